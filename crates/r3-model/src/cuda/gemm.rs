//! cuBLAS runs a [`GemmCall`] (`gemm_call.rs`): checked against its operands' lengths
//! first, then one `cublasGemmStridedBatchedEx`, or one `cublasGemmBatchedEx` over pointer
//! arrays. The one place r3's own GEMM calls become cuBLAS's arguments, so the arithmetic
//! of each call site (which operand is A, transposes, leading dimensions, offsets) stays in
//! device-agnostic code the CPU tests run.

use candle_core::cuda_backend::cudarc::cublas::sys;
use candle_core::cuda_backend::cudarc::driver::DevicePtr;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Result};

use crate::gemm_call::{table_array, DeviceTableCall, GemmBatch, GemmCall, GemmShape};

/// One operand of a GEMM call on the device: the address its offsets count from, the
/// elements it holds from there, and its dtype.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GemmOperand {
    /// The device address of element 0.
    pub(crate) addr: u64,
    /// Elements from `addr` the call may read or write.
    pub(crate) len: usize,
    /// f32, bf16 or f16.
    pub(crate) dtype: DType,
}

impl GemmOperand {
    /// The operand's cuBLAS data type.
    fn data_type(&self, what: &str) -> Result<sys::cudaDataType_t> {
        Ok(match self.dtype {
            DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
            DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
            DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
            other => candle_core::bail!("{what}: {other:?} GEMM operands"),
        })
    }
}

/// How a call's GEMMs compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GemmCompute {
    /// Products and sums in f32 (`CUBLAS_COMPUTE_32F`; tensor cores for 16-bit operands).
    F32,
    /// f32 operands converted to bf16 by cuBLAS itself, f32 accumulation
    /// (`CUBLAS_COMPUTE_32F_FAST_16BF`).
    Fast16bf,
}

/// `CUBLAS_OP_T` where stored transposed, else `CUBLAS_OP_N`.
fn op(transposed: bool) -> sys::cublasOperation_t {
    if transposed {
        sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        sys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// The cuBLAS types of one call: its operands' (A and B), its output's, its compute type.
#[derive(Debug, Clone, Copy)]
struct CublasTypes {
    input: sys::cudaDataType_t,
    output: sys::cudaDataType_t,
    compute: sys::cublasComputeType_t,
}

impl CublasTypes {
    /// The types of A, B and C under `compute`, refusing what cuBLAS would not take: A and
    /// B of one dtype, f32 operands for `FAST_16BF`.
    fn of([a, b, c]: &[GemmOperand; 3], compute: GemmCompute, what: &str) -> Result<CublasTypes> {
        if a.dtype != b.dtype {
            candle_core::bail!("{what}: GEMM operands {:?} and {:?}", a.dtype, b.dtype);
        }
        let compute = match compute {
            GemmCompute::F32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            GemmCompute::Fast16bf if a.dtype == DType::F32 => {
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF
            }
            GemmCompute::Fast16bf => {
                candle_core::bail!("{what}: FAST_16BF takes f32 operands, not {:?}", a.dtype)
            }
        };
        Ok(CublasTypes {
            input: a.data_type(what)?,
            output: c.data_type(what)?,
            compute,
        })
    }
}

/// A size cuBLAS takes as an int (the call's check has bounded every one).
fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| candle_core::Error::Msg(format!("{what}: {v} exceeds a 32-bit GEMM size")))
}

/// Runs `call` on `dev`'s cuBLAS handle (candle's, bound to the device's stream) over the
/// operands A, B and C, after [`GemmCall::check_within`] their lengths. The caller holds
/// the operands' stream guards until this returns.
pub(crate) fn run(
    dev: &CudaDevice,
    call: &GemmCall,
    [a, b, c]: [GemmOperand; 3],
    compute: GemmCompute,
    what: &str,
) -> Result<()> {
    call.check_within([a.len, b.len, c.len], what)?;
    let types = CublasTypes::of(&[a, b, c], compute, what)?;
    if call.count() == 0 {
        return Ok(());
    }
    let s = call.shape;
    match &call.batch {
        GemmBatch::Strided { count, strides } => {
            let (alpha, beta) = (1f32, if call.accumulate { 1f32 } else { 0f32 });
            let blas = dev.cublas_handle();
            let long = |v: usize| {
                i64::try_from(v).map_err(|_| {
                    candle_core::Error::Msg(format!("{what}: GEMM stride {v} past 64 bits"))
                })
            };
            // SAFETY: every GEMM lies inside its operand (`check_within` above, against the
            // lengths the caller read from the storages), the handle is candle's, bound to
            // the stream the operands' guards record on.
            unsafe {
                sys::cublasGemmStridedBatchedEx(
                    *blas.handle(),
                    op(s.trans_a),
                    op(s.trans_b),
                    int(s.m, what)?,
                    int(s.n, what)?,
                    int(s.k, what)?,
                    &alpha as *const f32 as *const _,
                    a.addr as *const _,
                    types.input,
                    int(s.lda, what)?,
                    long(strides[0])?,
                    b.addr as *const _,
                    types.input,
                    int(s.ldb, what)?,
                    long(strides[1])?,
                    &beta as *const f32 as *const _,
                    c.addr as *mut _,
                    types.output,
                    int(s.ldc, what)?,
                    long(strides[2])?,
                    int(*count, what)?,
                    types.compute,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
                )
                .result()
                .w()?;
            }
        }
        GemmBatch::Offsets(offsets) => {
            let count = offsets.len();
            let ptrs = call.pointer_table(
                [a.addr, b.addr, c.addr],
                [a, b, c].map(|o| o.dtype.size_in_bytes()),
            );
            let stream = dev.cuda_stream();
            // Freed stream-ordered, after the GEMM that reads it.
            let table = stream.clone_htod(&ptrs).w()?;
            let (table_ptr, _sync) = table.device_ptr(&stream);
            // SAFETY: the pointers are the checked offsets' (`check_within` above) inside
            // their operands; the table holds 3 · count of them.
            unsafe { run_table(dev, &s, count, table_ptr, types, call.accumulate, what) }?;
        }
    }
    Ok(())
}

/// A pointer-array call whose table a kernel has written on the device at `table` (`count`
/// A pointers, then B's, then C's): `call` is checked against the operands' lengths first
/// ([`DeviceTableCall::check_within`]), then one `cublasGemmBatchedEx` of its shape.
///
/// # Safety
/// The table must hold `3 · call.count` pointers, each GEMM's at offsets from the operands'
/// addresses no further than `call.furthest` and its C at its index times `call.c_step`
/// (what the kernel writing it guarantees).
pub(crate) unsafe fn run_device_table(
    dev: &CudaDevice,
    call: &DeviceTableCall,
    operands: [GemmOperand; 3],
    compute: GemmCompute,
    table: u64,
    what: &str,
) -> Result<()> {
    let [a, b, c] = &operands;
    call.check_within([a.len, b.len, c.len], what)?;
    let types = CublasTypes::of(&operands, compute, what)?;
    if call.count == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { run_table(dev, &call.shape, call.count, table, types, false, what) }
}

/// One `cublasGemmBatchedEx` of `count` GEMMs of `shape` whose pointer table lies on the
/// device at `table`: `count` A pointers, then B's, then C's. Overwrites C (or adds into it
/// with `accumulate`).
///
/// # Safety
/// The table must hold `3 · count` pointers, each GEMM's inside its operand, no two C's
/// overlapping.
unsafe fn run_table(
    dev: &CudaDevice,
    shape: &GemmShape,
    count: usize,
    table: u64,
    types: CublasTypes,
    accumulate: bool,
    what: &str,
) -> Result<()> {
    let s = shape;
    let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
    let at = |which: usize| table + (table_array(which, count) * size_of::<u64>()) as u64;
    let blas = dev.cublas_handle();
    // SAFETY: the caller's contract; the handle is candle's, bound to the stream the table
    // and the operands were written on.
    unsafe {
        sys::cublasGemmBatchedEx(
            *blas.handle(),
            op(s.trans_a),
            op(s.trans_b),
            int(s.m, what)?,
            int(s.n, what)?,
            int(s.k, what)?,
            &alpha as *const f32 as *const _,
            at(0) as *const *const _,
            types.input,
            int(s.lda, what)?,
            at(1) as *const *const _,
            types.input,
            int(s.ldb, what)?,
            &beta as *const f32 as *const _,
            at(2) as *const *mut _,
            types.output,
            int(s.ldc, what)?,
            int(count, what)?,
            types.compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
        )
        .result()
        .w()?;
    }
    Ok(())
}
