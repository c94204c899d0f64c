//! One mini-batch update: forward with the update pass's routing, policy loss (PPO
//! clip-higher or GSPO, optional TIS/MIS weights), entropy bonus, then the guarded
//! clip + AdamW step. A NaN/inf loss or gradient norm skips the step and leaves weights
//! and optimiser state untouched. With a token budget the mini-batch runs as micro-batches
//! (forward, partial loss over the whole mini-batch's denominators, backward, one at a
//! time), their gradients summed before the one step: the same update in bounded memory.

use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use r3_model::model::LayerRecompute;
use r3_model::precision::WeightGradients;
use r3_model::{Model, ReplayProof, ReplayRoutes, Routing, SharedLen};
use r3_routing::RouteTable;

use crate::algo::agg::{aggregate_with, AggNorm, LossAgg};
use crate::algo::logprob::scalar_f32;
use crate::algo::loss::{
    policy_loss_part, ClipRange, PolicyLossInput, PolicyLossKind, PolicyLossMetrics, PolicyLossSums,
};
use crate::algo::optim::AdamW;
use crate::algo::rollout_is::{rollout_is_weights, IsConfig, IsMetrics, IsSums};
use crate::algo::update::{guarded_step_timed, GradHook, SkipReason, UpdateOutcome, UpdateTimes};
use crate::config::train::RouterReplay;
use crate::error::Result;
use crate::policy::trainable::{score_with, ResponseBatch, ScoreOptions, TrainablePolicy};
use crate::rl::diagnostics::verify_proof;
use crate::rl::micro_batches::{
    backward_into, merge_proofs, pack_rows, pick_rows, place_rows, place_tables,
    recomputed_backward_into, GradientSums,
};

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
    /// Loss aggregation of the PPO loss, and of the entropy bonus under either loss (GSPO's
    /// own loss is always `seq-mean-token-mean`).
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
    /// Token budget of one micro-batch (rows × padded width, see
    /// [`crate::rl::micro_batches::pack_rows`]); 0 = the whole mini-batch in one forward.
    pub max_tokens_per_micro_batch: usize,
    /// Each update forward keeps only its layers' inputs and runs every layer again in the
    /// backward (activation checkpointing; the same gradients).
    pub gradient_checkpointing: bool,
    /// Each update forward's q and k heads are run again in the backward, the graph keeping
    /// the projections' outputs alone (`algo.selective_recompute`; the same gradients).
    pub selective_recompute: bool,
    /// Forwards compute the positions their sequences hold alike once, and micro-batches
    /// keep such sequences together (`algo.share_prefixes`).
    pub share_prefixes: bool,
    /// Score the head this many tokens at a time without keeping the logits
    /// (`algo.head_chunk_tokens`; 0: the logits kept whole).
    pub head_chunk_tokens: usize,
    /// In a 16-bit precision, each weight's gradient is kept in 16 bits from the moment it
    /// is complete, where that holds it exactly (`train.narrow_gradients`; the same update).
    pub narrow_gradients: bool,
    /// The gradients of weights held in bf16 are summed over the micro-batches in bf16,
    /// rounded stochastically (`train.grad_accum_dtype = "bf16"`); else in f32.
    pub bf16_gradient_sums: bool,
    /// The temperature the rollouts were sampled at (`rollout.temperature`): every update
    /// forward and old-log-prob pass scores the policy `softmax(logits / T)` they came
    /// from ([`ScoreOptions::temperature`]); 1: the raw logits.
    pub temperature: f32,
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
    /// TIS/MIS statistics over the mini-batch's (row-weighted) response tokens; `None`
    /// without an importance-sampling correction.
    pub is_metrics: Option<IsMetrics>,
    /// Routes chosen by a `Record` forward.
    pub routes: Option<Vec<RouteTable>>,
    /// Proof of a `Replay` forward (verified).
    pub replay: Option<ReplayProof>,
    /// Verified fraction of a `Replay` forward.
    pub verified_frac: Option<f64>,
    /// Per row of the mini-batch, what of it another row's computation stood for in its
    /// micro-batch's forward (`algo.share_prefixes`).
    pub shared_lens: Vec<SharedLen>,
    /// Seconds of its forwards (with the loss), backwards and optimiser step, summed over
    /// its micro-batches.
    pub times: UpdateTimes,
}

/// Runs one mini-batch update on `policy` with `optimizer`: one forward and backward per
/// micro-batch of `s.max_tokens_per_micro_batch` tokens, then one guarded step on the
/// summed gradients. One micro-batch (the mini-batch within the budget) computes exactly
/// what a single forward over the mini-batch does.
pub fn update_minibatch(
    policy: &TrainablePolicy,
    optimizer: &mut AdamW,
    mb: &MiniBatch<'_>,
    s: &UpdateSettings,
) -> Result<MiniBatchResult> {
    let mut model = policy.model()?;
    if s.narrow_gradients {
        // Each rounded weight's gradient leaves its op in 16 bits as written (no f32 copy
        // to check and narrow again).
        model.set_weight_gradients(WeightGradients::Narrow);
    }
    model.set_selective_recompute(s.selective_recompute);
    let device = policy.device();
    let n = mb.batch.len();
    let parts = pack_rows(
        mb.batch.sequences(),
        s.max_tokens_per_micro_batch,
        s.share_prefixes,
    );
    // The whole mini-batch's denominators: every micro-batch's loss and metrics use them.
    let full_mask = mb.batch.response_mask(None, &device)?;
    let mask = match &mb.row_weight {
        Some(w) => mb.batch.response_mask(Some(w), &device)?,
        None => full_mask.clone(),
    };
    let norm = AggNorm::of(&mask)?;
    let tokens = scalar_f32(&norm.tokens)?;
    let full_tokens = scalar_f32(&full_mask.sum_all()?.maximum(1e-8)?)?;
    // No token carries loss weight (dynamic sampling dropped every group): the forward
    // still gives the step's log-probs and routes, but there is no gradient to take, and an
    // AdamW step on zero gradients would still move the weights by its momentum and decay.
    let learnable = scalar_f32(&mask.sum_all()?)? > 0.0;
    drop((full_mask, mask));

    let mut acc = Accumulated {
        grads: learnable.then(GradStore::default),
        ..Accumulated::default()
    };
    if let [_] = parts.as_slice() {
        let started = Instant::now();
        let micro = micro_update(&model, mb, s, &norm, &device)?;
        acc.times.forward_s += started.elapsed().as_secs_f64();
        acc.add(
            micro,
            &(0..n).collect::<Vec<_>>(),
            optimizer,
            s.bf16_gradient_sums,
        )?;
    } else {
        for part in &parts {
            let started = Instant::now();
            let sub = mb.batch.subset(part)?;
            let width = sub.width();
            let routes: Option<ReplayRoutes> = match mb.routing {
                Routing::Replay(r) => Some(r.select(part)?),
                _ => None,
            };
            let sub_mb = MiniBatch {
                batch: &sub,
                old_logp: mb
                    .old_logp
                    .as_ref()
                    .map(|t| pick_rows(t, part, width))
                    .transpose()?,
                rollout_logp: pick_rows(&mb.rollout_logp, part, width)?,
                advantages: part.iter().map(|&r| mb.advantages[r]).collect(),
                row_weight: mb
                    .row_weight
                    .as_ref()
                    .map(|w| part.iter().map(|&r| w[r]).collect()),
                routing: match (&routes, mb.routing) {
                    (Some(r), _) => Routing::Replay(r),
                    (None, routing) => routing,
                },
            };
            let micro = micro_update(&model, &sub_mb, s, &norm, &device)?;
            acc.times.forward_s += started.elapsed().as_secs_f64();
            acc.add(micro, part, optimizer, s.bf16_gradient_sums)?;
        }
    }
    let Accumulated {
        loss,
        grads,
        sums,
        is_sums,
        entropy_sum,
        logp,
        routes,
        replay,
        mut shared_lens,
        mut times,
        backwards: _,
    } = acc;
    shared_lens.resize(n, SharedLen::default());
    let logp = match <[_; 1]>::try_from(logp) {
        Ok([(_, whole)]) => whole,
        Err(parts) => {
            let width = mb.batch.width();
            place_rows(&parts, n, width, &device)?
        }
    };
    let routes = match routes.is_empty() {
        true => None,
        false => Some(place_tables(routes, n)?),
    };
    let replay = match replay.is_empty() {
        true => None,
        false => Some(merge_proofs(replay, n)?),
    };
    let verified_frac = match (&replay, mb.routing) {
        (Some(proof), Routing::Replay(routes)) => {
            Some(verify_proof(proof, routes.tables(), s.mode, "update")?)
        }
        _ => None,
    };
    let loss = loss as f32;
    let outcome = match grads {
        _ if !learnable => {
            tracing::info!("no token of the mini-batch carries loss weight: update skipped");
            UpdateOutcome::Skipped {
                reason: SkipReason::NoLossTokens,
                loss,
                grad_norm: None,
            }
        }
        Some(grads) if loss.is_finite() => {
            let (outcome, optim_s) =
                guarded_step_timed(optimizer, loss, grads, s.lr, s.grad_clip, s.grad_hook)?;
            times.optim_s = optim_s;
            outcome
        }
        _ => {
            tracing::warn!(loss, "non-finite loss: update skipped");
            UpdateOutcome::Skipped {
                reason: SkipReason::NonFiniteLoss,
                loss,
                grad_norm: None,
            }
        }
    };
    Ok(MiniBatchResult {
        outcome,
        loss_metrics: sums.finish(tokens),
        logp,
        entropy: entropy_sum as f32 / full_tokens,
        is_metrics: is_sums.map(|s| s.finish(tokens)),
        routes,
        replay,
        verified_frac,
        shared_lens,
        times,
    })
}

/// What the micro-batches of an update have added up so far.
struct Accumulated {
    /// Sum of the partial loss values.
    loss: f64,
    /// Summed gradients of the optimiser's variables, detached; `None` once a partial loss
    /// is non-finite (the step is skipped, later backward passes would be wasted).
    grads: Option<GradStore>,
    sums: PolicyLossSums,
    /// The IS statistics' numerators (`None` without TIS/MIS).
    is_sums: Option<IsSums>,
    /// `Σ entropy` over the response tokens (row weights ignored, as the metric).
    entropy_sum: f64,
    logp: Vec<(Vec<usize>, Tensor)>,
    routes: Vec<(Vec<usize>, Vec<RouteTable>)>,
    replay: Vec<(Vec<usize>, ReplayProof)>,
    /// Per row of the mini-batch, what of it another row stood for, as the micro-batches so
    /// far found them.
    shared_lens: Vec<SharedLen>,
    /// Seconds of the forwards and backwards so far.
    times: UpdateTimes,
    /// Backwards added so far (which sum of the update the next one makes).
    backwards: u64,
}

impl Default for Accumulated {
    fn default() -> Self {
        Self {
            loss: 0.0,
            grads: Some(GradStore::default()),
            sums: PolicyLossSums::default(),
            is_sums: None,
            entropy_sum: 0.0,
            logp: Vec::new(),
            routes: Vec::new(),
            replay: Vec::new(),
            shared_lens: Vec::new(),
            times: UpdateTimes::default(),
            backwards: 0,
        }
    }
}

impl Accumulated {
    /// Adds micro-batch `micro` of rows `rows`: its backward (unless the loss is already
    /// non-finite) into the gradients of `optimizer`'s variables (bf16 variables' sums held
    /// in bf16 with `bf16_sums`), then drops its graph.
    fn add(
        &mut self,
        micro: Micro<'_>,
        rows: &[usize],
        optimizer: &AdamW,
        bf16_sums: bool,
    ) -> Result<()> {
        let value = scalar_f32(&micro.loss)?;
        self.loss += f64::from(value);
        match (self.grads.as_mut(), value.is_finite()) {
            (Some(acc), true) => {
                let started = Instant::now();
                let sums = match bf16_sums {
                    // The update these gradients are for is the optimiser's next step.
                    true => GradientSums::Bf16 {
                        seed: optimizer.rounding_seed(),
                        step: optimizer.step_count() + 1,
                        micro: self.backwards,
                    },
                    false => GradientSums::F32,
                };
                let vars = || optimizer.vars().map(|(_, v)| v);
                let device = micro.loss.device().clone();
                match micro.layers {
                    // Each gradient (each part, recomputing) added to its sum as the backward
                    // completes it; the loss handed over, so its graph (the head's logits)
                    // goes before the layers run again.
                    Some(layers) => {
                        recomputed_backward_into(layers, micro.loss, acc, vars(), sums)?
                    }
                    None => backward_into(&micro.loss, acc, vars(), sums, micro.narrow_grads)?,
                }
                // On a GPU the backward's kernels are queued, not done: waiting here makes
                // `backward_s` the backward's own time (it had flowed into the next read-back,
                // the optimiser's or the next micro-batch's). A no-op on the CPU.
                device.synchronize()?;
                self.backwards += 1;
                self.times.backward_s += started.elapsed().as_secs_f64();
            }
            _ => self.grads = None,
        }
        self.sums.add(&micro.sums);
        if let Some(is) = micro.is_sums {
            self.is_sums.get_or_insert_default().add(&is);
        }
        self.entropy_sum += micro.entropy_sum;
        for (&row, &len) in rows.iter().zip(&micro.shared_lens) {
            if self.shared_lens.len() <= row {
                self.shared_lens.resize(row + 1, SharedLen::default());
            }
            self.shared_lens[row] = len;
        }
        self.logp.push((rows.to_vec(), micro.logp));
        if let Some(r) = micro.routes {
            self.routes.push((rows.to_vec(), r));
        }
        if let Some(p) = micro.replay {
            self.replay.push((rows.to_vec(), p));
        }
        Ok(())
    }
}

/// One micro-batch's forward and partial loss.
struct Micro<'m> {
    /// Partial loss (with its graph): its rows' share of the mini-batch's loss.
    loss: Tensor,
    /// With gradient checkpointing, the layers the backward runs again.
    layers: Option<LayerRecompute<'m>>,
    /// The 16-bit dtype the backward keeps the weights' gradients in where exact
    /// (`narrow_gradients` in a 16-bit precision).
    narrow_grads: Option<DType>,
    sums: PolicyLossSums,
    is_sums: Option<IsSums>,
    entropy_sum: f64,
    /// `[rows, w]` log-probs, detached.
    logp: Tensor,
    routes: Option<Vec<RouteTable>>,
    replay: Option<ReplayProof>,
    shared_lens: Vec<SharedLen>,
}

/// Forward over `mb` (a whole mini-batch or one micro-batch of it) and its partial loss
/// over the mini-batch's denominators `norm`.
fn micro_update<'m>(
    model: &'m Model,
    mb: &MiniBatch<'_>,
    s: &UpdateSettings,
    norm: &AggNorm,
    device: &Device,
) -> Result<Micro<'m>> {
    let options = ScoreOptions {
        recompute: s.gradient_checkpointing,
        share_prefixes: s.share_prefixes,
        head_chunk_tokens: s.head_chunk_tokens,
        entropy_grad: s.entropy_coef != 0.0,
        temperature: s.temperature,
    };
    let (scored, layers) = score_with(model, mb.batch, mb.routing, options)?;
    let narrow_grads = model
        .precision()
        .narrow_dtype()
        .filter(|_| s.narrow_gradients);
    let layers = match (layers, narrow_grads) {
        (Some(layers), Some(narrow)) => Some(layers.keep_gradients_narrow(narrow)),
        (layers, _) => layers,
    };
    let full_mask = mb.batch.response_mask(None, device)?;
    let mask = match &mb.row_weight {
        Some(w) => mb.batch.response_mask(Some(w), device)?,
        None => full_mask.clone(),
    };
    let old = match &mb.old_logp {
        Some(t) => t.clone(),
        None => scored.logp.detach(),
    };
    let is = rollout_is_weights(&old, &mb.rollout_logp, &mask, &s.is)?;
    let advantages = Tensor::from_slice(&mb.advantages, mb.advantages.len(), device)?;
    let input = PolicyLossInput {
        logp: &scored.logp,
        old_logp: &old,
        advantages: &advantages,
        mask: &mask,
        is_weights: is.as_ref().map(|w| &w.weights),
    };
    let (mut loss, sums) = policy_loss_part(s.loss, &input, s.clip, s.agg, norm)?;
    // Only an entropy bonus needs the entropy in the autograd graph.
    let entropy_tensor = scored.entropy(s.entropy_coef != 0.0)?;
    let entropy_sum = scalar_f32(&entropy_tensor.detach().mul(&full_mask)?.sum_all()?)?;
    if s.entropy_coef != 0.0 {
        // Aggregated like the loss (`algo.loss_agg`, as verl's dp_actor `agg_loss` of the
        // entropy) over the whole mini-batch's denominators: this micro-batch's share.
        let bonus =
            aggregate_with(&entropy_tensor, &mask, s.agg, norm)?.affine(s.entropy_coef, 0.0)?;
        loss = loss.sub(&bonus)?;
    }
    Ok(Micro {
        loss,
        layers,
        narrow_grads,
        sums,
        is_sums: is.map(|w| w.sums),
        entropy_sum: f64::from(entropy_sum),
        logp: scored.logp.detach(),
        routes: scored.routes,
        replay: scored.replay,
        shared_lens: scored.shared_lens,
    })
}
