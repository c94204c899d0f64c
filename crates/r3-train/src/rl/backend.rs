//! The trainer's rollout backend: one value that is either the in-process engine (a second
//! copy of the policy's weights in the rollout precision) or the fleet of workers that
//! replaces it (`rollout.backend = "sglang"`; only a fleet draws a step's rollouts ahead).
//! Building it, generating with it and moving it to the policy's new weights.

use std::time::Instant;

use r3_rollout::{Dtype, Engine, EngineConfig, GenerateRequest, GenerateResult, RouterDtype};

use crate::config::train::{RolloutBackend, TrainConfig};
use crate::error::{Result, TrainError};
use crate::policy::model_text::ModelText;
use crate::policy::trainable::TrainablePolicy;
use crate::rl::ahead::AheadBatch;
use crate::rl::fleet::FleetRollout;
use crate::rl::sampling::Generate;

/// Where the trainer's rollouts and evaluations are generated.
// One value per trainer, built once and never moved in a loop: the engine's size costs
// nothing, and boxing it would only add an indirection to every generate call.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Backend {
    /// The in-process rollout engine (f16 by default) with the policy's current weights.
    Engine(Engine),
    /// A rollout fleet: its workers sample and evaluate, no weights held in this process.
    Fleet(FleetRollout),
}

/// Parses the rollout router precision (`bf16` / `model` or `f32`).
pub fn rollout_router_dtype(text: &str) -> Result<RouterDtype> {
    text.parse::<RouterDtype>()
        .map_err(|source| TrainError::RolloutDtype {
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
                let engine_cfg = EngineConfig {
                    dtype: rollout_dtype(&cfg.rollout.dtype)?,
                    router_dtype: rollout_router_dtype(&cfg.rollout.router_dtype)?,
                    ..EngineConfig::default()
                };
                let tensors = policy.tensor_map()?;
                Ok(Backend::Engine(Engine::new(
                    policy.config().clone(),
                    &tensors,
                    engine_cfg,
                )?))
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
            Backend::Fleet(_) => None,
        }
    }

    /// The fleet, if this backend is one.
    pub fn fleet(&self) -> Option<&FleetRollout> {
        match self {
            Backend::Engine(_) => None,
            Backend::Fleet(fleet) => Some(fleet),
        }
    }

    /// The batch a fleet generated ahead for the next step, if any.
    pub fn take_ahead(&mut self) -> Option<AheadBatch> {
        match self {
            Backend::Engine(_) => None,
            Backend::Fleet(fleet) => fleet.take_ahead(),
        }
    }

    /// The next step's batch when a fleet generated it during this one.
    pub fn ahead(&self) -> Option<&AheadBatch> {
        self.fleet().and_then(|f| f.ahead.as_ref())
    }

    /// Moves the backend to the policy's current weights, as weight version `version`
    /// for a fleet; returns seconds taken.
    pub fn sync(
        &mut self,
        policy: &TrainablePolicy,
        tokenizer: &ModelText,
        version: u64,
    ) -> Result<f64> {
        let t = Instant::now();
        match self {
            Backend::Engine(engine) => {
                engine.update_weights(&policy.tensor_map()?)?;
            }
            Backend::Fleet(fleet) => fleet.push(policy, tokenizer, version)?,
        }
        Ok(t.elapsed().as_secs_f64())
    }
}

impl Generate for Backend {
    fn generate_batch(&mut self, requests: Vec<GenerateRequest>) -> Result<Vec<GenerateResult>> {
        match self {
            Backend::Engine(engine) => engine.generate_batch(requests),
            Backend::Fleet(fleet) => fleet.generate_batch(requests),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_config_builds_the_in_process_engine() {
        let cfg = TrainConfig::default();
        let policy_dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/arith-moe");
        let policy = TrainablePolicy::load(&policy_dir).expect("policy");
        let tokenizer = ModelText::from_model_dir(&policy_dir).expect("tok");
        let mut backend = Backend::connect(&cfg, &policy, &tokenizer, 0).expect("connect");
        assert!(backend.fleet().is_none());
        assert!(backend.engine_mut().is_some());
        assert!(backend.ahead().is_none());
    }
}
