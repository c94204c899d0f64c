//! Where the training engine's tensors live: a device named in a config or on the command
//! line (`cpu`, `cuda`, `cuda:N`) as a value, and opening it into candle's [`Device`].
//!
//! A device is passed by argument like a dtype. Asking for CUDA never falls back to the CPU:
//! a build without candle's CUDA backend, or a machine without a GPU or driver, is an error
//! that says which of the two is missing.

use std::fmt;
use std::str::FromStr;

use candle_core::{Device, DeviceLocation};

/// The project script that builds `r3` with the `cuda` feature (named by the errors).
pub const CUDA_BUILD_SCRIPT: &str = "scripts/cuda/build.sh";

/// A device by name: the CPU or one CUDA GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The host CPU (the reference implementation of every op).
    #[default]
    Cpu,
    /// CUDA GPU number `ordinal` (`cuda` is `cuda:0`).
    Cuda {
        /// The GPU's index among the visible ones.
        ordinal: usize,
    },
}

/// Why a device cannot be named or opened.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The text names no device.
    #[error("device `{text}` is not one of `cpu`, `cuda`, `cuda:N` (N the GPU's index)")]
    Parse {
        /// What was given.
        text: String,
    },
    /// CUDA was asked of a build without candle's CUDA backend.
    #[error(
        "device `{spec}` needs the `cuda` feature, which this build of r3 lacks: build it with \
         {CUDA_BUILD_SCRIPT} (cargo build --features cuda); nothing falls back to the CPU"
    )]
    CudaNotBuilt {
        /// The device asked for.
        spec: DeviceSpec,
    },
    /// The build has CUDA but the GPU or its driver cannot be opened.
    #[error(
        "device `{spec}`: no usable CUDA GPU or driver on this machine ({reason}); nothing \
         falls back to the CPU"
    )]
    CudaUnavailable {
        /// The device asked for.
        spec: DeviceSpec,
        /// candle's (cudarc's) error.
        reason: String,
    },
}

impl DeviceSpec {
    /// True for the CPU.
    pub fn is_cpu(&self) -> bool {
        matches!(self, DeviceSpec::Cpu)
    }

    /// The spec naming an opened device (`cuda:N` for a GPU).
    pub fn of(device: &Device) -> Self {
        match device.location() {
            DeviceLocation::Cuda { gpu_id } => DeviceSpec::Cuda { ordinal: gpu_id },
            // Metal is not built by this project; a CPU build names every device `cpu`.
            _ => DeviceSpec::Cpu,
        }
    }

    /// Opens the device: the CPU always; a GPU only in a build with the `cuda` feature and
    /// on a machine whose driver sees it.
    pub fn open(&self) -> Result<Device, DeviceError> {
        self.open_with(candle_core::utils::cuda_is_available())
    }

    /// [`DeviceSpec::open`] with the build's CUDA support given (so both answers are tested
    /// in any build).
    fn open_with(&self, cuda_built: bool) -> Result<Device, DeviceError> {
        match *self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda { .. } if !cuda_built => {
                Err(DeviceError::CudaNotBuilt { spec: *self })
            }
            DeviceSpec::Cuda { ordinal } => {
                let unavailable = |reason: String| DeviceError::CudaUnavailable {
                    spec: *self,
                    reason,
                };
                let device = Device::new_cuda(ordinal).map_err(|e| unavailable(e.to_string()))?;
                keep_freed_memory(&device).map_err(unavailable)?;
                skip_unused_events(&device);
                Ok(device)
            }
        }
    }
}

/// Makes the GPU's stream-ordered memory pool keep the memory freed into it instead of
/// returning it to the driver. candle allocates every tensor from the device's default pool
/// (`cuMemAllocAsync`), whose release threshold is 0: at each synchronisation — the routing
/// copies router logits to the host a few times per layer — the pool unmapped all freed
/// memory, and the next allocations mapped it again (gigabytes a step on a 5.6 B-parameter
/// model, the GPU waiting meanwhile). With no threshold the pool holds what a step freed for
/// the next step, as PyTorch's caching allocator does; the driver still reclaims it if
/// another allocation of this process needs it. No effect off a GPU.
fn keep_freed_memory(device: &Device) -> Result<(), String> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => {
            use candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute as Attr;
            set_pool_attribute(gpu, Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX)
                .map_err(|e| format!("cannot set its memory pool's release threshold: {e}"))
        }
        _ => Ok(()),
    }
}

/// Stops cudarc from creating the two CUDA events it gives every new allocation for tracking
/// the buffer's uses across streams. cudarc only records and waits on those events once its
/// context is in multi-stream mode, which only its `new_stream` enters; candle's
/// `Device::new_cuda` works on the per-thread default stream and never calls it, and neither
/// does r3. So the events were created and destroyed with every tensor (two `cuEventCreate`
/// and two `cuEventDestroy` calls each, some thousands a training step and dozens per layer
/// of a decode step) and never used: turning the tracking off removes host work without
/// changing what is synchronised. Were a second stream ever made on this context, buffers
/// allocated from here on would not be tracked; nothing in r3 makes one. No effect off a GPU.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn skip_unused_events(device: &Device) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(gpu) = device {
        // SAFETY: the context works on one stream per thread and is not in cudarc's
        // multi-stream mode, in which alone the events would be recorded and waited on;
        // ordering between threads' streams was never managed by them (see above).
        unsafe { gpu.disable_event_tracking() }
    }
}

/// The default stream-ordered memory pool of a GPU's device (candle allocates from it).
#[cfg(feature = "cuda")]
fn default_pool(
    gpu: &candle_core::CudaDevice,
) -> Result<candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool, String> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` receives the device's default pool handle, which stays valid for the
    // context's life.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, gpu.cuda_stream().context().cu_device())
            .result()
            .map_err(|e| format!("cannot read its memory pool: {e}"))?;
    }
    Ok(pool)
}

/// Whether an error's text reads as a failed device allocation: CUDA's
/// `CUDA_ERROR_OUT_OF_MEMORY` (cudarc's name in candle's error text) or an allocator's "out
/// of memory", unless it names page-locked host memory ([`ModelError::HostMemory`], whose
/// driver error is worded the same). On the CPU an allocation failure aborts the process
/// instead, so this is a GPU's case.
///
/// [`ModelError::HostMemory`]: crate::ModelError::HostMemory
pub fn reads_as_out_of_memory(error: &dyn std::fmt::Display) -> bool {
    let text = error.to_string();
    let lower = text.to_ascii_lowercase();
    (lower.contains("out_of_memory") || lower.contains("out of memory"))
        && !text.contains(crate::error::PAGE_LOCKED_HOST_MEMORY)
}

/// The device's free and total memory in bytes, as its driver reports them now: `None` on
/// the CPU (whose memory the operating system manages); on a GPU, CUDA's `cuMemGetInfo`
/// after the work queued so far has run and the memory pool has handed back what it keeps
/// unused (`keep_freed_memory` keeps freed memory in the pool, where the driver counts it
/// as used).
pub fn device_memory(device: &Device) -> Result<Option<(usize, usize)>, DeviceError> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => {
            use candle_core::cuda_backend::cudarc::driver::sys;
            let unavailable = |reason: String| unavailable(device, reason);
            let stream = gpu.cuda_stream();
            stream
                .synchronize()
                .map_err(|e| unavailable(format!("cannot finish its queued work: {e}")))?;
            let pool = default_pool(gpu).map_err(unavailable)?;
            // SAFETY: a valid pool handle; trimming releases only memory no allocation holds.
            unsafe { sys::cuMemPoolTrimTo(pool, 0) }
                .result()
                .map_err(|e| unavailable(format!("cannot trim its memory pool: {e}")))?;
            stream
                .context()
                .mem_get_info()
                .map(Some)
                .map_err(|e| unavailable(format!("cannot read its free memory: {e}")))
        }
        _ => Ok(None),
    }
}

/// The most memory the device's tensors held at once since [`reset_device_memory_peak`], in
/// bytes, once the work queued so far has run: on a GPU the high-water mark of its
/// stream-ordered memory pool, from which candle allocates every tensor (what PyTorch's
/// `max_memory_allocated` reports; cuBLAS's workspace and the context are not in it);
/// `None` on the CPU, whose memory is the process's resident set.
pub fn device_memory_peak(device: &Device) -> Result<Option<u64>, DeviceError> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => {
            use candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute as Attr;
            gpu.cuda_stream()
                .synchronize()
                .map_err(|e| unavailable(device, format!("cannot finish its queued work: {e}")))?;
            pool_attribute(gpu, Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
                .map(Some)
                .map_err(|e| {
                    unavailable(
                        device,
                        format!("cannot read its memory pool's high-water mark: {e}"),
                    )
                })
        }
        _ => Ok(None),
    }
}

/// Starts [`device_memory_peak`]'s mark again from what the device's tensors hold now (the
/// driver resets a pool's high-water mark to zero, and it climbs back with the next
/// allocation past that); nothing on the CPU.
pub fn reset_device_memory_peak(device: &Device) -> Result<(), DeviceError> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => {
            use candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute as Attr;
            // Zero is the one value the driver accepts for this attribute.
            set_pool_attribute(gpu, Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0).map_err(|e| {
                unavailable(
                    device,
                    format!("cannot reset its memory pool's high-water mark: {e}"),
                )
            })
        }
        _ => Ok(()),
    }
}

/// The error of a GPU that cannot do what was asked of it, and why.
#[cfg(feature = "cuda")]
fn unavailable(device: &Device, reason: String) -> DeviceError {
    DeviceError::CudaUnavailable {
        spec: DeviceSpec::of(device),
        reason,
    }
}

/// A `u64` attribute of the GPU's default memory pool.
#[cfg(feature = "cuda")]
fn pool_attribute(
    gpu: &candle_core::CudaDevice,
    attribute: candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute,
) -> Result<u64, String> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let pool = default_pool(gpu)?;
    let mut value = 0u64;
    // SAFETY: the attributes read here are `u64`s written through the pointer; the pool
    // handle is valid for the context's life.
    unsafe {
        sys::cuMemPoolGetAttribute(
            pool,
            attribute,
            &mut value as *mut u64 as *mut std::ffi::c_void,
        )
    }
    .result()
    .map_err(|e| e.to_string())?;
    Ok(value)
}

/// Sets a `u64` attribute of the GPU's default memory pool.
#[cfg(feature = "cuda")]
fn set_pool_attribute(
    gpu: &candle_core::CudaDevice,
    attribute: candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute,
    mut value: u64,
) -> Result<(), String> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let pool = default_pool(gpu)?;
    // SAFETY: the attributes set here take a `u64` by pointer; the pool handle is valid.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            attribute,
            &mut value as *mut u64 as *mut std::ffi::c_void,
        )
    }
    .result()
    .map_err(|e| e.to_string())
}

/// Whether r3's own row ops run on this tensor: f32 or f64 on the CPU (the CPU
/// implementations), f32 on a GPU (the CUDA kernels of `cuda/kernels.cu`), and not empty
/// (empty tensors take candle's own ops: a kernel grid needs a row, CUDA a non-empty buffer).
pub(crate) fn row_ops_run_on(t: &candle_core::Tensor) -> bool {
    let device_has_them = match t.dtype() {
        candle_core::DType::F32 => t.device().is_cpu() || t.device().is_cuda(),
        candle_core::DType::F64 => t.device().is_cpu(),
        _ => false,
    };
    device_has_them && t.elem_count() > 0
}

/// Opens (`capture = true`) or closes CUDA's profiler capture range, so that a profiler
/// started with capture off (`ncu --profile-from-start off`) records only the work in
/// between (a benchmark's timed step, not the weights' drawing); waits for the device's
/// queued work first, so the range holds exactly what was launched inside it. Nothing on the
/// CPU.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn profiler_capture(device: &Device, capture: bool) -> Result<(), DeviceError> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let failed = |e: String| DeviceError::CudaUnavailable {
                spec: DeviceSpec::of(device),
                reason: format!("cannot switch the profiler's capture: {e}"),
            };
            device.synchronize().map_err(|e| failed(e.to_string()))?;
            let switched = if capture {
                candle_core::cuda_backend::cudarc::driver::profiler_start()
            } else {
                candle_core::cuda_backend::cudarc::driver::profiler_stop()
            };
            switched.map_err(|e| failed(e.to_string()))
        }
        _ => Ok(()),
    }
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;

    fn from_str(text: &str) -> Result<Self, DeviceError> {
        let bad = || DeviceError::Parse {
            text: text.to_string(),
        };
        match text.trim() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda { ordinal: 0 }),
            other => {
                let index = other.strip_prefix("cuda:").ok_or_else(bad)?;
                // Digits only: `cuda:+1` or `cuda: 1` name nothing.
                if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                let ordinal = index.parse().map_err(|_| bad())?;
                Ok(DeviceSpec::Cuda { ordinal })
            }
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device allocation's failure reads as out of memory, through any error that wraps
    /// its text; the host's page-locked memory running out, worded by the same driver, and
    /// other errors do not.
    #[test]
    fn only_a_device_allocation_reads_as_out_of_memory() {
        let driver = "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")";
        let device = crate::ModelError::Candle(candle_core::Error::Msg(driver.into()));
        assert!(reads_as_out_of_memory(&device));
        assert!(reads_as_out_of_memory(&format!("step 3 failed: {device}")));
        let host = crate::ModelError::HostMemory {
            values: 1 << 20,
            reason: driver.into(),
        };
        assert!(!reads_as_out_of_memory(&host), "{host}");
        assert!(!reads_as_out_of_memory(&format!("step 3 failed: {host}")));
        assert!(!reads_as_out_of_memory(&crate::ModelError::Input(
            "id 9".into()
        )));
    }

    /// The CPU reports no device memory (the operating system manages it).
    #[test]
    fn the_cpu_reports_no_device_memory() {
        assert_eq!(device_memory(&Device::Cpu).expect("cpu"), None);
        reset_device_memory_peak(&Device::Cpu).expect("nothing to reset");
        assert_eq!(device_memory_peak(&Device::Cpu).expect("cpu"), None);
    }

    #[test]
    fn parses_every_form_and_rejects_others() {
        let parse = |s: &str| s.parse::<DeviceSpec>().ok();
        assert_eq!(parse("cpu"), Some(DeviceSpec::Cpu));
        assert_eq!(parse("cuda"), Some(DeviceSpec::Cuda { ordinal: 0 }));
        assert_eq!(parse("cuda:0"), Some(DeviceSpec::Cuda { ordinal: 0 }));
        assert_eq!(parse("cuda:3"), Some(DeviceSpec::Cuda { ordinal: 3 }));
        assert_eq!(parse(" cuda:12 "), Some(DeviceSpec::Cuda { ordinal: 12 }));
        for bad in [
            "",
            "gpu",
            "CPU",
            "cuda:",
            "cuda:-1",
            "cuda:+1",
            "cuda: 1",
            "cuda:1.5",
            "cuda0",
            "metal",
            "cuda:99999999999999999999999",
        ] {
            let err = bad.parse::<DeviceSpec>().expect_err(bad).to_string();
            assert!(
                err.contains(&format!("`{bad}`")) && err.contains("`cuda:N`"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn display_round_trips() {
        for spec in [DeviceSpec::Cpu, DeviceSpec::Cuda { ordinal: 2 }] {
            assert_eq!(spec.to_string().parse::<DeviceSpec>().ok(), Some(spec));
        }
        assert_eq!(DeviceSpec::default(), DeviceSpec::Cpu);
    }

    #[test]
    fn cpu_opens_to_the_cpu() {
        let device = DeviceSpec::Cpu.open().expect("cpu");
        assert!(device.is_cpu());
        assert_eq!(DeviceSpec::of(&device), DeviceSpec::Cpu);
    }

    /// A build without the feature says so and names the build script, whatever the machine.
    #[test]
    fn cuda_without_the_feature_names_the_feature_and_the_script() {
        let spec = DeviceSpec::Cuda { ordinal: 1 };
        let err = spec.open_with(false).expect_err("no cuda feature");
        assert!(matches!(err, DeviceError::CudaNotBuilt { .. }), "{err:?}");
        let text = err.to_string();
        for needle in ["`cuda:1`", "`cuda` feature", CUDA_BUILD_SCRIPT, "CPU"] {
            assert!(text.contains(needle), "{needle} missing from: {text}");
        }
    }

    /// In this build (CI: no `cuda` feature) opening a GPU is the feature error; in a CUDA
    /// build on a machine without a GPU it is the driver error, never a CPU device.
    #[test]
    fn cuda_never_opens_to_the_cpu() {
        match (DeviceSpec::Cuda { ordinal: 0 }).open() {
            Ok(device) => assert!(device.is_cuda(), "cuda opened to {device:?}"),
            Err(DeviceError::CudaNotBuilt { .. }) => {
                assert!(!candle_core::utils::cuda_is_available())
            }
            Err(DeviceError::CudaUnavailable { reason, .. }) => {
                assert!(candle_core::utils::cuda_is_available());
                assert!(!reason.is_empty());
            }
            Err(other) => panic!("unexpected error {other}"),
        }
    }
}
