//! Where the device engine's steps choose their experts: on the host from each MoE layer's
//! router logits (the host waits for the device once a layer), or on the device with the
//! step's routes copied once at its end (r3-model's [`StepRouting`]), decided step by step.

use std::fmt;
use std::str::FromStr;

use r3_model::model::decode::StepRouting;

use crate::error::RolloutError;

/// Where the device engine's MoE layers choose their experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RoutingPlace {
    /// On the device for the steps whose slots' expert weights stay within
    /// [`AUTO_GATHER_BYTES`] a layer (decode steps at small batches), on a GPU and where the
    /// model's routers allow; on the host otherwise. On the CPU device the host already
    /// holds the logits, so routing there costs no wait and stays on the host.
    #[default]
    Auto,
    /// Always on the host.
    Host,
    /// Always on the device (a model whose routers cannot is refused when the engine is
    /// built).
    Device,
}

/// Bytes of expert weights a step routed on the device under [`RoutingPlace::Auto`] may read
/// per MoE layer. Routed on the device, every (row, slot) reads its expert's matrices (on a
/// GPU in place), even where rows share an expert, while a step routed on the host reads
/// each chosen expert once; a host round trip costs a GPU tens of microseconds a layer, about
/// what reading this much costs an H100. At batch 1 both read the same experts: Qwen3-30B-A3B's
/// top-8 of 9.4 MB bf16 experts is 75 MB a layer.
pub const AUTO_GATHER_BYTES: usize = 128 << 20;

impl RoutingPlace {
    /// The routing of one step feeding `rows` tokens through MoE layers of `top_k` experts
    /// of `expert_bytes` each, on a GPU or not, for a model whose routers can choose on the
    /// device or not.
    pub fn for_step(
        self,
        rows: usize,
        top_k: usize,
        expert_bytes: usize,
        on_gpu: bool,
        model_routes_on_device: bool,
    ) -> StepRouting {
        match self {
            RoutingPlace::Host => StepRouting::Host,
            RoutingPlace::Device => StepRouting::Device,
            RoutingPlace::Auto => {
                let read = rows.saturating_mul(top_k).saturating_mul(expert_bytes);
                if on_gpu && model_routes_on_device && read <= AUTO_GATHER_BYTES {
                    StepRouting::Device
                } else {
                    StepRouting::Host
                }
            }
        }
    }
}

impl fmt::Display for RoutingPlace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RoutingPlace::Auto => "auto",
            RoutingPlace::Host => "host",
            RoutingPlace::Device => "device",
        })
    }
}

impl FromStr for RoutingPlace {
    type Err = RolloutError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(RoutingPlace::Auto),
            "host" => Ok(RoutingPlace::Host),
            "device" => Ok(RoutingPlace::Device),
            other => Err(RolloutError::InvalidConfig(format!(
                "routing {other:?}: expected auto, host or device"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_routes_small_gpu_steps_on_the_device_only() {
        let mb = 1 << 20;
        let auto = RoutingPlace::Auto;
        // Batch 1, top-8 of 3 MB experts: 24 MB read a layer.
        assert_eq!(auto.for_step(1, 8, 3 * mb, true, true), StepRouting::Device);
        // Batch 64: 1.5 GB, past the budget.
        assert_eq!(auto.for_step(64, 8, 3 * mb, true, true), StepRouting::Host);
        // The budget itself is inside, one byte past it is not.
        assert_eq!(
            auto.for_step(1, 1, AUTO_GATHER_BYTES, true, true),
            StepRouting::Device
        );
        assert_eq!(
            auto.for_step(1, 1, AUTO_GATHER_BYTES + 1, true, true),
            StepRouting::Host
        );
        // Not on a GPU, or routers that choose on the host.
        assert_eq!(auto.for_step(1, 8, mb, false, true), StepRouting::Host);
        assert_eq!(auto.for_step(1, 8, mb, true, false), StepRouting::Host);
        // Forced either way.
        assert_eq!(
            RoutingPlace::Device.for_step(512, 8, 3 * mb, false, true),
            StepRouting::Device
        );
        assert_eq!(
            RoutingPlace::Host.for_step(1, 1, 1, true, true),
            StepRouting::Host
        );
    }

    #[test]
    fn names_parse_back_and_others_are_refused() {
        for place in [RoutingPlace::Auto, RoutingPlace::Host, RoutingPlace::Device] {
            assert_eq!(place.to_string().parse::<RoutingPlace>().ok(), Some(place));
        }
        let err = "gpu".parse::<RoutingPlace>().expect_err("not a place");
        assert!(err.to_string().contains("auto, host or device"), "{err}");
    }
}
