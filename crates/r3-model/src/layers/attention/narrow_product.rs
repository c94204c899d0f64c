//! `a · bᵀ` of f32 operands that hold 16-bit values (a 16-bit forward's rotated queries and
//! keys; its attention values and the output's gradient), as one 16-bit tensor-core GEMM
//! with f32 accumulation and an f32 output on a GPU. A product of two 16-bit floats is
//! exact in f32, so the GEMM computes the f32 GEMM's products and sums them in f32, in
//! cuBLAS's order either way; only the operands' copies (2 bytes a value, cast exactly) are
//! new. candle's f32 GEMM runs on the GPU's SIMT cores: on an H200 the attention's f32 GEMMs
//! took 8.1 ms of a 30B-A3B-shaped bf16 training step's 70.8 ms of kernels (session 40's
//! Nsight Compute table, docs/gpu.md).

use candle_core::{DType, Result, Tensor};

#[cfg(feature = "cuda")]
use crate::cast16::cast16;
#[cfg(any(test, feature = "cuda"))]
use crate::gemm_call::{GemmBatch, GemmCall, GemmShape};

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

#[cfg(any(test, feature = "cuda"))]
impl Batched {
    /// cuBLAS's A and B from the operands `a` and `b`: row-major `c [m, n] = a · bᵀ` is
    /// column-major `cᵀ (n × m) = op_T(b) · a`, so A is `b` and B is `a` (the host test and
    /// the GPU both take them from here).
    fn operands<T>(a: T, b: T) -> [T; 2] {
        [b, a]
    }

    /// The call's GEMMs, column-major, over [`Batched::operands`]: A (`b`) read as `k × n`
    /// and transposed, B (`a`) read as `k × m`; one GEMM per leading index, `[n · k, m · k,
    /// m · n]` elements apart.
    fn call(&self) -> GemmCall {
        let Batched { batch, m, n, k } = *self;
        GemmCall {
            shape: GemmShape {
                trans_a: true,
                trans_b: false,
                m: n,
                n: m,
                k,
                lda: k,
                ldb: k,
                ldc: n,
            },
            batch: GemmBatch::Strided {
                count: batch,
                strides: [n * k, m * k, m * n],
            },
            accumulate: false,
        }
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
    use candle_core::cuda_backend::cudarc::driver::DevicePtrMut;
    use candle_core::{CudaStorage, DType, Layout};

    use super::Batched;
    use crate::cuda::gemm::{self, GemmCompute, GemmOperand};

    /// `c [batch, m, n] = a [batch, m, k] · b [batch, n, k]ᵀ` into a fresh f32 output: the
    /// strided batched GEMM of [`Batched::call`], the 16-bit operands on tensor cores.
    pub(super) fn run(
        s: &Batched,
        sa: &CudaStorage,
        la: &Layout,
        sb: &CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        let what = "a · bᵀ of 16-bit values";
        if !matches!(sa.dtype(), DType::BF16 | DType::F16) {
            candle_core::bail!("{what}: {:?} operands", sa.dtype());
        }
        let dev = sa.device().clone();
        let stream = dev.cuda_stream();
        let (a, _read_a) = crate::cuda::gemm_operand(sa, la, &stream, what)?;
        let (b, _read_b) = crate::cuda::gemm_operand(sb, lb, &stream, what)?;
        let len = s.batch * s.m * s.n;
        // SAFETY: the GEMMs write every element (beta 0; `call`'s outputs tile `len`).
        let mut out = unsafe { dev.alloc::<f32>(len)? };
        {
            let (c0, _write) = out.device_ptr_mut(&stream);
            let c = GemmOperand {
                addr: c0,
                len,
                dtype: DType::F32,
            };
            let [a, b] = Batched::operands(a, b);
            gemm::run(&dev, &s.call(), [a, b, c], GemmCompute::F32, what)?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::Device;

    /// The GEMM call cuBLAS is given (`Batched::call`), run on the host by the plain
    /// column-major GEMM over the operands' elements, is candle's `a · bᵀ` bit for bit
    /// (small integers: every product and sum is exact in f32, so any order gives the same
    /// bits), and it fits the operands' and the output's lengths with nothing to spare. An
    /// operand order, transpose, leading dimension or stride that is not cuBLAS's reading
    /// of these row-major tensors gives another product or leaves the lengths.
    #[test]
    fn the_cublas_call_is_the_product_on_the_host() {
        let ints = |dims: &[usize], seed: usize| {
            let n: usize = dims.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 7 + seed * 13) % 17) as f32 - 8.0)
                .collect();
            Tensor::from_vec(v, dims, &Device::Cpu).expect("tensor")
        };
        let host = |t: &Tensor| {
            t.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("host")
        };
        let cases: [(&[usize], &[usize]); 3] = [
            (&[2, 3, 5, 4], &[2, 3, 7, 4]),
            (&[4, 3, 9], &[4, 2, 9]),
            (&[1, 6], &[3, 6]),
        ];
        for (ad, bd) in cases {
            let (a, b) = (ints(ad, 1), ints(bd, 2));
            let want = a.matmul(&b.t().expect("t")).expect("product");
            let shape = Batched::of(&a, &b).expect("shape");
            let call = shape.call();
            let mut c = vec![f32::NAN; want.elem_count()];
            let [ha, hb] = Batched::operands(host(&a), host(&b));
            call.run_host(&ha, &hb, &mut c, "test")
                .expect("the call fits its operands");
            assert_eq!(c, host(&want), "{ad:?} · {bd:?}ᵀ");
            for short in 0..3 {
                let mut lens = [ha.len(), hb.len(), c.len()];
                lens[short] -= 1;
                call.check_within(lens, "test")
                    .expect_err("an element short of an operand");
            }
        }
    }

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
