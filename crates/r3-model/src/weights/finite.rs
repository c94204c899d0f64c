//! The range scan of weight tensors: NaN or ±inf in a checkpoint — or a value past the
//! finite range of the precision an engine will hold the weights in (65504 for f16) — is
//! refused at load with the tensor and flat index named, before any forward pass turns it
//! into `null` logits. The scan reads the tensor's storage in place (no copy for contiguous
//! CPU tensors) and splits it into fixed chunks over rayon; the first bad element is the
//! lowest index, so the error does not depend on the thread count.

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{ModelError, Result};
use crate::weights::precision::WeightPrecision;

/// Elements per chunk of the parallel scan.
const CHUNK: usize = 1 << 16;

/// A float type the scan compares in.
trait Compared: Copy + Send + Sync {
    /// Whether `self` is NaN or of magnitude above `max`.
    fn outside(self, max: Self) -> bool;
}

impl Compared for f32 {
    #[inline(always)]
    fn outside(self, max: f32) -> bool {
        self.is_nan() || self.abs() > max
    }
}

impl Compared for f64 {
    #[inline(always)]
    fn outside(self, max: f64) -> bool {
        self.is_nan() || self.abs() > max
    }
}

/// First element of `data` outside `max` (NaN included) as (flat index, value widened to
/// `W`, the type compared in).
fn first_outside<T: Copy + Sync, W: Compared>(
    data: &[T],
    max: W,
    widen: impl Fn(T) -> W + Sync,
) -> Option<(usize, W)> {
    let outside = |x: T| widen(x).outside(max);
    // Each chunk is tested without an early exit (an OR over every element, which
    // vectorises); only a chunk holding a bad element is searched for its position.
    let (chunk_index, chunk) = data
        .par_chunks(CHUNK)
        .enumerate()
        .find_first(|(_, c)| c.iter().fold(false, |bad, &x| bad | outside(x)))?;
    let offset = chunk.iter().position(|&x| outside(x))?;
    Some((chunk_index * CHUNK + offset, widen(chunk[offset])))
}

/// [`first_outside`] for f32 values and an f32 `max` (≥ 0): a chunk's largest magnitude is
/// an integer max over the bits without the sign (non-negative floats order as their bits,
/// and NaN's lie above infinity's), which vectorises to one compare per lane.
fn first_outside_f32(data: &[f32], max: f32) -> Option<(usize, f32)> {
    let max_bits = max.to_bits();
    let (chunk_index, chunk) = data.par_chunks(CHUNK).enumerate().find_first(|(_, c)| {
        c.iter().fold(0u32, |m, x| m.max(x.to_bits() & 0x7FFF_FFFF)) > max_bits
    })?;
    let offset = chunk.iter().position(|&x| x.outside(max))?;
    Some((chunk_index * CHUNK + offset, chunk[offset]))
}

/// Checks that every element of the float tensor `tensor` is finite; an error names `name`,
/// the first bad element's flat (row-major) index and its value. Integer tensors pass.
pub fn check_finite(name: &str, tensor: &Tensor) -> Result<()> {
    check_holds(name, tensor, WeightPrecision::F32)
}

/// Checks that `precision` holds every element of the float tensor `tensor` (finite, and
/// within its finite range); an error names `name`, the first bad element's flat
/// (row-major) index, its value and, for a finite value, the precision. Integer tensors
/// pass.
pub fn check_holds(name: &str, tensor: &Tensor, precision: WeightPrecision) -> Result<()> {
    if !tensor.dtype().is_float() {
        return Ok(());
    }
    let cpu = match tensor.device() {
        Device::Cpu => tensor.contiguous()?,
        _ => tensor.to_device(&Device::Cpu)?.contiguous()?,
    };
    let max = precision.max_finite();
    let found = {
        let (storage, layout) = cpu.storage_and_layout();
        let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
            ModelError::Input(format!("tensor `{name}` is not contiguous after a copy"))
        })?;
        match &*storage {
            // Compared in f32 (half the vector width of f64) when `max` is an f32 value, as
            // every precision's largest finite value is.
            Storage::Cpu(CpuStorage::F32(v)) if f64::from(max as f32) == max && max >= 0.0 => {
                Some(first_outside_f32(&v[start..end], max as f32))
                    .map(|found| found.map(|(i, x)| (i, f64::from(x))))
            }
            Storage::Cpu(CpuStorage::F32(v)) => Some(first_outside(&v[start..end], max, f64::from)),
            Storage::Cpu(CpuStorage::F64(v)) => Some(first_outside(&v[start..end], max, |x| x)),
            Storage::Cpu(CpuStorage::F16(v)) => {
                Some(first_outside(&v[start..end], max, f16::to_f64))
            }
            Storage::Cpu(CpuStorage::BF16(v)) => {
                Some(first_outside(&v[start..end], max, bf16::to_f64))
            }
            // Other float formats (f8, ...) are scanned as f32 below.
            _ => None,
        }
    };
    let found = match found {
        Some(f) => f,
        None => {
            let wide = cpu.to_dtype(DType::F32)?;
            return check_holds(name, &wide, precision);
        }
    };
    match found {
        None => Ok(()),
        Some((index, value)) if !value.is_finite() => Err(ModelError::NonFiniteWeight {
            tensor: name.to_string(),
            index,
            value,
        }),
        Some((index, value)) => Err(ModelError::OutOfPrecisionRange {
            tensor: name.to_string(),
            index,
            value,
            precision,
            max: precision.max_finite(),
        }),
    }
}

/// [`check_holds`] over every tensor of a name → tensor map, in the map's order: the first
/// tensor `precision` cannot hold is the error. Tensors are scanned on the rayon pool (a
/// weight sync checks every parameter); the reported error is still the first in order.
pub fn check_map_holds<'a>(
    tensors: impl IntoIterator<Item = (&'a String, &'a Tensor)>,
    precision: WeightPrecision,
) -> Result<()> {
    let tensors: Vec<(&String, &Tensor)> = tensors.into_iter().collect();
    tensors
        .par_iter()
        .map(|(name, t)| check_holds(name, t, precision))
        .collect::<Vec<Result<()>>>()
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_bad_element_is_found_across_chunks_by_the_f32_bit_scan() {
        let mut v = vec![-65504.0f32; 3 * CHUNK];
        let t = Tensor::from_vec(v.clone(), v.len(), &Device::Cpu).expect("tensor");
        check_holds("w", &t, WeightPrecision::F16).expect("65504 fits f16");
        // A later chunk's bad element does not hide an earlier one.
        v[2 * CHUNK + 1] = f32::NAN;
        v[CHUNK + 3] = -65504.01;
        let t = Tensor::from_vec(v.clone(), v.len(), &Device::Cpu).expect("tensor");
        match check_holds("w", &t, WeightPrecision::F16) {
            Err(ModelError::OutOfPrecisionRange { index, value, .. }) => {
                assert_eq!((index, value), (CHUNK + 3, f64::from(-65504.01f32)));
            }
            other => panic!("expected an f16 range error, got {other:?}"),
        }
        for (bad, precision) in [
            (f32::NEG_INFINITY, WeightPrecision::F32),
            (f32::NAN, WeightPrecision::Bf16),
        ] {
            v[CHUNK + 3] = bad;
            let t = Tensor::from_vec(v.clone(), v.len(), &Device::Cpu).expect("tensor");
            match check_holds("w", &t, precision) {
                Err(ModelError::NonFiniteWeight { index, .. }) => assert_eq!(index, CHUNK + 3),
                other => panic!("expected a non-finite error, got {other:?}"),
            }
        }
    }

    #[test]
    fn each_precision_holds_up_to_its_largest_finite_value() {
        let t = Tensor::new(&[1.0f32, -65504.0, 3.0], &Device::Cpu).expect("tensor");
        check_holds("w", &t, WeightPrecision::F16).expect("65504 fits f16");
        let t = Tensor::new(&[1.0f32, 2.0, -70000.0, 1e30], &Device::Cpu).expect("tensor");
        match check_holds("w", &t, WeightPrecision::F16) {
            Err(ModelError::OutOfPrecisionRange {
                tensor,
                index,
                value,
                precision,
                ..
            }) => {
                assert_eq!((tensor.as_str(), index, value), ("w", 2, -70000.0));
                assert_eq!(precision, WeightPrecision::F16);
            }
            other => panic!("expected an f16 range error, got {other:?}"),
        }
        check_holds("w", &t, WeightPrecision::Bf16).expect("1e30 fits bf16");
        check_holds("w", &t, WeightPrecision::F32).expect("1e30 fits f32");
        // A value past bf16's largest finite (3.3895e38) but within f32's.
        let t = Tensor::new(&[3.4e38f32], &Device::Cpu).expect("tensor");
        assert!(check_holds("w", &t, WeightPrecision::Bf16).is_err());
        check_holds("w", &t, WeightPrecision::F32).expect("fits f32");
        // Non-finite values keep their own error.
        let t = Tensor::new(&[f32::NAN], &Device::Cpu).expect("tensor");
        assert!(matches!(
            check_holds("w", &t, WeightPrecision::F16),
            Err(ModelError::NonFiniteWeight { .. })
        ));
    }
}
