//! The trainer's state: the resolved config, the trainable policy and its AdamW, the
//! rollout engine holding the same weights, the task with its eval set and the position
//! of the training-problem stream. Building it from a base model or a checkpoint, weight
//! sync, evaluation and checkpoint writes live here; one RL step is in `step.rs`.

use std::path::Path;
use std::time::Instant;

use r3_rollout::{Dtype, Engine, EngineConfig};
use r3_tasks::{ArithmeticTask, CharTokenizer, Difficulty, Problem, RewardConfig};

use crate::checkpoint::{load_optimizer, save_checkpoint, state_at, TrainerState};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::fleet_sync::FleetRollout;
use crate::optim::{decay_matrices_only, AdamW, AdamWParams};
use crate::policy::TrainablePolicy;
use crate::rollout::{evaluate, EvalResult};

/// Everything one RL run mutates.
#[derive(Debug)]
pub struct Trainer {
    /// The resolved config.
    pub cfg: TrainConfig,
    /// Trainable weights (f32).
    pub policy: TrainablePolicy,
    /// AdamW over the policy's variables.
    pub optimizer: AdamW,
    /// The rollout engine (f16 by default) with the policy's current weights.
    pub engine: Engine,
    /// Character tokenizer of the model.
    pub tokenizer: CharTokenizer,
    /// Problems and the held-out eval set.
    pub task: ArithmeticTask,
    /// Reward rule.
    pub reward: RewardConfig,
    /// RL steps completed.
    pub step: u64,
    /// Word position of the training-problem stream.
    pub stream_pos: u128,
    /// The rollout fleet when `rollout.backend = "sglang"` (the engine then only evaluates).
    pub fleet: Option<FleetRollout>,
}

/// Parses the rollout precision (`f16` or `f32`).
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
        let policy = TrainablePolicy::load(&dir).map_err(|e| checkpoint_err(&dir, e))?;
        let tokenizer = CharTokenizer::from_file(&dir.join("tokenizer.json"))?;
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
        let policy = TrainablePolicy::load(dir).map_err(|e| checkpoint_err(dir, e))?;
        let tokenizer = CharTokenizer::from_file(&dir.join("tokenizer.json"))?;
        Self::assemble(cfg, policy, tokenizer, Some((dir, state)))
    }

    fn assemble(
        cfg: TrainConfig,
        policy: TrainablePolicy,
        tokenizer: CharTokenizer,
        resume: Option<(&Path, TrainerState)>,
    ) -> Result<Self> {
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
            ..EngineConfig::default()
        };
        let engine = Engine::new(policy.config().clone(), &policy.tensor_map()?, engine_cfg)?;
        let task = ArithmeticTask::new(
            Difficulty::level(cfg.task.difficulty)?,
            cfg.eval.size,
            cfg.eval.seed,
        )?;
        let reward = RewardConfig {
            format_reward: cfg.task.format_reward as f32,
        };
        let (step, stream_pos) = match resume {
            Some((dir, state)) => {
                load_optimizer(dir, &state, &mut optimizer)?;
                (state.step, state.word_pos()?)
            }
            None => (0, task.train_stream(cfg.seed).word_pos()),
        };
        let fleet = FleetRollout::connect(&cfg, &policy, &tokenizer, step)?;
        Ok(Self {
            cfg,
            policy,
            optimizer,
            engine,
            tokenizer,
            task,
            reward,
            step,
            stream_pos,
            fleet,
        })
    }

    /// The next `n` training problems of the seeded stream.
    pub fn next_problems(&mut self, n: usize) -> Result<Vec<Problem>> {
        let mut stream = self.task.train_stream(self.cfg.seed);
        stream.set_word_pos(self.stream_pos);
        let problems = stream.take_problems(n)?;
        self.stream_pos = stream.word_pos();
        Ok(problems)
    }

    /// Pushes the policy's current weights into the rollout engine; returns seconds taken.
    pub fn sync_weights(&mut self) -> Result<f64> {
        let t = Instant::now();
        self.engine.update_weights(&self.policy.tensor_map()?)?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// Held-out accuracy of the engine's current weights (native routing, eval settings).
    pub fn evaluate(&mut self) -> Result<EvalResult> {
        evaluate(
            &mut self.engine,
            &self.tokenizer,
            self.task.eval_set(),
            self.cfg.rollout.max_new_tokens,
            self.cfg.eval.temperature as f32,
            self.cfg.eval.seed,
        )
    }

    /// Writes a checkpoint of the current step into the run directory.
    pub fn save_checkpoint(&self, run_dir: &Path) -> Result<std::path::PathBuf> {
        let state = state_at(
            self.step,
            self.optimizer.step_count(),
            self.cfg.seed,
            self.stream_pos,
        );
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

fn checkpoint_err(dir: &Path, e: TrainError) -> TrainError {
    TrainError::Load {
        path: dir.to_path_buf(),
        source: Box::new(e),
    }
}
