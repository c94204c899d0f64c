//! Any backend with a hook before each step ([`Hooked`]); [`Paced`] slows it to a steady pace: for tests that must act while a request is still
//! running (pause it, retract it, drop its client). On the fixture models a request of a
//! hundred tokens takes a few milliseconds, so under CPU contention the engine could finish
//! it before the server saw the test's next move; paced, n tokens take at least n steps of
//! `pace` whatever the machine's load.

use std::path::Path;
use std::time::Duration;

use r3_rollout::prefix_cache::PrefixCacheStats;
use r3_rollout::{GenerateRequest, GenerateResult, PartialRollout, RequestId, RolloutError};
use r3_server::{InferenceBackend, MemoryRegions, ModelSummary, StagedWeights, WeightStager};

/// What a [`Hooked`] backend does before each step: `true` lets the step run, `false` makes
/// it a step with no results (the requests in flight stay in flight).
pub trait BeforeStep {
    fn before_step(&mut self, in_flight: usize) -> bool;
}

/// A pace: sleeps its duration before every step that has requests in flight.
pub struct Pace(pub Duration);

impl BeforeStep for Pace {
    fn before_step(&mut self, in_flight: usize) -> bool {
        if in_flight > 0 {
            std::thread::sleep(self.0);
        }
        true
    }
}

/// `inner` with `hook` run before each of its steps; everything else is `inner`'s own.
pub struct Hooked<B, H> {
    inner: B,
    hook: H,
}

/// `inner`, sleeping its pace before every step that has requests in flight.
pub type Paced<B> = Hooked<B, Pace>;

impl<B: InferenceBackend> Hooked<B, Pace> {
    /// `inner` at one step per `pace` at most.
    pub fn new(inner: B, pace: Duration) -> Self {
        Hooked {
            inner,
            hook: Pace(pace),
        }
    }
}

impl<B: InferenceBackend, H> Hooked<B, H> {
    /// `inner` with `hook` before each step.
    pub fn with_hook(inner: B, hook: H) -> Self {
        Hooked { inner, hook }
    }
}

impl<B: InferenceBackend, H: BeforeStep + Send + 'static> InferenceBackend for Hooked<B, H> {
    fn summary(&self) -> ModelSummary {
        self.inner.summary()
    }

    fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, RolloutError> {
        self.inner.submit(req)
    }

    fn step(&mut self) -> Result<Vec<GenerateResult>, RolloutError> {
        if !self.hook.before_step(self.inner.in_flight()) {
            return Ok(Vec::new());
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
