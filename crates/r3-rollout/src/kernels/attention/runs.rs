//! A token's two inner attention kernels over its context as the cache holds it: runs of
//! consecutive rows (one block's slots of one layer each, `row_len` values a row, keys
//! first), read through a pointer stepped by the row length — bit for bit the AVX2 kernels
//! that take one slice per key.
//!
//! - **Scores** in tiles of eight dot products, `KEYS` keys × `HEADS` query heads of one
//!   key/value head: each key chunk is loaded once for the tile's heads, each product adds
//!   its chunks in [`short_dot`]'s order into its own eight lanes, and the eight are reduced
//!   together by [`reduce_eight_lanes`] (per lane the same tree as [`short_dot`]).
//! - **Weighted sums** in tiles of `KH` key/value heads × `G` of their query heads × `C`
//!   eight-column chunks: each value chunk is loaded once for the tile's heads of its
//!   key/value head, and each column adds its products one key after another from zero, as
//!   [`weighted_rows`] does.
//!
//! Why: at gsm8k-moe's geometry (4 heads of width 24 over 2 key/value heads) the slice per
//! key cost a fat pointer pushed per key and row, a bounds check per key and head, and a
//! load of every key chunk once per query head; scores ran at ≈ 6 cycles a (key, head) with
//! the context in L2, several times their multiply-adds.
//!
//! [`short_dot`]: super::short_dot
//! [`reduce_eight_lanes`]: super::reduce_eight_lanes
//! [`weighted_rows`]: super::weighted_rows

use std::arch::x86_64::*;

use super::{reduce_eight_lanes, short_dot, AttnShape, KvLanes};

/// A token's context: runs of whole cache rows, in position order.
#[derive(Clone, Copy)]
pub(super) struct ContextRuns<'r, 'p, E> {
    /// The runs; each holds a whole number of rows.
    pub runs: &'r [&'p [E]],
    /// Values per cache row (keys then values).
    pub row_len: usize,
    /// Where a row's values start (the key width of every key/value head together).
    pub v_from: usize,
}

impl<E> ContextRuns<'_, '_, E> {
    /// Rows in all runs together.
    pub fn len(&self) -> usize {
        self.runs
            .iter()
            .map(|r| r.len() / self.row_len.max(1))
            .sum()
    }

    /// Whether the runs fit `shape`: whole rows, each holding every key/value head's keys
    /// (from 0) and values (from `v_from`), for query heads that split evenly over the
    /// key/value heads (the tiles read head `h`'s key/value head as `h / group`).
    pub fn fits(&self, shape: AttnShape) -> bool {
        let kv = shape.num_kv_heads;
        kv > 0
            && shape.num_heads.is_multiple_of(kv)
            && self.row_len > 0
            && kv * shape.qk_dim <= self.v_from
            && self.v_from + kv * shape.v_dim <= self.row_len
            && self.runs.iter().all(|r| r.len() % self.row_len == 0)
    }
}

/// Every head's scores over the context (`scores[h·n + j]`, `n` = the context's rows):
/// `short_dot(q_h, key_j of head h's key/value head) · scale`, bit for bit.
///
/// # Panics
/// When the runs do not fit the shape, `q` holds fewer than `heads·qk_dim` values or
/// `scores` fewer than `heads·n`.
pub(super) fn run_scores<E: KvLanes>(
    q: &[f32],
    ctx: ContextRuns<'_, '_, E>,
    shape: AttnShape,
    scores: &mut [f32],
) {
    let (heads, d, group) = (shape.num_heads, shape.qk_dim, shape.group());
    let n = ctx.len();
    assert!(
        ctx.fits(shape) && q.len() >= heads * d && scores.len() >= heads * n,
        "attention: context runs, query ({}) or scores ({}) do not fit {heads} heads of width {d} over {n} keys",
        q.len(),
        scores.len()
    );
    if d == 0 {
        scores[..heads * n].fill(0.0);
        return;
    }
    // One copy of the loops per tile shape, so that the tile is inlined into them.
    match group {
        g if g % 8 == 0 => scores_in_tiles::<1, 8, E>(q, ctx, shape, n, scores),
        g if g % 4 == 0 => scores_in_tiles::<2, 4, E>(q, ctx, shape, n, scores),
        g if g % 2 == 0 => scores_in_tiles::<4, 2, E>(q, ctx, shape, n, scores),
        _ => scores_in_tiles::<8, 1, E>(q, ctx, shape, n, scores),
    }
}

/// [`run_scores`]' loops in tiles of `KEYS` keys × `HEADS` query heads (`HEADS` dividing the
/// group); a run's keys short of a tile one (key, head) at a time by [`short_dot`].
#[inline(never)]
fn scores_in_tiles<const KEYS: usize, const HEADS: usize, E: KvLanes>(
    q: &[f32],
    ctx: ContextRuns<'_, '_, E>,
    shape: AttnShape,
    n: usize,
    scores: &mut [f32],
) {
    let (heads, d, group) = (shape.num_heads, shape.qk_dim, shape.group());
    let row = ctx.row_len;
    let mut j = 0;
    for run in ctx.runs {
        let m = run.len() / row;
        for h0 in (0..heads).step_by(HEADS) {
            let col = h0 / group * d;
            let mut i = 0;
            while i + KEYS <= m {
                // SAFETY: the build enables AVX2 and FMA (this module's cfg). Query heads
                // `h0 .. h0 + HEADS ≤ heads` (`HEADS` divides the group, which divides
                // `heads`) lie in `q`; keys `i .. i + KEYS ≤ m` of the run, columns `col ..
                // col + d ≤ kv · d ≤ row` (`run_scores`' assertion, `fits`); scores
                // `(h0 + h)·n + j + i + k < heads·n` lie in `scores` (the same assertion).
                unsafe {
                    score_tile::<KEYS, HEADS, E>(
                        q.as_ptr().add(h0 * d),
                        run.as_ptr().add(i * row + col),
                        (row, d, n),
                        shape.scale,
                        scores.as_mut_ptr().add(h0 * n + j + i),
                    );
                }
                i += KEYS;
            }
            for i in i..m {
                let key = &run[i * row + col..][..d];
                for h in h0..h0 + HEADS {
                    scores[h * n + j + i] = short_dot(&q[h * d..(h + 1) * d], key) * shape.scale;
                }
            }
        }
        j += m;
    }
}

/// `KEYS` keys × `HEADS` query heads of one key/value head: eight dot products, each in
/// [`short_dot`]'s order, reduced together.
///
/// # Safety
/// The CPU has AVX2 and FMA; `q` points at `HEADS` heads of `d` values, `d` apart; `keys`
/// at `KEYS` keys of `d` values, `row` apart; `out` at `HEADS` runs of `KEYS` writable
/// scores, `n` apart.
#[inline(always)]
unsafe fn score_tile<const KEYS: usize, const HEADS: usize, E: KvLanes>(
    q: *const f32,
    keys: *const E,
    (row, d, n): (usize, usize, usize),
    scale: f32,
    out: *mut f32,
) {
    let full = d - d % 8;
    // SAFETY: the caller's contract: every load reads eight values at `c + 8 ≤ full ≤ d`
    // of a query head or a key, every store writes a tile score.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut c = 0;
        while c < full {
            let k: [__m256; KEYS] = std::array::from_fn(|i| E::load8(keys.add(i * row + c)));
            for h in 0..HEADS {
                let x = _mm256_loadu_ps(q.add(h * d + c));
                for (i, k) in k.iter().enumerate() {
                    acc[h * KEYS + i] = _mm256_fmadd_ps(x, *k, acc[h * KEYS + i]);
                }
            }
            c += 8;
        }
        // Lane `h·KEYS + i` holds head h's product with key i.
        let dots = reduce_eight_lanes(&acc);
        if full == d {
            let s = _mm256_mul_ps(dots, _mm256_set1_ps(scale));
            match KEYS {
                8 => _mm256_storeu_ps(out, s),
                4 => {
                    _mm_storeu_ps(out, _mm256_castps256_ps128(s));
                    _mm_storeu_ps(out.add(n), _mm256_extractf128_ps::<1>(s));
                }
                _ => {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), s);
                    for h in 0..HEADS {
                        for i in 0..KEYS {
                            *out.add(h * n + i) = lanes[h * KEYS + i];
                        }
                    }
                }
            }
            return;
        }
        // The scalar tail after the reduction, one FMA after another as `short_dot` adds it.
        let mut sums = [0f32; 8];
        _mm256_storeu_ps(sums.as_mut_ptr(), dots);
        for h in 0..HEADS {
            for i in 0..KEYS {
                let mut s = sums[h * KEYS + i];
                for t in full..d {
                    s = (*q.add(h * d + t)).mul_add((*keys.add(i * row + t)).widen(), s);
                }
                *out.add(h * n + i) = s * scale;
            }
        }
    }
}

/// Every head's `out[h·v_dim ..][..v_dim] = Σ_j probs[h·n + j] · value_j of head h's
/// key/value head`, each column summed one key after another from zero: bit for bit
/// [`weighted_rows`](super::weighted_rows) per head.
///
/// # Panics
/// When the runs do not fit the shape, the value width is not a whole number of eight-column
/// chunks ([`weighted_fits`]), `probs` holds fewer than `heads·n` values or `out` fewer than
/// `heads·v_dim`.
pub(super) fn run_weighted<E: KvLanes>(
    probs: &[f32],
    ctx: ContextRuns<'_, '_, E>,
    shape: AttnShape,
    out: &mut [f32],
) {
    let (heads, kv, v_dim, group) = (
        shape.num_heads,
        shape.num_kv_heads,
        shape.v_dim,
        shape.group(),
    );
    let n = ctx.len();
    assert!(
        weighted_fits(shape)
            && ctx.fits(shape)
            && probs.len() >= heads * n
            && out.len() >= heads * v_dim,
        "attention: context runs, probabilities ({}) or output ({}) do not fit {heads} heads of width {v_dim} over {n} keys",
        probs.len(),
        out.len()
    );
    let plan = SumPlan::new(kv, group, v_dim / 8);
    let at = SumAt {
        n,
        group,
        v_dim,
        kv: 0,
        head: 0,
        chunk: 0,
    };
    for kv0 in (0..kv).step_by(plan.kv_heads) {
        for g0 in (0..group).step_by(plan.heads) {
            for chunk in (0..v_dim / 8).step_by(plan.chunks) {
                let at = SumAt {
                    kv: kv0,
                    head: g0,
                    chunk,
                    ..at
                };
                // SAFETY: the build enables AVX2 and FMA (this module's cfg); the tile's
                // key/value heads, query heads and chunks lie inside the shape (the plan's
                // sizes divide `kv`, the group and `v_dim / 8`), whose rows, probabilities
                // and output the assertion above checked.
                unsafe { (plan.tile)(at, probs, ctx, out) }
            }
        }
    }
}

/// Whether [`run_weighted`] takes the shape's value heads: whole eight-column chunks.
pub(super) fn weighted_fits(shape: AttnShape) -> bool {
    shape.v_dim > 0 && shape.v_dim.is_multiple_of(8)
}

/// Where one tile of [`run_weighted`] starts: its first key/value head, its first query
/// head within that head's group, and its first eight-column chunk.
#[derive(Clone, Copy)]
struct SumAt {
    n: usize,
    group: usize,
    v_dim: usize,
    kv: usize,
    head: usize,
    chunk: usize,
}

/// Most accumulators of one [`run_weighted`] tile: with a row's value chunks and a
/// probability they must fit AVX2's sixteen registers (at twelve the compiler kept one on
/// the stack, and every key's multiply-add into it waited on a store and a reload).
const MAX_SUMS: usize = 8;

/// One tile of [`run_weighted`].
type SumTile<E> = for<'r, 'p> unsafe fn(SumAt, &[f32], ContextRuns<'r, 'p, E>, &mut [f32]);

/// The tile [`run_weighted`] sums with: as many of the [`MAX_SUMS`] accumulators as divide the
/// shape, chunks first, then query heads of one key/value head, then key/value heads.
struct SumPlan<E> {
    kv_heads: usize,
    heads: usize,
    chunks: usize,
    tile: SumTile<E>,
}

impl<E: KvLanes> SumPlan<E> {
    fn new(kv: usize, group: usize, per_head: usize) -> Self {
        let chunks = [4, 3, 2, 1]
            .into_iter()
            .find(|c| per_head.is_multiple_of(*c))
            .unwrap_or(1);
        let heads = [4, 2, 1]
            .into_iter()
            .find(|g| group.is_multiple_of(*g) && g * chunks <= MAX_SUMS)
            .unwrap_or(1);
        let kv_heads = if heads == group && kv.is_multiple_of(2) && 2 * heads * chunks <= MAX_SUMS {
            2
        } else {
            1
        };
        // Every combination the choices above can make is listed; anything else would take
        // the one-column tile, correct and only slower.
        macro_rules! pick {
            ($(($kh:literal, $g:literal, $c:literal)),*) => {
                match (kv_heads, heads, chunks) {
                    $(($kh, $g, $c) => (sum_tile::<$kh, $g, $c, E> as SumTile<E>, ($kh, $g, $c)),)*
                    _ => (sum_tile::<1, 1, 1, E> as SumTile<E>, (1, 1, 1)),
                }
            };
        }
        let (tile, (kv_heads, heads, chunks)) = pick!(
            (1, 1, 1),
            (1, 1, 2),
            (1, 1, 3),
            (1, 1, 4),
            (1, 2, 1),
            (1, 2, 2),
            (1, 2, 3),
            (1, 2, 4),
            (1, 4, 1),
            (1, 4, 2),
            (2, 1, 1),
            (2, 1, 2),
            (2, 1, 3),
            (2, 1, 4),
            (2, 2, 1),
            (2, 2, 2),
            (2, 4, 1)
        );
        SumPlan {
            kv_heads,
            heads,
            chunks,
            tile,
        }
    }
}

/// `KH` key/value heads × `G` of each one's query heads × `C` eight-column chunks over the
/// whole context: per row, each value chunk loaded once and added into its `G` heads' sums.
///
/// # Safety
/// The CPU has AVX2 and FMA; key/value heads `at.kv .. + KH`, query heads `at.head .. + G`
/// of each one's group and chunks `at.chunk .. + C` lie inside the shape whose rows,
/// probabilities (`heads·n`) and output (`heads·v_dim`) the caller checked.
#[inline(never)]
unsafe fn sum_tile<const KH: usize, const G: usize, const C: usize, E: KvLanes>(
    at: SumAt,
    probs: &[f32],
    ctx: ContextRuns<'_, '_, E>,
    out: &mut [f32],
) {
    let SumAt {
        n,
        group,
        v_dim,
        kv,
        head,
        chunk,
    } = at;
    let head_of = |kh: usize, g: usize| (kv + kh) * group + head + g;
    // SAFETY: the caller's contract. Probability reads `probs[h·n + j]`, `j < n`; value
    // loads at `v_from + (kv + kh)·v_dim + 8·(chunk + c) + 8 ≤ row_len` of a row inside its
    // run; stores of head `h`'s chunks inside `out`.
    unsafe {
        use std::arch::x86_64::*;
        let mut acc = [[[_mm256_setzero_ps(); C]; G]; KH];
        let p: [[*const f32; G]; KH] = std::array::from_fn(|kh| {
            std::array::from_fn(|g| probs.as_ptr().add(head_of(kh, g) * n))
        });
        let mut j = 0;
        for run in ctx.runs {
            let m = run.len() / ctx.row_len;
            let mut row = run.as_ptr().add(ctx.v_from + kv * v_dim + 8 * chunk);
            for _ in 0..m {
                for kh in 0..KH {
                    let v: [__m256; C] =
                        std::array::from_fn(|c| E::load8(row.add(kh * v_dim + 8 * c)));
                    for g in 0..G {
                        let pj = _mm256_set1_ps(*p[kh][g].add(j));
                        for c in 0..C {
                            acc[kh][g][c] = _mm256_fmadd_ps(pj, v[c], acc[kh][g][c]);
                        }
                    }
                }
                row = row.add(ctx.row_len);
                j += 1;
            }
        }
        for (kh, acc) in acc.iter().enumerate() {
            for (g, acc) in acc.iter().enumerate() {
                let o = &mut out[head_of(kh, g) * v_dim + 8 * chunk..][..8 * C];
                for (c, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(o[8 * c..][..8].as_mut_ptr(), *a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{assert_scores_per_head, assert_sums_per_head};
    use super::*;
    use half::{bf16, f16};

    /// Values of mixed sign and magnitude, so that a changed summation order shows in the
    /// low bits.
    fn value(i: usize, s: f32) -> f32 {
        (i as f32 * s).sin() * 2f32.powi((i % 7) as i32 - 3)
    }

    /// The run kernels against the one-slice-per-key kernels, bit for bit: grouped and
    /// ungrouped heads (every score tile shape, groups of 3 and 6 that take the one-head
    /// tile), head widths with and without a scalar tail, value widths on every sum tile,
    /// rows with a gap between keys and values and past them, and contexts cut into runs of
    /// whole blocks, partial ones, single rows and none (an empty context).
    #[test]
    fn runs_score_and_sum_bit_for_bit_as_slices_per_key() {
        fn check<E: KvLanes>(narrow: fn(f32) -> E) {
            let cuts: [&[usize]; 6] = [&[16, 16, 5], &[3], &[], &[1, 7, 16, 2], &[9], &[16; 4]];
            for (heads, kv) in [
                (1usize, 1usize),
                (2, 1),
                (2, 2),
                (4, 2),
                (8, 2),
                (8, 1),
                (6, 2),
                (12, 2),
                (16, 2),
                (3, 3),
            ] {
                for (d, v_dim) in [
                    (24usize, 24usize),
                    (3, 8),
                    (20, 40),
                    (64, 64),
                    (72, 16),
                    (8, 128),
                    (16, 32),
                ] {
                    for (gap, tail) in [(0usize, 0usize), (5, 3)] {
                        let shape = AttnShape {
                            num_heads: heads,
                            num_kv_heads: kv,
                            qk_dim: d,
                            v_dim,
                            scale: 0.3,
                            window: None,
                        };
                        let v_from = kv * d + gap;
                        let row_len = v_from + kv * v_dim + tail;
                        for cut in cuts {
                            let n: usize = cut.iter().sum();
                            let rows: Vec<E> =
                                (0..n * row_len).map(|i| narrow(value(i, 0.71))).collect();
                            let mut runs = Vec::new();
                            let mut at = 0;
                            for &m in cut {
                                runs.push(&rows[at * row_len..(at + m) * row_len]);
                                at += m;
                            }
                            let ctx = ContextRuns {
                                runs: &runs,
                                row_len,
                                v_from,
                            };
                            let keys: Vec<&[E]> = rows.chunks_exact(row_len).collect();
                            let values: Vec<&[E]> =
                                rows.chunks_exact(row_len).map(|r| &r[v_from..]).collect();
                            let q: Vec<f32> = (0..heads * d).map(|i| value(i, 1.7)).collect();
                            let mut got = vec![f32::NAN; heads * n];
                            run_scores(&q, ctx, shape, &mut got);
                            let group = heads / kv;
                            let case = format!(
                                "{heads}/{kv} heads, d {d}, v {v_dim}, gap {gap}, runs {cut:?}"
                            );
                            assert_scores_per_head(&got, &q, &keys, (group, d, 0.3), &case);
                            let probs: Vec<f32> =
                                (0..heads * n).map(|j| value(j, 1.3).abs()).collect();
                            let mut got = vec![f32::NAN; heads * v_dim];
                            run_weighted(&probs, ctx, shape, &mut got);
                            assert_sums_per_head(&got, &probs, &values, (group, v_dim), &case);
                        }
                    }
                }
            }
        }
        check::<f32>(|v| v);
        check::<f16>(f16::from_f32);
        check::<bf16>(bf16::from_f32);
    }

    /// Query heads that do not split evenly over the key/value heads are not the tiles'
    /// shape: the runs do not fit it (the caller takes the slice-per-key kernels).
    #[test]
    fn heads_that_do_not_split_over_key_value_heads_do_not_fit() {
        let rows = [0f32; 4 * 40];
        let runs = [&rows[..]];
        let ctx = ContextRuns {
            runs: &runs,
            row_len: 40,
            v_from: 16,
        };
        let shape = |num_heads| AttnShape {
            num_heads,
            num_kv_heads: 2,
            qk_dim: 8,
            v_dim: 8,
            scale: 1.0,
            window: None,
        };
        assert!(ctx.fits(shape(4)));
        assert!(!ctx.fits(shape(5)));
    }

    /// Runs that are not whole rows, or rows too short for the shape's keys and values, are
    /// refused rather than read past.
    #[test]
    #[should_panic(expected = "do not fit")]
    fn a_run_of_partial_rows_is_refused() {
        let rows = [0f32; 2 * 16 + 3];
        let runs = [&rows[..]];
        let shape = AttnShape {
            num_heads: 2,
            num_kv_heads: 1,
            qk_dim: 8,
            v_dim: 8,
            scale: 1.0,
            window: None,
        };
        let ctx = ContextRuns {
            runs: &runs,
            row_len: 16,
            v_from: 8,
        };
        let mut scores = vec![0f32; 8];
        run_scores(&[0.0; 16], ctx, shape, &mut scores);
    }
}
