//! Masked softmax attention `softmax(q kᵀ · scale + mask) v` as one custom op with its own
//! backward (CPU, f32/f64).
//!
//! Composed from candle ops, one attention layer is ~10 autograd nodes over `[B, H, T, T]`
//! score tensors, each with a gradient pass of that size in candle's backward (upstream
//! candle also materialised a zero tensor plus an addition per node). Here the forward keeps the probabilities `P` and the backward computes
//! `dV = Pᵀ dO`, `dS = P ⊙ (dO Vᵀ − rowsum(P ⊙ dO Vᵀ))`, `dQ = dS K · scale` and
//! `dK = dSᵀ Q · scale` per (sequence, key/value head) with GEMMs, in parallel over those.

use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use crate::host::{contiguous, with_host, with_host_strided};
use crate::layers::gemm::{
    assume_init_slice, assume_init_vec, matmul_block, matmul_block_shared, matmul_unfilled,
    unfilled, MatRef, SharedBuf,
};
use crate::math::{lane_dot, lane_sum, row_max, Float};

/// The attention op: `q` `[B, KV, G·T, Dq]` (G query heads per key/value head, stacked) and
/// `k` `[B, KV, T, Dq]` contiguous, `v` `[B, KV, T, Dv]` through its strides (the usual
/// transposed view of the value projection, read without a copy) → `[B, T, KV·G·Dv]`, the
/// heads of each position side by side (head `kv·G + g`), the layout the output projection
/// reads (no transpose and copy after the op; its backward reads the output gradient as it
/// comes and hands `v`'s gradient back in `v`'s own layout).
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
    /// Per sequence, the first query position whose output anyone reads (`[B]`; None: all
    /// of them). The rows before it are skipped: their outputs stay zero and they add
    /// nothing to the gradients, which is exact where nothing reads them, since their
    /// output gradient is then zero. A batch sharing prefixes reads a shared position's
    /// output from the sequence it is computed for only.
    query_from: Option<Arc<Vec<usize>>>,
    /// Softmax probabilities of the forward for the backward: per job (sequence, key/value
    /// head) its query blocks' `[rows, keys]`, one after another.
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
    /// Query heads per sequence (`kv · G`).
    heads: usize,
}

impl Dims {
    /// Query heads per key/value head.
    fn groups(&self) -> usize {
        self.heads / self.kv
    }

    /// Offset in the `[B, T, heads·dv]` output (and its gradient) of job `j`'s query row
    /// `row` (group `row / t`, position `row % t`); rows of one group are `heads·dv` apart.
    fn out_offset(&self, j: usize, row: usize) -> usize {
        let (seq, kvh) = (j / self.kv, j % self.kv);
        let (g, pos) = (row / self.t, row % self.t);
        ((seq * self.t + pos) * self.heads + kvh * self.groups() + g) * self.dv
    }
}

/// Where job `j`'s value rows lie in a `[B, KV, T, Dv]` tensor's storage: rows `row`
/// elements apart from `start + seq · b + head · h` (the last dimension contiguous).
#[derive(Debug, Clone, Copy)]
struct ValueRows {
    start: usize,
    seq: usize,
    head: usize,
    row: usize,
}

impl ValueRows {
    /// The rows of `layout` (`[B, KV, T, Dv]`), checked to lie inside `len` elements.
    fn new(layout: &Layout, len: usize) -> candle_core::Result<Self> {
        let (b, kv, t, dv) = layout.shape().dims4()?;
        let st = layout.stride();
        let rows = ValueRows {
            start: layout.start_offset(),
            seq: st[0],
            head: st[1],
            row: st[2],
        };
        if b * kv * t * dv > 0 {
            let last = rows.start + (b - 1) * st[0] + (kv - 1) * st[1] + (t - 1) * st[2] + dv;
            if st[3] != 1 || last > len {
                candle_core::bail!(
                    "attention: v {:?} (strides {st:?}, offset {}) is not rows of contiguous values inside its {len} elements",
                    layout.shape(),
                    rows.start
                );
            }
        }
        Ok(rows)
    }

    /// Job `j`'s `[T, Dv]` value rows in `v` (`kv` heads per sequence).
    fn job<'v, T>(&self, v: &'v [T], j: usize, kv: usize) -> MatRef<'v, T> {
        MatRef {
            data: &v[self.start + (j / kv) * self.seq + (j % kv) * self.head..],
            row_stride: self.row,
            col_stride: 1,
        }
    }
}

impl MaskedAttention {
    /// The op for one layer's call.
    pub fn new(mask: Arc<Vec<f32>>, key_ends: Arc<Vec<usize>>, scale: f64, groups: usize) -> Self {
        MaskedAttention {
            mask,
            key_ends,
            scale,
            groups,
            query_from: None,
            probs: Mutex::new(None),
        }
    }

    /// This op skipping each sequence's queries before `from[b]` (see `query_from`).
    pub fn reading_queries_from(mut self, from: Option<Arc<Vec<usize>>>) -> Self {
        self.query_from = from;
        self
    }

    fn dims(&self, q: &Shape, k: &Shape, v: &Shape) -> candle_core::Result<Dims> {
        let (b, kv, rows, dq) = q.dims4()?;
        let (b2, kv2, t, dq2) = k.dims4()?;
        let (b3, kv3, t3, dv) = v.dims4()?;
        if b2 != b || b3 != b || kv2 != kv || kv3 != kv || dq2 != dq || t3 != t {
            candle_core::bail!("attention: q {q:?}, k {k:?}, v {v:?} do not fit");
        }
        if let Some(from) = self.query_from.as_ref().filter(|f| f.len() != b) {
            candle_core::bail!(
                "attention: {} first read queries for a batch of {b} sequences",
                from.len()
            );
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
            heads: kv * self.groups,
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

    /// The query blocks of job `j`: per group, runs of [`QUERY_BLOCK`] positions from the
    /// sequence's first read query (`query_from`; position 0 by default), each with
    /// the number of keys its rows can see (one past the last visible key of any of them;
    /// all `T` keys where none is visible, which keeps a fully masked row's arithmetic).
    fn blocks(&self, j: usize, d: Dims) -> Vec<QueryBlock> {
        let seq = j / d.kv;
        let groups = d.rows / d.t;
        let start = self.query_from.as_ref().map_or(0, |f| f[seq].min(d.t));
        let mut out = Vec::with_capacity(groups * (d.t - start).div_ceil(QUERY_BLOCK));
        for i0 in (start..d.t).step_by(QUERY_BLOCK) {
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

    /// Every job's query blocks and the size of its probabilities (`Σ rows · keys`): the
    /// probabilities are kept block by block, each `[rows, keys]` dense, jobs one after
    /// another, so nothing beyond the keys a block sees is stored or zero-filled.
    fn plans(&self, d: Dims) -> Vec<(Vec<QueryBlock>, usize)> {
        (0..d.jobs)
            .map(|j| {
                let blocks = self.blocks(j, d);
                let size = blocks.iter().map(|b| b.rows * b.keys).sum();
                (blocks, size)
            })
            .collect()
    }

    fn fwd_typed<T: Float + WithDType>(
        &self,
        (q, k, v): (&[T], &[T], &[T]),
        v_rows: ValueRows,
        d: Dims,
        wrap: fn(Vec<T>) -> CpuStorage,
    ) -> candle_core::Result<CpuStorage> {
        let plans = self.plans(d);
        let mut probs = unfilled::<T>(plans.iter().map(|(_, size)| size).sum());
        let mut out = vec![T::ZERO; d.jobs * d.rows * d.dv];
        let shared = (SharedBuf(out.as_mut_ptr()), out.len());
        job_regions(&mut probs, &plans)
            .into_par_iter()
            .enumerate()
            .for_each(|(j, region)| {
                let vj = v_rows.job(v, j, d.kv);
                let p = self.job_probs(q, k, j, d, &plans[j].0, region);
                let mut off = 0;
                for blk in &plans[j].0 {
                    let pb = &p[off..off + blk.rows * blk.keys];
                    off += blk.rows * blk.keys;
                    let a = MatRef::row_major(pb, blk.keys);
                    // SAFETY: `out` outlives the loop and is not touched otherwise while it
                    // runs; job `j` alone writes its heads' rows of the output (blocks of
                    // one job never share a row).
                    unsafe {
                        matmul_block_shared(
                            (blk.rows, d.dv, blk.keys),
                            shared,
                            d.out_offset(j, blk.row),
                            d.heads * d.dv,
                            false,
                            a,
                            vj,
                        );
                    }
                }
            });
        // SAFETY: `job_probs` wrote each job's whole region, and the regions tile `probs`.
        let probs = unsafe { assume_init_vec(probs) };
        *self.probs_cache()? = Some(wrap(probs));
        Ok(wrap(out))
    }

    fn probs_cache(&self) -> candle_core::Result<std::sync::MutexGuard<'_, Option<CpuStorage>>> {
        self.probs
            .lock()
            .map_err(|_| candle_core::Error::Msg("attention: probability cache poisoned".into()))
    }

    /// `(dq, dk, dv)` for job `j` from its probabilities and the output gradient `go`
    /// (`[B, T, heads·dv]`), query block by query block over the keys each block sees (`dk`
    /// and the job's rows of `dv` zero on entry, summed over the blocks; `dv` is the shared
    /// `[B, T, KV, dv]` buffer, in which job `j` alone writes its rows).
    #[allow(clippy::too_many_arguments)]
    fn backward_job<T: Float>(
        &self,
        (j, blocks): (usize, &[QueryBlock]),
        (q, k, v): (&[T], &[T], MatRef<'_, T>),
        p: &[T],
        go: &[T],
        (dq, dk, dv): (&mut [T], &mut [T], (SharedBuf<T>, usize)),
        d: Dims,
    ) {
        let scale = T::from_f64(self.scale);
        let row_stride = d.heads * d.dv;
        let dv_at = ((j / d.kv) * d.t * d.kv + j % d.kv) * d.dv;
        let mut ds = Vec::new();
        let mut off = 0;
        for blk in blocks {
            let (n, keys) = (blk.rows, blk.keys);
            let pb = &p[off..off + n * keys];
            off += n * keys;
            let gb = MatRef {
                data: &go[d.out_offset(j, blk.row)..],
                row_stride,
                col_stride: 1,
            };
            // dV += Pᵀ dO
            let a = MatRef {
                data: pb,
                row_stride: 1,
                col_stride: keys,
            };
            // SAFETY: the caller's `dv` buffer outlives the call and job `j` alone writes
            // its rows (`kv · dv` apart from `dv_at`).
            unsafe {
                matmul_block_shared((keys, d.dv, n), dv, dv_at, d.kv * d.dv, true, a, gb);
            }
            // dP = dO Vᵀ, then dS = P ⊙ (dP − rowsum(P ⊙ dP)) · scale, in place.
            ds.clear();
            ds.resize(n * keys, T::ZERO);
            let vt = MatRef {
                data: v.data,
                row_stride: v.col_stride,
                col_stride: v.row_stride,
            };
            matmul_block(n, keys, d.dv, &mut ds, keys, false, gb, vt);
            for (r, dsr) in ds.chunks_exact_mut(keys).enumerate() {
                let pr = &pb[r * keys..(r + 1) * keys];
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
        let dv_shared = (SharedBuf(dv.as_mut_ptr()), dv.len());
        with_host::<T, _>(q, |qv| {
            with_host::<T, _>(k, |kv| {
                with_host_strided::<T, _>(v, |vv, vl| {
                    let v_rows = ValueRows::new(vl, vv.len())?;
                    with_host::<T, _>(grad, |gv| {
                        let plans = self.plans(d);
                        let total: usize = plans.iter().map(|(_, size)| size).sum();
                        let cached = self.probs_cache()?;
                        let recomputed;
                        let probs = match cached.as_ref().map(|c| c.as_slice::<T>()) {
                            Some(p) => p?,
                            None => {
                                recomputed = self.recompute_probs(qv, kv, d, &plans);
                                &recomputed
                            }
                        };
                        if probs.len() != total || gv.len() != d.jobs * d.rows * d.dv {
                            candle_core::bail!(
                                "attention: {} cached probabilities for {total} expected, an output gradient of {} values for {}",
                                probs.len(),
                                gv.len(),
                                d.jobs * d.rows * d.dv
                            );
                        }
                        let mut bases = Vec::with_capacity(plans.len());
                        plans.iter().fold(0, |base, (_, size)| {
                            bases.push(base);
                            base + size
                        });
                        dq.par_chunks_mut(d.rows * d.dq)
                            .zip(dk.par_chunks_mut(d.t * d.dq))
                            .enumerate()
                            .for_each(|(j, (dqj, dkj))| {
                                let qj = &qv[j * d.rows * d.dq..(j + 1) * d.rows * d.dq];
                                let kj = &kv[j * d.t * d.dq..(j + 1) * d.t * d.dq];
                                let vj = v_rows.job(vv, j, d.kv);
                                let (blocks, size) = &plans[j];
                                let pj = &probs[bases[j]..bases[j] + size];
                                let grads = (dqj, dkj, dv_shared);
                                self.backward_job((j, blocks), (qj, kj, vj), pj, gv, grads, d);
                            });
                        Ok(())
                    })
                })
            })
        })?;
        let dev = q.device();
        let (b, kvh, t, dvw) = v.dims4()?;
        Ok((
            Tensor::from_vec(dq, q.shape(), dev)?,
            Tensor::from_vec(dk, k.shape(), dev)?,
            // v's gradient in `[B, T, KV, Dv]` order, v's usual layout, so the transpose
            // that made v hands it back contiguous.
            Tensor::from_vec(dv, (b, t, kvh, dvw), dev)?.transpose(1, 2)?,
        ))
    }

    /// The forward's probabilities again (when the cache is empty, e.g. a second backward),
    /// in the forward's layout.
    fn recompute_probs<T: Float>(
        &self,
        q: &[T],
        k: &[T],
        d: Dims,
        plans: &[(Vec<QueryBlock>, usize)],
    ) -> Vec<T> {
        let mut probs = unfilled::<T>(plans.iter().map(|(_, size)| size).sum());
        job_regions(&mut probs, plans)
            .into_par_iter()
            .enumerate()
            .for_each(|(j, region)| {
                self.job_probs(q, k, j, d, &plans[j].0, region);
            });
        // SAFETY: `job_probs` wrote each job's whole region, and the regions tile `probs`.
        unsafe { assume_init_vec(probs) }
    }

    /// Job `j`'s probabilities `softmax(q kᵀ · scale + mask)`, block after block, each
    /// `[rows, keys]` dense, into `region` (exactly `Σ rows · keys` long), which need not be
    /// initialised: every element is written. Returns the region, written.
    fn job_probs<'r, T: Float>(
        &self,
        q: &[T],
        k: &[T],
        j: usize,
        d: Dims,
        blocks: &[QueryBlock],
        region: &'r mut [MaybeUninit<T>],
    ) -> &'r mut [T] {
        let kj = &k[j * d.t * d.dq..(j + 1) * d.t * d.dq];
        let seq = j / d.kv;
        let mut rest = &mut region[..];
        for blk in blocks {
            let (block, tail) = std::mem::take(&mut rest).split_at_mut(blk.rows * blk.keys);
            rest = tail;
            let from = (j * d.rows + blk.row) * d.dq;
            let qb = &q[from..from + blk.rows * d.dq];
            let (a, b) = (MatRef::row_major(qb, d.dq), MatRef::transposed(kj, d.dq));
            let pb = matmul_unfilled(blk.rows, blk.keys, d.dq, block, a, b, 1);
            for (r, row) in pb.chunks_mut(blk.keys).enumerate() {
                let i = blk.pos + r;
                let mask = &self.mask[(seq * d.t + i) * d.t..][..blk.keys];
                self.softmax_row(row, mask);
            }
        }
        assert!(
            rest.is_empty(),
            "attention: a job's region is longer than its blocks"
        );
        // SAFETY: the blocks tile the region (asserted: nothing is left over) and
        // `matmul_unfilled` wrote each block whole.
        unsafe { assume_init_slice(region) }
    }
}

/// `probs` cut into the jobs' regions, one after another, each its plan's size.
fn job_regions<'p, T>(
    probs: &'p mut [MaybeUninit<T>],
    plans: &[(Vec<QueryBlock>, usize)],
) -> Vec<&'p mut [MaybeUninit<T>]> {
    let mut rest = probs;
    plans
        .iter()
        .map(|(_, size)| {
            let (region, tail) = std::mem::take(&mut rest).split_at_mut(*size);
            rest = tail;
            region
        })
        .collect()
}

/// One past the last visible key of every query row of a `[B, T, T]` additive mask (0 for a
/// row that sees none), `[B, T]`.
pub fn visible_key_ends(mask: &[f32], t: usize) -> Vec<usize> {
    mask.par_chunks_exact(t.max(1))
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
                (contiguous(q, ql, "q")?, contiguous(k, kl, "k")?, v),
                ValueRows::new(vl, v.len())?,
                d,
                CpuStorage::F32,
            )?,
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => self.fwd_typed(
                (contiguous(q, ql, "q")?, contiguous(k, kl, "k")?, v),
                ValueRows::new(vl, v.len())?,
                d,
                CpuStorage::F64,
            )?,
            _ => candle_core::bail!("attention: q, k and v must all be f32 or all f64"),
        };
        let b = ql.shape().dims4()?.0;
        Ok((out, Shape::from((b, d.t, d.heads * d.dv))))
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
    use super::MaskedAttention;
    use crate::layers::attention::{attend, attend_composed, AttentionMask, ScoreTiles};
    use crate::test_util::{max_abs_diff as max_diff, seeded_tensor as rand_tensor};
    use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
    use candle_core::{DType, Device, Var};
    use std::sync::Arc;

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

    /// The op behind a handle the test keeps, to empty its cache between the passes.
    struct Shared(Arc<MaskedAttention>);

    impl CustomOp3 for Shared {
        fn name(&self) -> &'static str {
            self.0.name()
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
            self.0.cpu_fwd(q, ql, k, kl, v, vl)
        }

        fn bwd(
            &self,
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            res: &Tensor,
            grad: &Tensor,
        ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
            self.0.bwd(q, k, v, res, grad)
        }
    }

    /// A backward whose forward left no probabilities (the cache emptied) recomputes them in
    /// the forward's block layout: the gradients equal the cached run's bit for bit.
    #[test]
    fn recomputed_probabilities_give_the_cached_gradients() {
        let dev = Device::Cpu;
        let t = super::QUERY_BLOCK + 7;
        let lengths = [t, 20];
        let (b, kv, groups, dq, dv) = (lengths.len(), 2, 2, 4, 3);
        let mask = AttentionMask::new(&lengths, t, Some(40), &dev).expect("mask");
        let q = Var::from_tensor(&rand_tensor(&[b, kv, groups * t, dq], 5, DType::F32)).unwrap();
        let k = Var::from_tensor(&rand_tensor(&[b, kv, t, dq], 6, DType::F32)).unwrap();
        let v = Var::from_tensor(&rand_tensor(&[b, kv, t, dv], 7, DType::F32)).unwrap();
        let w = rand_tensor(&[b, t, kv * groups * dv], 8, DType::F32);
        let run = |clear: bool| {
            let op = Arc::new(MaskedAttention::new(
                mask.host.clone(),
                mask.key_ends.clone(),
                0.41,
                groups,
            ));
            let out = q
                .as_tensor()
                .apply_op3(k.as_tensor(), v.as_tensor(), Shared(op.clone()))
                .expect("attend");
            if clear {
                *op.probs_cache().expect("cache") = None;
            }
            let grads = (&out * &w)
                .and_then(|l| l.sum_all())
                .and_then(|l| l.backward())
                .expect("backward");
            let flat = |x: &Var| {
                let g = grads.get(x).expect("gradient");
                g.flatten_all()
                    .and_then(|g| g.to_vec1::<f32>())
                    .expect("vec")
            };
            (flat(&q), flat(&k), flat(&v))
        };
        assert_eq!(run(false), run(true));
    }

    /// Queries nobody reads skipped (`reading_queries_from`): the read rows' outputs and
    /// every gradient are the full op's when the skipped rows' output gradient is zero (as
    /// where nothing reads them), and the skipped rows' outputs are zero. Starts inside the
    /// first block, at a block's edge, past it, and none. To rounding: the query blocks
    /// then start at `from`, so a row's block sees another number of (masked) keys, and the
    /// products sum their terms in other groups (measured: 4e-17 in f64).
    #[test]
    fn skipped_queries_change_nothing_that_is_read() {
        let dev = Device::Cpu;
        let t = 2 * super::QUERY_BLOCK + 5;
        let lengths = [t, t - 9, 30];
        let (b, kv, groups, dq, dv) = (lengths.len(), 2, 2, 4, 3);
        let from = vec![7, super::QUERY_BLOCK, super::QUERY_BLOCK + 11];
        let mask = AttentionMask::new(&lengths, t, None, &dev).expect("mask");
        let q = Var::from_tensor(&rand_tensor(&[b, kv, groups * t, dq], 11, DType::F64)).unwrap();
        let k = Var::from_tensor(&rand_tensor(&[b, kv, t, dq], 12, DType::F64)).unwrap();
        let v = Var::from_tensor(&rand_tensor(&[b, kv, t, dv], 13, DType::F64)).unwrap();
        // The output gradient, zero on the rows before each sequence's `from`.
        let w: Vec<f64> = rand_tensor(&[b, t, kv * groups * dv], 14, DType::F64)
            .flatten_all()
            .and_then(|w| w.to_vec1::<f64>())
            .expect("weights")
            .chunks(kv * groups * dv)
            .enumerate()
            .flat_map(|(r, row)| {
                let read = r % t >= from[r / t];
                row.iter().map(move |&x| if read { x } else { 0.0 })
            })
            .collect();
        let w = Tensor::from_vec(w, (b, t, kv * groups * dv), &dev).expect("w");
        let run = |skip: Option<Vec<usize>>| {
            let op = MaskedAttention::new(mask.host.clone(), mask.key_ends.clone(), 0.5, groups)
                .reading_queries_from(skip.map(Arc::new));
            let out = q
                .as_tensor()
                .apply_op3(k.as_tensor(), v.as_tensor(), op)
                .expect("attend");
            let grads = (&out * &w)
                .and_then(|l| l.sum_all())
                .and_then(|l| l.backward())
                .expect("backward");
            let flat = |x: &Tensor| {
                x.flatten_all()
                    .and_then(|x| x.to_vec1::<f64>())
                    .expect("vec")
            };
            let g = |x: &Var| flat(grads.get(x).expect("gradient"));
            (flat(&out), g(&q), g(&k), g(&v))
        };
        let (full, fq, fk, fv) = run(None);
        let (part, pq, pk, pv) = run(Some(from.clone()));
        let close = |what: &str, a: &[f64], p: &[f64]| {
            let d = a
                .iter()
                .zip(p)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(d < 1e-14, "{what}: max diff {d}");
        };
        let width = kv * groups * dv;
        for (r, (a, p)) in full.chunks(width).zip(part.chunks(width)).enumerate() {
            match r % t >= from[r / t] {
                true => close(&format!("row {r} (read)"), a, p),
                false => assert!(p.iter().all(|&x| x == 0.0), "row {r} is skipped"),
            }
        }
        for (what, a, p) in [("dq", &fq, &pq), ("dk", &fk, &pk), ("dv", &fv, &pv)] {
            close(what, a, p);
        }
        let bad = MaskedAttention::new(mask.host.clone(), mask.key_ends.clone(), 0.5, groups)
            .reading_queries_from(Some(Arc::new(vec![0; 2])));
        let err = q
            .as_tensor()
            .apply_op3(k.as_tensor(), v.as_tensor(), bad)
            .expect_err("a start per sequence");
        assert!(err.to_string().contains("2 first read queries"), "{err}");
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

    /// With `v` a contiguous `[B, KV, T, Dv]` and as the transposed view of a `[B, T, KV, Dv]`
    /// (the layout the model passes, read through its strides).
    fn check_against_composed(t: usize, lengths: &[usize]) {
        let dev = Device::Cpu;
        let (b, kv, groups, dq, dv) = (lengths.len(), 2, 3, 5, 4);
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
            for (window, v_token_major) in [(None, false), (Some(3), false), (None, true)] {
                let mask = AttentionMask::new(lengths, t, window, &dev)
                    .and_then(|m| m.to_dtype(dtype))
                    .expect("mask");
                let q = Var::from_tensor(&rand_tensor(&[b, kv, groups * t, dq], 1, dtype)).unwrap();
                let k = Var::from_tensor(&rand_tensor(&[b, kv, t, dq], 2, dtype)).unwrap();
                let v_shape = if v_token_major {
                    [b, t, kv, dv]
                } else {
                    [b, kv, t, dv]
                };
                let v = Var::from_tensor(&rand_tensor(&v_shape, 3, dtype)).unwrap();
                let w = rand_tensor(&[b, t, kv * groups * dv], 4, dtype);
                let run = |fused: bool| {
                    let vt = if v_token_major {
                        v.transpose(1, 2).expect("transpose")
                    } else {
                        v.as_tensor().clone()
                    };
                    let out = match fused {
                        true => attend(
                            &q,
                            &k,
                            &vt,
                            &mask,
                            0.37,
                            groups,
                            Default::default(),
                            ScoreTiles::WHOLE,
                        ),
                        false => attend_composed(&q, &k, &vt, &mask, 0.37, groups),
                    }
                    .expect("attend");
                    let grads = (&out * &w)
                        .and_then(|l| l.sum_all())
                        .and_then(|l| l.backward())
                        .expect("backward");
                    let g = |x: &Var| {
                        let g = grads.get(x).expect("gradient").clone();
                        assert!(g.is_contiguous(), "a variable's gradient is contiguous");
                        g
                    };
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
                    assert!(
                        d < tol,
                        "{dtype:?} window {window:?} v token-major {v_token_major} {what}: max diff {d}"
                    );
                }
            }
        }
    }
}
