//! Token log-probabilities, entropy and masked reductions from logits: shape-checked
//! wrappers over r3-model's fused, differentiable row kernels, and composed masked means.

use crate::error::{Result, TrainError};
use candle_core::{DType, Tensor};

/// Checks that a tensor is `[b, t]` f32.
pub(crate) fn check_bt(name: &'static str, x: &Tensor, b: usize, t: usize) -> Result<()> {
    if x.dims() != [b, t] {
        return Err(TrainError::shape(name, x.dims(), format!("[{b}, {t}]")));
    }
    if x.dtype() != DType::F32 {
        return Err(TrainError::Dtype {
            what: name,
            got: x.dtype(),
        });
    }
    Ok(())
}

fn logits_dims(logits: &Tensor) -> Result<(usize, usize, usize)> {
    if logits.dtype() != DType::F32 {
        return Err(TrainError::Dtype {
            what: "logits",
            got: logits.dtype(),
        });
    }
    logits
        .dims3()
        .map_err(|_| TrainError::shape("logits", logits.dims(), "[batch, time, vocab]"))
}

/// `logits` are `[B, T, V]` f32 and `targets` `[B, T]`.
fn check_targets(logits: &Tensor, targets: &Tensor) -> Result<()> {
    let (b, t, _v) = logits_dims(logits)?;
    if targets.dims() != [b, t] {
        return Err(TrainError::shape(
            "targets",
            targets.dims(),
            format!("[{b}, {t}] like the logits"),
        ));
    }
    Ok(())
}

/// Log-probabilities of `targets` `[B, T]` (u32) under `logits` `[B, T, V]` → `[B, T]`.
pub fn token_log_probs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    check_targets(logits, targets)?;
    Ok(r3_model::token_stats::token_log_probs(logits, targets)?)
}

/// [`token_log_probs`] with the targets also on the host (`host_targets`, row-major `[B·T]`,
/// the same values): checked there, so a GPU is not stopped to read them back.
pub fn token_log_probs_host_checked(
    logits: &Tensor,
    targets: &Tensor,
    host_targets: &[u32],
) -> Result<Tensor> {
    check_targets(logits, targets)?;
    Ok(r3_model::token_stats::token_log_probs_host_checked(
        logits,
        targets,
        host_targets,
    )?)
}

/// Entropy of the next-token distribution at every position, `[B, T, V]` → `[B, T]`.
pub fn entropy_from_logits(logits: &Tensor) -> Result<Tensor> {
    logits_dims(logits)?;
    Ok(r3_model::token_stats::entropy(logits)?)
}

/// `Σ x·mask / Σ mask` as a scalar tensor; 0 when the mask is empty.
pub fn masked_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    if x.dims() != mask.dims() {
        return Err(TrainError::shape(
            "masked_mean values",
            x.dims(),
            format!("{:?} like the mask", mask.dims()),
        ));
    }
    let num = x.mul(mask)?.sum_all()?;
    let den = mask.sum_all()?.maximum(1e-8)?;
    Ok(num.div(&den)?)
}

/// Per-row masked mean `[B, T]` → `[B]`; a row with an empty mask gives 0.
pub fn masked_row_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    if x.dims() != mask.dims() || x.rank() != 2 {
        return Err(TrainError::shape(
            "masked_row_mean values",
            x.dims(),
            format!("[B, T] like the mask {:?}", mask.dims()),
        ));
    }
    let num = x.mul(mask)?.sum(1)?;
    let den = mask.sum(1)?.maximum(1e-8)?;
    Ok(num.div(&den)?)
}

/// Reads a scalar tensor as f32 (for metrics).
pub fn scalar_f32(x: &Tensor) -> Result<f32> {
    Ok(x.to_dtype(DType::F32)?.to_scalar::<f32>()?)
}
