//! The float formats an engine can hold weights in, and the finite range of each: what the
//! weight checks (`finite.rs`) hold every tensor against. Free of any error type, so the
//! crate's error can name a precision without importing the checks.

use std::fmt;

use half::{bf16, f16};

/// The float format an engine holds weights in: every weight must lie in its finite range,
/// or the engine would turn it into ±inf (and the forward pass into NaN).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum WeightPrecision {
    /// f32: any finite value.
    #[default]
    F32,
    /// bf16: f32's exponent range, largest finite 3.3895e38.
    Bf16,
    /// f16: largest finite 65504.
    F16,
}

impl WeightPrecision {
    /// The largest finite magnitude of the format.
    pub fn max_finite(self) -> f64 {
        match self {
            WeightPrecision::F32 => f64::from(f32::MAX),
            WeightPrecision::Bf16 => bf16::MAX.to_f64(),
            WeightPrecision::F16 => f16::MAX.to_f64(),
        }
    }

    /// Whether `value` is finite and no larger in magnitude than [`Self::max_finite`].
    pub fn holds(self, value: f64) -> bool {
        value.abs() <= self.max_finite()
    }
}

impl fmt::Display for WeightPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WeightPrecision::F32 => "f32",
            WeightPrecision::Bf16 => "bf16",
            WeightPrecision::F16 => "f16",
        })
    }
}
