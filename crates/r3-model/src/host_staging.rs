//! A reusable host buffer that a device tensor's values are copied into for reading on the
//! host (the device rollout engine's rows of logits, each step).
//!
//! On a GPU the buffer is page-locked memory: a copy into ordinary (pageable) memory is
//! staged by the driver through a bounce buffer of its own, at a fraction of the link's
//! speed, where a copy into page-locked memory is one DMA. The buffer is allocated once and
//! grown when a copy needs more, so a step pays no allocation. On the CPU the values are
//! read into an ordinary vector.

use candle_core::{DType, Tensor};

use crate::error::Result;

/// Host memory that tensors' f32 values are copied into, reused copy after copy.
#[derive(Default)]
pub struct HostStaging {
    /// Page-locked memory for copies from a GPU (allocated on first use, grown as needed).
    #[cfg(feature = "cuda")]
    pinned: Option<candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<f32>>,
    /// The values of a copy from the CPU.
    host: Vec<f32>,
}

impl std::fmt::Debug for HostStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStaging")
            .field("host_len", &self.host.len())
            .finish_non_exhaustive()
    }
}

impl HostStaging {
    /// An empty staging buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// The values of `t` as f32 in row-major order (cast first if `t` is another dtype),
    /// copied to the host and waited for; the slice is valid until the next copy.
    pub fn copy_f32(&mut self, t: &Tensor) -> Result<&[f32]> {
        let t = t.to_dtype(DType::F32)?.contiguous()?;
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(gpu) = t.device() {
            let n = t.elem_count();
            let pinned = pinned_of_len(&mut self.pinned, gpu, n)?;
            return copy_into_pinned(&t, gpu, pinned, n);
        }
        self.host = t.flatten_all()?.to_vec1::<f32>()?;
        Ok(&self.host)
    }
}

/// Values of page-locked memory a staging buffer keeps between copies whatever the copies
/// before needed (64 Mi f32, 256 MiB: a decode step's sampled rows at batch 256 of a
/// 151,936-token vocabulary are 39 M). A larger buffer (a prefill's prompt log-probs: up to
/// ≈ 2.7 GiB under the default activation budget) is given back at the next copy that needs
/// less, where it had stayed pinned for the process's life.
pub const KEEP_PINNED_VALUES: usize = 64 << 20;

/// Whether a staging buffer of `held` values (none: `None`) is replaced for a copy of `n`:
/// when it is too small, or when it is past [`KEEP_PINNED_VALUES`] and more than twice what
/// the copy needs.
pub fn replaces_buffer(held: Option<usize>, n: usize) -> bool {
    match held {
        None => true,
        Some(len) => len < n.max(1) || (len > KEEP_PINNED_VALUES && len > 2 * n.max(1)),
    }
}

/// The length a replacing buffer is allocated at for a copy of `n` values: `n` with a
/// quarter to spare (a batch growing a few rows at a time does not reallocate at every
/// step).
pub fn buffer_len_for(n: usize) -> usize {
    n.max(1).saturating_add(n / 4)
}

/// The page-locked buffer in `slot`, reallocated when [`replaces_buffer`] says so.
#[cfg(feature = "cuda")]
fn pinned_of_len<'a>(
    slot: &'a mut Option<candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<f32>>,
    gpu: &candle_core::CudaDevice,
    n: usize,
) -> Result<&'a mut candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<f32>> {
    use crate::error::ModelError;
    if replaces_buffer(slot.as_ref().map(|p| p.len()), n) {
        // Free the old buffer before taking another.
        *slot = None;
        let len = buffer_len_for(n);
        // SAFETY: the values are unset until a copy writes them, and only the `n` a copy
        // wrote are read. No flags: cudarc's default (`alloc_pinned`) is write-combined
        // memory, fast for the device to read but uncached for the host, which reads these.
        let buffer = unsafe {
            gpu.cuda_stream()
                .context()
                .alloc_pinned_with_flags::<f32>(len, 0)
        }
        .map_err(|e| ModelError::HostMemory {
            values: len,
            reason: e.to_string(),
        })?;
        *slot = Some(buffer);
    }
    slot.as_mut().ok_or_else(|| {
        ModelError::Input("page-locked host buffer missing after its allocation".into())
    })
}

/// Copies the `n` values of the contiguous f32 GPU tensor `t` into `pinned` and waits for
/// the copy: the slice it returns holds them.
#[cfg(feature = "cuda")]
fn copy_into_pinned<'a>(
    t: &Tensor,
    gpu: &candle_core::CudaDevice,
    pinned: &'a mut candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<f32>,
    n: usize,
) -> Result<&'a [f32]> {
    use crate::error::ModelError;
    use candle_core::backend::BackendStorage;
    let failed = |what: &str, e: String| ModelError::Input(format!("{what}: {e}"));
    let stream = gpu.cuda_stream();
    {
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cuda(cuda) = &*storage else {
            return Err(ModelError::Input("a GPU tensor without GPU storage".into()));
        };
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| ModelError::Input("copy of a strided tensor".into()))?;
        if end - start != n || cuda.dtype() != DType::F32 {
            return Err(ModelError::Input(format!(
                "copy of {} values as {n} f32",
                end - start
            )));
        }
        let slice = cuda.as_cuda_slice::<f32>()?;
        let view = slice.slice(start..end);
        // cudarc copies as many bytes as the destination holds, so the destination is the
        // buffer's first `n` values (the buffer has room to spare): still page-locked
        // memory, which the driver recognises by its address.
        let whole = pinned
            .as_mut_slice()
            .map_err(|e| failed("writing page-locked memory", e.to_string()))?;
        let held = whole.len();
        let dst = whole.get_mut(..n).ok_or_else(|| {
            ModelError::Input(format!(
                "a page-locked buffer of {held} values for a copy of {n}"
            ))
        })?;
        stream
            .memcpy_dtoh(&view, dst)
            .map_err(|e| failed("copy to page-locked memory", e.to_string()))?;
    }
    // The copy is asynchronous, and the buffer's own event is recorded only when cudarc
    // manages several streams (it does not here), so wait for the stream itself.
    stream
        .synchronize()
        .map_err(|e| failed("waiting for the copy", e.to_string()))?;
    let all = pinned
        .as_slice()
        .map_err(|e| failed("reading page-locked memory", e.to_string()))?;
    Ok(&all[..n])
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Copies of tensors of several shapes and dtypes read back their values, one copy after
    /// another through the same buffer: row-major, a transposed view (values by hand), and
    /// bf16 (each value as `half` rounds it).
    #[test]
    fn copies_read_back_the_values() {
        let mut staging = HostStaging::new();
        for (rows, cols) in [(3usize, 5usize), (1, 1), (7, 11), (2, 4)] {
            let values: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.3 - 3.0).collect();
            let t = Tensor::from_vec(values.clone(), (rows, cols), &Device::Cpu).expect("t");
            assert_eq!(staging.copy_f32(&t).expect("copy"), values.as_slice());
            let transposed: Vec<f32> = (0..cols * rows)
                .map(|i| values[(i % rows) * cols + i / rows])
                .collect();
            let view = t.t().expect("transpose");
            assert_eq!(
                staging.copy_f32(&view).expect("view"),
                transposed.as_slice()
            );
            let rounded: Vec<f32> = values
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_f32())
                .collect();
            let t16 = t.to_dtype(DType::BF16).expect("bf16");
            assert_eq!(staging.copy_f32(&t16).expect("bf16"), rounded.as_slice());
        }
    }

    /// By hand: no buffer or a short one is replaced; one past the keep size and more than
    /// twice the copy is given back; one within twice the copy, or under the keep size, is
    /// kept; the new length has a quarter to spare.
    #[test]
    fn buffers_are_replaced_when_short_or_far_past_the_keep_size() {
        assert!(replaces_buffer(None, 10));
        assert!(replaces_buffer(Some(9), 10));
        assert!(!replaces_buffer(Some(10), 10));
        // Under the keep size: kept however small the copy.
        assert!(!replaces_buffer(Some(KEEP_PINNED_VALUES), 1));
        // Past it: kept while the copy needs half of it, given back below that.
        let big = 4 * KEEP_PINNED_VALUES;
        assert!(!replaces_buffer(Some(big), big / 2));
        assert!(replaces_buffer(Some(big), big / 2 - 1));
        assert!(replaces_buffer(Some(big), 0));
        assert_eq!(buffer_len_for(0), 1);
        assert_eq!(buffer_len_for(100), 125);
        assert_eq!(KEEP_PINNED_VALUES, 67_108_864);
    }
}
