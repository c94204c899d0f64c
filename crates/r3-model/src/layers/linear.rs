//! Dense projection `y = x Wᵀ (+ b)` over `[.., in]` inputs.
//!
//! The product is a custom op with an explicit backward (`dx = g W`, `dW = gᵀ x`): with
//! `x.matmul(&w.t())` candle would route the weight gradient through a transpose node and
//! accumulate it with a strided add, an extra full pass over every weight per step (the
//! expert weights dominate this model's parameters).

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, D};

use crate::error::Result;
use crate::weights::Weights;

/// `x [m, k] · w [n, k]ᵀ → [m, n]`, differentiable in both arguments.
struct MatmulWt;

/// Runs gemm for one float type over arbitrary 2-D strides.
fn gemm_xwt<T: 'static + num_like::Float>(
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
    let x = &x[xl.start_offset()..];
    let w = &w[wl.start_offset()..];
    let mut dst = vec![T::ZERO; m * n];
    let threads = candle_core::utils::get_num_threads();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the pointers come from slices that hold every element the strides address:
    // x is [m, k] with strides xs from its layout, wᵀ is read as [k, n] through w's strides
    // swapped, and dst is a fresh contiguous [m, n] buffer.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            xs[1] as isize,
            xs[0] as isize,
            w.as_ptr(),
            ws[0] as isize,
            ws[1] as isize,
            T::ZERO,
            T::ONE,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok((dst, Shape::from((m, n))))
}

/// The few constants `gemm_xwt` needs, for f32 and f64.
mod num_like {
    /// Zero and one of a float type.
    pub trait Float: Copy {
        const ZERO: Self;
        const ONE: Self;
    }
    impl Float for f32 {
        const ZERO: Self = 0.0;
        const ONE: Self = 1.0;
    }
    impl Float for f64 {
        const ZERO: Self = 0.0;
        const ONE: Self = 1.0;
    }
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
