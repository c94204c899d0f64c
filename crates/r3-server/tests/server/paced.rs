//! Any backend slowed to a steady pace: for tests that must act while a request is still
//! running (pause it, retract it, drop its client). On the fixture models a request of a
//! hundred tokens takes a few milliseconds, so under CPU contention the engine could finish
//! it before the server saw the test's next move; paced, n tokens take at least n steps of
//! `pace` whatever the machine's load.

use std::path::Path;
use std::time::Duration;

use r3_rollout::prefix_cache::PrefixCacheStats;
use r3_rollout::{GenerateRequest, GenerateResult, PartialRollout, RequestId, RolloutError};
use r3_server::{InferenceBackend, MemoryRegions, ModelSummary, StagedWeights, WeightStager};

/// `inner`, sleeping `pace` before every step that has requests in flight.
pub struct Paced<B> {
    inner: B,
    pace: Duration,
}

impl<B: InferenceBackend> Paced<B> {
    /// `inner` at one step per `pace` at most.
    pub fn new(inner: B, pace: Duration) -> Self {
        Paced { inner, pace }
    }
}

impl<B: InferenceBackend> InferenceBackend for Paced<B> {
    fn summary(&self) -> ModelSummary {
        self.inner.summary()
    }

    fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, RolloutError> {
        self.inner.submit(req)
    }

    fn step(&mut self) -> Result<Vec<GenerateResult>, RolloutError> {
        if self.inner.in_flight() > 0 {
            std::thread::sleep(self.pace);
        }
        self.inner.step()
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    fn abort(&mut self, id: RequestId) -> Result<Option<PartialRollout>, RolloutError> {
        self.inner.abort(id)
    }

    fn update_weights_from_dir(&mut self, dir: &Path) -> Result<u64, RolloutError> {
        self.inner.update_weights_from_dir(dir)
    }

    fn weight_version(&self) -> u64 {
        self.inner.weight_version()
    }

    fn weight_stager(&self) -> Option<WeightStager> {
        self.inner.weight_stager()
    }

    fn swap_weights(&mut self, staged: StagedWeights) -> Result<u64, RolloutError> {
        self.inner.swap_weights(staged)
    }

    fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        self.inner.prefix_cache_stats()
    }

    fn queue_lengths(&self) -> (usize, usize) {
        self.inner.queue_lengths()
    }

    fn generated_tokens(&self, id: RequestId) -> Option<Vec<u32>> {
        self.inner.generated_tokens(id)
    }

    fn flush_cache(&mut self) -> usize {
        self.inner.flush_cache()
    }

    fn retract_all(&mut self) -> usize {
        self.inner.retract_all()
    }

    fn release_memory(&mut self, regions: MemoryRegions) -> Result<Option<usize>, RolloutError> {
        self.inner.release_memory(regions)
    }

    fn resume_memory(&mut self, regions: MemoryRegions) -> Result<(), RolloutError> {
        self.inner.resume_memory(regions)
    }
}
