//! Policy-gradient losses in the style of verl's `core_algos.py`: each a pure function of
//! shape-documented tensors returning `(loss, metrics)`.
//!
//! * PPO clip with separate `ε_low` / `ε_high` (clip-higher, DAPO): per-token ratio
//!   `r_t = exp(logp_t − old_t)`, loss `max(−A·r_t, −A·clip(r_t, 1−ε_low, 1+ε_high))`;
//!   with dual-clip (`ClipRange::dual_clip` = `c`, verl's `clip_ratio_c`) a negative
//!   advantage's loss is further capped, `min(that, −A·c)`, as verl's
//!   `compute_policy_loss_vanilla`. Off by default (slime's default; verl's is `c = 3`).
//! * GSPO: sequence ratio `s_i = exp(mean_t(logp_t − old_t))`, used per token as
//!   `s_{i,t} = sg[s_i] · π(y_t) / sg[π(y_t)]` (equal to `s_i` in value, gradient
//!   `s_i · ∇logp_t`), clipped with GSPO's own tiny ε and averaged per sequence.
//!
//! Inputs (all f32, `B` sequences × `T` positions): `logp` carries the gradient; `old_logp`
//! and `is_weights` are detached here; `advantages` is `[B]` (broadcast over tokens) or
//! `[B, T]`; `mask` is 1.0 on response tokens.

use crate::algo::agg::{aggregate_with, AggNorm, LossAgg};
use crate::algo::logprob::{check_bt, scalar_f32};
use crate::error::{Result, TrainError};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};

/// Log-ratio clamp of PPO (as verl) so `exp` never overflows.
const PPO_LOG_RATIO_LIMIT: f64 = 20.0;
/// Upper clamp of GSPO's log sequence ratio, on the differentiable sum (as verl): a
/// sequence past it gets no gradient.
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

/// Clip range `[1 − low, 1 + high]` of the importance ratio, and the optional dual-clip.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ClipRange {
    /// `ε_low`.
    pub low: f64,
    /// `ε_high`.
    pub high: f64,
    /// Dual-clip `c` (verl's `clip_ratio_c`, > 1): where the advantage is negative the
    /// per-token loss is capped at `−A·c`, so a token whose ratio grew far past `1 + ε_high`
    /// neither adds more loss nor gradient. `None`: off (slime's default; verl's is 3.0).
    #[serde(default)]
    pub dual_clip: Option<f64>,
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
    /// Fraction of tokens whose loss the dual-clip capped (negative advantage, loss past
    /// `−A·c`; verl's `pg_clipfrac_lower`); 0 without dual-clip.
    #[serde(default)]
    pub dual_clip_frac: f32,
}

/// The sums behind [`PolicyLossMetrics`] over some rows of a mini-batch: numerators over
/// response tokens (and the partial loss). Micro-batches of one mini-batch add theirs, and
/// [`PolicyLossSums::finish`] divides by the mini-batch's token count once, so the metrics
/// equal the one-batch values (no mean of means).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PolicyLossSums {
    /// Sum of the partial losses (each already over the mini-batch's denominators).
    pub pg_loss: f64,
    /// `Σ mask · clipped`.
    pub clip: f64,
    /// `Σ mask · clipped · (ratio < 1)`.
    pub clip_low: f64,
    /// `Σ mask · clipped · (ratio > 1)`.
    pub clip_high: f64,
    /// `Σ mask · ratio`.
    pub ratio: f64,
    /// `Σ mask · (old − new)`.
    pub kl: f64,
    /// `Σ mask · (r − 1 − log r)`.
    pub kl_k3: f64,
    /// `Σ mask · dual-clipped`.
    pub dual_clip: f64,
}

impl PolicyLossSums {
    /// Adds the sums of other rows of the same mini-batch.
    pub fn add(&mut self, other: &PolicyLossSums) {
        self.pg_loss += other.pg_loss;
        self.clip += other.clip;
        self.clip_low += other.clip_low;
        self.clip_high += other.clip_high;
        self.ratio += other.ratio;
        self.kl += other.kl;
        self.kl_k3 += other.kl_k3;
        self.dual_clip += other.dual_clip;
    }

    /// The metrics: each numerator over `tokens`, the mini-batch's `max(Σ mask, 1e-8)`. The
    /// division is in f32, as the one-batch masked mean's, so one micro-batch gives the
    /// one-batch metrics bit for bit.
    pub fn finish(&self, tokens: f32) -> PolicyLossMetrics {
        let mean = |num: f64| num as f32 / tokens;
        PolicyLossMetrics {
            pg_loss: self.pg_loss as f32,
            clip_frac: mean(self.clip),
            clip_frac_low: mean(self.clip_low),
            clip_frac_high: mean(self.clip_high),
            ppo_kl: mean(self.kl),
            ppo_kl_k3: mean(self.kl_k3),
            ratio_mean: mean(self.ratio),
            dual_clip_frac: mean(self.dual_clip),
        }
    }
}

/// `Σ x · mask` as an f64 (a masked mean's numerator, as computed there).
pub(crate) fn masked_sum(x: &Tensor, mask: &Tensor) -> Result<f64> {
    Ok(f64::from(scalar_f32(&x.mul(mask)?.sum_all()?)?))
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

/// Shared clipped surrogate: per-token `max(−A·ρ, −A·clip(ρ))` (capped at `−A·c` where
/// `A < 0` with dual-clip `c`), IS-weighted, aggregated over `norm`'s denominators; with the
/// clip and ratio numerators.
fn clipped_surrogate(
    ratio: &Tensor,
    adv: &Tensor,
    input: &PolicyLossInput,
    clip: ClipRange,
    agg: LossAgg,
    norm: &AggNorm,
) -> Result<(Tensor, PolicyLossSums)> {
    if clip.low < 0.0 || clip.high < 0.0 || clip.low >= 1.0 {
        return Err(TrainError::ClipRange {
            low: clip.low,
            high: clip.high,
        });
    }
    if let Some(c) = clip.dual_clip {
        if !(c.is_finite() && c > 1.0) {
            return Err(TrainError::OutOfRange {
                name: "clip_ratio_c (dual-clip)",
                value: c,
                expected: "finite and > 1",
            });
        }
    }
    let mask = input.mask;
    let neg_adv = adv.neg()?;
    let unclipped = neg_adv.mul(ratio)?;
    let clipped = neg_adv.mul(&ratio.clamp(1.0 - clip.low, 1.0 + clip.high)?)?;
    let mut per_token = unclipped.maximum(&clipped)?;
    let mut dual_clip = 0.0;
    if let Some(c) = clip.dual_clip {
        // verl: where A < 0, min(max(−A·r, −A·clip(r)), −A·c); the cap is detached (A is),
        // so a capped token has no gradient.
        let cap = neg_adv.affine(c, 0.0)?;
        let negative = adv.lt(0.0)?;
        let capped = per_token
            .gt(&cap)?
            .to_dtype(mask.dtype())?
            .mul(&negative.to_dtype(mask.dtype())?)?;
        dual_clip = masked_sum(&capped, mask)?;
        per_token = negative.where_cond(&per_token.minimum(&cap)?, &per_token)?;
    }
    if let Some(w) = input.is_weights {
        per_token = per_token.mul(&w.detach())?;
    }
    let loss = aggregate_with(&per_token, input.mask, agg, norm)?;
    let was_clipped = clipped.gt(&unclipped)?.to_dtype(mask.dtype())?;
    let above = ratio.gt(1.0)?.to_dtype(mask.dtype())?;
    let below = ratio.lt(1.0)?.to_dtype(mask.dtype())?;
    let sums = PolicyLossSums {
        pg_loss: f64::from(scalar_f32(&loss)?),
        clip: masked_sum(&was_clipped, mask)?,
        clip_low: masked_sum(&was_clipped.mul(&below)?, mask)?,
        clip_high: masked_sum(&was_clipped.mul(&above)?, mask)?,
        ratio: masked_sum(&ratio.detach(), mask)?,
        kl: 0.0,
        kl_k3: 0.0,
        dual_clip,
    };
    Ok((loss, sums))
}

/// Adds the numerators of the token-level KL estimates (k1, k3) of KL(old ‖ new), from
/// `log_ratio = new − old`, to `sums`.
fn with_kl(mut sums: PolicyLossSums, log_ratio: &Tensor, mask: &Tensor) -> Result<PolicyLossSums> {
    let lr = log_ratio.detach();
    sums.kl = masked_sum(&lr.neg()?, mask)?;
    let k3 = lr.exp()?.sub(&lr)?.affine(1.0, -1.0)?;
    sums.kl_k3 = masked_sum(&k3, mask)?;
    Ok(sums)
}

/// The metrics of a loss over its own rows (the mini-batch is the input itself).
fn own_metrics(
    part: impl FnOnce(&AggNorm) -> Result<(Tensor, PolicyLossSums)>,
    mask: &Tensor,
) -> Result<(Tensor, PolicyLossMetrics)> {
    let norm = AggNorm::of(mask)?;
    let (loss, sums) = part(&norm)?;
    Ok((loss, sums.finish(scalar_f32(&norm.tokens)?)))
}

/// PPO clipped policy loss with clip-higher; `agg` reduces the per-token losses.
pub fn ppo_clip_loss(
    input: &PolicyLossInput,
    clip: ClipRange,
    agg: LossAgg,
) -> Result<(Tensor, PolicyLossMetrics)> {
    own_metrics(|norm| ppo_clip_part(input, clip, agg, norm), input.mask)
}

/// [`ppo_clip_loss`] of rows of a larger mini-batch whose denominators are `norm`: the
/// rows' share of its loss, and their metric sums.
fn ppo_clip_part(
    input: &PolicyLossInput,
    clip: ClipRange,
    agg: LossAgg,
    norm: &AggNorm,
) -> Result<(Tensor, PolicyLossSums)> {
    let c = check_inputs(input)?;
    let log_ratio = input
        .logp
        .sub(&c.old)?
        .clamp(-PPO_LOG_RATIO_LIMIT, PPO_LOG_RATIO_LIMIT)?;
    let ratio = log_ratio.exp()?;
    let (loss, sums) = clipped_surrogate(&ratio, &c.adv, input, clip, agg, norm)?;
    Ok((loss, with_kl(sums, &log_ratio, input.mask)?))
}

/// GSPO loss (token-level form with the stop-gradient trick); always aggregated
/// sequence-mean of token-mean, which is how GSPO is defined.
pub fn gspo_loss(input: &PolicyLossInput, clip: ClipRange) -> Result<(Tensor, PolicyLossMetrics)> {
    own_metrics(|norm| gspo_part(input, clip, norm), input.mask)
}

/// [`gspo_loss`] of rows of a larger mini-batch whose denominators are `norm` (the
/// sequence ratio is per row, so a row's loss does not depend on the others).
fn gspo_part(
    input: &PolicyLossInput,
    clip: ClipRange,
    norm: &AggNorm,
) -> Result<(Tensor, PolicyLossSums)> {
    let c = check_inputs(input)?;
    let (b, t) = input.logp.dims2()?;
    let token_log_ratio = input.logp.sub(&c.old)?.mul(input.mask)?;
    let lengths = input.mask.sum_keepdim(1)?.maximum(1.0)?;
    let seq_log_ratio = token_log_ratio.sum_keepdim(1)?.div(&lengths)?.detach();
    // Value: seq_log_ratio; gradient: that of logp_t, per token. Clamped after the sum, as
    // verl's `torch.clamp(max=10)`: a sequence above the bound gets no gradient (clamping
    // only the detached part would leave it `e^10 · ∇logp_t`).
    let log_s = input
        .logp
        .sub(&input.logp.detach())?
        .broadcast_add(&seq_log_ratio)?
        .minimum(GSPO_LOG_RATIO_MAX)?;
    let s = log_s.exp()?;
    let (loss, sums) = clipped_surrogate(&s, &c.adv, input, clip, LossAgg::SeqMeanTokenMean, norm)?;
    debug_assert_eq!(s.dims(), [b, t]);
    Ok((loss, with_kl(sums, &token_log_ratio, input.mask)?))
}

/// Dispatches to [`ppo_clip_loss`] or [`gspo_loss`]; `agg` is ignored for GSPO.
pub fn policy_loss(
    kind: PolicyLossKind,
    input: &PolicyLossInput,
    clip: ClipRange,
    agg: LossAgg,
) -> Result<(Tensor, PolicyLossMetrics)> {
    own_metrics(
        |norm| policy_loss_part(kind, input, clip, agg, norm),
        input.mask,
    )
}

/// The policy loss of some rows of a mini-batch (a micro-batch) whose denominators are
/// `norm` ([`AggNorm::of`] the whole mini-batch's mask): the partial losses of its
/// micro-batches sum to the mini-batch's [`policy_loss`], and so do their gradients and
/// [`PolicyLossSums`].
pub fn policy_loss_part(
    kind: PolicyLossKind,
    input: &PolicyLossInput,
    clip: ClipRange,
    agg: LossAgg,
    norm: &AggNorm,
) -> Result<(Tensor, PolicyLossSums)> {
    match kind {
        PolicyLossKind::Ppo => ppo_clip_part(input, clip, agg, norm),
        PolicyLossKind::Gspo => gspo_part(input, clip, norm),
    }
}
