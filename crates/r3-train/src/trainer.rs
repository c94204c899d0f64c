//! The trainer's state: the resolved config, the trainable policy and its AdamW, the
//! rollout engine holding the same weights (or the fleet that replaces it), the prompt
//! source (the built-in task or a dataset) with its eval prompts and position, and the
//! reward. Building it from a base model or a checkpoint, weight sync, evaluation and
//! checkpoint writes live here; one RL step is in `step.rs`.

use std::path::Path;
use std::time::Instant;

use r3_rollout::{config_eos_ids, Dtype, Engine, EngineConfig, RouterDtype};
use r3_tasks::Reward;

use crate::checkpoint::{load_optimizer, save_checkpoint, state_at, TrainerState};
use crate::config::{RolloutBackend, TrainConfig};
use crate::error::{Result, TrainError};
use crate::fleet_sync::FleetRollout;
use crate::model_text::ModelText;
use crate::optim::{decay_matrices_only, AdamW, AdamWParams};
use crate::policy::TrainablePolicy;
use crate::prompt_source::{PromptItem, PromptSource};
use crate::rollout::{evaluate_prompts, EvalResult, Generator};
use crate::rollout_ahead::AheadBatch;

/// Everything one RL run mutates.
#[derive(Debug)]
pub struct Trainer {
    /// The resolved config.
    pub cfg: TrainConfig,
    /// Trainable weights (f32).
    pub policy: TrainablePolicy,
    /// AdamW over the policy's variables.
    pub optimizer: AdamW,
    /// The rollout engine (f16 by default) with the policy's current weights; none when a
    /// rollout fleet generates (`rollout.backend = "sglang"`: it samples and evaluates).
    pub engine: Option<Engine>,
    /// The model's `eos_token_id`s (from its config.json).
    pub eos: Vec<u32>,
    /// The model's tokenizer and chat template.
    pub tokenizer: ModelText,
    /// Training and held-out prompts, and the position in them.
    pub prompts: PromptSource,
    /// Reward of a response.
    pub reward: Reward,
    /// RL steps completed.
    pub step: u64,
    /// The rollout fleet when `rollout.backend = "sglang"`.
    pub fleet: Option<FleetRollout>,
    /// The next step's batch when the fleet generated it during this step (`rollout.async`).
    pub ahead: Option<AheadBatch>,
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

impl Trainer {
    /// A fresh trainer on the base model of `cfg.model_dir`.
    pub fn new(cfg: TrainConfig) -> Result<Self> {
        let dir = cfg.model_dir.clone();
        let device = cfg.train.device_spec()?.open()?;
        let policy =
            TrainablePolicy::load_on(&dir, &device).map_err(|e| checkpoint_err(&dir, e))?;
        let tokenizer = ModelText::from_model_dir(&dir)?;
        Self::assemble(cfg, policy, tokenizer, None)
    }

    /// A trainer restored from checkpoint `dir` (weights, moments, step, stream position).
    pub fn from_checkpoint(cfg: TrainConfig, dir: &Path) -> Result<Self> {
        let state = crate::checkpoint::read_state(dir)?;
        if state.seed != cfg.seed {
            return Err(TrainError::CheckpointSeed {
                path: dir.to_path_buf(),
                checkpoint: state.seed,
                config: cfg.seed,
            });
        }
        let device = cfg.train.device_spec()?.open()?;
        let policy = TrainablePolicy::load_on(dir, &device).map_err(|e| checkpoint_err(dir, e))?;
        let tokenizer = ModelText::from_model_dir(dir)?;
        Self::assemble(cfg, policy, tokenizer, Some((dir, state)))
    }

    fn assemble(
        cfg: TrainConfig,
        policy: TrainablePolicy,
        tokenizer: ModelText,
        resume: Option<(&Path, TrainerState)>,
    ) -> Result<Self> {
        let mut policy = policy;
        policy.set_precision(cfg.train.precision()?);
        if tokenizer.vocab_size() > policy.config().vocab_size {
            return Err(TrainError::VocabularyTooSmall {
                tokenizer: tokenizer.vocab_size(),
                model: policy.config().vocab_size,
            });
        }
        let params = AdamWParams {
            beta1: cfg.optim.beta1,
            beta2: cfg.optim.beta2,
            eps: cfg.optim.adam_eps,
            weight_decay: cfg.optim.weight_decay,
        };
        let mut optimizer = AdamW::new(policy.vars().to_vec(), params, decay_matrices_only)?;
        let engine_cfg = EngineConfig {
            dtype: rollout_dtype(&cfg.rollout.dtype)?,
            router_dtype: rollout_router_dtype(&cfg.rollout.router_dtype)?,
            ..EngineConfig::default()
        };
        // A fleet samples and evaluates: no second copy of the weights in this process.
        let engine = match cfg.rollout.backend {
            RolloutBackend::Engine => Some(Engine::new(
                policy.config().clone(),
                &policy.tensor_map()?,
                engine_cfg,
            )?),
            RolloutBackend::Sglang => None,
        };
        let eos = config_eos_ids(policy.config());
        let reward = Reward::from_spec(&cfg.reward, cfg.task.format_reward as f32);
        let (step, prompts) = match resume {
            Some((dir, state)) => {
                load_optimizer(dir, &state, &mut optimizer)?;
                let prompts = PromptSource::new(
                    &cfg,
                    &tokenizer,
                    Some(state.word_pos()?),
                    state.dataset_position,
                )?;
                (state.step, prompts)
            }
            None => (0, PromptSource::new(&cfg, &tokenizer, None, None)?),
        };
        let fleet = FleetRollout::connect(&cfg, &policy, &tokenizer, step)?;
        Ok(Self {
            cfg,
            policy,
            optimizer,
            engine,
            eos,
            tokenizer,
            prompts,
            reward,
            step,
            fleet,
            ahead: None,
        })
    }

    /// The next `n` training prompts (the seeded problem stream, or the dataset's epoch order).
    pub fn next_prompts(&mut self, n: usize) -> Result<Vec<PromptItem>> {
        self.prompts.next_items(n, self.cfg.seed, &self.tokenizer)
    }

    /// The steps this run takes: `steps`, or fewer when `data.total_epochs` ends first.
    pub fn total_steps(&self) -> u64 {
        let rows = match &self.prompts {
            PromptSource::Arithmetic { .. } => None,
            PromptSource::Dataset { train, .. } => Some(train.items.len()),
        };
        self.cfg.total_steps(rows)
    }

    /// Pushes the policy's current weights into the in-process rollout engine (if any);
    /// returns seconds taken.
    pub fn sync_weights(&mut self) -> Result<f64> {
        let t = Instant::now();
        if let Some(engine) = self.engine.as_mut() {
            engine.update_weights(&self.policy.tensor_map()?)?;
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Held-out accuracy of the current weights (native routing, eval settings), on the
    /// in-process engine or the fleet's workers.
    pub fn evaluate(&mut self) -> Result<EvalResult> {
        let items = self.prompts.eval_items(&self.tokenizer)?;
        evaluate_prompts(
            generator(&mut self.engine, &mut self.fleet)?,
            &self.eos,
            &self.tokenizer,
            &items,
            &self.reward,
            self.cfg.rollout.max_new_tokens,
            self.cfg.eval.temperature as f32,
            self.cfg.eval.seed,
        )
    }

    /// Writes a checkpoint of the current step into the run directory.
    pub fn save_checkpoint(&self, run_dir: &Path) -> Result<std::path::PathBuf> {
        let (stream_pos, dataset_position) = self.prompt_position();
        let mut state = state_at(
            self.step,
            self.optimizer.step_count(),
            self.cfg.seed,
            stream_pos,
        );
        state.dataset_position = dataset_position;
        save_checkpoint(
            run_dir,
            &self.policy,
            &self.optimizer,
            &self.tokenizer,
            &state,
            self.cfg.checkpoint.keep_last,
        )
    }
}

/// Where the trainer's requests go: the fleet when there is one, else the in-process engine.
pub fn generator<'a>(
    engine: &'a mut Option<Engine>,
    fleet: &'a mut Option<FleetRollout>,
) -> Result<Generator<'a>> {
    match (fleet.as_mut(), engine.as_mut()) {
        (Some(fleet), _) => Ok(Generator::Fleet(fleet)),
        (None, Some(engine)) => Ok(Generator::Engine(engine)),
        (None, None) => Err(TrainError::InvalidConfig {
            field: "rollout.backend",
            reason: "neither an in-process engine nor a fleet to generate with".into(),
        }),
    }
}

fn checkpoint_err(dir: &Path, e: TrainError) -> TrainError {
    TrainError::Load {
        path: dir.to_path_buf(),
        source: Box::new(e),
    }
}
