//! What the kernel tests share: a seeded generator for their data, the bits of a slice.

/// A tiny seeded generator (64-bit LCG, Knuth's constants; the high bits), so every test's
/// data is the same at every run.
pub struct Lcg(u64);

#[allow(dead_code)]
impl Lcg {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 32 random bits.
    pub fn next_u32(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 32) as u32
    }

    /// A value uniform in `[lo, hi)` (24 random bits).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let unit = (self.next_u32() >> 8) as f32 / (1u32 << 24) as f32;
        lo + (hi - lo) * unit
    }

    /// `n` values uniform in `[lo, hi)`.
    pub fn values(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    /// A number below `n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        ((u64::from(self.next_u32()) * n as u64) >> 32) as usize
    }
}

/// The bit patterns of `v` (NaN payloads kept: kernels are compared bit for bit).
#[allow(dead_code)]
pub fn f32_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
