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
    /// Router logits in bf16 / f16 mode: `model` (or `dtype`'s own name: the gate as a 16-bit
    /// projection like every other) or `f32` (Megatron's `moe_router_dtype = fp32`); another
    /// dtype's name is refused. Default `model`.
    pub router_dtype: String,
    /// Where the policy, its gradients and the optimiser live: `cpu`, `cuda` or `cuda:N`
    /// (needs a build with the `cuda` feature, `scripts/cuda/build.sh`). Default `cpu`.
    pub device: String,
    /// In bf16 / f16: whether a 16-bit copy of every weight matrix is held beside its f32
    /// master weight, rewritten by the optimiser after each update and read by the matmuls
    /// instead of a cast of the weight at every use (Megatron's bf16 model parameters; 2
    /// bytes more per parameter, the same results bit for bit). `auto` (on a GPU, where the
    /// casts are a pass over every weight each; on the CPU the rounding costs the same
    /// either way), `on` or `off`. Default `auto`.
    pub narrow_weight_copies: String,
    /// In bf16 / f16: whether each weight's gradient is kept in 16 bits from the moment the
    /// backward completes it, where 16 bits hold it exactly, which a 16-bit forward's weight
    /// gradients do (Megatron's bf16 gradients beside fp32 main parameters): 2 bytes a
    /// parameter instead of 4 until the optimiser, the same update bit for bit, for one pass
    /// over each gradient. Default false.
    pub narrow_gradients: bool,
    /// The dtype the weight matrices are held and updated in: `f32` (f32 master weights, the
    /// default) or `bf16` (with `dtype = "bf16"`: the embedding and every matrix the forward
    /// rounds to bf16 — projections, experts, the head, and the router unless
    /// `router_dtype = "f32"` — held in bf16 with no f32 copy, 2 bytes a parameter instead of
    /// 4, their gradients bf16 as the GEMMs write them (the embedding's, each row's f32 sum,
    /// rounded once); AdamW keeps f32 moments, computes each update in f32 and rounds the new
    /// weight to bf16 stochastically, seeded by the run's seed; checkpoints hold those
    /// tensors in bf16). Norm scales and biases stay f32.
    pub master_weights: String,
    /// The dtype a bf16 weight's gradient is summed in over an update's micro-batches
    /// (`algo.max_tokens_per_micro_batch`; DeepSpeed's `grad_accum_dtype`): `f32` (default:
    /// 4 bytes a parameter from the second micro-batch on) or `bf16` (with `master_weights =
    /// "bf16"`: 2 bytes a parameter, as the gradients of one micro-batch are; each sum
    /// computed in f32 and rounded to bf16 stochastically, seeded by the run's seed, so the
    /// sum is unbiased where rounding to nearest drops every addend under half a bf16 step).
    /// f32 variables (norm scales, biases) are summed in f32 either way.
    pub grad_accum_dtype: String,
}

/// The dtype a trainer holds its weight matrices (its master weights) in
/// (`train.master_weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MasterWeights {
    /// f32 master weights: mixed precision's usual scheme.
    F32,
    /// The embedding and the matrices the bf16 forward rounds held in bf16, updated with
    /// stochastic rounding.
    Bf16,
}

impl Default for TrainPrecisionConfig {
    fn default() -> Self {
        Self {
            dtype: "f32".into(),
            router_dtype: "model".into(),
            device: "cpu".into(),
            narrow_weight_copies: "auto".into(),
            narrow_gradients: false,
            master_weights: "f32".into(),
            grad_accum_dtype: "f32".into(),
        }
    }
}

impl TrainPrecisionConfig {
    /// The device these settings name (not yet opened); an unknown name is an error.
    pub fn device_spec(&self) -> Result<DeviceSpec> {
        Ok(self.device.parse::<DeviceSpec>()?)
    }

    /// Whether the policy holds 16-bit copies of its weights (`narrow_weight_copies`) when
    /// it lives on `device`; an unknown value, or `on` in f32, is a config error.
    pub fn holds_narrow_copies(&self, device: &candle_core::Device) -> Result<bool> {
        // Matrices held in bf16 are their own 16-bit copies.
        let bf16_masters = self.master_weights()? == MasterWeights::Bf16;
        let mixed = self.precision()?.is_mixed() && !bf16_masters;
        match self.narrow_weight_copies.as_str() {
            "on" if bf16_masters => Err(TrainError::InvalidConfig {
                field: "train.narrow_weight_copies",
                reason: "`on` holds 16-bit copies beside f32 master weights; with \
                         train.master_weights = \"bf16\" the matrices are held in bf16 already"
                    .into(),
            }),
            "auto" => Ok(mixed && !device.is_cpu()),
            "on" if mixed => Ok(true),
            "on" => Err(TrainError::InvalidConfig {
                field: "train.narrow_weight_copies",
                reason: "`on` needs train.dtype = bf16 or f16 (f32 has nothing to copy)".into(),
            }),
            "off" => Ok(false),
            other => Err(TrainError::InvalidConfig {
                field: "train.narrow_weight_copies",
                reason: format!("`{other}` must be `auto`, `on` or `off`"),
            }),
        }
    }

    /// Refuses `narrow_gradients` in f32, where there is no 16-bit dtype to keep the
    /// gradients in.
    pub fn check_narrow_gradients(&self) -> Result<()> {
        if self.narrow_gradients && !self.precision()?.is_mixed() {
            return Err(TrainError::InvalidConfig {
                field: "train.narrow_gradients",
                reason: "needs train.dtype = bf16 or f16 (f32 gradients have no narrower form)"
                    .into(),
            });
        }
        Ok(())
    }

    /// The dtype the weight matrices are held in; an unknown value, or `bf16` with a
    /// `dtype` other than `bf16`, is a config error.
    pub fn master_weights(&self) -> Result<MasterWeights> {
        match self.master_weights.as_str() {
            "f32" => Ok(MasterWeights::F32),
            "bf16" if self.dtype == "bf16" => Ok(MasterWeights::Bf16),
            "bf16" => Err(TrainError::InvalidConfig {
                field: "train.master_weights",
                reason: format!(
                    "`bf16` needs train.dtype = \"bf16\" (it is `{}`): the forward must round \
                     the matrices to the dtype they are held in",
                    self.dtype
                ),
            }),
            other => Err(TrainError::InvalidConfig {
                field: "train.master_weights",
                reason: format!("`{other}` must be `f32` or `bf16`"),
            }),
        }
    }

    /// Whether bf16 weights' gradients are summed over micro-batches in bf16
    /// (`grad_accum_dtype`); an unknown value, or `bf16` without bf16 weights, is a config
    /// error.
    pub fn bf16_gradient_sums(&self) -> Result<bool> {
        match self.grad_accum_dtype.as_str() {
            "f32" => Ok(false),
            "bf16" if self.master_weights()? == MasterWeights::Bf16 => Ok(true),
            "bf16" => Err(TrainError::InvalidConfig {
                field: "train.grad_accum_dtype",
                reason: "`bf16` sums the gradients of weights held in bf16: it needs \
                         train.master_weights = \"bf16\" (f32 master weights keep f32 sums)"
                    .into(),
            }),
            other => Err(TrainError::InvalidConfig {
                field: "train.grad_accum_dtype",
                reason: format!("`{other}` must be `f32` or `bf16`"),
            }),
        }
    }

    /// The forward precision these settings name; an unknown value is a config error, and so
    /// is a router dtype named `bf16` / `f16` that is not `train.dtype` (the router runs in
    /// the training dtype or in f32, so another would be silently replaced).
    pub fn precision(&self) -> Result<Precision> {
        let bad = |field: &'static str, reason: String| TrainError::InvalidConfig { field, reason };
        let dtype = self.dtype.as_str();
        let router_f32 = match self.router_dtype.as_str() {
            "model" => false,
            "f32" => true,
            named @ ("bf16" | "f16") if named == dtype => false,
            named @ ("bf16" | "f16") => {
                return Err(bad(
                    "train.router_dtype",
                    format!(
                        "`{named}` is not train.dtype (`{dtype}`): the router runs in the \
                         model dtype (`model`, here `{dtype}`) or in `f32`"
                    ),
                ))
            }
            other => {
                return Err(bad(
                    "train.router_dtype",
                    format!(
                        "`{other}` must be `model` (the training dtype, or its name: `bf16` / \
                         `f16`) or `f32`"
                    ),
                ))
            }
        };
        match dtype {
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
            ..TrainPrecisionConfig::default()
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
        assert_eq!(
            cfg("f16", "f16").precision().ok(),
            Some(Precision::F16 { router_f32: false })
        );
    }

    /// A router dtype named `bf16` / `f16` that is not the training dtype would be replaced
    /// by it (a bf16 router in f16 training, an f32 router in f32 training): refused, naming
    /// the key and the dtypes the router can run in.
    #[test]
    fn a_named_router_dtype_must_be_the_training_dtype() {
        for (dtype, router) in [
            ("bf16", "f16"),
            ("f16", "bf16"),
            ("f32", "bf16"),
            ("f32", "f16"),
        ] {
            let cfg = TrainPrecisionConfig {
                dtype: dtype.into(),
                router_dtype: router.into(),
                ..TrainPrecisionConfig::default()
            };
            let err = cfg.precision().expect_err(router).to_string();
            assert!(err.contains("train.router_dtype"), "{err}");
            assert!(
                err.contains("model dtype") && err.contains("`f32`"),
                "{err}"
            );
        }
    }

    /// `auto` holds copies in bf16 / f16 off the CPU only; `on` holds them in bf16 / f16
    /// anywhere and is refused in f32; `off` never; other values are refused.
    #[test]
    fn narrow_weight_copies_follow_the_setting_the_dtype_and_the_device() {
        let cpu = candle_core::Device::Cpu;
        let with = |dtype: &str, copies: &str| TrainPrecisionConfig {
            dtype: dtype.into(),
            narrow_weight_copies: copies.into(),
            ..TrainPrecisionConfig::default()
        };
        assert_eq!(
            with("bf16", "auto").holds_narrow_copies(&cpu).ok(),
            Some(false)
        );
        assert_eq!(
            with("bf16", "on").holds_narrow_copies(&cpu).ok(),
            Some(true)
        );
        assert_eq!(with("f16", "on").holds_narrow_copies(&cpu).ok(), Some(true));
        assert_eq!(
            with("bf16", "off").holds_narrow_copies(&cpu).ok(),
            Some(false)
        );
        assert_eq!(
            with("f32", "auto").holds_narrow_copies(&cpu).ok(),
            Some(false)
        );
        let err = with("f32", "on")
            .holds_narrow_copies(&cpu)
            .expect_err("f32 on");
        assert!(
            err.to_string().contains("train.narrow_weight_copies"),
            "{err}"
        );
        assert!(with("bf16", "yes").holds_narrow_copies(&cpu).is_err());
    }

    /// `grad_accum_dtype = "bf16"` is accepted with bf16 weights only, and an unknown value
    /// is refused, each naming the field.
    #[test]
    fn bf16_gradient_sums_need_bf16_weights() {
        let with = |masters: &str, sums: &str| TrainPrecisionConfig {
            dtype: "bf16".into(),
            master_weights: masters.into(),
            grad_accum_dtype: sums.into(),
            ..TrainPrecisionConfig::default()
        };
        assert!(with("bf16", "bf16")
            .bf16_gradient_sums()
            .expect("bf16 weights"));
        assert!(!with("bf16", "f32").bf16_gradient_sums().expect("f32 sums"));
        assert!(!with("f32", "f32").bf16_gradient_sums().expect("default"));
        for (masters, sums) in [("f32", "bf16"), ("bf16", "f16")] {
            let err = with(masters, sums)
                .bf16_gradient_sums()
                .expect_err("refused");
            assert!(err.to_string().contains("train.grad_accum_dtype"), "{err}");
        }
    }

    /// `narrow_gradients` is refused in f32 (no 16-bit dtype to keep the gradients in) with
    /// the field named, and accepted in bf16 and f16; off, any dtype passes.
    #[test]
    fn narrow_gradients_need_a_sixteen_bit_dtype() {
        let with = |dtype: &str, narrow: bool| TrainPrecisionConfig {
            dtype: dtype.into(),
            narrow_gradients: narrow,
            ..TrainPrecisionConfig::default()
        };
        let err = with("f32", true)
            .check_narrow_gradients()
            .expect_err("f32 refused");
        assert!(err.to_string().contains("train.narrow_gradients"), "{err}");
        for (dtype, narrow) in [
            ("bf16", true),
            ("f16", true),
            ("f32", false),
            ("bf16", false),
        ] {
            assert!(
                with(dtype, narrow).check_narrow_gradients().is_ok(),
                "{dtype} {narrow}"
            );
        }
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
