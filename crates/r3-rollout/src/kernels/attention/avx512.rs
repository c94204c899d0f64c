//! AVX-512 forms of a token's two inner attention kernels, bit for bit the AVX2 ones.
//!
//! - **Scores** of two query heads side by side: one 16-lane register holds head a's eight
//!   lanes and head b's, each lane adding its products in [`short_dot`]'s order, and each
//!   half reduced by the same tree ([`reduce_eight`]). Heads sharing a key/value head
//!   (grouped-query attention) read each key chunk once for both.
//! - **Weighted sums** of the query heads that share a key/value head: sixteen value columns
//!   per register, each value chunk widened once for all of the group's heads, each column
//!   adding its products one key after another from zero as [`weighted_rows`] does.
//!
//! Why: at the mid config's head width of 64 a decode token's scores and sums cost as much as
//! reading its context. Measured (`examples/attention_speed.rs`, f16 cache, mid geometry,
//! contexts of 65): one thread on a context held in L2, 7.1 → 5.7 ns per (key, head); 64 rows
//! on two threads with the caches left warm, 1.29–1.45 → 1.09–1.13 ms a decode step; with
//! the caches flushed between layers (`cold`) unchanged at ≈ 2.3 ms, which is the rows'
//! misses (a software prefetch of the next token's rows spread over this token's work did
//! not shorten it either). In the engine, decode at batch 64: ≈ 2.2 → 1.9–2.1 ms a step.
//!
//! [`short_dot`]: super::short_dot
//! [`reduce_eight`]: super::reduce_eight
//! [`weighted_rows`]: super::weighted_rows

use std::arch::x86_64::*;

use super::{add_tails, head_scores, reduce_eight, short_dot, AttnShape, KvLanes};

/// Widest query head (in eight-value chunks) the pair kernel keeps in registers / on the
/// stack: 256 values; wider heads take the AVX2 path.
const MAX_CHUNKS: usize = 32;

/// Proof that the CPU has AVX-512F: obtained only from [`Avx512::detect`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Avx512(());

impl Avx512 {
    /// `Some` where the CPU has AVX-512F.
    pub(super) fn detect() -> Option<Self> {
        std::arch::is_x86_feature_detected!("avx512f").then_some(Avx512(()))
    }

    /// Whether [`Avx512::scores`] takes query heads of width `d`.
    pub(super) fn fits_scores(d: usize) -> bool {
        d.div_ceil(8) <= MAX_CHUNKS
    }

    /// Whether [`Avx512::weighted`] takes value heads of width `v_dim`.
    pub(super) fn fits_weighted(v_dim: usize) -> bool {
        v_dim > 0 && v_dim.is_multiple_of(16)
    }

    /// Every head's scores of one token: `scores[h·n + j] = short_dot(q_h, keys[j][(h /
    /// group)·d ..][..d]) · scale` for `n = keys.len()` and `d = shape.qk_dim`, bit for bit.
    ///
    /// # Panics
    /// When `d` does not fit ([`Avx512::fits_scores`]), `q` holds fewer than `heads·d`
    /// values, `scores` fewer than `heads·n`, or a key row is shorter than its head's columns.
    pub(super) fn scores<E: KvLanes>(
        self,
        q: &[f32],
        keys: &[&[E]],
        shape: AttnShape,
        scores: &mut [f32],
    ) {
        let (heads, group, d, scale) = (shape.num_heads, shape.group(), shape.qk_dim, shape.scale);
        assert!(Self::fits_scores(d), "avx512 scores: head width {d}");
        let n = keys.len();
        assert!(q.len() >= heads * d && scores.len() >= heads * n);
        let mut h = 0;
        while h + 2 <= heads {
            let (qa, qb) = (&q[h * d..(h + 1) * d], &q[(h + 1) * d..(h + 2) * d]);
            let cols = [h / group * d, (h + 1) / group * d];
            let (sa, sb) = scores[h * n..(h + 2) * n].split_at_mut(n);
            // SAFETY: `self` proves AVX-512F; the slices hold what the kernel reads and
            // writes (it slices every key row to its widest column before loading).
            unsafe {
                if cols[0] == cols[1] {
                    pair_scores::<E, true>(qa, qb, keys, cols, scale, sa, sb);
                } else {
                    pair_scores::<E, false>(qa, qb, keys, cols, scale, sa, sb);
                }
            }
            h += 2;
        }
        if h < heads {
            let qh = &q[h * d..(h + 1) * d];
            head_scores(
                qh,
                keys,
                h / group * d,
                scale,
                &mut scores[h * n..(h + 1) * n],
            );
        }
    }

    /// Every head's `out[h·v_dim ..][..v_dim] = Σ_j probs[h·n + j] · rows[j][(h / group)·v_dim
    /// ..]`, bit for bit [`super::weighted_rows`] per head.
    ///
    /// # Panics
    /// When `v_dim` does not fit ([`Avx512::fits_weighted`]), or `probs`, `rows` or a row is
    /// shorter than the heads read.
    pub(super) fn weighted<E: KvLanes>(
        self,
        probs: &[f32],
        n: usize,
        rows: &[&[E]],
        shape: AttnShape,
        out: &mut [f32],
    ) {
        let (group, v_dim) = (shape.group(), shape.v_dim);
        assert!(
            Self::fits_weighted(v_dim),
            "avx512 weighted: head width {v_dim}"
        );
        let heads = out.len() / v_dim;
        assert!(probs.len() >= heads * n && rows.len() >= n);
        let rows = &rows[..n];
        let per_head = v_dim / 16;
        // Chunks per pass dividing a head's; heads per pass dividing the group, ≤ 16
        // accumulators in all.
        let chunks = [4, 2, 1]
            .into_iter()
            .find(|c| per_head.is_multiple_of(*c))
            .unwrap_or(1);
        let tile_heads = [4, 2, 1]
            .into_iter()
            .find(|g| group.is_multiple_of(*g) && g * chunks <= 16)
            .unwrap_or(1);
        let mut h = 0;
        while h < heads {
            // Heads h .. h + take share key/value head h / group (tiles never cross a group;
            // what no whole tile covers goes one head at a time).
            let take = match tile_heads.min(heads - h).min(group - h % group) {
                t @ (4 | 2) => t,
                _ => 1,
            };
            let col = h / group * v_dim;
            for c in (0..per_head).step_by(chunks) {
                let at = TileAt {
                    n,
                    col: col + 16 * c,
                    v_dim,
                    head: h,
                    chunk: c,
                };
                // SAFETY: `self` proves AVX-512F; the tile reads `take` heads' n probs
                // (asserted above), rows sliced to n, each row sliced before its loads, and
                // writes inside `out` (`head + take ≤ heads`, `chunk + chunks ≤ per_head`).
                unsafe {
                    match (take, chunks) {
                        (4, 4) => group_tile::<4, 4, E>(at, probs, rows, out),
                        (4, 2) => group_tile::<4, 2, E>(at, probs, rows, out),
                        (4, _) => group_tile::<4, 1, E>(at, probs, rows, out),
                        (2, 4) => group_tile::<2, 4, E>(at, probs, rows, out),
                        (2, 2) => group_tile::<2, 2, E>(at, probs, rows, out),
                        (2, _) => group_tile::<2, 1, E>(at, probs, rows, out),
                        (_, 4) => group_tile::<1, 4, E>(at, probs, rows, out),
                        (_, 2) => group_tile::<1, 2, E>(at, probs, rows, out),
                        _ => group_tile::<1, 1, E>(at, probs, rows, out),
                    }
                }
            }
            h += take;
        }
    }
}

/// Scores of query heads a and b over every key: lanes 0–7 of each accumulator are head a's
/// eight-lane sums, lanes 8–15 head b's. `SAME`: both heads read the same key columns.
///
/// # Safety
/// The CPU supports AVX-512F; `qa` and `qb` hold `d ≤ 8·MAX_CHUNKS` values; `sa` and `sb`
/// hold `keys.len()` scores.
#[target_feature(enable = "avx512f")]
unsafe fn pair_scores<E: KvLanes, const SAME: bool>(
    qa: &[f32],
    qb: &[f32],
    keys: &[&[E]],
    cols: [usize; 2],
    scale: f32,
    sa: &mut [f32],
    sb: &mut [f32],
) {
    let d = qa.len();
    let full = d - d % 8;
    let chunks = full / 8;
    debug_assert!(chunks <= MAX_CHUNKS && qb.len() == d);
    let mut qq = [_mm512_setzero_ps(); MAX_CHUNKS];
    for (c, q) in qq.iter_mut().enumerate().take(chunks) {
        // SAFETY: 8c + 8 ≤ full ≤ d values of each query head.
        *q = unsafe { f32::load8x2(qa.as_ptr().add(8 * c), qb.as_ptr().add(8 * c)) };
    }
    let span = cols[0].max(cols[1]) + d;
    let n = keys.len().min(sa.len()).min(sb.len());
    let mut j = 0;
    while j + 8 <= n {
        let mut rows = [std::ptr::null::<E>(); 8];
        for (p, key) in rows.iter_mut().zip(&keys[j..j + 8]) {
            *p = key[..span].as_ptr();
        }
        let mut acc = [_mm512_setzero_ps(); 8];
        for (c, q) in qq.iter().enumerate().take(chunks) {
            for (a, &p) in acc.iter_mut().zip(&rows) {
                // SAFETY: each row holds `span` ≥ col + d values (sliced above) and
                // 8c + 8 ≤ full ≤ d.
                let k = unsafe {
                    if SAME {
                        E::load8_twice(p.add(cols[0] + 8 * c))
                    } else {
                        E::load8x2(p.add(cols[0] + 8 * c), p.add(cols[1] + 8 * c))
                    }
                };
                *a = _mm512_fmadd_ps(*q, k, *a);
            }
        }
        let mut lo = [_mm256_setzero_ps(); 8];
        let mut hi = [_mm256_setzero_ps(); 8];
        for ((l, h), a) in lo.iter_mut().zip(hi.iter_mut()).zip(acc) {
            *l = _mm512_castps512_ps256(a);
            *h = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
        }
        let mut sums = [reduce_eight(&lo), reduce_eight(&hi)];
        if full < d {
            for (sums, (q, col)) in sums.iter_mut().zip([(qa, cols[0]), (qb, cols[1])]) {
                let tails: [&[E]; 8] = std::array::from_fn(|i| &keys[j + i][col..col + d]);
                add_tails(q, &tails, full, sums);
            }
        }
        for (o, s) in sa[j..j + 8].iter_mut().zip(sums[0]) {
            *o = s * scale;
        }
        for (o, s) in sb[j..j + 8].iter_mut().zip(sums[1]) {
            *o = s * scale;
        }
        j += 8;
    }
    for (i, key) in keys.iter().enumerate().take(n).skip(j) {
        sa[i] = short_dot(qa, &key[cols[0]..cols[0] + d]) * scale;
        sb[i] = short_dot(qb, &key[cols[1]..cols[1] + d]) * scale;
    }
}

/// Where one [`group_tile`] pass starts: its first head and sixteen-column chunk, and the
/// key/value columns it reads.
#[derive(Clone, Copy)]
struct TileAt {
    n: usize,
    col: usize,
    v_dim: usize,
    head: usize,
    chunk: usize,
}

/// `G` heads sharing a key/value head × `C` sixteen-column chunks summed in one pass over the
/// context: each value chunk widened once for the `G` heads.
///
/// # Safety
/// The CPU supports AVX-512F; `probs` holds `n` probabilities for every head from `at.head`
/// on to `at.head + G`; `rows` holds `n` rows; `out` holds those heads' `v_dim` outputs with
/// chunks `at.chunk .. + C` inside a head.
#[target_feature(enable = "avx512f")]
unsafe fn group_tile<const G: usize, const C: usize, E: KvLanes>(
    at: TileAt,
    probs: &[f32],
    rows: &[&[E]],
    out: &mut [f32],
) {
    let TileAt {
        n,
        col,
        v_dim,
        head,
        chunk,
    } = at;
    let probs: [&[f32]; G] = std::array::from_fn(|h| &probs[(head + h) * n..][..n]);
    let mut acc = [[_mm512_setzero_ps(); C]; G];
    for (j, row) in rows[..n].iter().enumerate() {
        let row = row[col..col + 16 * C].as_ptr();
        let mut v = [_mm512_setzero_ps(); C];
        for (c, v) in v.iter_mut().enumerate() {
            // SAFETY: the row is sliced to the tile's 16·C columns.
            *v = unsafe { E::load16(row.add(16 * c)) };
        }
        for (acc, probs) in acc.iter_mut().zip(&probs) {
            let p = _mm512_set1_ps(probs[j]);
            for (a, v) in acc.iter_mut().zip(&v) {
                *a = _mm512_fmadd_ps(p, *v, *a);
            }
        }
    }
    for (h, acc) in acc.iter().enumerate() {
        let o = &mut out[(head + h) * v_dim + 16 * chunk..][..16 * C];
        for (c, a) in acc.iter().enumerate() {
            // SAFETY: `o` holds the tile's 16·C columns of this head.
            unsafe { _mm512_storeu_ps(o[16 * c..][..16].as_mut_ptr(), *a) };
        }
    }
}
