//! SwiGLU feed-forward `down(silu(gate(x)) · up(x))`: dense layers, experts, shared experts.

use candle_core::Tensor;

use super::linear::Linear;
use crate::error::Result;
use crate::precision::{Precision, WeightGradients};
use crate::spec::SwigluNames;
use crate::weights::Weights;

/// One SwiGLU MLP.
#[derive(Debug, Clone)]
pub struct SwiGlu {
    gate: Linear,
    up: Linear,
    down: Linear,
    precision: Precision,
}

impl SwiGlu {
    /// Loads `{prefix}.{gate,up,down}.weight` with the given projection names.
    pub fn new(weights: &Weights, prefix: &str, names: &SwigluNames) -> Result<Self> {
        Ok(SwiGlu {
            gate: Linear::new(weights, &format!("{prefix}.{}", names.gate), false)?,
            up: Linear::new(weights, &format!("{prefix}.{}", names.up), false)?,
            down: Linear::new(weights, &format!("{prefix}.{}", names.down), false)?,
            precision: Precision::F32,
        })
    }

    /// Sets the precision of the three projections and of the SwiGLU output.
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
        for l in [&mut self.gate, &mut self.up, &mut self.down] {
            l.set_precision(precision);
        }
    }

    /// Sets the dtype a 16-bit forward hands the three weights' gradients back in.
    pub fn set_weight_gradients(&mut self, grads: WeightGradients) {
        for l in [&mut self.gate, &mut self.up, &mut self.down] {
            l.set_weight_gradients(grads);
        }
    }

    /// Applies the MLP to the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let hidden = (self.gate.forward(x)?.silu()? * self.up.forward(x)?)?;
        self.down.forward(&self.precision.round(&hidden)?)
    }
}
