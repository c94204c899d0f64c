//! r3-model: the MoE transformer both r3 engines build on — HF config parsing, safetensors
//! weights with HF names, the router (select + weigh) and the f32 training forward with
//! `Native` / `Record` / `Replay` routing.

pub mod cast16;
pub mod config;
#[cfg(feature = "cuda")]
mod cuda;
pub mod device;
pub mod error;
mod gemm_call;
pub mod greedy_rows;
mod host;
pub mod host_staging;
pub mod kernel_params;
/// The CPU twins of r3's CUDA kernels that no public op reaches alone on the host, for the
/// kernels' host emulation (the r3-cuda-emu crate's tests) to compare against: not an API.
#[doc(hidden)]
pub mod kernel_twins {
    pub use crate::layers::moe::combine_slots::combine_rows;
    pub use crate::layers::moe::expert_gemm::slots::{expert_slot_pointers_twin, SlotPointerArgs};
    pub use crate::layers::moe::swiglu_halves::swiglu_grad_rows;
}
pub mod launch_shape;
pub mod layers;
pub mod math;
pub mod model;
pub mod narrow_grads;
pub mod optim_pass;
pub mod precision;
pub mod presets;
pub mod round16;
pub mod router;
pub mod routing_mode;
pub mod sample_rows;
pub mod spec;
pub mod stochastic_round;
#[cfg(test)]
mod test_util;
mod token_rows;
pub mod token_stats;
pub mod weights;

pub use config::{
    Architecture, AttentionConfig, Config, ConfigLimits, MoeConfig, MoeLayerRules, QkNorm,
    RopeConfig, RopeScaling, RouterKind, SharedExpert,
};
pub use device::{DeviceError, DeviceSpec};
pub use error::{ModelError, Result};
pub use host_staging::HostStaging;
pub use model::{
    Batch, ForwardOutput, HeadPositions, Model, RoutingWaits, ScoreTargets, SharedLen,
};
pub use precision::Precision;
pub use router::Router;
pub use routing_mode::{ReplayProof, ReplayRoutes, Routing};
pub use spec::{tensor_specs, tensor_specs_in, ExpertLayout, TensorRole, TensorSpec};
pub use weights::{
    check_finite, check_holds, check_map_holds, HeldTensors, LoadOptions, NarrowMasters,
    RandomInit, WeightPrecision, Weights,
};
