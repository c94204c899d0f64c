//! Variables' gradients kept in 16 bits where 16 bits hold them exactly.
//!
//! A bf16 (f16) training forward rounds each weight matrix at its matmul, and the rounding's
//! gradient is the incoming one rounded the same way (on a GPU the weight gradient is a 16-bit
//! GEMM's output), so the f32 gradient a weight receives from one backward is a bf16 (f16)
//! value: half its f32 bytes are zeros. [`narrow_where_exact`] stores such a gradient in the
//! 16-bit dtype, 2 bytes per parameter instead of 4 (Megatron's bf16 gradients beside fp32
//! main parameters; on a 5.6 B-parameter model 11 GB). It narrows only what the 16-bit
//! dtype holds exactly, checked value by value, so widening gives back every bit: a gradient
//! that is a sum of several contributions (a tied embedding), an f32 router's or one holding
//! a NaN stays f32. Readers take a gradient through [`in_dtype_of`], which widens it to its
//! variable's dtype.
//!
//! A model told so (`WeightGradients::Narrow`, `Model::set_weight_gradients`) hands its
//! rounded weights' gradients back in 16 bits already (a GPU's 16-bit GEMMs, the weight
//! roundings): no f32 copy, no check. What still arrives in f32 off the CPU is checked only
//! where it is large ([`keep_narrow`]): the check's verdict is read back by the host, which
//! waits for the device's queue each time.

use std::mem::MaybeUninit;

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use rayon::prelude::*;

use crate::cast16::cast16;
use crate::error::{ModelError, Result};

/// Elements per parallel chunk of the CPU check.
const CHUNK: usize = 1 << 16;

/// Off the CPU, f32 gradients of fewer values than this are left in f32 unchecked: norm
/// scales and biases, a few MB in all, where each check's read-back (the host waiting for
/// the device's queue) cost a step more time than their bytes are worth.
pub const DEVICE_CHECK_MIN_VALUES: usize = 1 << 20;

/// The gradient a backward keeping gradients narrow stores: [`narrow_where_exact`], except
/// that off the CPU a gradient of fewer than [`DEVICE_CHECK_MIN_VALUES`] values stays as it
/// is (see the module doc).
pub fn keep_narrow(grad: &Tensor, narrow: DType) -> Result<Tensor> {
    if !grad.device().is_cpu() && grad.elem_count() < DEVICE_CHECK_MIN_VALUES {
        check_narrow(narrow)?;
        return Ok(grad.clone());
    }
    narrow_where_exact(grad, narrow)
}

/// `grad` stored in `narrow` (bf16 or f16) when every value of it is exactly a `narrow`
/// value (none NaN), else `grad` itself. Widening the result ([`in_dtype_of`]) gives `grad`'s
/// values bit for bit. A gradient that is not f32 is returned as it is. On the CPU one
/// parallel pass over the gradient (each chunk checked, then written while in cache); on a
/// GPU one kernel; elsewhere candle's casts and a comparison.
pub fn narrow_where_exact(grad: &Tensor, narrow: DType) -> Result<Tensor> {
    check_narrow(narrow)?;
    if grad.dtype() != DType::F32 || grad.elem_count() == 0 {
        return Ok(grad.clone());
    }
    let grad = grad.detach().contiguous()?;
    let narrowed = match narrow_on_host(&grad, narrow)? {
        Some(narrowed) => narrowed,
        None => narrow_on_device(&grad, narrow)?,
    };
    Ok(narrowed.unwrap_or(grad))
}

/// The gradients of `loss` for every variable of its graph, each kept in `narrow` (bf16 or
/// f16) from the moment the backward completes it, where that holds it exactly
/// ([`keep_narrow`], through candle's `Tensor::backward_with`): they never all sit in f32
/// at once. Every other tensor's gradient is as `loss.backward()` gives it.
pub fn backward_narrowing(loss: &Tensor, narrow: DType) -> Result<GradStore> {
    check_narrow(narrow)?;
    Ok(loss.backward_with(|_, grad| {
        keep_narrow(&grad, narrow).map_err(|e| candle_core::Error::Msg(e.to_string()))
    })?)
}

/// Refuses a dtype other than bf16 and f16 to keep gradients in.
fn check_narrow(narrow: DType) -> Result<()> {
    match narrow {
        DType::BF16 | DType::F16 => Ok(()),
        other => Err(ModelError::Input(format!(
            "gradients can be kept narrow in bf16 or f16, not {other:?}"
        ))),
    }
}

/// `grad` in the dtype its variable `var`'s update is computed in: the variable's own, or
/// f32 for a 16-bit variable (weights held without an f32 master: their gradients are summed
/// over micro-batches, measured and clipped in f32); itself, or widened where a backward kept
/// it narrow ([`narrow_where_exact`]; on the CPU one parallel pass). Every reader of a
/// variable's gradient takes it so.
pub fn in_dtype_of(grad: &Tensor, var: &Tensor) -> Result<Tensor> {
    let wanted = match var.dtype() {
        DType::BF16 | DType::F16 => DType::F32,
        other => other,
    };
    if grad.dtype() == wanted {
        return Ok(grad.clone());
    }
    if wanted == DType::F32 {
        if let Some(wide) = widen_on_host(grad)? {
            return Ok(wide);
        }
    }
    Ok(grad.to_dtype(wanted)?)
}

/// For a contiguous f32 tensor on the CPU: `Some(Some(narrowed))` when `narrow` holds every
/// value exactly, `Some(None)` when it does not (the pass stops at the first such value);
/// `None` for any other tensor.
fn narrow_on_host(grad: &Tensor, narrow: DType) -> Result<Option<Option<Tensor>>> {
    let (storage, layout) = grad.storage_and_layout();
    let Some((from, to)) = layout.contiguous_offsets() else {
        return Ok(None);
    };
    let Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        return Ok(None);
    };
    let values = &data[from..to];
    let shape = grad.shape().clone();
    let narrowed = match narrow {
        DType::BF16 => filled(values, narrow_chunk_bf16)
            .map(|v| Tensor::from_vec(v, shape, &Device::Cpu))
            .transpose()?,
        _ => filled(values, narrow_chunk_f16)
            .map(|v| Tensor::from_vec(v, shape, &Device::Cpu))
            .transpose()?,
    };
    Ok(Some(narrowed))
}

/// A chunk of f32 values into bf16 when each is exact (bf16 is an f32's upper half: its
/// lower half zero, and no NaN); false, leaving `out` partly written, when one is not. The
/// check is a pass of its own so that both loops vectorise.
fn narrow_chunk_bf16(values: &[f32], out: &mut [MaybeUninit<half::bf16>]) -> bool {
    // Two plain reductions (an OR, a maximum), each of which the compiler vectorises: one
    // fold computing both kept its accumulators on the stack.
    let low = values.iter().fold(0u32, |acc, x| acc | x.to_bits()) & 0xFFFF;
    let largest = values
        .iter()
        .fold(0u32, |acc, x| acc.max(x.to_bits() & 0x7FFF_FFFF));
    if low != 0 || largest > 0x7F80_0000 {
        return false;
    }
    for (o, x) in out.iter_mut().zip(values) {
        o.write(half::bf16::from_bits((x.to_bits() >> 16) as u16));
    }
    true
}

/// A chunk of f32 values into f16 when each is exact (converting back gives its bits, and
/// none is NaN); false, leaving `out` partly written, at the first that is not.
fn narrow_chunk_f16(values: &[f32], out: &mut [MaybeUninit<half::f16>]) -> bool {
    for (o, &x) in out.iter_mut().zip(values) {
        let h = half::f16::from_f32(x);
        if x.is_nan() || h.to_f32().to_bits() != x.to_bits() {
            return false;
        }
        o.write(h);
    }
    true
}

/// A vector of `values.len()` elements written chunk by chunk in parallel by `fill` (one
/// output chunk per `CHUNK` input values, written whole when it returns true), without a
/// first pass zero-filling it; `None` as soon as one chunk returns false.
fn filled<S: Sync, T: Send>(
    values: &[S],
    fill: impl Fn(&[S], &mut [MaybeUninit<T>]) -> bool + Sync,
) -> Option<Vec<T>> {
    let n = values.len();
    let mut out: Vec<T> = Vec::with_capacity(n);
    let all_written = out.spare_capacity_mut()[..n]
        .par_chunks_mut(CHUNK)
        .zip(values.par_chunks(CHUNK))
        .all(|(out, values)| fill(values, out));
    if !all_written {
        return None;
    }
    // SAFETY: the capacity holds `n` elements; the chunks cover all of them, and `fill`
    // returned true for every chunk, which it does only after writing each of its elements.
    unsafe { out.set_len(n) };
    Some(out)
}

/// A contiguous bf16 or f16 tensor on the CPU widened to f32 in parallel chunks (bf16 by a
/// shift, f16 by conversion: both exact); `None` for any other tensor.
fn widen_on_host(grad: &Tensor) -> Result<Option<Tensor>> {
    let (storage, layout) = grad.storage_and_layout();
    let Some((from, to)) = layout.contiguous_offsets() else {
        return Ok(None);
    };
    let wide = match &*storage {
        Storage::Cpu(CpuStorage::BF16(data)) => filled(&data[from..to], |values, out| {
            for (o, v) in out.iter_mut().zip(values) {
                o.write(f32::from_bits(u32::from(v.to_bits()) << 16));
            }
            true
        }),
        Storage::Cpu(CpuStorage::F16(data)) => filled(&data[from..to], |values, out| {
            for (o, v) in out.iter_mut().zip(values) {
                o.write(v.to_f32());
            }
            true
        }),
        _ => return Ok(None),
    };
    // Every chunk's `fill` above returns true.
    let wide = wide.ok_or_else(|| ModelError::Input("a gradient chunk was not widened".into()))?;
    Ok(Some(Tensor::from_vec(
        wide,
        grad.shape().clone(),
        &Device::Cpu,
    )?))
}

/// `grad` (contiguous f32) in `narrow` where that holds its values exactly, off the CPU: on a
/// GPU one kernel that narrows and checks in the same pass (`r3_narrow_exact_*`), elsewhere
/// casts and a comparison. One read of the host's for the verdict.
fn narrow_on_device(grad: &Tensor, narrow: DType) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if grad.device().is_cuda() {
        return gpu::narrow_exact(grad, narrow);
    }
    narrow_composed(grad, narrow)
}

/// [`narrow_on_device`] by candle's ops on any device: narrowed and widened again, the values
/// equal the originals everywhere (a NaN never equals itself).
fn narrow_composed(grad: &Tensor, narrow: DType) -> Result<Option<Tensor>> {
    let narrowed = cast16(grad, narrow)?;
    let back = cast16(&narrowed, DType::F32)?;
    let exact = back.eq(grad)?.flatten_all()?.min(0)?.to_scalar::<u8>()? == 1;
    Ok(exact.then_some(narrowed))
}

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::op::BackpropOp;
    use candle_core::{CudaStorage, DType, Storage, Tensor};

    use crate::cuda;
    use crate::error::{ModelError, Result};

    /// `r3_narrow_exact_bf16` / `_f16` over a contiguous f32 gradient on a GPU: the narrowed
    /// tensor when the kernel found every value exact, `None` when it did not.
    pub(super) fn narrow_exact(grad: &Tensor, narrow: DType) -> Result<Option<Tensor>> {
        let n = grad.elem_count();
        let (storage, layout) = grad.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            return Err(ModelError::Input("a GPU gradient off the GPU".into()));
        };
        let dev = cuda::device(storage);
        let x = cuda::view::<f32>(storage, layout, "gradient")?;
        let inexact = dev.alloc_zeros::<u32>(1)?;
        let n64 = n as u64;
        // The narrowed values as a CUDA storage: `$ty`'s kernel writes each of the n.
        macro_rules! narrowed {
            ($kernel:literal, $ty:ty) => {{
                // SAFETY: the kernel's grid-stride loop writes every one of the n elements.
                let out = unsafe { dev.alloc::<$ty>(n) }?;
                let (func, stream) = cuda::kernel(&dev, $kernel)?;
                let mut launch = cuda::CheckedLaunch::new(&stream, &func, $kernel);
                launch.arg(&x).arg(&out).arg(&inexact).arg(&n64);
                // SAFETY: the arguments are the kernel's signature; `x` and `out` hold n
                // elements, `inexact` one.
                unsafe { launch.launch(cuda::elementwise(n)) }?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = match narrow {
            DType::BF16 => narrowed!("r3_narrow_exact_bf16", half::bf16),
            DType::F16 => narrowed!("r3_narrow_exact_f16", half::f16),
            other => {
                return Err(ModelError::Input(format!(
                    "no kernel narrows a gradient to {other:?}"
                )))
            }
        };
        let flag = Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(inexact, dev.clone())),
            1,
            BackpropOp::none(),
            false,
        )
        .to_vec1::<u32>()?;
        if flag.first().copied() != Some(0) {
            return Ok(None);
        }
        Ok(Some(Tensor::from_storage(
            Storage::Cuda(out),
            grad.shape().clone(),
            BackpropOp::none(),
            false,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn tensor(values: Vec<f32>) -> Tensor {
        let n = values.len();
        Tensor::from_vec(values, n, &Device::Cpu).expect("tensor")
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::F32)
            .and_then(|t| t.to_vec1::<f32>())
            .expect("values")
            .into_iter()
            .map(f32::to_bits)
            .collect()
    }

    #[test]
    fn bf16_values_are_kept_in_bf16_and_widen_to_the_same_bits() {
        // Each a bf16 value: 1.5, −2⁻¹³⁰ (subnormal in f32, bf16's too), −0, ∞, 3·2⁹⁰.
        let values = vec![
            1.5,
            -f32::from_bits(0x0001_0000),
            -0.0,
            f32::INFINITY,
            3.0 * 2f32.powi(90),
        ];
        let g = tensor(values);
        let kept = narrow_where_exact(&g, DType::BF16).expect("narrow");
        assert_eq!(kept.dtype(), DType::BF16);
        let widened = in_dtype_of(&kept, &g).expect("widen");
        assert_eq!(widened.dtype(), DType::F32);
        assert_eq!(bits(&widened), bits(&g));
    }

    #[test]
    fn a_value_bf16_does_not_hold_keeps_the_whole_gradient_f32() {
        for odd in [1.0 + 2f32.powi(-10), f32::NAN, f32::from_bits(1)] {
            let g = tensor(vec![1.0, 2.0, odd, 4.0]);
            let kept = narrow_where_exact(&g, DType::BF16).expect("narrow");
            assert_eq!(kept.dtype(), DType::F32, "{odd:e}");
            assert_eq!(bits(&kept), bits(&g));
        }
    }

    #[test]
    fn f16_keeps_its_own_values_only() {
        // 1 + 2⁻¹⁰ is an f16 value (bf16's lower half would not be zero); 2⁻²⁴ its least
        // subnormal. 70,000 is past f16's range and 1 + 2⁻¹¹ between two f16 values.
        let g = tensor(vec![1.0 + 2f32.powi(-10), 2f32.powi(-24), -65504.0]);
        let kept = narrow_where_exact(&g, DType::F16).expect("narrow");
        assert_eq!(kept.dtype(), DType::F16);
        assert_eq!(bits(&kept), bits(&g));
        assert_eq!(
            narrow_where_exact(&g, DType::BF16).expect("bf16").dtype(),
            DType::F32
        );
        for odd in [70_000.0, 1.0 + 2f32.powi(-11)] {
            let g = tensor(vec![1.0, odd]);
            assert_eq!(
                narrow_where_exact(&g, DType::F16).expect("f16").dtype(),
                DType::F32
            );
        }
    }

    #[test]
    fn the_device_path_agrees_with_the_host_path() {
        let cases = [
            vec![1.5f32, -0.25, 0.0, 1024.0],
            vec![1.5, 1.0 + 2f32.powi(-9), 0.0],
            vec![1.0, f32::NAN],
            vec![1.0 + 2f32.powi(-10), 2f32.powi(-24)],
        ];
        for values in cases {
            let g = tensor(values.clone());
            for narrow in [DType::BF16, DType::F16] {
                let host = narrow_on_host(&g, narrow)
                    .expect("host")
                    .expect("a host tensor");
                let device = narrow_composed(&g, narrow).expect("composed");
                assert_eq!(host.is_some(), device.is_some(), "{values:?} {narrow:?}");
                if let (Some(host), Some(device)) = (host, device) {
                    assert_eq!(bits(&host), bits(&device), "{values:?} {narrow:?}");
                    let composed = g.to_dtype(narrow).expect("cast");
                    assert_eq!(bits(&host), bits(&composed), "{values:?} {narrow:?}");
                    let wide = widen_on_host(&host).expect("widen").expect("a host tensor");
                    assert_eq!(bits(&wide), bits(&g), "{values:?} {narrow:?}");
                }
            }
        }
    }

    #[test]
    fn big_gradients_are_narrowed_and_widened_chunk_by_chunk() {
        // Past one chunk, with a value bf16 does not hold in the last chunk only.
        let n = 3 * CHUNK + 5;
        let values: Vec<f32> = (0..n).map(|i| (i % 255) as f32 * 0.25 - 30.0).collect();
        let g = tensor(values.clone());
        let kept = narrow_where_exact(&g, DType::BF16).expect("narrow");
        assert_eq!(kept.dtype(), DType::BF16);
        assert_eq!(bits(&in_dtype_of(&kept, &g).expect("widen")), bits(&g));
        let mut odd = values;
        odd[n - 2] = 1.0 + 2f32.powi(-12);
        let g = tensor(odd);
        assert_eq!(
            narrow_where_exact(&g, DType::BF16).expect("narrow").dtype(),
            DType::F32
        );
    }

    #[test]
    fn other_dtypes_are_refused_and_other_gradients_left_alone() {
        let g = tensor(vec![1.0]);
        assert!(narrow_where_exact(&g, DType::F32).is_err());
        let wide = g.to_dtype(DType::F64).expect("f64");
        assert_eq!(
            narrow_where_exact(&wide, DType::BF16).expect("f64").dtype(),
            DType::F64
        );
    }
}
