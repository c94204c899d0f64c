//! Dense projection `y = x Wᵀ (+ b)` over `[.., in]` inputs, flattened to one 2-D matmul.

use candle_core::{Tensor, D};

use crate::error::Result;
use crate::weights::Weights;

/// A linear layer with HF weight layout `[out, in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// Loads `{prefix}.weight` (and `{prefix}.bias` if `bias`).
    pub fn new(weights: &Weights, prefix: &str, bias: bool) -> Result<Self> {
        let weight = weights.get(&format!("{prefix}.weight"))?.clone();
        let bias = if bias {
            Some(weights.get(&format!("{prefix}.bias"))?.clone())
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    /// The `[out, in]` weight.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// Applies the projection to the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let in_dim = x.dim(D::Minus1)?;
        let rows = x.elem_count() / in_dim.max(1);
        let x2 = x.reshape((rows, in_dim))?;
        let mut y = x2.matmul(&self.weight.t()?)?;
        if let Some(b) = &self.bias {
            y = y.broadcast_add(b)?;
        }
        let mut out_dims = dims;
        if let Some(last) = out_dims.last_mut() {
            *last = self.weight.dim(0)?;
        }
        Ok(y.reshape(out_dims)?)
    }
}
