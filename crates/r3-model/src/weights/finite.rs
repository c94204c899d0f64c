//! The finiteness scan of weight tensors: NaN or ±inf in a checkpoint is refused at load with
//! the tensor and flat index named, before any forward pass turns it into `null` logits.
//! The scan reads the tensor's storage in place (no copy for contiguous CPU tensors) and
//! splits it into fixed chunks over rayon; the first bad element is the lowest index, so the
//! error does not depend on the thread count.

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{ModelError, Result};

/// Elements per chunk of the parallel scan.
const CHUNK: usize = 1 << 16;

/// First non-finite element of `data` as (flat index, value as f64).
fn first_non_finite<T: Copy + Sync>(
    data: &[T],
    is_finite: impl Fn(T) -> bool + Sync,
    widen: impl Fn(T) -> f64,
) -> Option<(usize, f64)> {
    let (chunk_index, chunk) = data
        .par_chunks(CHUNK)
        .enumerate()
        .find_first(|(_, c)| c.iter().any(|&x| !is_finite(x)))?;
    let offset = chunk.iter().position(|&x| !is_finite(x))?;
    Some((chunk_index * CHUNK + offset, widen(chunk[offset])))
}

/// Checks that every element of the float tensor `tensor` is finite; an error names `name`,
/// the first bad element's flat (row-major) index and its value. Integer tensors pass.
pub fn check_finite(name: &str, tensor: &Tensor) -> Result<()> {
    if !tensor.dtype().is_float() {
        return Ok(());
    }
    let cpu = match tensor.device() {
        Device::Cpu => tensor.contiguous()?,
        _ => tensor.to_device(&Device::Cpu)?.contiguous()?,
    };
    let found = {
        let (storage, layout) = cpu.storage_and_layout();
        let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
            ModelError::Input(format!("tensor `{name}` is not contiguous after a copy"))
        })?;
        match &*storage {
            Storage::Cpu(CpuStorage::F32(v)) => {
                Some(first_non_finite(&v[start..end], f32::is_finite, f64::from))
            }
            Storage::Cpu(CpuStorage::F64(v)) => {
                Some(first_non_finite(&v[start..end], f64::is_finite, |x| x))
            }
            Storage::Cpu(CpuStorage::F16(v)) => Some(first_non_finite(
                &v[start..end],
                f16::is_finite,
                f16::to_f64,
            )),
            Storage::Cpu(CpuStorage::BF16(v)) => Some(first_non_finite(
                &v[start..end],
                bf16::is_finite,
                bf16::to_f64,
            )),
            // Other float formats (f8, ...) are scanned as f32 below.
            _ => None,
        }
    };
    let found = match found {
        Some(f) => f,
        None => {
            let wide = cpu.to_dtype(DType::F32)?;
            return check_finite(name, &wide);
        }
    };
    match found {
        None => Ok(()),
        Some((index, value)) => Err(ModelError::NonFiniteWeight {
            tensor: name.to_string(),
            index,
            value,
        }),
    }
}
