//! A tensor's values as bit patterns, the form the workspace's bit-for-bit comparisons take.

use candle_core::{DType, Device, Tensor};

/// The bits of `t`'s values in row-major order, on any device and in any float dtype
/// (widened to f32 first: exact from bf16 and f16).
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.to_device(&Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("a tensor's values")
        .iter()
        .map(|v| v.to_bits())
        .collect()
}
