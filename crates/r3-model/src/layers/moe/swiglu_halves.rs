//! SwiGLU over a fused gate-up projection's two halves as one op:
//! `silu(h[.., :I]) · h[.., I:]`, and its backward as one pass writing both halves' gradients
//! (`d gate = d · up · σ(g) · (1 + g · (1 − σ(g)))`, `d up = d · silu(g)`).
//!
//! Composed from candle's ops (two strided `narrow`s, `silu`, a multiply) it was two copies
//! forward, and backward the multiply's two products, silu's five kernels and two
//! zero-padded copies back into the halves: ≈ 7 ms of a mid bf16 training step on an H200
//! (its kernel table before this op).
//! The op has a CPU implementation, whose value the tests hold to the composed ops bit for
//! bit, and a CUDA kernel (`cuda/kernels.cu`, the same arithmetic) that the device tests
//! hold to the CPU. At a 16-bit precision it also takes the rounding point that follows it
//! ([`swiglu_halves_rounded`]).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

use crate::device::row_ops_run_on;
use crate::error::Result;
use crate::host::contiguous;
use crate::math::StdFloat;
use crate::precision::{Precision, RoundTo};

/// `silu(h[.., :I]) · h[.., I:]` for `hidden` `[.., 2I]`, differentiable; None where the op
/// does not apply (another device or dtype: the caller composes).
pub(crate) fn swiglu_halves(hidden: &Tensor) -> Result<Option<Tensor>> {
    let two_i = hidden.dims().last().copied().unwrap_or(0);
    if two_i == 0 || !two_i.is_multiple_of(2) || !row_ops_run_on(hidden) {
        return Ok(None);
    }
    Ok(Some(
        hidden
            .contiguous()?
            .apply_op1(SwigluHalves { round: None })?,
    ))
}

/// [`swiglu_halves`] rounded at `precision` in the same op: `round(silu(g) · u)`, the values
/// and gradients of the SwiGLU followed by `precision.round` (the rounding point before the
/// down projection), but the graph keeps only the gate-up input. Two ops kept the unrounded
/// `[.., I]` output alive until the backward too (the rounding's input; ≈ 100 MB a layer on
/// the 30B-A3B shape at 8 × 512 tokens) and ran two kernels. The backward rounds the
/// incoming gradient as the rounding point's does, then differentiates the SwiGLU. An f32
/// precision or a non-f32 input: [`swiglu_halves`] (the rounding point changes neither).
pub(crate) fn swiglu_halves_rounded(
    hidden: &Tensor,
    precision: Precision,
) -> Result<Option<Tensor>> {
    let Some(narrow) = precision
        .narrow_dtype()
        .filter(|_| hidden.dtype() == DType::F32)
    else {
        return swiglu_halves(hidden);
    };
    let two_i = hidden.dims().last().copied().unwrap_or(0);
    if two_i == 0 || !two_i.is_multiple_of(2) || !row_ops_run_on(hidden) {
        return Ok(None);
    }
    Ok(Some(hidden.contiguous()?.apply_op1(SwigluHalves {
        round: Some(narrow),
    })?))
}

/// The forward op `[.., 2I] → [.., I]`, its output rounded to `round` (f32 input only).
#[derive(Debug, Clone, Copy)]
struct SwigluHalves {
    round: Option<DType>,
}

/// `silu(g)` as candle computes it: `g / (1 + exp(−g))`.
fn silu<T: StdFloat>(g: T) -> T {
    let one = T::from_f64(1.0);
    g / (one + (T::ZERO - g).exp())
}

/// The forward's CPU implementation (the kernel `r3_swiglu_f32` does the same).
fn swiglu_rows<T: StdFloat>(h: &[T], i: usize) -> Vec<T> {
    h.chunks(2 * i)
        .flat_map(|row| {
            let (gate, up) = row.split_at(i);
            gate.iter().zip(up).map(|(&g, &u)| silu(g) * u)
        })
        .collect()
}

/// The halves' width `I` of a `[.., 2I]` layout.
fn half_width(l: &Layout) -> usize {
    l.shape().dims().last().copied().unwrap_or(0) / 2
}

/// The output shape `[.., I]` of a `[.., 2I]` input.
fn halved(l: &Layout) -> Shape {
    let mut dims = l.shape().dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last /= 2;
    }
    Shape::from(dims)
}

impl CustomOp1 for SwigluHalves {
    fn name(&self) -> &'static str {
        "r3-swiglu-halves"
    }

    fn cpu_fwd(&self, h: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let i = half_width(l);
        let out = match h {
            CpuStorage::F32(h) => {
                let mut out = swiglu_rows(contiguous(h, l, "gate-up")?, i);
                if let Some(narrow) = self.round {
                    let round = crate::round16::rounding_for(narrow, "swiglu")?;
                    crate::round16::round_in_place(&mut out, round);
                }
                CpuStorage::F32(out)
            }
            CpuStorage::F64(h) => CpuStorage::F64(swiglu_rows(contiguous(h, l, "gate-up")?, i)),
            _ => candle_core::bail!("swiglu: the gate-up projection must be f32 or f64"),
        };
        Ok((out, halved(l)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        h: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let shape = halved(l);
        let n = shape.elem_count();
        // A grid-stride loop writing every output element.
        let out = cuda::launch_f32!(
            cuda::device(h),
            "r3_swiglu_f32",
            n,
            cuda::elementwise(n),
            [cuda::view::<f32>(h, l, "gate-up")?],
            [
                n as u64,
                half_width(l) as u32,
                cuda::round_code(self.round)?
            ]
        );
        Ok((out, shape))
    }

    fn bwd(&self, h: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        swiglu_halves_grad(h, grad, self.round).map(Some)
    }
}

/// The gradient of [`swiglu_halves_rounded`]'s op at the gate-up input `h` `[.., 2I]` (f32 or
/// f64, on a device [`swiglu_halves`] runs on) for the output gradient `grad` `[.., I]` (of
/// `h`'s dtype): the gradient first rounded to `round` where the op rounds (the rounding
/// point's backward), then the SwiGLU's. An op that holds its gate-up input itself
/// (`padded_experts.rs`) differentiates through it.
pub(crate) fn swiglu_halves_grad(
    h: &Tensor,
    grad: &Tensor,
    round: Option<DType>,
) -> candle_core::Result<Tensor> {
    let grad = match round {
        Some(narrow) => grad.apply_op1_no_bwd(&RoundTo { narrow })?,
        None => grad.contiguous()?,
    };
    h.contiguous()?
        .apply_op2_no_bwd(&grad.contiguous()?, &SwigluGrad)
}

/// The backward op `(h [.., 2I], d [.., I]) → dh [.., 2I]`: f32 or f64, or both operands in
/// one 16-bit float (computed in f32, `dh` written in that float:
/// [`swiglu_halves_grad_narrow`]).
#[derive(Debug, Clone, Copy)]
struct SwigluGrad;

/// The backward's CPU implementation (the kernel `r3_swiglu_grad_f32` does the same).
pub fn swiglu_grad_rows<T: StdFloat>(h: &[T], d: &[T], i: usize) -> Vec<T> {
    let one = T::from_f64(1.0);
    let mut dh = vec![T::ZERO; h.len()];
    for ((dst, row), dr) in dh.chunks_mut(2 * i).zip(h.chunks(2 * i)).zip(d.chunks(i)) {
        let (dgate, dup) = dst.split_at_mut(i);
        let (gate, up) = row.split_at(i);
        for j in 0..i {
            let (g, u, dd) = (gate[j], up[j], dr[j]);
            let s = one / (one + (T::ZERO - g).exp());
            dgate[j] = dd * u * (s * (one + g * (one - s)));
            dup[j] = dd * silu(g);
        }
    }
    dh
}

impl CustomOp2 for SwigluGrad {
    fn name(&self) -> &'static str {
        "r3-swiglu-halves-grad"
    }

    fn cpu_fwd(
        &self,
        h: &CpuStorage,
        hl: &Layout,
        d: &CpuStorage,
        dl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let i = half_width(hl);
        let narrow = h.dtype();
        if matches!(narrow, DType::BF16 | DType::F16) && d.dtype() == narrow {
            // Both widened (exactly), the f32 rows, narrowed (nearest, ties to even).
            let (hw, dw) = (h.to_dtype(hl, DType::F32)?, d.to_dtype(dl, DType::F32)?);
            let (CpuStorage::F32(hw), CpuStorage::F32(dw)) = (&hw, &dw) else {
                candle_core::bail!("16-bit swiglu gradient: the widened operands are not f32");
            };
            let dh = CpuStorage::F32(swiglu_grad_rows(hw, dw, i));
            return Ok((
                dh.to_dtype(&Layout::contiguous(hl.shape()), narrow)?,
                hl.shape().clone(),
            ));
        }
        let dh = match (h, d) {
            (CpuStorage::F32(h), CpuStorage::F32(d)) => CpuStorage::F32(swiglu_grad_rows(
                contiguous(h, hl, "gate-up")?,
                contiguous(d, dl, "swiglu gradient")?,
                i,
            )),
            (CpuStorage::F64(h), CpuStorage::F64(d)) => CpuStorage::F64(swiglu_grad_rows(
                contiguous(h, hl, "gate-up")?,
                contiguous(d, dl, "swiglu gradient")?,
                i,
            )),
            _ => candle_core::bail!(
                "swiglu: gate-up and gradient must be both f32, f64, bf16 or f16"
            ),
        };
        Ok((dh, hl.shape().clone()))
    }

    /// `r3_swiglu_grad_f32`, or `r3_swiglu_grad_narrow_bf16` / `_f16` for 16-bit operands.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        h: &candle_core::CudaStorage,
        hl: &Layout,
        d: &candle_core::CudaStorage,
        dl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        use candle_core::backend::BackendStorage;
        let n = dl.shape().elem_count();
        macro_rules! grad {
            ($kernel:literal, $t:ty) => {
                // A grid-stride loop over the `[.., I]` gradient writing both halves of each row.
                cuda::launch_typed!(
                    cuda::device(h),
                    $kernel,
                    $t,
                    2 * n,
                    cuda::elementwise(n),
                    [
                        cuda::view::<$t>(h, hl, "gate-up")?,
                        cuda::view::<$t>(d, dl, "swiglu gradient")?
                    ],
                    [n as u64, half_width(hl) as u32]
                )
            };
        }
        let dh = match (h.dtype(), d.dtype()) {
            (DType::F32, DType::F32) => grad!("r3_swiglu_grad_f32", f32),
            (DType::BF16, DType::BF16) => grad!("r3_swiglu_grad_narrow_bf16", half::bf16),
            (DType::F16, DType::F16) => grad!("r3_swiglu_grad_narrow_f16", half::f16),
            (a, b) => candle_core::bail!("swiglu gradient: gate-up {a:?}, gradient {b:?}"),
        };
        Ok((dh, hl.shape().clone()))
    }
}

/// `silu(h[.., :I]) · h[.., I:]` for a 16-bit `hidden` `[.., 2I]` (bf16 or f16), computed in
/// f32 and written in the same 16-bit float (nearest, ties to even), nothing differentiated:
/// the values of widening, [`swiglu_halves`] and narrowing, in one pass. None where the op
/// does not apply (another dtype, an operand to differentiate).
pub(crate) fn swiglu_halves_narrow(hidden: &Tensor) -> Result<Option<Tensor>> {
    let two_i = hidden.dims().last().copied().unwrap_or(0);
    let sixteen = matches!(hidden.dtype(), DType::BF16 | DType::F16);
    if two_i == 0 || !two_i.is_multiple_of(2) || !sixteen || hidden.track_op() {
        return Ok(None);
    }
    Ok(Some(
        hidden.contiguous()?.apply_op1_no_bwd(&SwigluHalvesNarrow)?,
    ))
}

/// The 16-bit op `[.., 2I] → [.., I]` ([`swiglu_halves_narrow`]).
#[derive(Debug, Clone, Copy)]
struct SwigluHalvesNarrow;

impl CustomOp1 for SwigluHalvesNarrow {
    fn name(&self) -> &'static str {
        "r3-swiglu-halves-16-bit"
    }

    /// Widened to f32, [`swiglu_rows`], narrowed (candle's casts: exact, then nearest with
    /// ties to even).
    fn cpu_fwd(&self, h: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let narrow = h.dtype();
        if !matches!(narrow, DType::BF16 | DType::F16) {
            candle_core::bail!("16-bit swiglu: the gate-up projection must be bf16 or f16");
        }
        let CpuStorage::F32(wide) = h.to_dtype(l, DType::F32)? else {
            candle_core::bail!("16-bit swiglu: the widened gate-up is not f32");
        };
        let shape = halved(l);
        let y = CpuStorage::F32(swiglu_rows(&wide, half_width(l)));
        Ok((y.to_dtype(&Layout::contiguous(&shape), narrow)?, shape))
    }

    /// `r3_swiglu_narrow_bf16` / `r3_swiglu_narrow_f16`.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        h: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        use candle_core::backend::BackendStorage;
        let shape = halved(l);
        let n = shape.elem_count();
        let half = half_width(l) as u32;
        // A grid-stride loop writing every output element.
        let out = match h.dtype() {
            DType::BF16 => cuda::launch_typed!(
                cuda::device(h),
                "r3_swiglu_narrow_bf16",
                half::bf16,
                n,
                cuda::elementwise(n),
                [cuda::view::<half::bf16>(h, l, "gate-up")?],
                [n as u64, half]
            ),
            DType::F16 => cuda::launch_typed!(
                cuda::device(h),
                "r3_swiglu_narrow_f16",
                half::f16,
                n,
                cuda::elementwise(n),
                [cuda::view::<half::f16>(h, l, "gate-up")?],
                [n as u64, half]
            ),
            dt => candle_core::bail!("16-bit swiglu: the gate-up projection is {dt:?}"),
        };
        Ok((out, shape))
    }
}

/// The gradient of the SwiGLU at a 16-bit gate-up `h` `[.., 2I]` for a 16-bit output gradient
/// `grad` `[.., I]` of the same float (bf16 or f16), computed in f32 and written in that float
/// (nearest, ties to even): the values of widening both, [`swiglu_halves_grad`] with the
/// rounding to that float (which leaves a gradient of its values as it is) and narrowing, in
/// one pass. None where the operands are not 16-bit of one float and shape (the caller
/// widens).
pub(crate) fn swiglu_halves_grad_narrow(h: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
    let dims = h.dims();
    let two_i = dims.last().copied().unwrap_or(0);
    let sixteen = matches!(h.dtype(), DType::BF16 | DType::F16) && grad.dtype() == h.dtype();
    let halves = two_i > 0 && two_i.is_multiple_of(2) && !dims.is_empty() && {
        let mut want = dims.to_vec();
        if let Some(last) = want.last_mut() {
            *last /= 2;
        }
        grad.dims() == want.as_slice()
    };
    if !sixteen || !halves || h.elem_count() == 0 {
        return Ok(None);
    }
    Ok(Some(
        h.contiguous()?
            .apply_op2_no_bwd(&grad.contiguous()?, &SwigluGrad)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::Var;

    /// The gradient at `h` of `Σ y ⊙ probe`.
    fn grad_at(h: &Var, y: &Tensor, probe: &Tensor) -> Tensor {
        let g = (y * probe)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
            .expect("backward");
        g.get(h.as_tensor()).expect("grad").clone()
    }

    /// The 16-bit op equals widening, the f32 op and narrowing bit for bit, in bf16 and
    /// f16; it does not apply to f32 input or to an operand being differentiated.
    #[test]
    fn the_16_bit_op_equals_the_f32_op_between_casts() {
        let bits = |t: &Tensor| crate::test_util::f32_bits(&t.to_dtype(DType::F32).expect("f32"));
        for narrow in [DType::BF16, DType::F16] {
            let h = (seeded_tensor(&[3, 2, 10], 7, DType::F32) * 4.0)
                .and_then(|t| t.to_dtype(narrow))
                .expect("hidden");
            let got = swiglu_halves_narrow(&h).expect("op").expect("applies");
            assert_eq!(got.dtype(), narrow);
            let want = swiglu_halves(&h.to_dtype(DType::F32).expect("wide"))
                .expect("f32 op")
                .expect("applies")
                .to_dtype(narrow)
                .expect("narrowed");
            assert_eq!(got.dims(), want.dims());
            assert_eq!(bits(&got), bits(&want), "{narrow:?}");
        }
        let wide = seeded_tensor(&[2, 8], 1, DType::F32);
        assert!(swiglu_halves_narrow(&wide).expect("f32").is_none());
        let tracked = Var::from_tensor(&wide.to_dtype(DType::BF16).expect("bf16")).expect("var");
        assert!(swiglu_halves_narrow(tracked.as_tensor())
            .expect("tracked")
            .is_none());
    }

    /// The 16-bit gradient op equals widening both operands, the f32 gradient with the
    /// rounding point's rounding and narrowing, bit for bit, in bf16 and f16 (and the
    /// narrowing is there: the f32 gradient holds values no 16-bit float does); it does not
    /// apply to mixed floats, f32 operands or a gradient of another shape.
    #[test]
    fn the_16_bit_gradient_equals_the_f32_gradient_between_casts() {
        let bits = |t: &Tensor| crate::test_util::f32_bits(&t.to_dtype(DType::F32).expect("f32"));
        for narrow in [DType::BF16, DType::F16] {
            let h = (seeded_tensor(&[3, 2, 10], 8, DType::F32) * 4.0)
                .and_then(|t| t.to_dtype(narrow))
                .expect("hidden");
            let d = (seeded_tensor(&[3, 2, 5], 9, DType::F32) * 1.37)
                .and_then(|t| t.to_dtype(narrow))
                .expect("gradient");
            let got = swiglu_halves_grad_narrow(&h, &d)
                .expect("op")
                .expect("applies");
            assert_eq!(got.dtype(), narrow);
            let wide = |t: &Tensor| t.to_dtype(DType::F32).expect("wide");
            let f32_grad = swiglu_halves_grad(&wide(&h), &wide(&d), Some(narrow)).expect("f32");
            let want = f32_grad.to_dtype(narrow).expect("narrowed");
            assert_eq!(got.dims(), want.dims());
            assert_eq!(bits(&got), bits(&want), "{narrow:?}");
            assert_ne!(bits(&got), bits(&f32_grad), "{narrow:?}: nothing narrowed");
            let other = if narrow == DType::BF16 {
                DType::F16
            } else {
                DType::BF16
            };
            let mixed = d.to_dtype(other).expect("other");
            assert!(swiglu_halves_grad_narrow(&h, &mixed)
                .expect("mixed")
                .is_none());
            let short = d.narrow(2, 0, 4).expect("short");
            assert!(swiglu_halves_grad_narrow(&h, &short)
                .expect("short")
                .is_none());
        }
        let h = seeded_tensor(&[2, 10], 1, DType::F32);
        let d = seeded_tensor(&[2, 5], 2, DType::F32);
        assert!(swiglu_halves_grad_narrow(&h, &d).expect("f32").is_none());
    }

    /// The value equals candle's composed `silu(gate) · up` bit for bit; the gradient equals
    /// the composed backward (f64 to 1e-12, f32 to 1e-5), for a 3-D input.
    #[test]
    fn equals_the_composed_ops() {
        for dtype in [DType::F64, DType::F32] {
            let h = Var::from_tensor(&(seeded_tensor(&[2, 3, 10], 1, dtype) * 4.0).expect("h"))
                .expect("var");
            let probe = seeded_tensor(&[2, 3, 5], 2, dtype);
            let composed = h
                .narrow(2, 0, 5)
                .and_then(|g| g.silu())
                .and_then(|g| g * h.narrow(2, 5, 5)?)
                .expect("composed");
            let fused = swiglu_halves(&h).expect("op").expect("applies on the CPU");
            assert_eq!(max_abs_diff(&fused, &composed), 0.0, "{dtype:?} value");
            let grad = |y: &Tensor| grad_at(&h, y, &probe);
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            let err = max_abs_diff(&grad(&fused), &grad(&composed));
            assert!(err < tol, "{dtype:?} gradient: {err}");
        }
        let odd = seeded_tensor(&[2, 3], 3, DType::F32);
        assert!(swiglu_halves(&odd).expect("odd").is_none());
    }

    /// Rounded in the op, the SwiGLU gives the bits of the op followed by the precision's
    /// rounding point, forward and backward, in bf16 and f16; at f32 (and for f64 input) it
    /// is the plain op.
    #[test]
    fn the_rounded_op_equals_the_op_then_the_rounding_point() {
        let bits = |t: &Tensor| crate::test_util::f32_bits(t);
        for precision in [
            Precision::Bf16 { router_f32: false },
            Precision::F16 { router_f32: false },
        ] {
            let h =
                Var::from_tensor(&(seeded_tensor(&[2, 3, 10], 5, DType::F32) * 4.0).expect("h"))
                    .expect("var");
            // A probe whose products are not 16-bit values, so the gradient's rounding shows.
            let probe = (seeded_tensor(&[2, 3, 5], 6, DType::F32) * 1.37).expect("probe");
            let fused = swiglu_halves_rounded(&h, precision)
                .expect("op")
                .expect("applies on the CPU");
            let two = precision
                .round(&swiglu_halves(&h).expect("op").expect("applies"))
                .expect("rounded");
            assert_eq!(bits(&fused), bits(&two), "{precision:?} value");
            let unrounded = swiglu_halves(&h).expect("op").expect("applies");
            assert_ne!(
                bits(&fused),
                bits(&unrounded),
                "{precision:?}: nothing rounded"
            );
            let grad = |y: &Tensor| grad_at(&h, y, &probe);
            assert_eq!(
                bits(&grad(&fused)),
                bits(&grad(&two)),
                "{precision:?} gradient"
            );
            assert_ne!(
                bits(&grad(&fused)),
                bits(&grad(&unrounded)),
                "{precision:?}: the gradient's rounding left out"
            );
        }
        let h = seeded_tensor(&[2, 10], 3, DType::F32);
        let plain = swiglu_halves(&h).expect("op").expect("applies");
        let at_f32 = swiglu_halves_rounded(&h, Precision::F32)
            .expect("op")
            .expect("applies");
        assert_eq!(bits(&at_f32), bits(&plain));
        let wide = seeded_tensor(&[2, 10], 3, DType::F64);
        let bf16 = Precision::Bf16 { router_f32: false };
        let kept = swiglu_halves_rounded(&wide, bf16)
            .expect("op")
            .expect("applies");
        assert_eq!(
            max_abs_diff(&kept, &swiglu_halves(&wide).expect("op").expect("applies")),
            0.0,
            "f64 is not rounded, as the rounding point leaves it"
        );
    }
}
