//! r3's own CUDA kernels (`kernels.cu`, compiled to PTX by the crate's build script with the
//! `cuda` feature) and the plumbing the ops use to launch them on a candle CUDA storage. Each
//! kernel has a CPU twin that the CPU tests check against candle's composed ops; the device
//! tests (`tests/devices.rs`, run on a GPU by `scripts/cuda/check.sh`) check the kernels
//! against the CPU.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DeviceRepr, LaunchArgs,
    LaunchConfig, PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::WrapErr;

use crate::kernel_params::ParamKind;

pub(crate) mod gemm;
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaDevice, CudaStorage, Layout, Result};

/// The kernels' PTX, written by build.rs.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/r3_kernels.ptx"));

/// The name the PTX module is loaded under (once per device, by candle).
const MODULE: &str = "r3_kernels";

/// The code r3's kernels take for an output rounding (`rounded_as` in `kernels.cu`): 0
/// none, 1 bf16, 2 f16 (nearest, ties to even).
pub(crate) fn round_code(round: Option<candle_core::DType>) -> Result<u32> {
    match round {
        None => Ok(0),
        Some(candle_core::DType::BF16) => Ok(1),
        Some(candle_core::DType::F16) => Ok(2),
        Some(dt) => candle_core::bail!("no kernel rounding to {dt:?}"),
    }
}

/// The kernel `name` of r3's module on `dev`, and the stream candle runs `dev`'s work on
/// (the kernel is launched there, ordered with candle's own kernels).
pub(crate) fn kernel(dev: &CudaDevice, name: &str) -> Result<(CudaFunction, Arc<CudaStream>)> {
    let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    Ok((func.into_cuda_function(), dev.cuda_stream()))
}

/// A launch of one of r3's kernels whose arguments are checked against the kernel's
/// parameters in `kernels.cu` (`kernel_params`) before it is queued: an argument missing,
/// one too many or of another kind is an error naming the kernel and the argument, where a
/// GPU would read the arguments at the wrong offsets and compute garbage without a word.
pub(crate) struct CheckedLaunch<'a> {
    name: &'a str,
    args: LaunchArgs<'a>,
    // The kinds pushed so far, without a heap allocation per launch (the most any kernel
    // takes is 26; a launch pushing more is refused).
    kinds: [ParamKind; MAX_KERNEL_ARGS],
    count: usize,
}

/// The most arguments a [`CheckedLaunch`] records.
const MAX_KERNEL_ARGS: usize = 32;

impl<'a> CheckedLaunch<'a> {
    /// A launch of `func` (r3's kernel `name`) on `stream`, no arguments yet.
    pub(crate) fn new(stream: &'a CudaStream, func: &'a CudaFunction, name: &'a str) -> Self {
        Self {
            name,
            args: stream.launch_builder(func),
            kinds: [ParamKind::Pointer; MAX_KERNEL_ARGS],
            count: 0,
        }
    }

    /// Adds the next argument (held by reference until the launch).
    pub(crate) fn arg<A: KernelArg>(&mut self, arg: A) -> &mut Self
    where
        LaunchArgs<'a>: PushKernelArg<A>,
    {
        if let Some(slot) = self.kinds.get_mut(self.count) {
            *slot = A::KIND;
        }
        self.count += 1;
        self.args.arg(arg);
        self
    }

    /// Checks the arguments against the kernel's parameters, then queues the launch.
    ///
    /// # Safety
    /// The buffers must hold what the kernel reads and writes under `cfg` (the check covers
    /// the arguments' number and kinds, not their lengths).
    pub(crate) unsafe fn launch(mut self, cfg: LaunchConfig) -> Result<()> {
        if self.count > MAX_KERNEL_ARGS {
            candle_core::bail!("{} launched with {} arguments", self.name, self.count);
        }
        crate::kernel_params::check_launch_args(self.name, &self.kinds[..self.count])
            .map_err(candle_core::Error::Msg)?;
        // SAFETY: the caller's contract; the arguments are the kernel's kinds (checked).
        unsafe { self.args.launch(cfg) }.w()?;
        Ok(())
    }
}

/// What kind of kernel parameter an argument passed to [`CheckedLaunch::arg`] is.
pub(crate) trait KernelArg {
    /// The parameter kind the argument fills.
    const KIND: ParamKind;
}

impl<T> KernelArg for &CudaSlice<T> {
    const KIND: ParamKind = ParamKind::Pointer;
}
impl<T> KernelArg for &mut CudaSlice<T> {
    const KIND: ParamKind = ParamKind::Pointer;
}
impl<T> KernelArg for &CudaView<'_, T> {
    const KIND: ParamKind = ParamKind::Pointer;
}
impl<T> KernelArg for &mut CudaViewMut<'_, T> {
    const KIND: ParamKind = ParamKind::Pointer;
}
impl KernelArg for &f32 {
    const KIND: ParamKind = ParamKind::F32;
}
impl KernelArg for &f64 {
    const KIND: ParamKind = ParamKind::F64;
}
impl KernelArg for &u32 {
    const KIND: ParamKind = ParamKind::Int32;
}
impl KernelArg for &i32 {
    const KIND: ParamKind = ParamKind::Int32;
}
impl KernelArg for &u64 {
    const KIND: ParamKind = ParamKind::Int64;
}
impl KernelArg for &usize {
    const KIND: ParamKind = ParamKind::Int64;
}
impl KernelArg for &DeviceAddr {
    const KIND: ParamKind = ParamKind::Pointer;
}

/// A device address passed where a kernel declares a pointer (a buffer held elsewhere, or
/// null for none): a pointer to the launch check, 8 bytes to the kernel.
#[derive(Clone, Copy, Debug)]
#[repr(transparent)]
pub(crate) struct DeviceAddr(pub(crate) u64);

// SAFETY: a plain 8-byte value, passed as the kernel's pointer parameter.
unsafe impl DeviceRepr for DeviceAddr {}

/// The first element under `layout` (contiguous) of an f32, bf16 or f16 storage as a GEMM
/// operand (its address, the layout's elements from there, its dtype), and the guard that
/// records the read on `stream` when dropped: held until the cuBLAS calls reading it are
/// queued, so that another stream writing the buffer later waits for them. `what` names the
/// caller in errors.
pub(crate) fn gemm_operand<'a>(
    storage: &'a CudaStorage,
    layout: &Layout,
    stream: &'a CudaStream,
    what: &str,
) -> Result<(gemm::GemmOperand, SyncOnDrop<'a>)> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("{what}: operands must be contiguous")
    };
    let offset = (start * storage.dtype().size_in_bytes()) as u64;
    let (ptr, guard) = match storage.dtype() {
        candle_core::DType::F32 => storage.as_cuda_slice::<f32>()?.device_ptr(stream),
        candle_core::DType::BF16 => storage.as_cuda_slice::<half::bf16>()?.device_ptr(stream),
        candle_core::DType::F16 => storage.as_cuda_slice::<half::f16>()?.device_ptr(stream),
        other => candle_core::bail!("{what}: {other:?} operands"),
    };
    let operand = gemm::GemmOperand {
        addr: ptr + offset,
        len: end - start,
        dtype: storage.dtype(),
    };
    Ok((operand, guard))
}

/// The contiguous elements of a storage of this layout, as a device view.
pub(crate) fn view<'a, T: CudaDType + DeviceRepr>(
    storage: &'a CudaStorage,
    layout: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let slice = storage.as_cuda_slice::<T>()?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(slice.slice(start..end)),
        None => candle_core::bail!("{what} must be contiguous for r3's CUDA kernel"),
    }
}

/// One block of `threads` (a multiple of 32, at most 1024) per row; at least one row (the
/// ops send empty tensors down candle's own paths: a kernel would read a row that is not
/// there, and CUDA allocates no zero-byte buffer) and at most 2^31 − 1 (a grid's x
/// dimension).
pub(crate) fn per_row(rows: usize, threads: u32) -> Result<LaunchConfig> {
    let rows = u32::try_from(rows)
        .ok()
        .filter(|&r| r > 0 && r <= i32::MAX as u32)
        .ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "{rows} rows for a CUDA grid of one block a row (1 to 2^31 − 1)"
            ))
        })?;
    Ok(LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

pub(crate) use crate::launch_shape::row_threads;

/// A grid-stride launch over `n` elements (`launch_shape::elementwise_blocks`).
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (crate::launch_shape::elementwise_blocks(n), 1, 1),
        block_dim: (crate::launch_shape::ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The device of a storage.
pub(crate) fn device(storage: &CudaStorage) -> CudaDevice {
    storage.device().clone()
}

/// Launches r3's kernel `$name` on `$dev` with `$cfg`: `$len` fresh outputs of type `$ty`,
/// passed after the arguments `[$before]` and before `[$after]` (each argument bound to a
/// local that lives until the launch, as the launcher holds pointers to them); evaluates to
/// the outputs as a CUDA storage. The caller guarantees that the kernel writes every output
/// element and that the arguments are the kernel's signature.
macro_rules! launch_typed {
    ($dev:expr, $name:expr, $ty:ty, $len:expr, $cfg:expr, [$($before:expr),*], [$($after:expr),*]) => {{
        let dev: candle_core::CudaDevice = $dev;
        // SAFETY: every element is written by the kernel (the macro's contract).
        let out = unsafe { dev.alloc::<$ty>($len) }?;
        let name: &str = $name;
        let (func, stream) = $crate::cuda::kernel(&dev, name)?;
        let mut launch = $crate::cuda::CheckedLaunch::new(&stream, &func, name);
        $(
            let arg = $before;
            launch.arg(&arg);
        )*
        launch.arg(&out);
        $(
            let arg = $after;
            launch.arg(&arg);
        )*
        // SAFETY: the arguments are the kernel's signature (the macro's contract; their
        // number and kinds checked by the launch).
        unsafe { launch.launch($cfg) }?;
        candle_core::CudaStorage::wrap_cuda_slice(out, dev)
    }};
}
pub(crate) use launch_typed;

/// [`launch_typed`] with f32 outputs.
macro_rules! launch_f32 {
    ($dev:expr, $name:expr, $len:expr, $cfg:expr, [$($before:expr),*], [$($after:expr),*]) => {
        $crate::cuda::launch_typed!($dev, $name, f32, $len, $cfg, [$($before),*], [$($after),*])
    };
}
pub(crate) use launch_f32;
