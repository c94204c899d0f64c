//! One guarded optimiser update: backward, NaN/inf check, gradient clipping, AdamW step.
//! A non-finite loss or gradient norm, or an AdamW step that would leave a parameter or
//! moment non-finite (or a parameter past the rollout precision's range), skips the update and leaves the weights and the optimiser state
//! untouched, so the loop can report it (`update.skipped`) and carry on. The timed forms
//! also return the seconds of the backward and the optimiser step, for the step's timings.

use std::time::Instant;

use crate::algo::grad_clip::{measure_grad_norm, scale_grads, GradNorm};
use crate::algo::logprob::scalar_f32;
use crate::algo::optim::{AdamW, AdamWStep};
use crate::error::Result;
use candle_core::backprop::GradStore;
use candle_core::Tensor;
use serde::{Deserialize, Serialize};

/// Why an update was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// The loss was NaN or infinite.
    NonFiniteLoss,
    /// The global gradient norm was NaN or infinite.
    NonFiniteGradNorm,
    /// The AdamW step would have left a parameter or moment NaN or infinite.
    NonFiniteUpdate,
    /// The AdamW step would have left a parameter past the finite range of the rollout
    /// precision (a checkpoint or sync of it could not be served).
    OutOfPrecisionRange,
    /// No token of the mini-batch carried loss weight (dynamic sampling dropped every
    /// group): there was nothing to learn, and no step was taken.
    NoLossTokens,
}

/// Edits the (clipped) gradients just before the AdamW step; tests pass one to inject what
/// the loss and gradient-norm guards would not see.
pub type GradHook = fn(&AdamW, &mut GradStore) -> Result<()>;

/// What happened to one update.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum UpdateOutcome {
    /// Weights were updated.
    Applied {
        /// Loss value.
        loss: f32,
        /// Gradient norm before clipping and the clip scale.
        grad_norm: GradNorm,
        /// Learning rate used.
        lr: f64,
    },
    /// Weights and optimiser state were left untouched.
    Skipped {
        /// Why.
        reason: SkipReason,
        /// Loss value (may be NaN).
        loss: f32,
        /// Gradient norm, when it was computed.
        grad_norm: Option<f32>,
    },
}

impl UpdateOutcome {
    /// Whether the weights changed.
    pub fn applied(&self) -> bool {
        matches!(self, UpdateOutcome::Applied { .. })
    }
}

/// Seconds one update spent in each of its parts (wall time; on a GPU, queued kernels
/// land in the part that next waits for them).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct UpdateTimes {
    /// The forward pass and the loss.
    pub forward_s: f64,
    /// The backward pass.
    pub backward_s: f64,
    /// The guarded optimiser step: gradient clipping, the checks and AdamW.
    pub optim_s: f64,
}

impl std::ops::AddAssign for UpdateTimes {
    fn add_assign(&mut self, other: Self) {
        self.forward_s += other.forward_s;
        self.backward_s += other.backward_s;
        self.optim_s += other.optim_s;
    }
}

/// Steps with precomputed gradients (e.g. accumulated over micro-batches) whose summed loss
/// value was `loss`.
pub fn guarded_step(
    opt: &mut AdamW,
    loss: f32,
    grads: GradStore,
    lr: f64,
    max_grad_norm: f64,
) -> Result<UpdateOutcome> {
    guarded_step_with(opt, loss, grads, lr, max_grad_norm, None)
}

/// [`guarded_step`] with an optional [`GradHook`] run on the clipped gradients.
pub fn guarded_step_with(
    opt: &mut AdamW,
    loss: f32,
    grads: GradStore,
    lr: f64,
    max_grad_norm: f64,
    hook: Option<GradHook>,
) -> Result<UpdateOutcome> {
    Ok(guarded_step_timed(opt, loss, grads, lr, max_grad_norm, hook)?.0)
}

/// [`guarded_step_with`], also returning its seconds (clipping, checks and AdamW: the
/// optimiser part of [`UpdateTimes`]).
pub fn guarded_step_timed(
    opt: &mut AdamW,
    loss: f32,
    grads: GradStore,
    lr: f64,
    max_grad_norm: f64,
    hook: Option<GradHook>,
) -> Result<(UpdateOutcome, f64)> {
    let started = Instant::now();
    let outcome = guarded(opt, loss, grads, lr, max_grad_norm, hook)?;
    Ok((outcome, started.elapsed().as_secs_f64()))
}

fn guarded(
    opt: &mut AdamW,
    loss: f32,
    mut grads: GradStore,
    lr: f64,
    max_grad_norm: f64,
    hook: Option<GradHook>,
) -> Result<UpdateOutcome> {
    if !loss.is_finite() {
        return Ok(UpdateOutcome::Skipped {
            reason: SkipReason::NonFiniteLoss,
            loss,
            grad_norm: None,
        });
    }
    let vars: Vec<_> = opt.vars().map(|(_, v)| v.clone()).collect();
    let grad_norm = measure_grad_norm(vars.iter(), &grads, max_grad_norm)?;
    if !grad_norm.is_finite() {
        tracing::warn!(
            loss,
            grad_norm = grad_norm.norm,
            "non-finite gradient norm: update skipped"
        );
        return Ok(UpdateOutcome::Skipped {
            reason: SkipReason::NonFiniteGradNorm,
            loss,
            grad_norm: Some(grad_norm.norm),
        });
    }
    // The clip factor is folded into the optimiser's pass; a hook sees the clipped gradients.
    let mut grad_scale = (grad_norm.scale != 1.0).then_some(grad_norm.scale);
    if let Some(hook) = hook {
        if let Some(scale) = grad_scale.take() {
            scale_grads(vars.iter(), &mut grads, scale)?;
        }
        hook(opt, &mut grads)?;
    }
    let reason = match opt.step_scaled(&grads, lr, grad_scale)? {
        AdamWStep::Applied => None,
        AdamWStep::NonFinite { variable, what } => {
            tracing::warn!(
                loss,
                lr,
                variable = %variable,
                what,
                "the update would make weights non-finite: skipped, weights and optimiser kept"
            );
            Some(SkipReason::NonFiniteUpdate)
        }
        AdamWStep::OutOfRange {
            variable,
            value,
            precision,
        } => {
            tracing::warn!(
                loss,
                lr,
                variable = %variable,
                value,
                %precision,
                "the update would leave a weight past the rollout precision's finite range: \
                 skipped, weights and optimiser kept"
            );
            Some(SkipReason::OutOfPrecisionRange)
        }
    };
    if let Some(reason) = reason {
        return Ok(UpdateOutcome::Skipped {
            reason,
            loss,
            grad_norm: Some(grad_norm.norm),
        });
    }
    Ok(UpdateOutcome::Applied {
        loss,
        grad_norm,
        lr,
    })
}

/// Backward of a scalar `loss`, then [`guarded_step`]. A non-finite loss skips before the
/// backward pass.
pub fn backward_and_step(
    opt: &mut AdamW,
    loss: &Tensor,
    lr: f64,
    max_grad_norm: f64,
) -> Result<UpdateOutcome> {
    backward_and_step_with(opt, loss, lr, max_grad_norm, None)
}

/// [`backward_and_step`] with an optional [`GradHook`] run on the clipped gradients.
pub fn backward_and_step_with(
    opt: &mut AdamW,
    loss: &Tensor,
    lr: f64,
    max_grad_norm: f64,
    hook: Option<GradHook>,
) -> Result<UpdateOutcome> {
    Ok(backward_and_step_timed(opt, loss, lr, max_grad_norm, hook)?.0)
}

/// [`backward_and_step_with`], also returning the seconds of its backward and optimiser
/// parts (the forward's is the caller's to fill).
pub fn backward_and_step_timed(
    opt: &mut AdamW,
    loss: &Tensor,
    lr: f64,
    max_grad_norm: f64,
    hook: Option<GradHook>,
) -> Result<(UpdateOutcome, UpdateTimes)> {
    let started = Instant::now();
    let value = scalar_f32(loss)?;
    if !value.is_finite() {
        tracing::warn!(loss = value, "non-finite loss: update skipped");
        let skipped = UpdateOutcome::Skipped {
            reason: SkipReason::NonFiniteLoss,
            loss: value,
            grad_norm: None,
        };
        return Ok((skipped, UpdateTimes::default()));
    }
    let grads = loss.backward()?;
    let backward_s = started.elapsed().as_secs_f64();
    let (outcome, optim_s) = guarded_step_timed(opt, value, grads, lr, max_grad_norm, hook)?;
    let times = UpdateTimes {
        forward_s: 0.0,
        backward_s,
        optim_s,
    };
    Ok((outcome, times))
}
