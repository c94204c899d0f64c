//! The seam between the HTTP server and the engine: a small trait the engine worker drives,
//! implemented by [`Engine`] and by test doubles, plus what the server needs to know about
//! the model to validate requests and encode routes.

use std::path::{Path, PathBuf};

use r3_routing::LayerLayout;

use super::weights_update::WeightStager;
use r3_rollout::engine::Engine;
use r3_rollout::error::RolloutError;
use r3_rollout::model::weights::ModelWeights;
use r3_rollout::prefix_cache::PrefixCacheStats;
use r3_rollout::request::{GenerateRequest, GenerateResult, PartialRollout, RequestId};

/// What the server knows about the served model (fixed for the server's lifetime).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSummary {
    /// HF `model_type` (e.g. `qwen3_moe`).
    pub model_type: String,
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// Prompt plus generated tokens may not exceed this.
    pub max_position_embeddings: usize,
    /// Which transformer layers are MoE (the SGLang wire carries all `num_hidden_layers`).
    pub layout: LayerLayout,
    /// Experts per token per MoE layer.
    pub top_k: usize,
    /// Logical experts per MoE layer.
    pub num_experts: usize,
    /// `eos_token_id`(s) of config.json; generation stops on them unless `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
}

impl ModelSummary {
    /// The summary of a model config and its eos ids.
    pub fn of(cfg: &r3_model::Config, eos_token_ids: &[u32]) -> Self {
        ModelSummary {
            model_type: cfg.architecture.model_type().to_string(),
            vocab_size: cfg.vocab_size,
            max_position_embeddings: cfg.max_position_embeddings,
            layout: cfg.layer_layout().clone(),
            top_k: cfg.top_k(),
            num_experts: cfg.num_experts(),
            eos_token_ids: eos_token_ids.to_vec(),
        }
    }
}

/// Regions of the engine's memory that `/release_memory_occupation` lets go and
/// `/resume_memory_occupation` takes back (SGLang's tags).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryRegions {
    /// The model's weights (`weights`).
    pub weights: bool,
    /// The KV cache (`kv_cache`): the prefix cache's blocks; no request runs meanwhile.
    pub kv_cache: bool,
    /// Captured CUDA graphs (`cuda_graph`): r3 captures none, so there is nothing to let go.
    pub cuda_graph: bool,
}

impl MemoryRegions {
    /// The tags clients name, in SGLang's spelling.
    pub const TAGS: [&'static str; 3] = ["kv_cache", "weights", "cuda_graph"];

    /// Every region.
    pub const ALL: MemoryRegions = MemoryRegions {
        weights: true,
        kv_cache: true,
        cuda_graph: true,
    };

    /// The regions `tags` name; none or an empty list is every region (as SGLang). An
    /// unknown tag is refused, naming it and the known ones.
    pub fn from_tags(tags: Option<&[String]>) -> Result<Self, String> {
        let Some(tags) = tags.filter(|t| !t.is_empty()) else {
            return Ok(MemoryRegions::ALL);
        };
        let mut regions = MemoryRegions::default();
        for tag in tags {
            let flag = match tag.as_str() {
                "weights" => &mut regions.weights,
                "kv_cache" => &mut regions.kv_cache,
                "cuda_graph" => &mut regions.cuda_graph,
                other => {
                    return Err(format!(
                        "tag {other:?} is not one of {}",
                        MemoryRegions::TAGS.join(", ")
                    ))
                }
            };
            *flag = true;
        }
        Ok(regions)
    }

    /// The tags of the regions held, in [`MemoryRegions::TAGS`]' order.
    pub fn tags(self) -> Vec<&'static str> {
        let held = [self.kv_cache, self.weights, self.cuda_graph];
        MemoryRegions::TAGS
            .into_iter()
            .zip(held)
            .filter_map(|(tag, on)| on.then_some(tag))
            .collect()
    }

    /// Whether no region is held.
    pub fn is_empty(self) -> bool {
        !(self.weights || self.kv_cache || self.cuda_graph)
    }

    /// Whether a step would use what is held: the weights or the KV cache (r3 captures no
    /// CUDA graphs, so a `cuda_graph` left released — as clients that resume only
    /// `weights` and `kv_cache` leave it — holds nothing back).
    pub fn holds_steps(self) -> bool {
        self.weights || self.kv_cache
    }

    /// The regions of either.
    pub fn union(self, other: MemoryRegions) -> MemoryRegions {
        MemoryRegions {
            weights: self.weights || other.weights,
            kv_cache: self.kv_cache || other.kv_cache,
            cuda_graph: self.cuda_graph || other.cuda_graph,
        }
    }

    /// The regions of `self` that `other` does not hold.
    pub fn without(self, other: MemoryRegions) -> MemoryRegions {
        MemoryRegions {
            weights: self.weights && !other.weights,
            kv_cache: self.kv_cache && !other.kv_cache,
            cuda_graph: self.cuda_graph && !other.cuda_graph,
        }
    }
}

/// New weights on their way to the engine worker: the checked directory, and the weights
/// already built from it when the backend has a [`WeightStager`].
#[derive(Debug)]
pub struct StagedWeights {
    /// The directory the weights come from (canonical, under the weights root).
    pub dir: PathBuf,
    /// Engine weights built on a loader thread; None: the backend loads `dir` itself.
    pub weights: Option<ModelWeights>,
}

/// A batched generation engine the server's worker thread drives: requests are submitted
/// between steps and finish in later steps (continuous batching).
pub trait InferenceBackend: Send + 'static {
    /// Facts about the served model.
    fn summary(&self) -> ModelSummary;
    /// Validates and queues a request; it joins the batch at the next step.
    fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, RolloutError>;
    /// Runs one batched step; returns the requests that finished in it.
    fn step(&mut self) -> Result<Vec<GenerateResult>, RolloutError>;
    /// Requests queued or running.
    fn in_flight(&self) -> usize;
    /// Stops a request; what it produced so far, or None if unknown/finished.
    fn abort(&mut self, id: RequestId) -> Result<Option<PartialRollout>, RolloutError>;
    /// Loads new weights from a safetensors directory; returns the new weight version.
    fn update_weights_from_dir(&mut self, dir: &Path) -> Result<u64, RolloutError>;
    /// Current weight version.
    fn weight_version(&self) -> u64;
    /// What builds this backend's weights away from its thread, so it keeps serving while
    /// a checkpoint is read; None: [`InferenceBackend::swap_weights`] loads on the engine
    /// thread.
    fn weight_stager(&self) -> Option<WeightStager> {
        None
    }
    /// Puts staged weights in place; returns the new weight version. Without built weights
    /// it loads `staged.dir` with [`InferenceBackend::update_weights_from_dir`].
    fn swap_weights(&mut self, staged: StagedWeights) -> Result<u64, RolloutError> {
        self.update_weights_from_dir(&staged.dir)
    }
    /// Prefix cache counters, if the backend has a prefix cache.
    fn prefix_cache_stats(&self) -> Option<PrefixCacheStats>;
    /// Requests waiting for admission and requests running.
    fn queue_lengths(&self) -> (usize, usize) {
        (0, self.in_flight())
    }
    /// Tokens a waiting or running request generated so far (for stop strings); None if
    /// unknown. A backend without it only matches stop strings when a request finishes.
    fn generated_tokens(&self, _id: RequestId) -> Option<Vec<u32>> {
        None
    }
    /// Empties the prefix cache; returns how many blocks it released.
    fn flush_cache(&mut self) -> usize {
        0
    }
    /// Sends every running request back to the queue, releasing its KV; it is re-prefilled
    /// when next admitted (`/pause_generation` mode `retract`). Returns how many. A backend
    /// without it keeps its requests where they are.
    fn retract_all(&mut self) -> usize {
        0
    }
    /// Lets go of the memory `regions` hold (the worker has checked that no request runs
    /// and runs no step until they are taken back); returns the device's free bytes after,
    /// where the backend has a device. By default the prefix cache is emptied for
    /// `kv_cache` and nothing else changes: an engine on the host holds no device memory.
    fn release_memory(&mut self, regions: MemoryRegions) -> Result<Option<usize>, RolloutError> {
        if regions.kv_cache {
            self.flush_cache();
        }
        Ok(None)
    }
    /// Takes back what [`InferenceBackend::release_memory`] let go of `regions`; by default
    /// there is nothing to take back.
    fn resume_memory(&mut self, _regions: MemoryRegions) -> Result<(), RolloutError> {
        Ok(())
    }
}

impl InferenceBackend for Engine {
    fn summary(&self) -> ModelSummary {
        ModelSummary::of(self.model_config(), self.eos_token_ids())
    }

    fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, RolloutError> {
        Engine::submit(self, req)
    }

    fn step(&mut self) -> Result<Vec<GenerateResult>, RolloutError> {
        Engine::step(self)
    }

    fn in_flight(&self) -> usize {
        let (waiting, running) = self.queue_lengths();
        waiting + running
    }

    fn abort(&mut self, id: RequestId) -> Result<Option<PartialRollout>, RolloutError> {
        Engine::abort(self, id)
    }

    fn update_weights_from_dir(&mut self, dir: &Path) -> Result<u64, RolloutError> {
        Engine::update_weights_from_dir(self, dir)
    }

    fn weight_version(&self) -> u64 {
        Engine::weight_version(self)
    }

    fn weight_stager(&self) -> Option<WeightStager> {
        Some(
            WeightStager::new(self.model_config().clone(), self.engine_config().dtype)
                .with_router_dtype(self.engine_config().router_dtype),
        )
    }

    fn swap_weights(&mut self, staged: StagedWeights) -> Result<u64, RolloutError> {
        match staged.weights {
            Some(weights) => Ok(Engine::swap_weights(self, weights)),
            None => Engine::update_weights_from_dir(self, &staged.dir),
        }
    }

    fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        Engine::prefix_cache_stats(self)
    }

    fn queue_lengths(&self) -> (usize, usize) {
        Engine::queue_lengths(self)
    }

    fn generated_tokens(&self, id: RequestId) -> Option<Vec<u32>> {
        Engine::generated_tokens(self, id).map(<[u32]>::to_vec)
    }

    fn flush_cache(&mut self) -> usize {
        Engine::flush_prefix_cache(self)
    }

    fn retract_all(&mut self) -> usize {
        Engine::retract_all(self)
    }
}
