//! Loss aggregation: turning a `[B, T]` matrix of per-token losses into one scalar.

use crate::algo::logprob::{masked_mean, masked_row_mean};
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

/// Reduces `loss` `[B, T]` under `mask` `[B, T]` (1.0 = response token) to a scalar.
pub fn aggregate(loss: &Tensor, mask: &Tensor, mode: LossAgg) -> Result<Tensor> {
    if loss.dims() != mask.dims() || loss.rank() != 2 {
        return Err(TrainError::shape(
            "aggregated loss",
            loss.dims(),
            format!("[B, T] like the mask {:?}", mask.dims()),
        ));
    }
    match mode {
        LossAgg::TokenMean => masked_mean(loss, mask),
        LossAgg::SeqMeanTokenMean | LossAgg::SeqMeanTokenSum => {
            let per_seq = match mode {
                LossAgg::SeqMeanTokenMean => masked_row_mean(loss, mask)?,
                _ => loss.mul(mask)?.sum(1)?,
            };
            // Only rows with at least one response token count.
            let row_has_tokens = mask.sum(1)?.gt(0.0)?.to_dtype(loss.dtype())?;
            masked_mean(&per_seq, &row_has_tokens)
        }
    }
}
