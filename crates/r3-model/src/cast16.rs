//! Casts between f32 and the 16-bit floats (bf16, f16) for the 16-bit GEMMs' operands and
//! outputs: on a GPU one vectorised kernel each way (`r3_narrow_*` / `r3_widen_*`, the same
//! round-to-nearest-even conversions as candle's casts), elsewhere candle's own cast. Values
//! only: the casts are applied to detached tensors inside ops that have their own backward.
//! And [`Widened`]: a value of either width read as f32 inside a pass, with no widened copy.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

/// A float read as f32 as a pass uses it (exact for bf16 and f16: the value a widened copy
/// would hold), so that a pass over 16-bit values needs no widened copy of them.
pub trait Widened: Copy + Send + Sync {
    /// The value as f32.
    fn wide(self) -> f32;
}

impl Widened for f32 {
    #[inline(always)]
    fn wide(self) -> f32 {
        self
    }
}

impl Widened for half::bf16 {
    #[inline(always)]
    fn wide(self) -> f32 {
        self.to_f32()
    }
}

impl Widened for half::f16 {
    #[inline(always)]
    fn wide(self) -> f32 {
        self.to_f32()
    }
}

/// `t` as `dtype`, no gradient: bit for bit `t.to_dtype(dtype)`, in one vectorised kernel on
/// a GPU for a contiguous f32 ↔ bf16 / f16 cast.
pub fn cast16(t: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    if t.dtype() == dtype {
        return Ok(t.clone());
    }
    let sixteen = |d: DType| matches!(d, DType::BF16 | DType::F16);
    let kernel_pair =
        (t.dtype() == DType::F32 && sixteen(dtype)) || (sixteen(t.dtype()) && dtype == DType::F32);
    if t.device().is_cuda() && kernel_pair && t.elem_count() > 0 {
        t.apply_op1_no_bwd(&Cast16 { to: dtype })
    } else {
        t.to_dtype(dtype)
    }
}

/// The cast as an op, so that a GPU runs r3's kernel.
#[derive(Debug, Clone, Copy)]
struct Cast16 {
    to: DType,
}

impl CustomOp1 for Cast16 {
    fn name(&self) -> &'static str {
        "cast-16-bit"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        Ok((storage.to_dtype(layout, self.to)?, layout.shape().clone()))
    }

    /// r3's kernel for a contiguous input whose first element sits on a 4-element boundary
    /// (its 16-byte loads); candle's cast otherwise.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        use candle_core::backend::BackendStorage;
        use half::{bf16, f16};

        let shape = layout.shape().clone();
        let n = shape.elem_count();
        let aligned = layout.is_contiguous() && layout.start_offset().is_multiple_of(4) && n > 0;
        if !aligned {
            return Ok((storage.to_dtype(layout, self.to)?, shape));
        }
        let dev = cuda::device(storage);
        let grid = cuda::elementwise(n.div_ceil(4));
        // One kernel per direction (`r3_narrow_*` / `r3_widen_*`), reading `$in`, writing `$out`.
        macro_rules! cast {
            ($kernel:literal, $in:ty, $out:ty) => {
                cuda::launch_typed!(
                    dev,
                    $kernel,
                    $out,
                    n,
                    grid,
                    [cuda::view::<$in>(storage, layout, "cast input")?],
                    [n as u64]
                )
            };
        }
        let out = match (storage.dtype(), self.to) {
            (DType::F32, DType::BF16) => cast!("r3_narrow_bf16", f32, bf16),
            (DType::F32, DType::F16) => cast!("r3_narrow_f16", f32, f16),
            (DType::BF16, DType::F32) => cast!("r3_widen_bf16", bf16, f32),
            (DType::F16, DType::F32) => cast!("r3_widen_f16", f16, f32),
            _ => storage.to_dtype(layout, self.to)?,
        };
        Ok((out, shape))
    }
}

/// Writes `src` (f32) cast to `dst`'s 16-bit float (bf16 or f16) into `dst`'s own storage,
/// in place: the values of `cast16(src, dst.dtype())`, without a new buffer and a second copy
/// into `dst` (a held weight copy's rewrite after each update: one pass that reads 4 bytes
/// and writes 2 a value). Both contiguous, of one shape; on a GPU r3's cast kernel, whose
/// 16-byte loads want each start on a 4-element boundary (a variable's own storage is).
pub fn cast16_into(src: &Tensor, dst: &Tensor) -> candle_core::Result<()> {
    if src.dtype() != DType::F32
        || !matches!(dst.dtype(), DType::BF16 | DType::F16)
        || src.dims() != dst.dims()
        || !src.is_contiguous()
        || !dst.is_contiguous()
    {
        candle_core::bail!(
            "cast into place: {:?} {:?} into {:?} {:?} (f32 into bf16 / f16 of one shape, both \
             contiguous)",
            src.dtype(),
            src.dims(),
            dst.dtype(),
            dst.dims()
        );
    }
    dst.inplace_op2(src, &CastInto)
}

/// The in-place op behind [`cast16_into`] (the first operand written, the second read).
struct CastInto;

impl candle_core::InplaceOp2 for CastInto {
    fn name(&self) -> &'static str {
        "cast-16-bit-into"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        src: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<()> {
        let CpuStorage::F32(src) = src else {
            candle_core::bail!("cast into place: the source is not f32");
        };
        let src = crate::host::contiguous(src, sl, "cast source")?;
        let Some((start, end)) = dl.contiguous_offsets() else {
            candle_core::bail!("cast into place: the destination is not contiguous");
        };
        if end - start != src.len() {
            candle_core::bail!("cast into place: {} values into {}", src.len(), end - start);
        }
        // half's slice conversions (nearest, ties to even, as candle's casts; vectorised
        // where the CPU has them), chunks side by side on the rayon pool.
        use half::slice::HalfFloatSliceExt;
        use rayon::prelude::*;
        const CHUNK: usize = crate::round16::ELEMS_PER_TASK;
        match dst {
            CpuStorage::BF16(d) => d[start..end]
                .par_chunks_mut(CHUNK)
                .zip(src.par_chunks(CHUNK))
                .for_each(|(d, s)| d.convert_from_f32_slice(s)),
            CpuStorage::F16(d) => d[start..end]
                .par_chunks_mut(CHUNK)
                .zip(src.par_chunks(CHUNK))
                .for_each(|(d, s)| d.convert_from_f32_slice(s)),
            _ => candle_core::bail!("cast into place: the destination is not bf16 or f16"),
        }
        Ok(())
    }

    /// r3's narrowing kernel (`r3_narrow_*`) writing into the destination's slice.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dl: &Layout,
        src: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<()> {
        use crate::cuda;
        use candle_core::backend::BackendStorage;
        use half::{bf16, f16};

        let (Some((start, end)), Some((s0, _))) =
            (dl.contiguous_offsets(), sl.contiguous_offsets())
        else {
            candle_core::bail!("cast into place: operands must be contiguous");
        };
        let n = end - start;
        if n == 0 {
            return Ok(());
        }
        if !(start.is_multiple_of(4) && s0.is_multiple_of(4)) {
            candle_core::bail!(
                "cast into place: offsets {start} and {s0} are not on a 4-element boundary"
            );
        }
        let dev = cuda::device(src);
        let input = cuda::view::<f32>(src, sl, "cast source")?;
        let grid = cuda::elementwise(n.div_ceil(4));
        // The launch holds pointers to its arguments until it returns.
        macro_rules! launch {
            ($kernel:literal, $ty:ty) => {{
                let mut out = dst.as_cuda_slice_mut::<$ty>()?.slice_mut(start..end);
                let (func, stream) = cuda::kernel(&dev, $kernel)?;
                let count = n as u64;
                let mut builder = cuda::CheckedLaunch::new(&stream, &func, $kernel);
                builder.arg(&input);
                builder.arg(&mut out);
                builder.arg(&count);
                // SAFETY: `r3_narrow_*(const float *x, H *y, size_t n)`: `input` and `out`
                // hold `n` values each (contiguous, checked above), aligned as it loads them.
                unsafe { builder.launch(grid) }?;
            }};
        }
        match dst.dtype() {
            DType::BF16 => launch!("r3_narrow_bf16", bf16),
            DType::F16 => launch!("r3_narrow_f16", f16),
            other => candle_core::bail!("cast into place: the destination is {other:?}"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{f32_bits, seeded_tensor};

    /// The bits of a tensor's values widened to f32 (exact from bf16 / f16).
    fn widened_bits(t: &Tensor) -> Vec<u32> {
        f32_bits(&t.to_dtype(DType::F32).expect("widen"))
    }

    /// The CPU form is candle's cast, bit for bit, both ways and for a strided input.
    #[test]
    fn equals_candles_cast_on_the_cpu() {
        let x = seeded_tensor(&[3, 7], 5, DType::F32);
        for narrow in [DType::BF16, DType::F16] {
            let n = cast16(&x, narrow).expect("narrow");
            let want = x.to_dtype(narrow).expect("to_dtype");
            let bits = widened_bits;
            assert_eq!(bits(&n), bits(&want), "{narrow:?}");
            // the op itself (a GPU's path) on the CPU storage
            let op = x.apply_op1_no_bwd(&Cast16 { to: narrow }).expect("op");
            assert_eq!(
                (op.dtype(), bits(&op)),
                (narrow, bits(&want)),
                "{narrow:?} op"
            );
            let back = cast16(&n, DType::F32).expect("widen");
            assert_eq!(bits(&back), bits(&want), "{narrow:?} back");
            let strided = x.t().expect("t");
            assert_eq!(
                bits(&cast16(&strided, narrow).expect("strided")),
                bits(&strided.to_dtype(narrow).expect("to_dtype")),
            );
        }
        assert_eq!(cast16(&x, DType::F32).expect("same").dtype(), DType::F32);
    }

    /// Casting into a tensor's own storage gives the cast's values, visible through another
    /// handle on that storage; a source of another dtype or shape is refused.
    #[test]
    fn casting_into_place_equals_the_cast() {
        let x = seeded_tensor(&[5, 9], 6, DType::F32);
        for narrow in [DType::BF16, DType::F16] {
            let var =
                candle_core::Var::zeros((5, 9), narrow, &candle_core::Device::Cpu).expect("var");
            let view = var.as_tensor().detach();
            cast16_into(&x, var.as_tensor()).expect("cast into");
            let want = x.to_dtype(narrow).expect("cast");
            assert_eq!(widened_bits(&view), widened_bits(&want), "{narrow:?}");
            assert!(cast16_into(&x.t().expect("t"), &view).is_err(), "shape");
            assert!(cast16_into(&want, &view).is_err(), "a 16-bit source");
            assert!(cast16_into(&x, &x).is_err(), "an f32 destination");
        }
    }
}
