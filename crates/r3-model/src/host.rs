//! Host views of CPU tensors for the custom ops' kernels: the contiguous slice behind a
//! storage and its layout, a 16-bit operand's values widened to f32, and a host GEMM's f32
//! output written back in its operands' dtype as cuBLAS writes it.

use candle_core::{CpuStorage, DType, Layout, Tensor, WithDType};

/// The contiguous elements of a storage slice under `layout`; `what` names the operand.
pub(crate) fn contiguous<'a, T>(
    data: &'a [T],
    layout: &Layout,
    what: &str,
) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((from, to)) => Ok(&data[from..to]),
        None => candle_core::bail!("{what} is not contiguous"),
    }
}

/// Runs `f` on the contiguous host elements of a CPU tensor of element type `T` (copying
/// only if the tensor is strided).
pub(crate) fn with_host<T: WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("tensor is not on the CPU");
    };
    f(contiguous(cpu.as_slice::<T>()?, layout, "tensor")?)
}

/// Runs `f` on a CPU tensor's whole storage slice of element type `T` and its layout, with
/// no copy: for kernels that read strided operands through the layout.
pub(crate) fn with_host_strided<T: WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&[T], &Layout) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("tensor is not on the CPU");
    };
    f(cpu.as_slice::<T>()?, layout)
}

/// A host GEMM's f32 output written in `dtype` as cuBLAS writes an output of that type (a
/// 16-bit value rounded once, to nearest, ties to even).
pub(crate) fn host_storage(
    out: Vec<f32>,
    dtype: DType,
    what: &str,
) -> candle_core::Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(out),
        DType::BF16 => CpuStorage::BF16(out.iter().map(|&v| half::bf16::from_f32(v)).collect()),
        DType::F16 => CpuStorage::F16(out.iter().map(|&v| half::f16::from_f32(v)).collect()),
        other => candle_core::bail!("{what}: {other:?} output"),
    })
}

/// The contiguous elements of a host operand as f32 (bf16 and f16 widened, exactly), and
/// its dtype.
pub(crate) fn host_values<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<(std::borrow::Cow<'a, [f32]>, DType)> {
    use std::borrow::Cow;
    Ok(match s {
        CpuStorage::F32(v) => (Cow::Borrowed(contiguous(v, l, what)?), DType::F32),
        CpuStorage::BF16(v) => (
            Cow::Owned(contiguous(v, l, what)?.iter().map(|x| x.to_f32()).collect()),
            DType::BF16,
        ),
        CpuStorage::F16(v) => (
            Cow::Owned(contiguous(v, l, what)?.iter().map(|x| x.to_f32()).collect()),
            DType::F16,
        ),
        _ => candle_core::bail!("a host GEMM takes f32, bf16 or f16 {what}"),
    })
}
