//! Causal attention of a flat batch of query tokens over the paged KV cache.
//!
//! Each query token belongs to one sequence span and attends to every cached position of its
//! sequence up to and including its own (the caller has already written this step's keys
//! and values). Grouped-query attention maps head `h` to kv head `h / (heads / kv_heads)`.
//! The cached rows are read in the pool's stored type ([`KvLanes`]: f32, f16 or bf16),
//! widened to f32 in registers; queries, scores and sums are f32.

use rayon::prelude::*;

#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
use crate::kernels::linear::dot;
use crate::kernels::ops::{prefetch_lines, CacheLevel};
use crate::kv_pool::{KvBlockId, KvElement, KvPool, KvRows, KvView};

/// [`KvLanes`]: how the attention kernels read each cached value type, eight values widened
/// to f32 lanes per load (on builds without AVX2 and FMA, value by value through
/// [`KvElement::widen`]).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod lanes {
    use std::arch::x86_64::*;

    use half::{bf16, f16};

    use crate::kv_pool::KvElement;

    /// A cached value type the attention kernels read eight (AVX2) or sixteen (AVX-512) at
    /// a time, widened to f32 lanes exactly.
    pub trait KvLanes: KvElement {
        /// Eight values at `p` as f32 lanes.
        ///
        /// # Safety
        /// `p` points at eight readable values.
        unsafe fn load8(p: *const Self) -> __m256;

        /// Sixteen values at `p` as f32 lanes.
        ///
        /// # Safety
        /// The CPU supports AVX-512F; `p` points at sixteen readable values.
        unsafe fn load16(p: *const Self) -> __m512;

        /// Eight values at `a` in lanes 0–7 and eight at `b` in lanes 8–15.
        ///
        /// # Safety
        /// The CPU supports AVX-512F; `a` and `b` each point at eight readable values.
        unsafe fn load8x2(a: *const Self, b: *const Self) -> __m512;

        /// Eight values at `p` in lanes 0–7 and again in lanes 8–15 ([`KvLanes::load8x2`]
        /// of `p` twice, reading them once).
        ///
        /// # Safety
        /// The CPU supports AVX-512F; `p` points at eight readable values.
        unsafe fn load8_twice(p: *const Self) -> __m512;
    }

    /// Two 256-bit halves as one 512-bit register (AVX-512F alone: the f32x8 insert needs DQ).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn join(lo: __m256, hi: __m256) -> __m512 {
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castps_pd(_mm512_castps256_ps512(lo)),
            _mm256_castps_pd(hi),
        ))
    }

    /// Sixteen bytes at `a` in the low half and sixteen at `b` in the high half.
    ///
    /// # Safety
    /// `a` and `b` each point at sixteen readable bytes.
    #[inline(always)]
    unsafe fn two_blocks(a: *const __m128i, b: *const __m128i) -> __m256i {
        // SAFETY: the caller's sixteen readable bytes at each pointer; the build enables AVX2.
        unsafe { _mm256_set_m128i(_mm_loadu_si128(b), _mm_loadu_si128(a)) }
    }

    /// The AVX-512 loads of [`KvLanes`] for a 16-bit type: its sixteen values (32 bytes) read
    /// as one 256-bit register and widened to f32 lanes by `$widen`.
    macro_rules! sixteen_bit_wide_loads {
        ($widen:path) => {
            #[target_feature(enable = "avx512f")]
            #[inline]
            unsafe fn load16(p: *const Self) -> __m512 {
                // SAFETY: the caller's sixteen readable values (32 bytes).
                unsafe { $widen(_mm256_loadu_si256(p.cast::<__m256i>())) }
            }

            #[target_feature(enable = "avx512f")]
            #[inline]
            unsafe fn load8x2(a: *const Self, b: *const Self) -> __m512 {
                // SAFETY: the caller's eight readable values (16 bytes) at each pointer.
                unsafe { $widen(two_blocks(a.cast(), b.cast())) }
            }

            #[target_feature(enable = "avx512f")]
            #[inline]
            unsafe fn load8_twice(p: *const Self) -> __m512 {
                // SAFETY: the caller's eight readable values (16 bytes).
                unsafe { $widen(_mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast()))) }
            }
        };
    }

    /// bf16 bits zero-extended and shifted into the upper half of each f32 lane (exact).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn widen_bf16x16(bits: __m256i) -> __m512 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
    }

    impl KvLanes for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            // SAFETY: the caller's eight readable floats.
            unsafe { _mm256_loadu_ps(p) }
        }

        #[target_feature(enable = "avx512f")]
        #[inline]
        unsafe fn load16(p: *const Self) -> __m512 {
            // SAFETY: the caller's sixteen readable floats.
            unsafe { _mm512_loadu_ps(p) }
        }

        #[target_feature(enable = "avx512f")]
        #[inline]
        unsafe fn load8x2(a: *const Self, b: *const Self) -> __m512 {
            // SAFETY: the caller's eight readable floats at each pointer.
            unsafe { join(_mm256_loadu_ps(a), _mm256_loadu_ps(b)) }
        }

        #[target_feature(enable = "avx512f")]
        #[inline]
        unsafe fn load8_twice(p: *const Self) -> __m512 {
            // SAFETY: the caller's eight readable floats.
            unsafe {
                _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))))
            }
        }
    }

    impl KvLanes for f16 {
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            #[cfg(target_feature = "f16c")]
            // SAFETY: the caller's eight readable halves (16 bytes); the build enables F16C.
            unsafe {
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>()))
            }
            #[cfg(not(target_feature = "f16c"))]
            {
                // SAFETY: the caller's eight readable halves.
                let v: [f32; 8] = std::array::from_fn(|i| unsafe { (*p.add(i)).to_f32() });
                // SAFETY: `v` holds eight floats.
                unsafe { _mm256_loadu_ps(v.as_ptr()) }
            }
        }

        sixteen_bit_wide_loads!(_mm512_cvtph_ps);
    }

    impl KvLanes for bf16 {
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            // bf16 is the upper half of an f32: zero-extend each to 32 bits and shift.
            // SAFETY: the caller's eight readable bf16 values (16 bytes); the build enables
            // AVX2.
            unsafe {
                let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast::<__m128i>()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
            }
        }

        sixteen_bit_wide_loads!(widen_bf16x16);
    }
}

/// [`KvLanes`] on builds without AVX2 and FMA: the kernels widen value by value.
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
mod lanes {
    use half::{bf16, f16};

    use crate::kv_pool::KvElement;

    /// A cached value type the attention kernels read.
    pub trait KvLanes: KvElement {}
    impl KvLanes for f32 {}
    impl KvLanes for f16 {}
    impl KvLanes for bf16 {}
}

pub use lanes::KvLanes;

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod avx512;

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod runs;

/// The token kernels the CPU runs: the AVX-512 ones ([`avx512`]) where detected and the head
/// widths fit, else the AVX2 / portable ones below. Both give the same bits.
#[derive(Debug, Clone, Copy)]
struct TokenKernels {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    avx512: Option<avx512::Avx512>,
}

impl TokenKernels {
    /// The kernels of this CPU.
    fn detect() -> Self {
        TokenKernels {
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx2",
                target_feature = "fma"
            ))]
            avx512: avx512::Avx512::detect(),
        }
    }

    /// Every head's scores over `keys` (`scores[h·n + j]`, `n = keys.len()`): head `h` reads
    /// key columns `(h / group)·qk_dim ..` of each row.
    fn scores<E: KvLanes>(self, q: &[f32], keys: &[&[E]], shape: AttnShape, scores: &mut [f32]) {
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        ))]
        if let Some(k) = self
            .avx512
            .filter(|_| avx512::Avx512::fits_scores(shape.qk_dim))
        {
            return k.scores(q, keys, shape, scores);
        }
        let (n, d, group) = (keys.len(), shape.qk_dim, shape.group());
        for h in 0..shape.num_heads {
            let qh = &q[h * d..(h + 1) * d];
            head_scores(
                qh,
                keys,
                h / group * d,
                shape.scale,
                &mut scores[h * n..(h + 1) * n],
            );
        }
    }

    /// [`weighted_heads`] on these kernels.
    fn weighted<E: KvLanes>(
        self,
        probs: &[f32],
        n: usize,
        rows: &[&[E]],
        shape: AttnShape,
        out: &mut [f32],
    ) {
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        ))]
        if let Some(k) = self
            .avx512
            .filter(|_| avx512::Avx512::fits_weighted(shape.v_dim))
        {
            return k.weighted(probs, n, rows, shape, out);
        }
        weighted_heads(probs, n, rows, shape.group(), shape.v_dim, out);
    }

    /// One token's attention over its context (`scratch.runs`, whole cache rows of
    /// `row_len` values, keys first and values from `k_dim`): every head's scores, their
    /// softmax, the weighted sums into `out`. The AVX-512 kernels where they fit, else the
    /// AVX2 kernels that read the runs as they lie ([`runs`]), else the portable ones; the
    /// kernels that take one slice per key get those lists built here, only when they run.
    fn attend_token<'p, E: KvLanes>(
        self,
        q: &[f32],
        scratch: &mut ContextScratch<'p, E>,
        (row_len, k_dim): (usize, usize),
        shape: AttnShape,
        out: &mut [f32],
    ) {
        let ContextScratch {
            runs,
            keys,
            values,
            scores,
        } = scratch;
        let n: usize = runs.iter().map(|r| r.len() / row_len.max(1)).sum();
        scores.clear();
        scores.resize(shape.num_heads * n, 0.0);
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        ))]
        {
            let wide_scores = self
                .avx512
                .is_some_and(|_| avx512::Avx512::fits_scores(shape.qk_dim));
            let wide_sums = self
                .avx512
                .is_some_and(|_| avx512::Avx512::fits_weighted(shape.v_dim));
            let ctx = runs::ContextRuns {
                runs,
                row_len,
                v_from: k_dim,
            };
            let fits = ctx.fits(shape);
            let scores_by_runs = !wide_scores && fits;
            let sums_by_runs = !wide_sums && fits && runs::weighted_fits(shape);
            if !scores_by_runs || !sums_by_runs {
                context_rows(runs, row_len, k_dim, keys, values);
            }
            match scores_by_runs {
                true => runs::run_scores(q, ctx, shape, scores),
                false => self.scores(q, keys, shape, scores),
            }
            for head in scores.chunks_exact_mut(n.max(1)) {
                crate::kernels::ops::softmax_in_place(head);
            }
            match sums_by_runs {
                true => runs::run_weighted(scores, ctx, shape, out),
                false => self.weighted(scores, n, values, shape, out),
            }
        }
        #[cfg(not(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        )))]
        {
            context_rows(runs, row_len, k_dim, keys, values);
            self.scores(q, keys, shape, scores);
            for head in scores.chunks_exact_mut(n.max(1)) {
                crate::kernels::ops::softmax_in_place(head);
            }
            self.weighted(scores, n, values, shape, out);
        }
    }
}

/// The key and value rows of a context given as runs of whole cache rows, one slice each.
fn context_rows<'p, E>(
    runs: &[&'p [E]],
    row_len: usize,
    k_dim: usize,
    keys: &mut Vec<&'p [E]>,
    values: &mut Vec<&'p [E]>,
) {
    keys.clear();
    values.clear();
    for run in runs {
        for r in run.chunks_exact(row_len.max(1)) {
            let (k, v) = r.split_at(k_dim.min(r.len()));
            keys.push(k);
            values.push(v);
        }
    }
}

/// One sequence's part of a batch: its query tokens and where its context lives.
#[derive(Debug, Clone)]
pub struct SeqSpan {
    /// Index of the span's first token in the flat batch.
    pub first_token: usize,
    /// Number of query tokens of this sequence in the batch.
    pub num_tokens: usize,
    /// Absolute position of the first query token (= tokens already in the KV cache).
    pub start_pos: usize,
    /// The sequence's KV blocks, in position order (covering `start_pos + num_tokens`).
    pub blocks: Vec<KvBlockId>,
}

/// Head geometry of one attention layer.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width of queries and keys.
    pub qk_dim: usize,
    /// Per-head width of values.
    pub v_dim: usize,
    /// Multiplier of q·k before softmax.
    pub scale: f32,
    /// Sliding window: a query at position `i` sees keys `j` with `i - j < window`.
    pub window: Option<usize>,
}

impl AttnShape {
    /// Query heads per key/value head (at least 1).
    pub fn group(&self) -> usize {
        (self.num_heads / self.num_kv_heads.max(1)).max(1)
    }
}

/// `out[j] = q · keys[j][from .. from + q.len()] · scale` for every key of one head, out
/// of line so that the dot product stays vectorised along the head dimension (inlined into
/// the context loop, the compiler vectorised across keys with shuffles).
///
/// Keys go eight at a time ([`eight_scores`]): one horizontal reduction for eight keys
/// instead of one per key, in the same per-key order as [`short_dot`], so every score is
/// bit for bit the one-key-at-a-time value.
#[inline(never)]
fn head_scores<E: KvLanes>(q: &[f32], keys: &[&[E]], from: usize, scale: f32, out: &mut [f32]) {
    let d = q.len();
    let n = out.len().min(keys.len());
    let mut j = 0;
    while j + 8 <= n {
        let rows: [&[E]; 8] = std::array::from_fn(|i| &keys[j + i][from..from + d]);
        eight_scores(q, &rows, scale, &mut out[j..j + 8]);
        j += 8;
    }
    for (sc, k) in out[j..n].iter_mut().zip(&keys[j..n]) {
        *sc = short_dot(q, &k[from..from + d]) * scale;
    }
}

/// `out[i] = (a · b_i) · scale` for eight keys, each dot exactly [`short_dot`]`(a, b_i)`:
/// the same 8-wide FMA chunks into one register per key, then the eight registers reduced
/// together by shuffles — per key the same pairs in the same order (`lo + hi` halves, then
/// lanes `0 + 2` and `1 + 3`, then those two) — and the scalar tail per key as `short_dot`
/// adds it. Without a tail the eight scores stay in one register to their store: eight
/// scalar writes read back as one vector (what building an array of dots and scaling it
/// compiled to) stall on store forwarding, which cost a third of this function's time.
#[inline(always)]
fn eight_scores<E: KvLanes>(a: &[f32], b: &[&[E]; 8], scale: f32, out: &mut [f32]) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        use std::arch::x86_64::*;
        let d = a.len();
        let full = d - d % 8;
        let out = &mut out[..8];
        // SAFETY: the build enables AVX2 and FMA (the cfg above); every load reads 8 floats
        // at an offset `c < full ≤ len` of `a` and of each `b[i]` (each as long as `a`, by
        // the caller's slicing); the stores write the 8 floats of `out` or of `reduced`.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..full).step_by(8) {
                let x = _mm256_loadu_ps(a.as_ptr().add(c));
                for (acc, row) in acc.iter_mut().zip(b) {
                    *acc = _mm256_fmadd_ps(x, E::load8(row[..d].as_ptr().add(c)), *acc);
                }
            }
            let dots = reduce_eight_lanes(&acc);
            if full == d {
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(dots, _mm256_set1_ps(scale)));
                return;
            }
            let mut reduced = [0f32; 8];
            _mm256_storeu_ps(reduced.as_mut_ptr(), dots);
            add_tails(a, b, full, &mut reduced);
            for (o, dot) in out.iter_mut().zip(reduced) {
                *o = dot * scale;
            }
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        for (o, row) in out.iter_mut().zip(b) {
            *o = short_dot(a, row) * scale;
        }
    }
}

/// [`reduce_eight_lanes`] written out: one sum per key, in key order.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline(always)]
fn reduce_eight(acc: &[std::arch::x86_64::__m256; 8]) -> [f32; 8] {
    let mut reduced = [0f32; 8];
    // SAFETY: the build enables AVX2 (the cfg above); the store writes the 8 floats of
    // `reduced`.
    unsafe {
        std::arch::x86_64::_mm256_storeu_ps(reduced.as_mut_ptr(), reduce_eight_lanes(acc));
    }
    reduced
}

/// Eight keys' 8-lane dot-product accumulators reduced to one sum per key, lane `i` holding
/// key `i`'s: per key the same pairs in the same order as [`short_dot`] (`lo + hi` halves,
/// then lanes `0 + 2` and `1 + 3`, then those two), the eight keys side by side through
/// shuffles, then one lane permutation into key order.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline(always)]
fn reduce_eight_lanes(acc: &[std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: the build enables AVX2 (the cfg above); register operations only.
    unsafe {
        // lo + hi halves: [s4 of key 2p | s4 of key 2p+1]
        let halves = |p: usize| {
            let lo = _mm256_permute2f128_ps(acc[2 * p], acc[2 * p + 1], 0x20);
            let hi = _mm256_permute2f128_ps(acc[2 * p], acc[2 * p + 1], 0x31);
            _mm256_add_ps(lo, hi)
        };
        let (h01, h23, h45, h67) = (halves(0), halves(1), halves(2), halves(3));
        // lanes 0 + 2 and 1 + 3: per 128-bit half [s2 of key i (2), s2 of key i+2 (2)]
        let pairs = |x: __m256, y: __m256| {
            _mm256_add_ps(
                _mm256_shuffle_ps(x, y, 0b01_00_01_00),
                _mm256_shuffle_ps(x, y, 0b11_10_11_10),
            )
        };
        let (q0123, q4567) = (pairs(h01, h23), pairs(h45, h67));
        // the two lanes of each s2: keys [0, 2, 4, 6 | 1, 3, 5, 7]
        let sums = _mm256_add_ps(
            _mm256_shuffle_ps(q0123, q4567, 0b10_00_10_00),
            _mm256_shuffle_ps(q0123, q4567, 0b11_01_11_01),
        );
        // Key i sits in lane [0, 4, 1, 5, 2, 6, 3, 7][i]: gather them into lane i.
        _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }
}

/// Adds each key's scalar tail (the `d % 8` values past `full`) to its reduced sum, one FMA
/// after another as [`short_dot`] adds them.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline(always)]
fn add_tails<E: KvElement>(a: &[f32], b: &[&[E]; 8], full: usize, sums: &mut [f32; 8]) {
    let d = a.len();
    for (s, row) in sums.iter_mut().zip(b) {
        for (x, y) in a[full..].iter().zip(&row[full..d]) {
            *s = x.mul_add(y.widen(), *s);
        }
    }
}

/// Dot product of two head vectors: 8-wide FMA chunks into one register, then a scalar
/// tail. Heads are short (16–256), so the per-call cost of [`dot`]'s 16 lanes and serial
/// remainder (a 24-wide head spent most of its time in the remainder's dependent FMAs)
/// outweighed its throughput on long rows.
#[inline(always)]
fn short_dot<E: KvLanes>(a: &[f32], b: &[E]) -> f32 {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        // SAFETY: the build enables AVX2 and FMA (checked by the cfg above); every load
        // reads 8 floats inside `a` and `b` (chunks of exactly 8).
        unsafe {
            use std::arch::x86_64::*;
            let mut acc = _mm256_setzero_ps();
            let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
            let (ra, rb) = (ca.remainder(), cb.remainder());
            for (x, y) in ca.zip(cb) {
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr()), E::load8(y.as_ptr()), acc);
            }
            let s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
            let mut s = _mm_cvtss_f32(s1);
            for (x, y) in ra.iter().zip(rb) {
                s = x.mul_add(y.widen(), s);
            }
            s
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        let widened: Vec<f32> = b.iter().map(|v| v.widen()).collect();
        dot(a, &widened)
    }
}

/// Value columns accumulated per pass of `weighted_rows` (four AVX2 registers).
const V_CHUNK: usize = 32;

/// `out = Σ_j probs[j] · rows[j][from .. from + out.len()]`.
///
/// Widths of 8, 16, 24 and 32 (a head's value chunk: [`V_CHUNK`], or a narrower head) keep
/// the sums in registers across the whole context ([`weighted_rows_fixed`]); a sum kept in
/// `out` was loaded and stored again for every key (small heads spent most of the
/// attention's time there). Every width adds the same products in the same order.
#[inline]
fn weighted_rows<E: KvElement>(probs: &[f32], rows: &[&[E]], from: usize, out: &mut [f32]) {
    match out.len() {
        32 => weighted_rows_fixed::<32, E>(probs, rows, from, out),
        24 => weighted_rows_fixed::<24, E>(probs, rows, from, out),
        16 => weighted_rows_fixed::<16, E>(probs, rows, from, out),
        8 => weighted_rows_fixed::<8, E>(probs, rows, from, out),
        _ => {
            out.fill(0.0);
            for (p, r) in probs.iter().zip(rows) {
                for (o, v) in out.iter_mut().zip(&r[from..]) {
                    *o = p.mul_add(v.widen(), *o);
                }
            }
        }
    }
}

/// [`weighted_rows`] for `W` (= `out.len()`) columns, the sums in a local array the compiler
/// keeps in registers.
#[inline(always)]
fn weighted_rows_fixed<const W: usize, E: KvElement>(
    probs: &[f32],
    rows: &[&[E]],
    from: usize,
    out: &mut [f32],
) {
    let mut acc = [0f32; W];
    for (p, r) in probs.iter().zip(rows) {
        let r = &r[from..from + W];
        for i in 0..W {
            acc[i] = p.mul_add(r[i].widen(), acc[i]);
        }
    }
    out[..W].copy_from_slice(&acc);
}

/// Every head's `out[h·v_dim ..][..v_dim] = Σ_j probs[h·n + j] · rows[j][(h / group)·v_dim ..]`.
///
/// Eight-column chunks of several heads side by side, twelve per pass over the context
/// ([`HeadTile`]): one head's chunks alone form three dependent chains at a head width
/// of 24, each waiting an FMA's latency per key (measured: a decode step's weighted sums
/// then took longer than its scores); a pass over several heads keeps the FMA units busy.
/// Each column still adds its products one key after another from zero, as
/// [`weighted_rows`] does: the same bits.
fn weighted_heads<E: KvLanes>(
    probs: &[f32],
    n: usize,
    rows: &[&[E]],
    group: usize,
    v_dim: usize,
    out: &mut [f32],
) {
    let heads = out.len() / v_dim.max(1);
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if v_dim.is_multiple_of(8) && v_dim > 0 && rows.len() >= n && probs.len() >= heads * n {
        let per_head = v_dim / 8;
        // A full tile's heads and chunks (twelve accumulators, chunks dividing a head's),
        // and its one-head form for the heads left over.
        type Sum<E> = fn(TileAt, &[f32], &[&[E]], &mut [f32]);
        let (tile_heads, tile_chunks, wide, narrow): (usize, usize, Sum<E>, Sum<E>) = match per_head
        {
            p if p % 3 == 0 => (4, 3, HeadTile::<4, 3>::sum, HeadTile::<1, 3>::sum),
            p if p % 4 == 0 => (3, 4, HeadTile::<3, 4>::sum, HeadTile::<1, 4>::sum),
            p if p % 2 == 0 => (6, 2, HeadTile::<6, 2>::sum, HeadTile::<1, 2>::sum),
            _ => (12, 1, HeadTile::<12, 1>::sum, HeadTile::<1, 1>::sum),
        };
        let at = TileAt {
            n,
            group,
            v_dim,
            head: 0,
            chunk: 0,
        };
        let mut head = 0;
        while head < heads {
            let (sum, step) = match heads - head >= tile_heads {
                true => (wide, tile_heads),
                false => (narrow, 1),
            };
            for chunk in (0..per_head).step_by(tile_chunks) {
                sum(TileAt { head, chunk, ..at }, probs, rows, out);
            }
            head += step;
        }
        return;
    }
    for h in 0..heads {
        let (g, p) = (h / group, &probs[h * n..(h + 1) * n]);
        let oh = &mut out[h * v_dim..(h + 1) * v_dim];
        // Output chunks small enough to stay in registers across the whole context.
        for (c, oc) in oh.chunks_mut(V_CHUNK).enumerate() {
            weighted_rows(p, rows, g * v_dim + c * V_CHUNK, oc);
        }
    }
}

/// Where one pass of [`weighted_heads`] starts: its first head and eight-column chunk.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[derive(Clone, Copy)]
struct TileAt {
    n: usize,
    group: usize,
    v_dim: usize,
    head: usize,
    chunk: usize,
}

/// `H` heads × `C` eight-column chunks of [`weighted_heads`] summed in one pass.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
struct HeadTile<const H: usize, const C: usize>;

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
impl<const H: usize, const C: usize> HeadTile<H, C> {
    /// Heads `at.head .. + H`, chunks `at.chunk .. + C` of each, over the whole context.
    fn sum<E: KvLanes>(at: TileAt, probs: &[f32], rows: &[&[E]], out: &mut [f32]) {
        let TileAt {
            n,
            group,
            v_dim,
            head,
            chunk,
        } = at;
        let probs: [&[f32]; H] = std::array::from_fn(|h| &probs[(head + h) * n..][..n]);
        let col: [usize; H] = std::array::from_fn(|h| (head + h) / group * v_dim + 8 * chunk);
        let widest = col.iter().max().map_or(0, |c| c + 8 * C);
        // SAFETY: the build enables AVX2 and FMA (the cfg above). Every probability read is
        // `probs[h][j]` with `j < n` (each slice holds `n`). Values: every row is sliced to
        // `widest` floats before its loads at `col[h] + 8c + 8 ≤ widest`. Stores: head
        // `head + h`'s chunk `chunk + c` lies inside `out` (`head + h < heads`, `chunk + c <
        // v_dim / 8`: the caller's tiling).
        unsafe {
            use std::arch::x86_64::*;
            let mut acc = [[_mm256_setzero_ps(); C]; H];
            for (j, row) in rows[..n].iter().enumerate() {
                let row = row[..widest].as_ptr();
                for ((acc, probs), &col) in acc.iter_mut().zip(&probs).zip(&col) {
                    let p = _mm256_set1_ps(*probs.get_unchecked(j));
                    for (c, acc) in acc.iter_mut().enumerate() {
                        let v = E::load8(row.add(col + 8 * c));
                        *acc = _mm256_fmadd_ps(p, v, *acc);
                    }
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                let o = &mut out[(head + h) * v_dim + 8 * chunk..][..8 * C];
                for (c, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(o[8 * c..][..8].as_mut_ptr(), *a);
                }
            }
        }
    }
}

/// `out[t, h*v_dim..]` = softmax(q_t,h · K / scale) · V for every token `t` of every span.
pub fn paged_attention(
    pool: &KvPool,
    layer: usize,
    spans: &[SeqSpan],
    q: &[f32],
    out: &mut [f32],
    shape: AttnShape,
    parallel: bool,
) {
    match pool.view() {
        KvView::F32(rows) => attend(rows, layer, spans, q, out, shape, parallel),
        KvView::F16(rows) => attend(rows, layer, spans, q, out, shape, parallel),
        KvView::Bf16(rows) => attend(rows, layer, spans, q, out, shape, parallel),
    }
}

/// [`paged_attention`] over a pool's rows stored as `E`.
fn attend<'p, E: KvLanes>(
    pool: KvRows<'p, E>,
    layer: usize,
    spans: &[SeqSpan],
    q: &[f32],
    out: &mut [f32],
    shape: AttnShape,
    parallel: bool,
) {
    let bs = pool.block_size();
    let AttnShape {
        num_heads,
        qk_dim,
        v_dim,
        window,
        ..
    } = shape;
    let kernels = TokenKernels::detect();
    let (row_len, k_dim) = (pool.layout().row(), pool.layout().k_dim);
    // (span index, absolute position) of every flat token.
    let mut owner = Vec::with_capacity(out.len() / (num_heads * v_dim));
    for (s, span) in spans.iter().enumerate() {
        for i in 0..span.num_tokens {
            owner.push((s, span.start_pos + i));
        }
    }
    // Per worker: the context's key and value rows and the scores, reused token after token
    // (three allocations per token and layer otherwise).
    let task = |scratch: &mut ContextScratch<'p, E>, (t, o): (usize, &mut [f32])| {
        let (s, pos) = owner[t];
        let span = &spans[s];
        let qt = &q[(span.first_token + (pos - span.start_pos)) * num_heads * qk_dim..]
            [..num_heads * qk_dim];
        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let n = pos + 1 - lo;
        // Block by block: a block's slots of one layer lie back to back (key, value, key,
        // …), so each run is asked for once and read as it lies.
        scratch.runs.clear();
        let mut abs = lo;
        while abs <= pos {
            let (b, first) = (span.blocks[abs / bs], abs % bs);
            let end = bs.min(first + (pos + 1 - abs));
            let run = pool.slot_run(b, layer, first, end);
            // The context's rows lie in blocks of a few KB each (too short a stream for
            // the hardware prefetcher to ramp up); asking for all of them before the first
            // head's scores overlaps their misses (measured, `examples/attention_speed.rs`:
            // a decode step's attention at 256 rows of a GRPO batch ≈ 15–20% faster).
            prefetch_lines(run, CacheLevel::L2);
            scratch.runs.push(run);
            abs += end - first;
        }
        debug_assert_eq!(
            scratch
                .runs
                .iter()
                .map(|r| r.len() / row_len)
                .sum::<usize>(),
            n
        );
        kernels.attend_token(qt, scratch, (row_len, k_dim), shape, o);
    };
    let row = num_heads * v_dim;
    if parallel && owner.len() > 1 {
        out.par_chunks_mut(row)
            .enumerate()
            .for_each_init(ContextScratch::default, task);
    } else {
        let mut scratch = ContextScratch::default();
        out.chunks_mut(row)
            .enumerate()
            .for_each(|item| task(&mut scratch, item));
    }
}

/// One worker's buffers for [`paged_attention`]: a token's context as runs of cache rows,
/// its key and value rows one slice each (for the kernels that take those), and its scores
/// (every head's, `[heads, context]`).
struct ContextScratch<'p, E> {
    runs: Vec<&'p [E]>,
    keys: Vec<&'p [E]>,
    values: Vec<&'p [E]>,
    scores: Vec<f32>,
}

impl<E> Default for ContextScratch<'_, E> {
    fn default() -> Self {
        ContextScratch {
            runs: Vec::new(),
            keys: Vec::new(),
            values: Vec::new(),
            scores: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use crate::kv_pool::KvLayout;

    /// Asserts that every head's scores in `got` (`[heads, n]`) are, bit for bit, that
    /// head's [`head_scores`] over `keys` (head `h` reading its key/value head's columns).
    pub(super) fn assert_scores_per_head<E: KvLanes>(
        got: &[f32],
        q: &[f32],
        keys: &[&[E]],
        (group, d, scale): (usize, usize, f32),
        case: &str,
    ) {
        let n = keys.len();
        for (h, got) in got
            .chunks_exact(n.max(1))
            .enumerate()
            .take(q.len() / d.max(1))
        {
            let mut want = vec![f32::NAN; n];
            head_scores(
                &q[h * d..(h + 1) * d],
                keys,
                h / group * d,
                scale,
                &mut want,
            );
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "scores, {case}: head {h} key {j}");
            }
        }
    }

    /// Asserts that every head's weighted sum in `got` (`[heads, v_dim]`) is, bit for bit,
    /// that head's [`weighted_rows`] over `values` (head `h` reading its key/value head's
    /// columns).
    pub(super) fn assert_sums_per_head<E: KvElement>(
        got: &[f32],
        probs: &[f32],
        values: &[&[E]],
        (group, v_dim): (usize, usize),
        case: &str,
    ) {
        let n = values.len();
        for (h, got) in got.chunks_exact(v_dim).enumerate() {
            let mut want = vec![f32::NAN; v_dim];
            weighted_rows(
                &probs[h * n..(h + 1) * n],
                values,
                h / group * v_dim,
                &mut want,
            );
            for (c, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "sums, {case}: head {h} column {c}"
                );
            }
        }
    }

    #[test]
    fn eight_keys_at_a_time_score_bit_for_bit_as_one_at_a_time() {
        // head widths with and without a scalar tail, below one chunk, and key counts
        // around multiples of eight; values of mixed sign and magnitude so that the
        // summation order shows in the low bits
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2f32.powi((state % 9) as i32 - 4)
        };
        for d in [3usize, 8, 12, 16, 20, 24, 64, 72, 128] {
            for n in [0usize, 1, 7, 8, 9, 16, 23, 40] {
                let from = 5;
                let q: Vec<f32> = (0..d).map(|_| next()).collect();
                let rows: Vec<Vec<f32>> = (0..n)
                    .map(|_| (0..from + d + 3).map(|_| next()).collect())
                    .collect();
                let keys: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
                let scale = 0.37f32;
                let mut got = vec![f32::NAN; n];
                head_scores(&q, &keys, from, scale, &mut got);
                for (j, (g, k)) in got.iter().zip(&keys).enumerate() {
                    let want = short_dot(&q, &k[from..from + d]) * scale;
                    assert_eq!(g.to_bits(), want.to_bits(), "d {d}, n {n}, key {j}");
                }
            }
        }
    }

    /// Every width of the weighted sum, the register-held ones (8, 16, 24, 32) and the
    /// others, adds the same products in the same order as a plain loop: bit for bit.
    #[test]
    fn weighted_rows_equal_the_plain_sum_bit_for_bit() {
        let f = |i: usize, s: f32| (i as f32 * s).sin() * 2f32.powi((i % 7) as i32 - 3);
        for width in [1usize, 3, 8, 12, 16, 20, 24, 32] {
            for n in [0usize, 1, 5, 33] {
                let from = 3;
                let rows: Vec<Vec<f32>> = (0..n)
                    .map(|j| (0..from + width + 2).map(|i| f(i + 50 * j, 0.77)).collect())
                    .collect();
                let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
                let probs: Vec<f32> = (0..n).map(|j| f(j, 1.9).abs()).collect();
                let mut got = vec![f32::NAN; width];
                weighted_rows(&probs, &refs, from, &mut got);
                for (c, g) in got.iter().enumerate() {
                    let mut want = 0f32;
                    for (p, r) in probs.iter().zip(&refs) {
                        want = p.mul_add(r[from + c], want);
                    }
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "width {width}, n {n}, column {c}"
                    );
                }
            }
        }
    }

    /// Every head's weighted sum at once, in tiles of several heads' chunks, is bit for bit
    /// each head's [`weighted_rows`] alone: head widths that tile by threes, fours, twos and
    /// ones, one that takes the plain path (12), head counts with and without a partial
    /// tile, grouped-query sharing and empty contexts.
    #[test]
    fn all_heads_at_once_equal_each_head_alone_bit_for_bit() {
        let f = |i: usize, s: f32| (i as f32 * s).sin() * 2f32.powi((i % 7) as i32 - 3);
        for v_dim in [8usize, 12, 16, 24, 32, 40, 64, 96, 128] {
            for (heads, group) in [
                (1usize, 1usize),
                (2, 2),
                (3, 1),
                (4, 2),
                (5, 5),
                (8, 4),
                (14, 2),
                (16, 1),
            ] {
                for n in [0usize, 1, 5, 33] {
                    let kv = heads / group;
                    let rows: Vec<Vec<f32>> = (0..n)
                        .map(|j| (0..kv * v_dim).map(|i| f(i + 977 * j, 0.61)).collect())
                        .collect();
                    let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
                    let probs: Vec<f32> = (0..heads * n).map(|j| f(j, 1.3).abs()).collect();
                    let mut got = vec![f32::NAN; heads * v_dim];
                    weighted_heads(&probs, n, &refs, group, v_dim, &mut got);
                    let case = format!("v_dim {v_dim}, heads {heads}, group {group}, n {n}");
                    assert_sums_per_head(&got, &probs, &refs, (group, v_dim), &case);
                }
            }
        }
    }

    /// The token kernels this CPU runs (AVX-512 where it has it: two heads per register,
    /// sixteen value columns per register) score and sum bit for bit as the AVX2 ones one
    /// head at a time, for f32, f16 and bf16 rows: head widths with and without a scalar
    /// tail and past the pair kernel's widest, query heads in pairs sharing a key/value head
    /// and not, an odd head left over, value widths on the sixteen-column kernel and off it,
    /// contexts around multiples of eight keys.
    #[test]
    fn token_kernels_score_and_sum_bit_for_bit_as_one_head_at_a_time() {
        fn check<E: KvLanes>(narrow: fn(f32) -> E) {
            let f = |i: usize, s: f32| (i as f32 * s).sin() * 2f32.powi((i % 7) as i32 - 3);
            let kernels = TokenKernels::detect();
            for (heads, group) in [
                (1usize, 1usize),
                (2, 1),
                (2, 2),
                (3, 1),
                (5, 5),
                (8, 2),
                (8, 4),
                (6, 3),
            ] {
                let kv = heads / group;
                let shape = |width: usize| AttnShape {
                    num_heads: heads,
                    num_kv_heads: kv,
                    qk_dim: width,
                    v_dim: width,
                    scale: 0.3,
                    window: None,
                };
                for d in [3usize, 8, 20, 64, 72, 264] {
                    for n in [0usize, 1, 7, 8, 9, 17, 40] {
                        let rows: Vec<Vec<E>> = (0..n)
                            .map(|j| {
                                (0..kv * d + 5)
                                    .map(|i| narrow(f(i + 331 * j, 0.71)))
                                    .collect()
                            })
                            .collect();
                        let keys: Vec<&[E]> = rows.iter().map(Vec::as_slice).collect();
                        let q: Vec<f32> = (0..heads * d).map(|i| f(i, 1.7)).collect();
                        let mut got = vec![f32::NAN; heads * n];
                        kernels.scores(&q, &keys, shape(d), &mut got);
                        let case = format!("d {d}, heads {heads}/{group}, n {n}");
                        assert_scores_per_head(&got, &q, &keys, (group, d, 0.3), &case);
                    }
                }
                for v_dim in [16usize, 24, 32, 48, 64, 128] {
                    for n in [0usize, 1, 9, 33] {
                        let rows: Vec<Vec<E>> = (0..n)
                            .map(|j| {
                                (0..kv * v_dim)
                                    .map(|i| narrow(f(i + 977 * j, 0.61)))
                                    .collect()
                            })
                            .collect();
                        let refs: Vec<&[E]> = rows.iter().map(Vec::as_slice).collect();
                        let probs: Vec<f32> = (0..heads * n).map(|j| f(j, 1.3).abs()).collect();
                        let mut got = vec![f32::NAN; heads * v_dim];
                        kernels.weighted(&probs, n, &refs, shape(v_dim), &mut got);
                        let case = format!("v_dim {v_dim}, heads {heads}/{group}, n {n}");
                        assert_sums_per_head(&got, &probs, &refs, (group, v_dim), &case);
                    }
                }
            }
        }
        check::<f32>(|v| v);
        check::<half::f16>(half::f16::from_f32);
        check::<half::bf16>(half::bf16::from_f32);
    }

    /// Dense reference: one sequence, all positions given as plain arrays.
    fn reference(q: &[f32], k: &[f32], v: &[f32], t: usize, sh: AttnShape) -> Vec<f32> {
        let (h, kvh, d, vd) = (sh.num_heads, sh.num_kv_heads, sh.qk_dim, sh.v_dim);
        let mut out = vec![0f32; t * h * vd];
        for i in 0..t {
            for hh in 0..h {
                let g = hh / (h / kvh);
                let lo = sh.window.map_or(0, |w| (i + 1).saturating_sub(w));
                let mut s: Vec<f64> = (lo..=i)
                    .map(|j| {
                        (0..d)
                            .map(|c| {
                                q[(i * h + hh) * d + c] as f64 * k[(j * kvh + g) * d + c] as f64
                            })
                            .sum::<f64>()
                            * sh.scale as f64
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for x in s.iter_mut() {
                    *x = (*x - m).exp() / z;
                }
                for c in 0..vd {
                    out[(i * h + hh) * vd + c] = (lo..=i)
                        .map(|j| s[j - lo] * v[(j * kvh + g) * vd + c] as f64)
                        .sum::<f64>() as f32;
                }
            }
        }
        out
    }

    /// Queries, keys and values of `t` tokens for 4 query heads over 2 key/value heads, each
    /// element `f(index, stream's frequency)`.
    fn four_heads_over_two(
        t: usize,
        qk_dim: usize,
        v_dim: usize,
        f: impl Fn(usize, f32) -> f32,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let q = (0..t * 4 * qk_dim).map(|i| f(i, 0.37)).collect();
        let k = (0..t * 2 * qk_dim).map(|i| f(i, 0.91)).collect();
        let v = (0..t * 2 * v_dim).map(|i| f(i, 1.3)).collect();
        (q, k, v)
    }

    /// Paged attention of one 7-token sequence (3-token blocks) against the dense reference:
    /// as one prefill span, as prefill(4) + decode spans, and with a sliding window.
    fn check_paged_against_dense(qk_dim: usize, v_dim: usize) {
        let sh = AttnShape {
            num_heads: 4,
            num_kv_heads: 2,
            qk_dim,
            v_dim,
            scale: 0.7,
            window: None,
        };
        let (t, kd, vd) = (7, 2 * qk_dim, 2 * v_dim);
        let (q, k, v) = four_heads_over_two(t, qk_dim, v_dim, |i, s| (i as f32 * s).sin() * 2.0);
        // Two layers: the attended one is layer 1, and layer 0 holds other values, so a
        // row read from the wrong layer shows.
        let layout = KvLayout {
            num_layers: 2,
            k_dim: kd,
            v_dim: vd,
            block_size: 3,
        };
        let mut pool = KvPool::new(layout, 4, Dtype::F32).unwrap();
        let blocks: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
        let (nk, nv): (Vec<f32>, Vec<f32>) = (
            k.iter().map(|x| 3.0 - x).collect(),
            v.iter().map(|x| -x).collect(),
        );
        for p in 0..t {
            let (kp, vp) = (p * kd..(p + 1) * kd, p * vd..(p + 1) * vd);
            pool.write(blocks[p / 3].id(), 1, p % 3, &k[kp.clone()], &v[vp.clone()]);
            pool.write(blocks[p / 3].id(), 0, p % 3, &nk[kp], &nv[vp]);
        }
        let ids: Vec<_> = blocks.iter().map(|b| b.id()).collect();
        let span = |first_token, num_tokens, start_pos| SeqSpan {
            first_token,
            num_tokens,
            start_pos,
            blocks: ids.clone(),
        };
        let want = reference(&q, &k, &v, t, sh);
        let mut out = vec![0f32; t * 4 * v_dim];
        paged_attention(&pool, 1, &[span(0, t, 0)], &q, &mut out, sh, true);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "v_dim {v_dim}: {a} vs {b}");
        }
        let spans = [span(0, 4, 0), span(4, 3, 4)];
        let mut out2 = vec![0f32; t * 4 * v_dim];
        paged_attention(&pool, 1, &spans, &q, &mut out2, sh, false);
        assert_eq!(out, out2);
        // A sliding window of 3 keys (Mixtral-style).
        let shw = AttnShape {
            window: Some(3),
            ..sh
        };
        let want = reference(&q, &k, &v, t, shw);
        paged_attention(&pool, 1, &[span(0, t, 0)], &q, &mut out, shw, true);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "window, v_dim {v_dim}: {a} vs {b}");
        }
    }

    #[test]
    fn paged_equals_dense_across_block_boundaries() {
        check_paged_against_dense(3, 2);
        // Value heads wider than one register chunk, with a ragged last chunk.
        check_paged_against_dense(20, V_CHUNK + 8);
    }

    /// An f16 or bf16 pool gives, bit for bit, what an f32 pool holding the same keys and
    /// values rounded to that type gives: the kernels widen the stored values exactly and
    /// add the same products in the same order. Head widths with and without eight-value
    /// chunks and a scalar tail, value heads over the tiled and the plain sums, contexts
    /// across several eight-key groups.
    #[test]
    fn half_pools_attend_bit_for_bit_as_f32_pools_of_the_rounded_values() {
        let f = |i: usize, s: f32| (i as f32 * s).sin() * 2f32.powi((i % 5) as i32 - 2);
        for (qk_dim, v_dim) in [(64usize, 64usize), (24, 24), (20, 40), (3, 2)] {
            let sh = AttnShape {
                num_heads: 4,
                num_kv_heads: 2,
                qk_dim,
                v_dim,
                scale: 0.3,
                window: None,
            };
            let (t, kd, vd, bs) = (19, 2 * qk_dim, 2 * v_dim, 4);
            let (q, k, v) = four_heads_over_two(t, qk_dim, v_dim, f);
            let layout = KvLayout {
                num_layers: 1,
                k_dim: kd,
                v_dim: vd,
                block_size: bs,
            };
            for dtype in [Dtype::F16, Dtype::Bf16] {
                let round = |x: &f32| match dtype {
                    Dtype::F16 => half::f16::from_f32(*x).to_f32(),
                    _ => half::bf16::from_f32(*x).to_f32(),
                };
                let (kr, vr): (Vec<f32>, Vec<f32>) =
                    (k.iter().map(round).collect(), v.iter().map(round).collect());
                let attend_with = |pool_dtype: Dtype, k: &[f32], v: &[f32]| {
                    let mut pool = KvPool::new(layout, t.div_ceil(bs), pool_dtype).unwrap();
                    let blocks: Vec<_> = (0..t.div_ceil(bs))
                        .map(|_| pool.allocate().unwrap())
                        .collect();
                    for p in 0..t {
                        let (kp, vp) = (&k[p * kd..(p + 1) * kd], &v[p * vd..(p + 1) * vd]);
                        pool.write(blocks[p / bs].id(), 0, p % bs, kp, vp);
                    }
                    let span = SeqSpan {
                        first_token: 0,
                        num_tokens: t,
                        start_pos: 0,
                        blocks: blocks.iter().map(|b| b.id()).collect(),
                    };
                    let mut out = vec![0f32; t * 4 * v_dim];
                    paged_attention(&pool, 0, &[span], &q, &mut out, sh, true);
                    out
                };
                let half = attend_with(dtype, &k, &v);
                let wide = attend_with(Dtype::F32, &kr, &vr);
                for (i, (a, b)) in half.iter().zip(&wide).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "{dtype} {qk_dim}/{v_dim}: {i}");
                }
            }
        }
    }
}
