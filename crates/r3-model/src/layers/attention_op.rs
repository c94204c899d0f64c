//! Masked softmax attention `softmax(q kᵀ · scale + mask) v` as one custom op with its own
//! backward (CPU, f32/f64).
//!
//! Composed from candle ops, one attention layer is ~10 autograd nodes over `[B, H, T, T]`
//! score tensors, each with a gradient pass of that size in candle's backward (upstream
//! candle also materialised a zero tensor plus an addition per node). Here the forward keeps the probabilities `P` and the backward computes
//! `dV = Pᵀ dO`, `dS = P ⊙ (dO Vᵀ − rowsum(P ⊙ dO Vᵀ))`, `dQ = dS K · scale` and
//! `dK = dSᵀ Q · scale` per (sequence, key/value head) with GEMMs, in parallel over those.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::gemm::{matmul_block, MatRef};
use crate::host::{contiguous, with_host};
use crate::math::{lane_dot, lane_sum, row_max, Float};

/// The attention op: `q` `[B, KV, G·T, Dq]` (G query heads per key/value head, stacked),
/// `k` `[B, KV, T, Dq]`, `v` `[B, KV, T, Dv]` → `[B, KV, G·T, Dv]`.
pub struct MaskedAttention {
    /// Additive mask `[B, T, T]` (0 or −∞), shared by every head.
    pub mask: Arc<Vec<f32>>,
    /// Per query row of the mask (`[B, T]`), one past its last visible key
    /// ([`visible_key_ends`]), shared by every layer of a batch.
    pub key_ends: Arc<Vec<usize>>,
    /// Multiplier of `q·k`.
    pub scale: f64,
    /// Query heads per key/value head.
    pub groups: usize,
    /// Softmax probabilities of the forward, `[B, KV, G·T, T]`, for the backward.
    probs: Mutex<Option<CpuStorage>>,
}

/// Sizes of one call.
#[derive(Debug, Clone, Copy)]
struct Dims {
    /// Sequences × key/value heads (independent jobs).
    jobs: usize,
    /// Query rows per job (G·T).
    rows: usize,
    /// Keys per sequence.
    t: usize,
    /// Query/key width.
    dq: usize,
    /// Value width.
    dv: usize,
    /// Key/value heads per sequence.
    kv: usize,
}

impl MaskedAttention {
    /// The op for one layer's call.
    pub fn new(mask: Arc<Vec<f32>>, key_ends: Arc<Vec<usize>>, scale: f64, groups: usize) -> Self {
        MaskedAttention {
            mask,
            key_ends,
            scale,
            groups,
            probs: Mutex::new(None),
        }
    }

    fn dims(&self, q: &Shape, k: &Shape, v: &Shape) -> candle_core::Result<Dims> {
        let (b, kv, rows, dq) = q.dims4()?;
        let (b2, kv2, t, dq2) = k.dims4()?;
        let (b3, kv3, t3, dv) = v.dims4()?;
        if b2 != b || b3 != b || kv2 != kv || kv3 != kv || dq2 != dq || t3 != t {
            candle_core::bail!("attention: q {q:?}, k {k:?}, v {v:?} do not fit");
        }
        if rows != self.groups * t || self.mask.len() != b * t * t || self.key_ends.len() != b * t {
            candle_core::bail!(
                "attention: {rows} query rows, {} groups, {t} keys, a mask of {} values and {} key ends do not fit",
                self.groups,
                self.mask.len(),
                self.key_ends.len()
            );
        }
        Ok(Dims {
            jobs: b * kv,
            rows,
            t,
            dq,
            dv,
            kv,
        })
    }

    /// Scores → probabilities in place for one query row (its keys up to the block's
    /// last visible one; `mask` the same keys' mask). Masked keys get exactly zero
    /// probability. Each step is its own pass without a branch or a running scalar, so that
    /// it vectorises (a fused loop with a running max and sum ran at scalar speed and was the
    /// layer's costliest part on small models); the sum is taken in lanes and reduced in f64
    /// ([`lane_sum`]).
    fn softmax_row<T: Float>(&self, row: &mut [T], mask: &[f32]) {
        let scale = T::from_f64(self.scale);
        for (x, &m) in row.iter_mut().zip(mask) {
            let scored = *x * scale + T::from_f64(m as f64);
            *x = if m == f32::NEG_INFINITY {
                T::NEG_INFINITY
            } else {
                scored
            };
        }
        let max = row_max(row);
        for x in row.iter_mut() {
            let e = (*x - max).exp();
            *x = if *x == T::NEG_INFINITY { T::ZERO } else { e };
        }
        let inv = T::from_f64(1.0 / lane_sum(row, |x| x));
        row.iter_mut().for_each(|x| *x = *x * inv);
    }

    /// The query blocks of job `j`: per group, runs of [`QUERY_BLOCK`] positions, each with
    /// the number of keys its rows can see (one past the last visible key of any of them;
    /// all `T` keys where none is visible, which keeps a fully masked row's arithmetic).
    fn blocks(&self, j: usize, d: Dims) -> Vec<QueryBlock> {
        let seq = j / d.kv;
        let groups = d.rows / d.t;
        let mut out = Vec::with_capacity(groups * d.t.div_ceil(QUERY_BLOCK));
        for i0 in (0..d.t).step_by(QUERY_BLOCK) {
            let i1 = (i0 + QUERY_BLOCK).min(d.t);
            let keys = self.key_ends[seq * d.t + i0..seq * d.t + i1]
                .iter()
                .copied()
                .max()
                .filter(|&k| k > 0)
                .unwrap_or(d.t);
            for g in 0..groups {
                out.push(QueryBlock {
                    row: g * d.t + i0,
                    pos: i0,
                    rows: i1 - i0,
                    keys,
                });
            }
        }
        out
    }

    fn fwd_typed<T: Float + WithDType>(
        &self,
        (q, k, v): (&[T], &[T], &[T]),
        d: Dims,
        wrap: fn(Vec<T>) -> CpuStorage,
    ) -> candle_core::Result<CpuStorage> {
        let mut probs = vec![T::ZERO; d.jobs * d.rows * d.t];
        let mut out = vec![T::ZERO; d.jobs * d.rows * d.dv];
        probs
            .par_chunks_mut(d.rows * d.t)
            .zip(out.par_chunks_mut(d.rows * d.dv))
            .enumerate()
            .for_each(|(j, (p, o))| {
                let vj = &v[j * d.t * d.dv..(j + 1) * d.t * d.dv];
                for blk in self.blocks(j, d) {
                    self.block_probs(q, k, j, d, blk, p);
                    let a = MatRef::row_major(&p[blk.row * d.t..], d.t);
                    let b = MatRef::row_major(vj, d.dv);
                    let dst = &mut o[blk.row * d.dv..];
                    matmul_block(blk.rows, d.dv, blk.keys, dst, d.dv, false, a, b);
                }
            });
        *self.probs_cache()? = Some(wrap(probs));
        Ok(wrap(out))
    }

    fn probs_cache(&self) -> candle_core::Result<std::sync::MutexGuard<'_, Option<CpuStorage>>> {
        self.probs
            .lock()
            .map_err(|_| candle_core::Error::Msg("attention: probability cache poisoned".into()))
    }

    /// `(dq, dk, dv)` for job `j` from its probabilities and the output gradient, query
    /// block by query block over the keys each block sees (`dk`, `dv` zero on entry, summed
    /// over the blocks).
    #[allow(clippy::too_many_arguments)]
    fn backward_job<T: Float>(
        &self,
        j: usize,
        (q, k, v): (&[T], &[T], &[T]),
        p: &[T],
        go: &[T],
        (dq, dk, dv): (&mut [T], &mut [T], &mut [T]),
        d: Dims,
    ) {
        let scale = T::from_f64(self.scale);
        let mut ds = Vec::new();
        for blk in self.blocks(j, d) {
            let (n, keys) = (blk.rows, blk.keys);
            let pb = &p[blk.row * d.t..];
            let gb = &go[blk.row * d.dv..(blk.row + n) * d.dv];
            // dV += Pᵀ dO
            let a = MatRef {
                data: pb,
                row_stride: 1,
                col_stride: d.t,
            };
            matmul_block(
                keys,
                d.dv,
                n,
                dv,
                d.dv,
                true,
                a,
                MatRef::row_major(gb, d.dv),
            );
            // dP = dO Vᵀ, then dS = P ⊙ (dP − rowsum(P ⊙ dP)) · scale, in place.
            ds.clear();
            ds.resize(n * keys, T::ZERO);
            let (a, b) = (MatRef::row_major(gb, d.dv), MatRef::transposed(v, d.dv));
            matmul_block(n, keys, d.dv, &mut ds, keys, false, a, b);
            for (r, dsr) in ds.chunks_exact_mut(keys).enumerate() {
                let pr = &pb[r * d.t..r * d.t + keys];
                let delta = T::from_f64(lane_dot(dsr, pr));
                for (g, &pv) in dsr.iter_mut().zip(pr) {
                    *g = pv * (*g - delta) * scale;
                }
            }
            // dQ = dS K, dK += dSᵀ Q
            let (a, b) = (MatRef::row_major(&ds, keys), MatRef::row_major(k, d.dq));
            let dqb = &mut dq[blk.row * d.dq..];
            matmul_block(n, d.dq, keys, dqb, d.dq, false, a, b);
            let qb = &q[blk.row * d.dq..(blk.row + n) * d.dq];
            let (a, b) = (MatRef::transposed(&ds, keys), MatRef::row_major(qb, d.dq));
            matmul_block(keys, d.dq, n, dk, d.dq, true, a, b);
        }
    }

    fn bwd_typed<T: Float + WithDType>(
        &self,
        (q, k, v, grad): (&Tensor, &Tensor, &Tensor, &Tensor),
        d: Dims,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let mut dq = vec![T::ZERO; d.jobs * d.rows * d.dq];
        let mut dk = vec![T::ZERO; d.jobs * d.t * d.dq];
        let mut dv = vec![T::ZERO; d.jobs * d.t * d.dv];
        with_host::<T, _>(q, |qv| {
            with_host::<T, _>(k, |kv| {
                with_host::<T, _>(v, |vv| {
                    with_host::<T, _>(grad, |gv| {
                        let cached = self.probs_cache()?;
                        let recomputed;
                        let probs = match cached.as_ref().map(|c| c.as_slice::<T>()) {
                            Some(p) => p?,
                            None => {
                                recomputed = self.recompute_probs(qv, kv, d);
                                &recomputed
                            }
                        };
                        dq.par_chunks_mut(d.rows * d.dq)
                            .zip(dk.par_chunks_mut(d.t * d.dq))
                            .zip(dv.par_chunks_mut(d.t * d.dv))
                            .enumerate()
                            .for_each(|(j, ((dqj, dkj), dvj))| {
                                let qj = &qv[j * d.rows * d.dq..(j + 1) * d.rows * d.dq];
                                let kj = &kv[j * d.t * d.dq..(j + 1) * d.t * d.dq];
                                let vj = &vv[j * d.t * d.dv..(j + 1) * d.t * d.dv];
                                let pj = &probs[j * d.rows * d.t..(j + 1) * d.rows * d.t];
                                let gj = &gv[j * d.rows * d.dv..(j + 1) * d.rows * d.dv];
                                self.backward_job(j, (qj, kj, vj), pj, gj, (dqj, dkj, dvj), d);
                            });
                        Ok(())
                    })
                })
            })
        })?;
        let dev = q.device();
        Ok((
            Tensor::from_vec(dq, q.shape(), dev)?,
            Tensor::from_vec(dk, k.shape(), dev)?,
            Tensor::from_vec(dv, v.shape(), dev)?,
        ))
    }

    /// The forward's probabilities again (when the cache is empty, e.g. a second backward).
    fn recompute_probs<T: Float>(&self, q: &[T], k: &[T], d: Dims) -> Vec<T> {
        let mut probs = vec![T::ZERO; d.jobs * d.rows * d.t];
        probs
            .par_chunks_mut(d.rows * d.t)
            .enumerate()
            .for_each(|(j, p)| {
                for blk in self.blocks(j, d) {
                    self.block_probs(q, k, j, d, blk, p);
                }
            });
        probs
    }

    /// Block `blk` of job `j`'s probabilities `softmax(q kᵀ · scale + mask)` into its rows
    /// of `p` (`[G·T, T]`, zero beyond the keys the block sees, which `p` holds already).
    fn block_probs<T: Float>(
        &self,
        q: &[T],
        k: &[T],
        j: usize,
        d: Dims,
        blk: QueryBlock,
        p: &mut [T],
    ) {
        let qb = &q[(j * d.rows + blk.row) * d.dq..(j * d.rows + blk.row + blk.rows) * d.dq];
        let kj = &k[j * d.t * d.dq..(j + 1) * d.t * d.dq];
        let (a, b) = (MatRef::row_major(qb, d.dq), MatRef::transposed(kj, d.dq));
        let pb = &mut p[blk.row * d.t..];
        matmul_block(blk.rows, blk.keys, d.dq, pb, d.t, false, a, b);
        let seq = j / d.kv;
        for (r, row) in pb.chunks_mut(d.t).take(blk.rows).enumerate() {
            let i = blk.pos + r;
            let mask = &self.mask[(seq * d.t + i) * d.t..][..blk.keys];
            self.softmax_row(&mut row[..blk.keys], mask);
        }
    }
}

/// One past the last visible key of every query row of a `[B, T, T]` additive mask (0 for a
/// row that sees none), `[B, T]`.
pub fn visible_key_ends(mask: &[f32], t: usize) -> Vec<usize> {
    mask.chunks_exact(t.max(1))
        .map(|row| {
            row.iter()
                .rposition(|&m| m != f32::NEG_INFINITY)
                .map_or(0, |last| last + 1)
        })
        .collect()
}

/// Query positions per block: a block computes scores only up to the last key any of its
/// rows sees, so a causal mask costs about half the products of a full one (and padding
/// rows, which see one key, almost none).
const QUERY_BLOCK: usize = 64;

/// One block of a job's query rows.
#[derive(Debug, Clone, Copy)]
struct QueryBlock {
    /// First row in the job's `[G·T]` query rows.
    row: usize,
    /// Query position of that row.
    pos: usize,
    /// Rows in the block (consecutive positions).
    rows: usize,
    /// Keys the block's rows see: `0..keys`.
    keys: usize,
}

impl CustomOp3 for MaskedAttention {
    fn name(&self) -> &'static str {
        "r3-masked-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = self.dims(ql.shape(), kl.shape(), vl.shape())?;
        let out = match (q, k, v) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => self.fwd_typed(
                (
                    contiguous(q, ql, "q")?,
                    contiguous(k, kl, "k")?,
                    contiguous(v, vl, "v")?,
                ),
                d,
                CpuStorage::F32,
            )?,
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => self.fwd_typed(
                (
                    contiguous(q, ql, "q")?,
                    contiguous(k, kl, "k")?,
                    contiguous(v, vl, "v")?,
                ),
                d,
                CpuStorage::F64,
            )?,
            _ => candle_core::bail!("attention: q, k and v must all be f32 or all f64"),
        };
        let (b, kv, rows, _) = ql.shape().dims4()?;
        Ok((out, Shape::from((b, kv, rows, d.dv))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = self.dims(q.shape(), k.shape(), v.shape())?;
        let (dq, dk, dv) = match q.dtype() {
            candle_core::DType::F32 => self.bwd_typed::<f32>((q, k, v, grad), d)?,
            candle_core::DType::F64 => self.bwd_typed::<f64>((q, k, v, grad), d)?,
            dt => candle_core::bail!("attention: no backward for {dt:?}"),
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::attention::{attend, attend_composed, AttentionMask};
    use crate::test_util::{max_abs_diff as max_diff, seeded_tensor as rand_tensor};
    use candle_core::{DType, Device, Var};

    /// Fused op against candle's composed ops: output and the gradients of q, k and v, with
    /// right padding, grouped heads, a window, and query/key width ≠ value width; on one
    /// query block and on three (the last partial, the second sequence's padding starting
    /// inside the second), where each block sees its own number of keys.
    #[test]
    fn fused_attention_matches_composed_ops() {
        check_against_composed(6, &[6, 4]);
        check_against_composed(
            2 * super::QUERY_BLOCK + 9,
            &[2 * super::QUERY_BLOCK + 9, 90],
        );
    }

    /// By hand: real query `i` sees keys up to `i`, a padding query key 0, a fully masked row
    /// none.
    #[test]
    fn key_ends_follow_the_mask() {
        let inf = f32::NEG_INFINITY;
        let mask = [0.0, inf, inf, 0.0, 0.0, inf, inf, inf, inf];
        assert_eq!(super::visible_key_ends(&mask, 3), vec![1, 2, 0]);
        let causal = AttentionMask::new(&[3, 1], 3, None, &Device::Cpu).expect("mask");
        assert_eq!(causal.key_ends.as_slice(), &[1, 2, 3, 1, 1, 1]);
    }

    fn check_against_composed(t: usize, lengths: &[usize]) {
        let dev = Device::Cpu;
        let (b, kv, groups, dq, dv) = (lengths.len(), 2, 3, 5, 4);
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
            for window in [None, Some(3)] {
                let mask = AttentionMask::new(lengths, t, window, &dev)
                    .and_then(|m| m.to_dtype(dtype))
                    .expect("mask");
                let q = Var::from_tensor(&rand_tensor(&[b, kv, groups * t, dq], 1, dtype)).unwrap();
                let k = Var::from_tensor(&rand_tensor(&[b, kv, t, dq], 2, dtype)).unwrap();
                let v = Var::from_tensor(&rand_tensor(&[b, kv, t, dv], 3, dtype)).unwrap();
                let w = rand_tensor(&[b, kv, groups * t, dv], 4, dtype);
                let run = |fused: bool| {
                    let f = if fused { attend } else { attend_composed };
                    let out = f(&q, &k, &v, &mask, 0.37, groups).expect("attend");
                    let grads = (&out * &w)
                        .and_then(|l| l.sum_all())
                        .and_then(|l| l.backward())
                        .expect("backward");
                    let g = |x: &Var| grads.get(x).expect("gradient").clone();
                    (out, g(&q), g(&k), g(&v))
                };
                let (fo, fq, fk, fv) = run(true);
                let (co, cq, ck, cv) = run(false);
                for (what, a, c) in [
                    ("out", &fo, &co),
                    ("dq", &fq, &cq),
                    ("dk", &fk, &ck),
                    ("dv", &fv, &cv),
                ] {
                    let d = max_diff(a, c);
                    assert!(d < tol, "{dtype:?} window {window:?} {what}: max diff {d}");
                }
            }
        }
    }
}
