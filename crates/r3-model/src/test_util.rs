//! Helpers of the custom ops' unit tests: seeded tensors, the largest difference and the
//! bits of a tensor's values.

use candle_core::{DType, Device, Tensor};

/// A tensor of `shape` with seeded values in [-1, 1) (an LCG), in `dtype`.
pub fn seeded_tensor(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    let data: Vec<f64> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("seeded tensor")
}

/// `max |a − b|` over all elements, as f64.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .and_then(|d| d.abs())
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.max(0))
        .and_then(|d| d.to_dtype(DType::F64))
        .and_then(|d| d.to_scalar::<f64>())
        .expect("max abs diff")
}

/// The bit patterns of an f32 tensor's values in row-major order (bit-for-bit comparisons:
/// `-0.0` and `0.0` differ, a NaN equals itself).
pub fn f32_bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("f32 values")
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// The bit patterns of a float tensor's values widened to f64 (exact for f32 and f64) in
/// row-major order: bit-for-bit comparisons of either dtype.
pub fn f64_bits(t: &Tensor) -> Vec<u64> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .expect("f64 values")
        .iter()
        .map(|v| v.to_bits())
        .collect()
}
