//! Rounding f32 values on host slices to the nearest 16-bit float (bf16 or f16, ties to
//! even) and widening them back: the one definition the training forward's rounding points
//! ([`crate::precision::RoundTo`] on the CPU) and the rollout engine's 16-bit modes share.
//! The values are bit for bit those of `half`'s conversions (candle's casts), computed
//! without a 16-bit buffer on the heap.

use candle_core::DType;
use half::{f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;

/// Rounds every value to the nearest bf16 (ties to even), in place; the same values as
/// `half::bf16::from_f32` (NaN stays a quiet NaN, overflow goes to infinity), computed on the
/// bits without branches so the loop vectorises (it runs at every op boundary).
pub fn round_to_bf16(v: &mut [f32]) {
    for x in v.iter_mut() {
        *x = f32::from_bits(bf16_round_bits(x.to_bits()));
    }
}

/// Rounds every value to the nearest f16 (ties to even; past the f16 range to infinity), in
/// place, through a small stack buffer (this runs on every matmul of the f16 modes).
pub fn round_to_f16(v: &mut [f32]) {
    let mut h = [f16::ZERO; 256];
    for chunk in v.chunks_mut(256) {
        let h = &mut h[..chunk.len()];
        h.convert_from_f32_slice(chunk);
        h.convert_to_f32_slice(chunk);
    }
}

/// The bits of the bf16 nearest to `v`: `half::bf16::from_f32(v).to_bits()`, branch-free.
#[inline(always)]
pub fn bf16_bits(v: f32) -> u16 {
    (bf16_round_bits(v.to_bits()) >> 16) as u16
}

/// The f32 bits of the bf16 nearest to the f32 with bits `b`.
#[inline(always)]
fn bf16_round_bits(b: u32) -> u32 {
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000;
    let quiet_nan = (b | 0x0040_0000) & 0xFFFF_0000;
    if (b & 0x7FFF_FFFF) > 0x7F80_0000 {
        quiet_nan
    } else {
        rounded
    }
}

/// The in-place rounding to `narrow` (bf16 or f16); None for any other dtype.
pub fn rounding_to(narrow: DType) -> Option<fn(&mut [f32])> {
    match narrow {
        DType::BF16 => Some(round_to_bf16),
        DType::F16 => Some(round_to_f16),
        _ => None,
    }
}

/// [`rounding_to`] for an op's kernel: the error names `what` when `narrow` is not a
/// 16-bit float.
pub fn rounding_for(narrow: DType, what: &str) -> candle_core::Result<fn(&mut [f32])> {
    match rounding_to(narrow) {
        Some(round) => Ok(round),
        None => candle_core::bail!("{what}: no rounding to {narrow:?}"),
    }
}

/// Values a task of [`rounded_copy`] takes: large enough that a task outweighs its dispatch,
/// small enough that a bf16 training step's activations split over every thread.
pub(crate) const ELEMS_PER_TASK: usize = 1 << 16;

/// `src` rounded by `round` into a new vector, in one pass, chunks side by side on the rayon
/// pool (every value is rounded on its own, so the result does not depend on the threads).
pub fn rounded_copy(src: &[f32], round: fn(&mut [f32])) -> Vec<f32> {
    let mut dst = vec![0f32; src.len()];
    dst.par_chunks_mut(ELEMS_PER_TASK)
        .zip(src.par_chunks(ELEMS_PER_TASK))
        .for_each(|(d, s)| {
            d.copy_from_slice(s);
            round(d);
        });
    dst
}

/// Rounds `values` by `round` in place, chunks side by side on the rayon pool (each value is
/// rounded on its own: the result does not depend on the threads).
pub fn round_in_place(values: &mut [f32], round: fn(&mut [f32])) {
    values.par_chunks_mut(ELEMS_PER_TASK).for_each(round);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_keeps_eight_significant_bits_ties_to_even() {
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
        // 1 + 3·2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: ties go to 1 + 2^-6.
        let mut v = [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 3.0, -0.1];
        round_to_bf16(&mut v);
        assert_eq!(v[0], 1.0);
        assert_eq!(v[1], 1.0 + 2f32.powi(-6));
        assert_eq!(v[2], 3.0);
        // -0.1 = -0x3DCCCCCD: the upper 16 bits 0xBDCD after rounding up the 0xCCCD tail.
        assert_eq!(v[3].to_bits(), 0xBDCD_0000);
    }

    /// Edge values and a sweep over exponents and low mantissa bits, ties included.
    fn sweep() -> Vec<f32> {
        let mut values = vec![
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
            3.3961514e38,
            65504.0,
            65520.0,
            6.0e-8,
        ];
        values.extend((0..200_000u32).map(|i| f32::from_bits(i.wrapping_mul(0x9E37_79B1))));
        values
    }

    #[test]
    fn both_roundings_equal_half_on_edge_cases_and_a_sweep() {
        let values = sweep();
        /// An in-place rounding, its per-value reference from `half`, and its name.
        type Case = (fn(&mut [f32]), fn(f32) -> f32, &'static str);
        let cases: [Case; 2] = [
            (round_to_bf16, |v| half::bf16::from_f32(v).to_f32(), "bf16"),
            (round_to_f16, |v| f16::from_f32(v).to_f32(), "f16"),
        ];
        for (round, reference, name) in cases {
            let mut got = values.clone();
            round(&mut got);
            for (v, g) in values.iter().zip(&got) {
                let want = reference(*v);
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "{name}: {v:e} ({:#x}): {g:e} vs half {want:e}",
                    v.to_bits()
                );
            }
        }
    }

    #[test]
    fn the_parallel_copy_rounds_every_value_once_and_keeps_the_source() {
        // Longer than several tasks, with a ragged last one.
        let src: Vec<f32> = (0..3 * ELEMS_PER_TASK + 17)
            .map(|i| (i as f32 * 0.377).sin() * 1e3)
            .collect();
        let kept = src.clone();
        for narrow in [DType::BF16, DType::F16] {
            let round = rounding_to(narrow).expect("a 16-bit float");
            let got = rounded_copy(&src, round);
            let mut want = src.clone();
            round(&mut want);
            assert_eq!(got.len(), src.len());
            assert!(got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            // Rounding twice changes nothing: each value went through once, to a 16-bit one.
            assert_eq!(rounded_copy(&got, round), got);
        }
        assert_eq!(src, kept);
        assert!(rounding_to(DType::F32).is_none());
    }
}
