//! `a · bᵀ` of f32 operands that hold 16-bit values (a 16-bit forward's rotated queries and
//! keys; its attention values and the output's gradient), as one 16-bit tensor-core GEMM
//! with f32 accumulation and an f32 output on a GPU. A product of two 16-bit floats is
//! exact in f32, so the GEMM computes the f32 GEMM's products and sums them in f32, in
//! cuBLAS's order either way; only the operands' copies (2 bytes a value, cast exactly) are
//! new. candle's f32 GEMM runs on the GPU's SIMT cores: on an H200 the attention's f32 GEMMs
//! took 8.1 ms of a 30B-A3B-shaped bf16 training step's 70.8 ms of kernels (session 40's
//! Nsight Compute table, docs/gpu.md).

use candle_core::{DType, Tensor};

#[cfg(feature = "cuda")]
use crate::cast16::cast16;
use candle_core::Result;

/// `a [.., m, k] · b [.., n, k]ᵀ → [.., m, n]` (f32, the same leading dimensions). With
/// `narrow` (bf16 / f16: the values `a` and `b` hold; the caller's promise) on a GPU, one
/// strided batched 16-bit GEMM writing f32; elsewhere, or without `narrow`, candle's f32
/// matmul (the same products). Not differentiable (the recomputing attention's forward and
/// backward call it on detached tensors).
pub(crate) fn matmul_t_of_narrow_values(
    a: &Tensor,
    b: &Tensor,
    narrow: Option<DType>,
) -> Result<Tensor> {
    if let Some(other) = narrow.filter(|d| !matches!(d, DType::BF16 | DType::F16)) {
        candle_core::bail!("a 16-bit product's operands hold bf16 or f16 values, not {other:?}");
    }
    #[cfg(feature = "cuda")]
    if let Some(narrow) = narrow {
        // An empty product stays with candle's matmul: CUDA allocates no zero-byte buffer.
        let empty = a.elem_count() == 0 || b.elem_count() == 0;
        if a.device().is_cuda() && a.dtype() == DType::F32 && b.dtype() == DType::F32 && !empty {
            let (a, b) = (a.contiguous()?, b.contiguous()?);
            let shape = Batched::of(&a, &b)?;
            let (an, bn) = (cast16(&a, narrow)?, cast16(&b, narrow)?);
            return an.apply_op2_no_bwd(&bn, &shape);
        }
    }
    a.matmul(&b.t()?)
}

/// The batched shape of one call: `batch` products of `[m, k] · [n, k]ᵀ`.
#[cfg(any(test, feature = "cuda"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Batched {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
}

#[cfg(any(test, feature = "cuda"))]
impl Batched {
    /// The shape of `a [.., m, k] · b [.., n, k]ᵀ`, or an error naming what does not fit.
    fn of(a: &Tensor, b: &Tensor) -> Result<Self> {
        let (ad, bd) = (a.dims(), b.dims());
        let fits = ad.len() >= 2
            && ad.len() == bd.len()
            && ad[..ad.len() - 2] == bd[..bd.len() - 2]
            && ad[ad.len() - 1] == bd[bd.len() - 1];
        if !fits {
            candle_core::bail!("a · bᵀ: {ad:?} and {bd:?} are not [.., m, k] and [.., n, k]");
        }
        Ok(Batched {
            batch: ad[..ad.len() - 2].iter().product(),
            m: ad[ad.len() - 2],
            n: bd[bd.len() - 2],
            k: ad[ad.len() - 1],
        })
    }
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp2 for Batched {
    fn name(&self) -> &'static str {
        "matmul-t-narrow-values"
    }

    fn cpu_fwd(
        &self,
        _s1: &candle_core::CpuStorage,
        _l1: &candle_core::Layout,
        _s2: &candle_core::CpuStorage,
        _l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("matmul-t-narrow-values runs on a GPU only (the host multiplies in f32)")
    }

    fn cuda_fwd(
        &self,
        sa: &candle_core::CudaStorage,
        la: &candle_core::Layout,
        sb: &candle_core::CudaStorage,
        lb: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let mut dims = la.dims().to_vec();
        let last = dims.len() - 1;
        dims[last] = self.n;
        let out = cuda::run(self, sa, la, sb, lb)?;
        Ok((out, candle_core::Shape::from(dims)))
    }
}

/// The product on cuBLAS.
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::cublas::sys;
    use candle_core::cuda_backend::cudarc::driver::DevicePtrMut;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, DType, Layout};

    use super::Batched;

    /// `c [batch, m, n] = a [batch, m, k] · b [batch, n, k]ᵀ` into a fresh f32 output, one
    /// strided batched GEMM: row-major `c` is column-major `cᵀ (n × m) = op_T(b) · a`, `b`
    /// and `a` read column-major as `k × n` and `k × m`.
    pub(super) fn run(
        s: &Batched,
        sa: &CudaStorage,
        la: &Layout,
        sb: &CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        if sa.dtype() != sb.dtype() {
            candle_core::bail!(
                "a · bᵀ of 16-bit values: operands {:?} and {:?}",
                sa.dtype(),
                sb.dtype()
            );
        }
        let in_type = match sa.dtype() {
            DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
            DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
            other => candle_core::bail!("a · bᵀ of 16-bit values: {other:?} operands"),
        };
        let dev = sa.device().clone();
        let stream = dev.cuda_stream();
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| {
                candle_core::Error::Msg(format!("a · bᵀ of 16-bit values: {v} past 32 bits"))
            })
        };
        let long = |v: usize| {
            i64::try_from(v).map_err(|_| {
                candle_core::Error::Msg(format!("a · bᵀ of 16-bit values: {v} past 64 bits"))
            })
        };
        let what = "a · bᵀ of 16-bit values";
        let (a0, _read_a) = crate::cuda::gemm_operand(sa, la, &stream, what)?;
        let (b0, _read_b) = crate::cuda::gemm_operand(sb, lb, &stream, what)?;
        // SAFETY: the GEMMs below write every element (beta 0).
        let mut out = unsafe { dev.alloc::<f32>(s.batch * s.m * s.n)? };
        {
            let (c0, _write) = out.device_ptr_mut(&stream);
            let blas = dev.cublas_handle();
            let (alpha, beta) = (1f32, 0f32);
            // SAFETY: the operands hold `batch` contiguous `[m, k]` and `[n, k]` matrices
            // (checked by `Batched::of` and the contiguous layouts), the output `batch`
            // `[m, n]`; the handle is candle's, bound to the stream the guards record on.
            unsafe {
                sys::cublasGemmStridedBatchedEx(
                    *blas.handle(),
                    sys::cublasOperation_t::CUBLAS_OP_T,
                    sys::cublasOperation_t::CUBLAS_OP_N,
                    int(s.n)?,
                    int(s.m)?,
                    int(s.k)?,
                    &alpha as *const f32 as *const _,
                    b0 as *const _,
                    in_type,
                    int(s.k)?,
                    long(s.n * s.k)?,
                    a0 as *const _,
                    in_type,
                    int(s.k)?,
                    long(s.m * s.k)?,
                    &beta as *const f32 as *const _,
                    c0 as *mut _,
                    sys::cudaDataType_t::CUDA_R_32F,
                    int(s.n)?,
                    long(s.m * s.n)?,
                    int(s.batch)?,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
                )
                .result()
                .w()?;
            }
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};

    /// Off a GPU the product is candle's f32 `a · bᵀ` bit for bit, with or without a 16-bit
    /// dtype named; shapes that do not multiply and a dtype that is not 16-bit are errors.
    #[test]
    fn off_a_gpu_it_is_the_f32_product_and_bad_shapes_are_errors() {
        let a = seeded_tensor(&[2, 3, 5, 4], 1, DType::F32);
        let b = seeded_tensor(&[2, 3, 7, 4], 2, DType::F32);
        let want = a.matmul(&b.t().expect("t")).expect("product");
        for narrow in [None, Some(DType::BF16), Some(DType::F16)] {
            let got = matmul_t_of_narrow_values(&a, &b, narrow).expect("product");
            assert_eq!(got.dims(), &[2, 3, 5, 7]);
            assert_eq!(max_abs_diff(&got, &want), 0.0, "{narrow:?}");
        }
        let err = matmul_t_of_narrow_values(&a, &b, Some(DType::F32)).expect_err("f32");
        assert!(err.to_string().contains("bf16 or f16"), "{err}");
        let wrong = seeded_tensor(&[2, 3, 7, 5], 3, DType::F32);
        let err = Batched::of(&a, &wrong).expect_err("k differs");
        assert!(err.to_string().contains("[.., n, k]"), "{err}");
        let shape = Batched::of(&a, &b).expect("shape");
        assert_eq!(
            shape,
            Batched {
                batch: 6,
                m: 5,
                n: 7,
                k: 4
            }
        );
    }
}
