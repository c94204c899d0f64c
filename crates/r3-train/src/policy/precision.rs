//! The `[train]` section: the training forward's precision (Megatron-style mixed precision:
//! f32 master weights and optimiser, bf16 or f16 matmuls and activations), the router's, and
//! the device the training engine runs on.

use r3_model::{DeviceSpec, Precision};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// Training-engine precision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainPrecisionConfig {
    /// `f32` (full precision), `bf16` (matmul inputs/outputs and activations rounded to
    /// bf16, f32 accumulation, f32 master weights and optimiser) or `f16` (the same rounding
    /// points in f16, the FP16 paper's training side). Default `f32`.
    pub dtype: String,
    /// Router logits in bf16 / f16 mode: `model` (or the dtype's name: the gate as a 16-bit
    /// projection like every other) or `f32`
    /// (Megatron's `moe_router_dtype = fp32`). Default `model`.
    pub router_dtype: String,
    /// Where the policy, its gradients and the optimiser live: `cpu`, `cuda` or `cuda:N`
    /// (needs a build with the `cuda` feature, `scripts/cuda/build.sh`). Default `cpu`.
    pub device: String,
}

impl Default for TrainPrecisionConfig {
    fn default() -> Self {
        Self {
            dtype: "f32".into(),
            router_dtype: "model".into(),
            device: "cpu".into(),
        }
    }
}

impl TrainPrecisionConfig {
    /// The device these settings name (not yet opened); an unknown name is an error.
    pub fn device_spec(&self) -> Result<DeviceSpec> {
        Ok(self.device.parse::<DeviceSpec>()?)
    }

    /// The forward precision these settings name; an unknown value is a config error.
    pub fn precision(&self) -> Result<Precision> {
        let bad = |field: &'static str, reason: String| TrainError::InvalidConfig { field, reason };
        let router_f32 = match self.router_dtype.as_str() {
            "model" | "bf16" | "f16" => false,
            "f32" => true,
            other => {
                return Err(bad(
                    "train.router_dtype",
                    format!(
                        "`{other}` must be `model` (the training dtype, `bf16`/`f16`) or `f32`"
                    ),
                ))
            }
        };
        match self.dtype.as_str() {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16 { router_f32 }),
            "f16" => Ok(Precision::F16 { router_f32 }),
            other => Err(bad(
                "train.dtype",
                format!("`{other}` must be `f32`, `bf16` or `f16`"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_setting_and_rejects_others() {
        let cfg = |dtype: &str, router: &str| TrainPrecisionConfig {
            dtype: dtype.into(),
            router_dtype: router.into(),
            device: "cpu".into(),
        };
        assert_eq!(
            TrainPrecisionConfig::default().precision().ok(),
            Some(Precision::F32)
        );
        assert_eq!(
            cfg("bf16", "f32").precision().ok(),
            Some(Precision::Bf16 { router_f32: true })
        );
        assert_eq!(
            cfg("bf16", "bf16").precision().ok(),
            Some(Precision::Bf16 { router_f32: false })
        );
        assert_eq!(
            cfg("f16", "model").precision().ok(),
            Some(Precision::F16 { router_f32: false })
        );
        assert!(cfg("f8", "model").precision().is_err());
        assert!(cfg("bf16", "f8").precision().is_err());
    }

    #[test]
    fn device_defaults_to_the_cpu_and_bad_names_say_so() {
        let default = TrainPrecisionConfig::default();
        assert_eq!(default.device_spec().ok(), Some(DeviceSpec::Cpu));
        let with = |device: &str| TrainPrecisionConfig {
            device: device.into(),
            ..TrainPrecisionConfig::default()
        };
        assert_eq!(
            with("cuda:1").device_spec().ok(),
            Some(DeviceSpec::Cuda { ordinal: 1 })
        );
        let err = with("gpu").device_spec().expect_err("gpu").to_string();
        assert!(
            err.starts_with("train.device:") && err.contains("`gpu`"),
            "{err}"
        );
    }
}
