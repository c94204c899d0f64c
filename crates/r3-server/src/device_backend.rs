//! The device engine ([`DeviceEngine`], r3-model's layers on candle tensors: `r3 serve
//! --device cpu-candle | cuda`) behind the server's [`InferenceBackend`] seam, so every
//! endpoint, field policy, limit and security flag works on it as on the CPU engine. Its
//! prefix cache is reported and flushed as the CPU engine's; it builds new weights on the
//! engine thread; a `retract` pause sends its running requests back to the queue, their
//! keys and values released; `/release_memory_occupation` moves its weights to the host
//! and `/resume_memory_occupation` brings them back.

use std::path::Path;

use r3_rollout::error::RolloutError;
use r3_rollout::prefix_cache::PrefixCacheStats;
use r3_rollout::request::{GenerateRequest, GenerateResult, PartialRollout, RequestId};
use r3_rollout::DeviceEngine;

use crate::backend::{InferenceBackend, MemoryRegions, ModelSummary};

impl InferenceBackend for DeviceEngine {
    fn summary(&self) -> ModelSummary {
        ModelSummary::of(self.model_config(), self.eos_token_ids())
    }

    fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, RolloutError> {
        DeviceEngine::submit(self, req)
    }

    fn step(&mut self) -> Result<Vec<GenerateResult>, RolloutError> {
        DeviceEngine::step(self)
    }

    fn in_flight(&self) -> usize {
        let (waiting, running) = self.queue_lengths();
        // Results a failed step held back are handed out by the next step: one must run.
        waiting + running + self.held_results()
    }

    fn abort(&mut self, id: RequestId) -> Result<Option<PartialRollout>, RolloutError> {
        DeviceEngine::abort(self, id)
    }

    fn update_weights_from_dir(&mut self, dir: &Path) -> Result<u64, RolloutError> {
        DeviceEngine::update_weights_from_dir(self, dir)
    }

    fn weight_version(&self) -> u64 {
        DeviceEngine::weight_version(self)
    }

    fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        DeviceEngine::prefix_cache_stats(self)
    }

    fn flush_cache(&mut self) -> usize {
        DeviceEngine::flush_prefix_cache(self)
    }

    fn queue_lengths(&self) -> (usize, usize) {
        DeviceEngine::queue_lengths(self)
    }

    fn generated_tokens(&self, id: RequestId) -> Option<Vec<u32>> {
        DeviceEngine::generated_tokens(self, id).map(<[u32]>::to_vec)
    }

    fn retract_all(&mut self) -> usize {
        DeviceEngine::retract_all(self)
    }

    /// `weights`: moved to the host ([`DeviceEngine::offload_weights`]); `kv_cache`: the
    /// prefix cache emptied (a batch holds keys and values only while it runs). The memory
    /// pool then hands what it keeps unused back to the driver, so that another process —
    /// a trainer — can take it.
    fn release_memory(&mut self, regions: MemoryRegions) -> Result<Option<usize>, RolloutError> {
        if regions.kv_cache {
            self.flush_prefix_cache();
        }
        if regions.weights {
            self.offload_weights()?;
        }
        // The regions are released by now: a failed reading of the free memory must not
        // report the release as failed (the worker would then step an engine whose weights
        // are on the host, and refuse to resume them).
        match r3_model::device::device_memory(self.device()) {
            Ok(memory) => Ok(memory.map(|(free, _)| free)),
            Err(e) => {
                tracing::warn!(error = %e, "memory released; the device's free memory could not be read");
                Ok(None)
            }
        }
    }

    fn resume_memory(&mut self, regions: MemoryRegions) -> Result<(), RolloutError> {
        if regions.weights {
            self.onload_weights()?;
        }
        Ok(())
    }
}
