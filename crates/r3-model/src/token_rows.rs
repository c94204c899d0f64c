//! The recomputing token log-prob's value and gradient (`token_stats`
//! `token_log_probs_recomputed`, the path off the CPU's fused op) as single passes over the
//! logits rows: `(z[t] − max) − log Σ exp(z − max)` per row, and `−g · exp(z − lse) + g · 1[t]`.
//! The composed forms broadcast a per-row value over `[rows, vocab]` three times forward and
//! twice backward; on an H200 each such pass over a mid step's `[4096, 32000]` logits took
//! 2.25 ms (candle's broadcast kernels compute strided indices per element). Each op has a
//! CPU implementation, which the tests hold to candle's composed ops, and a CUDA kernel
//! (`cuda/kernels.cu`: the same operations per element; the value's sum of exponentials in
//! its block's order, so within rounding of the CPU's) that the device tests hold to the CPU.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use crate::host::contiguous;
use crate::math::StdFloat;

/// `log softmax(logits)[target]` per row of contiguous `[rows, vocab]` logits (no gradient;
/// the caller's op supplies it); NaN for a target past the vocabulary.
pub(crate) fn token_logp_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits
        .contiguous()?
        .apply_op2_no_bwd(&targets.contiguous()?, &TokenLogProbRows)
}

/// The logits' gradient `−g · exp(z − lse) + g · 1[j = target]` of `[rows, vocab]` logits,
/// with each row's `(lse, g)` in `row_stats` `[rows, 2]`.
pub(crate) fn token_logp_grad_rows(
    logits: &Tensor,
    targets: &Tensor,
    row_stats: &Tensor,
) -> Result<Tensor> {
    logits.contiguous()?.apply_op3_no_bwd(
        &targets.contiguous()?,
        &row_stats.contiguous()?,
        &TokenLogProbGrad,
    )
}

/// Each row's entropy `−Σ p log p` of its softmax and its log-sum-exp, `[rows, 2]` of `(H,
/// lse)`, for contiguous `[rows, vocab]` logits (no gradient; [`entropy_grad_rows`] is the
/// caller's backward).
pub(crate) fn entropy_rows(logits: &Tensor) -> Result<Tensor> {
    logits.contiguous()?.apply_op1_no_bwd(&EntropyRows)
}

/// The entropy's gradient `−g · p_j · (log p_j + H)` of `[rows, vocab]` logits, with each
/// row's `(H, lse)` in `stats` `[rows, 2]` ([`entropy_rows`]) and its gradient `g` in
/// `grad` `[rows]`.
pub(crate) fn entropy_grad_rows(logits: &Tensor, stats: &Tensor, grad: &Tensor) -> Result<Tensor> {
    logits.contiguous()?.apply_op3_no_bwd(
        &stats.contiguous()?,
        &grad.contiguous()?,
        &EntropyGradRows,
    )
}

/// The rows and vocabulary of `[rows, vocab]` logits, checked against the targets' count and
/// (for the gradient) the `[rows, 2]` row stats'.
fn rows_and_vocab(ll: &Layout, tl: &Layout, stats: Option<&Layout>) -> Result<(usize, usize)> {
    let &[rows, vocab] = ll.shape().dims() else {
        candle_core::bail!("token rows: logits {:?} are not [rows, vocab]", ll.shape());
    };
    let stats_fit = stats.is_none_or(|sl| sl.shape().elem_count() == 2 * rows);
    if vocab == 0 || tl.shape().elem_count() != rows || !stats_fit {
        candle_core::bail!(
            "token rows: logits {:?}, targets {:?}, row stats {:?} do not fit",
            ll.shape(),
            tl.shape(),
            stats.map(|sl| sl.shape())
        );
    }
    Ok((rows, vocab))
}

/// [`token_logp_rows`]' op.
#[derive(Debug, Clone, Copy)]
struct TokenLogProbRows;

/// The CPU implementation (the CUDA kernel `r3_token_logprob_f32` does the same operations
/// per element, its sum of exponentials in its block's order: within rounding of this).
fn logp_rows<T: StdFloat>(logits: &[T], vocab: usize, targets: &[u32]) -> Vec<T> {
    logits
        .chunks(vocab)
        .zip(targets)
        .map(|(z, &t)| {
            let max = row_max(z);
            let mut sum = T::ZERO;
            for &v in z {
                sum = sum + (v - max).exp();
            }
            match z.get(t as usize) {
                Some(&zt) => (zt - max) - sum.ln(),
                None => T::NAN,
            }
        })
        .collect()
}

/// The largest of a row's values, a NaN losing (the kernels' `block_row_max`).
fn row_max<T: StdFloat>(z: &[T]) -> T {
    z.iter()
        .fold(T::NEG_INFINITY, |max, &v| if v > max { v } else { max })
}

impl CustomOp2 for TokenLogProbRows {
    fn name(&self) -> &'static str {
        "r3-token-logprob-rows"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        ll: &Layout,
        targets: &CpuStorage,
        tl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab) = rows_and_vocab(ll, tl, None)?;
        let CpuStorage::U32(t) = targets else {
            candle_core::bail!("token rows: targets must be u32");
        };
        let t = contiguous(t, tl, "targets")?;
        let out = match logits {
            CpuStorage::F32(z) => {
                CpuStorage::F32(logp_rows(contiguous(z, ll, "logits")?, vocab, t))
            }
            CpuStorage::F64(z) => {
                CpuStorage::F64(logp_rows(contiguous(z, ll, "logits")?, vocab, t))
            }
            _ => candle_core::bail!("token rows: logits must be f32 or f64"),
        };
        Ok((out, Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        ll: &Layout,
        targets: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;

        let (rows, vocab) = rows_and_vocab(ll, tl, None)?;
        // Block `r` reads row `r` and writes its one entry.
        let out = cuda::launch_f32!(
            cuda::device(logits),
            "r3_token_logprob_f32",
            rows,
            cuda::per_row(rows, cuda::row_threads(vocab))?,
            [
                cuda::view::<f32>(logits, ll, "logits")?,
                cuda::view::<u32>(targets, tl, "targets")?
            ],
            [vocab as u32]
        );
        Ok((out, Shape::from(rows)))
    }
}

/// [`token_logp_grad_rows`]' op.
#[derive(Debug, Clone, Copy)]
struct TokenLogProbGrad;

/// The CPU implementation (the CUDA kernel `r3_token_logprob_grad_f32` does the same
/// arithmetic).
fn logp_grad_rows<T: StdFloat>(logits: &[T], vocab: usize, targets: &[u32], stats: &[T]) -> Vec<T> {
    let mut out = vec![T::ZERO; logits.len()];
    for (r, (dst, z)) in out.chunks_mut(vocab).zip(logits.chunks(vocab)).enumerate() {
        let (lse, g) = (stats[2 * r], stats[2 * r + 1]);
        for (d, &v) in dst.iter_mut().zip(z) {
            *d = T::ZERO - g * (v - lse).exp();
        }
        if let Some(d) = dst.get_mut(targets[r] as usize) {
            *d = *d + g;
        }
    }
    out
}

impl CustomOp3 for TokenLogProbGrad {
    fn name(&self) -> &'static str {
        "r3-token-logprob-grad"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        ll: &Layout,
        targets: &CpuStorage,
        tl: &Layout,
        stats: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, vocab) = rows_and_vocab(ll, tl, Some(sl))?;
        let CpuStorage::U32(t) = targets else {
            candle_core::bail!("token rows: targets must be u32");
        };
        let t = contiguous(t, tl, "targets")?;
        let out = match (logits, stats) {
            (CpuStorage::F32(z), CpuStorage::F32(s)) => CpuStorage::F32(logp_grad_rows(
                contiguous(z, ll, "logits")?,
                vocab,
                t,
                contiguous(s, sl, "row stats")?,
            )),
            (CpuStorage::F64(z), CpuStorage::F64(s)) => CpuStorage::F64(logp_grad_rows(
                contiguous(z, ll, "logits")?,
                vocab,
                t,
                contiguous(s, sl, "row stats")?,
            )),
            _ => candle_core::bail!("token rows: logits and row stats must be both f32 or f64"),
        };
        Ok((out, ll.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        ll: &Layout,
        targets: &candle_core::CudaStorage,
        tl: &Layout,
        stats: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;

        let (rows, vocab) = rows_and_vocab(ll, tl, Some(sl))?;
        // Block `r` writes row `r`.
        let out = cuda::launch_f32!(
            cuda::device(logits),
            "r3_token_logprob_grad_f32",
            rows * vocab,
            cuda::per_row(rows, cuda::row_threads(vocab))?,
            [
                cuda::view::<f32>(logits, ll, "logits")?,
                cuda::view::<u32>(targets, tl, "targets")?,
                cuda::view::<f32>(stats, sl, "row stats")?
            ],
            [vocab as u32]
        );
        Ok((out, ll.shape().clone()))
    }
}

/// The rows and vocabulary of `[rows, vocab]` logits, checked against `[rows, 2]` row stats
/// and a `[rows]` gradient where given.
fn entropy_rows_and_vocab(
    ll: &Layout,
    stats: Option<(&Layout, &Layout)>,
) -> Result<(usize, usize)> {
    let &[rows, vocab] = ll.shape().dims() else {
        candle_core::bail!(
            "entropy rows: logits {:?} are not [rows, vocab]",
            ll.shape()
        );
    };
    let fit = stats
        .is_none_or(|(sl, gl)| sl.shape().dims() == [rows, 2] && gl.shape().elem_count() == rows);
    if vocab == 0 || !fit {
        candle_core::bail!(
            "entropy rows: logits {:?}, row stats {:?} and gradient {:?} do not fit",
            ll.shape(),
            stats.map(|(sl, _)| sl.shape()),
            stats.map(|(_, gl)| gl.shape())
        );
    }
    Ok((rows, vocab))
}

/// [`entropy_rows`]' op.
#[derive(Debug, Clone, Copy)]
struct EntropyRows;

/// The CPU implementation (the CUDA kernel `r3_entropy_rows_f32` does the same operations
/// per element, its sums in its block's order: within rounding of this): with `m` the row's
/// max, `S = Σ exp(z − m)` and `T = Σ exp(z − m)·(z − m)` (a −∞ logit adding nothing),
/// `H = log S − T / S` and `lse = m + log S`.
fn entropy_row_stats<T: StdFloat>(logits: &[T], vocab: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(2 * logits.len() / vocab.max(1));
    for z in logits.chunks(vocab) {
        let max = row_max(z);
        let (mut s, mut t) = (T::ZERO, T::ZERO);
        for &v in z {
            let d = v - max;
            let e = d.exp();
            s = s + e;
            if e > T::ZERO {
                t = t + e * d;
            }
        }
        let log_s = s.ln();
        out.push(log_s - t / s);
        out.push(max + log_s);
    }
    out
}

impl CustomOp1 for EntropyRows {
    fn name(&self) -> &'static str {
        "r3-entropy-rows"
    }

    fn cpu_fwd(&self, logits: &CpuStorage, ll: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab) = entropy_rows_and_vocab(ll, None)?;
        let out = match logits {
            CpuStorage::F32(z) => {
                CpuStorage::F32(entropy_row_stats(contiguous(z, ll, "logits")?, vocab))
            }
            CpuStorage::F64(z) => {
                CpuStorage::F64(entropy_row_stats(contiguous(z, ll, "logits")?, vocab))
            }
            _ => candle_core::bail!("entropy rows: logits must be f32 or f64"),
        };
        Ok((out, Shape::from((rows, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        ll: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;

        let (rows, vocab) = entropy_rows_and_vocab(ll, None)?;
        // Block `r` reads row `r` and writes its two entries.
        let out = cuda::launch_f32!(
            cuda::device(logits),
            "r3_entropy_rows_f32",
            2 * rows,
            cuda::per_row(rows, cuda::row_threads(vocab))?,
            [cuda::view::<f32>(logits, ll, "logits")?],
            [vocab as u32]
        );
        Ok((out, Shape::from((rows, 2))))
    }
}

/// [`entropy_grad_rows`]' op.
#[derive(Debug, Clone, Copy)]
struct EntropyGradRows;

/// The CPU implementation (the CUDA kernel `r3_entropy_grad_f32` does the same arithmetic):
/// `0 − g · p · (lp + H)` with `lp = z − lse`, `p = exp(lp)`; 0 where `p` is.
fn entropy_grad_of<T: StdFloat>(logits: &[T], vocab: usize, stats: &[T], grad: &[T]) -> Vec<T> {
    let mut out = vec![T::ZERO; logits.len()];
    for (r, (dst, z)) in out.chunks_mut(vocab).zip(logits.chunks(vocab)).enumerate() {
        let (h, lse, g) = (stats[2 * r], stats[2 * r + 1], grad[r]);
        for (d, &v) in dst.iter_mut().zip(z) {
            let lp = v - lse;
            let p = lp.exp();
            *d = if p > T::ZERO {
                T::ZERO - g * p * (lp + h)
            } else {
                T::ZERO
            };
        }
    }
    out
}

impl CustomOp3 for EntropyGradRows {
    fn name(&self) -> &'static str {
        "r3-entropy-grad-rows"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        ll: &Layout,
        stats: &CpuStorage,
        sl: &Layout,
        grad: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, vocab) = entropy_rows_and_vocab(ll, Some((sl, gl)))?;
        let out = match (logits, stats, grad) {
            (CpuStorage::F32(z), CpuStorage::F32(s), CpuStorage::F32(g)) => {
                CpuStorage::F32(entropy_grad_of(
                    contiguous(z, ll, "logits")?,
                    vocab,
                    contiguous(s, sl, "row stats")?,
                    contiguous(g, gl, "gradient")?,
                ))
            }
            (CpuStorage::F64(z), CpuStorage::F64(s), CpuStorage::F64(g)) => {
                CpuStorage::F64(entropy_grad_of(
                    contiguous(z, ll, "logits")?,
                    vocab,
                    contiguous(s, sl, "row stats")?,
                    contiguous(g, gl, "gradient")?,
                ))
            }
            _ => candle_core::bail!(
                "entropy rows: logits, row stats and gradient must be all f32 or all f64"
            ),
        };
        Ok((out, ll.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        ll: &Layout,
        stats: &candle_core::CudaStorage,
        sl: &Layout,
        grad: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;

        let (rows, vocab) = entropy_rows_and_vocab(ll, Some((sl, gl)))?;
        // Block `r` writes row `r`.
        let out = cuda::launch_f32!(
            cuda::device(logits),
            "r3_entropy_grad_f32",
            rows * vocab,
            cuda::per_row(rows, cuda::row_threads(vocab))?,
            [
                cuda::view::<f32>(logits, ll, "logits")?,
                cuda::view::<f32>(stats, sl, "row stats")?,
                cuda::view::<f32>(grad, gl, "gradient")?
            ],
            [vocab as u32]
        );
        Ok((out, ll.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::{DType, Device, D};

    /// Seeded `[rows, vocab]` logits spread wide enough that rows differ in their maxima.
    fn logits(rows: usize, vocab: usize, dtype: DType) -> Tensor {
        (seeded_tensor(&[rows, vocab], 7, dtype) * 9.0).expect("logits")
    }

    /// Each row's value equals candle's composed `log_softmax` + `gather` bit for bit; a
    /// target past the vocabulary reads NaN (the caller checks targets first).
    #[test]
    fn rows_equal_the_composed_log_softmax() {
        for dtype in [DType::F64, DType::F32] {
            let z = logits(5, 11, dtype);
            let t = Tensor::new(&[0u32, 10, 4, 4, 7], &Device::Cpu).expect("t");
            let got = token_logp_rows(&z, &t).expect("rows");
            let max = z.max_keepdim(1).expect("max");
            let shifted = z.broadcast_sub(&max).expect("sub");
            let lse = shifted
                .exp()
                .and_then(|e| e.sum_keepdim(1))
                .and_then(|s| s.log())
                .expect("lse");
            let want = shifted
                .broadcast_sub(&lse)
                .and_then(|l| l.gather(&t.unsqueeze(1).expect("u"), 1))
                .and_then(|l| l.squeeze(1))
                .expect("want");
            assert_eq!(max_abs_diff(&got, &want), 0.0, "{dtype:?}");
        }
        let z = logits(2, 3, DType::F32);
        let past = Tensor::new(&[1u32, 3], &Device::Cpu).expect("t");
        let got = token_logp_rows(&z, &past)
            .and_then(|v| v.to_vec1::<f32>())
            .expect("rows");
        assert!(got[0].is_finite() && got[1].is_nan(), "{got:?}");
    }

    /// The gradient equals the composed broadcast form bit for bit, and, summed over a row,
    /// is `g · (1 − Σ softmax) = 0` to rounding (an independent check of the formula).
    #[test]
    fn grad_rows_equal_the_composed_form() {
        for dtype in [DType::F64, DType::F32] {
            let z = logits(4, 9, dtype);
            let t = Tensor::new(&[2u32, 0, 8, 2], &Device::Cpu).expect("t");
            let lse = z
                .exp()
                .and_then(|e| e.sum_keepdim(1))
                .and_then(|s| s.log())
                .expect("lse");
            let g = Tensor::new(&[0.5f64, -1.5, 2.0, 0.25], &Device::Cpu)
                .and_then(|g| g.to_dtype(dtype))
                .and_then(|g| g.unsqueeze(1))
                .expect("g");
            let stats = Tensor::cat(&[&lse, &g], 1).expect("stats");
            let got = token_logp_grad_rows(&z, &t, &stats).expect("grad");
            let want = z
                .broadcast_sub(&lse)
                .and_then(|d| d.exp())
                .and_then(|d| d.broadcast_mul(&g.neg().expect("neg")))
                .and_then(|d| d.scatter_add(&t.unsqueeze(1).expect("u"), &g, 1))
                .expect("want");
            assert_eq!(max_abs_diff(&got, &want), 0.0, "{dtype:?}");
            let row_sums = got.sum(D::Minus1).expect("sums");
            let zero = row_sums.zeros_like().expect("zero");
            assert!(max_abs_diff(&row_sums, &zero) < 1e-5, "{dtype:?}");
        }
    }
}
