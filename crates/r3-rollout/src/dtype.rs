//! The engine's compute precision: which float type weights are stored in and activations
//! are rounded to around every matmul.

use std::fmt;
use std::str::FromStr;

use crate::error::RolloutError;

/// Precision of the rollout engine's matmuls (weights and their inputs/outputs).
/// Norms, softmax, residual stream, attention scores and sampling stay in f32 in both modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dtype {
    /// Half precision weights and matmul inputs/outputs (accumulation in f32): the fast mode.
    #[default]
    F16,
    /// Full precision everywhere: reproduces the HF oracle.
    F32,
}

impl FromStr for Dtype {
    type Err = RolloutError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f16" | "float16" => Ok(Dtype::F16),
            "f32" | "float32" => Ok(Dtype::F32),
            other => Err(RolloutError::InvalidConfig(format!(
                "unknown dtype {other:?}: expected f16 or f32"
            ))),
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
        })
    }
}
