//! Stochastic rounding of f32 values to bf16, for weights held in bf16 without an f32 master
//! copy (`train.master_weights = "bf16"` in r3-train).
//!
//! An update smaller than half a bf16 step (a learning rate of 1e-6 on weights near 1 is 128
//! times smaller) vanishes under round-to-nearest, every step, so pure-bf16 weights stop
//! learning; rounded stochastically — up with probability equal to the fraction of the step
//! the value has covered — the weight's expected value follows the f32 update exactly
//! (Zamirai et al., "Revisiting BFloat16 Training"; torchao's `bf16_stochastic_round`). The
//! random bits are a counter-based draw: the `i`-th element of a tensor takes a 32-bit
//! integer hash of `i` and a 64-bit `key` made from the run's seed, the optimiser step and
//! the tensor's index ([`rounding_key`], splitmix64), so every draw is seeded, independent of
//! how the work is split over threads, and the CPU's pass and a GPU's kernel
//! (`r3_round_bf16_stochastic` and the AdamW kernels in `cuda/kernels.cu`) give the same
//! bits. The per-element hash is 32-bit (Wellons' `lowbias32`) so that the CPU's AdamW pass
//! vectorises it: a 64-bit mix per element made that pass 1.5× slower than the f32 one.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::cast16::Widened;
use crate::error::{ModelError, Result};

/// splitmix64's increment γ (2⁶⁴ / φ).
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// splitmix64's output function.
#[inline(always)]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of one tensor's draws at one optimiser step: distinct for every (seed, step,
/// tensor), so no two roundings of a run reuse their bits.
pub fn rounding_key(seed: u64, step: u64, tensor: u64) -> u64 {
    mix(mix(mix(seed).wrapping_add(step.wrapping_mul(GAMMA))).wrapping_add(tensor))
}

/// Wellons' `lowbias32` integer hash.
#[inline(always)]
fn hash32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// The keys of one tensor's moments' draws at one optimiser step (first, second), distinct
/// from every [`rounding_key`] of the weights.
pub fn moment_rounding_keys(seed: u64, step: u64, tensor: u64) -> [u64; 2] {
    // Salts that move the seed's streams away from the weights' (any fixed odd constants).
    const M: u64 = 0x6d6f_6d65_6e74_5f31;
    const V: u64 = 0x6d6f_6d65_6e74_5f32;
    [
        rounding_key(seed ^ M, step, tensor),
        rounding_key(seed ^ V, step, tensor),
    ]
}

/// The key of one tensor's draws when its gradient's sum over micro-batches is held in bf16:
/// the sum after micro-batch `micro` (1 for the second micro-batch's, the first's gradient
/// being held as it came) of the update at optimiser step `step`; distinct from every key of
/// the weights' and moments' roundings.
pub fn sum_rounding_key(seed: u64, step: u64, micro: u64, tensor: u64) -> u64 {
    // A salt that moves the seed's streams away from the weights' and moments' (any fixed
    // constant).
    const SUMS: u64 = 0x6772_6164_5f73_756d;
    rounding_key(rounding_key(seed ^ SUMS, step, micro), 0, tensor)
}

/// The 16 random bits of element `index` under `key`: the top half of a hash of the index's
/// low word and the key's low word, salted by a hash of their high words
/// ([`DrawStream::bits`] for a run of indices sharing their high word).
#[inline(always)]
pub fn rounding_bits(key: u64, index: u64) -> u32 {
    DrawStream::new(key, index >> 32).bits(index as u32)
}

/// The draws of `key` for the indices whose high word is `high` (a run of fewer than 2³²
/// elements starting at a multiple of its length, as the passes' chunks are): the salt
/// hashed once, one hash per draw.
#[derive(Debug, Clone, Copy)]
pub struct DrawStream {
    key: u32,
    salt: u32,
}

impl DrawStream {
    /// The stream of `key` over the indices `high · 2³² ..`.
    #[inline(always)]
    pub fn new(key: u64, high: u64) -> Self {
        Self {
            key: key as u32,
            salt: hash32((high as u32) ^ (key >> 32) as u32),
        }
    }

    /// [`rounding_bits`] of the index whose low word is `low`.
    #[inline(always)]
    pub fn bits(self, low: u32) -> u32 {
        hash32(low ^ self.key ^ self.salt) >> 16
    }
}

/// `x` rounded to bf16 by `bits` (16 random bits): the bf16 below `x` in magnitude, or the
/// one above with probability (`x`'s distance past the one below) / (the step between them).
/// Adding the bits to the 16 bits bf16 drops carries into the kept half exactly then; a carry
/// out of the largest finite value gives ±∞, as an overflowing update should (the guard
/// refuses it). ±∞ stays what it is; every NaN becomes bf16's canonical quiet NaN `0x7fc0`
/// (an f32 sum with a NaN operand gives the operand on a CPU but the one NaN `0x7fffffff` on
/// a GPU, so only one NaN out keeps the CPU's and the kernels' bits equal).
#[inline(always)]
pub fn round_bf16_stochastic(x: f32, bits: u32) -> bf16 {
    // Branch-free (selects), so that the optimiser's pass vectorises: nothing is added to
    // ±∞ or NaN.
    let b = x.to_bits();
    let finite = (b & 0x7f80_0000) != 0x7f80_0000;
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    let add = if finite { bits & 0xffff } else { 0 };
    let rounded = (b.wrapping_add(add) >> 16) as u16;
    bf16::from_bits(if nan { CANONICAL_NAN } else { rounded })
}

/// The one NaN [`round_bf16_stochastic`] gives: bf16's quiet NaN, sign clear.
pub const CANONICAL_NAN: u16 = 0x7fc0;

/// Elements per parallel task of the CPU pass.
const CHUNK: usize = 1 << 15;

/// `values` rounded stochastically into `out` (of the same length), element `i` by the
/// draw `first + i` of `key`, chunks in parallel.
pub fn round_slice_stochastic(values: &[f32], out: &mut [bf16], key: u64, first: u64) {
    round_into(out, key, first, |i| values[i]);
}

/// `out[i]` = `value(i)` rounded by draw `first + i` of `key`, chunks of [`CHUNK`] in
/// parallel; a chunk whose indices share their high word draws from one [`DrawStream`] (its
/// salt hashed once), any other index by index.
fn round_into(out: &mut [bf16], key: u64, first: u64, value: impl Fn(usize) -> f32 + Sync) {
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let start = c * CHUNK;
        let base = first + start as u64;
        let last = base + out.len().saturating_sub(1) as u64;
        if base >> 32 == last >> 32 {
            let stream = DrawStream::new(key, base >> 32);
            for (j, o) in out.iter_mut().enumerate() {
                let bits = stream.bits((base + j as u64) as u32);
                *o = round_bf16_stochastic(value(start + j), bits);
            }
        } else {
            for (j, o) in out.iter_mut().enumerate() {
                let bits = rounding_bits(key, base + j as u64);
                *o = round_bf16_stochastic(value(start + j), bits);
            }
        }
    });
}

/// `t` (f32) rounded stochastically to bf16, element `i` (in row-major order) by draw `i` of
/// `key`; no gradient. On a GPU one kernel (`r3_round_bf16_stochastic`), the same bits.
pub fn stochastic_round_bf16(t: &Tensor, key: u64) -> Result<Tensor> {
    if t.dtype() != DType::F32 {
        return Err(ModelError::Input(format!(
            "stochastic rounding to bf16 takes f32 values, not {:?}",
            t.dtype()
        )));
    }
    if t.elem_count() == 0 {
        return Ok(t.to_dtype(DType::BF16)?);
    }
    Ok(t.contiguous()?.apply_op1_no_bwd(&StochasticRound { key })?)
}

/// The rounding as an op, so that a GPU runs r3's kernel.
#[derive(Debug, Clone, Copy)]
struct StochasticRound {
    key: u64,
}

impl CustomOp1 for StochasticRound {
    fn name(&self) -> &'static str {
        "stochastic-round-bf16"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(data), Some((from, to))) = (storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("stochastic rounding takes a contiguous f32 tensor");
        };
        let values = &data[from..to];
        let mut out = vec![bf16::ZERO; values.len()];
        round_slice_stochastic(values, &mut out, self.key, 0);
        Ok((CpuStorage::BF16(out), layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;

        let shape = layout.shape().clone();
        let n = shape.elem_count();
        // n > 0: `stochastic_round_bf16` answers an empty tensor itself.
        let dev = cuda::device(storage);
        // The kernel's grid-stride loop writes every one of the n elements.
        let out = cuda::launch_typed!(
            dev,
            "r3_round_bf16_stochastic",
            bf16,
            n,
            cuda::elementwise(n),
            [cuda::view::<f32>(
                storage,
                layout,
                "stochastic rounding's input"
            )?],
            [n as u64, self.key]
        );
        Ok((out, shape))
    }
}

/// `a + b` (each f32 or bf16, of one shape) computed in f32 and rounded to bf16
/// stochastically, element `i` (in row-major order) by draw `i` of `key`; no gradient. A
/// gradient summed over micro-batches and held in bf16 takes one such sum per micro-batch:
/// unbiased, where rounding to nearest drops every addend under half a bf16 step of the sum.
/// One pass over both (no widened copies); on a GPU one kernel (`r3_sum_bf16_stochastic_*`),
/// the same bits.
pub fn sum_round_bf16_stochastic(a: &Tensor, b: &Tensor, key: u64) -> Result<Tensor> {
    let wide_enough = |t: &Tensor| matches!(t.dtype(), DType::F32 | DType::BF16);
    if !wide_enough(a) || !wide_enough(b) {
        return Err(ModelError::Input(format!(
            "a stochastically rounded sum takes f32 or bf16 addends, not {:?} and {:?}",
            a.dtype(),
            b.dtype()
        )));
    }
    if a.dims() != b.dims() {
        return Err(ModelError::Input(format!(
            "a stochastically rounded sum takes addends of one shape, not {:?} and {:?}",
            a.dims(),
            b.dims()
        )));
    }
    if a.elem_count() == 0 {
        return Ok(a.to_dtype(DType::BF16)?);
    }
    Ok(a.contiguous()?
        .apply_op2_no_bwd(&b.contiguous()?, &StochasticSum { key })?)
}

/// `out[i]` = `a[i] + b[i]` in f32, rounded by draw `i` of `key`.
fn sum_slices_stochastic<A: Widened, B: Widened>(a: &[A], b: &[B], out: &mut [bf16], key: u64) {
    round_into(out, key, 0, |i| a[i].wide() + b[i].wide());
}

/// The stochastically rounded sum as an op, so that a GPU runs r3's kernel.
#[derive(Debug, Clone, Copy)]
struct StochasticSum {
    key: u64,
}

impl candle_core::CustomOp2 for StochasticSum {
    fn name(&self) -> &'static str {
        "stochastic-sum-bf16"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        la: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (Some((a0, a1)), Some((b0, b1))) = (la.contiguous_offsets(), lb.contiguous_offsets())
        else {
            candle_core::bail!("a stochastically rounded sum takes contiguous addends");
        };
        let mut out = vec![bf16::ZERO; a1 - a0];
        match (a, b) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => {
                sum_slices_stochastic(&a[a0..a1], &b[b0..b1], &mut out, self.key)
            }
            (CpuStorage::F32(a), CpuStorage::BF16(b)) => {
                sum_slices_stochastic(&a[a0..a1], &b[b0..b1], &mut out, self.key)
            }
            (CpuStorage::BF16(a), CpuStorage::F32(b)) => {
                sum_slices_stochastic(&a[a0..a1], &b[b0..b1], &mut out, self.key)
            }
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => {
                sum_slices_stochastic(&a[a0..a1], &b[b0..b1], &mut out, self.key)
            }
            _ => candle_core::bail!("a stochastically rounded sum takes f32 or bf16 addends"),
        }
        Ok((CpuStorage::BF16(out), la.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a: &candle_core::CudaStorage,
        la: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        use candle_core::backend::BackendStorage;

        let shape = la.shape().clone();
        let n = shape.elem_count();
        // n > 0: `sum_round_bf16_stochastic` answers empty addends itself.
        let dev = cuda::device(a);
        macro_rules! sum_kernel {
            ($name:expr, $ta:ty, $tb:ty) => {
                // The kernel's grid-stride loop writes every one of the n elements.
                cuda::launch_typed!(
                    dev,
                    $name,
                    bf16,
                    n,
                    cuda::elementwise(n),
                    [
                        cuda::view::<$ta>(a, la, "the sum's first addend")?,
                        cuda::view::<$tb>(b, lb, "the sum's second addend")?
                    ],
                    [n as u64, self.key]
                )
            };
        }
        let out = match (a.dtype(), b.dtype()) {
            (DType::F32, DType::F32) => sum_kernel!("r3_sum_bf16_stochastic_f32_f32", f32, f32),
            (DType::F32, DType::BF16) => sum_kernel!("r3_sum_bf16_stochastic_f32_bf16", f32, bf16),
            (DType::BF16, DType::F32) => sum_kernel!("r3_sum_bf16_stochastic_bf16_f32", bf16, f32),
            (DType::BF16, DType::BF16) => {
                sum_kernel!("r3_sum_bf16_stochastic_bf16_bf16", bf16, bf16)
            }
            _ => candle_core::bail!("a stochastically rounded sum takes f32 or bf16 addends"),
        };
        Ok((out, shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The two bf16 neighbours of a value between them, and the rounding by hand: all bits
    /// below the fraction covered round down, all at or above it round up.
    #[test]
    fn rounds_up_exactly_for_the_covered_fraction_of_draws() {
        let lo = bf16::from_f32(1.0);
        let hi = bf16::from_bits(lo.to_bits() + 1);
        // A quarter of the way from 1 to the next bf16 (1 + 2⁻⁷): low half 0x4000.
        let x = f32::from_bits(1.0f32.to_bits() + 0x4000);
        assert!(x > lo.to_f32() && x < hi.to_f32());
        let ups = (0u32..=0xffff)
            .filter(|&b| round_bf16_stochastic(x, b) == hi)
            .count();
        let downs = (0u32..=0xffff)
            .filter(|&b| round_bf16_stochastic(x, b) == lo)
            .count();
        assert_eq!((ups, downs), (0x4000, 0xc000));
        // Negative values round in magnitude the same way.
        let ups_neg = (0u32..=0xffff)
            .filter(|&b| round_bf16_stochastic(-x, b) == -hi)
            .count();
        assert_eq!(ups_neg, 0x4000);
        // A value bf16 holds exactly never moves.
        assert!((0u32..=0xffff).all(|b| round_bf16_stochastic(1.5, b) == bf16::from_f32(1.5)));
    }

    /// Overflow past bf16's largest finite value gives infinity; infinities stay; every NaN
    /// (quiet or signalling, either sign, a GPU sum's `0x7fffffff`, a payload in the dropped
    /// half alone) becomes the one canonical NaN, whatever the bits drawn.
    #[test]
    fn overflow_and_non_finite_values() {
        let big = bf16::MAX.to_f32();
        let past = f32::from_bits((bf16::MAX.to_bits() as u32) << 16 | 0xffff);
        assert_eq!(round_bf16_stochastic(big, 0xffff), bf16::MAX);
        assert_eq!(round_bf16_stochastic(past, 0), bf16::MAX);
        assert!(round_bf16_stochastic(past, 1).is_infinite());
        assert!(round_bf16_stochastic(-past, 1).is_infinite());
        for nan in [
            0x7fc0_0000,
            0xffc0_0000,
            0x7fff_ffff,
            0x7f80_0001,
            0xff80_0001,
        ] {
            for bits in [0, 7, 0xffff] {
                let got = round_bf16_stochastic(f32::from_bits(nan), bits).to_bits();
                assert_eq!(got, CANONICAL_NAN, "NaN {nan:#x}, bits {bits:#x}: {got:#x}");
            }
        }
        assert_eq!(
            round_bf16_stochastic(f32::NEG_INFINITY, 7),
            bf16::NEG_INFINITY
        );
    }

    /// Over many draws the mean of the rounded values is the value (the rounding is
    /// unbiased), within a few standard errors; round-to-nearest is biased by a quarter step.
    #[test]
    fn the_rounding_is_unbiased() {
        let x = 1.0f32 + 0.25 * 2f32.powi(-7);
        let n = 200_000usize;
        let values = vec![x; n];
        let mut out = vec![bf16::ZERO; n];
        round_slice_stochastic(&values, &mut out, rounding_key(3, 1, 0), 0);
        let mean = out.iter().map(|v| f64::from(v.to_f32())).sum::<f64>() / n as f64;
        let step = 2f64.powi(-7);
        // Bernoulli(¼) over a step: standard error step·√(¼·¾ / n).
        let se = step * (0.25f64 * 0.75 / n as f64).sqrt();
        assert!(
            (mean - f64::from(x)).abs() < 5.0 * se,
            "mean {mean} for {x}: off by {} standard errors",
            (mean - f64::from(x)).abs() / se
        );
        assert!((f64::from(bf16::from_f32(x).to_f32()) - f64::from(x)).abs() > 100.0 * se);
    }

    /// The bits of `t` rounded by `key`'s draws.
    fn rounded_bits(t: &Tensor, key: u64) -> Vec<u16> {
        stochastic_round_bf16(t, key)
            .expect("round")
            .to_vec1::<bf16>()
            .expect("values")
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// The draws are the key's and the index's alone: the op over a tensor equals the slice
    /// pass started anywhere at the right index, another key gives other bits, the same key
    /// the same bits.
    #[test]
    fn draws_depend_on_key_and_index_only() {
        let n = 70_001usize; // past two chunks, with a tail
        let values: Vec<f32> = (0..n).map(|i| 1.0 + (i as f32) * 1e-6).collect();
        let t = Tensor::from_vec(values.clone(), n, &Device::Cpu).expect("tensor");
        let key = rounding_key(11, 5, 2);
        let whole = rounded_bits(&t, key);
        let mut tail = vec![bf16::ZERO; n - 40_000];
        round_slice_stochastic(&values[40_000..], &mut tail, key, 40_000);
        assert!(tail
            .iter()
            .zip(&whole[40_000..])
            .all(|(a, &b)| a.to_bits() == b));
        let other = rounded_bits(&t, rounding_key(11, 6, 2));
        assert_ne!(whole, other);
        let again = rounded_bits(&t, key);
        assert_eq!(whole, again);
        assert!(stochastic_round_bf16(&t.to_dtype(DType::BF16).expect("bf16"), key).is_err());
    }

    /// A stream's draws are [`rounding_bits`]' for its indices, across a high word's end.
    #[test]
    fn a_stream_draws_what_rounding_bits_does() {
        let key = rounding_key(1, 2, 3);
        for index in [0u64, 5, (1 << 32) - 1, 1 << 32, (7 << 32) + 9] {
            let stream = DrawStream::new(key, index >> 32);
            assert_eq!(
                stream.bits(index as u32),
                rounding_bits(key, index),
                "{index}"
            );
        }
        assert_ne!(rounding_bits(key, 5), rounding_bits(key, (1 << 32) + 5));
    }

    /// Keys differ across seeds, steps and tensors.
    #[test]
    fn keys_are_distinct() {
        let keys: std::collections::HashSet<u64> = (0..4)
            .flat_map(|s| (0..16).flat_map(move |t| (0..64).map(move |i| rounding_key(s, t, i))))
            .collect();
        assert_eq!(keys.len(), 4 * 16 * 64);
    }

    /// The stochastically rounded sum of every pair of addend dtypes is the sum in f32
    /// rounded by hand with each index's draw; a third dtype or two shapes are errors.
    #[test]
    fn sums_round_each_f32_sum_by_its_draw() {
        let n = 70_001usize; // past two chunks, with a tail
        let a: Vec<f32> = (0..n).map(|i| 1.0 + (i as f32) * 3e-6).collect();
        let b: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) * 1e-4).collect();
        let (ta, tb) = (
            Tensor::from_vec(a, n, &Device::Cpu).expect("a"),
            Tensor::from_vec(b, n, &Device::Cpu).expect("b"),
        );
        let key = sum_rounding_key(7, 3, 1, 4);
        for (da, db) in [
            (DType::F32, DType::F32),
            (DType::F32, DType::BF16),
            (DType::BF16, DType::F32),
            (DType::BF16, DType::BF16),
        ] {
            let (x, y) = (ta.to_dtype(da).expect("a"), tb.to_dtype(db).expect("b"));
            let got = sum_round_bf16_stochastic(&x, &y, key).expect("sum");
            assert_eq!(got.dtype(), DType::BF16);
            let wide = |t: &Tensor| t.to_dtype(DType::F32).and_then(|t| t.to_vec1::<f32>());
            let (x, y) = (wide(&x).expect("x"), wide(&y).expect("y"));
            let got = got.to_vec1::<bf16>().expect("got");
            let by_hand = x.iter().zip(&y).enumerate().all(|(i, (&x, &y))| {
                got[i].to_bits()
                    == round_bf16_stochastic(x + y, rounding_bits(key, i as u64)).to_bits()
            });
            assert!(by_hand, "{da:?} + {db:?}");
        }
        let f16 = ta.to_dtype(DType::F16).expect("f16");
        assert!(sum_round_bf16_stochastic(&f16, &tb, key).is_err());
        let short = tb.narrow(0, 0, 10).expect("short");
        assert!(sum_round_bf16_stochastic(&ta, &short, key).is_err());
    }

    /// A sum held in bf16 keeps addends far under half its step in expectation: 100,000
    /// sums of 1 and 1/40 of a bf16 step average to 1 + step/40 within 5 standard errors,
    /// where rounding to nearest gives 1 every time.
    #[test]
    fn a_sum_keeps_small_addends_in_expectation() {
        let n = 100_000usize;
        let step = 2f32.powi(-7);
        let a = Tensor::full(bf16::from_f32(1.0), n, &Device::Cpu).expect("a");
        let b = Tensor::full(step / 40.0, n, &Device::Cpu).expect("b");
        let sum = sum_round_bf16_stochastic(&a, &b, sum_rounding_key(1, 1, 1, 0))
            .and_then(|s| Ok(s.to_dtype(DType::F32)?.to_vec1::<f32>()?))
            .expect("sum");
        let mean = sum.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
        let (want, p) = (1.0 + f64::from(step) / 40.0, 1.0 / 40.0);
        let se = f64::from(step) * (p * (1.0 - p) / n as f64).sqrt();
        assert!(
            (mean - want).abs() < 5.0 * se,
            "mean {mean} for {want}: off by {} standard errors",
            (mean - want).abs() / se
        );
        assert_eq!(bf16::from_f32(1.0 + step / 40.0).to_f32(), 1.0);
    }

    /// The sums' keys differ from each other across micro-batches and tensors, and from the
    /// weights' and moments' keys.
    #[test]
    fn sum_keys_are_distinct_from_every_other_key() {
        let mut keys = std::collections::HashSet::new();
        for step in 0..8 {
            for tensor in 0..32 {
                keys.insert(rounding_key(5, step, tensor));
                keys.extend(moment_rounding_keys(5, step, tensor));
                for micro in 1..8 {
                    keys.insert(sum_rounding_key(5, step, micro, tensor));
                }
            }
        }
        assert_eq!(keys.len(), 8 * 32 * (1 + 2 + 7));
    }
}
