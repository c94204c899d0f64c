//! A decode step's attention over a KV cache as one op: for each query row, the scores
//! against the cached keys, the masked softmax and the probability-weighted sum of the
//! values in one pass (`r3_attend_rows_f32`). The composed form is a batched GEMM for the
//! scores, r3's masked softmax and a second batched GEMM: three launches per layer, which at
//! a decode step of a few rows take longer to launch than to run. On a GPU only, for
//! nothing differentiated and keys that fit a block's shared memory; the CPU keeps the
//! composed form. The op's CPU implementation (the kernel's operations per element, each dot
//! product and weighted sum in the same order; the exponentials' sum in column order where
//! the kernel sums in its block's order, and a GPU build may fuse a product into its sum:
//! so within rounding of the kernel) is what the tests hold it to: against the composed
//! attention on the CPU, and the kernel against it on a GPU.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use crate::error::Result;

/// Most keys a block's scores hold in shared memory (with the query: 48 KiB of f32).
pub(crate) const MAX_ROW_KEYS: usize = 8192;

/// Widest query / key / value head the op takes.
const MAX_HEAD_DIM: usize = 512;

/// Most query rows (`B · KV · G · T`) the op takes: a step of a few rows, whose launches are
/// its time. Past it (batches of hundreds) the batched GEMMs, which read each key once for
/// a head's `G` query rows, keep the step.
const MAX_QUERY_ROWS: usize = 1024;

/// `softmax(q kᵀ · scale + mask) · v` for `q` `[B, KV, G·T, Dq]` (rows ordered group, then
/// query time), `k` `[B, KV, S, Dq]` and `v` `[B, KV, S, Dv]` (each head's `S` rows packed:
/// a KV cache's views of longer buffers) and `mask` `[B, 1, 1, T, S]`: `[B, KV, G·T, Dv]`.
/// None where the op does not apply (not a GPU, not f32, an operand to differentiate, more
/// than [`MAX_ROW_KEYS`] keys or `MAX_QUERY_ROWS` query rows, other shapes): the caller
/// composes.
pub(crate) fn attend_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
) -> Result<Option<Tensor>> {
    Ok(match q.device().is_cuda() && fits(q, k, v, mask) {
        true => Some(apply(q, k, v, mask, scale)?),
        false => None,
    })
}

/// The op on any device (the CPU's form is the tests' reference for the kernel).
fn apply(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    Ok(q.contiguous()?.apply_op3_no_bwd(
        k,
        v,
        &AttendRows {
            mask: mask.contiguous()?,
            scale: scale as f32,
        },
    )?)
}

/// Whether the operands fit the op.
fn fits(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> bool {
    let (Ok((b, kv, gt, dq)), Ok((kb, kkv, s, kd)), Ok((vb, vkv, vs, dv))) =
        (q.dims4(), k.dims4(), v.dims4())
    else {
        return false;
    };
    let &[mb, 1, 1, t, ms] = mask.dims() else {
        return false;
    };
    let f32s = [q, k, v, mask].iter().all(|x| x.dtype() == DType::F32);
    let tracked = [q, k, v, mask].iter().any(|x| x.track_op());
    let shapes = (kb, kkv, kd) == (b, kv, dq)
        && (vb, vkv, vs) == (b, kv, s)
        && (mb, ms) == (b, s)
        && t > 0
        && gt % t == 0
        && s > 0
        && s <= MAX_ROW_KEYS
        && dq <= MAX_HEAD_DIM
        && dv <= MAX_HEAD_DIM
        && b * kv * gt > 0
        && b * kv * gt <= MAX_QUERY_ROWS
        && rows_packed(k.layout())
        && rows_packed(v.layout());
    f32s && !tracked && shapes
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

/// The op `(q, k, v) → out`, its mask and scale held.
struct AttendRows {
    mask: Tensor,
    scale: f32,
}

/// One query row's attention: `q` its `Dq` values, `key(j)` / `value(j)` the `j`-th key and
/// value rows, `mask` its `S` additive values; `out` its `Dv` outputs. The kernel's order:
/// each score's dot product over `d` in order, the probabilities `exp(x − max) / Σ` (the
/// kernel's Σ in its block's order), each output the sum over the keys in order.
fn attend_row<'a>(
    q: &[f32],
    key: impl Fn(usize) -> &'a [f32],
    value: impl Fn(usize) -> &'a [f32],
    mask: &[f32],
    scale: f32,
    out: &mut [f32],
) {
    let scores: Vec<f32> = mask
        .iter()
        .enumerate()
        .map(|(j, &m)| {
            let dot = q.iter().zip(key(j)).fold(0f32, |acc, (&a, &b)| acc + a * b);
            dot * scale + m
        })
        .collect();
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let exps: Vec<f32> = scores.iter().map(|&x| (x - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    for (d, o) in out.iter_mut().enumerate() {
        *o = exps
            .iter()
            .enumerate()
            .fold(0f32, |acc, (j, &e)| acc + (e / sum) * value(j)[d]);
    }
}

impl CustomOp3 for AttendRows {
    fn name(&self) -> &'static str {
        "r3-attend-rows"
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
        let (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) = (q, k, v) else {
            candle_core::bail!("attend rows: q, k and v must be f32");
        };
        let q = crate::host::contiguous(q, ql, "attention queries")?;
        let mask = self.mask.flatten_all()?.to_vec1::<f32>()?;
        let (b, kv, gt, dq) = ql.shape().dims4()?;
        let (_, _, s, _) = kl.shape().dims4()?;
        let dv = vl.shape().dims()[3];
        let t = mask.len() / (b * s).max(1);
        let (ks, vs) = (kl.stride(), vl.stride());
        let (k0, v0) = (kl.start_offset(), vl.start_offset());
        let mut out = vec![0f32; b * kv * gt * dv];
        for (r, o) in out.chunks_mut(dv).enumerate() {
            let (bi, hi, row) = (r / (kv * gt), (r / gt) % kv, r % gt);
            let key = |j: usize| {
                let at = k0 + bi * ks[0] + hi * ks[1] + j * dq;
                &k[at..at + dq]
            };
            let value = |j: usize| {
                let at = v0 + bi * vs[0] + hi * vs[1] + j * dv;
                &v[at..at + dv]
            };
            let m = &mask[(bi * t + row % t) * s..][..s];
            attend_row(&q[r * dq..(r + 1) * dq], key, value, m, self.scale, o);
        }
        Ok((CpuStorage::F32(out), Shape::from((b, kv, gt, dv))))
    }

    /// One block per query row (`r3_attend_rows_f32`), its scores in shared memory.
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
        let t = self.mask.dim(3)?;
        let (mask_storage, mask_layout) = self.mask.storage_and_layout();
        let candle_core::Storage::Cuda(mask) = &*mask_storage else {
            candle_core::bail!("attend rows: the mask is not on the GPU");
        };
        let rows = u32::try_from(b * kv * gt)
            .map_err(|_| candle_core::Error::Msg("attend rows: too many query rows".into()))?;
        let config = LaunchConfig {
            grid_dim: (rows, 1, 1),
            block_dim: (crate::launch_shape::ATTEND_ROWS_THREADS, 1, 1),
            shared_mem_bytes: crate::launch_shape::attend_rows_shared_bytes(s, dq) as u32,
        };
        let (ks, vs) = (kl.stride(), vl.stride());
        // Every output row is written by its block.
        let out = cuda::launch_f32!(
            cuda::device(q),
            "r3_attend_rows_f32",
            b * kv * gt * dv,
            config,
            [
                cuda::view::<f32>(q, ql, "attention queries")?,
                rows_view(k, kl, "keys")?,
                rows_view(v, vl, "values")?,
                cuda::view::<f32>(mask, mask_layout, "attention mask")?
            ],
            [
                kv as u32,
                gt as u32,
                t as u32,
                s as u32,
                dq as u32,
                dv as u32,
                ks[0] as u64,
                ks[1] as u64,
                vs[0] as u64,
                vs[1] as u64,
                self.scale
            ]
        );
        Ok((out, Shape::from((b, kv, gt, dv))))
    }
}

/// The device elements a `[B, H, S, D]` layout with packed rows spans, from its first.
#[cfg(feature = "cuda")]
fn rows_view<'a>(
    storage: &'a candle_core::CudaStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>> {
    let (b, h, s, d) = l.shape().dims4()?;
    let st = l.stride();
    if b == 0 || h == 0 || s == 0 || d == 0 || !rows_packed(l) {
        candle_core::bail!("{what}: not [B, H, S, D] with packed rows");
    }
    let extent = (b - 1) * st[0] + (h - 1) * st[1] + (s - 1) * d + d;
    let start = l.start_offset();
    let slice = storage.as_cuda_slice::<f32>()?;
    if start + extent > slice.len() {
        candle_core::bail!("{what}: its layout runs past its storage");
    }
    Ok(slice.slice(start..start + extent))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::attention::{attend_additive, LayerKv};
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::Device;

    /// On the CPU the op equals the composed attention within f32 rounding (1e-6 of values
    /// of order 1) over a KV cache's strided views: GQA with two query heads per key head, a
    /// decode step and a step of three queries, a mask hiding some keys.
    #[test]
    fn equals_the_composed_attention_over_cache_views() {
        let (b, kv, groups, d) = (2, 2, 2, 8);
        for t in [1usize, 3] {
            let mut cache = LayerKv::default();
            let (k, _) = cache
                .append(
                    &seeded_tensor(&[b, kv, 9, d], 1, DType::F32),
                    &seeded_tensor(&[b, kv, 9, d], 2, DType::F32),
                )
                .expect("prefill");
            assert!(k.dims()[2] == 9);
            let (k, v) = cache
                .append(
                    &seeded_tensor(&[b, kv, t, d], 3, DType::F32),
                    &seeded_tensor(&[b, kv, t, d], 4, DType::F32),
                )
                .expect("step");
            assert!(
                !k.is_contiguous() && !v.is_contiguous(),
                "views of a longer buffer"
            );
            let s = k.dim(2).expect("slots");
            let mask: Vec<f32> = (0..b * t * s)
                .map(|i| if i % 7 == 3 { f32::NEG_INFINITY } else { 0.0 })
                .collect();
            let mask = Tensor::from_vec(mask, (b, 1, 1, t, s), &Device::Cpu).expect("mask");
            let q = seeded_tensor(&[b, kv, groups * t, d], 5, DType::F32);
            let want = attend_additive(&q, &k, &v, &mask, 0.3, groups).expect("composed");
            assert!(attend_rows(&q, &k, &v, &mask, 0.3).expect("cpu").is_none());
            let got = apply(&q, &k, &v, &mask, 0.3).expect("op");
            assert_eq!(got.dims(), want.dims());
            let diff = max_abs_diff(&got, &want);
            assert!(diff < 1e-6, "t {t}: {diff}");
        }
    }
}
