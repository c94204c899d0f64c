//! A decode step's attention over a KV cache as one op: for each key/value head's group of
//! query rows, the scores against the cached keys, the masked softmax and the
//! probability-weighted sum of the values in one pass (`r3_attend_group_f32`, and
//! `r3_attend_group_bf16` / `_f16` over a 16-bit cache). The composed form is a batched GEMM for the
//! scores, r3's masked softmax and a second batched GEMM: three launches per layer, which at
//! a decode step take longer to launch than to run, a score tensor of `rows · slots` floats,
//! and f32 keys and values (a 16-bit cache widened first). The kernel reads each key and value
//! once for the group's `G` rows, takes the keys a chunk at a time with an online softmax (no
//! score array grows with the context) and widens 16-bit keys and values as it reads them.
//! A step of few blocks over a long context (a small batch) splits its keys into spans, each
//! span a block of its own whose partial state (weighted sums, max, sum) a second kernel
//! merges (`r3_attend_group_combine_f32`; flash-decoding's split), so the GPU is kept busy
//! where a block per head would stream all of its keys alone. On a GPU only, for nothing
//! differentiated; the CPU keeps the composed form. The op's CPU
//! implementation (`attend_group` and `combine_spans`: the kernels' operations in the
//! kernels' spans and chunks, each dot product and weighted sum in the same order; a chunk's
//! exponentials summed in column order
//! where the kernel sums in its warp's order, and a GPU build may fuse a product into its
//! sum: so within rounding of the kernel) is checked against the composed attention on the
//! CPU, as the kernel is on a GPU and in the emulator (`r3-cuda-emu`).

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use std::ops::Range;

use crate::error::Result;
use crate::launch_shape::{
    attend_group_shared_bytes, attend_group_spans, attend_group_threads, MAX_DYNAMIC_SHARED_BYTES,
};

/// Query rows (`B · KV · G · T`) up to which a step of several positions takes the kernel:
/// its launches are the step's time. Past it a prefill takes the batched GEMMs, which read
/// each key once for all `T` positions where the kernel's block per position reads it `T`
/// times (a prefix hit's few new positions over a long cached prefix), and whose tensor cores
/// do the scores' `T · S` products. A decode step (one position) takes the kernel at any
/// batch.
const MAX_QUERY_ROWS: usize = 1024;

/// `softmax(q kᵀ · scale + mask) · v` for `q` `[B, KV, G·T, Dq]` (f32; rows ordered group,
/// then query time), `k` `[B, KV, S, Dq]` and `v` `[B, KV, S, Dv]` (both f32, bf16 or f16;
/// each head's `S` rows packed: a KV cache's views of longer buffers) and each query row's
/// runs of seen slots `seen` (u32 `[B · T, 4]`: the mask is 0 inside them, −∞ elsewhere;
/// slots past `S` are not read): `[B, KV, G·T, Dv]` in f32. None where the op does not apply (not a GPU,
/// other dtypes, an operand to differentiate, a prefill of many rows, which the composed
/// GEMMs run faster — see [`MAX_QUERY_ROWS`] — a group past a block's shared memory, other
/// shapes): the caller composes.
pub(crate) fn attend_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seen: &Tensor,
    scale: f64,
    groups: usize,
) -> Result<Option<Tensor>> {
    Ok(match q.device().is_cuda() && fits(q, k, v, seen, groups) {
        true => Some(apply(q, k, v, seen, scale, groups)?),
        false => None,
    })
}

/// The op on any device (the CPU's form is the tests' reference for the kernel).
fn apply(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seen: &Tensor,
    scale: f64,
    groups: usize,
) -> Result<Tensor> {
    Ok(q.contiguous()?.apply_op3_no_bwd(
        k,
        v,
        &AttendGroups {
            seen: seen.contiguous()?,
            scale: scale as f32,
            groups,
        },
    )?)
}

/// Whether the operands fit the op.
fn fits(q: &Tensor, k: &Tensor, v: &Tensor, seen: &Tensor, groups: usize) -> bool {
    let (Ok((b, kv, gt, dq)), Ok((kb, kkv, s, kd)), Ok((vb, vkv, vs, dv))) =
        (q.dims4(), k.dims4(), v.dims4())
    else {
        return false;
    };
    let t = gt.checked_div(groups).unwrap_or(0);
    let dtypes = q.dtype() == DType::F32
        && seen.dtype() == DType::U32
        && k.dtype() == v.dtype()
        && matches!(k.dtype(), DType::F32 | DType::BF16 | DType::F16);
    let tracked = [q, k, v].iter().any(|x| x.track_op());
    let blocks = b * kv * t;
    let shapes = (kb, kkv, kd) == (b, kv, dq)
        && (vb, vkv, vs) == (b, kv, s)
        && seen.dims() == [b * t, 4]
        && t > 0
        && dq > 0
        && dv > 0
        && gt == groups * t
        && s > 0
        && blocks > 0
        && blocks <= i32::MAX as usize
        && attend_group_shared_bytes(groups, dq, dv, attend_group_threads(groups, dq, dv))
            <= MAX_DYNAMIC_SHARED_BYTES
        && rows_packed(k.layout())
        && rows_packed(v.layout());
    let faster = t == 1 || b * kv * gt <= MAX_QUERY_ROWS;
    dtypes && !tracked && shapes && faster
}

/// Whether a `[B, H, S, D]` layout is a matmul operand as it is, for candle's CPU and CUDA
/// matmuls and this op alike: unit stride along `D`, each (batch, head)'s `S` rows of `D`
/// packed, and the heads of every batch row evenly spaced — a contiguous tensor, or the
/// first `S` slots of a longer `[B, H, capacity, D]` buffer (`LayerKv`'s views).
pub(crate) fn rows_packed(l: &Layout) -> bool {
    let (&[b, h, _, d], stride) = (l.shape().dims(), l.stride()) else {
        return false;
    };
    stride.len() == 4
        && stride[3] == 1
        && stride[2] == d
        && (b == 1 || h == 1 || stride[0] == stride[1] * h)
}

/// The op `(q, k, v) → out`, its runs of seen slots, scale and query rows a group held.
struct AttendGroups {
    seen: Tensor,
    scale: f32,
    groups: usize,
}

/// One key/value head's group at one query time, over a span of its keys: the running
/// max and sum of each of its `G` rows and their `G · Dv` weighted sums of values (not yet
/// divided by the sums).
struct GroupState {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

/// [`GroupState`] of `q` (the group's `G` rows of `Dq` values) over the keys `keys`,
/// `key(j)` / `value(j)` the `j`-th key and value rows (widened to f32), `runs` the query
/// row's runs of seen slots. The kernel's order: keys from the span's first seen slot to its
/// last, in chunks of `chunk`; each score's dot product over `d` in order (−∞ for a key
/// neither run holds, not read); per row and chunk the running
/// max, the probabilities `exp(x − max)` (none while every score so far is −∞), their sum,
/// the rescaling of the row's sum and weighted sums by `exp(old max − max)`, each weighted sum
/// adding the chunk's values in order of the keys.
#[allow(clippy::too_many_arguments)]
fn attend_group<'a>(
    q: &[f32],
    key: impl Fn(usize) -> &'a [f32],
    value: impl Fn(usize) -> &'a [f32],
    runs: [u32; 4],
    keys: Range<usize>,
    scale: f32,
    chunk: usize,
    dv: usize,
    dq: usize,
) -> GroupState {
    let groups = q.len() / dq.max(1);
    let sees = |j: usize| {
        let j = j as u32;
        (runs[0] <= j && j < runs[1]) || (runs[2] <= j && j < runs[3])
    };
    let bounds = [(runs[0], runs[1]), (runs[2], runs[3])];
    let held = bounds.iter().filter(|(from, to)| from < to);
    let lo = held
        .clone()
        .map(|&(from, _)| from as usize)
        .min()
        .unwrap_or(keys.end);
    let hi = held.map(|&(_, to)| to as usize).max().unwrap_or(0);
    let keys = keys.start.max(lo)..keys.end.min(hi);
    let mut state = GroupState {
        max: vec![f32::NEG_INFINITY; groups],
        sum: vec![0f32; groups],
        acc: vec![0f32; groups * dv],
    };
    for c0 in keys.clone().step_by(chunk.max(1)) {
        let chunk_keys = c0..(c0 + chunk).min(keys.end);
        for (g, qg) in q.chunks(dq).enumerate() {
            let scores: Vec<f32> = chunk_keys
                .clone()
                .map(|j| match sees(j) {
                    true => qg.iter().zip(key(j)).fold(0f32, |a, (&x, &y)| a + x * y) * scale,
                    false => f32::NEG_INFINITY,
                })
                .collect();
            let top = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let now = state.max[g].max(top);
            let none = now == f32::NEG_INFINITY;
            let probs: Vec<f32> = scores
                .iter()
                .map(|&x| if none { 0.0 } else { (x - now).exp() })
                .collect();
            let factor = if none {
                1.0
            } else {
                (state.max[g] - now).exp()
            };
            state.max[g] = now;
            state.sum[g] = state.sum[g] * factor + probs.iter().sum::<f32>();
            for (d, a) in state.acc[g * dv..(g + 1) * dv].iter_mut().enumerate() {
                let chunk_sum = chunk_keys
                    .clone()
                    .zip(&probs)
                    .fold(0f32, |acc, (j, &p)| acc + p * value(j)[d]);
                *a = *a * factor + chunk_sum;
            }
        }
    }
    state
}

/// The group's outputs (`G` rows of `dv`) from its spans' states, in span order: one span's
/// weighted sums over its sums; several merged as `r3_attend_group_combine_f32` merges them —
/// with `M` the spans' largest max and `w_i = exp(M_i − M)` (0 for a span that saw no key),
/// `Σ_i w_i acc_i / Σ_i w_i sum_i`. A row no span saw a key for is 0 / 0 = NaN.
fn combine_spans(states: &[GroupState], dv: usize, out: &mut [f32]) {
    for (g, row) in out.chunks_mut(dv).enumerate() {
        if let [one] = states {
            for (o, &a) in row.iter_mut().zip(&one.acc[g * dv..(g + 1) * dv]) {
                *o = a / one.sum[g];
            }
            continue;
        }
        let top = states
            .iter()
            .fold(f32::NEG_INFINITY, |m, st| m.max(st.max[g]));
        let weights: Vec<f32> = states
            .iter()
            .map(|st| match st.max[g] == f32::NEG_INFINITY {
                true => 0.0,
                false => (st.max[g] - top).exp(),
            })
            .collect();
        let den = states
            .iter()
            .zip(&weights)
            .fold(0f32, |a, (st, &w)| a + w * st.sum[g]);
        for (d, o) in row.iter_mut().enumerate() {
            let num = states
                .iter()
                .zip(&weights)
                .fold(0f32, |a, (st, &w)| a + w * st.acc[g * dv + d]);
            *o = num / den;
        }
    }
}

/// A key or value storage's elements as f32 (16-bit ones widened exactly), for the CPU form.
fn widened(x: &CpuStorage, what: &str) -> candle_core::Result<Vec<f32>> {
    match x {
        CpuStorage::F32(x) => Ok(x.clone()),
        CpuStorage::BF16(x) => Ok(x.iter().map(|v| v.to_f32()).collect()),
        CpuStorage::F16(x) => Ok(x.iter().map(|v| v.to_f32()).collect()),
        _ => candle_core::bail!("attend groups: {what} must be f32, bf16 or f16"),
    }
}

impl CustomOp3 for AttendGroups {
    fn name(&self) -> &'static str {
        "r3-attend-groups"
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
        let CpuStorage::F32(q) = q else {
            candle_core::bail!("attend groups: the queries must be f32");
        };
        let q = crate::host::contiguous(q, ql, "attention queries")?;
        let (k, v) = (widened(k, "the keys")?, widened(v, "the values")?);
        let seen = self.seen.flatten_all()?.to_vec1::<u32>()?;
        let (b, kv, gt, dq) = ql.shape().dims4()?;
        let (_, _, s, _) = kl.shape().dims4()?;
        let dv = vl.shape().dims()[3];
        let groups = self.groups.max(1);
        let t = gt / groups;
        if seen.len() != b * t * 4 {
            candle_core::bail!(
                "attend groups: {} seen-slot bounds for {b} × {t} query rows",
                seen.len()
            );
        }
        let (spans, span) = attend_group_spans(b * kv * t, s);
        let chunk = attend_group_threads(groups, dq, dv) as usize;
        let (ks, vs) = (kl.stride(), vl.stride());
        let (k0, v0) = (kl.start_offset(), vl.start_offset());
        let mut out = vec![0f32; b * kv * gt * dv];
        for bi in 0..b {
            for hi in 0..kv {
                let key = |j: usize| {
                    let at = k0 + bi * ks[0] + hi * ks[1] + j * dq;
                    &k[at..at + dq]
                };
                let value = |j: usize| {
                    let at = v0 + bi * vs[0] + hi * vs[1] + j * dv;
                    &v[at..at + dv]
                };
                let head = (bi * kv + hi) * gt;
                for ti in 0..t {
                    let rows = |g: usize| head + g * t + ti;
                    let qg: Vec<f32> = (0..groups)
                        .flat_map(|g| q[rows(g) * dq..(rows(g) + 1) * dq].iter().copied())
                        .collect();
                    let mut og = vec![0f32; groups * dv];
                    let at = (bi * t + ti) * 4;
                    let runs = [seen[at], seen[at + 1], seen[at + 2], seen[at + 3]];
                    let states: Vec<GroupState> = (0..spans)
                        .map(|i| {
                            let keys = i * span..((i + 1) * span).min(s);
                            let scale = self.scale;
                            attend_group(&qg, key, value, runs, keys, scale, chunk, dv, dq)
                        })
                        .collect();
                    combine_spans(&states, dv, &mut og);
                    for (g, row) in og.chunks(dv).enumerate() {
                        out[rows(g) * dv..(rows(g) + 1) * dv].copy_from_slice(row);
                    }
                }
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((b, kv, gt, dv))))
    }

    /// One block per batch row, key/value head and query time (`r3_attend_group_f32`, or
    /// `_bf16` / `_f16` over 16-bit keys and values).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let (b, kv, gt, dq) = ql.shape().dims4()?;
        let (_, _, s, _) = kl.shape().dims4()?;
        let dv = vl.shape().dims()[3];
        let groups = self.groups.max(1);
        let t = gt / groups;
        let (seen_storage, seen_layout) = self.seen.storage_and_layout();
        let candle_core::Storage::Cuda(seen) = &*seen_storage else {
            candle_core::bail!("attend groups: the seen slots are not on the GPU");
        };
        let (spans, span) = attend_group_spans(b * kv * t, s);
        let too_many = |_| candle_core::Error::Msg("attend groups: too many blocks".into());
        let blocks = u32::try_from(b * kv * t).map_err(too_many)?;
        let threads = attend_group_threads(groups, dq, dv);
        let config = LaunchConfig {
            grid_dim: (blocks, u32::try_from(spans).map_err(too_many)?, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: attend_group_shared_bytes(groups, dq, dv, threads) as u32,
        };
        let (ks, vs) = (kl.stride(), vl.stride());
        let after = [kv, groups, t, s, span, dq, dv].map(|n| n as u32);
        let strides = [ks[0], ks[1], vs[0], vs[1]].map(|n| n as u64);
        let q_view = cuda::view::<f32>(q, ql, "attention queries")?;
        let seen_view = cuda::view::<u32>(seen, seen_layout, "seen slots")?;
        let outputs = b * kv * gt * dv;
        // One span: the outputs; more: each block's and span's partial state.
        let written = match spans {
            1 => outputs,
            _ => b * kv * t * spans * groups * (dv + 2),
        };
        macro_rules! launch {
            ($name:expr, $ty:ty) => {
                cuda::launch_f32!(
                    cuda::device(q),
                    $name,
                    written,
                    config,
                    [
                        q_view,
                        rows_view::<$ty>(k, kl, "keys")?,
                        rows_view::<$ty>(v, vl, "values")?,
                        seen_view
                    ],
                    [
                        after[0], after[1], after[2], after[3], after[4], after[5], after[6],
                        strides[0], strides[1], strides[2], strides[3], self.scale
                    ]
                )
            };
        }
        // Every output (or every span's state) is written by its block.
        let out = match candle_core::backend::BackendStorage::dtype(k) {
            DType::BF16 => launch!("r3_attend_group_bf16", half::bf16),
            DType::F16 => launch!("r3_attend_group_f16", half::f16),
            _ => launch!("r3_attend_group_f32", f32),
        };
        if spans == 1 {
            return Ok((out, Shape::from((b, kv, gt, dv))));
        }
        let combine = LaunchConfig {
            grid_dim: (crate::launch_shape::elementwise_blocks(outputs), 1, 1),
            block_dim: (crate::launch_shape::ELEMENTWISE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // Every output is written by the grid-stride loop.
        let merged = cuda::launch_f32!(
            cuda::device(q),
            "r3_attend_group_combine_f32",
            outputs,
            combine,
            [cuda::view::<f32>(
                &out,
                &Layout::contiguous(written),
                "span states"
            )?],
            [blocks, groups as u32, t as u32, spans as u32, dv as u32]
        );
        Ok((merged, Shape::from((b, kv, gt, dv))))
    }
}

/// The device elements a `[B, H, S, D]` layout with packed rows spans, from its first.
#[cfg(feature = "cuda")]
fn rows_view<'a, T>(
    storage: &'a candle_core::CudaStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>>
where
    T: candle_core::cuda_backend::CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
{
    let (b, h, s, d) = l.shape().dims4()?;
    let st = l.stride();
    if b == 0 || h == 0 || s == 0 || d == 0 || !rows_packed(l) {
        candle_core::bail!("{what}: not [B, H, S, D] with packed rows");
    }
    let extent = (b - 1) * st[0] + (h - 1) * st[1] + (s - 1) * d + d;
    let start = l.start_offset();
    let slice = storage.as_cuda_slice::<T>()?;
    if start + extent > slice.len() {
        candle_core::bail!("{what}: its layout runs past its storage");
    }
    Ok(slice.slice(start..start + extent))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::attention::{attend_additive, LayerKv};
    use crate::model::step_mask::{SeenSlots, StepMask};
    use crate::test_util::seeded_tensor;
    use candle_core::Device;

    /// On the CPU the op equals the composed attention within f32 rounding (1e-6 of values
    /// of order 1) over a KV cache's strided views, f32, bf16 and f16: GQA with three query
    /// heads per key head, a decode step and a step of three queries over 300 slots (one
    /// span, three of the kernel's chunks) and over 1,500 (three spans of 500 merged), each
    /// query row's two runs of seen slots against the additive mask `StepMask` builds from
    /// them (batch row 0's runs apart by more than a span: over 1,500 slots its second span
    /// starts in the gap, so its first chunks have no probabilities; batch row 1 left-padded
    /// past half its slots, whose first span holds nothing to read), and one query row that
    /// sees no key at all (NaN, as the composed softmax gives).
    #[test]
    fn equals_the_composed_attention_over_cache_views() {
        let (b, kv, groups, d) = (2, 2, 3, 8);
        for (held, dtype, t) in [297, 1497]
            .into_iter()
            .flat_map(|h| [DType::F32, DType::BF16, DType::F16].map(|d| (h, d)))
            .flat_map(|(h, d)| [1usize, 3].map(|t| (h, d, t)))
        {
            let mut cache = LayerKv::default();
            // `slots` slots of keys and values in `dtype`.
            let part = |slots, seed| {
                seeded_tensor(&[b, kv, slots, d], seed, DType::F32)
                    .to_dtype(dtype)
                    .expect("part")
            };
            let (k, _) = cache
                .append(&part(held, 1), &part(held, 2))
                .expect("prefill");
            assert!(k.dims()[2] == held);
            let (k, v) = cache.append(&part(t, 3), &part(t, 4)).expect("step");
            assert!(
                !k.is_contiguous() && !v.is_contiguous(),
                "views of a longer buffer"
            );
            let s = k.dim(2).expect("slots");
            assert_eq!(
                attend_group_spans(b * kv * t, s).0,
                1 + 2 * (s > 1000) as usize
            );
            let runs: Vec<SeenSlots> = (0..b * t)
                .map(|row| {
                    let (bi, ti) = (row / t, row % t);
                    let end = s - t + ti + 1;
                    match (bi, ti) {
                        (0, _) => SeenSlots::runs(0..s / 15, 3 * s / 5..end),
                        (_, 0) if t == 3 => SeenSlots::run(0..0),
                        _ => SeenSlots::run(s / 2..end),
                    }
                })
                .collect();
            let dense: Vec<f32> = runs
                .iter()
                .flat_map(|r| {
                    (0..s).map(|j| match r.sees(j) {
                        true => 0.0,
                        false => f32::NEG_INFINITY,
                    })
                })
                .collect();
            let mask = StepMask::Additive(&dense)
                .additive((b, t, s), &Device::Cpu, DType::F32)
                .expect("mask");
            let bounds: Vec<u32> = runs.iter().flat_map(SeenSlots::bounds).collect();
            let seen = Tensor::from_vec(bounds, (b * t, 4), &Device::Cpu).expect("runs");
            let q = seeded_tensor(&[b, kv, groups * t, d], 5, DType::F32);
            let wide = |x: &Tensor| x.to_dtype(DType::F32).expect("widened");
            let want =
                attend_additive(&q, &wide(&k), &wide(&v), &mask, 0.3, groups).expect("composed");
            assert!(attend_rows(&q, &k, &v, &seen, 0.3, groups)
                .expect("cpu")
                .is_none());
            let got = apply(&q, &k, &v, &seen, 0.3, groups).expect("op");
            assert_eq!(got.dims(), want.dims());
            let (got, want) = (
                got.flatten_all()
                    .and_then(|x| x.to_vec1::<f32>())
                    .expect("got"),
                want.flatten_all()
                    .and_then(|x| x.to_vec1::<f32>())
                    .expect("want"),
            );
            let nan = got
                .iter()
                .zip(&want)
                .filter(|(g, w)| g.is_nan() && w.is_nan());
            // t = 3: batch row 1's first query row of each of the 2 heads' 3 groups.
            assert_eq!(nan.count(), if t == 3 { kv * groups * d } else { 0 });
            let diff = got
                .iter()
                .zip(&want)
                .filter(|(w, _)| !w.is_nan())
                .map(|(g, w)| (g - w).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-6, "{dtype:?} t {t}: {diff}");
        }
    }

    /// The online softmax in any chunk and over any spans equals one softmax over the whole
    /// row: chunks of 1, 4, 7 and more than the row, in one, two and three spans, over a row
    /// of 23 keys that sees keys 2, 3 and 15 on (the second span of three starts in the gap,
    /// its first chunks without probabilities) and whose scores span ±20 (so a later chunk's
    /// or span's max rescales the earlier ones).
    #[test]
    fn any_chunk_and_span_give_the_whole_rows_softmax() {
        let (groups, dq, dv, s) = (2usize, 3usize, 2usize, 23usize);
        let q: Vec<f32> = (0..groups * dq).map(|i| (i as f32 - 2.5) * 0.9).collect();
        let key_rows: Vec<Vec<f32>> = (0..s)
            .map(|j| (0..dq).map(|d| ((j * 3 + d) % 11) as f32 - 5.0).collect())
            .collect();
        let values: Vec<Vec<f32>> = (0..s)
            .map(|j| (0..dv).map(|d| (j + 2 * d) as f32 * 0.25).collect())
            .collect();
        // Keys 2, 3 and 15.. seen: in three spans of 8, the second starts in the gap.
        let runs = [2u32, 4, 15, s as u32];
        let scale = 0.7f32;
        // By hand: f64 softmax weights over the seen keys.
        let want: Vec<f64> = (0..groups)
            .flat_map(|g| {
                let x: Vec<f64> = (0..s)
                    .map(|j| {
                        let dot: f64 = (0..dq)
                            .map(|d| f64::from(q[g * dq + d] * key_rows[j][d]))
                            .sum();
                        match (2..4).contains(&j) || j >= 15 {
                            true => dot * f64::from(scale),
                            false => f64::NEG_INFINITY,
                        }
                    })
                    .collect();
                let top = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = x.iter().map(|x| (x - top).exp()).collect();
                let sum: f64 = e.iter().sum();
                let values = &values;
                (0..dv).map(move |d| (0..s).map(|j| e[j] / sum * f64::from(values[j][d])).sum())
            })
            .collect();
        for (chunk, spans) in [1, 4, 7, 64]
            .into_iter()
            .flat_map(|c| [(c, 1), (c, 2), (c, 3)])
        {
            let span = s.div_ceil(spans);
            let states: Vec<GroupState> = (0..spans)
                .map(|i| {
                    let keys = i * span..((i + 1) * span).min(s);
                    let (key, value) = (|j: usize| &key_rows[j][..], |j: usize| &values[j][..]);
                    attend_group(&q, key, value, runs, keys, scale, chunk, dv, dq)
                })
                .collect();
            let mut out = vec![0f32; groups * dv];
            combine_spans(&states, dv, &mut out);
            for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (f64::from(g) - w).abs() < 1e-5 * w.abs().max(1.0),
                    "chunk {chunk}, {spans} spans, {i}: {g} vs {w}"
                );
            }
        }
    }
}
