//! Casts between f32 and the 16-bit floats (bf16, f16) for the 16-bit GEMMs' operands and
//! outputs: on a GPU one vectorised kernel each way (`r3_narrow_*` / `r3_widen_*`, the same
//! round-to-nearest-even conversions as candle's casts), elsewhere candle's own cast. Values
//! only: the casts are applied to detached tensors inside ops that have their own backward.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::seeded_tensor;

    /// The CPU form is candle's cast, bit for bit, both ways and for a strided input.
    #[test]
    fn equals_candles_cast_on_the_cpu() {
        let x = seeded_tensor(&[3, 7], 5, DType::F32);
        for narrow in [DType::BF16, DType::F16] {
            let n = cast16(&x, narrow).expect("narrow");
            let want = x.to_dtype(narrow).expect("to_dtype");
            let bits = |t: &Tensor| {
                t.to_dtype(DType::F32)
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1::<f32>())
                    .expect("values")
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            };
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
}
