//! Importance-sampling correction for the training–inference mismatch, from the
//! old-policy log-probs (training engine) and the rollout log-probs (inference engine).
//!
//! * TIS (truncated IS): weight `min(π_old / π_rollout, C)`.
//! * MIS (masked IS): weight `π_old / π_rollout` where that ratio is `≤ C`, else 0 — the
//!   token (or whole sequence) is dropped from the loss. Dropped tokens still count in a
//!   `token-mean` denominator: they contribute zero, they are not removed from the batch.
//!
//! At token level the ratio is per token; at sequence level it is the product over the
//! response tokens, `exp(Σ_t (old − rollout))`, shared by every token of the sequence.
//! All arithmetic is in log space, so huge ratios never overflow. Weights are detached.

use crate::algo::logprob::check_bt;
use crate::algo::loss::masked_sum;
use crate::error::{Result, TrainError};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};

/// Which importance-sampling correction to apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum IsMode {
    /// No correction.
    #[default]
    None,
    /// Truncated importance sampling.
    Tis,
    /// Masked importance sampling.
    Mis,
}

/// Granularity of the importance ratio.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum IsLevel {
    /// One ratio per token.
    #[default]
    Token,
    /// One ratio per sequence (product over its tokens).
    Sequence,
}

/// Importance-sampling settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct IsConfig {
    /// TIS, MIS or none.
    pub mode: IsMode,
    /// Token or sequence ratios.
    pub level: IsLevel,
    /// Threshold `C` (truncation for TIS, drop-above for MIS); must be > 0.
    pub threshold: f64,
}

/// Weights to multiply the per-token policy loss by, with the sums behind their summary.
#[derive(Debug, Clone)]
pub struct IsWeights {
    /// `[B, T]`, detached; 0 outside the mask.
    pub weights: Tensor,
    /// Numerators of [`IsMetrics`] over these rows ([`IsSums::finish`] gives the metrics).
    pub sums: IsSums,
}

/// Summary of an importance-weight computation (means over response tokens).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct IsMetrics {
    /// Mean weight.
    pub weight_mean: f32,
    /// Fraction of response tokens whose ratio exceeded the threshold (truncated or dropped).
    pub over_threshold_frac: f32,
    /// Mean of the untruncated log-ratio `old − rollout` at the chosen level.
    pub log_ratio_mean: f32,
}

/// The numerators behind [`IsMetrics`] over some rows of a mini-batch. Micro-batches of one
/// mini-batch add theirs, and [`IsSums::finish`] divides by the mini-batch's token count
/// once (as `PolicyLossSums`), so the metrics are the one-batch values.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IsSums {
    /// `Σ mask · weight`.
    pub weight: f64,
    /// `Σ mask · (log-ratio > ln C)`.
    pub over: f64,
    /// `Σ mask · log-ratio`.
    pub log_ratio: f64,
}

impl IsSums {
    /// Adds the sums of other rows of the same mini-batch.
    pub fn add(&mut self, other: &IsSums) {
        self.weight += other.weight;
        self.over += other.over;
        self.log_ratio += other.log_ratio;
    }

    /// The metrics: each numerator over `tokens`, the mini-batch's `max(Σ mask, 1e-8)`, divided
    /// in f32 as a one-batch masked mean.
    pub fn finish(&self, tokens: f32) -> IsMetrics {
        let mean = |num: f64| num as f32 / tokens;
        IsMetrics {
            weight_mean: mean(self.weight),
            over_threshold_frac: mean(self.over),
            log_ratio_mean: mean(self.log_ratio),
        }
    }
}

/// Computes IS weights `[B, T]` from `old_logp`, `rollout_logp` and `mask` (all `[B, T]`
/// f32), or `None` when `cfg.mode` is `None`.
pub fn rollout_is_weights(
    old_logp: &Tensor,
    rollout_logp: &Tensor,
    mask: &Tensor,
    cfg: &IsConfig,
) -> Result<Option<IsWeights>> {
    if cfg.mode == IsMode::None {
        return Ok(None);
    }
    if cfg.threshold.is_nan() || cfg.threshold <= 0.0 {
        return Err(TrainError::OutOfRange {
            name: "IS threshold",
            value: cfg.threshold,
            expected: "> 0",
        });
    }
    let (b, t) = old_logp.dims2()?;
    check_bt("old_logp", old_logp, b, t)?;
    check_bt("rollout_logp", rollout_logp, b, t)?;
    check_bt("mask", mask, b, t)?;
    let token_log_ratio = old_logp.detach().sub(&rollout_logp.detach())?.mul(mask)?;
    let log_ratio = match cfg.level {
        IsLevel::Token => token_log_ratio,
        IsLevel::Sequence => token_log_ratio
            .sum_keepdim(1)?
            .broadcast_as((b, t))?
            .contiguous()?,
    };
    let log_c = cfg.threshold.ln();
    let over = log_ratio.gt(log_c)?.to_dtype(mask.dtype())?;
    let truncated = log_ratio.minimum(log_c)?.exp()?;
    let weights = if cfg.mode == IsMode::Mis {
        truncated.mul(&over.affine(-1.0, 1.0)?)?
    } else {
        truncated
    }
    .mul(mask)?
    .detach();
    let sums = IsSums {
        weight: masked_sum(&weights, mask)?,
        over: masked_sum(&over, mask)?,
        log_ratio: masked_sum(&log_ratio, mask)?,
    };
    Ok(Some(IsWeights { weights, sums }))
}
