//! f16 weights packed in column panels for the decode matmul `y = x · Wᵀ`.
//!
//! A panel holds `PANEL` consecutive output columns (weight rows) stored k-major, so step `c`
//! of the reduction reads one contiguous line of `PANEL` f16 values. The kernel keeps an
//! `[rows × PANEL]` block of outputs in registers, widens each line to f32 in registers and
//! does one broadcast-FMA per input row: no horizontal sums, no f32 copy of the weights, and
//! the output lands row-major. With AVX-512 this runs on `vcvtph2ps` + `vfmadd231ps`; other
//! CPUs widen a panel to an f32 scratch and use portable loops.

use half::f16;
use half::slice::HalfFloatSliceExt;

/// Output columns per panel (two 16-lane f32 vectors).
pub const PANEL: usize = 32;
/// Input rows per register tile.
const TILE_ROWS: usize = 8;

/// Which code computes the panels, chosen from the CPU's features. Safe code can obtain one
/// only from [`PanelKernel::detect`] or [`PanelKernel::portable`], so the AVX-512 kernel runs
/// only where detection found AVX-512F.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PanelKernel(KernelChoice);

/// The private choice behind a [`PanelKernel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KernelChoice {
    /// AVX-512F intrinsics (x86-64 CPUs that have them).
    Avx512,
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
        PanelKernel::portable()
    }

    /// The portable kernel (runs on every CPU).
    pub fn portable() -> Self {
        PanelKernel(KernelChoice::Portable)
    }
}

/// Weight `[n, k]` (row-major, as HF stores it) repacked into `ceil(n / PANEL)` panels of
/// `[k][PANEL]` f16 values; the last panel's missing columns are zero.
#[derive(Debug, Clone)]
pub struct PackedF16 {
    data: Vec<f16>,
    n: usize,
    k: usize,
}

impl PackedF16 {
    /// Packs row-major f32 weights `w [n, k]`, rounding to f16.
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        debug_assert_eq!(w.len(), n * k);
        let panels = n.div_ceil(PANEL);
        let mut data = vec![f16::ZERO; panels * k * PANEL];
        for (p, panel) in data.chunks_exact_mut(k * PANEL).enumerate() {
            let cols = PANEL.min(n - p * PANEL);
            for j in 0..cols {
                let row = &w[(p * PANEL + j) * k..(p * PANEL + j + 1) * k];
                for (c, v) in row.iter().enumerate() {
                    panel[c * PANEL + j] = f16::from_f32(*v);
                }
            }
        }
        PackedF16 { data, n, k }
    }

    /// Number of panels.
    pub fn panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.data.len() * 2
    }

    /// Panel `p` as `[k][PANEL]` f16 values.
    fn panel(&self, p: usize) -> &[f16] {
        &self.data[p * self.k * PANEL..(p + 1) * self.k * PANEL]
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
            for (c, src) in self.panel(p).chunks_exact(PANEL).enumerate() {
                src.convert_to_f32_slice(&mut line);
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
        let k = self.k;
        assert!(x.len() >= m * k);
        assert!(m == 0 || out.len() >= (m - 1) * ldo + self.panel_cols(p));
        let panel = self.panel(p);
        let cols = self.panel_cols(p);
        match kernel.0 {
            #[cfg(target_arch = "x86_64")]
            KernelChoice::Avx512 => {
                for (r0, rows) in row_tiles(m) {
                    let xs = &x[r0 * k..(r0 + rows) * k];
                    let os = &mut out[r0 * ldo..];
                    // SAFETY: only `detect` builds an Avx512 kernel (the field is private), and
                    // only where the CPU has AVX-512F; the slices cover `rows` input rows of k
                    // values, a k×PANEL panel, and `rows` output rows of stride ldo with `cols`
                    // valid columns (checked above).
                    unsafe { avx512::tile(xs, rows, k, panel, os, ldo, cols) };
                }
            }
            _ => portable_panel(panel, x, m, k, out, ldo, cols),
        }
    }
}

/// `m` rows split into `ceil(m / TILE_ROWS)` tiles of nearly equal height: `(first, rows)`.
fn row_tiles(m: usize) -> impl Iterator<Item = (usize, usize)> {
    let tiles = m.div_ceil(TILE_ROWS);
    let (base, extra) = (m / tiles.max(1), m % tiles.max(1));
    (0..tiles).scan(0, move |r0, t| {
        let rows = base + usize::from(t < extra);
        let first = *r0;
        *r0 += rows;
        Some((first, rows))
    })
}

/// Portable panel kernel: widen once, then row-times-panel with plain loops.
fn portable_panel(
    panel: &[f16],
    x: &[f32],
    m: usize,
    k: usize,
    out: &mut [f32],
    ldo: usize,
    cols: usize,
) {
    let mut wide = vec![0f32; k * PANEL];
    panel.convert_to_f32_slice(&mut wide);
    for r in 0..m {
        let mut acc = [0f32; PANEL];
        for (c, line) in wide.chunks_exact(PANEL).enumerate() {
            let xv = x[r * k + c];
            for (a, w) in acc.iter_mut().zip(line) {
                *a = xv.mul_add(*w, *a);
            }
        }
        out[r * ldo..r * ldo + cols].copy_from_slice(&acc[..cols]);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{PANEL, TILE_ROWS};
    use half::f16;
    use std::arch::x86_64::*;

    /// One register tile: `rows` (≤ TILE_ROWS) input rows times one panel.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `x` holds `rows·k` values, `panel` `k·PANEL`, and `out`
    /// at least `(rows-1)·ldo + cols` values.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile(
        x: &[f32],
        rows: usize,
        k: usize,
        panel: &[f16],
        out: &mut [f32],
        ldo: usize,
        cols: usize,
    ) {
        match rows {
            8 => tile_n::<8>(x, k, panel, out, ldo, cols),
            7 => tile_n::<7>(x, k, panel, out, ldo, cols),
            6 => tile_n::<6>(x, k, panel, out, ldo, cols),
            5 => tile_n::<5>(x, k, panel, out, ldo, cols),
            4 => tile_n::<4>(x, k, panel, out, ldo, cols),
            3 => tile_n::<3>(x, k, panel, out, ldo, cols),
            2 => tile_n::<2>(x, k, panel, out, ldo, cols),
            _ => tile_n::<1>(x, k, panel, out, ldo, cols),
        }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tile_n<const R: usize>(
        x: &[f32],
        k: usize,
        panel: &[f16],
        out: &mut [f32],
        ldo: usize,
        cols: usize,
    ) {
        const { assert!(R <= TILE_ROWS && PANEL == 32) };
        debug_assert!(x.len() >= R * k && panel.len() >= k * PANEL);
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let wp = panel.as_ptr() as *const __m256i;
        let xp = x.as_ptr();
        for c in 0..k {
            let w0 = _mm512_cvtph_ps(_mm256_loadu_si256(wp.add(2 * c)));
            let w1 = _mm512_cvtph_ps(_mm256_loadu_si256(wp.add(2 * c + 1)));
            for (r, a) in acc.iter_mut().enumerate() {
                let xb = _mm512_set1_ps(*xp.add(r * k + c));
                a[0] = _mm512_fmadd_ps(xb, w0, a[0]);
                a[1] = _mm512_fmadd_ps(xb, w1, a[1]);
            }
        }
        let op = out.as_mut_ptr();
        if cols == PANEL {
            for (r, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(op.add(r * ldo), a[0]);
                _mm512_storeu_ps(op.add(r * ldo + 16), a[1]);
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
                _mm512_mask_storeu_ps(op.add(r * ldo), m0, a[0]);
                _mm512_mask_storeu_ps(op.add(r * ldo + 16), m1, a[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 997) as f32 / 498.0
                    - 1.0
            })
            .collect()
    }

    /// The exact f32 result of f16-rounded weights (f64 accumulation).
    fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|c| x[i * k + c] as f64 * f16::from_f32(w[j * k + c]).to_f64())
                    .sum();
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    #[test]
    fn every_kernel_matches_the_reference_including_ragged_edges() {
        let kernels = [PanelKernel::portable(), PanelKernel::detect()];
        for &(m, k, n) in &[
            (1, 64, 32),
            (3, 37, 50),
            (8, 128, 96),
            (11, 16, 17),
            (64, 40, 33),
            (17, 70, 65),
        ] {
            let x = data(m * k, 1);
            let w = data(n * k, 2);
            let want = reference(&x, m, k, &w, n);
            let packed = PackedF16::pack(&w, n, k);
            for kernel in kernels {
                // Sentinels past column n must survive: the tail panel writes only its columns.
                let ldo = n + 3;
                let mut out = vec![f32::NAN; m * ldo];
                for p in 0..packed.panels() {
                    packed.panel_times(kernel, p, &x, m, &mut out[p * PANEL..], ldo);
                }
                for i in 0..m {
                    for j in 0..n {
                        let (a, b) = (out[i * ldo + j], want[i * n + j]);
                        assert!(
                            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                            "{kernel:?} m={m} k={k} n={n} ({i},{j}): {a} vs {b}"
                        );
                    }
                    assert!(
                        out[i * ldo + n..(i + 1) * ldo].iter().all(|v| v.is_nan()),
                        "{kernel:?} wrote past column {n}"
                    );
                }
            }
        }
    }

    #[test]
    fn row_tiles_cover_every_row_once_in_even_tiles() {
        for m in 0..40 {
            let tiles: Vec<_> = row_tiles(m).collect();
            let mut next = 0;
            for &(first, rows) in &tiles {
                assert_eq!(first, next);
                assert!((1..=TILE_ROWS).contains(&rows));
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
        let packed = PackedF16::pack(&w, n, k);
        let mut wide = Vec::new();
        let cols = packed.widen_panels(1, 3, &mut wide);
        assert_eq!(cols, 38);
        for c in 0..k {
            for j in 0..cols {
                assert_eq!(
                    wide[c * cols + j],
                    f16::from_f32(w[(32 + j) * k + c]).to_f32()
                );
            }
        }
    }
}
