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
//! measured f32 GEMM peak of 120–180 GFLOP/s).

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
/// each in two half-panel passes. (A one-pass tile over the whole panel for one or two rows,
/// four accumulators a row, did not move batch-1 decode: 166 against 167 tokens/s.)
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
