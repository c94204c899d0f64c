//! Element-wise and row-wise kernels of the inference path: RMSNorm, SwiGLU, softmax, RoPE.
//! All in f32 on plain slices (fused: one pass per row, no temporaries); scalar math and the
//! rotary tables and rotation come from r3-model, so both engines compute them one way.

use r3_model::layers::attention::rope::Rope as ModelRope;
use r3_model::layers::attention::rope_op::rotate_row;
use r3_model::RopeConfig;
use rayon::prelude::*;

/// In-place RMSNorm of every `dim`-wide row: `x · w / sqrt(mean(x²) + eps)`.
pub fn rms_norm_rows(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for row in x.chunks_exact_mut(dim) {
        let ss: f32 = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = w * (*v * inv);
        }
    }
}

/// RMSNorm of `src` rows into `dst` (same shape), blocks of rows side by side (each row's
/// values are the same whichever thread runs it).
pub fn rms_norm_into(src: &[f32], dst: &mut [f32], weight: &[f32], eps: f32) {
    /// Rows a task takes at least: a decode step's few rows stay on one thread.
    const ROWS_PER_TASK: usize = 32;
    assert_eq!(
        src.len(),
        dst.len(),
        "rms norm: source and destination lengths differ"
    );
    let block = weight.len().max(1) * ROWS_PER_TASK;
    dst.par_chunks_mut(block)
        .zip(src.par_chunks(block))
        .for_each(|(dst, src)| {
            dst.copy_from_slice(src);
            rms_norm_rows(dst, weight, eps);
        });
}

/// The cache level [`prefetch_lines`] asks lines into.
#[derive(Debug, Clone, Copy)]
pub(crate) enum CacheLevel {
    /// The core's first-level cache: lines wanted within a few hundred cycles.
    L1,
    /// The second level: a larger set wanted soon (a whole context's rows).
    L2,
}

/// Asks for every cache line of `xs` to be brought into `level`: a hint for reads the
/// hardware prefetcher would not foresee (many short streams side by side); nothing is
/// read or written, so results never change.
#[inline(always)]
pub(crate) fn prefetch_lines<T>(xs: &[T], level: CacheLevel) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        // Every 64-byte line the slice touches, from the one holding its first byte: a
        // plain counted loop (an iterator chain here cost more than the prefetches).
        let base = xs.as_ptr().cast::<i8>();
        let bytes = std::mem::size_of_val(xs);
        let lead = base as usize % 64;
        let lines = (lead + bytes).div_ceil(64) * usize::from(bytes > 0);
        let first = base.wrapping_sub(lead);
        for line in 0..lines {
            let at = first.wrapping_add(64 * line);
            // SAFETY: a prefetch is a hint: it never faults and changes no memory (the
            // address is only computed, never dereferenced), and SSE (which has it) is
            // part of every x86-64 CPU.
            unsafe {
                match level {
                    CacheLevel::L1 => _mm_prefetch::<_MM_HINT_T0>(at),
                    CacheLevel::L2 => _mm_prefetch::<_MM_HINT_T1>(at),
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (xs, level);
}

/// SiLU (x·sigmoid(x)), on the vectorisable `fast_exp`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + fast_exp(-x))
}

/// SwiGLU on fused rows `[gate | up]` of width `2·inter`: writes `silu(gate)·up` rows of
/// width `inter` into `out`.
pub fn swiglu_rows(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    for (gu, o) in gate_up
        .chunks_exact(2 * inter)
        .zip(out.chunks_exact_mut(inter))
    {
        let (g, u) = gu.split_at(inter);
        for ((ov, gv), uv) in o.iter_mut().zip(g).zip(u) {
            *ov = silu(*gv) * uv;
        }
    }
}

/// In-place numerically stable softmax of one row.
pub fn softmax_in_place(row: &mut [f32]) {
    let max = row_max(row);
    // Separate passes: an exp loop without a running sum vectorises.
    for v in row.iter_mut() {
        *v = fast_exp(*v - max);
    }
    let inv = (1.0 / lane_sum(row, |v| v)) as f32;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

pub use r3_model::math::{fast_exp, lane_sum, log_sum_exp, row_max, sigmoid};

/// `log softmax(row)[index]`.
pub fn log_softmax_at(row: &[f32], index: usize) -> f32 {
    row[index] - log_sum_exp(row)
}

/// Rotary tables of r3-model's [`ModelRope`] (frequencies, scaling incl. YaRN and its
/// attention factor) on the host, grown on demand, applied one head vector at a time with
/// r3-model's rotation.
#[derive(Debug, Clone)]
pub struct Rope {
    model: ModelRope,
    cos: Vec<f32>,
    sin: Vec<f32>,
    positions: usize,
}

impl Rope {
    /// The rope of a model config.
    pub fn new(cfg: &RopeConfig) -> Self {
        Rope {
            model: ModelRope::new(cfg),
            cos: Vec::new(),
            sin: Vec::new(),
            positions: 0,
        }
    }

    /// Makes sure the tables cover positions `0..n`.
    pub fn ensure(&mut self, n: usize) {
        if n <= self.positions {
            return;
        }
        let n = n.next_power_of_two().max(64);
        (self.cos, self.sin) = self.model.host_tables(n);
        self.positions = n;
    }

    /// Rotates one head vector `x` (length `rot_dim`) for position `pos` (tables must cover it).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.model.inv_freq().len();
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        rotate_row(x, cos, sin, self.model.interleaved(), false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_by_hand() {
        let mut x = vec![3.0, 4.0];
        rms_norm_rows(&mut x, &[1.0, 2.0], 0.0);
        // mean square = 12.5
        let r = 12.5f32.sqrt();
        assert!((x[0] - 3.0 / r).abs() < 1e-6 && (x[1] - 8.0 / r).abs() < 1e-6);
    }

    #[test]
    fn softmax_and_log_softmax_agree() {
        let mut r = vec![1.0, 2.0, 3.0];
        let lp = log_softmax_at(&r, 2);
        softmax_in_place(&mut r);
        assert!((r.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!((r[2].ln() - lp).abs() < 1e-6);
    }

    #[test]
    fn rope_preserves_norm_and_relative_angle() {
        for inter in [false, true] {
            let mut rope = Rope::new(&RopeConfig {
                theta: 10000.0,
                dim: 4,
                interleaved: inter,
                scaling: r3_model::RopeScaling::None,
            });
            rope.ensure(10);
            let q = [0.3f32, -1.0, 0.5, 2.0];
            let k = [1.0f32, 0.2, -0.7, 0.4];
            let d = |p: usize, s: usize| {
                let (mut a, mut b) = (q, k);
                rope.apply(&mut a, p);
                rope.apply(&mut b, s);
                a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>()
            };
            // q·k depends only on the position difference.
            assert!((d(5, 3) - d(7, 5)).abs() < 1e-5);
            let mut a = q;
            rope.apply(&mut a, 9);
            let n0: f32 = q.iter().map(|v| v * v).sum();
            let n1: f32 = a.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-5);
        }
    }
}
