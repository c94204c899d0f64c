//! Dense linear layers `y = x · Wᵀ (+ b)` with weights kept in the engine's dtype.
//!
//! f32 weights are stored row-major `[out, in]` exactly as HF writes them: small batches go
//! through a kernel that streams each weight row once and dots it with every input row,
//! larger batches use the `gemm` crate. f16 weights are packed in column panels
//! (`PackedF16`): up to `PANEL_M` input rows run the register-tiled panel kernel, more rows
//! widen groups of panels to f32 and use `gemm`. In f16 mode the matmul inputs and outputs
//! are rounded to f16 and accumulation is f32, which is what an f16 GPU kernel does. bf16
//! weights use the same panels (widened by a shift); inputs and outputs are rounded to bf16,
//! the bias added in f32 before the output rounding (a bf16 GEMM's epilogue).

use r3_model::layers::gemm::SharedBuf;
use rayon::prelude::*;

use super::packed_f16::{HalfKind, PackedF16, PanelKernel, StackedRows, PANEL};
use crate::dtype::Dtype;
use crate::error::RolloutError;
use r3_model::round16::{round_to_bf16, round_to_f16};

/// Number of input rows up to which the row-streaming kernel beats `gemm` (f32 weights).
const SMALL_M: usize = 32;
/// Number of input rows up to which the f16 panel kernel runs instead of widening + `gemm`.
/// Since the panel kernel writes its output in place it is the faster one for a decode step's
/// rows (`r3 bench rollout --configs mid --batches 256`, three rounds alternated: 2,540–2,590
/// → 2,621–2,755 tokens/s with the `[256, 32000]` logits and the projections moved over) and
/// as fast on a prefill's thousands (tried up to 8,192); beyond this many its panel-by-panel
/// pass, which reads every input row once per panel, leaves cache blocking to `gemm`.
const PANEL_M: usize = 512;
/// Panels per parallel task of the f16 panel kernel.
const PANELS_PER_TASK: usize = 2;
/// Output columns per parallel task of the small-batch kernel.
const ROWS_PER_TASK: usize = 64;
/// Work (m·n·k) below which a matmul runs on the calling thread only.
const PARALLEL_WORK: usize = 1 << 20;

/// Weight storage of a linear layer.
#[derive(Debug, Clone)]
enum WeightData {
    F32(Vec<f32>),
    F16(PackedF16, PanelKernel),
}

/// A linear layer `[out_features, in_features]` with optional bias (bias always f32).
#[derive(Debug, Clone)]
pub struct Linear {
    weight: WeightData,
    bias: Option<Vec<f32>>,
    out_features: usize,
    in_features: usize,
}

impl Linear {
    /// Builds a layer from row-major f32 weights `[out, in]`, converting to `dtype`.
    pub fn new(
        name: &str,
        weight: Vec<f32>,
        out_features: usize,
        in_features: usize,
        bias: Option<Vec<f32>>,
        dtype: Dtype,
    ) -> Result<Self, RolloutError> {
        if weight.len() != out_features * in_features {
            return Err(RolloutError::Weights(format!(
                "{name}: expected {out_features}x{in_features} values, got {}",
                weight.len()
            )));
        }
        check_bias(name, bias.as_deref(), out_features)?;
        let weight = match dtype {
            Dtype::F32 => WeightData::F32(weight),
            Dtype::F16 => WeightData::F16(
                PackedF16::pack(&weight, out_features, in_features),
                PanelKernel::detect(),
            ),
            Dtype::Bf16 => WeightData::F16(
                PackedF16::pack_as(HalfKind::Bf16, &weight, out_features, in_features),
                PanelKernel::detect(),
            ),
        };
        Ok(Linear {
            weight,
            bias,
            out_features,
            in_features,
        })
    }

    /// Builds a layer from row blocks stacked in order (borrowed, e.g. a tensor's storage),
    /// converting to `dtype`: the f16/bf16 panels are packed from the blocks directly.
    pub fn from_rows(
        name: &str,
        rows: &StackedRows<'_>,
        bias: Option<Vec<f32>>,
        dtype: Dtype,
    ) -> Result<Self, RolloutError> {
        let (out_features, in_features) = (rows.len(), rows.width());
        check_whole_rows(name, rows)?;
        match dtype {
            Dtype::F32 => Self::new(
                name,
                rows.parts().concat(),
                out_features,
                in_features,
                bias,
                dtype,
            ),
            Dtype::F16 | Dtype::Bf16 => {
                check_bias(name, bias.as_deref(), out_features)?;
                let kind = match dtype {
                    Dtype::Bf16 => HalfKind::Bf16,
                    _ => HalfKind::F16,
                };
                Ok(Linear {
                    weight: WeightData::F16(
                        PackedF16::pack_rows(kind, rows, out_features),
                        PanelKernel::detect(),
                    ),
                    bias,
                    out_features,
                    in_features,
                })
            }
        }
    }

    /// Overwrites the weight with `rows` and the bias with `bias` in place, in this layer's
    /// dtype (the values [`Linear::from_rows`] would hold, without allocating): a weight
    /// sync's path. The shape and whether there is a bias must be this layer's; else an
    /// error naming `name`, and nothing is written.
    pub fn refill(
        &mut self,
        name: &str,
        rows: &StackedRows<'_>,
        bias: Option<&[f32]>,
    ) -> Result<(), RolloutError> {
        let (n, k) = (self.out_features, self.in_features);
        if (rows.len(), rows.width()) != (n, k) || bias.is_some() != self.bias.is_some() {
            return Err(RolloutError::Weights(format!(
                "{name}: a {}x{} update{} for a {n}x{k} layer{}",
                rows.len(),
                rows.width(),
                if bias.is_some() { " with bias" } else { "" },
                if self.bias.is_some() {
                    " with bias"
                } else {
                    ""
                },
            )));
        }
        check_whole_rows(name, rows)?;
        check_bias(name, bias, n)?;
        let dtype = self.dtype();
        match &mut self.weight {
            WeightData::F32(w) => {
                let mut at = 0;
                for part in rows.parts() {
                    copy_parallel(&mut w[at..at + part.len()], part);
                    at += part.len();
                }
            }
            WeightData::F16(w, _) => w.repack(rows),
        }
        if let (Some(dst), Some(src)) = (self.bias.as_mut(), bias) {
            dst.copy_from_slice(src);
            dtype.round_activations(dst);
        }
        Ok(())
    }

    /// Output width.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Input width.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// The dtype the weight is stored in.
    pub fn dtype(&self) -> Dtype {
        match &self.weight {
            WeightData::F32(_) => Dtype::F32,
            WeightData::F16(w, _) => match w.kind() {
                HalfKind::F16 => Dtype::F16,
                HalfKind::Bf16 => Dtype::Bf16,
            },
        }
    }

    /// Bytes held by the weight and bias.
    pub fn size_bytes(&self) -> usize {
        let w = match &self.weight {
            WeightData::F32(w) => w.len() * 4,
            WeightData::F16(w, _) => w.size_bytes(),
        };
        w + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }

    /// `out[m, out_features] = x[m, in_features] · Wᵀ + b`. `parallel` lets the call use the
    /// rayon pool (callers already inside a parallel loop pass false).
    pub fn forward(&self, x: &[f32], m: usize, out: &mut [f32], parallel: bool) {
        let (n, k) = (self.out_features, self.in_features);
        debug_assert_eq!(x.len(), m * k);
        debug_assert_eq!(out.len(), m * n);
        if m == 0 {
            return;
        }
        let parallel = parallel && m * n * k >= PARALLEL_WORK;
        match &self.weight {
            WeightData::F32(w) => {
                if m <= SMALL_M {
                    small_m_f32(x, m, k, w, n, out, parallel);
                } else {
                    gemm_f32(x, m, k, w, n, out, parallel);
                }
            }
            WeightData::F16(w, kernel) => {
                let bf16 = w.kind() == HalfKind::Bf16;
                let round: fn(&mut [f32]) = if bf16 { round_to_bf16 } else { round_to_f16 };
                // Matmul inputs are half values: round once, up front.
                let xr = rounded_copy(x, k, round, parallel);
                if m <= PANEL_M {
                    panels_f16(&xr, m, w, *kernel, n, out, parallel);
                } else {
                    blocked_f16(&xr, m, k, w, n, out, parallel);
                }
                if bf16 {
                    // The bias belongs to the epilogue, before the output is stored in bf16.
                    self.add_bias(out);
                    round_rows(out, n, round, parallel);
                    return;
                }
                round_rows(out, n, round, parallel);
            }
        }
        self.add_bias(out);
    }

    fn add_bias(&self, out: &mut [f32]) {
        if let Some(b) = &self.bias {
            for row in out.chunks_exact_mut(self.out_features) {
                for (o, bv) in row.iter_mut().zip(b) {
                    *o += bv;
                }
            }
        }
    }
}

/// Errors unless `bias`, when given, holds `out_features` values.
fn check_bias(name: &str, bias: Option<&[f32]>, out_features: usize) -> Result<(), RolloutError> {
    match bias {
        Some(b) if b.len() != out_features => Err(RolloutError::Weights(format!(
            "{name} bias: expected {out_features} values, got {}",
            b.len()
        ))),
        _ => Ok(()),
    }
}

/// Errors unless every block of `rows` is a whole number of rows.
fn check_whole_rows(name: &str, rows: &StackedRows<'_>) -> Result<(), RolloutError> {
    let values: usize = rows.parts().iter().map(|p| p.len()).sum();
    if values != rows.len() * rows.width() {
        return Err(RolloutError::Weights(format!(
            "{name}: {values} values are not whole rows of {}",
            rows.width()
        )));
    }
    Ok(())
}

/// `dst.copy_from_slice(src)` in chunks on the rayon pool (weights run to tens of MB).
pub(crate) fn copy_parallel(dst: &mut [f32], src: &[f32]) {
    const CHUNK: usize = 1 << 16;
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// Rounds every value to the nearest f16 (the output precision of an f16 matmul).
/// Elements per parallel task of the roundings around a half-precision matmul (they ran on
/// the calling thread while the others waited: ≈ 3% of a decode step's samples at batch
/// 64 on mid, most of them the `[rows, vocab]` logits).
const ROUND_ELEMS_PER_TASK: usize = 1 << 14;

/// Elements per parallel rounding task: whole rows of `width`, about
/// [`ROUND_ELEMS_PER_TASK`] of them.
fn round_chunk(width: usize) -> usize {
    let width = width.max(1);
    (ROUND_ELEMS_PER_TASK / width).max(1) * width
}

/// `round` applied to `v`, rows of `width` side by side when `parallel`.
fn round_rows(v: &mut [f32], width: usize, round: fn(&mut [f32]), parallel: bool) {
    if !parallel || v.len() <= ROUND_ELEMS_PER_TASK {
        return round(v);
    }
    v.par_chunks_mut(round_chunk(width)).for_each(round);
}

/// `x` copied and rounded by `round` in one pass, rows of `width` side by side when
/// `parallel`.
fn rounded_copy(x: &[f32], width: usize, round: fn(&mut [f32]), parallel: bool) -> Vec<f32> {
    if !parallel || x.len() <= ROUND_ELEMS_PER_TASK {
        let mut xr = x.to_vec();
        round(&mut xr);
        return xr;
    }
    let mut xr = vec![0f32; x.len()];
    let chunk = round_chunk(width);
    xr.par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk))
        .for_each(|(d, s)| {
            d.copy_from_slice(s);
            round(d);
        });
    xr
}

/// Dot product with eight independent FMA lanes (vectorises to one ymm FMA per step).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let ca = a.chunks_exact(16);
    let cb = b.chunks_exact(16);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (xa, xb) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] = xa[i].mul_add(xb[i], acc[i]);
        }
    }
    let mut s = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        s = x.mul_add(*y, s);
    }
    let mut t = [0f32; 8];
    for i in 0..8 {
        t[i] = acc[i] + acc[i + 8];
    }
    s + ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]))
}

/// Dot products of one input row with four consecutive weight rows (`w` = 4·k values):
/// every x load feeds four FMAs, and the 8 accumulator vectors hide the FMA latency.
#[inline]
fn dot4(x: &[f32], w: &[f32], k: usize) -> [f32; 4] {
    let (w0, r) = w.split_at(k);
    let (w1, r) = r.split_at(k);
    let (w2, w3) = r.split_at(k);
    let mut acc = [[0f32; 16]; 4];
    let full = k / 16 * 16;
    for c in (0..full).step_by(16) {
        let xs = &x[c..c + 16];
        let (a, b, d, e) = (
            &w0[c..c + 16],
            &w1[c..c + 16],
            &w2[c..c + 16],
            &w3[c..c + 16],
        );
        for i in 0..16 {
            acc[0][i] = xs[i].mul_add(a[i], acc[0][i]);
            acc[1][i] = xs[i].mul_add(b[i], acc[1][i]);
            acc[2][i] = xs[i].mul_add(d[i], acc[2][i]);
            acc[3][i] = xs[i].mul_add(e[i], acc[3][i]);
        }
    }
    let mut out = [0f32; 4];
    for (r, (o, a)) in out.iter_mut().zip(&acc).enumerate() {
        let wr = &w[r * k..(r + 1) * k];
        let mut s = 0f32;
        for c in full..k {
            s = x[c].mul_add(wr[c], s);
        }
        let mut t = [0f32; 8];
        for i in 0..8 {
            t[i] = a[i] + a[i + 8];
        }
        *o = s + ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
    }
    out
}

/// Output columns `cols` (`[rows, m]`, column-major) for weight rows `w_rows` (f32,
/// `rows·k`): four rows at a time through `dot4`, the rest through `dot`.
fn rows_times_inputs(x: &[f32], m: usize, k: usize, w_rows: &[f32], cols: &mut [f32]) {
    let rows = cols.len() / m;
    let quads = rows / 4;
    for q in 0..quads {
        let w4 = &w_rows[q * 4 * k..(q + 1) * 4 * k];
        for i in 0..m {
            let d = dot4(&x[i * k..(i + 1) * k], w4, k);
            for (r, v) in d.iter().enumerate() {
                cols[(q * 4 + r) * m + i] = *v;
            }
        }
    }
    for j in quads * 4..rows {
        let wr = &w_rows[j * k..(j + 1) * k];
        for i in 0..m {
            cols[j * m + i] = dot(&x[i * k..(i + 1) * k], wr);
        }
    }
}

/// Small-batch kernel, f32 weights: each task handles a run of output columns.
fn small_m_f32(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, out: &mut [f32], par: bool) {
    let task = |(t, cols): (usize, &mut [f32])| {
        let n0 = t * ROWS_PER_TASK;
        let rows = cols.len() / m;
        rows_times_inputs(x, m, k, &w[n0 * k..(n0 + rows) * k], cols);
    };
    column_tasks(m, n, out, par, task);
}

/// f16 panel kernel over all output columns: tasks of `PANELS_PER_TASK` panels, each writing
/// its columns of every row of `out` in place (a scratch per task, zero-filled and copied
/// into place after a serial wait, cost the 256-row decode projections a fifth of their
/// time).
fn panels_f16(
    x: &[f32],
    m: usize,
    w: &PackedF16,
    kernel: PanelKernel,
    n: usize,
    out: &mut [f32],
    par: bool,
) {
    assert!(
        out.len() >= m * n && w.rows() == n,
        "panels_f16: output shorter than [m, n]"
    );
    let dst = SharedBuf(out.as_mut_ptr());
    let task = |t: usize| {
        let (p0, p1) = (
            t * PANELS_PER_TASK,
            ((t + 1) * PANELS_PER_TASK).min(w.panels()),
        );
        for p in p0..p1 {
            // SAFETY: `out` holds m rows of n (asserted above) and panel p's columns start at
            // p·PANEL < n; each panel belongs to one task, so no two tasks write the same
            // element, and `out` stays borrowed mutably until every task is done.
            unsafe { w.panel_times_into(kernel, p, x, m, dst.at(p * PANEL), n) };
        }
    };
    let tasks = w.panels().div_ceil(PANELS_PER_TASK);
    if par {
        (0..tasks).into_par_iter().for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
}

/// Runs `task` over blocks of `ROWS_PER_TASK` output columns (stored column-major in a
/// scratch buffer, `[n, m]`), then transposes into the row-major `out[m, n]`.
fn column_tasks<F>(m: usize, n: usize, out: &mut [f32], par: bool, task: F)
where
    F: Fn((usize, &mut [f32])) + Sync + Send,
{
    if m == 1 {
        if par {
            out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(task);
        } else {
            out.chunks_mut(ROWS_PER_TASK).enumerate().for_each(task);
        }
        return;
    }
    let mut scratch = vec![0f32; m * n];
    if par {
        scratch
            .par_chunks_mut(ROWS_PER_TASK * m)
            .enumerate()
            .for_each(task);
    } else {
        scratch
            .chunks_mut(ROWS_PER_TASK * m)
            .enumerate()
            .for_each(task);
    }
    for j in 0..n {
        for i in 0..m {
            out[i * n + j] = scratch[j * m + i];
        }
    }
}

fn parallelism(par: bool) -> gemm::Parallelism {
    if par {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    }
}

/// `out = x · wᵀ` with the gemm crate, f32, `w` row-major `[n, k]`.
fn gemm_f32(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, out: &mut [f32], par: bool) {
    gemm_rhs(x, m, k, w, n, (k as isize, 1), out, par);
}

/// `out[m, n] = x[m, k] · rhs` where `rhs` is the `[k, n]` matrix with (column, row) strides
/// `rhs_strides`.
#[allow(clippy::too_many_arguments)]
fn gemm_rhs(
    x: &[f32],
    m: usize,
    k: usize,
    rhs: &[f32],
    n: usize,
    rhs_strides: (isize, isize),
    out: &mut [f32],
    par: bool,
) {
    assert!(x.len() >= m * k && rhs.len() >= n * k && out.len() >= m * n);
    // SAFETY: the slices hold at least the elements the strides address (asserted above): x
    // is [m, k] row-major, rhs a [k, n] matrix either way round, out is [m, n] row-major and
    // borrowed mutably here.
    unsafe { gemm_into(x, m, k, rhs, n, rhs_strides, out.as_mut_ptr(), n, par) }
}

/// `dst[m, n] = x[m, k] · rhs` with `rhs` the `[k, n]` matrix with (column, row) strides
/// `rhs_strides` and `dst`'s rows `ld` apart.
///
/// # Safety
/// `x` and `rhs` hold every element their shapes and strides address; `dst` is valid for
/// writes of `m` rows of `n` elements `ld ≥ n` apart that no one else reads or writes
/// meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_into(
    x: &[f32],
    m: usize,
    k: usize,
    rhs: &[f32],
    n: usize,
    rhs_strides: (isize, isize),
    dst: *mut f32,
    ld: usize,
    par: bool,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        ld as isize,
        false,
        x.as_ptr(),
        1,
        k as isize,
        rhs.as_ptr(),
        rhs_strides.0,
        rhs_strides.1,
        0.0f32,
        1.0f32,
        false,
        false,
        false,
        parallelism(par),
    );
}

/// Panels per block of the f16 large-batch path.
const BLOCK_PANELS: usize = 4;

/// `out = x · wᵀ` for f16 weights and many input rows: each block of panels is widened to
/// f32 once (cost amortised over the m rows) and multiplied with the f32 gemm kernel
/// straight into its columns of `out` (rows `n` apart), which no pass zero-fills or copies.
/// (The gemm crate's own f16 kernel is several times slower on this CPU.)
fn blocked_f16(x: &[f32], m: usize, k: usize, w: &PackedF16, n: usize, out: &mut [f32], par: bool) {
    assert!(
        x.len() >= m * k && out.len() >= m * n,
        "blocked_f16: short operand"
    );
    let blocks = w.panels().div_ceil(BLOCK_PANELS);
    // A single block (a narrow layer, e.g. the router) parallelises inside gemm instead.
    let gemm_par = par && blocks == 1;
    let dst = SharedBuf(out.as_mut_ptr());
    let task = |b: usize| {
        let p0 = b * BLOCK_PANELS;
        let mut wt = Vec::new();
        let cols = w.widen_panels(p0, (p0 + BLOCK_PANELS).min(w.panels()), &mut wt);
        let n0 = p0 * PANEL;
        assert!(
            n0 + cols <= n,
            "blocked_f16: panels past the output's columns"
        );
        assert!(
            wt.len() >= k * cols,
            "blocked_f16: widened panels shorter than [k, cols]"
        );
        // SAFETY: `out` holds `m` rows of `n` (asserted above); this block writes only the
        // columns `n0 .. n0 + cols ≤ n` of each, and no two blocks share a column, so the
        // tasks' writes are disjoint. `wt` holds `[k, cols]` row-major, `x` `[m, k]`.
        unsafe {
            gemm_into(
                x,
                m,
                k,
                &wt,
                cols,
                (1, cols as isize),
                dst.at(n0),
                n,
                gemm_par,
            )
        };
    };
    if par && !gemm_par {
        (0..blocks).into_par_iter().for_each(task);
    } else {
        (0..blocks).for_each(task);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for t in 0..k {
                    s += x[i * k + t] as f64 * w[j * k + t] as f64;
                }
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 1000) as f32
                    / 500.0
                    - 1.0
            })
            .collect()
    }

    /// What `blocked_f16` computed before it wrote into `out` directly: each block widened,
    /// multiplied into a scratch of its own, then copied into its columns.
    fn blocked_f16_through_scratch(
        x: &[f32],
        m: usize,
        k: usize,
        w: &PackedF16,
        n: usize,
    ) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for b in 0..w.panels().div_ceil(BLOCK_PANELS) {
            let p0 = b * BLOCK_PANELS;
            let mut wt = Vec::new();
            let cols = w.widen_panels(p0, (p0 + BLOCK_PANELS).min(w.panels()), &mut wt);
            let mut ob = vec![0f32; m * cols];
            gemm_rhs(x, m, k, &wt, cols, (1, cols as isize), &mut ob, false);
            let n0 = p0 * PANEL;
            for i in 0..m {
                out[i * n + n0..i * n + n0 + cols].copy_from_slice(&ob[i * cols..(i + 1) * cols]);
            }
        }
        out
    }

    #[test]
    fn blocked_f16_writes_what_the_scratch_blocks_computed_bit_for_bit() {
        for &(m, k, n) in &[(2, 64, 65), (17, 96, 384), (64, 40, 1000), (5, 128, 16)] {
            let x = data(m * k, 3);
            let w = PackedF16::pack(&data(n * k, 11), n, k);
            let want = blocked_f16_through_scratch(&x, m, k, &w, n);
            for par in [false, true] {
                let mut got = vec![f32::NAN; m * n];
                blocked_f16(&x, m, k, &w, n, &mut got, par);
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "m {m}, k {k}, n {n}, parallel {par}");
            }
        }
    }

    /// The roundings around a half-precision matmul give the same bits run side by side
    /// (outputs and inputs past `ROUND_ELEMS_PER_TASK`, rows split into tasks) as on one
    /// thread, with and without a bias, in f16 and bf16.
    #[test]
    fn parallel_roundings_give_the_serial_bits() {
        // out [64, 600] and x [64, 300] both exceed one task; m·n·k passes PARALLEL_WORK.
        let (m, k, n) = (64, 300, 600);
        let x = data(m * k, 4);
        let w = data(n * k, 5);
        for dtype in [Dtype::F16, Dtype::Bf16] {
            for bias in [None, Some(data(n, 6))] {
                let lin = Linear::new("t", w.clone(), n, k, bias, dtype).unwrap();
                let run = |par: bool| {
                    let mut out = vec![f32::NAN; m * n];
                    lin.forward(&x, m, &mut out, par);
                    out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                assert_eq!(run(true), run(false), "{dtype:?}");
            }
        }
        assert!(m * k > ROUND_ELEMS_PER_TASK && m * n * k >= PARALLEL_WORK);
    }

    #[test]
    fn matches_naive_for_every_path() {
        for &(m, k, n) in &[
            (1, 70, 130),
            (3, 64, 65),
            (12, 64, 300),
            (8, 33, 200),
            (9, 64, 64),
            (40, 100, 70),
            (131, 48, 150),
            // past PANEL_M: widened blocks through gemm
            (PANEL_M + 9, 24, 70),
        ] {
            let x = data(m * k, 1);
            let w = data(n * k, 2);
            let b: Vec<f32> = data(n, 3);
            let mut want = naive(&x, m, k, &w, n);
            for (i, v) in want.iter_mut().enumerate() {
                *v += b[i % n];
            }
            for dtype in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
                let lin = Linear::new("t", w.clone(), n, k, Some(b.clone()), dtype).unwrap();
                for par in [false, true] {
                    let mut out = vec![0f32; m * n];
                    lin.forward(&x, m, &mut out, par);
                    let tol = match dtype {
                        Dtype::F32 => 1e-4,
                        Dtype::F16 => 0.05 * (k as f32).sqrt(),
                        Dtype::Bf16 => 0.2 * (k as f32).sqrt(),
                    };
                    for (a, b) in out.iter().zip(&want) {
                        assert!(
                            (a - b).abs() <= tol,
                            "m={m} k={k} n={n} {dtype}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// A hand-computed bf16 projection: inputs, weights, bias epilogue and output rounding.
    #[test]
    fn bf16_linear_rounds_inputs_weights_and_output_by_hand() {
        // x = [1 + 2^-9, 3]: bf16 keeps 8 significant bits, so x becomes [1, 3].
        // w = [[1 + 2^-9, 1], [0.5, -1 - 2^-7]]: bf16 rows [1, 1] and [0.5, -1 - 2^-7].
        // bias [2^-8, 0].
        // Row 0: 1·1 + 3·1 + 2^-8 = 4 + 2^-8; bf16 step at 4 is 2^-5, so the output is 4.
        // Without the bias before rounding it would also be 4; the bias alone in f32 would
        // leave 4 + 2^-8: the epilogue order is visible in the result.
        // Row 1: 0.5 − 3·(1 + 2^-7) = −2.5234375 = −1.01000011b·2: nine significant bits,
        // halfway between the bf16 values −1.0100001b·2 and −1.0100010b·2; ties go to the
        // even mantissa, −1.0100010b·2 = −2.53125.
        let x = [1.0 + 2f32.powi(-9), 3.0];
        let w = vec![1.0 + 2f32.powi(-9), 1.0, 0.5, -1.0 - 2f32.powi(-7)];
        let b = vec![2f32.powi(-8), 0.0];
        let lin = Linear::new("hand", w, 2, 2, Some(b), Dtype::Bf16).unwrap();
        let mut out = [0f32; 2];
        lin.forward(&x, 1, &mut out, false);
        assert_eq!(out, [4.0, -2.53125]);
        assert_eq!(lin.dtype(), Dtype::Bf16);
        // f16 keeps the bias after the rounded product: 4 + 2^-8 survives.
        let w16 = vec![1.0, 1.0, 0.5, -1.0];
        let lin16 = Linear::new(
            "hand",
            w16,
            2,
            2,
            Some(vec![2f32.powi(-8), 0.0]),
            Dtype::F16,
        );
        lin16.unwrap().forward(&[1.0, 3.0], 1, &mut out, false);
        assert_eq!(out[0], 4.0 + 2f32.powi(-8));
    }

    #[test]
    fn wrong_shape_is_an_error() {
        assert!(Linear::new("w", vec![0.0; 5], 2, 3, None, Dtype::F32).is_err());
        assert!(Linear::new("w", vec![0.0; 6], 2, 3, Some(vec![0.0]), Dtype::F32).is_err());
    }
}
