//! Mixed precision of the training forward (Megatron style): the weights and the optimiser
//! stay f32 (master weights); in bf16 mode every matmul reads its inputs and weights rounded to
//! bf16, accumulates in f32 and rounds its output to bf16, and the activations between ops are
//! bf16 at the same boundaries the rollout engine's bf16 mode uses (embeddings, norm outputs,
//! projection outputs, rotated q/k, SwiGLU and expert outputs, MoE block output, residual
//! stream). Rounding is a cast pair whose gradient passes straight through (candle's cast
//! backward), so gradients reach the f32 master weights; the backward itself runs in f32.

use candle_core::{DType, Tensor};

use crate::error::Result;

/// Where the training forward rounds to bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Full f32 forward (the default; gradient checks run here).
    #[default]
    F32,
    /// bf16 matmul inputs/outputs and activations at op boundaries, f32 accumulation.
    Bf16 {
        /// Router logits in f32 from the f32 gate weight (Megatron's `moe_router_dtype =
        /// fp32`); otherwise the gate is a bf16 projection like every other.
        router_f32: bool,
    },
}

impl Precision {
    /// Whether activations and matmuls are rounded to bf16.
    pub fn is_bf16(self) -> bool {
        matches!(self, Precision::Bf16 { .. })
    }

    /// The precision of the router projection: f32 when the router is kept in f32.
    pub fn router(self) -> Precision {
        match self {
            Precision::Bf16 { router_f32: true } => Precision::F32,
            other => other,
        }
    }

    /// `t` rounded to bf16 (nearest, ties to even) and widened back, in bf16 mode; `t` itself
    /// otherwise. Differentiable: the gradient passes through unchanged.
    pub fn round(self, t: &Tensor) -> Result<Tensor> {
        if !self.is_bf16() || t.dtype() != DType::F32 {
            return Ok(t.clone());
        }
        Ok(t.to_dtype(DType::BF16)?.to_dtype(DType::F32)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Values checked by hand: bf16 keeps 8 significant bits, ties to even; the gradient of
    /// the rounding is the identity.
    #[test]
    fn bf16_round_by_hand_with_straight_through_gradient() {
        let v = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            3.0,
            2.5234375,
        ];
        let x = Var::from_slice(&v, 4, &Device::Cpu).expect("var");
        let p = Precision::Bf16 { router_f32: false };
        let y = p.round(x.as_tensor()).expect("round");
        let got = y.to_vec1::<f32>().expect("values");
        assert_eq!(got, vec![1.0, 1.0 + 2f32.powi(-6), 3.0, 2.53125]);
        let grads = (y * 2.0)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
            .expect("backward");
        let g = grads.get(&x).expect("grad").to_vec1::<f32>().expect("grad");
        assert_eq!(g, vec![2.0; 4]);
        let same = Precision::F32.round(x.as_tensor()).expect("f32");
        assert_eq!(same.to_vec1::<f32>().expect("values"), v.to_vec());
        assert_eq!(
            Precision::Bf16 { router_f32: true }.router(),
            Precision::F32
        );
    }
}
