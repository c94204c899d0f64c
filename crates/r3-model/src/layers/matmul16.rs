//! `x · wᵀ` as one 16-bit tensor-core GEMM from f32 operands, keeping only the f32 operands
//! for the backward: a GPU's mixed-precision projection.
//!
//! Composed from casts (`x.to_dtype(bf16) · w.to_dtype(bf16)ᵀ`, widened), the graph kept the
//! 16-bit copies of the weight (2 bytes per parameter of every matmul until the backward: 11
//! GB on a 5.6 B-parameter model), of the input and of the output beside the f32 tensors it
//! already held. This op recasts the operands in its backward instead, and computes the
//! weight gradient of a projection over `[.., k]` rows as one GEMM over all rows (where
//! candle's broadcast matmul summed one 16-bit product per leading index in 16 bits).

use candle_core::{CustomOp2, DType, Tensor};

use super::precomputed::{precomputed_fwd, Precomputed};
use crate::cast16::cast16;
use crate::error::{ModelError, Result};
use crate::precision::WeightGradients;
use crate::weights::check_narrow_copy;

/// `x [.., k] · w [n, k]ᵀ → [.., n]` (or a stacked `w [b, n, k]` times `x [b, m, k]`) with
/// both operands rounded to `narrow` (bf16 / f16), f32 accumulation, the output rounded to
/// `narrow` and returned as f32. `x` is f32; `w` is f32 or already `narrow` (an inference
/// engine's weight copy: then no cast at all). `copy`, where given, is `w`'s 16-bit copy held
/// beside it by a trainer ([`Weights::hold_narrow_copies`]): the forward and the input
/// gradient read it instead of casting `w` again. Differentiable in `x` and `w`, whose
/// gradients are computed by 16-bit GEMMs too and returned in their own dtypes (`w`'s in
/// 16 bits, as the GEMM wrote it, where `grads` asks: [`WeightGradients`]).
///
/// [`Weights::hold_narrow_copies`]: crate::weights::Weights::hold_narrow_copies
pub fn matmul_wt_narrow(
    x: &Tensor,
    w: &Tensor,
    copy: Option<&Tensor>,
    narrow: DType,
    grads: WeightGradients,
) -> Result<Tensor> {
    if x.dtype() != DType::F32 || !(w.dtype() == DType::F32 || w.dtype() == narrow) {
        return Err(ModelError::Input(format!(
            "16-bit matmul of {:?} by {:?}: the input must be f32, the weight f32 or {narrow:?}",
            x.dtype(),
            w.dtype()
        )));
    }
    let stacked = match w.rank() {
        2 => false,
        3 if x.rank() == 3 && x.dim(0)? == w.dim(0)? => true,
        _ => {
            return Err(ModelError::Input(format!(
                "16-bit matmul: input {:?} and weight {:?} are neither [.., k]·[n, k] nor [b, m, k]·[b, n, k]",
                x.dims(),
                w.dims()
            )))
        }
    };
    if let Some(copy) = copy {
        check_narrow_copy(w, copy, Some(narrow))?;
    }
    let x = x.contiguous()?;
    let xn = cast16(&x.detach(), narrow)?;
    let value = narrowed_product(&xn, copy.unwrap_or(w), narrow, stacked)?;
    if !x.track_op() && !w.track_op() {
        // Nothing to differentiate (inference): the value, without the op's copy of it.
        return Ok(value);
    }
    let op = Matmul16 {
        value: Precomputed::new(value),
        narrow,
        stacked,
        copy: copy.map(Tensor::detach),
        grads,
    };
    Ok(x.apply_op2(w, op)?)
}

/// `xn · w` for the input already in `narrow` (`xn`, contiguous) and `w` f32 or `narrow`:
/// the weight cast, one 16-bit GEMM, the output widened to f32.
pub(crate) fn narrowed_product(
    xn: &Tensor,
    w: &Tensor,
    narrow: DType,
    stacked: bool,
) -> Result<Tensor> {
    let wn = cast16(&w.detach(), narrow)?;
    let value = if xn.rank() == 2 && !stacked {
        xn.matmul(&wn.t()?)?
    } else {
        xn.broadcast_matmul(&wn.t()?)?
    };
    Ok(cast16(&value, DType::F32)?)
}

/// [`matmul_wt_narrow`]'s value for several `[n, k]` weights sharing the input `x` (f32),
/// nothing differentiated: the input cast to `narrow` once for all of them (a layer's q, k
/// and v projections: two kernels fewer than three separate products).
pub(crate) fn matmul_wt_narrow_shared(
    x: &Tensor,
    ws: &[&Tensor],
    narrow: DType,
) -> Result<Vec<Tensor>> {
    let fits = |w: &Tensor| w.rank() == 2 && (w.dtype() == DType::F32 || w.dtype() == narrow);
    if x.dtype() != DType::F32 || !ws.iter().all(|w| fits(w)) {
        return Err(ModelError::Input(format!(
            "16-bit matmuls sharing an input: the input ({:?}) must be f32, the weights \
             [n, k] in f32 or {narrow:?}",
            x.dtype()
        )));
    }
    let xn = cast16(&x.contiguous()?.detach(), narrow)?;
    ws.iter()
        .map(|w| narrowed_product(&xn, w, narrow, false))
        .collect()
}

/// The op: its value precomputed, its backward from the f32 operands.
#[derive(Debug)]
struct Matmul16 {
    value: Precomputed,
    narrow: DType,
    /// `w` is `[b, n, k]`, one matrix per leading index of `x` `[b, m, k]`.
    stacked: bool,
    /// `w`'s held 16-bit copy, read by the input gradient instead of a cast of `w`.
    copy: Option<Tensor>,
    /// The dtype `w`'s gradient is returned in.
    grads: WeightGradients,
}

impl CustomOp2 for Matmul16 {
    fn name(&self) -> &'static str {
        "matmul-16-bit"
    }

    precomputed_fwd!(2);

    /// `dx = g w`, `dw = gᵀ x`, each a 16-bit GEMM of the rounded operands.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let n = self.narrow;
        let xn = cast16(&x.detach(), n)?;
        let wn = match &self.copy {
            Some(copy) => copy.clone(),
            None => cast16(&w.detach(), n)?,
        };
        let gn = cast16(&grad.detach(), n)?;
        let (dx, dw) = if self.stacked {
            (gn.matmul(&wn)?, gn.t()?.matmul(&xn)?)
        } else {
            let k = w.dim(1)?;
            let rows = x.elem_count() / k.max(1);
            let g2 = gn.reshape((rows, w.dim(0)?))?;
            let x2 = xn.reshape((rows, k))?;
            (g2.matmul(&wn)?.reshape(x.dims())?, g2.t()?.matmul(&x2)?)
        };
        let dw = match self.grads {
            WeightGradients::Narrow => dw,
            WeightGradients::InWeightDtype => cast16(&dw, w.dtype())?,
        };
        Ok((Some(cast16(&dx, DType::F32)?), Some(dw)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::Var;

    const WIDE: WeightGradients = WeightGradients::InWeightDtype;

    /// The casts-and-matmul composition the op replaces.
    fn composed(x: &Tensor, w: &Tensor, n: DType) -> Tensor {
        let (xn, wn) = (
            x.to_dtype(n).expect("x"),
            w.to_dtype(n).and_then(|w| w.t()).expect("w"),
        );
        let y = if x.rank() == 2 && w.rank() == 2 {
            xn.matmul(&wn)
        } else {
            xn.broadcast_matmul(&wn)
        };
        y.and_then(|y| y.to_dtype(DType::F32)).expect("y")
    }

    /// Value bit for bit the composition's; gradients within 16-bit rounding of the
    /// composition's (their sums run in another order), for a 2-D and a 3-D input by a
    /// matrix and for stacked weights, in bf16 and f16.
    #[test]
    fn equals_the_composed_casts_and_matmul() {
        let cases: [(&[usize], &[usize]); 3] = [
            (&[6, 8], &[5, 8]),
            (&[2, 3, 8], &[5, 8]),
            (&[3, 4, 8], &[3, 5, 8]),
        ];
        for n in [DType::BF16, DType::F16] {
            for (i, (xs, ws)) in cases.iter().enumerate() {
                let x = Var::from_tensor(&seeded_tensor(xs, 10 + i as u64, DType::F32)).expect("x");
                let w = Var::from_tensor(&seeded_tensor(ws, 20 + i as u64, DType::F32)).expect("w");
                let want = composed(&x, &w, n);
                let got = matmul_wt_narrow(&x, &w, None, n, WIDE).expect("op");
                assert_eq!(max_abs_diff(&got, &want), 0.0, "{n:?} case {i} value");
                let probe = seeded_tensor(want.dims(), 30 + i as u64, DType::F32);
                let grads = |y: &Tensor| {
                    let g = (y * &probe)
                        .and_then(|l| l.sum_all())
                        .and_then(|l| l.backward())
                        .expect("backward");
                    [&x, &w].map(|v| g.get(v).expect("grad").clone())
                };
                let tol = if n == DType::BF16 { 3e-2 } else { 4e-3 };
                for (name, (gw, gg)) in ["x", "w"]
                    .iter()
                    .zip(grads(&want).iter().zip(grads(&got).iter()))
                {
                    let scale = gw
                        .abs()
                        .and_then(|a| a.max_all())
                        .and_then(|m| m.to_scalar::<f32>())
                        .expect("scale") as f64;
                    let err = max_abs_diff(gw, gg);
                    assert!(
                        err <= tol * scale,
                        "{n:?} case {i} d{name}: {err} of {scale}"
                    );
                }
            }
        }
        // A weight already in the 16-bit float gives the same value as its f32 original.
        let x = seeded_tensor(&[2, 3, 8], 40, DType::F32);
        let w = seeded_tensor(&[5, 8], 41, DType::F32);
        let wn = w.to_dtype(DType::BF16).expect("narrow");
        let a = matmul_wt_narrow(&x, &w, None, DType::BF16, WIDE).expect("f32 weight");
        let b = matmul_wt_narrow(&x, &wn, None, DType::BF16, WIDE).expect("bf16 weight");
        assert_eq!(max_abs_diff(&a, &b), 0.0);
        assert!(matmul_wt_narrow(
            &x,
            &w.to_dtype(DType::F16).expect("f16"),
            None,
            DType::BF16,
            WIDE
        )
        .is_err());
        let bad = Tensor::zeros((2, 3), DType::BF16, &candle_core::Device::Cpu).expect("t");
        let w = Tensor::zeros((4, 3), DType::F32, &candle_core::Device::Cpu).expect("t");
        assert!(matmul_wt_narrow(&bad, &w, None, DType::BF16, WIDE).is_err());
    }

    /// A weight variable held in bf16 (a trainer's `train.master_weights = "bf16"`, the path
    /// a GPU takes) is differentiated too: its gradient comes back in bf16 either way the
    /// trainer asks, the same bits as an f32 weight of the same values hands back rounded,
    /// and the input's gradient is the f32 weight's bit for bit.
    #[test]
    fn a_bf16_weight_variable_gets_its_gradient_in_bf16() {
        let x = Var::from_tensor(&seeded_tensor(&[2, 3, 8], 60, DType::F32)).expect("x");
        let w16 = seeded_tensor(&[5, 8], 61, DType::F32)
            .to_dtype(DType::BF16)
            .expect("bf16");
        let w32 = Var::from_tensor(&w16.to_dtype(DType::F32).expect("widen")).expect("w");
        let w16 = Var::from_tensor(&w16).expect("w");
        let probe = seeded_tensor(&[2, 3, 5], 62, DType::F32);
        for grads in [WeightGradients::InWeightDtype, WeightGradients::Narrow] {
            let run = |w: &Var| {
                let y = matmul_wt_narrow(&x, w, None, DType::BF16, grads).expect("op");
                let g = (&y * &probe)
                    .and_then(|l| l.sum_all())
                    .and_then(|l| l.backward())
                    .expect("backward");
                let dw = g.get(w).expect("dw").clone();
                let dx = g.get(&x).expect("dx").clone();
                (y, dx, dw)
            };
            let (y32, dx32, dw32) = run(&w32);
            let (y16, dx16, dw16) = run(&w16);
            assert_eq!(dw16.dtype(), DType::BF16, "{grads:?}");
            let f32_bits = crate::test_util::f32_bits;
            assert_eq!(f32_bits(&y32), f32_bits(&y16));
            assert_eq!(f32_bits(&dx32), f32_bits(&dx16));
            let as_bf16 = |t: &Tensor| {
                let rounded = cast16(t, DType::BF16).and_then(|t| cast16(&t, DType::F32));
                f32_bits(&rounded.expect("rounded"))
            };
            assert_eq!(as_bf16(&dw32), as_bf16(&dw16), "{grads:?}");
        }
    }

    /// With the weight's held 16-bit copy, value and both gradients are bit for bit the
    /// product's without it (the copy holds the values the op would cast to). A copy made
    /// different from the weight shows that the forward and the input gradient read it (the
    /// weight gradient, `gᵀ x`, reads no weight). A copy of another dtype or shape is
    /// refused.
    #[test]
    fn a_held_copy_of_the_weight_gives_the_same_product_and_gradients() {
        let bits = crate::test_util::f32_bits;
        for n in [DType::BF16, DType::F16] {
            let x = Var::from_tensor(&seeded_tensor(&[2, 3, 8], 50, DType::F32)).expect("x");
            let w = Var::from_tensor(&seeded_tensor(&[5, 8], 51, DType::F32)).expect("w");
            let probe = seeded_tensor(&[2, 3, 5], 52, DType::F32);
            let run = |copy: Option<&Tensor>| {
                let y = matmul_wt_narrow(&x, &w, copy, n, WIDE).expect("op");
                let g = (&y * &probe)
                    .and_then(|l| l.sum_all())
                    .and_then(|l| l.backward())
                    .expect("backward");
                let dx = g.get(&x).expect("dx").clone();
                let dw = g.get(&w).expect("dw").clone();
                [y, dx, dw].map(|t| bits(&t))
            };
            let copy = w.to_dtype(n).expect("copy");
            assert_eq!(run(Some(&copy)), run(None), "{n:?}");
            let other = (w.as_tensor() * 1.5)
                .and_then(|t| t.to_dtype(n))
                .expect("other");
            let [y, dx, dw] = run(Some(&other));
            let [y0, dx0, dw0] = run(None);
            assert_ne!(y, y0, "{n:?}: the forward read the copy");
            assert_ne!(dx, dx0, "{n:?}: the input gradient read the copy");
            assert_eq!(dw, dw0, "{n:?}: the weight gradient reads no weight");
            let wrong_shape = seeded_tensor(&[5, 7], 53, DType::F32)
                .to_dtype(n)
                .expect("t");
            assert!(matmul_wt_narrow(&x, &w, Some(&wrong_shape), n, WIDE).is_err());
            assert!(matmul_wt_narrow(&x, &w, Some(w.as_tensor()), n, WIDE).is_err());
        }
    }

    /// Handed back narrow (`WeightGradients::Narrow`) the weight's gradient is the same
    /// values in the 16-bit float, for a 2-D and a stacked weight; the input's is unchanged.
    #[test]
    fn a_narrow_weight_gradient_has_the_wide_ones_values() {
        let bits = crate::test_util::f32_bits;
        for n in [DType::BF16, DType::F16] {
            for (xs, ws) in [
                (&[2usize, 3, 8][..], &[5usize, 8][..]),
                (&[3, 4, 8], &[3, 5, 8]),
            ] {
                let x = Var::from_tensor(&seeded_tensor(xs, 60, DType::F32)).expect("x");
                let w = Var::from_tensor(&seeded_tensor(ws, 61, DType::F32)).expect("w");
                let run = |grads| {
                    let y = matmul_wt_narrow(&x, &w, None, n, grads).expect("op");
                    let probe = seeded_tensor(y.dims(), 62, DType::F32);
                    let g = (&y * &probe)
                        .and_then(|l| l.sum_all())
                        .and_then(|l| l.backward())
                        .expect("backward");
                    [&x, &w].map(|v| g.get(v).expect("grad").clone())
                };
                let ([dx, dw], [nx, nw]) = (run(WIDE), run(WeightGradients::Narrow));
                assert_eq!((dw.dtype(), nw.dtype()), (DType::F32, n), "{ws:?}");
                assert_eq!(nx.dtype(), DType::F32);
                let widened = nw.to_dtype(DType::F32).expect("widen");
                assert_eq!(bits(&dw), bits(&widened), "{n:?} {ws:?}: dw");
                assert_eq!(bits(&dx), bits(&nx), "{n:?} {ws:?}: dx");
            }
        }
    }
}
