//! Dense projection `y = x Wᵀ (+ b)` over `[.., in]` inputs.
//!
//! The product is a custom op with an explicit backward (`dx = g W`, `dW = gᵀ x`): with
//! `x.matmul(&w.t())` candle would route the weight gradient through a transpose node and
//! accumulate it with a strided add, an extra full pass over every weight per step (the
//! expert weights dominate this model's parameters).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor, WithDType};

use super::gemm::{matmul_vec, MatRef};
use super::matmul16::{matmul_wt_narrow, matmul_wt_narrow_shared};
use super::precomputed::{precomputed_fwd, Precomputed};
use crate::cast16::cast16;
use crate::error::Result;
use crate::host::with_host;
use crate::math::Float;
use crate::precision::{Precision, RoundTo, WeightGradients};
use crate::weights::check_narrow_copy;
use crate::weights::Weights;

/// `x [.., k] · w [n, k]ᵀ → [.., n]`, differentiable in both arguments. Leading dimensions
/// are read as rows in the op itself, so a 3-D activation needs no reshape nodes (each one
/// more node in candle's backward; upstream candle zero-filled and added a gradient buffer
/// per node).
struct MatmulWt;

/// Rows `m`, width `k` and the (row, column) strides of `x` read as an `[m, k]` matrix:
/// any strides for 2-D, contiguous for higher ranks.
fn as_matrix(xl: &Layout) -> candle_core::Result<(usize, usize, usize, usize)> {
    let dims = xl.shape().dims();
    let st = xl.stride();
    match dims.len() {
        2 => Ok((dims[0], dims[1], st[0], st[1])),
        r if r > 2 && xl.is_contiguous() => {
            let k = dims[r - 1];
            Ok((xl.shape().elem_count() / k.max(1), k, k, 1))
        }
        _ => candle_core::bail!("linear: input {:?} must be 2-D or contiguous", xl.shape()),
    }
}

/// `x · wᵀ` for one float type.
fn gemm_xwt<T: Float>(
    x: &[T],
    xl: &Layout,
    w: &[T],
    wl: &Layout,
) -> candle_core::Result<(Vec<T>, Shape)> {
    let (m, k, x_row, x_col) = as_matrix(xl)?;
    let (n, k2) = wl.shape().dims2()?;
    if k != k2 {
        candle_core::bail!("linear: input width {k} does not match weight width {k2}");
    }
    let ws = wl.stride();
    let x = MatRef {
        data: &x[xl.start_offset()..],
        row_stride: x_row,
        col_stride: x_col,
    };
    // wᵀ is w read with its strides swapped.
    let wt = MatRef {
        data: &w[wl.start_offset()..],
        row_stride: ws[1],
        col_stride: ws[0],
    };
    let dst = matmul_vec(m, n, k, x, wt, candle_core::utils::get_num_threads());
    let mut out_dims = xl.shape().dims().to_vec();
    if let Some(last) = out_dims.last_mut() {
        *last = n;
    }
    Ok((dst, Shape::from(out_dims)))
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
        if grad.device().is_cpu() {
            match grad.dtype() {
                DType::F32 => return host_bwd::<f32>(x, w, grad),
                DType::F64 => return host_bwd::<f64>(x, w, grad),
                _ => {}
            }
        }
        // Gradients flow detached here, so these reshapes build no graph.
        let n = w.dim(0)?;
        let k = w.dim(1)?;
        let rows = grad.elem_count() / n.max(1);
        let grad2 = grad.reshape((rows, n))?;
        let dx = if x.track_op() {
            Some(grad2.matmul(w)?.reshape(x.shape())?)
        } else {
            None
        };
        let dw = if w.track_op() {
            let x2 = if x.rank() == 2 {
                x.clone()
            } else {
                x.reshape((rows, k))?
            };
            Some(grad2.t()?.matmul(&x2)?)
        } else {
            None
        };
        Ok((dx, dw))
    }
}

/// [`MatmulWt`]'s backward on the CPU: `dx = g · w` and `dw = gᵀ · x` through r3's gemm
/// straight into new buffers (candle's matmul zero-fills its output first), the same gemm
/// calls as candle's, so the same values.
fn host_bwd<T: Float + WithDType>(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
    let (n, k) = w.dims2()?;
    let rows = grad.elem_count() / n.max(1);
    if rows * k != x.elem_count() || rows * n != grad.elem_count() {
        candle_core::bail!(
            "linear backward: gradient {:?} does not fit input {:?} and weight {:?}",
            grad.shape(),
            x.shape(),
            w.shape()
        );
    }
    let threads = candle_core::utils::get_num_threads();
    with_host::<T, _>(grad, |g| {
        let dx = if x.track_op() {
            with_host::<T, _>(w, |wv| {
                let a = MatRef::row_major(g, n);
                let v = matmul_vec(rows, k, n, a, MatRef::row_major(wv, k), threads);
                Ok(Some(Tensor::from_vec(v, x.shape(), x.device())?))
            })?
        } else {
            None
        };
        let dw = if w.track_op() {
            with_host::<T, _>(x, |xv| {
                let a = MatRef::transposed(g, n);
                let v = matmul_vec(n, k, rows, a, MatRef::row_major(xv, k), threads);
                Ok(Some(Tensor::from_vec(v, (n, k), w.device())?))
            })?
        } else {
            None
        };
        Ok((dx, dw))
    })
}

/// `x [.., k] · w [n, k]ᵀ → [.., n]` with weight gradients that need no transpose pass; a
/// stacked `w [b, n, k]` multiplies `x [b, m, k]` batch by batch.
pub fn matmul_wt(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && w.rank() == 2 && matches!(x.dtype(), DType::F32 | DType::F64) {
        let x = if x.rank() > 2 {
            x.contiguous()?
        } else {
            x.clone()
        };
        Ok(x.apply_op2(w, MatmulWt)?)
    } else if x.rank() == 2 && w.rank() == 2 {
        Ok(x.matmul(&w.t()?)?)
    } else {
        Ok(x.broadcast_matmul(&w.t()?)?)
    }
}

/// `x · wᵀ` at precision `p`: in f32 the plain product; in bf16 / f16 the product of the
/// rounded operands with f32 accumulation, rounded. On the CPU that is computed literally
/// (round, f32 GEMM, round: the reference the CPU engines match); on a GPU it is one 16-bit
/// tensor-core GEMM (cuBLAS accumulates in f32 and rounds its output once), the same value
/// up to the order of the sum, keeping only the f32 operands for its backward
/// ([`matmul_wt_narrow`]). Its backward on a GPU runs in the 16-bit format too (as
/// Megatron's does), while the CPU's runs in f32. `copy` is `w`'s held 16-bit copy where a
/// trainer keeps one ([`Weights::hold_narrow_copies`]): the rounded weight is read from it.
/// `grads` is the dtype `w`'s gradient is handed back in ([`WeightGradients`]: the same
/// values in f32 or in the 16-bit float).
///
/// [`Weights::hold_narrow_copies`]: crate::weights::Weights::hold_narrow_copies
pub fn matmul_wt_at(
    p: Precision,
    x: &Tensor,
    w: &Tensor,
    copy: Option<&Tensor>,
    grads: WeightGradients,
) -> Result<Tensor> {
    let narrow = match p.narrow_dtype() {
        None => return matmul_wt(x, w),
        Some(narrow) => narrow,
    };
    // The weight may be an inference engine's 16-bit copy (`Weights::narrow_matrices`).
    let f32_operands = x.dtype() == DType::F32 && (w.dtype() == DType::F32 || w.dtype() == narrow);
    if !x.device().is_cpu() && f32_operands {
        matmul_wt_narrow(x, w, copy, narrow, grads)
    } else {
        p.round(&matmul_wt(&p.round(x)?, &round_weight(p, w, copy, grads)?)?)
    }
}

/// A weight `w` (f32) rounded at precision `p` ([`Precision::round`]), read from `copy` where
/// one is given: the weight's 16-bit copy held beside it ([`Weights::hold_narrow_copies`]),
/// whose values are the rounding's, so nothing is rounded per use. The gradient reaches `w`
/// as through [`Precision::round`] (the incoming one rounded), in f32 or, where `grads`
/// asks, in the 16-bit float itself ([`WeightGradients::Narrow`]: the same values). A `copy`
/// not in `p`'s 16-bit float or not shaped as `w` is refused; in f32 the copy is not read.
///
/// [`Weights::hold_narrow_copies`]: crate::weights::Weights::hold_narrow_copies
pub(crate) fn round_weight(
    p: Precision,
    w: &Tensor,
    copy: Option<&Tensor>,
    grads: WeightGradients,
) -> Result<Tensor> {
    let narrow = match p.narrow_dtype() {
        Some(narrow) if w.dtype() == DType::F32 => narrow,
        _ => return p.round(w),
    };
    let value = match copy {
        Some(copy) => {
            check_narrow_copy(w, copy, Some(narrow))?;
            cast16(&copy.detach(), DType::F32)?
        }
        None if grads == WeightGradients::Narrow && w.track_op() => p.round(&w.detach())?,
        None => return p.round(w),
    };
    if !w.track_op() {
        return Ok(value);
    }
    Ok(w.apply_op1(RoundedWeight {
        value: Precomputed::new(value),
        narrow,
        grads,
    })?)
}

/// A weight rounded to a 16-bit float, its value precomputed ([`round_weight`]: read from
/// the weight's held copy, or rounded); the backward is [`RoundTo`]'s, its result kept in
/// the 16-bit float where `grads` asks.
#[derive(Debug)]
struct RoundedWeight {
    value: Precomputed,
    narrow: DType,
    grads: WeightGradients,
}

impl CustomOp1 for RoundedWeight {
    fn name(&self) -> &'static str {
        "rounded-weight"
    }

    precomputed_fwd!(1);

    fn bwd(
        &self,
        arg: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        match self.grads {
            // `RoundTo`'s values, `grad.to_dtype(narrow).to_dtype(f32)`, before the widening.
            WeightGradients::Narrow => Ok(Some(cast16(grad, self.narrow)?)),
            WeightGradients::InWeightDtype => RoundTo {
                narrow: self.narrow,
            }
            .bwd(arg, res, grad),
        }
    }
}

/// A linear layer with HF weight layout `[out, in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    /// The weight's held 16-bit copy, where a trainer keeps one.
    copy: Option<Tensor>,
    bias: Option<Tensor>,
    precision: Precision,
    grads: WeightGradients,
}

impl Linear {
    /// Loads `{prefix}.weight` (and `{prefix}.bias` if `bias`), and the weight's held 16-bit
    /// copy where `weights` has one.
    pub fn new(weights: &Weights, prefix: &str, bias: bool) -> Result<Self> {
        let name = format!("{prefix}.weight");
        let weight = weights.get(&name)?.clone();
        let copy = weights.narrow_copy(&name).cloned();
        let bias = if bias {
            Some(weights.get(&format!("{prefix}.bias"))?.clone())
        } else {
            None
        };
        Ok(Linear {
            weight,
            copy,
            bias,
            precision: Precision::F32,
            grads: WeightGradients::InWeightDtype,
        })
    }

    /// Sets the precision of the product (bf16: inputs, weight and bias rounded, f32
    /// accumulation, output rounded after the bias).
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    /// Sets the dtype a 16-bit forward hands the weight's (and bias's) gradient back in.
    pub fn set_weight_gradients(&mut self, grads: WeightGradients) {
        self.grads = grads;
    }

    /// The `[out, in]` weight.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// Applies each of `projections` to the last dimension of `x`: their [`Linear::forward`]
    /// values. Where nothing is differentiated and the projections share a 16-bit precision
    /// and have no bias (a layer's q, k and v in an inference engine), `x` is rounded (on a
    /// GPU: cast to the 16-bit float) once for all of them instead of once each; the same
    /// values, since the rounding of one input has one answer.
    pub fn forward_sharing_input(projections: &[&Linear], x: &Tensor) -> Result<Vec<Tensor>> {
        let p = match projections.first() {
            Some(first) => first.precision,
            None => return Ok(Vec::new()),
        };
        let shared = !x.track_op()
            && projections
                .iter()
                .all(|l| l.precision == p && l.bias.is_none() && !l.weight.track_op());
        let narrow = match p.narrow_dtype() {
            Some(narrow) if shared => narrow,
            _ => return projections.iter().map(|l| l.forward(x)).collect(),
        };
        // Nothing is differentiated: a held copy serves as the weight itself.
        let weights: Vec<&Tensor> = projections
            .iter()
            .map(|l| l.copy.as_ref().unwrap_or(&l.weight))
            .collect();
        let f32_operands = x.dtype() == DType::F32
            && weights
                .iter()
                .all(|w| w.dtype() == DType::F32 || w.dtype() == narrow);
        if !x.device().is_cpu() && f32_operands {
            return matmul_wt_narrow_shared(x, &weights, narrow);
        }
        // `matmul_wt_at`'s literal form with the input's rounding shared.
        let xr = p.round(x)?;
        weights
            .iter()
            .map(|w| p.round(&matmul_wt(&xr, &p.round(w)?)?))
            .collect()
    }

    /// Applies the projection to the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let p = self.precision;
        if p.is_mixed() {
            // The bias joins before the one rounding of the output.
            return match &self.bias {
                Some(b) => {
                    let w = round_weight(p, &self.weight, self.copy.as_ref(), self.grads)?;
                    let y = matmul_wt(&p.round(x)?, &w)?;
                    let b = round_weight(p, b, None, self.grads)?;
                    p.round(&y.broadcast_add(&b)?)
                }
                None => matmul_wt_at(p, x, &self.weight, self.copy.as_ref(), self.grads),
            };
        }
        let y = matmul_wt(x, &self.weight)?;
        match &self.bias {
            Some(b) => Ok(y.broadcast_add(b)?),
            None => Ok(y),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::max_abs_diff;
    use candle_core::{DType, Device, Var};

    fn ramp(shape: &[usize], step: f64) -> Tensor {
        let n: usize = shape.iter().product();
        let data: Vec<f64> = (0..n).map(|i| (i as f64 * step).sin()).collect();
        Tensor::from_vec(data, shape, &Device::Cpu).expect("tensor")
    }

    /// Projections sharing an input give each projection's own forward bit for bit: f32,
    /// bf16 and f16, with and without a bias among them, with a differentiated input (which
    /// takes each forward) and without.
    #[test]
    fn projections_sharing_an_input_equal_their_own_forwards() {
        let bits = crate::test_util::f32_bits;
        let f32 = |t: Tensor| t.to_dtype(DType::F32).expect("f32");
        let x = f32(ramp(&[2, 5, 12], 0.37));
        for precision in [
            Precision::F32,
            Precision::Bf16 { router_f32: false },
            Precision::F16 { router_f32: false },
        ] {
            for with_bias in [false, true] {
                let linears: Vec<Linear> = [(8, 0.11), (4, 0.23), (4, 0.31)]
                    .iter()
                    .enumerate()
                    .map(|(i, &(n, step))| Linear {
                        weight: f32(ramp(&[n, 12], step)),
                        copy: None,
                        bias: (with_bias && i == 1).then(|| f32(ramp(&[n], 0.5))),
                        precision,
                        grads: WeightGradients::InWeightDtype,
                    })
                    .collect();
                let refs: Vec<&Linear> = linears.iter().collect();
                let tracked = Var::from_tensor(&x).expect("var");
                for input in [&x, tracked.as_tensor()] {
                    let shared = Linear::forward_sharing_input(&refs, input).expect("shared");
                    assert_eq!(shared.len(), 3);
                    for (l, got) in linears.iter().zip(&shared) {
                        let want = l.forward(input).expect("own");
                        assert_eq!(got.dims(), want.dims());
                        assert_eq!(bits(got), bits(&want), "{precision:?} bias {with_bias}");
                    }
                }
            }
        }
    }

    /// A hand-computed bf16 projection (the rollout engine's bf16 linear test uses the same
    /// numbers): inputs, weights and bias read as bf16, f32 accumulation, the output rounded
    /// after the bias; gradients reach the f32 master weight unchanged by the rounding.
    #[test]
    fn bf16_projection_by_hand() {
        // x = [1 + 2^-9, 3] reads as [1, 3]; w = [[1 + 2^-9, 1], [0.5, -1 - 2^-7]] reads as
        // [[1, 1], [0.5, -1 - 2^-7]]; bias [2^-8, 0].
        // Row 0: 4 + 2^-8 rounds to 4 (bf16 step at 4 is 2^-5).
        // Row 1: 0.5 - 3(1 + 2^-7) = -2.5234375, a tie between -2.515625 and -2.53125; the
        // even mantissa wins: -2.53125.
        let dev = Device::Cpu;
        let w = Var::from_slice(
            &[1.0 + 2f32.powi(-9), 1.0, 0.5, -1.0 - 2f32.powi(-7)],
            (2, 2),
            &dev,
        )
        .expect("w");
        let b = Tensor::from_slice(&[2f32.powi(-8), 0.0], 2, &dev).expect("b");
        let mut lin = Linear {
            weight: w.as_tensor().clone(),
            copy: None,
            bias: Some(b),
            precision: Precision::F32,
            grads: WeightGradients::InWeightDtype,
        };
        lin.set_precision(Precision::Bf16 { router_f32: false });
        let x = Tensor::from_slice(&[1.0 + 2f32.powi(-9), 3.0], (1, 2), &dev).expect("x");
        let y = lin.forward(&x).expect("forward");
        assert_eq!(
            y.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("y"),
            vec![4.0, -2.53125]
        );
        // d(sum y)/dW = x broadcast per row (straight through both roundings): the rounded x.
        let grads = y.sum_all().and_then(|l| l.backward()).expect("backward");
        let gw = grads.get(&w).expect("dw");
        assert_eq!(
            gw.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("dw"),
            vec![1.0, 3.0, 1.0, 3.0]
        );
    }

    /// The same projection in f16 mode, by hand (f16 keeps 11 significant bits): the weight
    /// 1 + 2^-12 and the input 1 + 2^-12 round to 1; row 0 is 4 + 2^-11, below half the f16
    /// step at 4 (2^-8), so 4; row 1 is 0.5 - 3(1 + 2^-10) = -2.5 - 1.5 * 2^-9, a tie between
    /// 257 and 258 steps of 2^-9 above 2: the even one, -2.50390625.
    #[test]
    fn f16_projection_rounds_inputs_weights_and_output_by_hand() {
        let dev = Device::Cpu;
        let w = Tensor::from_slice(
            &[1.0 + 2f32.powi(-12), 1.0, 0.5, -1.0 - 2f32.powi(-10)],
            (2, 2),
            &dev,
        )
        .expect("w");
        let b = Tensor::from_slice(&[2f32.powi(-11), 0.0], 2, &dev).expect("b");
        let mut lin = Linear {
            weight: w,
            copy: None,
            bias: Some(b),
            precision: Precision::F32,
            grads: WeightGradients::InWeightDtype,
        };
        lin.set_precision(Precision::F16 { router_f32: false });
        let x = Tensor::from_slice(&[1.0 + 2f32.powi(-12), 3.0], (1, 2), &dev).expect("x");
        let y = lin.forward(&x).expect("forward");
        assert_eq!(
            y.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("y"),
            vec![4.0, -(2.5 + 2f32.powi(-8))]
        );
    }

    /// The custom product on a 3-D input and on a transposed 2-D input equals candle's
    /// matmul: values and both gradients (f64, so equal to rounding).
    #[test]
    fn projection_matches_candle_matmul_for_3d_and_strided_inputs() {
        let w = Var::from_tensor(&ramp(&[5, 4], 0.37)).expect("w");
        let x3 = Var::from_tensor(&ramp(&[2, 3, 4], 0.71)).expect("x");
        let xt = Var::from_tensor(&ramp(&[4, 6], 0.53)).expect("x");
        let cases: [(&Var, Tensor); 2] = [(&x3, x3.as_tensor().clone()), (&xt, xt.t().expect("t"))];
        for (var, x) in cases {
            let fused = matmul_wt(&x, &w).expect("fused");
            let reference = x.broadcast_matmul(&w.t().expect("t")).expect("matmul");
            assert_eq!(fused.dims(), reference.dims());
            let weights = ramp(fused.dims(), 0.19);
            let grads = |y: &Tensor| {
                let g = (y * &weights)
                    .and_then(|l| l.sum_all())
                    .and_then(|l| l.backward())
                    .expect("backward");
                (
                    g.get(var).expect("dx").clone(),
                    g.get(&w).expect("dw").clone(),
                )
            };
            assert!(max_abs_diff(&fused, &reference) < 1e-12);
            let ((fx, fw), (rx, rw)) = (grads(&fused), grads(&reference));
            assert!(max_abs_diff(&fx, &rx) < 1e-12 && max_abs_diff(&fw, &rw) < 1e-12);
            assert_eq!(fused.dtype(), DType::F64);
        }
    }

    /// Handed back narrow (`WeightGradients::Narrow`), a 16-bit projection's weight and bias
    /// gradients are the same values in the 16-bit float, with and without a bias, with and
    /// without a held copy of the weight; the input's gradient is unchanged.
    #[test]
    fn narrow_weight_gradients_have_the_wide_ones_values() {
        let bits = crate::test_util::f32_bits;
        let f32 = |t: Tensor| t.to_dtype(DType::F32).expect("f32");
        let x0 = f32(ramp(&[3, 4, 6], 0.37));
        for p in [
            Precision::Bf16 { router_f32: false },
            Precision::F16 { router_f32: false },
        ] {
            let narrow = p.narrow_dtype().expect("16-bit");
            for (with_bias, with_copy) in [(false, false), (true, false), (true, true)] {
                let run = |grads| {
                    let x = Var::from_tensor(&x0).expect("x");
                    let w = Var::from_tensor(&f32(ramp(&[5, 6], 0.23))).expect("w");
                    let b = Var::from_tensor(&f32(ramp(&[5], 0.5))).expect("b");
                    let mut lin = Linear {
                        weight: w.as_tensor().clone(),
                        copy: with_copy.then(|| w.to_dtype(narrow).expect("copy")),
                        bias: with_bias.then(|| b.as_tensor().clone()),
                        precision: Precision::F32,
                        grads: WeightGradients::InWeightDtype,
                    };
                    lin.set_precision(p);
                    lin.set_weight_gradients(grads);
                    let y = lin.forward(x.as_tensor()).expect("forward");
                    let probe = f32(ramp(y.dims(), 0.11));
                    let g = (&y * &probe)
                        .and_then(|l| l.sum_all())
                        .and_then(|l| l.backward())
                        .expect("backward");
                    let mut out = vec![
                        g.get(&x).expect("dx").clone(),
                        g.get(&w).expect("dw").clone(),
                    ];
                    if with_bias {
                        out.push(g.get(&b).expect("db").clone());
                    }
                    out
                };
                let (wide, kept) = (
                    run(WeightGradients::InWeightDtype),
                    run(WeightGradients::Narrow),
                );
                let what = format!("{p:?} bias {with_bias} copy {with_copy}");
                assert_eq!(kept[0].dtype(), DType::F32, "{what}: dx");
                for (i, (a, b)) in wide.iter().zip(&kept).enumerate() {
                    if i > 0 {
                        assert_eq!((a.dtype(), b.dtype()), (DType::F32, narrow), "{what}: {i}");
                    }
                    assert_eq!(bits(a), bits(&f32(b.clone())), "{what}: gradient {i}");
                }
            }
        }
    }
}
