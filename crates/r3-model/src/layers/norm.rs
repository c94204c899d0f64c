//! RMSNorm `y = x · w / sqrt(mean(x²) + eps)` over the last dimension.
//!
//! On CPU in f32/f64 it is one custom op with its own backward (rows in parallel): candle's
//! fused kernel has no gradient, and the composed `rms_norm_slow` costs six ops forward and
//! about twice that backward, each a full pass with a fresh buffer, five times per layer.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::gemm::{assume_init_vec, unfilled};
use crate::device::row_ops_run_on;
use crate::error::Result;
use crate::host::{contiguous, with_host};
use crate::math::Float;
use crate::precision::{Precision, RoundTo};
use crate::round16::{round_in_place, rounding_for};
use crate::weights::Weights;

/// RMSNorm with a learned scale.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
    precision: Precision,
}

impl RmsNorm {
    /// Loads `{prefix}.weight`.
    pub fn new(weights: &Weights, prefix: &str, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: weights.get(&format!("{prefix}.weight"))?.clone(),
            eps: eps as f32,
            precision: Precision::F32,
        })
    }

    /// The learned scale `[H]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The same norm reading `weight` (of this norm's shape) as its scale: a segment run
    /// again in a backward hands the norm its own leaf for the scale.
    pub fn with_weight(&self, weight: Tensor) -> RmsNorm {
        RmsNorm {
            weight,
            ..self.clone()
        }
    }

    /// Sets the precision (bf16: the scale read as bf16, the output rounded to bf16).
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    /// Normalises the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let p = self.precision;
        // The CPU's fused kernels in f32 / f64; r3's CUDA kernels in f32 on a GPU.
        let fused = row_ops_run_on(x) && x.dtype() == self.weight.dtype();
        if fused {
            // A mixed forward's two rounding points (the scale read as the 16-bit float, the
            // output rounded to it) happen inside the op's own pass: on a GPU two kernels
            // fewer per norm, which bound a decode step of a few rows by their launches.
            let round = p.narrow_dtype().filter(|_| x.dtype() == DType::F32);
            let x = x.contiguous()?;
            return Ok(x.apply_op2(
                &self.weight,
                RmsNormOp {
                    eps: self.eps as f64,
                    round,
                },
            )?);
        }
        if p.is_mixed() {
            let rounded = RmsNorm {
                weight: p.round(&self.weight)?,
                eps: self.eps,
                precision: Precision::F32,
            };
            return p.round(&rounded.forward(x)?);
        }
        Ok(candle_nn::ops::rms_norm_slow(x, &self.weight, self.eps)?)
    }
}

/// The fused RMSNorm op `(x, w) → y`.
struct RmsNormOp {
    eps: f64,
    /// The 16-bit float the scale is read as and the output rounded to (f32 values rounded
    /// to nearest, ties to even: [`Precision::round`]'s values at both points); None for the
    /// plain norm. The op's value and gradients equal rounding around the plain op.
    round: Option<DType>,
}

/// Rows per parallel task (the weight gradient is summed per task, then across tasks): the
/// GPU kernel's chunk too.
const ROWS_PER_TASK: usize = crate::launch_shape::RMS_NORM_DW_CHUNK_ROWS;

// The CUDA kernel `r3_rms_norm_dw_chunks_f32` holds a chunk's inverse RMS values in 64 slots.
const _: () = assert!(ROWS_PER_TASK <= 64);

/// `1 / sqrt(mean(row²) + eps)`.
fn inv_rms<T: Float>(row: &[T], eps: f64) -> T {
    let ms = row.iter().map(|&v| (v * v).to_f64()).sum::<f64>() / row.len() as f64;
    T::from_f64(1.0 / (ms + eps).sqrt())
}

/// Rows whose sums advance side by side ([`inv_rms_group`], [`dot_group`]).
const ROW_GROUP: usize = 8;

/// [`inv_rms`] of each of the `ROW_GROUP` rows of width `d` that lie one after another in
/// `rows` (`[ROW_GROUP · d]`). Each row's squares are summed in column order from zero, as
/// `inv_rms` sums them (the same bits); the rows' sums advance side by side, so their
/// chains of f64 additions overlap instead of each waiting on the adder's latency
/// (measured: one row's chain made the norms ≈ 12% of a small model's training step).
fn inv_rms_group<T: Float>(rows: &[T], d: usize, eps: f64) -> [T; ROW_GROUP] {
    let row: [&[T]; ROW_GROUP] = std::array::from_fn(|i| &rows[i * d..(i + 1) * d]);
    let mut sums = [0f64; ROW_GROUP];
    for c in 0..d {
        for (sum, row) in sums.iter_mut().zip(&row) {
            *sum += (row[c] * row[c]).to_f64();
        }
    }
    sums.map(|sum| T::from_f64(1.0 / (sum / d as f64 + eps).sqrt()))
}

/// Per row of a `ROW_GROUP`-row block, `mean(g·w·x̂)` with `x̂ = x · r` as [`rms_bwd_parts`]
/// sums it row by row (column order from zero, in f64): the same bits, the rows side by
/// side as in [`inv_rms_group`].
fn dot_group<T: Float>(xs: &[T], gs: &[T], w: &[T], r: &[T; ROW_GROUP]) -> [T; ROW_GROUP] {
    let d = w.len();
    let x: [&[T]; ROW_GROUP] = std::array::from_fn(|i| &xs[i * d..(i + 1) * d]);
    let g: [&[T]; ROW_GROUP] = std::array::from_fn(|i| &gs[i * d..(i + 1) * d]);
    let mut dots = [0f64; ROW_GROUP];
    for (c, &w) in w.iter().enumerate() {
        for (i, dot) in dots.iter_mut().enumerate() {
            let xhat = x[i][c] * r[i];
            *dot += (g[i][c] * w * xhat).to_f64();
        }
    }
    dots.map(|dot| T::from_f64(dot / d as f64))
}

fn rms_fwd<T: Float>(x: &[T], w: &[T], eps: f64) -> Vec<T> {
    let d = w.len();
    // Not zero-filled first: every element is written below.
    let mut y = unfilled(x.len());
    y.par_chunks_mut(d * ROW_GROUP)
        .zip(x.par_chunks(d * ROW_GROUP))
        .for_each(|(ys, xs)| {
            let group = match xs.len() == d * ROW_GROUP {
                true => Some(inv_rms_group(xs, d, eps)),
                false => None,
            };
            for (i, (yr, xr)) in ys.chunks_mut(d).zip(xs.chunks(d)).enumerate() {
                let r = group.map_or_else(|| inv_rms(xr, eps), |g| g[i]);
                for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(w) {
                    y.write(x * r * w);
                }
            }
        });
    // SAFETY: the chunks cover all `x.len()` elements and each element was written.
    unsafe { assume_init_vec(y) }
}

/// `dx = r · (g·w − x̂ · mean(g·w·x̂))`, `dw = Σ_rows g · x̂`, with `x̂ = x · r`.
///
/// `dw` is summed per fixed chunk of [`ROWS_PER_TASK`] rows, and the chunk sums are combined
/// in a fixed order ([`sum_chunks`]): the result does not depend on how rayon schedules the
/// chunks, so a run is the same on any thread count.
fn rms_bwd<T: Float>(x: &[T], w: &[T], g: &[T], eps: f64) -> (Vec<T>, Vec<T>) {
    let (dx, partials) = rms_bwd_parts(x, w, g, eps);
    (dx, sum_chunks(&partials, w.len()))
}

/// [`rms_bwd`]'s `dx` and its per-chunk `dw` sums, before the chunks are combined. The CUDA
/// kernels `r3_rms_norm_dx_f32` and `r3_rms_norm_dw_chunks_f32` do the same per-element
/// operations in the same order (written so that nvcc fuses none), the rows of a chunk added
/// in order; their f64 sums (the squares, the mean's products) run in a block's order, so
/// within rounding of these.
fn rms_bwd_parts<T: Float>(x: &[T], w: &[T], g: &[T], eps: f64) -> (Vec<T>, Vec<Vec<T>>) {
    let d = w.len();
    // The writes below cover `dx` only if `g` is as long as `x` (candle hands the op a
    // gradient of its output's shape: a mismatch is a bug, not input).
    assert_eq!(
        g.len(),
        x.len(),
        "rms norm backward: gradient and input lengths differ"
    );
    // Not zero-filled first: every element is written below.
    let mut dx = unfilled(x.len());
    let partials: Vec<Vec<T>> = dx
        .par_chunks_mut(d * ROWS_PER_TASK)
        .zip(x.par_chunks(d * ROWS_PER_TASK))
        .zip(g.par_chunks(d * ROWS_PER_TASK))
        .map(|((dxs, xs), gs)| {
            let mut dw = vec![T::ZERO; d];
            let blocks = dxs
                .chunks_mut(d * ROW_GROUP)
                .zip(xs.chunks(d * ROW_GROUP))
                .zip(gs.chunks(d * ROW_GROUP));
            for ((dxb, xb), gb) in blocks {
                // A full block's inverse RMS and means side by side; a short one row by row.
                let group = match xb.len() == d * ROW_GROUP {
                    true => {
                        let r = inv_rms_group(xb, d, eps);
                        Some((r, dot_group(xb, gb, w, &r)))
                    }
                    false => None,
                };
                let rows = dxb.chunks_mut(d).zip(xb.chunks(d)).zip(gb.chunks(d));
                for (i, ((dxr, xr), gr)) in rows.enumerate() {
                    let (r, mean) = match group {
                        Some((r, means)) => (r[i], means[i]),
                        None => {
                            let r = inv_rms(xr, eps);
                            let mut dot = 0f64;
                            for ((&x, &g), &w) in xr.iter().zip(gr).zip(w) {
                                dot += (g * w * (x * r)).to_f64();
                            }
                            (r, T::from_f64(dot / d as f64))
                        }
                    };
                    for ((&x, &g), dw) in xr.iter().zip(gr).zip(dw.iter_mut()) {
                        *dw = *dw + g * (x * r);
                    }
                    for (((dx, &x), &g), &w) in dxr.iter_mut().zip(xr).zip(gr).zip(w) {
                        dx.write(r * (g * w - x * r * mean));
                    }
                }
            }
            dw
        })
        .collect();
    // SAFETY: the row chunks of `dx`, `x` and `g` (one length, asserted above) pair up
    // element for element, and each element of `dx` was written (a row is at most `d` long).
    let dx = unsafe { assume_init_vec(dx) };
    (dx, partials)
}

/// The element-wise sum of per-chunk vectors in one fixed order: each half of the chunk
/// list summed from zero in chunk order, then the two halves added. The order depends only
/// on the number of chunks, never on the pool.
fn sum_chunks<T: Float>(parts: &[Vec<T>], d: usize) -> Vec<T> {
    let fold = |parts: &[Vec<T>]| {
        parts.iter().fold(vec![T::ZERO; d], |mut acc, p| {
            for (a, &b) in acc.iter_mut().zip(p) {
                *a = *a + b;
            }
            acc
        })
    };
    if parts.len() < 2 {
        return fold(parts);
    }
    let (left, right) = parts.split_at(parts.len() / 2);
    let mut sum = fold(left);
    for (a, b) in sum.iter_mut().zip(fold(right)) {
        *a = *a + b;
    }
    sum
}

impl RmsNormOp {
    fn bwd_typed<T: Float + WithDType>(
        &self,
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
        (want_dx, want_dw): (bool, bool),
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = with_host::<T, _>(x, |xv| {
            with_host::<T, _>(w, |wv| {
                with_host::<T, _>(grad, |gv| Ok(rms_bwd(xv, wv, gv, self.eps)))
            })
        })?;
        let dx = want_dx
            .then(|| Tensor::from_vec(dx, x.shape(), x.device()))
            .transpose()?;
        let dw = want_dw
            .then(|| Tensor::from_vec(dw, w.shape(), w.device()))
            .transpose()?;
        Ok((dx, dw))
    }

    /// The plain norm's gradients of `x` and `w` (those wanted) for the output gradient
    /// `grad`.
    fn plain_bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
        (want_dx, want_dw): (bool, bool),
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        if x.device().is_cuda() {
            // r3's CUDA kernels: `dx` one pass per row, `dw` per chunk of rows then summed.
            let eps = self.eps;
            let grad = grad.contiguous()?;
            let dx = want_dx
                .then(|| x.apply_op3_no_bwd(w, &grad, &RmsNormDx { eps }))
                .transpose()?;
            let dw = want_dw
                .then(|| x.apply_op2_no_bwd(&grad, &RmsNormDwChunks { eps })?.sum(0))
                .transpose()?;
            return Ok((dx, dw));
        }
        match x.dtype() {
            DType::F32 => self.bwd_typed::<f32>(x, w, grad, (want_dx, want_dw)),
            DType::F64 => self.bwd_typed::<f64>(x, w, grad, (want_dx, want_dw)),
            dt => candle_core::bail!("rms norm: no backward for {dt:?}"),
        }
    }
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "r3-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        weight_width(xl, wl)?;
        let rounding = self
            .round
            .map(|narrow| rounding_for(narrow, "rms norm"))
            .transpose()?;
        let y = match (x, w) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => {
                let (x, w) = (
                    contiguous(x, xl, "rms norm input")?,
                    contiguous(w, wl, "rms norm weight")?,
                );
                CpuStorage::F32(match rounding {
                    None => rms_fwd(x, w, self.eps),
                    Some(round) => {
                        let mut scale = w.to_vec();
                        round(&mut scale);
                        let mut y = rms_fwd(x, &scale, self.eps);
                        round_in_place(&mut y, round);
                        y
                    }
                })
            }
            (CpuStorage::F64(_), CpuStorage::F64(_)) if rounding.is_some() => {
                candle_core::bail!("rms norm: the 16-bit rounding applies to f32 operands")
            }
            (CpuStorage::F64(x), CpuStorage::F64(w)) => CpuStorage::F64(rms_fwd(
                contiguous(x, xl, "rms norm input")?,
                contiguous(w, wl, "rms norm weight")?,
                self.eps,
            )),
            _ => candle_core::bail!("rms norm: operands must both be f32 or both f64"),
        };
        Ok((y, xl.shape().clone()))
    }

    /// r3's CUDA kernels (`r3_rms_norm_f32`): one pass per row; the squares summed in f64
    /// as on the CPU, the scale and the output rounded in the same pass when asked.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let d = weight_width(xl, wl)?;
        let n = xl.shape().elem_count();
        // Each block reads and writes its own row of `d`.
        let y = cuda::launch_f32!(
            cuda::device(x),
            "r3_rms_norm_f32",
            n,
            cuda::per_row(n / d, cuda::row_threads(d))?,
            [
                cuda::view::<f32>(x, xl, "rms norm input")?,
                cuda::view::<f32>(w, wl, "rms norm weight")?
            ],
            [d as u32, self.eps, cuda::round_code(self.round)?]
        );
        Ok((y, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let wants = (x.track_op(), w.track_op());
        let Some(narrow) = self.round else {
            return self.plain_bwd(x, w, grad, wants);
        };
        // What the rounding points around the plain norm give (`RoundTo`'s backward rounds
        // the gradient passing through it): the output gradient rounded, the plain norm's
        // gradients at the rounded scale, the scale's gradient rounded.
        let round = RoundTo { narrow };
        let grad = grad.apply_op1_no_bwd(&round)?;
        let scale = w.apply_op1_no_bwd(&round)?;
        let (dx, dw) = self.plain_bwd(x, &scale, &grad, wants)?;
        let dw = dw.map(|dw| dw.apply_op1_no_bwd(&round)).transpose()?;
        Ok((dx, dw))
    }
}

/// The row width `d` of an RMSNorm: the weight's length, which must end the input's shape.
fn weight_width(xl: &Layout, wl: &Layout) -> candle_core::Result<usize> {
    let d = wl.shape().elem_count();
    if xl.shape().dims().last() != Some(&d) || wl.shape().rank() != 1 || d == 0 {
        candle_core::bail!(
            "rms norm: input {:?} does not end in the weight's {d}",
            xl.shape()
        );
    }
    Ok(d)
}

/// The row width of an RMSNorm backward: the input's last dimension, checked against the
/// incoming gradient's shape.
fn gradient_width(xl: &Layout, gl: &Layout) -> candle_core::Result<usize> {
    let d = *xl.shape().dims().last().unwrap_or(&0);
    if d == 0 || gl.shape() != xl.shape() {
        candle_core::bail!(
            "rms norm: gradient {:?} for input {:?}",
            gl.shape(),
            xl.shape()
        );
    }
    Ok(d)
}

/// The input gradient of [`RmsNormOp`] as an op `(x, w, g) → dx` (a GPU's backward).
struct RmsNormDx {
    eps: f64,
}

impl CustomOp3 for RmsNormDx {
    fn name(&self) -> &'static str {
        "r3-rms-norm-dx"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        weight_width(xl, wl)?;
        gradient_width(xl, gl)?;
        let dx = match (x, w, g) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(g)) => CpuStorage::F32(
                rms_bwd_parts(
                    contiguous(x, xl, "rms norm input")?,
                    contiguous(w, wl, "rms norm weight")?,
                    contiguous(g, gl, "rms norm gradient")?,
                    self.eps,
                )
                .0,
            ),
            (CpuStorage::F64(x), CpuStorage::F64(w), CpuStorage::F64(g)) => CpuStorage::F64(
                rms_bwd_parts(
                    contiguous(x, xl, "rms norm input")?,
                    contiguous(w, wl, "rms norm weight")?,
                    contiguous(g, gl, "rms norm gradient")?,
                    self.eps,
                )
                .0,
            ),
            _ => candle_core::bail!("rms norm: operands must be all f32 or all f64"),
        };
        Ok((dx, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let d = weight_width(xl, wl)?;
        gradient_width(xl, gl)?;
        let n = xl.shape().elem_count();
        // Each block reads and writes its own row of `d`.
        let dx = cuda::launch_f32!(
            cuda::device(x),
            "r3_rms_norm_dx_f32",
            n,
            cuda::per_row(n / d, cuda::row_threads(d))?,
            [
                cuda::view::<f32>(x, xl, "rms norm input")?,
                cuda::view::<f32>(w, wl, "rms norm weight")?,
                cuda::view::<f32>(g, gl, "rms norm gradient")?
            ],
            [d as u32, self.eps]
        );
        Ok((dx, xl.shape().clone()))
    }
}

/// The weight gradient of [`RmsNormOp`] per chunk of [`ROWS_PER_TASK`] rows, as an op
/// `(x, g) → [chunks, d]` (a GPU's backward; the caller sums the chunks).
struct RmsNormDwChunks {
    eps: f64,
}

impl RmsNormDwChunks {
    /// The chunks' sums of an input of `n` elements in rows of `d`, as `[chunks, d]`.
    fn shape(n: usize, d: usize) -> Shape {
        Shape::from(((n / d).div_ceil(ROWS_PER_TASK), d))
    }
}

impl CustomOp2 for RmsNormDwChunks {
    fn name(&self) -> &'static str {
        "r3-rms-norm-dw-chunks"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = gradient_width(xl, gl)?;
        // The weight only scales `dx`: the chunks' `dw` sums do not read it.
        let parts = match (x, g) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => CpuStorage::F32(
                rms_bwd_parts(
                    contiguous(x, xl, "rms norm input")?,
                    &vec![1.0; d],
                    contiguous(g, gl, "rms norm gradient")?,
                    self.eps,
                )
                .1
                .concat(),
            ),
            (CpuStorage::F64(x), CpuStorage::F64(g)) => CpuStorage::F64(
                rms_bwd_parts(
                    contiguous(x, xl, "rms norm input")?,
                    &vec![1.0; d],
                    contiguous(g, gl, "rms norm gradient")?,
                    self.eps,
                )
                .1
                .concat(),
            ),
            _ => candle_core::bail!("rms norm: operands must both be f32 or both f64"),
        };
        Ok((parts, Self::shape(xl.shape().elem_count(), d)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let d = gradient_width(xl, gl)?;
        let rows = xl.shape().elem_count() / d;
        let shape = Self::shape(xl.shape().elem_count(), d);
        // Block `c` writes chunk `c`'s row of `d` sums, a thread per column (up to 1,024):
        // the chunks are few (64 for mid's 4,096 rows) and each column's sum is a chain of
        // 64 dependent adds, so a thread per four columns left the GPU mostly idle (≈ 78 µs a
        // call on an H200, 8% of a mid bf16 step's kernel time).
        let threads = crate::launch_shape::rms_norm_dw_chunk_threads(d);
        let parts = cuda::launch_f32!(
            cuda::device(x),
            "r3_rms_norm_dw_chunks_f32",
            shape.elem_count(),
            cuda::per_row(shape.dims()[0], threads)?,
            [
                cuda::view::<f32>(x, xl, "rms norm input")?,
                cuda::view::<f32>(g, gl, "rms norm gradient")?
            ],
            [rows as u32, d as u32, ROWS_PER_TASK as u32, self.eps]
        );
        Ok((parts, shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::max_abs_diff as max_diff;
    use candle_core::{Device, Var};

    fn values(shape: &[usize], salt: usize, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let data: Vec<f64> = (0..n)
            .map(|i| (((i * 29 + salt * 13) % 97) as f64 / 97.0 - 0.4) * 3.0)
            .collect();
        Tensor::from_vec(data, shape, &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .expect("values")
    }

    /// The weight gradient over many row chunks is the same bit for bit in pools of 1 to 4
    /// threads, and equals the plain sum over rows (in f64) to rounding.
    #[test]
    fn weight_gradient_does_not_depend_on_the_thread_count() {
        let host = |shape: &[usize], salt| {
            values(shape, salt, DType::F32)
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("host")
        };
        let (rows, d) = (40 * ROWS_PER_TASK + 7, 8);
        let (x, w, g) = (host(&[rows, d], 1), host(&[d], 2), host(&[rows, d], 3));
        let in_pool = |threads| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("pool")
                .install(|| rms_bwd(&x, &w, &g, 1e-6).1)
        };
        let one = in_pool(1);
        for threads in 2..=4 {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&in_pool(threads)), bits(&one), "{threads} threads");
        }
        for (j, &dw) in one.iter().enumerate() {
            let exact: f64 = (0..rows)
                .map(|r| {
                    let row = &x[r * d..(r + 1) * d];
                    let ms = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / d as f64;
                    f64::from(g[r * d + j]) * f64::from(row[j]) / (ms + 1e-6).sqrt()
                })
                .sum();
            assert!(
                (f64::from(dw) - exact).abs() < 1e-3,
                "dw[{j}] {dw} vs {exact}"
            );
        }
    }

    /// Values and both gradients equal candle's composed `rms_norm_slow`, over more rows than
    /// one parallel task holds (so the per-task weight-gradient sums are combined).
    #[test]
    fn fused_matches_composed_ops() {
        for dtype in [DType::F64, DType::F32] {
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            let x = Var::from_tensor(&values(&[3, 50, 8], 1, dtype)).expect("x");
            let w = Var::from_tensor(&values(&[8], 2, dtype)).expect("w");
            let probe = values(&[3, 50, 8], 3, dtype);
            let norm = RmsNorm {
                weight: w.as_tensor().clone(),
                eps: 1e-6,
                precision: Precision::F32,
            };
            let fused = norm.forward(x.as_tensor()).expect("fused");
            let composed =
                candle_nn::ops::rms_norm_slow(x.as_tensor(), w.as_tensor(), 1e-6).expect("slow");
            assert!(max_diff(&fused, &composed) < tol, "{dtype:?} values");
            let gf = (&fused * &probe)
                .and_then(|t| t.sum_all())
                .and_then(|l| l.backward())
                .expect("b");
            let gc = (&composed * &probe)
                .and_then(|t| t.sum_all())
                .and_then(|l| l.backward())
                .expect("b");
            for (name, v) in [("x", &x), ("w", &w)] {
                let (a, b) = (
                    gf.get(v.as_tensor()).expect("g"),
                    gc.get(v.as_tensor()).expect("g"),
                );
                assert!(max_diff(a, b) < tol, "{dtype:?} gradient of {name}");
            }
        }
    }

    /// In a mixed forward the op rounds the scale and the output in its own pass: its value
    /// and both gradients equal the rounding points around the plain norm (`RoundTo` on the
    /// scale and on the output, the plain fused op between) bit for bit, in bf16 and f16,
    /// over more rows than one parallel task holds.
    #[test]
    fn the_rounded_norm_equals_rounding_around_the_plain_norm() {
        let bits = crate::test_util::f32_bits;
        for p in [
            Precision::Bf16 { router_f32: false },
            Precision::F16 { router_f32: false },
        ] {
            let x = Var::from_tensor(&values(&[3, 50, 8], 1, DType::F32)).expect("x");
            let w = Var::from_tensor(&values(&[8], 2, DType::F32)).expect("w");
            let probe = values(&[3, 50, 8], 3, DType::F32);
            let norm = RmsNorm {
                weight: w.as_tensor().clone(),
                eps: 1e-6,
                precision: p,
            };
            let fused = norm.forward(x.as_tensor()).expect("fused");
            let plain = RmsNorm {
                weight: p.round(w.as_tensor()).expect("scale"),
                eps: 1e-6,
                precision: Precision::F32,
            };
            let around = p
                .round(&plain.forward(x.as_tensor()).expect("plain"))
                .expect("rounded");
            assert_eq!(bits(&fused), bits(&around), "{p:?} values");
            let grads = |y: &Tensor| {
                (y * &probe)
                    .and_then(|t| t.sum_all())
                    .and_then(|l| l.backward())
                    .expect("backward")
            };
            let (gf, ga) = (grads(&fused), grads(&around));
            for (name, v) in [("x", &x), ("w", &w)] {
                let (a, b) = (
                    gf.get(v.as_tensor()).expect("g"),
                    ga.get(v.as_tensor()).expect("g"),
                );
                assert_eq!(bits(a), bits(b), "{p:?} gradient of {name}");
            }
            // The rounding is not a no-op on these values: the plain norm differs.
            let unrounded = RmsNorm {
                weight: w.as_tensor().clone(),
                eps: 1e-6,
                precision: Precision::F32,
            }
            .forward(x.as_tensor())
            .expect("f32");
            assert_ne!(
                bits(&fused),
                bits(&unrounded),
                "{p:?} rounding changed nothing"
            );
        }
    }

    /// The GPU backward's two ops (input gradient; weight gradient per chunk, then summed)
    /// equal the fused CPU backward: `dx` bit for bit, `dw` to rounding (the chunks summed
    /// in another order), over several chunks and a short last one.
    #[test]
    fn the_gpu_backward_ops_equal_the_fused_backward() {
        let host = |t: &Tensor| {
            t.flatten_all()
                .and_then(|t| t.to_dtype(DType::F64))
                .and_then(|t| t.to_vec1::<f64>())
                .expect("host")
        };
        let (rows, d) = (3 * ROWS_PER_TASK + 5, 12);
        for dtype in [DType::F64, DType::F32] {
            let x = values(&[rows, d], 1, dtype);
            let w = values(&[d], 2, dtype);
            let g = values(&[rows, d], 3, dtype);
            let (dx_cpu, dw_cpu) = match dtype {
                DType::F32 => {
                    let f = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
                    let (dx, dw) = rms_bwd(
                        &f(&x).expect("x"),
                        &f(&w).expect("w"),
                        &f(&g).expect("g"),
                        1e-6,
                    );
                    let wide = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
                    (wide(dx), wide(dw))
                }
                _ => rms_bwd(&host(&x), &host(&w), &host(&g), 1e-6),
            };
            let dx = x
                .apply_op3_no_bwd(&w, &g, &RmsNormDx { eps: 1e-6 })
                .expect("dx");
            let parts = x
                .apply_op2_no_bwd(&g, &RmsNormDwChunks { eps: 1e-6 })
                .expect("dw chunks");
            assert_eq!(parts.dims(), &[4, d]);
            assert_eq!(host(&dx), dx_cpu, "{dtype:?} dx");
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-4 };
            let dw = host(&parts.sum(0).expect("dw"));
            for (a, b) in dw.iter().zip(&dw_cpu) {
                assert!((a - b).abs() < tol, "{dtype:?} dw {a} vs {b}");
            }
        }
    }
}
