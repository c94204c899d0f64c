//! Half-precision (f16 or bf16) weights packed in column panels for the decode matmul
//! `y = x · Wᵀ`.
//!
//! A panel holds `PANEL` consecutive output columns (weight rows) stored k-major, so step `c`
//! of the reduction reads one contiguous line of `PANEL` 16-bit values. The kernel keeps an
//! `[rows × PANEL]` block of outputs in registers, widens each line to f32 in registers and
//! does one broadcast-FMA per input row: no horizontal sums, no f32 copy of the weights, and
//! the output lands row-major. With AVX-512 f16 widens with `vcvtph2ps` and bf16 with a zero
//! extension and a 16-bit shift (bf16 is the upper half of an f32), then `vfmadd231ps`; with
//! AVX2 the same over half a panel at a time (`packed_f16/avx2.rs`); other CPUs widen a panel
//! to an f32 scratch and use portable loops. Every kernel writes the same bits.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use rayon::prelude::*;

use crate::dtype::bf16_bits;
use crate::kernels::ops::{prefetch_lines, CacheLevel};

#[cfg(target_arch = "x86_64")]
mod avx2;

/// A row-major matrix given as row blocks stacked in order (`[q; k; v]`, `[gate; up]`, or one
/// block), each borrowed where it lies: packing reads the rows without first copying the
/// blocks into one buffer.
#[derive(Debug, Clone, Copy)]
pub struct StackedRows<'a> {
    parts: &'a [&'a [f32]],
    width: usize,
}

impl<'a> StackedRows<'a> {
    /// The blocks `parts`, each a whole number of rows of `width` values (a `width` of 0
    /// holds no rows).
    pub fn new(parts: &'a [&'a [f32]], width: usize) -> Self {
        StackedRows { parts, width }
    }

    /// Values per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        match self.width {
            0 => 0,
            w => self.parts.iter().map(|p| p.len() / w).sum(),
        }
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `r` (panics past the last row, like an index).
    pub fn row(&self, mut r: usize) -> &'a [f32] {
        let w = self.width;
        for part in self.parts {
            let rows = part.len() / w.max(1);
            if r < rows {
                return &part[r * w..(r + 1) * w];
            }
            r -= rows;
        }
        panic!("row past the end of the stacked blocks")
    }

    /// The blocks in order.
    pub fn parts(&self) -> &'a [&'a [f32]] {
        self.parts
    }
}

/// Which 16-bit float format a packed weight holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HalfKind {
    /// IEEE half precision (5 exponent bits, 10 mantissa bits).
    F16,
    /// bfloat16 (8 exponent bits, 7 mantissa bits).
    Bf16,
}

impl HalfKind {
    /// The bits of `src` rounded to this format (nearest, ties to even), into `dst` (same
    /// length): `f16::from_f32` / `bf16::from_f32` per value, in loops that vectorise.
    fn narrow(self, src: &[f32], dst: &mut [u16]) {
        match self {
            HalfKind::F16 => dst
                .reinterpret_cast_mut::<f16>()
                .convert_from_f32_slice(src),
            HalfKind::Bf16 => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = bf16_bits(*s);
                }
            }
        }
    }

    /// Widens 16-bit values of this format into `dst` (same length).
    fn widen(self, src: &[u16], dst: &mut [f32]) {
        match self {
            HalfKind::F16 => src.reinterpret_cast::<f16>().convert_to_f32_slice(dst),
            // bf16 is the upper half of an f32: a shift, which this loop vectorises.
            HalfKind::Bf16 => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = f32::from_bits(u32::from(*s) << 16);
                }
            }
        }
    }
}

/// Output columns per panel (two 16-lane f32 vectors).
pub const PANEL: usize = 32;
/// Reduction steps per tile of [`PackedF16::repack`].
const TILE_K: usize = 64;
/// Input rows per register tile: fourteen rows' two accumulators, the panel line's two
/// halves and one broadcast fill 31 of AVX-512's 32 registers. Decode at batch 64 hands each
/// of 32 experts (top-4) 8 ± 2.6 rows; an expert past a tile's height runs a second tile,
/// which reads its panel again from L2 and widens it again (`examples/expert_stream.rs`, 256
/// experts of 12 rows streamed: 12.5–12.8 ms with 8-row tiles, 10.6–11.2 ms with 12- or 14-row tiles).
const TILE_ROWS: usize = 14;

/// Which code computes the panels, chosen from the CPU's features. Safe code can obtain one
/// only from [`PanelKernel::detect`], [`PanelKernel::available`] or
/// [`PanelKernel::portable`], so the AVX-512 kernel runs only where detection found AVX-512F,
/// and the AVX2 one only where it found AVX2, FMA and F16C.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PanelKernel(KernelChoice);

/// The private choice behind a [`PanelKernel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KernelChoice {
    /// AVX-512F intrinsics (x86-64 CPUs that have them).
    Avx512,
    /// AVX2, FMA and F16C intrinsics, half a panel at a time (x86-64 CPUs without AVX-512).
    Avx2,
    /// Portable loops over a widened panel.
    Portable,
}

impl PanelKernel {
    /// The fastest kernel this CPU runs.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return PanelKernel(KernelChoice::Avx512);
            }
        }
        PanelKernel::avx2().unwrap_or_else(PanelKernel::portable)
    }

    /// The AVX2 kernel, where the CPU has AVX2, FMA and F16C.
    fn avx2() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Some(PanelKernel(KernelChoice::Avx2));
            }
        }
        None
    }

    /// The portable kernel (runs on every CPU).
    pub fn portable() -> Self {
        PanelKernel(KernelChoice::Portable)
    }

    /// The kernel's name, as a benchmark prints it: `avx512`, `avx2` or `portable`.
    pub fn name(&self) -> &'static str {
        match self.0 {
            KernelChoice::Avx512 => "avx512",
            KernelChoice::Avx2 => "avx2",
            KernelChoice::Portable => "portable",
        }
    }

    /// Every kernel this CPU runs, the portable one first and the detected one last: for
    /// tests and benchmarks that compare them (they write the same bits).
    pub fn available() -> Vec<Self> {
        let mut kernels = vec![PanelKernel::portable()];
        kernels.extend(PanelKernel::avx2());
        let detected = PanelKernel::detect();
        if !kernels.contains(&detected) {
            kernels.push(detected);
        }
        kernels
    }
}

/// One line of a panel: the `PANEL` 16-bit values of one reduction step, 64 bytes on a cache
/// line of their own, so the AVX-512 pack writes each with one aligned streaming store and
/// the decode kernel's two loads per line touch one cache line.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(C, align(64))]
struct Line([u16; PANEL]);

const _: () = assert!(std::mem::size_of::<Line>() == 2 * PANEL);

impl Line {
    /// A line of zeros (also the padding of a tail panel's missing columns).
    const ZERO: Line = Line([0; PANEL]);
}

impl std::fmt::Debug for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Weight `[n, k]` (row-major, as HF stores it) repacked into `ceil(n / PANEL)` panels of
/// `[k][PANEL]` 16-bit values of one [`HalfKind`]; the last panel's missing columns are zero.
#[derive(Debug, Clone)]
pub struct PackedF16 {
    /// `panels · k` lines, panel after panel.
    data: Vec<Line>,
    kind: HalfKind,
    n: usize,
    k: usize,
}

impl PackedF16 {
    /// Packs row-major f32 weights `w [n, k]`, rounding to f16.
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        Self::pack_as(HalfKind::F16, w, n, k)
    }

    /// Packs row-major f32 weights `w [n, k]`, rounding to `kind`.
    pub fn pack_as(kind: HalfKind, w: &[f32], n: usize, k: usize) -> Self {
        Self::pack_rows(kind, &StackedRows::new(&[w], k), n)
    }

    /// Packs the `n` rows of `rows` (each `k = rows.width()` values), rounding to `kind`.
    pub fn pack_rows(kind: HalfKind, rows: &StackedRows<'_>, n: usize) -> Self {
        let mut packed = Self::zeros(kind, n, rows.width());
        packed.repack(rows);
        packed
    }

    /// An `[n, k]` weight of zeros.
    fn zeros(kind: HalfKind, n: usize, k: usize) -> Self {
        PackedF16 {
            data: vec![Line::ZERO; n.div_ceil(PANEL) * k],
            kind,
            n,
            k,
        }
    }

    /// Overwrites the packed values with `rows` (this weight's `n` rows of `k` values, the
    /// caller checked), in place: a weight sync reuses the buffer instead of allocating (and
    /// page-faulting) a new one. Panels are packed on the rayon pool by the fastest packing
    /// code this CPU runs ([`PackedF16::repack_with`]).
    pub fn repack(&mut self, rows: &StackedRows<'_>) {
        self.repack_with(PanelKernel::detect(), rows);
    }

    /// [`PackedF16::repack`] by the packing code of `kernel`. Every kernel writes the same
    /// bits (round to nearest, ties to even, as `f16::from_f32` / `bf16::from_f32`): the
    /// AVX-512 one transposes 16×16 blocks in registers, narrows 16 columns of a line per
    /// instruction and streams each line out whole, the portable one narrows row tiles and
    /// transposes them with scalar moves. The tail panel's missing columns stay zero (the
    /// AVX-512 kernel writes them as the zero they hold).
    ///
    /// # Panics
    /// When `rows` is not `n` rows of `k` values (the unchecked loads below rely on it).
    pub fn repack_with(&mut self, kernel: PanelKernel, rows: &StackedRows<'_>) {
        let (kind, n, k) = (self.kind, self.n, self.k);
        assert_eq!(
            (rows.len(), rows.width()),
            (n, k),
            "repack: rows of the wrong shape"
        );
        // `max(1)`: a weight with k = 0 holds no lines, and chunks must not be empty.
        self.data
            .par_chunks_mut(k.max(1))
            .enumerate()
            .for_each(|(p, panel)| {
                let cols = PANEL.min(n - p * PANEL);
                match kernel.0 {
                    #[cfg(target_arch = "x86_64")]
                    KernelChoice::Avx512 => {
                        let panel_rows = panel_rows(rows, p, cols);
                        // SAFETY: only `detect` builds an Avx512 kernel (the field is
                        // private), and only where the CPU has AVX-512F; each of the `cols`
                        // (≤ PANEL) rows holds k values (`row` slices whole rows of width k,
                        // checked above) and the panel k lines (the chunk size).
                        unsafe { avx512::pack_panel(kind, &panel_rows[..cols], k, panel) }
                    }
                    #[cfg(target_arch = "x86_64")]
                    KernelChoice::Avx2 => {
                        let panel_rows = panel_rows(rows, p, cols);
                        // SAFETY: only `avx2` builds an Avx2 kernel, and only where the CPU
                        // has AVX2, FMA and F16C; the rows and the panel as for the AVX-512
                        // pack above.
                        unsafe { avx2::pack_panel(kind, &panel_rows[..cols], k, panel) }
                    }
                    _ => portable_pack_panel(kind, rows, p, cols, panel),
                }
            });
    }

    /// Rows of the weight `[n, k]`.
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Columns of the weight `[n, k]`.
    pub fn cols(&self) -> usize {
        self.k
    }

    /// The format of the packed values.
    pub fn kind(&self) -> HalfKind {
        self.kind
    }

    /// Number of panels.
    pub fn panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<Line>()
    }

    /// Panel `p` as its `k` lines.
    fn panel(&self, p: usize) -> &[Line] {
        &self.data[p * self.k..(p + 1) * self.k]
    }

    /// Valid output columns of panel `p`.
    fn panel_cols(&self, p: usize) -> usize {
        PANEL.min(self.n - p * PANEL)
    }

    /// Widens panels `p0..p1` into `[k, cols]` row-major f32 (the matrix `Wᵀ` restricted to
    /// those columns), for the large-batch gemm path.
    pub fn widen_panels(&self, p0: usize, p1: usize, out: &mut Vec<f32>) -> usize {
        let cols: usize = (p0..p1).map(|p| self.panel_cols(p)).sum();
        out.clear();
        out.resize(self.k * cols, 0.0);
        let mut line = [0f32; PANEL];
        let mut col0 = 0;
        for p in p0..p1 {
            let pc = self.panel_cols(p);
            for (c, src) in self.panel(p).iter().enumerate() {
                self.kind.widen(&src.0, &mut line);
                out[c * cols + col0..c * cols + col0 + pc].copy_from_slice(&line[..pc]);
            }
            col0 += pc;
        }
        cols
    }

    /// Output columns `p * PANEL ..` for all `m` input rows: `out` is the row-major `[m, ldo]`
    /// output offset to the panel's first column (`out[r * ldo + j]`, j < panel columns).
    pub fn panel_times(
        &self,
        kernel: PanelKernel,
        p: usize,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        ldo: usize,
    ) {
        assert!(m == 0 || out.len() >= (m - 1) * ldo + self.panel_cols(p));
        // SAFETY: `out` holds every element the call writes (asserted above) and is borrowed
        // mutably for its duration.
        unsafe { self.panel_times_into(kernel, p, x, m, out.as_mut_ptr(), ldo) }
    }

    /// [`PackedF16::panel_times`] into a raw output, for tasks that write disjoint columns of
    /// one shared output side by side (no task holds a `&mut` to all of it).
    ///
    /// # Panics
    /// When `x` holds fewer than `m` rows of this weight's `k` values, or `p` is not a panel.
    ///
    /// # Safety
    /// `out` is valid for writes of `m` rows `ldo` apart of this panel's columns (`PANEL`, or
    /// what is left of the weight's rows for the last panel), and no one else reads or writes
    /// those elements meanwhile.
    pub unsafe fn panel_times_into(
        &self,
        kernel: PanelKernel,
        p: usize,
        x: &[f32],
        m: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let k = self.k;
        assert!(x.len() >= m * k, "panel_times: short input");
        let panel = self.panel(p);
        let cols = self.panel_cols(p);
        match kernel.0 {
            #[cfg(target_arch = "x86_64")]
            KernelChoice::Avx512 => {
                for (r0, rows) in row_tiles(m, TILE_ROWS) {
                    let xs = &x[r0 * k..(r0 + rows) * k];
                    // SAFETY: only `detect` builds an Avx512 kernel (the field is private), and
                    // only where the CPU has AVX-512F; the slices cover `rows` input rows of k
                    // values and a k×PANEL panel; `out` is writable for `rows` rows of stride
                    // ldo with `cols` valid columns from row r0 on (the caller's contract).
                    unsafe {
                        avx512::tile(self.kind, xs, rows, k, panel, out.add(r0 * ldo), ldo, cols)
                    };
                }
            }
            #[cfg(target_arch = "x86_64")]
            KernelChoice::Avx2 => {
                // SAFETY: only `avx2` builds an Avx2 kernel (the field is private), and only
                // where the CPU has AVX2, FMA and F16C; `x` covers m rows of k values
                // (asserted above), the panel k lines, and `out` is writable for m rows of
                // stride ldo with `cols` valid columns (the caller's contract).
                unsafe { avx2::panel_times(self.kind, x, m, k, panel, out, ldo, cols) };
            }
            _ => portable_panel(self.kind, panel, x, m, k, out, ldo, cols),
        }
    }
}

/// Panel `p`'s `cols` (≤ PANEL) rows of `rows`, borrowed where they lie (the rest empty): what
/// the SIMD packs read side by side.
#[cfg(target_arch = "x86_64")]
fn panel_rows<'a>(rows: &StackedRows<'a>, p: usize, cols: usize) -> [&'a [f32]; PANEL] {
    let mut panel_rows: [&[f32]; PANEL] = [&[]; PANEL];
    for (j, r) in panel_rows.iter_mut().enumerate().take(cols) {
        *r = rows.row(p * PANEL + j);
    }
    panel_rows
}

/// `m` rows split into `ceil(m / tile_rows)` tiles of nearly equal height: `(first, rows)`.
fn row_tiles(m: usize, tile_rows: usize) -> impl Iterator<Item = (usize, usize)> {
    let tiles = m.div_ceil(tile_rows);
    let (base, extra) = (m / tiles.max(1), m % tiles.max(1));
    (0..tiles).scan(0, move |r0, t| {
        let rows = base + usize::from(t < extra);
        let first = *r0;
        *r0 += rows;
        Some((first, rows))
    })
}

/// Portable panel kernel: widen once, then row-times-panel with plain loops.
///
/// # Safety
/// `out` is valid for writes of `m` rows `ldo` apart of `cols` values each, which no one else
/// touches meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn portable_panel(
    kind: HalfKind,
    panel: &[Line],
    x: &[f32],
    m: usize,
    k: usize,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    let mut wide = vec![0f32; k * PANEL];
    for (line, w) in panel.iter().zip(wide.chunks_exact_mut(PANEL)) {
        kind.widen(&line.0, w);
    }
    for r in 0..m {
        let mut acc = [0f32; PANEL];
        for (c, line) in wide.chunks_exact(PANEL).enumerate() {
            let xv = x[r * k + c];
            for (a, w) in acc.iter_mut().zip(line) {
                *a = xv.mul_add(*w, *a);
            }
        }
        // SAFETY: row r's `cols` values lie in the caller's writable rows.
        unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), out.add(r * ldo), cols) };
    }
}

/// Portable packing of panel `p` (`cols` valid columns, `k = rows.width()`): a tile of the
/// panel's rows × TILE_K reduction steps is narrowed row by row (contiguous reads), then
/// written out line by line (contiguous writes).
fn portable_pack_panel(
    kind: HalfKind,
    rows: &StackedRows<'_>,
    p: usize,
    cols: usize,
    panel: &mut [Line],
) {
    let k = rows.width();
    let mut tile = [[0u16; TILE_K]; PANEL];
    for c0 in (0..k).step_by(TILE_K) {
        let width = TILE_K.min(k - c0);
        for (j, t) in tile.iter_mut().enumerate().take(cols) {
            let row = rows.row(p * PANEL + j);
            // The row's next tile, ahead of its use: a panel reads its 32 rows side by
            // side, more streams than the hardware prefetcher follows (the AVX-512 pack ran
            // twice as fast with it).
            let next = (c0 + TILE_K).min(k)..(c0 + 2 * TILE_K).min(k);
            prefetch_lines(&row[next], CacheLevel::L1);
            kind.narrow(&row[c0..c0 + width], &mut t[..width]);
        }
        for (c, line) in panel[c0..c0 + width].iter_mut().enumerate() {
            for (j, v) in line.0.iter_mut().enumerate().take(cols) {
                *v = tile[j][c];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{HalfKind, Line, PANEL, TILE_ROWS};
    use std::arch::x86_64::*;

    /// One register tile: `rows` (≤ TILE_ROWS) input rows times one panel of `kind` values.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `x` holds `rows·k` values, `panel` `k` lines, and `out`
    /// is writable for `rows` rows `ldo` apart of `cols` values, untouched by others meanwhile.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile(
        kind: HalfKind,
        x: &[f32],
        rows: usize,
        k: usize,
        panel: &[Line],
        out: *mut f32,
        ldo: usize,
        cols: usize,
    ) {
        match kind {
            HalfKind::F16 => tile_rows::<false>(x, rows, k, panel, out, ldo, cols),
            HalfKind::Bf16 => tile_rows::<true>(x, rows, k, panel, out, ldo, cols),
        }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tile_rows<const BF16: bool>(
        x: &[f32],
        rows: usize,
        k: usize,
        panel: &[Line],
        out: *mut f32,
        ldo: usize,
        cols: usize,
    ) {
        match rows {
            14 => tile_n::<14, BF16>(x, k, panel, out, ldo, cols),
            13 => tile_n::<13, BF16>(x, k, panel, out, ldo, cols),
            12 => tile_n::<12, BF16>(x, k, panel, out, ldo, cols),
            11 => tile_n::<11, BF16>(x, k, panel, out, ldo, cols),
            10 => tile_n::<10, BF16>(x, k, panel, out, ldo, cols),
            9 => tile_n::<9, BF16>(x, k, panel, out, ldo, cols),
            8 => tile_n::<8, BF16>(x, k, panel, out, ldo, cols),
            7 => tile_n::<7, BF16>(x, k, panel, out, ldo, cols),
            6 => tile_n::<6, BF16>(x, k, panel, out, ldo, cols),
            5 => tile_n::<5, BF16>(x, k, panel, out, ldo, cols),
            4 => tile_n::<4, BF16>(x, k, panel, out, ldo, cols),
            3 => tile_n::<3, BF16>(x, k, panel, out, ldo, cols),
            2 => tile_n::<2, BF16>(x, k, panel, out, ldo, cols),
            _ => tile_n::<1, BF16>(x, k, panel, out, ldo, cols),
        }
    }

    /// Sixteen 16-bit values at `p` widened to f32 lanes: f16 by conversion, bf16 by putting
    /// its bits in the upper half of each lane (exact).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn widen16<const BF16: bool>(p: *const __m256i) -> __m512 {
        let v = _mm256_loadu_si256(p);
        if BF16 {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
        } else {
            _mm512_cvtph_ps(v)
        }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tile_n<const R: usize, const BF16: bool>(
        x: &[f32],
        k: usize,
        panel: &[Line],
        out: *mut f32,
        ldo: usize,
        cols: usize,
    ) {
        const { assert!(R <= TILE_ROWS && PANEL == 32) };
        debug_assert!(x.len() >= R * k && panel.len() >= k);
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let wp = panel.as_ptr() as *const __m256i;
        let xp = x.as_ptr();
        for c in 0..k {
            // The line PANEL_PREFETCH_LINES ahead, asked for now: a decode step streams
            // every expert's weights from memory once, and the hardware prefetcher alone
            // left the FMAs waiting for them. Past the panel's end the request reaches the
            // next panel (panels lie back to back) or harmlessly past the buffer: a
            // prefetch never faults, hence `wrapping_add`.
            _mm_prefetch::<_MM_HINT_T0>(
                wp.wrapping_add(2 * (c + PANEL_PREFETCH_LINES)) as *const i8
            );
            let w0 = widen16::<BF16>(wp.add(2 * c));
            let w1 = widen16::<BF16>(wp.add(2 * c + 1));
            for (r, a) in acc.iter_mut().enumerate() {
                let xb = _mm512_set1_ps(*xp.add(r * k + c));
                a[0] = _mm512_fmadd_ps(xb, w0, a[0]);
                a[1] = _mm512_fmadd_ps(xb, w1, a[1]);
            }
        }
        if cols == PANEL {
            for (r, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * ldo), a[0]);
                _mm512_storeu_ps(out.add(r * ldo + 16), a[1]);
            }
        } else {
            let m0: __mmask16 = if cols >= 16 {
                0xffff
            } else {
                (1u16 << cols) - 1
            };
            let m1: __mmask16 = if cols <= 16 {
                0
            } else {
                ((1u32 << (cols - 16)) - 1) as u16
            };
            for (r, a) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(out.add(r * ldo), m0, a[0]);
                _mm512_mask_storeu_ps(out.add(r * ldo + 16), m1, a[1]);
            }
        }
    }

    /// Lines (reduction steps, 64 bytes each) ahead of use the tile kernel asks for its
    /// panel's next line: `examples/expert_stream.rs`, 256 cold experts of 8 rows on 2
    /// threads, 19.8 ms without, 10.5 / 9.8 / 10.0 / 10.3 ms at 64 / 96 / 128 / 192 lines.
    const PANEL_PREFETCH_LINES: usize = 96;

    /// Lanes per vector: a 16×16 block of f32 is transposed in sixteen registers.
    const LANES: usize = 16;

    /// Values ahead of the block each row's next cache line is asked for: a panel reads its
    /// 32 rows side by side, more streams than the hardware prefetcher follows.
    const PREFETCH_AHEAD: usize = 64;

    /// Packs one panel: `rows` (≤ PANEL, each `k` values) narrowed to `kind` and written
    /// k-major into `panel` (`k` lines). Each 16 rows × 16 reduction steps block is loaded
    /// row by row, transposed in registers and narrowed one half line per instruction, so no
    /// value passes through memory between the load and the store (the portable kernel moves
    /// each value through a tile and a scalar transpose). A group of fewer than 16 rows (the
    /// tail panel) is padded with zero rows, which narrow to the zero the padding holds; the
    /// last block of a `k` that is not a multiple of 16 is loaded masked. Lines are written
    /// whole with streaming stores: nothing reads the packed weights again before the next
    /// forward, so they bypass the cache, and the CPU need not first read each line it
    /// overwrites (ordinary stores would add that read to the pack's memory traffic).
    ///
    /// # Safety
    /// The CPU must support AVX-512F; every row of `rows` holds at least `k` values,
    /// `rows.len() ≤ PANEL` and `panel` holds at least `k` lines.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pack_panel(kind: HalfKind, rows: &[&[f32]], k: usize, panel: &mut [Line]) {
        match kind {
            HalfKind::F16 => pack_panel_as::<false>(rows, k, panel),
            HalfKind::Bf16 => pack_panel_as::<true>(rows, k, panel),
        }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn pack_panel_as<const BF16: bool>(rows: &[&[f32]], k: usize, panel: &mut [Line]) {
        debug_assert!(rows.len() <= PANEL && panel.len() >= k);
        debug_assert!(rows.iter().all(|r| r.len() >= k));
        let out = panel.as_mut_ptr();
        for c0 in (0..k).step_by(LANES) {
            let width = LANES.min(k - c0);
            // width < 16 in the masked branch, so the shift cannot overflow.
            let mask: __mmask16 = if width == LANES {
                !0
            } else {
                (1u16 << width) - 1
            };
            // The two 16-column halves of each line of the block; a missing group stays zero.
            let mut halves = [[_mm256_setzero_si256(); LANES]; 2];
            for (group, block) in rows.chunks(LANES).enumerate() {
                let mut v = [_mm512_setzero_ps(); LANES];
                for (lane, row) in v.iter_mut().zip(block) {
                    let at = row.as_ptr().add(c0);
                    if c0 + PREFETCH_AHEAD < k {
                        _mm_prefetch::<_MM_HINT_T0>(at.add(PREFETCH_AHEAD).cast::<i8>());
                    }
                    // Masked-off lanes are not read (AVX-512 suppresses their faults).
                    *lane = if width == LANES {
                        _mm512_loadu_ps(at)
                    } else {
                        _mm512_maskz_loadu_ps(mask, at)
                    };
                }
                transpose16(&mut v);
                for (half, column) in halves[group].iter_mut().zip(&v).take(width) {
                    *half = narrow16::<BF16>(*column);
                }
            }
            let [lows, highs] = &halves;
            for (c, (lo, hi)) in lows.iter().zip(highs).take(width).enumerate() {
                let line = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(*lo), *hi);
                // `Line` is 64-byte aligned, as the streaming store requires.
                _mm512_stream_si512(out.add(c0 + c).cast::<__m512i>(), line);
            }
        }
        // Streaming stores are weakly ordered: fence them before the panel is handed back
        // (the rayon join that follows orders ordinary stores only).
        _mm_sfence();
    }

    /// Sixteen f32 lanes rounded to f16 or bf16 (nearest, ties to even), as 16-bit values.
    /// f16: `vcvtps2ph` with the rounding given in the instruction (MXCSR's mode is not
    /// consulted), the conversion `half` itself uses under F16C. bf16: the branch-free bit
    /// rounding of [`crate::dtype::bf16_bits`] lane by lane (`vcvtneps2bf16` would flush
    /// subnormals to zero, which `bf16::from_f32` does not).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn narrow16<const BF16: bool>(v: __m512) -> __m256i {
        if BF16 {
            let b = _mm512_castps_si512(v);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
            let bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb);
            let rounded = _mm512_add_epi32(b, bias);
            let quiet = _mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000));
            let magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFF_FFFF));
            let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7F80_0000));
            let bits = _mm512_mask_blend_epi32(nan, rounded, quiet);
            // After the shift every lane fits 16 bits: the truncating narrow keeps it whole.
            _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(bits))
        } else {
            _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)
        }
    }

    /// Transposes the 16×16 f32 block held one row per register, in place: after it
    /// register `c` holds column `c`. Unpacks interleave pairs of rows, then 64-bit shuffles
    /// and two rounds of 128-bit lane shuffles finish the transpose (64 shuffles in all).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn transpose16(r: &mut [__m512; LANES]) {
        let mut t = [_mm512_setzero_ps(); LANES];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for i in 0..4 {
            let b = 4 * i;
            r[b] = _mm512_shuffle_ps::<0x44>(t[b], t[b + 2]);
            r[b + 1] = _mm512_shuffle_ps::<0xEE>(t[b], t[b + 2]);
            r[b + 2] = _mm512_shuffle_ps::<0x44>(t[b + 1], t[b + 3]);
            r[b + 3] = _mm512_shuffle_ps::<0xEE>(t[b + 1], t[b + 3]);
        }
        for h in 0..2 {
            let b = 8 * h;
            for i in 0..4 {
                t[b + i] = _mm512_shuffle_f32x4::<0x88>(r[b + i], r[b + 4 + i]);
                t[b + 4 + i] = _mm512_shuffle_f32x4::<0xDD>(r[b + i], r[b + 4 + i]);
            }
        }
        for i in 0..8 {
            r[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[8 + i]);
            r[8 + i] = _mm512_shuffle_f32x4::<0xDD>(t[i], t[8 + i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 997) as f32 / 498.0
                    - 1.0
            })
            .collect()
    }

    /// The exact f32 result of weights rounded to `kind` (f64 accumulation).
    fn reference(kind: HalfKind, x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let round = |v: f32| match kind {
            HalfKind::F16 => f16::from_f32(v).to_f64(),
            HalfKind::Bf16 => bf16::from_f32(v).to_f64(),
        };
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|c| x[i * k + c] as f64 * round(w[j * k + c]))
                    .sum();
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    #[test]
    fn every_kernel_matches_the_reference_including_ragged_edges() {
        let kernels = PanelKernel::available();
        for &(m, k, n) in &[
            (1, 64, 32),
            (3, 37, 50),
            (8, 128, 96),
            (11, 16, 17),
            (13, 40, 33),
            (14, 64, 64),
            (64, 40, 33),
            (17, 70, 65),
            // Half panels: a first half short of 16 columns, exactly 16, a second half of one.
            (5, 33, 8),
            (7, 19, 16),
            (6, 24, 49),
            (2, 45, 40),
        ] {
            let x = data(m * k, 1);
            let w = data(n * k, 2);
            for hk in [HalfKind::F16, HalfKind::Bf16] {
                let want = reference(hk, &x, m, k, &w, n);
                let packed = PackedF16::pack_as(hk, &w, n, k);
                // Sentinels past column n must survive: the tail panel writes only its columns.
                let ldo = n + 3;
                let mut first: Option<Vec<f32>> = None;
                for &kernel in &kernels {
                    let mut out = vec![f32::NAN; m * ldo];
                    for p in 0..packed.panels() {
                        packed.panel_times(kernel, p, &x, m, &mut out[p * PANEL..], ldo);
                    }
                    for i in 0..m {
                        for j in 0..n {
                            let (a, b) = (out[i * ldo + j], want[i * n + j]);
                            assert!(
                                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                                "{hk:?} {kernel:?} m={m} k={k} n={n} ({i},{j}): {a} vs {b}"
                            );
                        }
                        assert!(
                            out[i * ldo + n..(i + 1) * ldo].iter().all(|v| v.is_nan()),
                            "{kernel:?} wrote past column {n}"
                        );
                    }
                    // Every kernel adds each output's products in the same order: the same
                    // bits as the portable loop's.
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    match &first {
                        None => first = Some(out),
                        Some(portable) => assert_eq!(
                            bits(&out),
                            bits(portable),
                            "{hk:?} {kernel:?} m={m} k={k} n={n}: other bits than the portable loop"
                        ),
                    }
                }
            }
        }
    }

    #[test]
    fn packing_rounds_each_value_like_half_and_stacked_blocks_like_one_matrix() {
        // Ties, overflow past each format's range, subnormals, signed zeros and NaN.
        let specials = [
            0.0f32,
            -0.0,
            1.0 + f32::EPSILON * 4096.0,
            1.0 + 1.0 / 256.0,
            -(1.0 + 3.0 / 256.0),
            65519.0,
            65520.0,
            3.4e38,
            -f32::MAX,
            f32::INFINITY,
            f32::NAN,
            1e-8,
            -6.0e-8,
            1e-40,
        ];
        let (n, k) = (37, 11);
        let mut w = data(n * k, 9);
        w[..specials.len()].copy_from_slice(&specials);
        for kind in [HalfKind::F16, HalfKind::Bf16] {
            let packed = PackedF16::pack_as(kind, &w, n, k);
            for r in 0..n {
                for c in 0..k {
                    let v = w[r * k + c];
                    let want = match kind {
                        HalfKind::F16 => f16::from_f32(v).to_bits(),
                        HalfKind::Bf16 => bf16::from_f32(v).to_bits(),
                    };
                    let got = packed.panel(r / PANEL)[c].0[r % PANEL];
                    assert_eq!(got, want, "{kind:?} ({r},{c}) {v}");
                }
            }
            // Three blocks of 5, 20 and 12 rows pack as the matrix they stack into, and a
            // repack over other values leaves what packing those values builds.
            let blocks = [&w[..5 * k], &w[5 * k..25 * k], &w[25 * k..]];
            let stacked = PackedF16::pack_rows(kind, &StackedRows::new(&blocks, k), n);
            assert_eq!(stacked.data, packed.data, "{kind:?}");
            let other = data(n * k, 10);
            let mut reused = packed.clone();
            reused.repack(&StackedRows::new(&[&other], k));
            assert_eq!(reused.data, PackedF16::pack_as(kind, &other, n, k).data);
        }
    }

    /// f16 bits of `v` rounded to nearest, ties to even, written from the IEEE definition
    /// (independent of `half` and of the CPU's conversion): NaN keeps its sign and the top
    /// of its payload and turns quiet, overflow goes to infinity.
    fn f16_reference(v: f32) -> u16 {
        let b = v.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let exp = ((b >> 23) & 0xFF) as i32;
        let man = b & 0x7F_FFFF;
        if exp == 0xFF {
            return sign
                | 0x7C00
                | if man == 0 {
                    0
                } else {
                    0x0200 | (man >> 13) as u16
                };
        }
        // The value is m · 2^(e) with m an integer of 24 bits (the implicit bit included).
        let (m, e) = if exp == 0 {
            (man, -149)
        } else {
            (man | 0x80_0000, exp - 150)
        };
        // f16 values are q · 2^(-24) for integer q (subnormals and normals alike) up to the
        // exponent where the 11-bit significand needs a coarser step: round at the step of
        // the binade the value lies in.
        let binade = if m == 0 {
            -24
        } else {
            (31 - m.leading_zeros() as i32) + e
        };
        let step = (binade - 10).max(-24);
        let shift = step - e;
        let q = if shift <= 0 {
            u64::from(m) << (-shift)
        } else if shift >= 40 {
            0
        } else {
            let (whole, rest) = (u64::from(m) >> shift, u64::from(m) & ((1u64 << shift) - 1));
            let halfway = 1u64 << (shift - 1);
            whole + u64::from(rest > halfway || (rest == halfway && whole & 1 == 1))
        };
        // q · 2^step as f16 bits: the significand in q (possibly carried to 2^11), the
        // exponent from step.
        let (mut q, mut step) = (q, step);
        if q >= 1 << 11 {
            q >>= 1;
            step += 1;
        }
        let bits = if q < 1 << 10 {
            // Subnormal (step is -24 there) or zero.
            q as u32
        } else {
            let biased = step + 10 + 15;
            if biased >= 31 {
                return sign | 0x7C00;
            }
            ((biased as u32) << 10) | (q as u32 & 0x3FF)
        };
        sign | bits as u16
    }

    /// Values that probe the rounding: signed zeros, f16 and bf16 subnormals and the
    /// smallest normals, ties (to even, both ways) in each format, the edge of f16's range
    /// (65504 stays, 65519.99 rounds down, 65520 overflows to infinity), f32's extremes,
    /// infinities and NaNs (quiet, signalling, negative, with payload).
    fn edge_values() -> Vec<f32> {
        let mut v = vec![
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::from_bits(0x8000_0001),
            f32::from_bits(0x007F_FFFF),
            65504.0,
            -65504.0,
            65519.99,
            65520.0,
            -65520.0,
            65536.0,
            3.4e38,
            f32::MAX,
            -f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(0xFF80_0001),
            f32::from_bits(0x7FC0_1234),
            f32::from_bits(0x7FBF_FFFF),
            f32::from_bits(0x7F80_2000),
        ];
        // f16: the smallest subnormal 2^-24 and the ties around it and 2^-14 (smallest
        // normal); ties between neighbours at 1 and 2048 (ulp 2^-10 and 2), odd and even.
        for (x, ulp) in [
            (2f32.powi(-24), 2f32.powi(-24)),
            (2f32.powi(-14), 2f32.powi(-24)),
        ] {
            v.extend([
                x,
                x - ulp / 2.0,
                x + ulp / 2.0,
                x * 1.5,
                x / 2.0,
                x / 4.0,
                x * 0.75,
            ]);
        }
        for (x, ulp) in [
            (1.0f32, 2f32.powi(-10)),
            (2048.0, 2.0),
            (0.5, 2f32.powi(-11)),
        ] {
            for j in 0..4 {
                let t = x + ulp * (j as f32 + 0.5);
                v.extend([t, -t, t.next_up(), t.next_down()]);
            }
        }
        // bf16: ties at 1 (ulp 2^-7), subnormal ties, the largest finite value's tie.
        for j in 0..4 {
            let t = 1.0 + 2f32.powi(-7) * (j as f32 + 0.5);
            v.extend([t, -t, t.next_up(), t.next_down()]);
        }
        v.extend([
            f32::from_bits(0x0000_8000),
            f32::from_bits(0x0001_8000),
            f32::from_bits(0x7F7F_8000),
            f32::from_bits(0x7F7F_7FFF),
        ]);
        v
    }

    /// `len` f32 bit patterns from a fixed LCG: every class (NaN, inf, subnormal, normal).
    fn random_bits(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let b = (s >> 32) as u32;
                // Half of them with the exponent pulled into f16's range and its edges.
                if b & 1 == 0 {
                    f32::from_bits(b)
                } else {
                    let exp = 100 + (b >> 1) % 50;
                    f32::from_bits((b & 0x807F_FFFF) | (exp << 23))
                }
            })
            .collect()
    }

    #[test]
    fn the_reference_conversion_agrees_with_half() {
        for v in edge_values().into_iter().chain(random_bits(200_000, 3)) {
            assert_eq!(
                f16_reference(v),
                f16::from_f32(v).to_bits(),
                "{v:e} ({:#010x})",
                v.to_bits()
            );
        }
    }

    #[test]
    fn every_pack_kernel_writes_the_bits_half_rounds_to() {
        let kernels = PanelKernel::available();
        let edges = edge_values();
        // Ragged shapes: tail panels of 1–31 columns, a second row group of 1–15, k not a
        // multiple of 16 (masked loads) and below 16.
        for (case, &(n, k)) in [
            (37, 11),
            (64, 16),
            (33, 35),
            (5, 3),
            (96, 48),
            (17, 70),
            (50, 100),
        ]
        .iter()
        .enumerate()
        {
            let mut w = random_bits(n * k, case as u64);
            let edge_at = (case * 7) % (n * k);
            for (i, e) in edges.iter().enumerate() {
                w[(edge_at + i) % (n * k)] = *e;
            }
            for kind in [HalfKind::F16, HalfKind::Bf16] {
                let mut packs: Vec<PackedF16> = kernels
                    .iter()
                    .map(|&kernel| {
                        let mut p = PackedF16::zeros(kind, n, k);
                        p.repack_with(kernel, &StackedRows::new(&[&w], k));
                        p
                    })
                    .collect();
                for r in 0..n {
                    for c in 0..k {
                        let v = w[r * k + c];
                        let want = match kind {
                            HalfKind::F16 => f16::from_f32(v).to_bits(),
                            HalfKind::Bf16 => bf16::from_f32(v).to_bits(),
                        };
                        for (kernel, p) in kernels.iter().zip(&packs) {
                            let got = p.panel(r / PANEL)[c].0[r % PANEL];
                            assert_eq!(
                                got, want,
                                "{kind:?} {kernel:?} n={n} k={k} ({r},{c}) {v:e}"
                            );
                        }
                    }
                }
                // Padding included: the kernels' buffers are equal as a whole.
                for (kernel, p) in kernels.iter().zip(&packs).skip(1) {
                    assert_eq!(packs[0].data, p.data, "{kind:?} {kernel:?} n={n} k={k}");
                }
                // A repack over stacked blocks (rows of one panel from two blocks) by each
                // kernel leaves what packing the stacked matrix does.
                let split = (n / 3) * k;
                let blocks = [&w[split..], &w[..split]];
                let mut swapped = w[split..].to_vec();
                swapped.extend_from_slice(&w[..split]);
                for (kernel, p) in kernels.iter().zip(packs.iter_mut()) {
                    p.repack_with(*kernel, &StackedRows::new(&blocks, k));
                    assert_eq!(
                        p.data,
                        PackedF16::pack_as(kind, &swapped, n, k).data,
                        "{kernel:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn row_tiles_cover_every_row_once_in_even_tiles() {
        for (m, height) in (0..40).flat_map(|m| [(m, TILE_ROWS), (m, 6)]) {
            let tiles: Vec<_> = row_tiles(m, height).collect();
            let mut next = 0;
            for &(first, rows) in &tiles {
                assert_eq!(first, next);
                assert!((1..=height).contains(&rows));
                next += rows;
            }
            assert_eq!(next, m);
            let heights = tiles.iter().map(|t| t.1);
            if let (Some(hi), Some(lo)) = (heights.clone().max(), heights.min()) {
                assert!(hi - lo <= 1, "m={m}: {tiles:?}");
            }
        }
    }

    #[test]
    fn widened_panels_are_the_transposed_weights() {
        let (n, k) = (70, 5);
        let w = data(n * k, 4);
        for kind in [HalfKind::F16, HalfKind::Bf16] {
            let packed = PackedF16::pack_as(kind, &w, n, k);
            let mut wide = Vec::new();
            let cols = packed.widen_panels(1, 3, &mut wide);
            assert_eq!(cols, 38);
            for c in 0..k {
                for j in 0..cols {
                    let v = w[(32 + j) * k + c];
                    let want = match kind {
                        HalfKind::F16 => f16::from_f32(v).to_f32(),
                        HalfKind::Bf16 => bf16::from_f32(v).to_f32(),
                    };
                    assert_eq!(wide[c * cols + j], want);
                }
            }
        }
    }
}
