//! Dense projection `y = x Wᵀ (+ b)` over `[.., in]` inputs.
//!
//! The product is a custom op with an explicit backward (`dx = g W`, `dW = gᵀ x`): with
//! `x.matmul(&w.t())` candle would route the weight gradient through a transpose node and
//! accumulate it with a strided add, an extra full pass over every weight per step (the
//! expert weights dominate this model's parameters).

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, D};

use super::gemm::{matmul, MatRef};
use crate::error::Result;
use crate::math::Float;
use crate::weights::Weights;

/// `x [m, k] · w [n, k]ᵀ → [m, n]`, differentiable in both arguments.
struct MatmulWt;

/// `x · wᵀ` for one float type over arbitrary 2-D strides.
fn gemm_xwt<T: Float>(
    x: &[T],
    xl: &Layout,
    w: &[T],
    wl: &Layout,
) -> candle_core::Result<(Vec<T>, Shape)> {
    let (m, k) = xl.shape().dims2()?;
    let (n, k2) = wl.shape().dims2()?;
    if k != k2 {
        candle_core::bail!("linear: input width {k} does not match weight width {k2}");
    }
    let (xs, ws) = (xl.stride(), wl.stride());
    let x = MatRef {
        data: &x[xl.start_offset()..],
        row_stride: xs[0],
        col_stride: xs[1],
    };
    // wᵀ is w read with its strides swapped.
    let wt = MatRef {
        data: &w[wl.start_offset()..],
        row_stride: ws[1],
        col_stride: ws[0],
    };
    let mut dst = vec![T::ZERO; m * n];
    matmul(
        m,
        n,
        k,
        &mut dst,
        x,
        wt,
        candle_core::utils::get_num_threads(),
    );
    Ok((dst, Shape::from((m, n))))
}

impl CustomOp2 for MatmulWt {
    fn name(&self) -> &'static str {
        "r3-matmul-wt"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match (x, w) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => {
                let (out, shape) = gemm_xwt(x, xl, w, wl)?;
                Ok((CpuStorage::F32(out), shape))
            }
            (CpuStorage::F64(x), CpuStorage::F64(w)) => {
                let (out, shape) = gemm_xwt(x, xl, w, wl)?;
                Ok((CpuStorage::F64(out), shape))
            }
            _ => candle_core::bail!(
                "linear: training projection supports matching f32 or f64 operands"
            ),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = if x.track_op() {
            Some(grad.matmul(w)?)
        } else {
            None
        };
        let dw = if w.track_op() {
            Some(grad.t()?.matmul(x)?)
        } else {
            None
        };
        Ok((dx, dw))
    }
}

/// `x [m, k] · w [n, k]ᵀ` with weight gradients that need no transpose pass.
pub fn matmul_wt(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && matches!(x.dtype(), candle_core::DType::F32 | candle_core::DType::F64)
    {
        Ok(x.apply_op2(w, MatmulWt)?)
    } else {
        Ok(x.matmul(&w.t()?)?)
    }
}

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
        let mut y = matmul_wt(&x2, &self.weight)?;
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
