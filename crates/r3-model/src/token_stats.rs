//! Per-position statistics of next-token logits — the log-probability of a given token and
//! the entropy — as fused, differentiable ops over rows of `[.., V]` logits.
//!
//! Composed from candle ops, `log_softmax` + `gather` makes about a dozen full passes (and
//! as many fresh buffers) over the logits forward and backward; at a 32k vocabulary that was
//! a third of a training step. Here each direction is one parallel pass over the rows, and
//! the backward is written straight into the logits gradient.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::device::row_ops_run_on;
use crate::error::{ModelError, Result};
use crate::host::{contiguous, with_host};
use crate::layers::precomputed::{precomputed_fwd, Precomputed};
use crate::math::{lane_sum, log_sum_exp, row_max, Float};
use crate::token_rows;

/// `log softmax(logits)[target]` for every row: logits `[.., V]` (f32/f64, CPU), targets
/// `[..]` u32 → `[..]`, differentiable in the logits.
pub fn token_log_probs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    log_probs_of(logits, targets, None)
}

/// [`token_log_probs`] with the targets also given on the host (`host_targets`, the same
/// values as `targets`, row-major): the vocabulary check runs on them, so a GPU is not
/// stopped to read the largest target back before the log-probs (a target past the
/// vocabulary is an error naming its row). The trainer holds its targets on the host; where
/// the two disagree the device's kernels still never read past a row (they give NaN for a
/// target outside the vocabulary).
pub fn token_log_probs_host_checked(
    logits: &Tensor,
    targets: &Tensor,
    host_targets: &[u32],
) -> Result<Tensor> {
    log_probs_of(logits, targets, Some(host_targets))
}

/// [`token_log_probs`], the targets' range checked on `host_targets` where given, else where
/// the log-probs are computed (the fused CPU op, or one scalar read back from a device).
fn log_probs_of(logits: &Tensor, targets: &Tensor, host_targets: Option<&[u32]>) -> Result<Tensor> {
    let dims = logits.dims();
    let Some((&vocab, lead)) = dims.split_last() else {
        return Err(ModelError::Input("token log-probs of a scalar".into()));
    };
    let host_len_fits = host_targets.is_none_or(|h| h.len() == targets.elem_count());
    if targets.dims() != lead || !host_len_fits {
        let on_host = host_targets.map_or(String::new(), |h| format!(" ({} on the host)", h.len()));
        return Err(ModelError::Input(format!(
            "targets have shape {:?}{on_host}, logits {dims:?}: expected {lead:?}",
            targets.dims()
        )));
    }
    if let Some((row, t)) = host_targets
        .into_iter()
        .flatten()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(ModelError::Input(format!(
            "token stats: target {t} in row {row} is outside the vocabulary of {vocab}"
        )));
    }
    if fused(logits) {
        // The op reads `[.., V]` as rows and returns `[..]`: no reshape nodes whose
        // backward would each fill and add a logits-sized gradient.
        let targets = targets.to_dtype(DType::U32)?.contiguous()?;
        return Ok(logits.contiguous()?.apply_op2(&targets, TokenLogProb)?);
    }
    let rows = lead.iter().product::<usize>();
    let logits2 = logits.reshape((rows, vocab))?.contiguous()?;
    let targets1 = targets.to_dtype(DType::U32)?.reshape(rows)?.contiguous()?;
    let value = match host_targets {
        Some(_) => recomputed_in_range(&logits2, &targets1)?,
        None => token_log_probs_recomputed(&logits2, &targets1)?,
    };
    Ok(value.reshape(lead)?)
}

/// [`token_log_probs`] from candle's composed ops, `[R, V]` logits and `[R]` targets: the
/// reference the fused op and [`token_log_probs_recomputed`] are tested against.
pub fn token_log_probs_composed(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logp = log_softmax_composed(logits)?;
    Ok(logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?)
}

/// [`token_log_probs_composed`]'s value (the same arithmetic, outside the graph: one pass per
/// row where r3's row ops run, else the composed ops) in an op whose backward recomputes the
/// softmax from the logits: the graph keeps the logits alone, where the composed form kept
/// three more logits-sized tensors (shifted, exponentiated, log-softmax) until the backward.
/// Every device (the GPU's path). A target past the vocabulary is an error (one scalar read
/// back from the device; [`token_log_probs_host_checked`] checks host targets instead).
pub fn token_log_probs_recomputed(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    if targets.dims() != [rows] {
        return Err(ModelError::Input(format!(
            "targets have shape {:?}, logits [{rows}, {vocab}]: expected [{rows}]",
            targets.dims()
        )));
    }
    // u32 from here on (the row ops' index type; a no-op for the trainer's own targets).
    let targets = &targets.to_dtype(DType::U32)?;
    if rows > 0 {
        let largest = targets.max(0)?.to_scalar::<u32>()?;
        if largest as usize >= vocab {
            return Err(ModelError::Input(format!(
                "token stats: target {largest} is outside the vocabulary of {vocab}"
            )));
        }
    }
    recomputed_in_range(logits, targets)
}

/// [`token_log_probs_recomputed`] of u32 `targets` `[rows]` already known to lie inside the
/// vocabulary of `logits` `[rows, V]`.
fn recomputed_in_range(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let value = if row_ops_run_on(logits) {
        // One pass per row (the same arithmetic as the composed ops).
        token_rows::token_logp_rows(&logits.detach(), targets)?
    } else {
        token_log_probs_composed(&logits.detach(), targets)?
    };
    if !logits.track_op() {
        // Nothing to differentiate (inference): the value, without the op's copy of it.
        return Ok(value);
    }
    let op = RecomputedTokenLogProb {
        value: Precomputed::new(value),
    };
    Ok(logits.contiguous()?.apply_op2(targets, op)?)
}

/// Entropy `−Σ p log p` of the softmax of every row: logits `[.., V]` → `[..]`,
/// differentiable in the logits.
pub fn entropy(logits: &Tensor) -> Result<Tensor> {
    let dims = logits.dims();
    let Some((&vocab, lead)) = dims.split_last() else {
        return Err(ModelError::Input("entropy of a scalar".into()));
    };
    if fused(logits) {
        return Ok(logits.contiguous()?.apply_op1(Entropy)?);
    }
    let rows = lead.iter().product::<usize>();
    let logits2 = logits.reshape((rows, vocab))?.contiguous()?;
    if row_ops_run_on(&logits2) {
        // A GPU's f32 logits (the CPU's took the fused op).
        return Ok(entropy_by_rows(&logits2)?.reshape(lead)?);
    }
    let logp = log_softmax_composed(&logits2)?;
    let out = logp.exp()?.mul(&logp)?.sum(1)?.neg()?;
    Ok(out.reshape(lead)?)
}

/// [`entropy`] of contiguous `[rows, vocab]` logits by the row ops (on a GPU one block a row,
/// two reads of each row: the composed ops made five temporaries of the logits' size, ≈ 14
/// passes, 35 GB at 4,096 tokens of a 151,936-token vocabulary): the value from
/// `token_rows::entropy_rows`, its gradient from `token_rows::entropy_grad_rows`.
fn entropy_by_rows(logits: &Tensor) -> Result<Tensor> {
    let stats = token_rows::entropy_rows(&logits.detach())?;
    let value = stats.narrow(1, 0, 1)?.squeeze(1)?.contiguous()?;
    if !logits.track_op() {
        return Ok(value);
    }
    let op = RowEntropy {
        value: Precomputed::new(value),
        stats,
    };
    Ok(logits.apply_op1(op)?)
}

/// [`entropy_by_rows`]' differentiable op: its value precomputed, its backward one pass per
/// row with the rows' `(H, lse)` kept from the forward.
#[derive(Debug)]
struct RowEntropy {
    value: Precomputed,
    stats: Tensor,
}

impl CustomOp1 for RowEntropy {
    fn name(&self) -> &'static str {
        "r3-entropy-by-rows"
    }

    precomputed_fwd!(1);

    fn bwd(
        &self,
        logits: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.detach().to_dtype(logits.dtype())?;
        Ok(Some(token_rows::entropy_grad_rows(
            &logits.detach(),
            &self.stats,
            &grad,
        )?))
    }
}

/// Whether the fused CPU kernels handle this tensor.
fn fused(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// `log_softmax` over dim 1 from candle ops (other devices and dtypes; the tests' reference).
fn log_softmax_composed(logits: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

/// [`token_log_probs_recomputed`]'s op: its value precomputed, its backward
/// `d/dz_j = g · (1[j = target] − softmax_j)` with each row's log-sum-exp recovered from the
/// value as `z[target] − logp`.
#[derive(Debug)]
struct RecomputedTokenLogProb {
    value: Precomputed,
}

impl CustomOp2 for RecomputedTokenLogProb {
    fn name(&self) -> &'static str {
        "r3-token-logprob-recomputed"
    }

    precomputed_fwd!(2);

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        logp: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let logits = logits.detach();
        let targets = targets.detach().unsqueeze(1)?;
        let grad = grad.detach().unsqueeze(1)?;
        let lse = (logits.gather(&targets, 1)? - logp.detach().unsqueeze(1)?)?;
        if row_ops_run_on(&logits) && grad.dtype() == logits.dtype() {
            // One pass over the logits (the same arithmetic as the composed form below).
            let row_stats = Tensor::cat(&[&lse, &grad], 1)?;
            let d = token_rows::token_logp_grad_rows(&logits, &targets.squeeze(1)?, &row_stats)?;
            return Ok((Some(d), None));
        }
        let d = logits
            .broadcast_sub(&lse)?
            .exp()?
            .broadcast_mul(&grad.neg()?)?;
        Ok((Some(d.scatter_add(&targets, &grad, 1)?), None))
    }
}

/// The contiguous elements of `[.., vocab]` logits and `vocab`.
fn rows_of<'a, T>(data: &'a [T], layout: &Layout) -> candle_core::Result<(&'a [T], usize)> {
    Ok((
        contiguous(data, layout, "logits")?,
        vocab_of(layout.shape())?,
    ))
}

/// The last dimension of `[.., vocab]` logits.
fn vocab_of(shape: &Shape) -> candle_core::Result<usize> {
    match shape.dims().last() {
        Some(&v) if v > 0 => Ok(v),
        _ => candle_core::bail!("token stats: logits {shape:?} have no vocabulary dimension"),
    }
}

/// `[.., vocab]` → `[..]`.
fn lead_shape(shape: &Shape) -> Shape {
    let dims = shape.dims();
    Shape::from(dims[..dims.len().saturating_sub(1)].to_vec())
}

/// Log-probability of the target token in each row.
struct TokenLogProb;

fn token_logp_fwd<T: Float>(
    logits: &[T],
    vocab: usize,
    targets: &[u32],
) -> candle_core::Result<Vec<T>> {
    if let Some((r, &t)) = targets
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        candle_core::bail!(
            "token stats: target {t} in row {r} is outside the vocabulary of {vocab}"
        );
    }
    Ok(logits
        .par_chunks(vocab)
        .zip(targets.par_iter())
        .map(|(row, &t)| row[t as usize] - log_sum_exp(row))
        .collect())
}

/// `d/dz_j = g · (1[j = target] − softmax_j)`; the forward's output `logp` gives each row's
/// log-sum-exp back as `z[target] − logp`.
fn token_logp_bwd<T: Float>(
    logits: &[T],
    vocab: usize,
    targets: &[u32],
    logp: &[T],
    grad: &[T],
) -> Vec<T> {
    let mut out = vec![T::ZERO; logits.len()];
    out.par_chunks_mut(vocab)
        .zip(logits.par_chunks(vocab))
        .zip(targets.par_iter().zip(logp.par_iter().zip(grad.par_iter())))
        .for_each(|((dst, row), (&t, (&lp, &g)))| {
            let t = t as usize;
            let lse = row[t] - lp;
            for (d, &z) in dst.iter_mut().zip(row) {
                *d = T::ZERO - g * (z - lse).exp();
            }
            dst[t] = dst[t] + g;
        });
    out
}

impl CustomOp2 for TokenLogProb {
    fn name(&self) -> &'static str {
        "r3-token-logprob"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        ll: &Layout,
        targets: &CpuStorage,
        tl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::U32(targets) = targets else {
            candle_core::bail!("token stats: targets must be u32");
        };
        let targets = contiguous(targets, tl, "targets")?;
        if targets.len() * vocab_of(ll.shape())? != ll.shape().elem_count() {
            candle_core::bail!(
                "token stats: {} targets for logits {:?}",
                targets.len(),
                ll.shape()
            );
        }
        let out = match logits {
            CpuStorage::F32(v) => {
                let (v, vocab) = rows_of(v, ll)?;
                CpuStorage::F32(token_logp_fwd(v, vocab, targets)?)
            }
            CpuStorage::F64(v) => {
                let (v, vocab) = rows_of(v, ll)?;
                CpuStorage::F64(token_logp_fwd(v, vocab, targets)?)
            }
            _ => candle_core::bail!("token stats: logits must be f32 or f64"),
        };
        Ok((out, lead_shape(ll.shape())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        logp: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let vocab = vocab_of(logits.shape())?;
        let d = with_host::<u32, _>(targets, |t| match logits.dtype() {
            DType::F32 => with_host::<f32, _>(logits, |z| {
                with_host::<f32, _>(logp, |lp| {
                    with_host::<f32, _>(grad, |g| Ok(token_logp_bwd(z, vocab, t, lp, g)))
                })
            })
            .and_then(|d| Tensor::from_vec(d, logits.shape(), logits.device())),
            DType::F64 => with_host::<f64, _>(logits, |z| {
                with_host::<f64, _>(logp, |lp| {
                    with_host::<f64, _>(grad, |g| Ok(token_logp_bwd(z, vocab, t, lp, g)))
                })
            })
            .and_then(|d| Tensor::from_vec(d, logits.shape(), logits.device())),
            dt => candle_core::bail!("token stats: no backward for {dt:?}"),
        })?;
        Ok((Some(d), None))
    }
}

/// Entropy of each row's softmax.
struct Entropy;

/// A row's entropy and log-sum-exp: with `m` its largest logit, `S = Σ e^(z−m)` and
/// `T = Σ e^(z−m) (z−m)`, `H = log S − T / S` and `lse = m + log S` (as the GPU's row
/// kernels compute them). Centred on `m`, nothing cancels: `lse − Σ p z` lost ≈ 5e-5 in f32
/// on logits around 30, where both terms are ≈ 30. A `−∞` logit adds nothing (its `p z` was
/// `0 · −∞`, a NaN).
fn entropy_and_lse<T: Float>(row: &[T]) -> (T, T) {
    let max = row_max(row);
    let s = lane_sum(row, |z| (z - max).exp());
    // f32's `exp` (`fast_exp`) of −∞ is its clamp's 1.2e-38, not 0: the −∞ logit is
    // matched itself.
    let t = lane_sum(row, |z| {
        if z == T::NEG_INFINITY {
            T::ZERO
        } else {
            (z - max).exp() * (z - max)
        }
    });
    let log_s = s.ln();
    (T::from_f64(log_s - t / s), max + T::from_f64(log_s))
}

/// Each row's [`entropy_and_lse`] entropy.
fn entropy_fwd<T: Float>(logits: &[T], vocab: usize) -> Vec<T> {
    logits
        .par_chunks(vocab)
        .map(|row| entropy_and_lse(row).0)
        .collect()
}

/// `dH/dz_j = −p_j (log p_j + H)` (0 at a `−∞` logit, whose `p_j` is).
fn entropy_bwd<T: Float>(logits: &[T], vocab: usize, grad: &[T]) -> Vec<T> {
    let mut out = vec![T::ZERO; logits.len()];
    out.par_chunks_mut(vocab)
        .zip(logits.par_chunks(vocab))
        .zip(grad.par_iter())
        .for_each(|((dst, row), &g)| {
            let (h, lse) = entropy_and_lse(row);
            for (d, &z) in dst.iter_mut().zip(row) {
                let logp = z - lse;
                *d = if z == T::NEG_INFINITY {
                    T::ZERO
                } else {
                    T::ZERO - g * logp.exp() * (logp + h)
                };
            }
        });
    out
}

impl CustomOp1 for Entropy {
    fn name(&self) -> &'static str {
        "r3-entropy"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        ll: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = match logits {
            CpuStorage::F32(v) => {
                let (v, vocab) = rows_of(v, ll)?;
                CpuStorage::F32(entropy_fwd(v, vocab))
            }
            CpuStorage::F64(v) => {
                let (v, vocab) = rows_of(v, ll)?;
                CpuStorage::F64(entropy_fwd(v, vocab))
            }
            _ => candle_core::bail!("token stats: logits must be f32 or f64"),
        };
        Ok((out, lead_shape(ll.shape())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let vocab = vocab_of(logits.shape())?;
        let d = match logits.dtype() {
            DType::F32 => with_host::<f32, _>(logits, |z| {
                with_host::<f32, _>(grad, |g| Ok(entropy_bwd(z, vocab, g)))
            })
            .and_then(|d| Tensor::from_vec(d, logits.shape(), logits.device()))?,
            DType::F64 => with_host::<f64, _>(logits, |z| {
                with_host::<f64, _>(grad, |g| Ok(entropy_bwd(z, vocab, g)))
            })
            .and_then(|d| Tensor::from_vec(d, logits.shape(), logits.device()))?,
            dt => candle_core::bail!("token stats: no backward for {dt:?}"),
        };
        Ok(Some(d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::max_abs_diff as max_diff;
    use candle_core::{Device, Var};

    fn logits(rows: usize, vocab: usize, dtype: DType) -> Tensor {
        let data: Vec<f64> = (0..rows * vocab)
            .map(|i| (((i * 37 + 11) % 101) as f64 / 101.0 - 0.5) * 6.0)
            .collect();
        Tensor::from_vec(data, (rows, vocab), &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .expect("logits")
    }

    /// Gradient of `Σ weights · out` with respect to `z`.
    fn grad_of(out: &Tensor, weights: &Tensor, z: &Var) -> Tensor {
        let grads = (out * weights)
            .and_then(|t| t.sum_all())
            .and_then(|l| l.backward())
            .expect("backward");
        grads.get(z.as_tensor()).expect("gradient").clone()
    }

    /// The recomputing op (the GPU's path) equals the composed ops: the value bit for bit,
    /// the logits' gradient to rounding (f64 1e-13, f32 1e-6), rows sharing a target.
    #[test]
    fn recomputed_op_equals_the_composed_ops() {
        for dtype in [DType::F64, DType::F32] {
            let z = Var::from_tensor(&logits(6, 9, dtype)).expect("var");
            let targets = Tensor::new(&[0u32, 8, 3, 3, 5, 1], &Device::Cpu).expect("t");
            let w = Tensor::new(&[0.5f32, -1.0, 2.0, 0.25, 1.5, -0.75], &Device::Cpu)
                .and_then(|w| w.to_dtype(dtype))
                .expect("w");
            let want = token_log_probs_composed(&z, &targets).expect("composed");
            let got = token_log_probs_recomputed(&z, &targets).expect("recomputed");
            assert_eq!(max_diff(&got, &want), 0.0, "{dtype:?} value");
            let tol = if dtype == DType::F64 { 1e-13 } else { 1e-6 };
            let err = max_diff(&grad_of(&got, &w, &z), &grad_of(&want, &w, &z));
            assert!(err < tol, "{dtype:?} gradient {err}");
            let bad = Tensor::new(&[1u32, 2], &Device::Cpu).expect("t");
            assert!(token_log_probs_recomputed(&z, &bad).is_err());
        }
    }

    /// `[B, T, V]` logits give the values and gradients of the same rows as `[B·T, V]`.
    #[test]
    fn batched_logits_equal_flat_rows() {
        let flat = Var::from_tensor(&logits(6, 9, DType::F32)).expect("var");
        let batched = Var::from_tensor(&flat.reshape((2, 3, 9)).expect("reshape")).expect("var");
        let targets = Tensor::new(&[0u32, 8, 3, 3, 5, 1], &Device::Cpu).expect("t");
        let w = Tensor::new(&[0.5f32, -1.0, 2.0, 0.25, 1.5, -0.75], &Device::Cpu).expect("w");
        let t2 = targets.reshape((2, 3)).expect("t2");
        let w2 = w.reshape((2, 3)).expect("w2");
        let lp_flat = token_log_probs(&flat, &targets).expect("flat");
        let lp_batched = token_log_probs(&batched, &t2).expect("batched");
        assert_eq!(lp_batched.dims(), &[2, 3]);
        assert_eq!(max_diff(&lp_batched.flatten_all().unwrap(), &lp_flat), 0.0);
        let g_flat = grad_of(&lp_flat, &w, &flat);
        let g_batched = grad_of(&lp_batched, &w2, &batched);
        assert_eq!(max_diff(&g_batched.reshape((6, 9)).unwrap(), &g_flat), 0.0);
        let h_flat = entropy(&flat).expect("entropy");
        let h_batched = entropy(&batched).expect("entropy");
        assert_eq!(max_diff(&h_batched.flatten_all().unwrap(), &h_flat), 0.0);
        let g_flat = grad_of(&h_flat, &w, &flat);
        let g_batched = grad_of(&h_batched, &w2, &batched);
        assert_eq!(max_diff(&g_batched.reshape((6, 9)).unwrap(), &g_flat), 0.0);
        // Wrong target count is an error naming both shapes.
        let bad = Tensor::new(&[0u32, 1], &Device::Cpu).expect("bad");
        assert!(token_log_probs(&batched, &bad).is_err());
    }

    /// Fused values and gradients equal the composed `log_softmax` path (and a hand value).
    #[test]
    fn fused_ops_match_composed_ops() {
        for dtype in [DType::F64, DType::F32] {
            let tol = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
            let z = Var::from_tensor(&logits(6, 9, dtype)).expect("var");
            let targets = Tensor::new(&[0u32, 8, 3, 3, 5, 1], &Device::Cpu).expect("t");
            let weights = logits(1, 6, dtype).squeeze(0).expect("w");

            let fused = token_log_probs(z.as_tensor(), &targets).expect("fused");
            let logp = log_softmax_composed(z.as_tensor()).expect("lsm");
            let composed = logp
                .gather(&targets.unsqueeze(1).expect("u"), 1)
                .and_then(|t| t.squeeze(1))
                .expect("gather");
            assert!(max_diff(&fused, &composed) < tol, "{dtype:?} log-probs");
            let (a, b) = (
                grad_of(&fused, &weights, &z),
                grad_of(&composed, &weights, &z),
            );
            assert!(max_diff(&a, &b) < tol, "{dtype:?} log-prob gradient");

            let fused = entropy(z.as_tensor()).expect("fused");
            let composed = logp
                .exp()
                .and_then(|p| p.mul(&logp))
                .and_then(|t| t.sum(1))
                .and_then(|t| t.neg())
                .expect("h");
            assert!(max_diff(&fused, &composed) < tol, "{dtype:?} entropy");
            let (a, b) = (
                grad_of(&fused, &weights, &z),
                grad_of(&composed, &weights, &z),
            );
            assert!(max_diff(&a, &b) < tol, "{dtype:?} entropy gradient");
        }
        // uniform logits over 4 tokens: log-prob ln(1/4), entropy ln 4
        let u = Tensor::zeros((1, 4), DType::F64, &Device::Cpu).expect("u");
        let t = Tensor::new(&[2u32], &Device::Cpu).expect("t");
        let lp = token_log_probs(&u, &t)
            .expect("lp")
            .to_vec1::<f64>()
            .expect("lp");
        assert!((lp[0] + 4f64.ln()).abs() < 1e-15);
        let h = entropy(&u).expect("h").to_vec1::<f64>().expect("h");
        assert!((h[0] - 4f64.ln()).abs() < 1e-15);
    }

    /// The entropy by the row ops (a GPU's path, its kernels' CPU twins here) and by the
    /// CPU's fused op equals the composed `log_softmax` path on f64 copies of the logits:
    /// value and logits' gradient within rounding (f64 1e-12, f32 2e-5), with wide logits (a
    /// max far from 0, where `lse − Σ p z` cancels: the fused op computed that and was
    /// 4.8e-5 off here in f32), and with a −∞ logit (probability 0): the entropy of the
    /// others, ln 4 for four equal ones, and no NaN (the fused op's was one).
    #[test]
    fn the_entropy_by_rows_equals_the_composed_one() {
        let wide = logits(6, 9, DType::F64).affine(4.0, 30.0).expect("wide");
        let weights = logits(1, 6, DType::F64).squeeze(0).expect("w");
        let z64 = Var::from_tensor(&wide).expect("var");
        let logp = log_softmax_composed(z64.as_tensor()).expect("lsm");
        let want = logp
            .exp()
            .and_then(|p| p.mul(&logp))
            .and_then(|t| t.sum(1))
            .and_then(|t| t.neg())
            .expect("h");
        let want_grad = grad_of(&want, &weights, &z64);
        type EntropyOp = fn(&Tensor) -> Result<Tensor>;
        let ops: [(&str, EntropyOp); 2] = [("rows", entropy_by_rows), ("fused", entropy)];
        for ((name, op), dtype) in ops
            .into_iter()
            .flat_map(|o| [(o, DType::F64), (o, DType::F32)])
        {
            let tol = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
            let z = Var::from_tensor(&wide.to_dtype(dtype).expect("z")).expect("var");
            let w = weights.to_dtype(dtype).expect("w");
            let got = op(z.as_tensor()).expect(name);
            let wide_again = |t: &Tensor| t.to_dtype(DType::F64).expect("f64");
            assert!(
                max_diff(&wide_again(&got), &want) < tol,
                "{name} {dtype:?} entropy"
            );
            let g = wide_again(&grad_of(&got, &w, &z));
            assert!(max_diff(&g, &want_grad) < tol, "{name} {dtype:?} gradient");
        }
        let masked =
            Tensor::new(&[[0f32, 0.0, f32::NEG_INFINITY, 0.0, 0.0]], &Device::Cpu).expect("masked");
        for (name, op) in ops {
            let z = Var::from_tensor(&masked).expect("var");
            let h = op(z.as_tensor()).expect(name);
            let h0 = h.to_vec1::<f32>().expect("h")[0];
            assert!((h0 - 4f32.ln()).abs() < 1e-6, "{name}: {h0}");
            let w = Tensor::new(&[1f32], &Device::Cpu).expect("w");
            let g = grad_of(&h, &w, &z)
                .flatten_all()
                .and_then(|g| g.to_vec1::<f32>())
                .expect("g");
            assert!(
                g.iter().all(|v| v.abs() < 1e-6),
                "{name}: uniform over the rest: {g:?}"
            );
        }
    }

    /// Targets checked on the host give the very values and gradients of targets checked
    /// on the device, on the fused path (f32) and the other (bf16 logits); a target past
    /// the vocabulary, or host targets of another count, are errors naming them.
    #[test]
    fn host_checked_targets_equal_device_checked_ones() {
        let host = [0u32, 8, 3, 3, 5, 1];
        let targets = Tensor::new(&host, &Device::Cpu).expect("t");
        for dtype in [DType::F32, DType::BF16] {
            let z = Var::from_tensor(&logits(6, 9, dtype)).expect("var");
            let want = token_log_probs(&z, &targets).expect("device-checked");
            let got = token_log_probs_host_checked(&z, &targets, &host).expect("host-checked");
            let w = Tensor::ones(6, dtype, &Device::Cpu).expect("w");
            assert_eq!(max_diff(&got, &want), 0.0, "{dtype:?} value");
            let (a, b) = (grad_of(&got, &w, &z), grad_of(&want, &w, &z));
            assert_eq!(max_diff(&a, &b), 0.0, "{dtype:?} gradient");
        }
        let z = logits(2, 5, DType::F32);
        let t = Tensor::new(&[1u32, 5], &Device::Cpu).expect("t");
        let err = token_log_probs_host_checked(&z, &t, &[1, 5]).expect_err("out of range");
        assert!(err.to_string().contains("target 5 in row 1"), "{err}");
        let err = token_log_probs_host_checked(&z, &t, &[1]).expect_err("short host targets");
        assert!(err.to_string().contains("1 on the host"), "{err}");
    }

    #[test]
    fn targets_outside_the_vocabulary_are_errors() {
        let z = logits(2, 5, DType::F32);
        let t = Tensor::new(&[1u32, 5], &Device::Cpu).expect("t");
        let err = token_log_probs(&z, &t).expect_err("out of range");
        assert!(err.to_string().contains("target 5 in row 1"), "{err}");
        let bad_shape = Tensor::new(&[1u32, 2, 3], &Device::Cpu).expect("t");
        assert!(token_log_probs(&z, &bad_shape).is_err());
        // the recomputing op (a GPU's path) names it too
        let err = token_log_probs_recomputed(&z, &t).expect_err("out of range");
        assert!(err.to_string().contains("target 5"), "{err}");
    }
}
