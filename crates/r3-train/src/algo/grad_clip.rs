//! Global gradient-norm computation and clipping over a `GradStore`.

use crate::algo::fused_optim::{sum_of_squares, HostFloats};
use crate::algo::logprob::scalar_f32;
use crate::error::Result;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use r3_model::narrow_grads::in_dtype_of;
use r3_model::optim_pass::sum_of_squares_on_device;
use rayon::prelude::*;
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
/// contribute nothing): the per-tensor sums of squares added in `vars`' order, in f32. A
/// gradient kept in 16 bits (`r3_model::narrow_grads`), or of a variable held in 16 bits, is
/// read widened to f32 (each value as the pass reads it).
///
/// When every gradient is on the CPU, each sum is one fused read of the gradient (tensors in
/// parallel) in candle's own summation order, so the norm is bit for bit candle's
/// `sqr().sum_all()` composition of the widened gradients. When every gradient is on one
/// GPU, each sum is one read of the gradient by r3's kernel
/// (`r3_model::optim_pass::sum_of_squares_on_device`: within a tensor the squares added in
/// f64, so the last bits differ from the CPU's) and one value comes back to the host.
/// Elsewhere candle's ops are composed ([`global_grad_norm_composed`]).
pub fn global_grad_norm<'a>(
    vars: impl IntoIterator<Item = &'a Var>,
    grads: &GradStore,
) -> Result<f32> {
    let present = present_grads(vars, grads);
    let float = |t: &Tensor| matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16);
    if !present.is_empty()
        && present
            .iter()
            .all(|(var, g)| float(var) && g.device().is_cuda())
    {
        let on_device: Vec<&Tensor> = present.iter().map(|&(_, g)| g).collect();
        if let Some(sum) = sum_of_squares_on_device(&on_device)? {
            return Ok(sum.sqrt());
        }
    }
    let on_host = present
        .iter()
        .all(|(var, g)| float(var) && g.device().is_cpu());
    if on_host {
        let sums: Vec<Option<f32>> = present
            .par_iter()
            .map(|(var, g)| -> Result<Option<f32>> {
                // A gradient kept in 16 bits is read as it is, each value widened.
                let g = match g.dtype() {
                    DType::F32 | DType::BF16 | DType::F16 => g.contiguous()?,
                    _ => in_dtype_of(g, var)?.contiguous()?,
                };
                Ok(HostFloats::of(&g).map(|h| sum_of_squares(h.slice())))
            })
            .collect::<Result<_>>()?;
        if let Some(sums) = sums.into_iter().collect::<Option<Vec<f32>>>() {
            // as the composed path: the first sum, then each next one added to the running
            // total
            let total = sums.into_iter().reduce(|total, sq| total + sq);
            return Ok(total.map_or(0.0, f32::sqrt));
        }
    }
    composed_sum_norm(present)
}

/// [`global_grad_norm`] by candle's composed ops on any device (`sqr().sum_all()` per
/// gradient, summed on the device): the path of non-CPU gradients, and the reference that
/// tests and `r3 bench optim` compare the fused pass with.
pub fn global_grad_norm_composed<'a>(
    vars: impl IntoIterator<Item = &'a Var>,
    grads: &GradStore,
) -> Result<f32> {
    composed_sum_norm(present_grads(vars, grads))
}

/// Each of `vars` that has a gradient in `grads`, as its tensor beside that gradient.
fn present_grads<'a, 'g>(
    vars: impl IntoIterator<Item = &'a Var>,
    grads: &'g GradStore,
) -> Vec<(&'a Tensor, &'g Tensor)> {
    vars.into_iter()
        .filter_map(|var| grads.get(var.as_tensor()).map(|g| (var.as_tensor(), g)))
        .collect()
}

fn composed_sum_norm(present: Vec<(&Tensor, &Tensor)>) -> Result<f32> {
    let mut total: Option<Tensor> = None;
    for (var, g) in present {
        let sq = in_dtype_of(g, var)?
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F32)?;
        total = Some(match total {
            Some(t) => t.add(&sq)?,
            None => sq,
        });
    }
    match total {
        Some(t) => Ok(scalar_f32(&t)?.sqrt()),
        None => Ok(0.0),
    }
}

/// Measures the global norm and the factor that would clip it to `max_norm > 0`
/// (`max_norm / (norm + 1e-6)` when the norm is finite and above it, else 1), without touching
/// the gradients: pass the factor to [`crate::AdamW::step_scaled`], which folds it into its
/// pass. `max_norm <= 0` only measures.
pub fn measure_grad_norm<'a>(
    vars: impl IntoIterator<Item = &'a Var>,
    grads: &GradStore,
    max_norm: f64,
) -> Result<GradNorm> {
    let norm = global_grad_norm(vars, grads)?;
    let mut scale = 1.0f32;
    if norm.is_finite() && max_norm > 0.0 && f64::from(norm) > max_norm {
        scale = (max_norm / (f64::from(norm) + 1e-6)) as f32;
    }
    Ok(GradNorm { norm, scale })
}

/// Multiplies every gradient of `vars` in `grads` by `scale` (a new tensor each, as
/// `affine(scale, 0)`: gradients may share storage, so none is scaled in place), in its
/// variable's dtype (one kept in 16 bits is widened first).
pub fn scale_grads<'a>(
    vars: impl IntoIterator<Item = &'a Var>,
    grads: &mut GradStore,
    scale: f32,
) -> Result<()> {
    for var in vars {
        if let Some(g) = grads.get(var.as_tensor()) {
            let scaled = in_dtype_of(g, var.as_tensor())?.affine(f64::from(scale), 0.0)?;
            grads.insert(var.as_tensor(), scaled);
        }
    }
    Ok(())
}

/// Measures the global norm and, when it is finite and above `max_norm > 0`, scales every
/// gradient by `max_norm / (norm + 1e-6)` (as PyTorch's `clip_grad_norm_`).
/// `max_norm <= 0` only measures. A non-finite norm leaves the gradients untouched.
pub fn clip_grad_norm<'a>(
    vars: impl IntoIterator<Item = &'a Var> + Clone,
    grads: &mut GradStore,
    max_norm: f64,
) -> Result<GradNorm> {
    let measured = measure_grad_norm(vars.clone(), grads, max_norm)?;
    if measured.is_finite() && max_norm > 0.0 && f64::from(measured.norm) > max_norm {
        scale_grads(vars, grads, measured.scale)?;
    }
    Ok(measured)
}
