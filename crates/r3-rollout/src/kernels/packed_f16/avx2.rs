//! The AVX2 form of the panel kernel (x86-64 CPUs with AVX2, FMA and F16C but no AVX-512:
//! AMD Zen 1–3, Intel client cores and many cloud VMs), bit for bit the others.
//!
//! A 16-lane AVX-512 register holds half a panel line; an AVX2 register holds a quarter, and
//! there are 16 registers instead of 32. So a tile covers half a panel — 16 output columns,
//! two 8-lane accumulators a row — for up to [`TILE_ROWS`] rows, and a row tile runs the two
//! halves one after the other (the second reads the panel's lines again, from cache). Per
//! reduction step a half widens two eight-value pieces of the line (`vcvtph2ps` for f16, a
//! zero extension and a 16-bit shift for bf16) and does one broadcast-FMA per row and piece.
//! Each output adds its products one reduction step after another from zero, as the portable
//! loop and the AVX-512 kernel do, so every kernel writes the same bits.
//!
//! Why: without AVX-512 the panels took the portable loop, which widens a whole panel into
//! an f32 scratch and reads it back once per row (`examples/expert_stream.rs` on a 2-core
//! AVX2-only AMD EPYC: 8 rows an expert 55 ms with the weights cached, 58 GFLOP/s, against a
//! measured f32 GEMM peak of 120–180 GFLOP/s; this kernel 21–23 ms cached and 27 ms with the
//! weights streamed from memory).

use std::arch::x86_64::*;

use super::{row_tiles, HalfKind, Line, PANEL};

/// Input rows per register tile: six rows' two accumulators, the two widened weight pieces
/// and one broadcast fill 15 of AVX2's 16 registers.
pub(super) const TILE_ROWS: usize = 6;

/// Output columns of a half panel: two 8-lane registers.
const HALF: usize = PANEL / 2;

/// Lines (reduction steps, 64 bytes each) ahead of use the panel's first pass asks for its
/// next line: the same distance as the AVX-512 kernel's (a decode step streams every
/// expert's weights from memory once).
const PREFETCH_LINES: usize = 96;

/// Where one pass over a panel stands among all of them: the first pass streams the panel
/// from memory; each later one finds it in cache and asks for a share of the next panel's
/// lines (panels lie back to back, and a task runs its panels in order), so that memory keeps
/// streaming while the panel is read again: pass `i` asks for every `(count − 1)`-th line
/// from line `i − 1` on, so the later passes share the next panel's lines out among them.
#[derive(Debug, Clone, Copy)]
struct Pass {
    /// This pass's place, 0 for the first.
    index: usize,
    /// How many passes the panel gets (two halves a row tile).
    count: usize,
}

/// `m` input rows times one panel of `kind` values: row tiles of up to [`TILE_ROWS`] rows,
/// each in two half-panel passes. (Tried and not kept: a one-pass tile over the whole panel
/// for one or two rows, four accumulators a row, did not move batch-1 decode, 166 against 167
/// tokens/s; whole-panel tiles of up to three rows for every batch, 16 registers, ran 8 rows
/// an expert in 36 ms against 21–23 in `examples/expert_stream.rs`.)
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` holds `m·k` values, `panel` `k` lines, and
/// `out` is writable for `m` rows `ldo` apart of `cols` (≤ `PANEL`) values, untouched by
/// others meanwhile.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn panel_times(
    kind: HalfKind,
    x: &[f32],
    m: usize,
    k: usize,
    panel: &[Line],
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    let halves = cols.div_ceil(HALF);
    let passes = m.div_ceil(TILE_ROWS) * halves;
    for (t, (r0, rows)) in row_tiles(m, TILE_ROWS).enumerate() {
        for half in 0..halves {
            let first = half * HALF;
            let job = HalfTile {
                x: &x[r0 * k..(r0 + rows) * k],
                k,
                panel,
                half,
                pass: Pass {
                    index: t * halves + half,
                    count: passes,
                },
                out: out.add(r0 * ldo + first),
                ldo,
                cols: HALF.min(cols - first),
            };
            match kind {
                HalfKind::F16 => tile_rows::<false>(&job, rows),
                HalfKind::Bf16 => tile_rows::<true>(&job, rows),
            }
        }
    }
}

/// One half-panel pass of a row tile: its input rows `x` (`k` values each), the panel, which
/// half (0 or 1), the pass's place among the panel's passes, and the output: `cols` (≤ 16)
/// valid columns of rows `ldo` apart from `out` on.
#[derive(Clone, Copy)]
struct HalfTile<'a> {
    x: &'a [f32],
    k: usize,
    panel: &'a [Line],
    half: usize,
    pass: Pass,
    out: *mut f32,
    ldo: usize,
    cols: usize,
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile_rows<const BF16: bool>(job: &HalfTile<'_>, rows: usize) {
    match rows {
        6 => half_tile::<6, BF16>(job),
        5 => half_tile::<5, BF16>(job),
        4 => half_tile::<4, BF16>(job),
        3 => half_tile::<3, BF16>(job),
        2 => half_tile::<2, BF16>(job),
        _ => half_tile::<1, BF16>(job),
    }
}

/// Eight 16-bit values at `p` widened to f32 lanes: f16 by conversion, bf16 by putting its
/// bits in the upper half of each lane (exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn widen8<const BF16: bool>(p: *const __m128i) -> __m256 {
    let v = _mm_loadu_si128(p);
    if BF16 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
    } else {
        _mm256_cvtph_ps(v)
    }
}

/// `R` rows times half `job.half` of the panel.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn half_tile<const R: usize, const BF16: bool>(job: &HalfTile<'_>) {
    let HalfTile {
        x,
        k,
        panel,
        half,
        pass,
        out,
        ldo,
        cols,
    } = *job;
    const { assert!(R <= TILE_ROWS && PANEL == 32) };
    debug_assert!(x.len() >= R * k && panel.len() >= k && half < 2);
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // A line is four 16-byte pieces of eight values; this half reads pieces 2·half and
    // 2·half + 1.
    let lines = panel.as_ptr() as *const __m128i;
    // Each row's start, so that a step addresses a row's value as start + c (the compiler
    // otherwise recomputed r·k + c for every row and step).
    let row_starts: [*const f32; R] = std::array::from_fn(|r| x.as_ptr().add(r * k));
    // Later passes: this pass's share of the next panel, every `stride`-th line.
    let stride = pass.count.saturating_sub(1).max(1);
    let mut skip = pass.index.saturating_sub(1);
    for c in 0..k {
        // Past the panel's end a request reaches the next panel or harmlessly past the
        // buffer: a prefetch never faults, hence `wrapping_add`.
        if pass.index == 0 {
            _mm_prefetch::<_MM_HINT_T0>(lines.wrapping_add(4 * (c + PREFETCH_LINES)) as *const i8);
        } else if skip == 0 {
            _mm_prefetch::<_MM_HINT_T1>(lines.wrapping_add(4 * (c + k)) as *const i8);
            skip = stride - 1;
        } else {
            skip -= 1;
        }
        let piece = lines.add(4 * c + 2 * half);
        let w0 = widen8::<BF16>(piece);
        let w1 = widen8::<BF16>(piece.add(1));
        for (a, row) in acc.iter_mut().zip(&row_starts) {
            let xb = _mm256_broadcast_ss(&*row.add(c));
            a[0] = _mm256_fmadd_ps(xb, w0, a[0]);
            a[1] = _mm256_fmadd_ps(xb, w1, a[1]);
        }
    }
    if cols == HALF {
        for (r, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(r * ldo), a[0]);
            _mm256_storeu_ps(out.add(r * ldo + 8), a[1]);
        }
    } else {
        // The weight's last panel: only its own columns are written (the output may hold
        // other values past them).
        let mut row = [0f32; HALF];
        for (r, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(row.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(row.as_mut_ptr().add(8), a[1]);
            std::ptr::copy_nonoverlapping(row.as_ptr(), out.add(r * ldo), cols);
        }
    }
}

/// Rows (and reduction steps) of a block the pack transposes in registers: 8 × 8 f32.
const LANES: usize = 8;

/// Values ahead of the block each row's next cache line is asked for (a panel reads its 32
/// rows side by side, more streams than the hardware prefetcher follows), as the AVX-512
/// pack does.
const PACK_PREFETCH_AHEAD: usize = 64;

/// Packs one panel: `rows` (≤ PANEL, each `k` values) narrowed to `kind` and written k-major
/// into `panel` (`k` lines), as the AVX-512 pack with eight-lane registers: each 8 rows × 8
/// reduction steps block is loaded row by row, transposed in registers and narrowed a
/// quarter line per instruction; a missing row group (the tail panel) stays zero, the last
/// block of a `k` that is not a multiple of 8 is loaded masked, and lines are written whole
/// with streaming stores. The same bits as `half`'s conversions.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; every row of `rows` holds at least `k` values,
/// `rows.len() ≤ PANEL` and `panel` holds at least `k` lines.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pack_panel(kind: HalfKind, rows: &[&[f32]], k: usize, panel: &mut [Line]) {
    match kind {
        HalfKind::F16 => pack_panel_as::<false>(rows, k, panel),
        HalfKind::Bf16 => pack_panel_as::<true>(rows, k, panel),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn pack_panel_as<const BF16: bool>(rows: &[&[f32]], k: usize, panel: &mut [Line]) {
    debug_assert!(rows.len() <= PANEL && panel.len() >= k);
    debug_assert!(rows.iter().all(|r| r.len() >= k));
    let out = panel.as_mut_ptr();
    let lane_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for c0 in (0..k).step_by(LANES) {
        let width = LANES.min(k - c0);
        // Lanes below `width` are loaded; the others read as zero and are not touched
        // (a masked load suppresses their faults).
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(width as i32), lane_index);
        // Each line of the block as four eight-column quarters (one a row group).
        let mut lines = [[_mm_setzero_si128(); PANEL / LANES]; LANES];
        for (group, block) in rows.chunks(LANES).enumerate() {
            let mut v = [_mm256_setzero_ps(); LANES];
            for (lane, row) in v.iter_mut().zip(block) {
                let at = row.as_ptr().add(c0);
                if c0 + PACK_PREFETCH_AHEAD < k {
                    _mm_prefetch::<_MM_HINT_T0>(at.add(PACK_PREFETCH_AHEAD).cast::<i8>());
                }
                *lane = if width == LANES {
                    _mm256_loadu_ps(at)
                } else {
                    _mm256_maskload_ps(at, mask)
                };
            }
            transpose8(&mut v);
            for (line, column) in lines.iter_mut().zip(&v).take(width) {
                line[group] = narrow8::<BF16>(*column);
            }
        }
        for (c, &[q0, q1, q2, q3]) in lines.iter().take(width).enumerate() {
            let line = out.add(c0 + c).cast::<__m256i>();
            // `Line` is 64-byte aligned, so both 32-byte halves are, as streaming stores need.
            _mm256_stream_si256(line, _mm256_set_m128i(q1, q0));
            _mm256_stream_si256(line.add(1), _mm256_set_m128i(q3, q2));
        }
    }
    // Streaming stores are weakly ordered: fence them before the panel is handed back.
    _mm_sfence();
}

/// Eight f32 lanes rounded to f16 or bf16 (nearest, ties to even), as eight 16-bit values:
/// f16 by `vcvtps2ph` with the rounding in the instruction (its immediate's bit 2 clear:
/// MXCSR's mode is not consulted); bf16 by the bit rounding of
/// [`crate::dtype::bf16_bits`] (NaN made quiet, never rounded into infinity).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn narrow8<const BF16: bool>(v: __m256) -> __m128i {
    if BF16 {
        let b = _mm256_castps_si256(v);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
        let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb);
        let rounded = _mm256_add_epi32(b, bias);
        let quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x0040_0000));
        // The magnitude is non-negative as an i32, so the signed compare is the unsigned one.
        let magnitude = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFF_FFFF));
        let nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F80_0000));
        let bits = _mm256_srli_epi32::<16>(_mm256_blendv_epi8(rounded, quiet, nan));
        // Every lane fits 16 bits after the shift: the saturating pack keeps it whole, and
        // packing the low half with the high half keeps the lanes in order.
        _mm_packus_epi32(
            _mm256_castsi256_si128(bits),
            _mm256_extracti128_si256::<1>(bits),
        )
    } else {
        _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)
    }
}

/// Transposes the 8 × 8 block of f32 held in `r` (row i in `r[i]`) in registers.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn transpose8(r: &mut [__m256; LANES]) {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    r[0] = _mm256_permute2f128_ps::<0x20>(s0, s4);
    r[1] = _mm256_permute2f128_ps::<0x20>(s1, s5);
    r[2] = _mm256_permute2f128_ps::<0x20>(s2, s6);
    r[3] = _mm256_permute2f128_ps::<0x20>(s3, s7);
    r[4] = _mm256_permute2f128_ps::<0x31>(s0, s4);
    r[5] = _mm256_permute2f128_ps::<0x31>(s1, s5);
    r[6] = _mm256_permute2f128_ps::<0x31>(s2, s6);
    r[7] = _mm256_permute2f128_ps::<0x31>(s3, s7);
}
