//! The greedy pick's reduction of logits rows as one op: per row the largest value, the
//! log-sum-exp `log Σ exp(z − max) + max` and the first column holding the largest value
//! (the rollout engines' greedy token and its log-prob under the raw distribution).
//!
//! Composed from candle's ops it was a dozen kernels a step (max, an index column uploaded
//! from the host and cast, compare, select, min, subtract, exp, sum, log, add, and the cat of
//! the three results): at a decode step of one row those launches, not the arithmetic, are
//! the time. The op has a CPU implementation, which the tests hold to the composed ops, and a
//! CUDA kernel (`r3_greedy_rows_f32` in `cuda/kernels.cu`, the same comparisons, its sum in
//! a block's order) that the device tests hold to the CPU (whose sum is in f64).

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::error::{ModelError, Result};
use crate::host::contiguous;

/// Per row of `logits` `[rows, vocab]` (f32, or cast to it) on any device: `[rows, 3]` f32
/// of (largest value, log-sum-exp, first column holding the largest value). A NaN or `+∞`
/// in a row makes its log-sum-exp NaN; a row with no value above `−∞` gives `vocab` as
/// its column (none): the caller treats such rows as not reducible. Columns below 2^24 are
/// exact in f32.
pub fn greedy_rows(logits: &Tensor) -> Result<Tensor> {
    let (_, vocab) = logits.dims2()?;
    if vocab >= 1 << 24 {
        return Err(ModelError::Input(format!(
            "greedy rows: a vocabulary of {vocab} columns is past f32's exact integers"
        )));
    }
    Ok(logits
        .to_dtype(DType::F32)?
        .contiguous()?
        .apply_op1_no_bwd(&GreedyRows)?)
}

/// The op `[rows, vocab] → [rows, 3]`.
#[derive(Debug, Clone, Copy)]
struct GreedyRows;

/// One row's (largest value, log-sum-exp, first column of the largest): the largest by `>`
/// (a NaN never wins, the first of equal values stays), the f32 exponentials summed in f64:
/// an f32 sum in column order drifts over a large vocabulary (1.8e-4 off the exact
/// log-sum-exp over 151,936 columns, where the GPU's tree of f32 sums is 1e-7 off).
fn reduce_row(row: &[f32]) -> [f32; 3] {
    let (mut best, mut first) = (f32::NEG_INFINITY, row.len());
    for (j, &v) in row.iter().enumerate() {
        if v > best {
            (best, first) = (v, j);
        }
    }
    let sum: f64 = row.iter().map(|&v| f64::from((v - best).exp())).sum();
    [best, (sum.ln() + f64::from(best)) as f32, first as f32]
}

impl CustomOp1 for GreedyRows {
    fn name(&self) -> &'static str {
        "r3-greedy-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, vocab) = l.shape().dims2()?;
        let CpuStorage::F32(values) = s else {
            candle_core::bail!("greedy rows: the logits must be f32");
        };
        let values = contiguous(values, l, "logits")?;
        let out: Vec<f32> = values
            .par_chunks(vocab.max(1))
            .take(rows)
            .flat_map_iter(reduce_row)
            .collect();
        Ok((CpuStorage::F32(out), Shape::from((rows, 3))))
    }

    /// One block per row (`r3_greedy_rows_f32`).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let (rows, vocab) = l.shape().dims2()?;
        // Block `r` writes the three values of row `r`.
        let out = cuda::launch_f32!(
            cuda::device(s),
            "r3_greedy_rows_f32",
            rows * 3,
            cuda::per_row(rows, cuda::row_threads(vocab))?,
            [cuda::view::<f32>(s, l, "logits")?],
            [vocab as u32]
        );
        Ok((out, Shape::from((rows, 3))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    /// The composed ops the op replaces (the device engine's former greedy reduction).
    fn composed(logits: &Tensor) -> Vec<Vec<f32>> {
        let (rows, vocab) = logits.dims2().expect("dims");
        let max = logits.max_keepdim(D::Minus1).expect("max");
        let columns = Tensor::arange(0u32, vocab as u32, logits.device())
            .and_then(|c| c.to_dtype(DType::F32))
            .and_then(|c| c.broadcast_as((rows, vocab)))
            .expect("columns");
        let past_end = Tensor::new(vocab as f32, logits.device())
            .and_then(|t| t.broadcast_as((rows, vocab)))
            .expect("past end");
        let first = logits
            .broadcast_eq(&max)
            .and_then(|m| m.where_cond(&columns, &past_end))
            .and_then(|f| f.min_keepdim(D::Minus1))
            .expect("first");
        let sum = logits
            .broadcast_sub(&max)
            .and_then(|d| d.exp())
            .and_then(|e| e.sum_keepdim(D::Minus1))
            .expect("sum");
        let lse = (sum.log().expect("log") + &max).expect("lse");
        Tensor::cat(&[&max, &lse, &first], 1)
            .and_then(|t| t.to_vec2::<f32>())
            .expect("reduced")
    }

    /// Finite rows (planted ties among the largest, a row of equal values, `−∞` entries)
    /// reduce as the composed ops do: the same largest value and first column, the
    /// log-sum-exp within 1e-6; a NaN or `+∞` makes the row's log-sum-exp NaN, a row of
    /// `−∞` names no column.
    #[test]
    fn rows_reduce_as_the_composed_ops() {
        let (rows, vocab) = (7, 1000);
        let mut v: Vec<f32> = (0..rows * vocab)
            .map(|i| (((i * 7919) % 4001) as f32 / 400.0) - 5.0)
            .collect();
        // Row 1: the largest value planted at columns 400, 20 and 900 (first: 20).
        for c in [400, 20, 900] {
            v[vocab + c] = 9.5;
        }
        // Row 2: every value equal (first: 0); row 3: −∞ entries beside finite ones.
        v[2 * vocab..3 * vocab].fill(1.25);
        for c in (0..vocab).step_by(3) {
            v[3 * vocab + c] = f32::NEG_INFINITY;
        }
        // Row 4 holds a NaN, row 5 a +∞, row 6 only −∞.
        v[4 * vocab + 17] = f32::NAN;
        v[5 * vocab + 3] = f32::INFINITY;
        v[6 * vocab..].fill(f32::NEG_INFINITY);
        let logits = Tensor::from_vec(v, (rows, vocab), &Device::Cpu).expect("logits");
        let got = greedy_rows(&logits)
            .and_then(|t| Ok(t.to_vec2::<f32>()?))
            .expect("op");
        let want = composed(&logits);
        for r in 0..4 {
            assert_eq!(got[r][0], want[r][0], "row {r} largest");
            assert_eq!(got[r][2], want[r][2], "row {r} first column");
            assert!((got[r][1] - want[r][1]).abs() <= 1e-6 * want[r][1].abs().max(1.0));
        }
        assert_eq!(got[1][2], 20.0);
        assert_eq!(got[2][2], 0.0);
        assert!(got[4][1].is_nan() && got[5][1].is_nan(), "{:?}", &got[4..6]);
        assert_eq!(got[6][2], vocab as f32, "a row of −∞ names no column");
    }

    /// Over a 151,936-column row (a Qwen vocabulary) the log-sum-exp is the exact one
    /// rounded to f32: 14.629595121938861, from Python's `math.fsum` of the row's
    /// exponentials in f64 (an f32 sum in column order gave 14.629419).
    #[test]
    fn a_long_rows_log_sum_exp_is_the_exact_one() {
        let vocab = 151_936usize;
        let row: Vec<f32> = (0..vocab)
            .map(|i| (((i * 7919) % 4001) as f32 / 400.0) - 5.0)
            .collect();
        let got = greedy_rows(&Tensor::from_vec(row, (1, vocab), &Device::Cpu).expect("row"))
            .and_then(|t| Ok(t.to_vec2::<f32>()?))
            .expect("op");
        let exact = 14.629_595_121_938_861f64;
        assert!(
            (f64::from(got[0][1]) - exact).abs() <= 1e-6,
            "{} against {exact}",
            got[0][1]
        );
    }
}
