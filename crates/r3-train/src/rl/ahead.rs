//! One-step off-policy rollout (`rollout.async = true`): while step n's updates run on
//! the trainer, the fleet generates step n+1's batch on the weights step n started from
//! (version n − 1). Step n's weights reach the workers only after that batch is in, so no
//! request spans a weight update and every batch after the first is exactly one version
//! old — counted in `rollout.stale_frac` and bounded by `rollout.max_staleness`.
//!
//! The batch generated ahead lives only in memory: a checkpoint records the prompt
//! stream's position before its prompts, so a run resumed from it draws the same prompts
//! again and samples them on the checkpoint's weights.

use std::time::Instant;

use r3_fleet::{Fleet, RolloutStats};
use r3_rollout::GenerateRequest;
use r3_tasks::DatasetPosition;

use crate::error::Result;
use crate::rl::failed_groups::RequestOutcome;
use crate::rl::prompt_source::PromptItem;

/// A step's rollout generated during the step before it.
#[derive(Debug)]
pub struct AheadBatch {
    /// The step it is for.
    pub step: u64,
    /// Its prompts, drawn in the order the synchronous loop draws them.
    pub items: Vec<PromptItem>,
    /// The fleet's outcomes, group-major: a result per request, or the fleet's error (the
    /// trainer drops the groups of requests that failed for their own fault, and fails the
    /// step for any other failure).
    pub results: Vec<RequestOutcome>,
    /// What generating them cost.
    pub stats: RolloutStats,
    /// Wall seconds the fleet took.
    pub generate_s: f64,
    /// The prompt stream's position before its prompts were drawn (what a checkpoint
    /// records, so a resumed run draws them again).
    pub stream_pos: u128,
    /// The same for a dataset.
    pub dataset_position: Option<DatasetPosition>,
}

/// What the fleet generated while the step's updates ran: an outcome per request, their
/// cost and the wall seconds it took.
pub type Generated = (Vec<RequestOutcome>, RolloutStats, f64);

/// Runs `work` (the step's updates) on this thread while `fleet` generates `requests` on
/// another; both outcomes come back (a panic of the generating thread is resumed here).
pub fn generate_while<T>(
    fleet: &Fleet,
    requests: Vec<GenerateRequest>,
    work: impl FnOnce() -> T,
) -> (T, Result<Generated>) {
    std::thread::scope(|scope| {
        let generating = scope.spawn(move || {
            let started = Instant::now();
            // Per request, so one request's own failure costs the batch only its group.
            fleet
                .generate_each(requests)
                .map(|(outcomes, stats)| (outcomes, stats, started.elapsed().as_secs_f64()))
        });
        let done = work();
        match generating.join() {
            Ok(generated) => (done, generated.map_err(Into::into)),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}
