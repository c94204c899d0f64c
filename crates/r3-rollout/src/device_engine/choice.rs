//! Which rollout engine runs and where, as a user names it (`--device`, `rollout.device`):
//! `cpu` is the CPU engine with its own kernels (the default), `cpu-candle` the device
//! engine on candle's CPU device (the same code a GPU runs, exercised without one),
//! `cuda` / `cuda:N` the device engine on a GPU; and one engine value over both.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use r3_model::{Config, DeviceSpec, LoadOptions};

use super::{DeviceEngine, DeviceEngineConfig, RoutingPlace};
use crate::dtype::{Dtype, KvCacheDtype};
use crate::engine::{Engine, EngineConfig};
use crate::error::RolloutError;
use crate::model::tensors::TensorMap;
use crate::request::{GenerateRequest, GenerateResult};

/// Where rollouts are generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RolloutDevice {
    /// The CPU engine (packed f16/bf16 kernels, paged KV, prefix cache).
    #[default]
    Cpu,
    /// The device engine (r3-model's layers on candle tensors, prefix cache) on this device.
    Candle(DeviceSpec),
}

impl RolloutDevice {
    /// The device of the device engine; None for the CPU engine.
    pub fn candle(&self) -> Option<DeviceSpec> {
        match self {
            RolloutDevice::Cpu => None,
            RolloutDevice::Candle(spec) => Some(*spec),
        }
    }

    /// Errors unless the engine this names, computing in `engine`, can keep its KV cache in
    /// `kv`: the CPU engine any dtype, the device engine `auto` or its own dtype (its
    /// forward's: a 16-bit forward's keys and values are 16-bit values) or `f32` — each holds
    /// its keys and values exactly, where another would add a rounding its forward does not
    /// have.
    pub fn check_kv_cache_dtype(
        &self,
        kv: KvCacheDtype,
        engine: Dtype,
    ) -> Result<(), RolloutError> {
        match self.candle() {
            Some(_) => device_engine_takes(kv, engine, &self.to_string()),
            None => Ok(()),
        }
    }
}

/// Errors unless the device engine (`device`, as the error names it), computing in `engine`,
/// can keep its KV cache in `kv`: `auto`, `engine` named, or `f32`.
pub(crate) fn device_engine_takes(
    kv: KvCacheDtype,
    engine: Dtype,
    device: &str,
) -> Result<(), RolloutError> {
    match kv {
        KvCacheDtype::Auto => Ok(()),
        KvCacheDtype::Fixed(d) if d == Dtype::F32 || d == engine => Ok(()),
        KvCacheDtype::Fixed(_) => Err(RolloutError::InvalidConfig(format!(
            "KV cache dtype `{kv}` is for the CPU engine; the device engine ({device}) keeps \
             its cache in its compute dtype (`auto`, here `{engine}`) or in `f32`"
        ))),
    }
}

impl FromStr for RolloutDevice {
    type Err = RolloutError;

    fn from_str(text: &str) -> Result<Self, RolloutError> {
        match text.trim() {
            "cpu" => Ok(RolloutDevice::Cpu),
            "cpu-candle" => Ok(RolloutDevice::Candle(DeviceSpec::Cpu)),
            other => match other.parse::<DeviceSpec>() {
                Ok(spec @ DeviceSpec::Cuda { .. }) => Ok(RolloutDevice::Candle(spec)),
                _ => Err(RolloutError::InvalidConfig(format!(
                    "rollout device `{text}` is not one of `cpu` (the CPU engine), `cpu-candle` \
                     (the device engine on the CPU), `cuda`, `cuda:N` (N the GPU's index)"
                ))),
            },
        }
    }
}

impl fmt::Display for RolloutDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RolloutDevice::Cpu => write!(f, "cpu"),
            RolloutDevice::Candle(DeviceSpec::Cpu) => write!(f, "cpu-candle"),
            RolloutDevice::Candle(spec) => write!(f, "{spec}"),
        }
    }
}

impl DeviceEngineConfig {
    /// The device engine's settings for `device` taken from the CPU engine's (dtype,
    /// router dtype, batch size, KV budget and dtype, activation budget, prefill token cap,
    /// the prefix cache on or off, its budget and block size; the CPU engine's token budget
    /// of a step (`max_batch_tokens`, decode and prefill together) has no counterpart, and
    /// [`RolloutEngine`]'s constructors refuse a `kv_cache_dtype` other than `auto` or `f32`
    /// for this engine).
    pub fn from_engine_config(device: DeviceSpec, cfg: &EngineConfig) -> Self {
        DeviceEngineConfig {
            device,
            dtype: cfg.dtype,
            router_dtype: cfg.router_dtype,
            max_running: cfg.max_running,
            kv_cache_bytes: cfg.kv_cache_bytes,
            kv_cache_dtype: cfg.kv_cache_dtype,
            activation_bytes: cfg.activation_bytes,
            max_prefill_tokens: cfg.max_prefill_tokens,
            block_size: cfg.block_size,
            prefix_cache: cfg.prefix_cache,
            prefix_cache_bytes: cfg.prefix_cache_bytes,
            // The CPU engine routes on the host, where its logits are; the choice per step
            // is the device engine's own.
            routing: RoutingPlace::Auto,
        }
    }
}

/// One of the two engines, chosen by a [`RolloutDevice`].
// Built once per command, never moved in a loop: boxing would only add an indirection.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum RolloutEngine {
    /// The CPU engine.
    Cpu(Engine),
    /// The device engine.
    Device(DeviceEngine),
}

impl RolloutEngine {
    /// Loads a HF model directory into the engine `device` names, with `cfg`'s settings.
    pub fn from_dir_with(
        device: RolloutDevice,
        dir: &Path,
        cfg: EngineConfig,
        options: &LoadOptions,
    ) -> Result<Self, RolloutError> {
        device.check_kv_cache_dtype(cfg.kv_cache_dtype, cfg.dtype)?;
        Ok(match device.candle() {
            None => RolloutEngine::Cpu(Engine::from_dir_with(dir, cfg, options)?),
            Some(spec) => RolloutEngine::Device(DeviceEngine::from_dir_with(
                dir,
                DeviceEngineConfig::from_engine_config(spec, &cfg),
                options,
            )?),
        })
    }

    /// Builds the engine `device` names from a parsed config and HF-named tensors (on the
    /// CPU), with `cfg`'s settings.
    pub fn new(
        device: RolloutDevice,
        model_cfg: Config,
        tensors: &TensorMap,
        cfg: EngineConfig,
    ) -> Result<Self, RolloutError> {
        device.check_kv_cache_dtype(cfg.kv_cache_dtype, cfg.dtype)?;
        Ok(match device.candle() {
            None => RolloutEngine::Cpu(Engine::new(model_cfg, tensors, cfg)?),
            Some(spec) => RolloutEngine::Device(DeviceEngine::new(
                model_cfg,
                tensors,
                DeviceEngineConfig::from_engine_config(spec, &cfg),
            )?),
        })
    }

    /// The model config.
    pub fn model_config(&self) -> &Config {
        match self {
            RolloutEngine::Cpu(e) => e.model_config(),
            RolloutEngine::Device(e) => e.model_config(),
        }
    }

    /// `eos_token_id`(s) from config.json.
    pub fn eos_token_ids(&self) -> &[u32] {
        match self {
            RolloutEngine::Cpu(e) => e.eos_token_ids(),
            RolloutEngine::Device(e) => e.eos_token_ids(),
        }
    }

    /// Submits all requests and steps until they finish; results in input order.
    pub fn generate(
        &mut self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<GenerateResult>, RolloutError> {
        match self {
            RolloutEngine::Cpu(e) => e.generate(reqs),
            RolloutEngine::Device(e) => e.generate(reqs),
        }
    }

    /// Seconds spent on route capture so far.
    pub fn capture_seconds(&self) -> f64 {
        match self {
            RolloutEngine::Cpu(e) => e.capture_seconds(),
            RolloutEngine::Device(e) => e.capture_seconds(),
        }
    }

    /// Seconds the host waited for the device so far ([`DeviceEngine::device_wait_seconds`]);
    /// None for the CPU engine, which has no device to wait for.
    pub fn device_wait_seconds(&self) -> Option<f64> {
        match self {
            RolloutEngine::Cpu(_) => None,
            RolloutEngine::Device(e) => Some(e.device_wait_seconds()),
        }
    }

    /// Steps so far routed on the device and all steps
    /// ([`DeviceEngine::steps_routed_on_device`]); None for the CPU engine, which routes on
    /// the host.
    pub fn steps_routed_on_device(&self) -> Option<(u64, u64)> {
        match self {
            RolloutEngine::Cpu(_) => None,
            RolloutEngine::Device(e) => Some(e.steps_routed_on_device()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;

    /// The device engine's settings carry the budgets the CPU engine's config was given,
    /// the activation budget included (`r3 serve --activation-mib`), and a request whose
    /// one step needs more activations than that budget is refused by the engine so built.
    #[test]
    fn the_activation_budget_reaches_the_device_engine() {
        let cfg = EngineConfig {
            kv_cache_bytes: 5 << 20,
            activation_bytes: 3 << 20,
            ..EngineConfig::default()
        };
        let device = DeviceEngineConfig::from_engine_config(DeviceSpec::Cpu, &cfg);
        assert_eq!(
            (device.kv_cache_bytes, device.activation_bytes),
            (5 << 20, 3 << 20)
        );
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_tiny");
        let candle = RolloutDevice::Candle(DeviceSpec::Cpu);
        let tight = EngineConfig {
            activation_bytes: 1,
            ..cfg
        };
        let mut engine = RolloutEngine::from_dir_with(candle, &dir, tight, &LoadOptions::default())
            .expect("engine");
        let request = crate::request::GenerateRequest::new(
            vec![1, 2, 3],
            crate::sampler::SamplingParams::greedy(2),
        );
        let err = engine
            .generate(vec![request])
            .expect_err("over a 1-byte activation budget");
        assert!(err.to_string().contains("activation budget"), "{err}");
    }

    /// The device engine holds its KV cache in `auto` or `f32` (both exact) and refuses any
    /// other dtype where it is built, naming it; the CPU engine takes every one.
    #[test]
    fn the_device_engine_takes_only_exact_kv_cache_dtypes() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_tiny");
        let cfg = EngineConfig {
            dtype: Dtype::Bf16,
            kv_cache_dtype: KvCacheDtype::Fixed(Dtype::F16),
            kv_cache_bytes: 4 << 20,
            prefix_cache_bytes: 1 << 20,
            ..EngineConfig::default()
        };
        let options = LoadOptions::default();
        let cpu = RolloutEngine::from_dir_with(RolloutDevice::Cpu, &dir, cfg.clone(), &options);
        assert!(matches!(cpu, Ok(RolloutEngine::Cpu(_))), "{cpu:?}");
        let candle = RolloutDevice::Candle(DeviceSpec::Cpu);
        let err = RolloutEngine::from_dir_with(candle, &dir, cfg.clone(), &options)
            .expect_err("an f16 cache would round a bf16 forward's keys");
        assert!(err.to_string().contains("KV cache dtype `f16`"), "{err}");
        for kv in [KvCacheDtype::Auto, KvCacheDtype::Fixed(Dtype::F32)] {
            let cfg = EngineConfig {
                kv_cache_dtype: kv,
                ..cfg.clone()
            };
            let engine = RolloutEngine::from_dir_with(candle, &dir, cfg, &options);
            assert!(matches!(engine, Ok(RolloutEngine::Device(_))), "{kv}");
        }
    }

    #[test]
    fn names_round_trip_and_bad_names_are_refused() {
        for text in ["cpu", "cpu-candle", "cuda:0", "cuda:3"] {
            let d: RolloutDevice = text.parse().expect(text);
            assert_eq!(d.to_string(), text);
        }
        assert_eq!(
            "cuda".parse::<RolloutDevice>().ok(),
            Some(RolloutDevice::Candle(DeviceSpec::Cuda { ordinal: 0 }))
        );
        assert_eq!(
            "cpu".parse::<RolloutDevice>().ok(),
            Some(RolloutDevice::Cpu)
        );
        for bad in ["gpu", "cuda:x", "", "cpu-cuda"] {
            let err = bad.parse::<RolloutDevice>().expect_err(bad);
            assert!(err.to_string().contains("cpu-candle"), "{err}");
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_the_build_error() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_tiny");
        let err = RolloutEngine::from_dir_with(
            "cuda".parse().expect("cuda"),
            &dir,
            EngineConfig::default(),
            &LoadOptions::default(),
        )
        .expect_err("no CUDA in this build");
        assert!(err.to_string().contains("scripts/cuda/build.sh"), "{err}");
    }
}
