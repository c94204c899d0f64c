//! The composed attention's row softmax as single passes: `softmax(scores · scale + mask)`
//! reading the `[B, 1, 1, T, S]` mask per query row (no broadcast add over the scores, no
//! separate max / subtract / exp / sum / divide kernels), and the softmax backward
//! `p ⊙ (dp − Σ dO ⊙ O)` (no broadcast subtract). Each is an op with a CPU implementation,
//! which the tests hold to candle's composed ops, and a CUDA kernel (`cuda/kernels.cu`: the
//! same operations per element; the softmax's sum in its block's order, so within rounding of
//! the CPU's) that the device tests hold to the CPU. On an H200 the composed forms
//! took ≈ 2 ms of a mid layer's 5.6 ms forward: candle's broadcast kernels compute strided
//! indices per element. `attention_probs` builds the probabilities on them for the composed
//! attention and the recomputing op alike (one home, so neither attention file imports the
//! other).

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, D};

use crate::device::row_ops_run_on;
use crate::host::contiguous;
use crate::math::StdFloat;

/// The probabilities `softmax(q kᵀ · scale + additive)` `[B, KV, G·T, S]` of contiguous `q`
/// `[B, KV, G·T, Dq]` and `k` `[B, KV, S, Dq]` (contiguous, or a KV cache's view of the
/// first `S` slots of a longer buffer: the matmul reads its strides): the composed attention's and the recomputing
/// op's (forward and backward). Where nothing is differentiated through them and the mask is
/// `[B, 1, 1, T, S]`, one pass ([`masked_softmax`], the same arithmetic as candle's ops, bit
/// for bit on the CPU); else candle's composed ops.
pub(crate) fn attention_probs(
    q: &Tensor,
    k: &Tensor,
    additive: &Tensor,
    scale: f64,
    groups: usize,
) -> candle_core::Result<Tensor> {
    probs_of_scores(q.matmul(&k.t()?)?, additive, scale, groups)
}

/// The probabilities `softmax(raw · scale + additive)` of the raw scores `q kᵀ` `[B, KV,
/// G·T, S]` ([`attention_probs`] after its product).
pub(crate) fn probs_of_scores(
    raw: Tensor,
    additive: &Tensor,
    scale: f64,
    groups: usize,
) -> candle_core::Result<Tensor> {
    let (b, kv, gt, s) = raw.dims4()?;
    let groups = groups.max(1);
    // Nothing differentiated through the probabilities (the recomputing op builds them from
    // detached inputs; inference): one pass reading the mask per query row.
    if let Some(probs) = masked_softmax(&raw, additive, scale)? {
        return Ok(probs);
    }
    let scores = (raw * scale)?
        .reshape((b, kv, groups, gt / groups, s))?
        .broadcast_add(additive)?;
    candle_nn::ops::softmax(&scores, D::Minus1)?.reshape((b, kv, gt, s))
}

/// `softmax(scores · scale + mask)` over the last dimension of contiguous `scores`
/// `[B, KV, G·T, S]` (rows ordered batch, head, query) with `mask` `[B, 1, 1, T, S]`; None
/// where the op does not apply (another device or dtype, a mask of another shape, a tensor
/// that needs gradients) and the caller composes. f32 and f64 on the CPU, f32 on a GPU.
pub(crate) fn masked_softmax(scores: &Tensor, mask: &Tensor, scale: f64) -> Result<Option<Tensor>> {
    let (b, kv, gt, s) = scores.dims4()?;
    let fits_mask =
        matches!(mask.dims(), &[mb, 1, 1, t, ms] if mb == b && ms == s && t > 0 && gt % t == 0);
    if !fits_mask || scores.track_op() || mask.dtype() != scores.dtype() || !row_ops_run_on(scores)
    {
        return Ok(None);
    }
    let t = mask.dim(3)?;
    let op = MaskedSoftmax {
        scale,
        t_rows: t,
        rows_per_batch: kv * gt,
    };
    Ok(Some(
        scores
            .contiguous()?
            .apply_op2_no_bwd(&mask.contiguous()?, &op)?,
    ))
}

/// `p ⊙ (dp − row_dot)` with `p`, `dp` `[.., S]` and `row_dot` `[.., 1]` (each row's
/// `Σ dO ⊙ O`); None where the op does not apply, as [`masked_softmax`].
pub(crate) fn softmax_grad(p: &Tensor, dp: &Tensor, row_dot: &Tensor) -> Result<Option<Tensor>> {
    let rows = p.elem_count() / p.dims().last().copied().unwrap_or(1).max(1);
    if p.dims() != dp.dims()
        || row_dot.elem_count() != rows
        || p.dtype() != dp.dtype()
        || p.dtype() != row_dot.dtype()
        || !row_ops_run_on(p)
    {
        return Ok(None);
    }
    Ok(Some(p.contiguous()?.apply_op3_no_bwd(
        &dp.contiguous()?,
        &row_dot.contiguous()?,
        &SoftmaxGrad,
    )?))
}

/// [`masked_softmax`]'s op.
#[derive(Debug, Clone, Copy)]
struct MaskedSoftmax {
    scale: f64,
    /// Query rows per head (`T`): row `r`'s mask row is `(r / rows_per_batch) · T + r % T`.
    t_rows: usize,
    /// Rows per batch element (`KV · G · T`).
    rows_per_batch: usize,
}

/// The CPU implementation (the CUDA kernel `r3_masked_softmax_f32` does the same operations
/// per element, its sum in its block's order, and a GPU build may fuse `s · scale + m`: so
/// within rounding of this): per row `x = s · scale + m`, its max, `e = exp(x − max)` summed
/// in order, `e / sum`.
fn masked_softmax_rows<T: StdFloat>(
    scores: &[T],
    mask: &[T],
    cols: usize,
    op: &MaskedSoftmax,
) -> Vec<T> {
    let scale = T::from_f64(op.scale);
    let mut out = vec![T::ZERO; scores.len()];
    for (r, (dst, src)) in out.chunks_mut(cols).zip(scores.chunks(cols)).enumerate() {
        let (b, t) = (r / op.rows_per_batch, r % op.t_rows);
        let m = &mask[(b * op.t_rows + t) * cols..][..cols];
        let mut max = T::NEG_INFINITY;
        for (&s, &mk) in src.iter().zip(m) {
            let x = s * scale + mk;
            if x > max {
                max = x;
            }
        }
        let mut sum = T::ZERO;
        for ((d, &s), &mk) in dst.iter_mut().zip(src).zip(m) {
            *d = (s * scale + mk - max).exp();
            sum = sum + *d;
        }
        for d in dst.iter_mut() {
            *d = *d / sum;
        }
    }
    out
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "r3-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        scores: &CpuStorage,
        sl: &Layout,
        mask: &CpuStorage,
        ml: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let cols = *sl.shape().dims().last().unwrap_or(&1);
        let out = match (scores, mask) {
            (CpuStorage::F32(s), CpuStorage::F32(m)) => CpuStorage::F32(masked_softmax_rows(
                contiguous(s, sl, "scores")?,
                contiguous(m, ml, "mask")?,
                cols,
                self,
            )),
            (CpuStorage::F64(s), CpuStorage::F64(m)) => CpuStorage::F64(masked_softmax_rows(
                contiguous(s, sl, "scores")?,
                contiguous(m, ml, "mask")?,
                cols,
                self,
            )),
            _ => candle_core::bail!("masked softmax: scores and mask must be both f32 or f64"),
        };
        Ok((out, sl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        scores: &candle_core::CudaStorage,
        sl: &Layout,
        mask: &candle_core::CudaStorage,
        ml: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;

        let s = cuda::view::<f32>(scores, sl, "scores")?;
        let m = cuda::view::<f32>(mask, ml, "mask")?;
        let cols = *sl.shape().dims().last().unwrap_or(&1);
        let rows = sl.shape().elem_count() / cols.max(1);
        // Each block reads and writes its own row of `cols` entries.
        let out = cuda::launch_f32!(
            cuda::device(scores),
            "r3_masked_softmax_f32",
            sl.shape().elem_count(),
            cuda::per_row(rows, cuda::row_threads(cols))?,
            [s, m],
            [
                self.scale as f32,
                cols as u32,
                self.t_rows as u32,
                self.rows_per_batch as u32
            ]
        );
        Ok((out, sl.shape().clone()))
    }
}

/// [`softmax_grad`]'s op.
#[derive(Debug, Clone, Copy)]
struct SoftmaxGrad;

/// The CPU implementation (the CUDA kernel `r3_softmax_grad_f32` does the same arithmetic).
fn softmax_grad_rows<T: StdFloat>(p: &[T], dp: &[T], row_dot: &[T], cols: usize) -> Vec<T> {
    p.iter()
        .zip(dp)
        .enumerate()
        .map(|(i, (&p, &dp))| p * (dp - row_dot[i / cols]))
        .collect()
}

impl CustomOp3 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "r3-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        p: &CpuStorage,
        pl: &Layout,
        dp: &CpuStorage,
        dl: &Layout,
        row: &CpuStorage,
        rl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let cols = *pl.shape().dims().last().unwrap_or(&1);
        let out = match (p, dp, row) {
            (CpuStorage::F32(p), CpuStorage::F32(d), CpuStorage::F32(r)) => {
                CpuStorage::F32(softmax_grad_rows(
                    contiguous(p, pl, "probabilities")?,
                    contiguous(d, dl, "dp")?,
                    contiguous(r, rl, "row dots")?,
                    cols.max(1),
                ))
            }
            (CpuStorage::F64(p), CpuStorage::F64(d), CpuStorage::F64(r)) => {
                CpuStorage::F64(softmax_grad_rows(
                    contiguous(p, pl, "probabilities")?,
                    contiguous(d, dl, "dp")?,
                    contiguous(r, rl, "row dots")?,
                    cols.max(1),
                ))
            }
            _ => candle_core::bail!("softmax grad: inputs must be all f32 or all f64"),
        };
        Ok((out, pl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &candle_core::CudaStorage,
        pl: &Layout,
        dp: &candle_core::CudaStorage,
        dl: &Layout,
        row: &candle_core::CudaStorage,
        rl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;

        let n = pl.shape().elem_count();
        let cols = (*pl.shape().dims().last().unwrap_or(&1)).max(1);
        let out = cuda::launch_f32!(
            cuda::device(p),
            "r3_softmax_grad_f32",
            n,
            cuda::elementwise(n),
            [
                cuda::view::<f32>(p, pl, "probabilities")?,
                cuda::view::<f32>(dp, dl, "dp")?,
                cuda::view::<f32>(row, rl, "row dots")?
            ],
            [cols as u32, n as u64]
        );
        Ok((out, pl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::attention::AttentionMask;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::{DType, Device, Var, D};

    /// The composed form the op replaces.
    fn composed(scores: &Tensor, mask: &Tensor, scale: f64, groups: usize) -> Tensor {
        let (b, kv, gt, s) = scores.dims4().expect("dims");
        let x = (scores * scale)
            .and_then(|x| x.reshape((b, kv, groups, gt / groups, s)))
            .and_then(|x| x.broadcast_add(mask))
            .expect("scores");
        candle_nn::ops::softmax(&x, D::Minus1)
            .and_then(|p| p.reshape((b, kv, gt, s)))
            .expect("softmax")
    }

    /// Equal to candle's composed ops bit for bit (f64, f32), with grouped query heads, key
    /// padding, a sliding window and more keys than queries' rows would need.
    #[test]
    fn masked_softmax_equals_the_composed_ops() {
        let (b, kv, groups, t) = (2, 2, 3, 5);
        for dtype in [DType::F64, DType::F32] {
            for window in [None, Some(2)] {
                let mask = AttentionMask::new(&[5, 3], t, window, &Device::Cpu)
                    .and_then(|m| m.to_dtype(dtype))
                    .expect("mask");
                let scores = seeded_tensor(&[b, kv, groups * t, t], 11, dtype);
                let got = masked_softmax(&scores, mask.additive(), 0.37)
                    .expect("op")
                    .expect("applies");
                let want = composed(&scores, mask.additive(), 0.37, groups);
                assert_eq!(max_abs_diff(&got, &want), 0.0, "{dtype:?} {window:?}");
            }
        }
    }

    /// The op steps aside where it does not apply: scores that need gradients, a mask of
    /// another shape, a dtype it has no kernel for.
    #[test]
    fn masked_softmax_declines_what_it_does_not_cover() {
        let mask = AttentionMask::new(&[4], 4, None, &Device::Cpu).expect("mask");
        let tracked = Var::from_tensor(&seeded_tensor(&[1, 1, 4, 4], 1, DType::F32)).expect("v");
        assert!(masked_softmax(tracked.as_tensor(), mask.additive(), 1.0)
            .expect("op")
            .is_none());
        let scores = seeded_tensor(&[1, 1, 4, 4], 1, DType::F32);
        let flat = mask.additive().reshape((1, 4, 4)).expect("flat");
        assert!(masked_softmax(&scores, &flat, 1.0).expect("op").is_none());
        let half = scores.to_dtype(DType::F16).expect("f16");
        let half_mask = mask.additive().to_dtype(DType::F16).expect("f16");
        assert!(masked_softmax(&half, &half_mask, 1.0)
            .expect("op")
            .is_none());
        // an empty batch takes candle's own ops (no zero-row launch on a GPU)
        let empty = Tensor::zeros((0, 1, 4, 4), DType::F32, &Device::Cpu).expect("empty");
        let empty_mask = Tensor::zeros((0, 1, 1, 4, 4), DType::F32, &Device::Cpu).expect("m");
        assert!(masked_softmax(&empty, &empty_mask, 1.0)
            .expect("op")
            .is_none());
        // three query rows per head do not divide into the mask's four
        let odd = seeded_tensor(&[1, 1, 3, 4], 1, DType::F32);
        assert!(masked_softmax(&odd, mask.additive(), 1.0)
            .expect("op")
            .is_none());
    }

    /// `p ⊙ (dp − row)` equals the composed broadcast form bit for bit.
    #[test]
    fn softmax_grad_equals_the_composed_ops() {
        for dtype in [DType::F64, DType::F32] {
            let p = seeded_tensor(&[2, 3, 4, 6], 1, dtype);
            let dp = seeded_tensor(&[2, 3, 4, 6], 2, dtype);
            let row = seeded_tensor(&[2, 3, 4, 1], 3, dtype);
            let got = softmax_grad(&p, &dp, &row).expect("op").expect("applies");
            let want = dp
                .broadcast_sub(&row)
                .and_then(|d| &p * d)
                .expect("composed");
            assert_eq!(max_abs_diff(&got, &want), 0.0, "{dtype:?}");
            let short = seeded_tensor(&[2, 3, 4, 2], 3, dtype);
            assert!(softmax_grad(&p, &dp, &short).expect("op").is_none());
        }
    }
}
