//! A decode step's rotary embedding and the rounding point after it as one op: `x`
//! `[B, H, T, D]` rotated by per-sequence tables `cos` / `sin` `[B, T, D/2]` (candle's `rope`
//! and `rope_i` arithmetic: half-split or interleaved pairs) and rounded to a mixed
//! precision's 16-bit float in the same pass. Composed, candle's rope kernel and r3's
//! rounding kernel were two launches for each of q and k in every layer of a decode step,
//! whose time at a small batch is its launches. The op has a CPU implementation, which the
//! tests hold to candle's rope and the rounding bit for bit, and a CUDA kernel
//! (`r3_rope_rounded_f32`, the same expressions) that the device tests hold to the CPU.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::device::row_ops_run_on;
use crate::error::Result;
use crate::host::contiguous;
use crate::round16::{round_in_place, rounding_for, rounding_to};

/// `x` rotated by `cos` / `sin` and rounded to `narrow` (bf16 or f16), nothing
/// differentiated; None where the op does not apply (not f32 on the CPU or a GPU, tables not
/// `[B, T, D/2]` for `x` `[B, H, T, D]`, an operand to differentiate, no 16-bit float): the
/// caller composes.
pub(crate) fn rope_rounded(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    interleaved: bool,
    narrow: DType,
) -> Result<Option<Tensor>> {
    let Ok((b, _, t, d)) = x.dims4() else {
        return Ok(None);
    };
    let tables = [b, t, d / 2];
    let applies = row_ops_run_on(x)
        && x.dtype() == DType::F32
        && cos.dtype() == DType::F32
        && sin.dtype() == DType::F32
        && cos.dims() == tables
        && sin.dims() == tables
        && d % 2 == 0
        && !x.track_op()
        && rounding_to(narrow).is_some();
    if !applies {
        return Ok(None);
    }
    Ok(Some(x.contiguous()?.apply_op3_no_bwd(
        &cos.contiguous()?,
        &sin.contiguous()?,
        &RopeRounded {
            interleaved,
            narrow,
        },
    )?))
}

/// The op `(x, cos, sin) → rounded rotation` ([`rope_rounded`]).
#[derive(Debug, Clone, Copy)]
struct RopeRounded {
    interleaved: bool,
    narrow: DType,
}

/// The element indices of pair `i` of a row of width `d`.
fn pair(i: usize, d: usize, interleaved: bool) -> (usize, usize) {
    if interleaved {
        (2 * i, 2 * i + 1)
    } else {
        (i, i + d / 2)
    }
}

impl CustomOp3 for RopeRounded {
    fn name(&self) -> &'static str {
        "r3-rope-rounded"
    }

    /// Rows `(b, h, t)` side by side: candle's expressions, then the rounding.
    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        c: &CpuStorage,
        cl: &Layout,
        s: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(x), CpuStorage::F32(c), CpuStorage::F32(s)) = (x, c, s) else {
            candle_core::bail!("rope rounded: x, cos and sin must be f32");
        };
        let (x, cos, sin) = (
            contiguous(x, xl, "rope input")?,
            contiguous(c, cl, "rope cos")?,
            contiguous(s, sl, "rope sin")?,
        );
        let (_, h, t, d) = xl.shape().dims4()?;
        let half = d / 2;
        let round = rounding_for(self.narrow, "rope rounded")?;
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(d)
            .zip(x.par_chunks(d))
            .enumerate()
            .for_each(|(row, (dst, src))| {
                // Row `row` is (b, h, t): its tables' row is (b, t).
                let (bi, ti) = (row / (h * t), row % t);
                let table = (bi * t + ti) * half;
                for i in 0..half {
                    let (i1, i2) = pair(i, d, self.interleaved);
                    let (c, s) = (cos[table + i], sin[table + i]);
                    dst[i1] = src[i1] * c - src[i2] * s;
                    dst[i2] = src[i1] * s + src[i2] * c;
                }
            });
        round_in_place(&mut out, round);
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }

    /// A thread per pair (`r3_rope_rounded_f32`).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        c: &candle_core::CudaStorage,
        cl: &Layout,
        s: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let (_, h, t, d) = xl.shape().dims4()?;
        let n = xl.shape().elem_count();
        // Every pair's two elements are written.
        let out = cuda::launch_f32!(
            cuda::device(x),
            "r3_rope_rounded_f32",
            n,
            cuda::elementwise(n / 2),
            [
                cuda::view::<f32>(x, xl, "rope input")?,
                cuda::view::<f32>(c, cl, "rope cos")?,
                cuda::view::<f32>(s, sl, "rope sin")?
            ],
            [
                (n / 2) as u64,
                h as u32,
                t as u32,
                d as u32,
                u32::from(self.interleaved),
                cuda::round_code(Some(self.narrow))?
            ]
        );
        Ok((out, xl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::Precision;
    use crate::test_util::{f32_bits, seeded_tensor};

    /// Half-split and interleaved pairs, bf16 and f16, a prefill of several positions and a
    /// decode step of one: bit for bit candle's `rope` / `rope_i` then `Precision::round`;
    /// the op does not apply to a differentiated input or 2-D tables.
    #[test]
    fn equals_candles_rope_then_the_rounding() {
        for (b, h, t, d) in [(2, 3, 5, 8), (3, 4, 1, 16)] {
            let x = (seeded_tensor(&[b, h, t, d], 1, DType::F32) * 3.0).expect("x");
            let cos = seeded_tensor(&[b, t, d / 2], 2, DType::F32);
            let sin = seeded_tensor(&[b, t, d / 2], 3, DType::F32);
            for interleaved in [false, true] {
                let rotated = if interleaved {
                    candle_nn::rotary_emb::rope_i(&x, &cos, &sin)
                } else {
                    candle_nn::rotary_emb::rope(&x, &cos, &sin)
                }
                .expect("candle rope");
                for p in [
                    Precision::Bf16 { router_f32: false },
                    Precision::F16 { router_f32: false },
                ] {
                    let narrow = p.narrow_dtype().expect("16-bit");
                    let got = rope_rounded(&x, &cos, &sin, interleaved, narrow)
                        .expect("op")
                        .expect("applies on the CPU");
                    let want = p.round(&rotated).expect("rounded");
                    assert_eq!(
                        f32_bits(&got),
                        f32_bits(&want),
                        "{:?} interleaved {interleaved} {p:?}",
                        (b, h, t, d)
                    );
                }
            }
        }
        let x = seeded_tensor(&[1, 2, 3, 4], 1, DType::F32);
        let flat = seeded_tensor(&[3, 2], 2, DType::F32);
        assert!(rope_rounded(&x, &flat, &flat, false, DType::BF16)
            .expect("2-D tables")
            .is_none());
        let var = candle_core::Var::from_tensor(&x).expect("var");
        let tables = seeded_tensor(&[1, 3, 2], 2, DType::F32);
        assert!(
            rope_rounded(var.as_tensor(), &tables, &tables, false, DType::BF16)
                .expect("tracked")
                .is_none()
        );
    }
}
