//! Policy-gradient losses in the style of verl's `core_algos.py`: each a pure function of
//! shape-documented tensors returning `(loss, metrics)`.
//!
//! * PPO clip with separate `ε_low` / `ε_high` (clip-higher, DAPO): per-token ratio
//!   `r_t = exp(logp_t − old_t)`, loss `max(−A·r_t, −A·clip(r_t, 1−ε_low, 1+ε_high))`.
//! * GSPO: sequence ratio `s_i = exp(mean_t(logp_t − old_t))`, used per token as
//!   `s_{i,t} = sg[s_i] · π(y_t) / sg[π(y_t)]` (equal to `s_i` in value, gradient
//!   `s_i · ∇logp_t`), clipped with GSPO's own tiny ε and averaged per sequence.
//!
//! Inputs (all f32, `B` sequences × `T` positions): `logp` carries the gradient; `old_logp`
//! and `is_weights` are detached here; `advantages` is `[B]` (broadcast over tokens) or
//! `[B, T]`; `mask` is 1.0 on response tokens.

use crate::algo::agg::{aggregate, LossAgg};
use crate::algo::logprob::{check_bt, masked_mean, scalar_f32};
use crate::error::{Result, TrainError};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};

/// Log-ratio clamp of PPO (as verl) so `exp` never overflows.
const PPO_LOG_RATIO_LIMIT: f64 = 20.0;
/// Upper clamp of GSPO's log sequence ratio (as verl).
const GSPO_LOG_RATIO_MAX: f64 = 10.0;

/// Which policy loss to optimise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PolicyLossKind {
    /// Token-level PPO clip (GRPO / DAPO clip-higher).
    #[default]
    Ppo,
    /// Sequence-level ratio (GSPO).
    Gspo,
}

/// Clip range `[1 − low, 1 + high]` of the importance ratio.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ClipRange {
    /// `ε_low`.
    pub low: f64,
    /// `ε_high`.
    pub high: f64,
}

/// The tensors a policy loss reads.
#[derive(Debug, Clone, Copy)]
pub struct PolicyLossInput<'a> {
    /// Current-policy log-probs of the response tokens, `[B, T]`, with gradient.
    pub logp: &'a Tensor,
    /// Old-policy log-probs, `[B, T]` (detached by the loss).
    pub old_logp: &'a Tensor,
    /// Advantages, `[B]` or `[B, T]`.
    pub advantages: &'a Tensor,
    /// 1.0 on response tokens, 0.0 on prompt and padding, `[B, T]`.
    pub mask: &'a Tensor,
    /// Optional importance weights (TIS/MIS), `[B, T]`, multiplied into the per-token loss.
    pub is_weights: Option<&'a Tensor>,
}

/// Numbers describing one policy-loss evaluation (means over response tokens).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PolicyLossMetrics {
    /// The aggregated loss value.
    pub pg_loss: f32,
    /// Fraction of tokens where the clipped branch was taken.
    pub clip_frac: f32,
    /// Fraction clipped with ratio below 1 (negative advantage, `1 − ε_low` edge).
    pub clip_frac_low: f32,
    /// Fraction clipped with ratio above 1 (positive advantage, `1 + ε_high` edge).
    pub clip_frac_high: f32,
    /// Mean of `old − new` log-prob (k1 estimate of KL(old ‖ new)).
    pub ppo_kl: f32,
    /// Mean of `r − 1 − log r` with `r = new/old` (k3 estimate of KL(old ‖ new), ≥ 0).
    pub ppo_kl_k3: f32,
    /// Mean importance ratio used in the loss (token ratio for PPO, sequence ratio for GSPO).
    pub ratio_mean: f32,
}

struct Checked {
    adv: Tensor,
    old: Tensor,
}

fn check_inputs(input: &PolicyLossInput) -> Result<Checked> {
    let (b, t) = input
        .logp
        .dims2()
        .map_err(|_| TrainError::shape("logp", input.logp.dims(), "[B, T]"))?;
    check_bt("logp", input.logp, b, t)?;
    check_bt("old_logp", input.old_logp, b, t)?;
    check_bt("mask", input.mask, b, t)?;
    if let Some(w) = input.is_weights {
        check_bt("is_weights", w, b, t)?;
    }
    let adv = match input.advantages.dims() {
        [bb] if *bb == b => input.advantages.unsqueeze(1)?.broadcast_as((b, t))?,
        [bb, tt] if *bb == b && *tt == t => input.advantages.clone(),
        other => {
            return Err(TrainError::shape(
                "advantages",
                other,
                format!("[{b}] or [{b}, {t}]"),
            ))
        }
    };
    Ok(Checked {
        adv: adv.detach(),
        old: input.old_logp.detach(),
    })
}

/// Shared clipped surrogate: per-token `max(−A·ρ, −A·clip(ρ))`, IS-weighted, aggregated.
fn clipped_surrogate(
    ratio: &Tensor,
    adv: &Tensor,
    input: &PolicyLossInput,
    clip: ClipRange,
    agg: LossAgg,
) -> Result<(Tensor, [f32; 4])> {
    if clip.low < 0.0 || clip.high < 0.0 || clip.low >= 1.0 {
        return Err(TrainError::ClipRange {
            low: clip.low,
            high: clip.high,
        });
    }
    let neg_adv = adv.neg()?;
    let unclipped = neg_adv.mul(ratio)?;
    let clipped = neg_adv.mul(&ratio.clamp(1.0 - clip.low, 1.0 + clip.high)?)?;
    let mut per_token = unclipped.maximum(&clipped)?;
    if let Some(w) = input.is_weights {
        per_token = per_token.mul(&w.detach())?;
    }
    let loss = aggregate(&per_token, input.mask, agg)?;
    let mask = input.mask;
    let was_clipped = clipped.gt(&unclipped)?.to_dtype(mask.dtype())?;
    let above = ratio.gt(1.0)?.to_dtype(mask.dtype())?;
    let below = ratio.lt(1.0)?.to_dtype(mask.dtype())?;
    let stats = [
        scalar_f32(&masked_mean(&was_clipped, mask)?)?,
        scalar_f32(&masked_mean(&was_clipped.mul(&below)?, mask)?)?,
        scalar_f32(&masked_mean(&was_clipped.mul(&above)?, mask)?)?,
        scalar_f32(&masked_mean(&ratio.detach(), mask)?)?,
    ];
    Ok((loss, stats))
}

/// Token-level KL estimates `(k1, k3)` of KL(old ‖ new) from `log_ratio = new − old`.
fn kl_estimates(log_ratio: &Tensor, mask: &Tensor) -> Result<(f32, f32)> {
    let lr = log_ratio.detach();
    let k1 = scalar_f32(&masked_mean(&lr.neg()?, mask)?)?;
    let k3 = lr.exp()?.sub(&lr)?.affine(1.0, -1.0)?;
    Ok((k1, scalar_f32(&masked_mean(&k3, mask)?)?))
}

/// The metrics of a loss value, its clip statistics `[frac, low, high, ratio mean]` and the
/// token log-ratios `new − old`.
fn loss_metrics(
    loss: &Tensor,
    [clip_frac, clip_frac_low, clip_frac_high, ratio_mean]: [f32; 4],
    log_ratio: &Tensor,
    mask: &Tensor,
) -> Result<PolicyLossMetrics> {
    let (ppo_kl, ppo_kl_k3) = kl_estimates(log_ratio, mask)?;
    Ok(PolicyLossMetrics {
        pg_loss: scalar_f32(loss)?,
        clip_frac,
        clip_frac_low,
        clip_frac_high,
        ppo_kl,
        ppo_kl_k3,
        ratio_mean,
    })
}

/// PPO clipped policy loss with clip-higher; `agg` reduces the per-token losses.
pub fn ppo_clip_loss(
    input: &PolicyLossInput,
    clip: ClipRange,
    agg: LossAgg,
) -> Result<(Tensor, PolicyLossMetrics)> {
    let c = check_inputs(input)?;
    let log_ratio = input
        .logp
        .sub(&c.old)?
        .clamp(-PPO_LOG_RATIO_LIMIT, PPO_LOG_RATIO_LIMIT)?;
    let ratio = log_ratio.exp()?;
    let (loss, stats) = clipped_surrogate(&ratio, &c.adv, input, clip, agg)?;
    let metrics = loss_metrics(&loss, stats, &log_ratio, input.mask)?;
    Ok((loss, metrics))
}

/// GSPO loss (token-level form with the stop-gradient trick); always aggregated
/// sequence-mean of token-mean, which is how GSPO is defined.
pub fn gspo_loss(input: &PolicyLossInput, clip: ClipRange) -> Result<(Tensor, PolicyLossMetrics)> {
    let c = check_inputs(input)?;
    let (b, t) = input.logp.dims2()?;
    let token_log_ratio = input.logp.sub(&c.old)?.mul(input.mask)?;
    let lengths = input.mask.sum_keepdim(1)?.maximum(1.0)?;
    let seq_log_ratio = token_log_ratio
        .sum_keepdim(1)?
        .div(&lengths)?
        .minimum(GSPO_LOG_RATIO_MAX)?
        .detach();
    // Value: seq_log_ratio; gradient: that of logp_t, per token.
    let log_s = input
        .logp
        .sub(&input.logp.detach())?
        .broadcast_add(&seq_log_ratio)?;
    let s = log_s.exp()?;
    let (loss, stats) = clipped_surrogate(&s, &c.adv, input, clip, LossAgg::SeqMeanTokenMean)?;
    debug_assert_eq!(s.dims(), [b, t]);
    let metrics = loss_metrics(&loss, stats, &token_log_ratio, input.mask)?;
    Ok((loss, metrics))
}

/// Dispatches to [`ppo_clip_loss`] or [`gspo_loss`]; `agg` is ignored for GSPO.
pub fn policy_loss(
    kind: PolicyLossKind,
    input: &PolicyLossInput,
    clip: ClipRange,
    agg: LossAgg,
) -> Result<(Tensor, PolicyLossMetrics)> {
    match kind {
        PolicyLossKind::Ppo => ppo_clip_loss(input, clip, agg),
        PolicyLossKind::Gspo => gspo_loss(input, clip),
    }
}
