//! r3-rollout: the inference engine of r3 — batched generation with a paged KV cache that
//! records the routed experts of every position, a prefix cache that keeps routes beside KV,
//! partial rollouts and in-process weight sync.
//!
//! The engine has its own inference path (f16, bf16 or f32 matmuls, fused row kernels, paged
//! attention); it shares only the config, the weight format and the router math with the
//! training forward of `r3-model`.
//!
//! This crate is the engine alone: it has no HTTP and no async runtime. The SGLang-compatible
//! HTTP server around it is the crate `r3-server` (axum + tokio), which depends on this one.
//! The trainer drives the engine in process and does not build the server, though it does
//! compile tokio and hyper through `r3-fleet`, its HTTP client for remote rollout workers.
//!
//! Log-probs, in f32 from the engine's logits, as SGLang reports them: an output token's is
//! taken under the distribution it was sampled from before top-k / top-p / min-p
//! (`log softmax(l / T)[token]`, `l` the logits after penalties and bias) or, where the
//! request's `logprob_scale` is [`LogprobScale::Raw`] and for greedy requests, at temperature
//! 1 (`log softmax(l)[token]`); prompt log-probs are always the raw model distribution's
//! (see [`sampler`]).

pub mod device_engine;
pub mod dtype;
pub mod engine;
pub mod error;
mod generate_call;
pub mod kernels;
pub mod kv_pool;
pub mod model;
pub mod prefix_cache;
pub mod request;
pub mod sampler;

pub use device_engine::choice::{RolloutDevice, RolloutEngine};
pub use device_engine::{DeviceEngine, DeviceEngineConfig, RoutingPlace};
pub use dtype::{Dtype, KvCacheDtype, RouterDtype};
pub use engine::{config_eos_ids, CachedBlock, Engine, EngineConfig};
pub use error::RolloutError;
pub use kv_pool::{KvBlock, KvBlockId, KvBlockRef, KvLayout, KvPool};
pub use model::tensors::{load_dir, TensorMap};
pub use r3_routing::MergePolicy;
pub use request::{
    FinishReason, GenerateRequest, GenerateResult, PartialRollout, PromptLogprobs, RequestId,
};
pub use sampler::{LogprobScale, SamplingParams};
