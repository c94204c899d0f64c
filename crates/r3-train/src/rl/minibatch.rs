//! One mini-batch update: forward with the update pass's routing, policy loss (PPO
//! clip-higher or GSPO, optional TIS/MIS weights), entropy bonus, then the guarded
//! backward + clip + AdamW step. A NaN/inf loss or gradient norm skips the step and
//! leaves weights and optimiser state untouched.

use std::time::Instant;

use candle_core::Tensor;
use r3_model::{ReplayProof, Routing};
use r3_routing::RouteTable;

use crate::algo::agg::LossAgg;
use crate::algo::logprob::{entropy_from_logits, masked_mean};
use crate::algo::loss::{
    policy_loss, ClipRange, PolicyLossInput, PolicyLossKind, PolicyLossMetrics,
};
use crate::algo::optim::AdamW;
use crate::algo::rollout_is::{rollout_is_weights, IsConfig};
use crate::algo::update::{backward_and_step_timed, GradHook, UpdateOutcome, UpdateTimes};
use crate::config::train::RouterReplay;
use crate::error::Result;
use crate::policy::trainable::{score, ResponseBatch, TrainablePolicy};
use crate::rl::diagnostics::verify_proof;

/// The data of one mini-batch.
#[derive(Debug)]
pub struct MiniBatch<'a> {
    /// Sequences of this mini-batch.
    pub batch: &'a ResponseBatch,
    /// `[b, W]` old log-probs, or `None` for single mini-step (the update forward is the
    /// old policy: old = current, detached).
    pub old_logp: Option<Tensor>,
    /// `[b, W]` rollout log-probs (for TIS/MIS).
    pub rollout_logp: Tensor,
    /// One advantage per sequence.
    pub advantages: Vec<f32>,
    /// Per-sequence loss weight (0 drops a sequence from the loss), `None` = all 1.
    pub row_weight: Option<Vec<f32>>,
    /// Routing of the update forward: `Replay` of the old pass's (R2) or the rollout's
    /// (R3) routes, `Record` for the single mini-step's diagnostics, or `Native`.
    pub routing: Routing<'a>,
}

/// Loss and optimiser settings of an update.
#[derive(Debug, Clone, Copy)]
pub struct UpdateSettings {
    /// PPO or GSPO.
    pub loss: PolicyLossKind,
    /// Ratio clip range of that loss.
    pub clip: ClipRange,
    /// Loss aggregation (PPO).
    pub agg: LossAgg,
    /// Importance-sampling correction.
    pub is: IsConfig,
    /// Entropy bonus coefficient.
    pub entropy_coef: f64,
    /// Learning rate of this step.
    pub lr: f64,
    /// Gradient-norm clip (0 = measure only).
    pub grad_clip: f64,
    /// The replay mode (names the mode in replay errors).
    pub mode: RouterReplay,
    /// Test hook on the clipped gradients before the AdamW step (`None` in real runs).
    pub grad_hook: Option<GradHook>,
}

/// What one mini-batch update did and saw.
#[derive(Debug)]
pub struct MiniBatchResult {
    /// Applied or skipped (and why).
    pub outcome: UpdateOutcome,
    /// Policy-loss statistics.
    pub loss_metrics: PolicyLossMetrics,
    /// `[b, W]` log-probs of the update forward, detached.
    pub logp: Tensor,
    /// Mean entropy over the response tokens.
    pub entropy: f32,
    /// Routes chosen by a `Record` forward.
    pub routes: Option<Vec<RouteTable>>,
    /// Proof of a `Replay` forward (verified).
    pub replay: Option<ReplayProof>,
    /// Verified fraction of a `Replay` forward.
    pub verified_frac: Option<f64>,
    /// Seconds of its forward (with the loss), backward and optimiser step.
    pub times: UpdateTimes,
}

/// Runs one mini-batch update on `policy` with `optimizer`.
pub fn update_minibatch(
    policy: &TrainablePolicy,
    optimizer: &mut AdamW,
    mb: &MiniBatch<'_>,
    s: &UpdateSettings,
) -> Result<MiniBatchResult> {
    let started = Instant::now();
    let model = policy.model()?;
    let scored = score(&model, mb.batch, mb.routing)?;
    let verified_frac = match (&scored.replay, mb.routing) {
        (Some(proof), Routing::Replay(routes)) => {
            Some(verify_proof(proof, routes.tables(), s.mode, "update")?)
        }
        _ => None,
    };
    let device = policy.device();
    let full_mask = mb.batch.response_mask(None, &device)?;
    let mask = match &mb.row_weight {
        Some(w) => mb.batch.response_mask(Some(w), &device)?,
        None => full_mask.clone(),
    };
    let old = match &mb.old_logp {
        Some(t) => t.clone(),
        None => scored.logp.detach(),
    };
    let is = rollout_is_weights(&old, &mb.rollout_logp, &mask, &s.is)?;
    let advantages = Tensor::from_slice(&mb.advantages, mb.advantages.len(), &device)?;
    let input = PolicyLossInput {
        logp: &scored.logp,
        old_logp: &old,
        advantages: &advantages,
        mask: &mask,
        is_weights: is.as_ref().map(|w| &w.weights),
    };
    let (mut loss, loss_metrics) = policy_loss(s.loss, &input, s.clip, s.agg)?;
    // Only an entropy bonus needs the entropy in the autograd graph.
    let entropy_tensor = match s.entropy_coef != 0.0 {
        true => entropy_from_logits(&scored.logits)?,
        false => entropy_from_logits(&scored.logits.detach())?,
    };
    let entropy = masked_mean(&entropy_tensor, &full_mask)?;
    if s.entropy_coef != 0.0 {
        let bonus = masked_mean(&entropy_tensor, &mask)?.affine(s.entropy_coef, 0.0)?;
        loss = loss.sub(&bonus)?;
    }
    let forward_s = started.elapsed().as_secs_f64();
    let (outcome, mut times) =
        backward_and_step_timed(optimizer, &loss, s.lr, s.grad_clip, s.grad_hook)?;
    times.forward_s = forward_s;
    Ok(MiniBatchResult {
        outcome,
        loss_metrics,
        logp: scored.logp.detach(),
        entropy: entropy.to_scalar::<f32>()?,
        routes: scored.routes,
        replay: scored.replay,
        verified_frac,
        times,
    })
}
