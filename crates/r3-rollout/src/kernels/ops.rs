//! Element-wise and row-wise kernels of the inference path: RMSNorm, SwiGLU, softmax, RoPE.
//! All in f32 on plain slices (fused: one pass per row, no temporaries).

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

/// RMSNorm of `src` rows into `dst` (same shape).
pub fn rms_norm_into(src: &[f32], dst: &mut [f32], weight: &[f32], eps: f32) {
    dst.copy_from_slice(src);
    rms_norm_rows(dst, weight, eps);
}

/// SiLU (x·sigmoid(x)), on the vectorisable `fast_exp`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + fast_exp(-x))
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + fast_exp(-x))
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

pub use r3_model::math::{fast_exp, lane_sum, log_sum_exp, row_max};

/// `log softmax(row)[index]`.
pub fn log_softmax_at(row: &[f32], index: usize) -> f32 {
    row[index] - log_sum_exp(row)
}

/// Rotary position embedding tables (cos/sin per position and frequency), grown on demand.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    interleaved: bool,
    cos: Vec<f32>,
    sin: Vec<f32>,
    positions: usize,
}

impl Rope {
    /// Rope over `rot_dim` dims with the given inverse frequencies (`rot_dim / 2` of them).
    /// `interleaved` rotates pairs (2i, 2i+1) instead of (i, i + rot_dim/2).
    pub fn new(inv_freq: Vec<f32>, interleaved: bool) -> Self {
        Rope {
            inv_freq,
            interleaved,
            cos: Vec::new(),
            sin: Vec::new(),
            positions: 0,
        }
    }

    /// HF default inverse frequencies: `1 / theta^(2i/dim)`.
    pub fn default_inv_freq(rot_dim: usize, theta: f64) -> Vec<f32> {
        (0..rot_dim / 2)
            .map(|i| (1.0 / theta.powf((2 * i) as f64 / rot_dim as f64)) as f32)
            .collect()
    }

    /// Makes sure the tables cover positions `0..n`.
    pub fn ensure(&mut self, n: usize) {
        if n <= self.positions {
            return;
        }
        let n = n.next_power_of_two().max(64);
        let half = self.inv_freq.len();
        self.cos = vec![0.0; n * half];
        self.sin = vec![0.0; n * half];
        for p in 0..n {
            for (i, f) in self.inv_freq.iter().enumerate() {
                let a = p as f32 * f;
                self.cos[p * half + i] = a.cos();
                self.sin[p * half + i] = a.sin();
            }
        }
        self.positions = n;
    }

    /// Rotates one head vector `x` (length `rot_dim`) for position `pos` (tables must cover it).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        if self.interleaved {
            for i in 0..half {
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = a * cos[i] - b * sin[i];
                x[2 * i + 1] = b * cos[i] + a * sin[i];
            }
        } else {
            for i in 0..half {
                let (a, b) = (x[i], x[i + half]);
                x[i] = a * cos[i] - b * sin[i];
                x[i + half] = b * cos[i] + a * sin[i];
            }
        }
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
            let mut rope = Rope::new(Rope::default_inv_freq(4, 10000.0), inter);
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
