//! The trainer's rollout backend: one value that is either the in-process engine (a second
//! copy of the policy's weights in the rollout precision) or the fleet of workers that
//! replaces it (`rollout.backend = "sglang"`; only a fleet draws a step's rollouts ahead).
//! Building it, generating with it and moving it to the policy's new weights.

use std::time::Instant;

use r3_model::{HeldTensors, WeightPrecision};

use r3_rollout::{
    DeviceEngine, DeviceEngineConfig, Dtype, Engine, EngineConfig, GenerateRequest, GenerateResult,
    RolloutDevice, RolloutEngine, RouterDtype,
};

use crate::config::train::{RolloutBackend, TrainConfig};
use crate::error::{Result, TrainError};
use crate::policy::model_text::ModelText;
use crate::policy::trainable::TrainablePolicy;
use crate::rl::ahead::AheadBatch;
use crate::rl::failed_groups::RequestOutcome;
use crate::rl::fleet::FleetRollout;
use crate::rl::sampling::{check_count, Generate};

/// Where the trainer's rollouts and evaluations are generated.
// One value per trainer, built once and never moved in a loop: the engine's size costs
// nothing, and boxing it would only add an indirection to every generate call.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Backend {
    /// The in-process rollout engine (f16 by default) with the policy's current weights.
    Engine(Engine),
    /// The in-process device engine (`rollout.device` = `cpu-candle`, `cuda`, `cuda:N`)
    /// with the policy's current weights.
    Device(DeviceEngine),
    /// A rollout fleet: its workers sample and evaluate, no weights held in this process.
    Fleet(FleetRollout),
}

/// Parses the rollout router precision for an engine computing in `engine`: `model` or
/// `engine`'s own name, or `f32`; another dtype's name is refused ([`RouterDtype::parse_for`]).
pub fn rollout_router_dtype(text: &str, engine: Dtype) -> Result<RouterDtype> {
    RouterDtype::parse_for(text, engine).map_err(|source| TrainError::RolloutDtype {
        text: text.to_string(),
        source: Box::new(source),
    })
}

/// Parses the rollout precision (`f16`, `bf16` or `f32`).
pub fn rollout_dtype(text: &str) -> Result<Dtype> {
    text.parse::<Dtype>()
        .map_err(|source| TrainError::RolloutDtype {
            text: text.to_string(),
            source: Box::new(source),
        })
}

/// The in-process engine's settings from `cfg.rollout`: its precision, KV cache dtype and
/// budgets (rows, KV cache, one step's activations, prefill tokens, prefix cache), as
/// `r3 serve`'s flags set them.
pub fn engine_config(cfg: &TrainConfig) -> Result<EngineConfig> {
    let r = &cfg.rollout;
    // `validate` bounds each budget; a config built without it still gets no wrapped count.
    let bytes = |field: &'static str, mib: usize| {
        mib.checked_mul(1 << 20)
            .ok_or_else(|| TrainError::InvalidConfig {
                field,
                reason: format!("{mib} MiB is past a byte count this machine can hold"),
            })
    };
    let dtype = rollout_dtype(&r.dtype)?;
    Ok(EngineConfig {
        dtype,
        router_dtype: rollout_router_dtype(&r.router_dtype, dtype)?,
        kv_cache_dtype: r.kv_cache_dtype.parse().map_err(TrainError::Rollout)?,
        max_running: r.max_running,
        kv_cache_bytes: bytes("rollout.kv_cache_mib", r.kv_cache_mib)?,
        activation_bytes: bytes("rollout.activation_mib", r.activation_mib)?,
        prefix_cache: r.prefix_cache_mib > 0,
        prefix_cache_bytes: bytes("rollout.prefix_cache_mib", r.prefix_cache_mib)?,
        // 0: no cap, as `r3 serve` without `--chunked-prefill-size`; the CPU engine's step
        // budget counts a token of each decoding row too.
        max_batch_tokens: match r.chunked_prefill_size {
            0 => EngineConfig::default().max_batch_tokens,
            n => n.saturating_add(r.max_running),
        },
        max_prefill_tokens: (r.chunked_prefill_size > 0).then_some(r.chunked_prefill_size),
        ..EngineConfig::default()
    })
}

impl Backend {
    /// The backend `cfg.rollout.backend` names, holding the policy's weights as version
    /// `step`: an engine built from them, or the fleet connected and synced to them.
    pub fn connect(
        cfg: &TrainConfig,
        policy: &TrainablePolicy,
        tokenizer: &ModelText,
        step: u64,
    ) -> Result<Self> {
        match cfg.rollout.backend {
            RolloutBackend::Engine => {
                let engine_cfg = engine_config(cfg)?;
                let device = cfg
                    .rollout
                    .device
                    .parse::<RolloutDevice>()
                    .map_err(TrainError::Rollout)?;
                Ok(match device.candle() {
                    // The CPU engine packs host values: a GPU policy's weights cross once.
                    None => Backend::Engine(Engine::new(
                        policy.config().clone(),
                        &policy.tensor_map()?,
                        engine_cfg,
                    )?),
                    // The device engine copies what it keeps onto its own device (checking
                    // them there), so a GPU policy's weights reach a GPU engine without
                    // crossing the host, as at every sync. On the policy's own GPU it takes
                    // the policy's handle: one copy a tensor at each sync.
                    Some(spec) => Backend::Device(DeviceEngine::new_beside(
                        policy.config().clone(),
                        &policy.device_tensor_map(),
                        DeviceEngineConfig::from_engine_config(spec, &engine_cfg),
                        &policy.device(),
                    )?),
                })
            }
            RolloutBackend::Sglang => Ok(Backend::Fleet(FleetRollout::connect(
                cfg, policy, tokenizer, step,
            )?)),
        }
    }

    /// The in-process engine, if this backend is one.
    pub fn engine_mut(&mut self) -> Option<&mut Engine> {
        match self {
            Backend::Engine(engine) => Some(engine),
            Backend::Device(_) | Backend::Fleet(_) => None,
        }
    }

    /// The fleet, if this backend is one.
    pub fn fleet(&self) -> Option<&FleetRollout> {
        match self {
            Backend::Engine(_) | Backend::Device(_) => None,
            Backend::Fleet(fleet) => Some(fleet),
        }
    }

    /// The batch a fleet generated ahead for the next step, if any.
    pub fn take_ahead(&mut self) -> Option<AheadBatch> {
        match self {
            Backend::Engine(_) | Backend::Device(_) => None,
            Backend::Fleet(fleet) => fleet.take_ahead(),
        }
    }

    /// The next step's batch when a fleet generated it during this one.
    pub fn ahead(&self) -> Option<&AheadBatch> {
        self.fleet().and_then(|f| f.ahead.as_ref())
    }

    /// Lets the in-process device engine's weights go before an update when the engine
    /// shares the policy's device (they are the old ones until [`Backend::sync`], which
    /// builds them again from the policy's): on a GPU both engines share, the update's peak
    /// then holds no second model, nor the prefix cache (its blocks are the old weights'; a
    /// GRPO group's samples hit it within their call). An engine on another device, the CPU
    /// engine and a fleet keep theirs (the update does not use that memory). Returns whether
    /// it let them go.
    pub fn release_for_update(&mut self, policy: &TrainablePolicy) -> Result<bool> {
        match self {
            Backend::Device(engine) if engine.device().same_device(&policy.device()) => {
                engine.release_weights()?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Moves the backend to the policy's current weights, as weight version `version`
    /// for a fleet; returns seconds taken. `held` is the precision the trainer keeps every
    /// weight within (checked at start, kept by the guarded update): an in-process engine
    /// whose precision that covers loads them without scanning them again.
    pub fn sync(
        &mut self,
        policy: &TrainablePolicy,
        tokenizer: &ModelText,
        version: u64,
        held: WeightPrecision,
    ) -> Result<f64> {
        let t = Instant::now();
        match self {
            Backend::Engine(engine) => {
                let map = policy.tensor_map()?;
                engine.update_weights_held(HeldTensors::vouched(&map, held))?;
            }
            Backend::Device(engine) => {
                let map = policy.device_tensor_map();
                engine.update_weights_held(HeldTensors::vouched(&map, held))?;
            }
            Backend::Fleet(fleet) => fleet.push(policy, tokenizer, version)?,
        }
        Ok(t.elapsed().as_secs_f64())
    }
}

impl Backend {
    /// A step's first rollout round: one outcome per request. A fleet's request that failed
    /// for its own fault is an error in its slot (its group is dropped,
    /// [`crate::rl::failed_groups`]); every other failure, and any failure of an in-process
    /// engine, fails the call.
    pub fn generate_round(
        &mut self,
        requests: Vec<GenerateRequest>,
    ) -> Result<Vec<RequestOutcome>> {
        match self {
            Backend::Fleet(fleet) => fleet.generate_round(requests),
            other => Ok(other
                .generate_batch(requests)?
                .into_iter()
                .map(Ok)
                .collect()),
        }
    }

    /// A further rollout round of the step (dynamic sampling's refill): as
    /// [`Backend::generate_round`], but a fleet adds the round's cost to the step's
    /// `rollout.*` counters instead of replacing them.
    pub fn generate_another_round(
        &mut self,
        requests: Vec<GenerateRequest>,
    ) -> Result<Vec<RequestOutcome>> {
        match self {
            Backend::Fleet(fleet) => fleet.generate_another_round(requests),
            other => other.generate_round(requests),
        }
    }
}

impl Generate for Backend {
    fn generate_batch(&mut self, requests: Vec<GenerateRequest>) -> Result<Vec<GenerateResult>> {
        match self {
            Backend::Engine(engine) => engine.generate_batch(requests),
            Backend::Device(engine) => engine.generate_batch(requests),
            Backend::Fleet(fleet) => fleet.generate_batch(requests),
        }
    }
}

impl Generate for RolloutEngine {
    fn generate_batch(&mut self, requests: Vec<GenerateRequest>) -> Result<Vec<GenerateResult>> {
        match self {
            RolloutEngine::Cpu(engine) => engine.generate_batch(requests),
            RolloutEngine::Device(engine) => engine.generate_batch(requests),
        }
    }
}

impl Generate for DeviceEngine {
    fn generate_batch(&mut self, requests: Vec<GenerateRequest>) -> Result<Vec<GenerateResult>> {
        let expected = requests.len();
        let results = self.generate(requests)?;
        // The device engine has no diagnostic re-run: the error says how to locate it.
        if let Some((request, token, value)) = results.iter().enumerate().find_map(|(n, r)| {
            let t = r.output_logprobs.iter().position(|l| !l.is_finite())?;
            Some((n, t, r.output_logprobs[t]))
        }) {
            return Err(TrainError::NonFiniteRollout {
                request,
                token,
                value,
                location: "not located by the device engine (rollout.device = \"cpu\" re-runs \
                           the sequence stage by stage)"
                    .into(),
            });
        }
        check_count(results.len(), expected)?;
        Ok(results)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shipped arithmetic model as a policy, with its tokenizer.
    fn arith_policy() -> (TrainablePolicy, ModelText) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/arith-moe");
        let policy = TrainablePolicy::load(&dir).expect("policy");
        let tokenizer = ModelText::from_model_dir(&dir).expect("tok");
        (policy, tokenizer)
    }

    #[test]
    fn the_default_config_builds_the_in_process_engine() {
        let cfg = TrainConfig::default();
        let (policy, tokenizer) = arith_policy();
        let mut backend = Backend::connect(&cfg, &policy, &tokenizer, 0).expect("connect");
        assert!(backend.fleet().is_none());
        assert!(backend.engine_mut().is_some());
        assert!(backend.ahead().is_none());
    }

    /// The device engine's prefix cache is emptied when its weights are let go for the
    /// update (it held the rollouts' blocks until the weight sync, through the update): a
    /// group of samples sharing a prompt still hits it within the call.
    #[test]
    fn the_device_engines_prefix_cache_is_let_go_for_the_update() {
        let mut cfg = TrainConfig::default();
        cfg.rollout.device = "cpu-candle".into();
        let (policy, tokenizer) = arith_policy();
        let mut backend = Backend::connect(&cfg, &policy, &tokenizer, 0).expect("connect");
        // Four samples of one 40-token prompt: its two full 16-token blocks are computed
        // once and hit by the others.
        let prompt: Vec<u32> = (0..40).map(|i| 3 + (i * 7) % 20).collect();
        let requests = (0..4)
            .map(|i| {
                GenerateRequest::new(
                    prompt.clone(),
                    r3_rollout::SamplingParams {
                        seed: i,
                        max_new_tokens: 4,
                        ..r3_rollout::SamplingParams::default()
                    },
                )
            })
            .collect();
        let results = backend.generate_batch(requests).expect("generate");
        assert_eq!(results.len(), 4);
        assert!(backend.release_for_update(&policy).expect("release"));
        let Backend::Device(engine) = &backend else {
            panic!("not the device engine");
        };
        let stats = engine.prefix_cache_stats().expect("a prefix cache");
        assert!(
            stats.hit_blocks > 0,
            "the group's samples shared no block: {stats:?}"
        );
        assert!(stats.inserted_blocks > 0, "{stats:?}");
        assert_eq!((stats.cached_blocks, stats.used_bytes), (0, 0), "{stats:?}");
    }

    /// The engine budgets reach the engine `r3 train` builds: the defaults are the engine's
    /// own (so a default run is unchanged), and set ones arrive in bytes on the CPU engine
    /// and on the device engine, a prefix cache of 0 MiB turning the cache off.
    #[test]
    fn the_rollout_budgets_reach_the_engine() {
        let defaults = engine_config(&TrainConfig::default()).expect("defaults");
        let engine = EngineConfig::default();
        assert_eq!(
            (
                defaults.max_running,
                defaults.kv_cache_bytes,
                defaults.activation_bytes,
                defaults.prefix_cache,
                defaults.prefix_cache_bytes,
                defaults.max_batch_tokens,
                defaults.max_prefill_tokens
            ),
            (
                engine.max_running,
                engine.kv_cache_bytes,
                engine.activation_bytes,
                engine.prefix_cache,
                engine.prefix_cache_bytes,
                engine.max_batch_tokens,
                engine.max_prefill_tokens
            )
        );
        let (policy, tokenizer) = arith_policy();
        for device in ["cpu", "cpu-candle"] {
            let mut cfg = TrainConfig::default();
            cfg.rollout.device = device.into();
            cfg.rollout.max_running = 7;
            cfg.rollout.kv_cache_mib = 96;
            cfg.rollout.activation_mib = 64;
            cfg.rollout.prefix_cache_mib = 0;
            cfg.rollout.chunked_prefill_size = 512;
            let backend = Backend::connect(&cfg, &policy, &tokenizer, 0).expect("connect");
            let got = match &backend {
                Backend::Engine(e) => {
                    let c = e.engine_config();
                    (
                        c.max_running,
                        c.kv_cache_bytes,
                        c.activation_bytes,
                        c.prefix_cache,
                        Some(c.max_batch_tokens - c.max_running),
                    )
                }
                Backend::Device(e) => {
                    let c = e.engine_config();
                    (
                        c.max_running,
                        c.kv_cache_bytes,
                        c.activation_bytes,
                        c.prefix_cache,
                        c.max_prefill_tokens,
                    )
                }
                Backend::Fleet(_) => panic!("{device}: a fleet"),
            };
            assert_eq!(got, (7, 96 << 20, 64 << 20, false, Some(512)), "{device}");
        }
        let mut cfg = TrainConfig::default();
        cfg.rollout.prefix_cache_mib = 3;
        let set = engine_config(&cfg).expect("set");
        assert_eq!((set.prefix_cache, set.prefix_cache_bytes), (true, 3 << 20));
        cfg.rollout.kv_cache_mib = usize::MAX / 1024;
        let Err(e) = engine_config(&cfg) else {
            panic!("a wrapped KV budget accepted");
        };
        assert!(e.to_string().contains("rollout.kv_cache_mib"), "{e}");
    }

    #[test]
    fn rollout_device_cpu_candle_builds_the_device_engine_and_syncs_it() {
        let mut cfg = TrainConfig::default();
        cfg.rollout.device = "cpu-candle".into();
        let (policy, tokenizer) = arith_policy();
        let mut backend = Backend::connect(&cfg, &policy, &tokenizer, 0).expect("connect");
        assert!(matches!(backend, Backend::Device(_)));
        assert!(backend.engine_mut().is_none() && backend.fleet().is_none());
        // The default f16 rollout: the weights checked as the trainer checks them at start.
        r3_model::check_map_holds(&policy.tensor_map().expect("map"), WeightPrecision::F16)
            .expect("f16 holds the model");
        backend
            .sync(&policy, &tokenizer, 1, WeightPrecision::F16)
            .expect("sync");
        let Backend::Device(engine) = &backend else {
            unreachable!("checked above")
        };
        assert_eq!(engine.weight_version(), 1);
    }
}
