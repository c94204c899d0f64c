//! Rotary embedding as one custom op with its own backward (CPU, f32/f64): reads `x`
//! `[B, H, T, D]` through its strides (so the usual `[B, T, H, D]` → `[B, H, T, D]` transpose
//! needs no copy) and writes the rotated tensor contiguous. Candle's composed `rope_slow`
//! builds ~7 autograd nodes per call, each with its own gradient pass in the backward.

use std::mem::MaybeUninit;
use std::sync::Arc;

use rayon::prelude::*;

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor, WithDType};

use crate::host::with_host;
use crate::layers::gemm::{assume_init_vec, unfilled};
use crate::math::Float;

/// Rotation by the position's angles: half-split pairs `(i, i + D/2)` or interleaved pairs
/// `(2i, 2i + 1)`; `cos`/`sin` are `[positions, D/2]` (scale already folded in).
pub struct RotaryOp {
    /// cos table, row-major `[positions, D/2]`.
    pub cos: Arc<Vec<f32>>,
    /// sin table, row-major `[positions, D/2]`.
    pub sin: Arc<Vec<f32>>,
    /// Pair layout.
    pub interleaved: bool,
}

/// One pair `(a, b)` rotated by `(c, s)`, or rotated back with `inverse`: the arithmetic
/// both [`rotate_row`] and the training op use, so the engines round alike.
#[inline(always)]
fn rotate_pair<T: Float>(xa: T, xb: T, c: T, s: T, inverse: bool) -> (T, T) {
    if inverse {
        (xa * c + xb * s, xb * c - xa * s)
    } else {
        (xa * c - xb * s, xb * c + xa * s)
    }
}

/// The element indices of pair `i` of a row with `half` pairs.
#[inline(always)]
fn pair_index(i: usize, half: usize, interleaved: bool) -> (usize, usize) {
    if interleaved {
        (2 * i, 2 * i + 1)
    } else {
        (i, i + half)
    }
}

/// Rotates (or, with `inverse`, rotates back) one head row of `2·cos.len()` values in place
/// by one position's `cos`/`sin`: half-split pairs `(i, i + half)` or interleaved `(2i, 2i+1)`.
/// The rotation of both engines (the rollout calls it per head on the host).
#[inline]
pub fn rotate_row<T: Float>(
    row: &mut [T],
    cos: &[f32],
    sin: &[f32],
    interleaved: bool,
    inverse: bool,
) {
    let half = cos.len();
    for (i, (&c, &s)) in cos.iter().zip(sin).enumerate() {
        let (a, b) = pair_index(i, half, interleaved);
        let (c, s) = (T::from_f64(c as f64), T::from_f64(s as f64));
        (row[a], row[b]) = rotate_pair(row[a], row[b], c, s, inverse);
    }
}

/// [`rotate_row`] from `src` into `dst` (same length), which need not be initialised:
/// every element is written.
#[inline]
fn rotate_row_into<T: Float>(
    src: &[T],
    dst: &mut [MaybeUninit<T>],
    cos: &[f32],
    sin: &[f32],
    interleaved: bool,
    inverse: bool,
) {
    let half = cos.len();
    debug_assert!(src.len() == 2 * half && dst.len() == 2 * half && sin.len() == half);
    for (i, (&c, &s)) in cos.iter().zip(sin).enumerate() {
        let (a, b) = pair_index(i, half, interleaved);
        let (c, s) = (T::from_f64(c as f64), T::from_f64(s as f64));
        let (ya, yb) = rotate_pair(src[a], src[b], c, s, inverse);
        dst[a].write(ya);
        dst[b].write(yb);
    }
}

impl RotaryOp {
    /// The head row at the start of `src` (`dst.len()` values) rotated by position `pos`'s
    /// angles into `dst`.
    #[inline]
    fn rotate_at<T: Float>(
        &self,
        src: &[T],
        dst: &mut [MaybeUninit<T>],
        pos: usize,
        inverse: bool,
    ) {
        let d = dst.len();
        let half = d / 2;
        rotate_row_into(
            &src[..d],
            dst,
            &self.cos[pos * half..(pos + 1) * half],
            &self.sin[pos * half..(pos + 1) * half],
            self.interleaved,
            inverse,
        );
    }

    /// `[B, H, T, D]` elements read through `layout` (last dim contiguous), rotated into a
    /// new contiguous `[B, H, T, D]` vector; one parallel task per (batch row, head).
    fn run<T: Float + WithDType>(
        &self,
        x: &[T],
        layout: &Layout,
        inverse: bool,
    ) -> candle_core::Result<Vec<T>> {
        let (b, h, t, d) = layout.shape().dims4()?;
        let st = layout.stride();
        let half = d / 2;
        if d != 2 * half
            || st[3] != 1
            || self.cos.len() < t * half
            || self.sin.len() != self.cos.len()
        {
            candle_core::bail!(
                "rope: input {:?} (strides {st:?}) does not fit tables of {} values",
                layout.shape(),
                self.cos.len()
            );
        }
        let n = b * h * t * d;
        if n == 0 {
            return Ok(Vec::new());
        }
        // Every element the strides address must lie inside `x` before any is read.
        let last = layout.start_offset() + (b - 1) * st[0] + (h - 1) * st[1] + (t - 1) * st[2];
        if last + d > x.len() {
            candle_core::bail!(
                "rope: input {:?} (strides {st:?}, offset {}) reaches past its {} elements",
                layout.shape(),
                layout.start_offset(),
                x.len()
            );
        }
        let mut out = unfilled(n);
        out.par_chunks_mut(t * d)
            .enumerate()
            .for_each(|(task, rows)| {
                let (bi, hi) = (task / h, task % h);
                let base = layout.start_offset() + bi * st[0] + hi * st[1];
                for (ti, row) in rows.chunks_exact_mut(d).enumerate() {
                    self.rotate_at(&x[base + ti * st[2]..], row, ti, inverse);
                }
            });
        // SAFETY: the tasks cover all `n` elements in rows of `d`, and `rotate_row_into`
        // writes every element of each row.
        Ok(unsafe { assume_init_vec(out) })
    }

    /// [`RotaryOp::run`] on a contiguous `[B, H, T, D]` `x`, written in `[B, T, H, D]` order
    /// (one parallel task per (batch row, position)).
    fn run_token_major<T: Float + WithDType>(
        &self,
        x: &[T],
        (b, h, t, d): (usize, usize, usize, usize),
        inverse: bool,
    ) -> candle_core::Result<Vec<T>> {
        let half = d / 2;
        let n = b * h * t * d;
        if d != 2 * half || x.len() != n || self.cos.len() < t * half {
            candle_core::bail!(
                "rope: {} values for [{b}, {h}, {t}, {d}] with tables of {} values",
                x.len(),
                self.cos.len()
            );
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut out = unfilled(n);
        out.par_chunks_mut(h * d)
            .enumerate()
            .for_each(|(task, heads)| {
                let (bi, ti) = (task / t, task % t);
                for (hi, row) in heads.chunks_exact_mut(d).enumerate() {
                    self.rotate_at(&x[((bi * h + hi) * t + ti) * d..], row, ti, inverse);
                }
            });
        // SAFETY: the tasks cover all `n` elements in rows of `d`, and `rotate_row_into`
        // writes every element of each row.
        Ok(unsafe { assume_init_vec(out) })
    }
}

/// Whether `x` `[B, H, T, D]` is the `(1, 2)` transpose of a contiguous `[B, T, H, D]` (the
/// usual input: projections reshaped to heads, then transposed).
fn is_token_major(x: &Tensor) -> bool {
    match x.dims() {
        &[_, h, t, d] => x.stride() == [t * h * d, d, h * d, 1],
        _ => false,
    }
}

impl CustomOp1 for RotaryOp {
    fn name(&self) -> &'static str {
        "r3-rotary"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = match x {
            CpuStorage::F32(v) => CpuStorage::F32(self.run(v, l, false)?),
            CpuStorage::F64(v) => CpuStorage::F64(self.run(v, l, false)?),
            _ => candle_core::bail!("rope: input must be f32 or f64"),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if is_token_major(x) {
            // The gradient in x's own layout: the transpose before the op hands it back
            // contiguous, so the projections' backward reads it without a copy.
            let (b, h, t, d) = x.dims4()?;
            let dims = (b, h, t, d);
            let dx = match grad.dtype() {
                candle_core::DType::F32 => {
                    let v = with_host::<f32, _>(grad, |g| self.run_token_major(g, dims, true))?;
                    Tensor::from_vec(v, (b, t, h, d), x.device())?
                }
                candle_core::DType::F64 => {
                    let v = with_host::<f64, _>(grad, |g| self.run_token_major(g, dims, true))?;
                    Tensor::from_vec(v, (b, t, h, d), x.device())?
                }
                dt => candle_core::bail!("rope: no backward for {dt:?}"),
            };
            return Ok(Some(dx.transpose(1, 2)?));
        }
        let layout = Layout::contiguous(grad.shape());
        let dx = match grad.dtype() {
            candle_core::DType::F32 => {
                let v = with_host::<f32, _>(grad, |g| self.run(g, &layout, true))?;
                Tensor::from_vec(v, x.shape(), x.device())?
            }
            candle_core::DType::F64 => {
                let v = with_host::<f64, _>(grad, |g| self.run(g, &layout, true))?;
                Tensor::from_vec(v, x.shape(), x.device())?
            }
            dt => candle_core::bail!("rope: no backward for {dt:?}"),
        };
        Ok(Some(dx))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{RopeConfig, RopeScaling};
    use crate::layers::attention::rope::Rope;
    use crate::test_util::{max_abs_diff as max_diff, seeded_tensor as rand_tensor};
    use candle_core::{DType, Device, Var};

    /// Which rotation a test runs.
    #[derive(Clone, Copy, PartialEq)]
    enum Path {
        /// The CPU's fused op (`RopeTables::apply` on the CPU).
        Fused,
        /// A GPU's: candle's rope kernel with the rotate-back backward, in its CPU form.
        Kernel,
        /// candle's composed ops, the reference.
        Composed,
    }

    /// The fused rope and the kernel rope against candle's composed ops on a transposed
    /// (strided) input and on a contiguous one: values and input gradients, half-split and
    /// interleaved, f32 and f64.
    #[test]
    fn fused_and_kernel_rope_match_composed_ops() {
        let (b, t, h, d) = (2, 5, 3, 8);
        for (interleaved, transposed) in [(false, true), (true, true), (false, false)] {
            let rope = Rope::new(&RopeConfig {
                theta: 10000.0,
                dim: d,
                interleaved,
                scaling: RopeScaling::None,
            });
            for (dtype, tol) in [(DType::F64, 0.0), (DType::F32, 0.0)] {
                let tables = rope.tables(t, &Device::Cpu, dtype).expect("tables");
                let shape = if transposed {
                    [b, t, h, d]
                } else {
                    [b, h, t, d]
                };
                let x = Var::from_tensor(&rand_tensor(&shape, 1, dtype)).unwrap();
                let w = rand_tensor(&[b, h, t, d], 2, dtype);
                let run = |path: Path| {
                    let xt = if transposed {
                        x.transpose(1, 2).expect("transpose")
                    } else {
                        x.as_tensor().clone()
                    };
                    let y = match path {
                        Path::Fused => tables.apply(&xt),
                        Path::Kernel => tables.apply_kernel(&xt),
                        Path::Composed => tables.apply_composed(&xt),
                    }
                    .expect("rope");
                    let grads = (&y * &w)
                        .and_then(|l| l.sum_all())
                        .and_then(|l| l.backward())
                        .expect("backward");
                    let g = grads.get(&x).expect("gradient").clone();
                    assert!(
                        g.is_contiguous(),
                        "a variable's gradient is handed out contiguous"
                    );
                    (y, g)
                };
                let (fy, fg) = run(Path::Fused);
                let (cy, cg) = run(Path::Composed);
                assert!(fy.is_contiguous());
                let (dy, dg) = (max_diff(&fy, &cy), max_diff(&fg, &cg));
                // Same products and sums in the same order: bit-identical values; the
                // gradient may differ in the last bit (composed: sum of two scatter paths).
                assert!(
                    dy <= tol,
                    "{dtype:?} interleaved={interleaved}: value diff {dy}"
                );
                let gtol = if dtype == DType::F32 { 1e-6 } else { 1e-15 };
                assert!(
                    dg <= gtol,
                    "{dtype:?} interleaved={interleaved}: grad diff {dg}"
                );
                // candle's kernel rounds its products in another order.
                let (ky, kg) = run(Path::Kernel);
                let ktol = if dtype == DType::F32 { 1e-6 } else { 1e-14 };
                let (dy, dg) = (max_diff(&ky, &cy), max_diff(&kg, &cg));
                assert!(
                    dy <= ktol && dg <= ktol,
                    "kernel {dtype:?} interleaved={interleaved}: {dy} {dg}"
                );
                assert!(
                    max_diff(&kg, &kg.zeros_like().expect("z")) > 0.1,
                    "a real gradient"
                );
            }
        }
    }
}
