//! Next tokens chosen where the logits live. For rows whose next token is the argmax of the
//! raw logits, the device hands the host three numbers per row (the largest logit, the
//! log-sum-exp of the row, the first index holding the largest logit); for rows drawn from
//! their whole distribution (an RL rollout's untruncated sampling) the host hands the
//! device the one uniform the row's sampling takes from its stream, its temperature and the
//! distribution its log-prob is reported under, and gets back the column and that log-prob.
//! Neither needs the row.
//!
//! A step's logits are `[batch, vocab]` f32 (1 MB per 8 rows of a 32,000-token vocabulary,
//! 4.9 MB per 8 rows of Qwen3's 151,936): copied to the host each step, they were the step's
//! largest transfer at large batches, and the host then walked every row (an argmax and a
//! log-softmax, or an exponential of every value). The greedy reduction is one kernel on a
//! GPU (`r3_model::greedy_rows`) and candle's reductions over the rows elsewhere; it keeps
//! the sampler's definition ([`crate::sampler::sample`]'s greedy branch: the first index of
//! the largest value, `argmax`, and its log-prob under the raw distribution), its log-sum-exp
//! summed in the device's order (a rounding away from the host's, as the engines' logits
//! already are). The draw is `r3_model::sample_rows`: the sampler's own full-vocabulary
//! branch on the host, and on a GPU a kernel that picks the host's column bit for bit.

use candle_core::{DType, Device, Tensor, D};

use r3_model::greedy_rows::greedy_rows;
use r3_model::sample_rows::{sample_rows_reporting, RowDraw};

use rand_chacha::ChaCha8Rng;

use r3_model::launch_shape::SAMPLE_ROWS_MAX_COLUMNS;

use crate::engine::next_token::{drawn_pick_suffices, greedy_pick_suffices, RowPick};
use crate::error::RolloutError;
use crate::sampler::{full_vocabulary_draw, LogprobScale, SamplingParams};

/// Where a row's next token is chosen this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickWay {
    /// Its greedy pick, reduced where the logits live ([`greedy_picks`]).
    Greedy,
    /// Its draw from the whole distribution, made where the logits live ([`drawn_picks`]).
    Drawn,
    /// The host's sampler, from the copied row.
    Host,
}

impl PickWay {
    /// Where the next token of a row sampled by `params` with `generated` output tokens so
    /// far is chosen over `vocab` columns; `all_logits`: the step copies every row to the
    /// host anyway (prompt log-probs).
    pub fn of(params: &SamplingParams, generated: usize, vocab: usize, all_logits: bool) -> Self {
        if all_logits {
            PickWay::Host
        } else if greedy_pick_suffices(params, generated) {
            PickWay::Greedy
        } else if vocab <= SAMPLE_ROWS_MAX_COLUMNS && drawn_pick_suffices(params, generated, vocab)
        {
            PickWay::Drawn
        } else {
            PickWay::Host
        }
    }
}

/// Each row's pick made where `logits` (`[rows, vocab]`, each row's last slot) live, as
/// `ways` says ([`greedy_picks`], [`drawn_picks`] with `streams`: each row's seeded stream
/// and sampling parameters); `None` where the host samples the row from its copied logits.
pub fn device_picks<'a>(
    logits: &Tensor,
    ways: &[PickWay],
    streams: impl Iterator<Item = (&'a mut ChaCha8Rng, &'a SamplingParams)>,
) -> Result<Vec<Option<RowPick>>, RolloutError> {
    let mut picks: Vec<Option<RowPick>> = vec![None; ways.len()];
    if ways.contains(&PickWay::Greedy) {
        for ((pick, way), greedy) in picks.iter_mut().zip(ways).zip(greedy_picks(logits)?) {
            if *way == PickWay::Greedy {
                *pick = greedy;
            }
        }
    }
    if ways.contains(&PickWay::Drawn) {
        let drawn_streams = streams
            .zip(ways)
            .map(|(stream, way)| (*way == PickWay::Drawn).then_some(stream))
            .collect();
        for (pick, drawn) in picks.iter_mut().zip(drawn_picks(logits, drawn_streams)?) {
            if drawn.is_some() {
                *pick = drawn;
            }
        }
    }
    Ok(picks)
}

/// Per row of `logits` (`[rows, vocab]`, any float dtype, on any device): its greedy pick,
/// or `None` for a row whose largest logit or log-sum-exp is not finite (NaN or infinite
/// logits: the caller then samples it from its copied logits, as the host's sampler
/// defines).
pub fn greedy_picks(logits: &Tensor) -> Result<Vec<Option<RowPick>>, RolloutError> {
    let logits = logits.to_dtype(DType::F32)?;
    let (rows, vocab) = logits.dims2()?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    // On a GPU one kernel (`r3_model::greedy_rows`): composed, the reduction below was a
    // dozen launches a step and an upload of the column indices.
    let reduced = if logits.device().is_cuda() {
        greedy_rows(&logits)?
    } else {
        composed_reduction(&logits)?
    };
    let reduced = reduced.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
    Ok(reduced
        .into_iter()
        .map(|row| {
            let (max, lse, first) = (row[0], row[1], row[2]);
            (max.is_finite() && lse.is_finite() && first < vocab as f32).then_some(RowPick {
                token: first as u32,
                logprob: max - lse,
            })
        })
        .collect())
}

/// Per row of `logits` (`[rows, vocab]`, any float dtype, on any device) with a stream (the
/// row's seeded stream and its sampling parameters): the column the sampler's
/// full-vocabulary branch picks with the one uniform it takes from that stream, and the
/// log-prob it reports (under the distribution `logprob_scale` names); `None` for a
/// row without a stream or not drawable (a NaN, no finite largest logit: the caller samples
/// it from its copied logits). Each uniform is taken from a copy of the row's stream, which
/// replaces the stream only where the device drew: a row left to the host is sampled from
/// its stream as it was.
pub fn drawn_picks(
    logits: &Tensor,
    streams: Vec<Option<(&mut ChaCha8Rng, &SamplingParams)>>,
) -> Result<Vec<Option<RowPick>>, RolloutError> {
    let (rows, vocab) = logits.dims2()?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    // Each row's draw, and its stream as the draw leaves it.
    let drawn_by: Vec<Option<((RowDraw, LogprobScale), ChaCha8Rng)>> = streams
        .iter()
        .map(|stream| {
            let (rng, params) = stream.as_ref()?;
            let mut advanced = (**rng).clone();
            let draw = RowDraw {
                uniform: full_vocabulary_draw(&mut advanced),
                inv_temperature: 1.0 / params.temperature,
            };
            Some(((draw, params.logprob_scale), advanced))
        })
        .collect();
    let draws: Vec<Option<(RowDraw, LogprobScale)>> =
        drawn_by.iter().map(|d| d.as_ref().map(|d| d.0)).collect();
    let drawn = sample_rows_reporting(logits, &draws)?
        .to_device(&Device::Cpu)?
        .to_vec2::<f32>()?;
    let mut picks = Vec::with_capacity(rows);
    for ((row, stream), by) in drawn.into_iter().zip(streams).zip(drawn_by) {
        let pick = (row[0] < vocab as f32 && row[1].is_finite()).then_some(RowPick {
            token: row[0] as u32,
            logprob: row[1],
        });
        if let (Some(_), Some((rng, _)), Some((_, advanced))) = (pick, stream, by) {
            *rng = advanced;
        }
        picks.push(pick);
    }
    Ok(picks)
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

    /// `flat` as `[rows, vocab]` logits in `dtype`, and the f32 rows the host reads of them.
    fn logits_in(flat: &[f32], rows: usize, vocab: usize, dtype: DType) -> (Tensor, Vec<Vec<f32>>) {
        let t = Tensor::from_vec(flat.to_vec(), (rows, vocab), &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .expect("logits");
        let seen = t
            .to_dtype(DType::F32)
            .and_then(|t| t.to_vec2())
            .expect("rows");
        (t, seen)
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
                let (t, seen) = logits_in(&flat, host.len(), vocab, dtype);
                let picks: Vec<RowPick> = greedy_picks(&t)
                    .expect("reduce")
                    .into_iter()
                    .map(|p| p.expect("finite"))
                    .collect();
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

    /// A NaN or infinite row gives no pick (the caller samples it from the copied logits);
    /// the finite rows beside it keep theirs.
    #[test]
    fn non_finite_rows_give_no_picks() {
        for bad in [f32::NAN, f32::INFINITY] {
            let mut flat = vec![0.5f32; 2 * 5];
            flat[7] = bad;
            flat[3] = 0.75;
            let t = Tensor::from_vec(flat, (2, 5), &Device::Cpu).expect("logits");
            let picks = greedy_picks(&t).expect("reduce");
            assert_eq!(picks[0].map(|p| p.token), Some(3), "{bad}");
            assert!(picks[1].is_none(), "{bad}");
        }
        let all_masked = Tensor::full(f32::NEG_INFINITY, (1, 4), &Device::Cpu).expect("row");
        assert_eq!(greedy_picks(&all_masked).expect("reduce"), vec![None]);
        let empty = Tensor::zeros((0, 4), DType::F32, &Device::Cpu).expect("empty");
        assert!(greedy_picks(&empty).expect("reduce").is_empty());
    }

    /// A drawn row's pick is the host sampler's token and log-prob with the same stream (bit
    /// for bit: the sampler's full-vocabulary branch is the op's host side; at temperature
    /// 0.8 under both log-prob scales, each within 1e-5 of its exact f64 value), from f32 and
    /// bf16 logits, and its stream is then where the host's sampling leaves it (one draw
    /// on); a row without a stream gives none, and a row holding a NaN gives none with its
    /// stream untouched (the host samples it from there).
    #[test]
    fn drawn_picks_are_the_host_samplers_draws() {
        use crate::sampler::{sample, SampleScratch};
        use rand::{Rng, SeedableRng};
        let vocab = 3_000;
        let mut host = rows(9, vocab);
        host[4][17] = f32::NAN;
        let flat: Vec<f32> = host.iter().flatten().copied().collect();
        // Rows 0 and 2 at 0.8 report the scaled log-prob, row 8 at 0.8 the raw one (rows 0
        // and 8 spread their mass; row 2's is on two planted maxima).
        let params: Vec<SamplingParams> = (0..host.len())
            .map(|r| SamplingParams {
                temperature: if [0, 2, 8].contains(&r) { 0.8 } else { 1.0 },
                logprob_scale: if r == 8 {
                    LogprobScale::Raw
                } else {
                    LogprobScale::Sampling
                },
                ..SamplingParams::default()
            })
            .collect();
        let seeded = |r: usize| ChaCha8Rng::seed_from_u64(r as u64);
        for dtype in [DType::F32, DType::BF16] {
            let (t, seen) = logits_in(&flat, host.len(), vocab, dtype);
            let mut rngs: Vec<ChaCha8Rng> = (0..host.len()).map(seeded).collect();
            let streams = rngs
                .iter_mut()
                .zip(&params)
                .enumerate()
                .map(|(r, stream)| (r != 3).then_some(stream))
                .collect();
            let picks = drawn_picks(&t, streams).expect("draw");
            for (r, pick) in picks.iter().enumerate() {
                let next = rngs[r].random::<u64>();
                if r == 3 || r == 4 {
                    assert!(pick.is_none(), "row {r}");
                    assert_eq!(next, seeded(r).random::<u64>(), "row {r}'s stream moved");
                    continue;
                }
                let mut rng = seeded(r);
                let (token, logprob) = sample(
                    &seen[r],
                    &params[r],
                    &mut rng,
                    &mut SampleScratch::default(),
                );
                assert_eq!(
                    *pick,
                    Some(RowPick { token, logprob }),
                    "row {r}, {dtype:?}"
                );
                assert_eq!(next, rng.random::<u64>(), "row {r}'s stream");
            }
            // The spread rows at 0.8 report their own distributions, scaled and raw, which
            // differ.
            let exact = |r: usize, inv_t: f64| {
                r3_test_support::exact_logprob(
                    &seen[r],
                    inv_t,
                    picks[r].expect("drawn").token as usize,
                )
            };
            for (r, inv_t, other) in [(0, 1.0 / 0.8, 1.0), (8, 1.0, 1.0 / 0.8)] {
                let got = f64::from(picks[r].expect("drawn").logprob);
                assert!((got - exact(r, inv_t)).abs() < 1e-5, "row {r}: {got}");
                assert!((got - exact(r, other)).abs() > 1e-3, "row {r}: {got}");
            }
        }
    }
}
