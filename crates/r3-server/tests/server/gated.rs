//! Any backend behind a gate the test opens: while it is closed, steps make no progress (the
//! requests in flight stay in flight however long the test takes), so a test can act on a
//! request that is certainly still running, and a request that ends while it is closed was
//! ended by the server (aborted), never by the engine.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use r3_rollout::prefix_cache::PrefixCacheStats;
use r3_rollout::{GenerateRequest, GenerateResult, PartialRollout, RequestId, RolloutError};
use r3_server::{InferenceBackend, MemoryRegions, ModelSummary, StagedWeights, WeightStager};

/// The test's side of the gate.
#[derive(Clone, Default)]
pub struct Gate(Arc<AtomicBool>);

impl Gate {
    /// A closed gate.
    pub fn closed() -> Self {
        Gate::default()
    }

    /// Lets the steps run from now on.
    pub fn open(&self) {
        self.0.store(true, Ordering::Release);
    }

    fn is_open(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Opens its gate when dropped: declared after a test's server, it lets the requests a
/// failed test left in flight finish, so the server's shutdown (which answers them first)
/// ends and the test fails instead of hanging.
pub struct OpenOnDrop(pub Gate);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// `inner`, stepping only once its gate is open.
pub struct Gated<B> {
    inner: B,
    gate: Gate,
}

impl<B: InferenceBackend> Gated<B> {
    pub fn new(inner: B, gate: Gate) -> Self {
        Gated { inner, gate }
    }
}

impl<B: InferenceBackend> InferenceBackend for Gated<B> {
    fn summary(&self) -> ModelSummary {
        self.inner.summary()
    }

    fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, RolloutError> {
        self.inner.submit(req)
    }

    fn step(&mut self) -> Result<Vec<GenerateResult>, RolloutError> {
        if !self.gate.is_open() {
            std::thread::sleep(Duration::from_millis(1));
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

/// Waits until `done` holds, checking every millisecond; panics with `what` after a minute
/// (a hang guard only: every wait here ends in milliseconds when the server behaves).
pub fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}
