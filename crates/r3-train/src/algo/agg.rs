//! Loss aggregation: turning a `[B, T]` matrix of per-token losses into one scalar.

use crate::algo::logprob::masked_row_mean;
use crate::error::{Result, TrainError};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};

/// How per-token losses are reduced to the scalar that is differentiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum LossAgg {
    /// Mean over every response token of the batch: long responses weigh more (DAPO).
    #[default]
    TokenMean,
    /// Mean over sequences of each sequence's token mean: every response weighs the same
    /// (original GRPO; GSPO's definition). Rows with an empty mask are left out.
    SeqMeanTokenMean,
    /// Mean over sequences of each sequence's token sum (Dr. GRPO style, unnormalised).
    SeqMeanTokenSum,
}

/// The denominators of an aggregation, taken from the mask of a whole mini-batch: a
/// micro-batch's partial loss (the numerator over its own rows, divided by these) then sums
/// over the micro-batches to the mini-batch's loss, whatever the split.
#[derive(Debug, Clone)]
pub struct AggNorm {
    /// `max(Σ mask, 1e-8)`, a scalar tensor: the (weighted) response tokens (`token-mean`).
    pub tokens: Tensor,
    /// `max(rows with a response token, 1e-8)`, a scalar tensor (`seq-mean-*`).
    pub rows: Tensor,
}

impl AggNorm {
    /// The denominators of `mask` `[B, T]` (1.0 = response token, row-weighted).
    pub fn of(mask: &Tensor) -> Result<Self> {
        if mask.rank() != 2 {
            return Err(TrainError::shape("aggregation mask", mask.dims(), "[B, T]"));
        }
        Ok(Self {
            tokens: mask.sum_all()?.maximum(1e-8)?,
            rows: row_has_tokens(mask)?.sum_all()?.maximum(1e-8)?,
        })
    }
}

/// `[B]`: 1.0 for the rows of `mask` with at least one response token.
fn row_has_tokens(mask: &Tensor) -> Result<Tensor> {
    Ok(mask.sum(1)?.gt(0.0)?.to_dtype(mask.dtype())?)
}

/// Reduces `loss` `[B, T]` under `mask` `[B, T]` (1.0 = response token) to a scalar.
pub fn aggregate(loss: &Tensor, mask: &Tensor, mode: LossAgg) -> Result<Tensor> {
    aggregate_with(loss, mask, mode, &AggNorm::of(mask)?)
}

/// [`aggregate`] with the denominators `norm` of a larger batch these rows belong to: the
/// rows' share of that batch's aggregated loss (`aggregate` is `aggregate_with` under the
/// mask's own [`AggNorm`]).
pub fn aggregate_with(
    loss: &Tensor,
    mask: &Tensor,
    mode: LossAgg,
    norm: &AggNorm,
) -> Result<Tensor> {
    if loss.dims() != mask.dims() || loss.rank() != 2 {
        return Err(TrainError::shape(
            "aggregated loss",
            loss.dims(),
            format!("[B, T] like the mask {:?}", mask.dims()),
        ));
    }
    match mode {
        LossAgg::TokenMean => Ok(loss.mul(mask)?.sum_all()?.div(&norm.tokens)?),
        LossAgg::SeqMeanTokenMean | LossAgg::SeqMeanTokenSum => {
            let per_seq = match mode {
                LossAgg::SeqMeanTokenMean => masked_row_mean(loss, mask)?,
                _ => loss.mul(mask)?.sum(1)?,
            };
            // Only rows with at least one response token count.
            let has_tokens = row_has_tokens(mask)?.to_dtype(loss.dtype())?;
            Ok(per_seq.mul(&has_tokens)?.sum_all()?.div(&norm.rows)?)
        }
    }
}
