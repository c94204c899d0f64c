//! Greedy picks reduced where the logits live: for rows whose next token is the argmax of
//! the raw logits, the device hands the host three numbers per row (the largest logit, the
//! log-sum-exp of the row, the first index holding the largest logit) instead of the row.
//!
//! A step's logits are `[batch, vocab]` f32 (1 MB per 8 rows of a 32,000-token vocabulary,
//! 4.9 MB per 8 rows of Qwen3's 151,936): copied to the host each step, they were the step's
//! largest transfer at large batches, and the host then walked every row for its argmax and
//! log-softmax. The reduction is one kernel on a GPU (`r3_model::greedy_rows`) and candle's
//! reductions over the rows elsewhere. It
//! keeps the sampler's definition ([`crate::sampler::sample`]'s greedy branch: the first
//! index of the largest value, `argmax`, and its log-prob under the raw distribution); the
//! log-sum-exp is summed in the device's order (a rounding away from the host's, as the
//! engines' logits already are).

use candle_core::{DType, Device, Tensor, D};

use r3_model::greedy_rows::greedy_rows;

use crate::engine::next_token::GreedyPick;
use crate::error::RolloutError;

/// Per row of `logits` (`[rows, vocab]`, any float dtype, on any device): its greedy pick,
/// or `None` when any row's largest logit or log-sum-exp is not finite (NaN or infinite
/// logits: the caller then samples those rows from their copied logits, as the host's
/// sampler defines).
pub fn greedy_picks(logits: &Tensor) -> Result<Option<Vec<GreedyPick>>, RolloutError> {
    let logits = logits.to_dtype(DType::F32)?;
    let (rows, vocab) = logits.dims2()?;
    if rows == 0 {
        return Ok(Some(Vec::new()));
    }
    // On a GPU one kernel (`r3_model::greedy_rows`): composed, the reduction below was a
    // dozen launches a step and an upload of the column indices.
    let reduced = if logits.device().is_cuda() {
        greedy_rows(&logits)?
    } else {
        composed_reduction(&logits)?
    };
    let reduced = reduced.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
    let mut picks = Vec::with_capacity(rows);
    for row in reduced {
        let (max, lse, first) = (row[0], row[1], row[2]);
        if !(max.is_finite() && lse.is_finite()) || first.is_nan() || first >= vocab as f32 {
            return Ok(None);
        }
        picks.push(GreedyPick {
            token: first as u32,
            logprob: max - lse,
        });
    }
    Ok(Some(picks))
}

/// `[rows, 3]` of (largest logit, log-sum-exp, first index of the largest) from candle's ops
/// (the CPU device's form, whose sums the CPU engine's tests were written against).
fn composed_reduction(logits: &Tensor) -> Result<Tensor, RolloutError> {
    let (rows, vocab) = logits.dims2()?;
    let max = logits.max_keepdim(D::Minus1)?;
    // The first index holding the maximum: every other column reads `vocab`, then the row's
    // smallest. Indices below 2^24 are exact in f32 (the largest vocabularies are ~2^18).
    let columns = Tensor::arange(0u32, vocab as u32, logits.device())?
        .to_dtype(DType::F32)?
        .broadcast_as((rows, vocab))?;
    // A broadcast scalar, not a `[rows, vocab]` buffer (156 MB at batch 256 of a 151,936-token
    // vocabulary).
    let past_end = Tensor::new(vocab as f32, logits.device())?.broadcast_as((rows, vocab))?;
    let first = logits
        .broadcast_eq(&max)?
        .where_cond(&columns, &past_end)?
        .min_keepdim(D::Minus1)?;
    let sum = logits.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?;
    let lse = (sum.log()? + &max)?;
    // One copy: [rows, 3] of (max, log-sum-exp, first index).
    Ok(Tensor::cat(&[&max, &lse, &first], 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops::log_softmax_at;
    use crate::sampler::argmax;

    /// Rows of `vocab` pseudo-random logits, some rounded to bf16 (so that the largest value
    /// repeats) and some with the maximum planted twice or at the ends.
    fn rows(n: usize, vocab: usize) -> Vec<Vec<f32>> {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 20.0 - 10.0
        };
        (0..n)
            .map(|r| {
                let mut row: Vec<f32> = (0..vocab).map(|_| next()).collect();
                match r % 4 {
                    // bf16-rounded: a coarse grid where the top value is often shared
                    0 => row
                        .iter_mut()
                        .for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
                    1 => {
                        row[vocab / 3] = 50.0;
                        row[2 * vocab / 3] = 50.0;
                    }
                    2 => {
                        row[0] = 40.0;
                        row[vocab - 1] = 40.0;
                    }
                    _ => row[vocab - 1] = 60.0,
                }
                row
            })
            .collect()
    }

    /// The device's picks are the host sampler's greedy tokens (the first maximum, ties
    /// included) with the host's raw log-probs to float rounding, in f32 and from bf16
    /// logits.
    #[test]
    fn picks_equal_the_host_samplers_greedy_choice() {
        for vocab in [1usize, 7, 32_000] {
            let host = rows(12, vocab);
            let flat: Vec<f32> = host.iter().flatten().copied().collect();
            for dtype in [DType::F32, DType::BF16] {
                let t = Tensor::from_vec(flat.clone(), (host.len(), vocab), &Device::Cpu)
                    .and_then(|t| t.to_dtype(dtype))
                    .expect("logits");
                let seen: Vec<Vec<f32>> = t
                    .to_dtype(DType::F32)
                    .and_then(|t| t.to_vec2())
                    .expect("rows");
                let picks = greedy_picks(&t).expect("reduce").expect("finite");
                assert_eq!(picks.len(), host.len());
                let mut ties = 0;
                for (row, pick) in seen.iter().zip(&picks) {
                    let want = argmax(row);
                    let top = row[want];
                    ties += usize::from(row.iter().filter(|&&v| v == top).count() > 1);
                    assert_eq!(pick.token as usize, want, "vocab {vocab}, {dtype:?}");
                    let lp = log_softmax_at(row, want);
                    assert!(
                        (pick.logprob - lp).abs() <= 2e-6 * lp.abs().max(1.0),
                        "log-prob {} against the host's {lp}",
                        pick.logprob
                    );
                }
                if vocab > 1 {
                    assert!(ties >= 3, "the rows planted no ties ({ties})");
                }
            }
        }
    }

    /// A NaN or infinite row gives no picks (the caller samples from the copied logits).
    #[test]
    fn non_finite_rows_give_no_picks() {
        for bad in [f32::NAN, f32::INFINITY] {
            let mut flat = vec![0.5f32; 2 * 5];
            flat[7] = bad;
            let t = Tensor::from_vec(flat, (2, 5), &Device::Cpu).expect("logits");
            assert!(greedy_picks(&t).expect("reduce").is_none(), "{bad}");
        }
        let all_masked = Tensor::full(f32::NEG_INFINITY, (1, 4), &Device::Cpu).expect("row");
        assert!(greedy_picks(&all_masked).expect("reduce").is_none());
        let empty = Tensor::zeros((0, 4), DType::F32, &Device::Cpu).expect("empty");
        assert_eq!(greedy_picks(&empty).expect("reduce"), Some(Vec::new()));
    }
}
