//! Scalar math shared by the training kernels (f32/f64) and the inference engine: the
//! `Float` abstraction, a vectorisable `exp` for f32, and log-sum-exp over a row.

/// A float type the training kernels run in.
pub trait Float:
    Copy
    + Send
    + Sync
    + 'static
    + PartialEq
    + std::ops::Add<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Sub<Output = Self>
{
    /// Additive identity.
    const ZERO: Self;
    /// Multiplicative identity.
    const ONE: Self;
    /// Negative infinity.
    const NEG_INFINITY: Self;
    /// `e^x` (f32: [`fast_exp`]).
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// The larger of two values.
    fn max(self, other: Self) -> Self;
    /// Widening to f64.
    fn to_f64(self) -> f64;
    /// Narrowing from f64.
    fn from_f64(x: f64) -> Self;
    /// `1 / (1 + e^{-x})`.
    fn sigmoid(self) -> Self;
}

impl Float for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    #[inline(always)]
    fn exp(self) -> Self {
        fast_exp(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f32::ln(self)
    }
    #[inline(always)]
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn sigmoid(self) -> Self {
        sigmoid(self)
    }
}

impl Float for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f64::ln(self)
    }
    #[inline(always)]
    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn sigmoid(self) -> Self {
        1.0 / (1.0 + (-self).exp())
    }
}

/// Float arithmetic with std's `exp` and `ln`, the functions candle's composed CPU ops use: for
/// the CPU twins of r3's CUDA kernels (`layers/attention/softmax.rs`, `token_rows.rs`), which
/// equal those ops bit for bit ([`Float`]'s f32 `exp` is the faster [`fast_exp`]).
pub trait StdFloat:
    Copy
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    /// Additive identity.
    const ZERO: Self;
    /// Negative infinity.
    const NEG_INFINITY: Self;
    /// Not a number.
    const NAN: Self;
    /// `e^x`, std's.
    fn exp(self) -> Self;
    /// Natural logarithm, std's.
    fn ln(self) -> Self;
    /// Narrowing from f64.
    fn from_f64(x: f64) -> Self;
}

macro_rules! std_float {
    ($t:ty) => {
        impl StdFloat for $t {
            const ZERO: Self = 0.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            const NAN: Self = <$t>::NAN;
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn from_f64(x: f64) -> Self {
                x as $t
            }
        }
    };
}
std_float!(f32);
std_float!(f64);

/// `e^x` for f32 with a Cody–Waite range reduction and a degree-6 polynomial (max relative
/// error about 2e-7, i.e. within a couple of ulp of libm), written so it vectorises: no
/// rounding or float-to-int calls, which LLVM leaves scalar; the input is clamped to
/// [-87.3, 88.7] (the normal f32 range).
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    // Adding 1.5 · 2^23 rounds to the nearest integer (ties to even) and leaves it in the
    // low mantissa bits, where the exponent bits below pick it up without a conversion.
    const SHIFT: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.7);
    let shifted = x.mul_add(std::f32::consts::LOG2_E, SHIFT);
    let n = shifted - SHIFT;
    // ln 2 split in a part exact in f32 and a remainder.
    let r = n.mul_add(-0.693_145_75, x);
    let r = n.mul_add(-1.428_606_8e-6, r);
    let p = 1.987_569_1e-4f32;
    let p = p.mul_add(r, 1.398_199_9e-3);
    let p = p.mul_add(r, 8.333_452e-3);
    let p = p.mul_add(r, 4.166_579_6e-2);
    let p = p.mul_add(r, 1.666_666_5e-1);
    let p = p.mul_add(r, 0.5);
    let p = (p * r).mul_add(r, r) + 1.0;
    // n + 127 lies in [1, 255] for the clamped input
    let bits = shifted
        .to_bits()
        .wrapping_sub(SHIFT.to_bits())
        .wrapping_add(127)
        << 23;
    p * f32::from_bits(bits)
}

/// Logistic sigmoid `1 / (1 + e^{-x})` on [`fast_exp`]: the one f32 sigmoid of both engines
/// (routers, gated shared experts, the training kernels).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + fast_exp(-x))
}

/// Lanes of the row sums below: independent accumulators let the loop vectorise.
const LANES: usize = 16;

/// `Σ f(x)` over a row, accumulated in `LANES` lanes and reduced in f64.
#[inline(always)]
pub fn lane_sum<T: Float>(row: &[T], f: impl Fn(T) -> T) -> f64 {
    let mut acc = [T::ZERO; LANES];
    let chunks = row.chunks_exact(LANES);
    let rem = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] = acc[i] + f(c[i]);
        }
    }
    acc.iter().map(|v| v.to_f64()).sum::<f64>() + rem.iter().map(|&v| f(v).to_f64()).sum::<f64>()
}

/// `Σ a·b` over two rows of equal length, accumulated in `LANES` lanes and reduced in f64.
#[inline(always)]
pub fn lane_dot<T: Float>(a: &[T], b: &[T]) -> f64 {
    let mut acc = [T::ZERO; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] = acc[i] + x[i] * y[i];
        }
    }
    acc.iter().map(|v| v.to_f64()).sum::<f64>()
        + ra.iter()
            .zip(rb)
            .map(|(&x, &y)| (x * y).to_f64())
            .sum::<f64>()
}

/// The largest value of a row (`-inf` for an empty one), in `LANES` lanes.
#[inline(always)]
pub fn row_max<T: Float>(row: &[T]) -> T {
    let mut acc = [T::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let rem = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] = acc[i].max(c[i]);
        }
    }
    acc.iter()
        .chain(rem)
        .fold(T::NEG_INFINITY, |m, &v| m.max(v))
}

/// `ln Σ exp(row)` (log-sum-exp), shifted by the row maximum.
pub fn log_sum_exp<T: Float>(row: &[T]) -> T {
    let max = row_max(row);
    let sum = lane_sum(row, |z| (z - max).exp());
    max + T::from_f64(sum.ln())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_libm() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (fast_exp(x) as f64, (x as f64).exp());
            worst = worst.max(((a - b) / b).abs());
            x += 0.0137;
        }
        assert!(worst < 1e-6, "relative error {worst}");
        assert_eq!(fast_exp(-200.0), fast_exp(-87.3));
        assert_eq!(fast_exp(0.0), 1.0);
        assert!(fast_exp(f32::NAN).is_nan());
    }

    #[test]
    fn lane_dot_equals_the_f64_dot_product() {
        // 37 values: two full chunks of lanes and a remainder.
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 1.3).cos()).collect();
        let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
        assert!((lane_dot(&a, &b) - want).abs() < 1e-6);
        assert_eq!(lane_dot::<f32>(&[], &[]), 0.0);
        assert_eq!(lane_dot(&[2.0f64; 3], &[0.5; 3]), 3.0);
    }

    #[test]
    fn sigmoid_matches_the_logistic_function() {
        for i in -400..=400 {
            let x = i as f32 * 0.05;
            let want = 1.0 / (1.0 + (-(x as f64)).exp());
            assert!((sigmoid(x) as f64 - want).abs() < 3e-7, "x = {x}");
        }
        assert_eq!(sigmoid(0.0), 0.5);
        assert_eq!(sigmoid(100.0), 1.0);
        assert!(sigmoid(-200.0) >= 0.0 && sigmoid(-200.0) < 1e-37);
    }

    #[test]
    fn log_sum_exp_by_hand() {
        // ln(e^1 + e^2 + e^3) over 37 copies (lanes plus a remainder)
        let row: Vec<f64> = (0..37).map(|i| (i % 3 + 1) as f64).collect();
        let want = (0..37)
            .map(|i| ((i % 3 + 1) as f64).exp())
            .sum::<f64>()
            .ln();
        assert!((log_sum_exp(&row) - want).abs() < 1e-12);
        let row32: Vec<f32> = row.iter().map(|&v| v as f32).collect();
        assert!((log_sum_exp(&row32) as f64 - want).abs() < 1e-5);
    }
}
