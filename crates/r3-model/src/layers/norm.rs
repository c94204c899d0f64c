//! RMSNorm via candle's composed `rms_norm_slow` (the fused kernel has no gradient).

use candle_core::Tensor;

use crate::error::Result;
use crate::weights::Weights;

/// RMSNorm with a learned scale.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    /// Loads `{prefix}.weight`.
    pub fn new(weights: &Weights, prefix: &str, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: weights.get(&format!("{prefix}.weight"))?.clone(),
            eps: eps as f32,
        })
    }

    /// Normalises the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm_slow(x, &self.weight, self.eps)?)
    }
}
