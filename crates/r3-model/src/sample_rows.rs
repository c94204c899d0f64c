//! Drawing a row's next token from its whole distribution as one op: per row of logits and
//! a uniform draw from the row's own seeded stream, the column the inverse CDF of
//! `softmax(row / T)` picks and that column's log-prob, under the distribution it was drawn
//! from (`log softmax(row / T)`, [`LogprobScale::Sampling`], SGLang's default) or under the
//! raw one (`log softmax(row)`, temperature 1, [`LogprobScale::Raw`]) — the rollout
//! sampler's full-vocabulary branch ([`sample_row`] is that branch; the sampler draws and
//! calls it).
//!
//! Sampled rows are an RL rollout's (no truncation). Copied to the host each
//! decode step they were `rows × vocab` f32 (156 MB at batch 256 of a 151,936-token
//! vocabulary) and an exponential of every value there; on a GPU the op is one kernel
//! (`r3_sample_rows_f32` in `cuda/kernels.cu`) and two numbers a row cross. The kernel
//! computes the host's exponentials (`fast_exp`, bit for bit), sums them in the host's order
//! (blocks of [`SAMPLE_BLOCK`] columns, each as [`lane_sum`] sums) and walks the same
//! partial sums, so a GPU picks the column the host would from the same logits and draw.
//! The scaled log-prob is read off that same pass, `(z − max) / T − ln(total)`: the host's
//! bits too.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::host::contiguous;
use crate::launch_shape::SAMPLE_ROWS_MAX_COLUMNS;
use crate::math::{fast_exp, lane_sum, log_sum_exp, row_max};

/// Columns per partial sum of the inverse-CDF walk: the walk skips whole blocks by their
/// sums, then steps through one block.
pub const SAMPLE_BLOCK: usize = 256;

/// Which distribution a drawn row's reported log-prob is taken under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogprobScale {
    /// The distribution the column is drawn from before any truncation, `softmax(row / T)`:
    /// what SGLang reports for a sampled request by default (its sampler's `log(probs)`).
    #[default]
    Sampling,
    /// The raw distribution at temperature 1, `softmax(row)`, whatever the temperature:
    /// what SGLang reports with `SGLANG_RETURN_ORIGINAL_LOGPROB` set.
    Raw,
}

/// f64 values a row's draw takes in the draws [`sample_rows_reporting`] hands the op (and
/// `r3_sample_rows_f32` reads): the uniform (negative: the row is not asked), `1 / T`, and
/// 1 for a [`LogprobScale::Sampling`] log-prob or 0 for a [`LogprobScale::Raw`] one.
pub const DRAW_VALUES: usize = 3;

/// Reusable buffers of [`sample_row`] (one per sampling thread).
#[derive(Debug, Default, Clone)]
pub struct SampleRowScratch {
    /// `e^((z − max) / T)` of every column.
    exps: Vec<f32>,
    /// Sums of `exps` over consecutive blocks of [`SAMPLE_BLOCK`] columns.
    blocks: Vec<f64>,
}

/// Draws a column of `row` from `softmax(row · inv_t)` with the uniform `draw` in [0, 1):
/// one pass of exponentials (`fast_exp`) that also yields the block sums, then the inverse
/// CDF over the blocks and inside one block. Returns the column and its log-prob under the
/// distribution `scale` names: [`LogprobScale::Sampling`]'s `(z − max) · inv_t − ln(total)`
/// reuses the pass's normaliser, as does [`LogprobScale::Raw`]'s at `inv_t` = 1 (the same
/// value: `x · 1 = x`); the raw one at another temperature needs the raw normaliser, a
/// second pass. Where rounding leaves the draw past a block's values stepped through (its
/// sum, in lanes, can be an ulp more), the block's last column is picked; past every block's
/// sum, the last column with mass.
pub fn sample_row(
    row: &[f32],
    inv_t: f32,
    draw: f64,
    scale: LogprobScale,
    scratch: &mut SampleRowScratch,
) -> (usize, f32) {
    let (max, total) = exps_and_blocks(row, inv_t, scratch);
    let SampleRowScratch { exps, blocks } = scratch;
    let mut u = draw * total;
    let mut pick = exps.iter().rposition(|&e| e > 0.0).unwrap_or(0);
    for (b, &bs) in blocks.iter().enumerate() {
        if u < bs {
            let base = b * SAMPLE_BLOCK;
            let end = (base + SAMPLE_BLOCK).min(exps.len());
            // The block's sum (in lanes) can exceed its values stepped through by an ulp:
            // a draw in that sliver is the block's last column.
            pick = end - 1;
            for (i, &e) in exps[base..end].iter().enumerate() {
                u -= e as f64;
                if u < 0.0 {
                    pick = base + i;
                    break;
                }
            }
            break;
        }
        u -= bs;
    }
    let logprob = if scale == LogprobScale::Sampling || inv_t == 1.0 {
        (row[pick] - max) * inv_t - total.ln() as f32
    } else {
        row[pick] - log_sum_exp(row)
    };
    (pick, logprob)
}

/// Fills `scratch` with `row`'s exponentials `e^((z − max) · inv_t)` and their block sums;
/// returns the row's largest value and the blocks' total.
fn exps_and_blocks(row: &[f32], inv_t: f32, scratch: &mut SampleRowScratch) -> (f32, f64) {
    let max = row_max(row);
    let SampleRowScratch { exps, blocks } = scratch;
    exps.resize(row.len(), 0.0);
    blocks.clear();
    for (src, dst) in row.chunks(SAMPLE_BLOCK).zip(exps.chunks_mut(SAMPLE_BLOCK)) {
        for (d, v) in dst.iter_mut().zip(src) {
            *d = fast_exp((v - max) * inv_t);
        }
        blocks.push(lane_sum(dst, |v| v));
    }
    (max, blocks.iter().sum())
}

/// The uniform at the bound after `column` of `row` in [`sample_row`]'s walk at
/// temperature 1: the last uniform that picks at most `column` (`below`) or the first that
/// picks a later column (for a `column` before the row's last with mass). There an ulp more
/// or less anywhere in another implementation's sums or scaling picks the other column: the
/// draws that hold a device's walk to the host's bit for bit. Found by bisection over the
/// uniforms with the walk itself (whose column never falls as the uniform grows).
pub fn uniform_at_bound(row: &[f32], column: usize, below: bool) -> f64 {
    let mut scratch = SampleRowScratch::default();
    // Positive doubles order as their bits: `lo` picks at most `column`, `hi` past it.
    let (mut lo, mut hi) = (0f64.to_bits(), 1f64.to_bits());
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if sample_row(
            row,
            1.0,
            f64::from_bits(mid),
            LogprobScale::Raw,
            &mut scratch,
        )
        .0 > column
        {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    f64::from_bits(if below { lo } else { hi })
}

/// Whether the op draws from `row` (else its column reads as none and the caller samples
/// the row on the host): no NaN, and a finite largest value. Such a row's exponentials are
/// finite and its walk is the same on every device.
pub fn drawable(row: &[f32]) -> bool {
    row_max(row).is_finite() && !row.iter().any(|v| v.is_nan())
}

/// One row's draw for [`sample_rows`]: the uniform from its seeded stream and its inverse
/// temperature.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowDraw {
    /// The uniform in [0, 1) the walk scales by the row's total mass.
    pub uniform: f64,
    /// `1 / T` (finite and positive).
    pub inv_temperature: f32,
}

/// [`sample_rows_reporting`] with every asked row's log-prob under the raw distribution
/// ([`LogprobScale::Raw`]).
pub fn sample_rows(logits: &Tensor, draws: &[Option<RowDraw>]) -> Result<Tensor> {
    let raw: Vec<Option<(RowDraw, LogprobScale)>> = draws
        .iter()
        .map(|d| d.map(|d| (d, LogprobScale::Raw)))
        .collect();
    sample_rows_reporting(logits, &raw)
}

/// Per row of `logits` `[rows, vocab]` (f32, or cast to it) on any device, with `draws`
/// naming the rows to draw from and the distribution each reports its log-prob under
/// (`None`: not this row): `[rows, 2]` f32 of (column, log-prob) as [`sample_row`] gives
/// them. A row not asked, or not [`drawable`], gives `vocab` as its column (none) and a NaN
/// log-prob. The draws cross to the device (24 bytes a row); on a GPU the rows stay where
/// they are.
pub fn sample_rows_reporting(
    logits: &Tensor,
    draws: &[Option<(RowDraw, LogprobScale)>],
) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    if draws.len() != rows {
        return Err(ModelError::Input(format!(
            "sample rows: {} draws for {rows} rows of logits",
            draws.len()
        )));
    }
    if vocab == 0 {
        return Err(ModelError::Input(
            "sample rows: rows of no columns have nothing to draw".into(),
        ));
    }
    if rows == 0 {
        return Ok(Tensor::zeros((0, 2), DType::F32, logits.device())?);
    }
    if vocab > SAMPLE_ROWS_MAX_COLUMNS {
        return Err(ModelError::Input(format!(
            "sample rows: a vocabulary of {vocab} columns is past the {SAMPLE_ROWS_MAX_COLUMNS} \
             a block's partial sums fit in"
        )));
    }
    let draws = Tensor::from_vec(pack_draws(draws)?, (rows, DRAW_VALUES), logits.device())?;
    Ok(logits
        .to_dtype(DType::F32)?
        .contiguous()?
        .apply_op2_no_bwd(&draws, &SampleRows)?)
}

/// `draws` as the op and `r3_sample_rows_f32` read them: [`DRAW_VALUES`] f64 a row, row
/// after row. A draw whose uniform is outside [0, 1) or whose `1 / T` is not finite and
/// positive is refused, naming its row.
pub fn pack_draws(draws: &[Option<(RowDraw, LogprobScale)>]) -> Result<Vec<f64>> {
    let mut packed = Vec::with_capacity(DRAW_VALUES * draws.len());
    for (r, draw) in draws.iter().enumerate() {
        match draw {
            Some((d, scale)) => {
                let in_range = (0.0..1.0).contains(&d.uniform)
                    && d.inv_temperature.is_finite()
                    && d.inv_temperature > 0.0;
                if !in_range {
                    return Err(ModelError::Input(format!(
                        "sample rows: row {r}'s draw {} or inverse temperature {} is out of \
                         range (a uniform in [0, 1), a finite positive 1 / T)",
                        d.uniform, d.inv_temperature
                    )));
                }
                let scaled = match scale {
                    LogprobScale::Sampling => 1.0,
                    LogprobScale::Raw => 0.0,
                };
                packed.extend([d.uniform, f64::from(d.inv_temperature), scaled]);
            }
            // A negative uniform: not asked.
            None => packed.extend([-1.0, 1.0, 0.0]),
        }
    }
    Ok(packed)
}

/// The op `([rows, vocab] f32, [rows, DRAW_VALUES] f64) → [rows, 2]`.
#[derive(Debug, Clone, Copy)]
struct SampleRows;

/// One row's (column, log-prob), or (`vocab`, NaN) for a row not asked or not drawable.
fn draw_row(row: &[f32], draw: &[f64], scratch: &mut SampleRowScratch) -> [f32; 2] {
    let (uniform, inv_t) = (draw[0], draw[1] as f32);
    if uniform < 0.0 || !drawable(row) {
        return [row.len() as f32, f32::NAN];
    }
    let scale = if draw[2] != 0.0 {
        LogprobScale::Sampling
    } else {
        LogprobScale::Raw
    };
    let (pick, logprob) = sample_row(row, inv_t, uniform, scale, scratch);
    [pick as f32, logprob]
}

impl CustomOp2 for SampleRows {
    fn name(&self) -> &'static str {
        "r3-sample-rows"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        ds: &CpuStorage,
        dl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, vocab) = l.shape().dims2()?;
        let (CpuStorage::F32(values), CpuStorage::F64(draws)) = (s, ds) else {
            candle_core::bail!("sample rows: the logits must be f32 and the draws f64");
        };
        let values = contiguous(values, l, "logits")?;
        let draws = contiguous(draws, dl, "draws")?;
        let out: Vec<f32> = values
            .par_chunks(vocab.max(1))
            .zip(draws.par_chunks(DRAW_VALUES))
            .take(rows)
            .map_init(SampleRowScratch::default, |scratch, (row, draw)| {
                draw_row(&row[..vocab.min(row.len())], draw, scratch)
            })
            .flatten_iter()
            .collect();
        Ok((CpuStorage::F32(out), Shape::from((rows, 2))))
    }

    /// One block per row (`r3_sample_rows_f32`), a double of shared memory per column
    /// block.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        ds: &candle_core::CudaStorage,
        dl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        use crate::launch_shape::{sample_rows_shared_bytes, SAMPLE_ROWS_THREADS};
        let (rows, vocab) = l.shape().dims2()?;
        let mut cfg = cuda::per_row(rows, SAMPLE_ROWS_THREADS)?;
        cfg.shared_mem_bytes = sample_rows_shared_bytes(vocab) as u32;
        // Block `r` writes the two values of row `r`.
        let out = cuda::launch_f32!(
            cuda::device(s),
            "r3_sample_rows_f32",
            rows * 2,
            cfg,
            [
                cuda::view::<f32>(s, l, "logits")?,
                cuda::view::<f64>(ds, dl, "draws")?
            ],
            [vocab as u32]
        );
        Ok((out, Shape::from((rows, 2))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use r3_test_support::exact_logprob;

    /// `n` pseudo-random values in [lo, hi).
    fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }

    /// The exact inverse CDF in f64 of `softmax(row · inv_t)` at `draw`: the column whose
    /// cumulative mass first exceeds it, and how far the draw lies from the nearest bound
    /// between columns (as a fraction of the total mass).
    fn exact_pick(row: &[f32], inv_t: f64, draw: f64) -> (usize, f64) {
        let max = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
        let e: Vec<f64> = row
            .iter()
            .map(|&v| ((f64::from(v) - max) * inv_t).exp())
            .collect();
        let total: f64 = e.iter().sum();
        let mut acc = 0.0;
        for (j, &ej) in e.iter().enumerate() {
            let next = acc + ej / total;
            if draw < next {
                return (j, (draw - acc).min(next - draw));
            }
            acc = next;
        }
        (row.len() - 1, 0.0)
    }

    /// The draw picks the column the exact f64 inverse CDF picks (wherever the draw is not
    /// within 1e-6 of the mass of a bound between two columns), whichever log-prob it
    /// reports, and reports within 1e-5 the exact f64 log-prob of the distribution asked:
    /// `log softmax(row / T)` for [`LogprobScale::Sampling`], `log softmax(row)` for
    /// [`LogprobScale::Raw`] (the two the same bits at temperature 1, apart by more than
    /// the tolerance at 0.7), over rows longer than a block, shorter than one, and of a Qwen
    /// vocabulary's length.
    #[test]
    fn draws_follow_the_exact_inverse_cdf() {
        let mut scratch = SampleRowScratch::default();
        let mut checked = 0;
        for (vocab, seed) in [(1_000usize, 1u64), (40, 2), (151_936, 3), (257, 4)] {
            let row = values(vocab, seed, -8.0, 8.0);
            for t in [1.0f32, 0.7] {
                let inv_t = 1.0 / t;
                for k in 0..50 {
                    let draw = (k as f64 + 0.37) / 50.0;
                    let (got, scaled) =
                        sample_row(&row, inv_t, draw, LogprobScale::Sampling, &mut scratch);
                    let (raw_pick, raw) =
                        sample_row(&row, inv_t, draw, LogprobScale::Raw, &mut scratch);
                    assert_eq!(got, raw_pick, "the scale moved the pick");
                    let (want, margin) = exact_pick(&row, f64::from(inv_t), draw);
                    if margin > 1e-6 {
                        assert_eq!(got, want, "vocab {vocab}, T {t}, draw {draw}");
                        checked += 1;
                    }
                    for (lp, exact, what) in [
                        (scaled, exact_logprob(&row, f64::from(inv_t), got), "scaled"),
                        (raw, exact_logprob(&row, 1.0, got), "raw"),
                    ] {
                        assert!(
                            (f64::from(lp) - exact).abs() <= 1e-5,
                            "vocab {vocab}, T {t}: {what} log-prob {lp} against {exact}"
                        );
                    }
                    if t == 1.0 {
                        assert_eq!(scaled.to_bits(), raw.to_bits(), "T 1");
                    } else {
                        assert!((scaled - raw).abs() > 1e-3, "T {t}: {scaled} vs {raw}");
                    }
                }
            }
        }
        assert!(checked >= 390, "only {checked} draws away from a bound");
    }

    /// The op gives each asked row [`sample_row`]'s column and log-prob at the row's scale,
    /// bit for bit ([`sample_rows`]: every row raw; [`sample_rows_reporting`]: rows raw and
    /// scaled side by side), and (`vocab`, NaN) for a row not asked, a row holding a NaN, a
    /// row with a `+∞` and a row of `−∞`; rows of `−∞` entries beside finite ones are drawn
    /// (never picking a `−∞`).
    #[test]
    fn the_op_is_sample_row_on_each_asked_row() {
        let (rows, vocab) = (8, 600);
        let mut v = values(rows * vocab, 9, -4.0, 4.0);
        v[vocab + 5] = f32::NAN;
        v[2 * vocab + 9] = f32::INFINITY;
        v[3 * vocab..4 * vocab].fill(f32::NEG_INFINITY);
        for c in (0..vocab).filter(|c| c % 3 != 1) {
            v[4 * vocab + c] = f32::NEG_INFINITY;
        }
        let logits = Tensor::from_vec(v.clone(), (rows, vocab), &Device::Cpu).expect("logits");
        let draws: Vec<Option<RowDraw>> = (0..rows)
            .map(|r| {
                (r != 5).then_some(RowDraw {
                    uniform: 0.13 * r as f64 + 0.05,
                    inv_temperature: if r >= 6 { 1.0 / 0.6 } else { 1.0 },
                })
            })
            .collect();
        // Row 7 reports the scaled log-prob, the others the raw one.
        let scale = |r: usize| {
            if r == 7 {
                LogprobScale::Sampling
            } else {
                LogprobScale::Raw
            }
        };
        let reporting: Vec<Option<(RowDraw, LogprobScale)>> = draws
            .iter()
            .enumerate()
            .map(|(r, d)| d.map(|d| (d, scale(r))))
            .collect();
        let op = |t: Result<Tensor>| t.and_then(|t| Ok(t.to_vec2::<f32>()?)).expect("op");
        let all_raw = op(sample_rows(&logits, &draws));
        let got = op(sample_rows_reporting(&logits, &reporting));
        let mut scratch = SampleRowScratch::default();
        for r in [0, 4, 6, 7] {
            let d = draws[r].expect("asked");
            let row = &v[r * vocab..(r + 1) * vocab];
            let (pick, lp) = sample_row(row, d.inv_temperature, d.uniform, scale(r), &mut scratch);
            let (_, raw) = sample_row(
                row,
                d.inv_temperature,
                d.uniform,
                LogprobScale::Raw,
                &mut scratch,
            );
            assert_eq!(got[r][0], pick as f32, "row {r}'s column");
            assert_eq!(got[r][1].to_bits(), lp.to_bits(), "row {r}'s log-prob");
            assert_eq!(all_raw[r][0], pick as f32, "row {r}'s column, all raw");
            assert_eq!(
                all_raw[r][1].to_bits(),
                raw.to_bits(),
                "row {r}'s raw log-prob"
            );
            assert!(row[pick].is_finite(), "row {r} picked a −∞");
        }
        assert_ne!(
            got[7][1], all_raw[7][1],
            "row 7's scaled log-prob is its raw one"
        );
        for r in [1, 2, 3, 5] {
            assert_eq!(got[r][0], vocab as f32, "row {r} names no column");
            assert!(got[r][1].is_nan(), "row {r}'s log-prob");
        }
    }

    /// At the uniforms on either side of the bound after a column, the walk picks that
    /// column and the next one: in the first block, at a block's end, at the next block's
    /// start and in the last. At the end of block 0 of this row the block's lane sum exceeds
    /// its values stepped through, so the draws in between take the block's last column
    /// (they took the row's last, column 999, before that rule).
    #[test]
    fn uniforms_at_a_bound_pick_the_columns_either_side() {
        let row = values(1_000, 5, -6.0, 6.0);
        let mut scratch = SampleRowScratch::default();
        for column in [0usize, 77, 255, 256, 998] {
            for (below, want) in [(true, column), (false, column + 1)] {
                let u = uniform_at_bound(&row, column, below);
                assert_eq!(
                    sample_row(&row, 1.0, u, LogprobScale::Raw, &mut scratch).0,
                    want,
                    "column {column}, below {below}"
                );
            }
        }
    }

    /// Draws out of range, a count unlike the rows', rows of no columns and a vocabulary
    /// past the kernel's shared sums are refused by name; no rows give no draws.
    #[test]
    fn bad_draws_are_refused_by_name() {
        let logits = Tensor::zeros((2, 8), DType::F32, &Device::Cpu).expect("logits");
        let ok = Some(RowDraw {
            uniform: 0.5,
            inv_temperature: 1.0,
        });
        let refused = |draws: &[Option<RowDraw>]| match sample_rows(&logits, draws) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{draws:?} accepted"),
        };
        assert!(refused(&[ok]).contains("1 draws for 2 rows"));
        let empty = Tensor::zeros((2, 0), DType::F32, &Device::Cpu).expect("empty");
        let Err(e) = sample_rows(&empty, &[ok, ok]) else {
            panic!("rows of no columns accepted");
        };
        assert!(e.to_string().contains("no columns"), "{e}");
        let none = Tensor::zeros((0, 8), DType::F32, &Device::Cpu).expect("none");
        let drawn = sample_rows(&none, &[]).expect("no rows");
        assert_eq!(drawn.dims(), &[0, 2]);
        let past_one = Some(RowDraw {
            uniform: 1.0,
            inv_temperature: 1.0,
        });
        assert!(refused(&[ok, past_one]).contains("row 1's draw 1"));
        let frozen = Some(RowDraw {
            uniform: 0.5,
            inv_temperature: f32::INFINITY,
        });
        assert!(refused(&[frozen, ok]).contains("row 0's draw"));
        let wide = Tensor::zeros((1, SAMPLE_ROWS_MAX_COLUMNS + 1), DType::F32, &Device::Cpu)
            .expect("wide");
        let Err(e) = sample_rows(&wide, &[ok]) else {
            panic!("a vocabulary past the shared sums accepted");
        };
        assert!(e.to_string().contains("past the"), "{e}");
    }
}
