//! The range scan of weight tensors: NaN or ±inf in a checkpoint — or a value past the
//! finite range of the precision an engine will hold the weights in (65504 for f16) — is
//! refused at load with the tensor and flat index named, before any forward pass turns it
//! into `null` logits. The scan reads the tensor's storage in place (no copy for contiguous
//! CPU tensors) and splits it into fixed chunks over rayon; the first bad element is the
//! lowest index, so the error does not depend on the thread count.

use std::collections::BTreeMap;

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
    let max = precision.max_finite();
    let cpu = match tensor.device() {
        Device::Cpu => tensor.contiguous()?,
        _ => {
            // On a GPU the weights are checked where they are; only a tensor that may hold
            // a bad value is copied to the host to name the first one.
            let reducible = matches!(
                tensor.dtype(),
                DType::F16 | DType::BF16 | DType::F32 | DType::F64
            );
            if reducible && holds_on_device(tensor, max, DEVICE_CHUNK)? {
                return Ok(());
            }
            tensor.to_device(&Device::Cpu)?.contiguous()?
        }
    };
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

/// Elements per reduction of [`holds_on_device`] (bounds its temporary to one chunk).
const DEVICE_CHUNK: usize = 1 << 24;

/// Whether every element of the float tensor `tensor` is finite and of magnitude at most
/// `max`, decided on the tensor's own device in chunks of `chunk` elements: per chunk the
/// largest magnitude (exact in any dtype, compared on the host in f64) and the sum (NaN and
/// ±inf propagate through any summation order, where a maximum may skip NaN), two scalars to
/// the host. `false` means some element may be outside: a sum that overflows is a false
/// alarm (the caller's host scan then finds nothing), never a missed value.
fn holds_on_device(tensor: &Tensor, max: f64, chunk: usize) -> Result<bool> {
    let flat = tensor.flatten_all()?;
    let n = flat.dim(0)?;
    let scalar = |t: Tensor| -> Result<f64> { Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?) };
    let mut start = 0;
    while start < n {
        let part = flat.narrow(0, start, chunk.max(1).min(n - start))?;
        let max_abs = scalar(part.abs()?.max_all()?)?;
        let sum = scalar(part.sum_all()?)?;
        if !(max_abs <= max && sum.is_finite()) {
            return Ok(false);
        }
        start += part.dim(0)?;
    }
    Ok(true)
}

/// [`check_holds`] over every tensor of a name → tensor map, in the map's order: the first
/// tensor `precision` cannot hold is the error. CPU tensors are scanned on the rayon pool (a
/// weight sync checks every parameter); the reported error is still the first in order.
/// Tensors on a GPU are checked one after another on their device.
pub fn check_map_holds<'a>(
    tensors: impl IntoIterator<Item = (&'a String, &'a Tensor)>,
    precision: WeightPrecision,
) -> Result<()> {
    let tensors: Vec<(&String, &Tensor)> = tensors.into_iter().collect();
    if !tensors.iter().all(|(_, t)| t.device().is_cpu()) {
        return tensors
            .iter()
            .try_for_each(|(name, t)| check_holds(name, t, precision));
    }
    tensors
        .par_iter()
        .map(|(name, t)| check_holds(name, t, precision))
        .collect::<Vec<Result<()>>>()
        .into_iter()
        .collect()
}

/// A name → tensor map every value of which a precision holds: made by
/// [`HeldTensors::check`] (the range scan) or, where the maker keeps that invariant itself,
/// [`HeldTensors::vouched`]. An engine loading it scans only what the proof does not cover.
#[derive(Debug, Clone, Copy)]
pub struct HeldTensors<'a> {
    tensors: &'a BTreeMap<String, Tensor>,
    precision: WeightPrecision,
}

impl<'a> HeldTensors<'a> {
    /// Scans `tensors` ([`check_map_holds`]): an error names the first tensor `precision`
    /// cannot hold.
    pub fn check(
        tensors: &'a BTreeMap<String, Tensor>,
        precision: WeightPrecision,
    ) -> Result<Self> {
        check_map_holds(tensors, precision)?;
        Ok(HeldTensors { tensors, precision })
    }

    /// Without a scan, on the caller's word that `precision` holds every value: for a maker
    /// that keeps the invariant itself (the RL trainer checks its weights at start and its
    /// guarded update refuses any step that would leave one outside). A value outside would
    /// reach the engine unchecked.
    pub fn vouched(tensors: &'a BTreeMap<String, Tensor>, precision: WeightPrecision) -> Self {
        HeldTensors { tensors, precision }
    }

    /// The tensors.
    pub fn tensors(&self) -> &'a BTreeMap<String, Tensor> {
        self.tensors
    }

    /// Whether every value is known to fit `precision` (held for one at most as wide).
    pub fn fit(&self, precision: WeightPrecision) -> bool {
        self.precision.max_finite() <= precision.max_finite()
    }

    /// Checks that `precision` holds every value: nothing to do where the proof covers it,
    /// else the scan.
    pub fn ensure(&self, precision: WeightPrecision) -> Result<()> {
        if self.fit(precision) {
            return Ok(());
        }
        check_map_holds(self.tensors, precision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A check-made proof covers its precision and narrower ones only; a wider precision is
    /// scanned; a vouched map is taken at its word.
    #[test]
    fn a_held_map_is_scanned_only_where_its_proof_does_not_reach() {
        let dev = Device::Cpu;
        let big = Tensor::from_vec(vec![1.0f32, 70000.0], 2, &dev).unwrap();
        let map: BTreeMap<String, Tensor> = [("w".to_string(), big)].into();
        assert!(HeldTensors::check(&map, WeightPrecision::F16).is_err());
        let held = HeldTensors::check(&map, WeightPrecision::F32).unwrap();
        assert!(held.ensure(WeightPrecision::F32).is_ok());
        assert!(
            held.ensure(WeightPrecision::F16).is_err(),
            "f16 is narrower: scanned"
        );
        let vouched = HeldTensors::vouched(&map, WeightPrecision::F16);
        assert!(vouched.fit(WeightPrecision::Bf16) && vouched.fit(WeightPrecision::F16));
        assert!(
            vouched.ensure(WeightPrecision::F16).is_ok(),
            "taken at its word"
        );
    }

    /// The device-side filter agrees with the host scan on the CPU: clean tensors pass (in
    /// chunks that split them), NaN, ±inf and values past the precision's range do not,
    /// including a bf16 value the f16 limit would round to when compared in bf16.
    #[test]
    fn the_device_filter_never_passes_a_value_the_host_scan_refuses() {
        let dev = Device::Cpu;
        let f16_max = WeightPrecision::F16.max_finite();
        let clean = Tensor::from_vec(vec![1.0f32, -65504.0, 3.5, 0.0, 7.0], 5, &dev).unwrap();
        for chunk in [1, 2, 5, 64] {
            assert!(
                holds_on_device(&clean, f16_max, chunk).unwrap(),
                "chunk {chunk}"
            );
        }
        for bad in [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            65520.0,
            -70000.0,
        ] {
            let t = Tensor::from_vec(vec![1.0f32, 2.0, bad, 4.0], (2, 2), &dev).unwrap();
            for chunk in [1, 3, 64] {
                assert!(
                    !holds_on_device(&t, f16_max, chunk).unwrap(),
                    "{bad} chunk {chunk}"
                );
            }
            assert!(check_holds("t", &t, WeightPrecision::F16).is_err());
        }
        // 65536 is a bf16 value; the f16 limit 65504 rounds to it in bf16.
        let bf = Tensor::from_vec(vec![1.0f32, 65536.0], 2, &dev)
            .and_then(|t| t.to_dtype(DType::BF16))
            .unwrap();
        assert!(!holds_on_device(&bf, f16_max, 64).unwrap());
        assert!(holds_on_device(&bf, WeightPrecision::F32.max_finite(), 64).unwrap());
        let wide = Tensor::from_vec(vec![1e300f64, -2.0], 2, &dev).unwrap();
        assert!(!holds_on_device(&wide, WeightPrecision::F32.max_finite(), 64).unwrap());
    }

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
