//! Host views of CPU tensors for the custom ops' kernels: the contiguous slice behind a
//! storage and its layout.

use candle_core::{Layout, Tensor, WithDType};

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
