//! Global gradient-norm computation and clipping over a `GradStore`.

use crate::algo::logprob::scalar_f32;
use crate::error::Result;
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};

/// Result of measuring (and maybe clipping) the global gradient norm.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradNorm {
    /// L2 norm over all gradients before clipping.
    pub norm: f32,
    /// Factor the gradients were multiplied by (1.0 when not clipped or not finite).
    pub scale: f32,
}

impl GradNorm {
    /// Whether the norm is a finite number (a NaN/inf gradient must skip the update).
    pub fn is_finite(&self) -> bool {
        self.norm.is_finite()
    }
}

/// L2 norm of all gradients of `vars` present in `grads` (variables without a gradient
/// contribute nothing).
pub fn global_grad_norm<'a>(
    vars: impl IntoIterator<Item = &'a Var>,
    grads: &GradStore,
) -> Result<f32> {
    let mut total: Option<Tensor> = None;
    for var in vars {
        if let Some(g) = grads.get(var.as_tensor()) {
            let sq = g.sqr()?.sum_all()?.to_dtype(candle_core::DType::F32)?;
            total = Some(match total {
                Some(t) => t.add(&sq)?,
                None => sq,
            });
        }
    }
    match total {
        Some(t) => Ok(scalar_f32(&t)?.sqrt()),
        None => Ok(0.0),
    }
}

/// Measures the global norm and, when it is finite and above `max_norm > 0`, scales every
/// gradient by `max_norm / (norm + 1e-6)` (as PyTorch's `clip_grad_norm_`).
/// `max_norm <= 0` only measures. A non-finite norm leaves the gradients untouched.
pub fn clip_grad_norm<'a>(
    vars: impl IntoIterator<Item = &'a Var> + Clone,
    grads: &mut GradStore,
    max_norm: f64,
) -> Result<GradNorm> {
    let norm = global_grad_norm(vars.clone(), grads)?;
    let mut scale = 1.0f32;
    if norm.is_finite() && max_norm > 0.0 && f64::from(norm) > max_norm {
        scale = (max_norm / (f64::from(norm) + 1e-6)) as f32;
        for var in vars {
            if let Some(g) = grads.get(var.as_tensor()) {
                let scaled = g.affine(f64::from(scale), 0.0)?;
                grads.insert(var.as_tensor(), scaled);
            }
        }
    }
    Ok(GradNorm { norm, scale })
}
