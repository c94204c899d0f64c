//! The trainer: its state (the resolved config, the trainable policy and its AdamW, the
//! rollout backend, the prompt source with its eval prompts and position, the reward)
//! and what it does: build itself from a base model or a checkpoint, run one RL step —
//! rollout → reward → GRPO advantages (+ dynamic sampling) → the updates → weight sync
//! to the rollout backend → metrics — evaluate, and write checkpoints. The step's data
//! is in `step`, its updates in `updates`, its metrics line in `step_metrics`.

use std::path::Path;
use std::time::Instant;

use r3_model::{check_map_holds, Config, DeviceSpec, WeightPrecision, Weights};
use r3_rollout::{config_eos_ids, GenerateRequest};
use r3_tasks::{DatasetPosition, Reward};

use crate::algo::optim::{decay_matrices_only, AdamW, AdamWParams, UpdateStaging};
use crate::config::train::TrainConfig;
use crate::error::{Result, StepPhase, TrainError};
use crate::policy::model_text::ModelText;
use crate::policy::trainable::TrainablePolicy;
use crate::rl::ahead::{generate_while, AheadBatch};
use crate::rl::backend::{rollout_dtype, Backend};
use crate::rl::checkpoint::{load_optimizer, save_checkpoint, state_at, TrainerState};
use crate::rl::diagnostics::logp_mismatch;
use crate::rl::failed_groups::{drop_failed_groups, refuse_fleet_failures, FailedGroups};
use crate::rl::memory::{lap_peak, reset_peak};
use crate::rl::metrics_log::StepMetrics;
use crate::rl::prompt_source::{PromptItem, PromptSource};
use crate::rl::refill::fill_groups;
use crate::rl::sampling::{evaluate_prompts, group_requests, score_groups, EvalResult};
use crate::rl::step::{sampling_spec, update_settings, StepBatch, StepContext, StepTrace};
use crate::rl::step_metrics::{finish_metrics, stale_frac};
use crate::rl::updates::{run_updates, Updates};

/// Everything one RL run mutates.
#[derive(Debug)]
pub struct Trainer {
    /// The resolved config.
    pub cfg: TrainConfig,
    /// Trainable weights (f32).
    pub policy: TrainablePolicy,
    /// AdamW over the policy's variables.
    pub optimizer: AdamW,
    /// Where rollouts are generated: the in-process engine with the policy's current
    /// weights, or a rollout fleet (`rollout.backend = "sglang"`).
    pub backend: Backend,
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
    /// The precision every weight was checked against at start (the rollout's).
    start_precision: WeightPrecision,
}

/// The policy in model directory `dir` on `cfg`'s training device, at its precision and
/// with its master weights (`train.*`).
fn load_policy(cfg: &TrainConfig, dir: &Path) -> Result<TrainablePolicy> {
    let device = cfg.train.device_spec()?.open()?;
    TrainablePolicy::load_for_training(
        dir,
        &device,
        cfg.train.precision()?,
        cfg.train.master_weights()?,
    )
    .map_err(|e| checkpoint_err(dir, e))
}

impl Trainer {
    /// A fresh trainer on the base model of `cfg.model_dir`.
    pub fn new(cfg: TrainConfig) -> Result<Self> {
        let dir = cfg.model_dir.clone();
        let policy = load_policy(&cfg, &dir)?;
        let tokenizer = ModelText::from_model_dir(&dir)?;
        Self::assemble(cfg, policy, tokenizer, None)
    }

    /// A fresh trainer on a model held in memory instead of `cfg.model_dir`'s files: its
    /// config, its f32 weights (on `cfg`'s training device, `train.device`) and its
    /// tokenizer; then as [`Trainer::new`]. For a benchmark whose weights are drawn on the
    /// GPU: billions of parameters never written to disk or crossing the host.
    pub fn with_model(
        cfg: TrainConfig,
        model_cfg: Config,
        weights: Weights,
        tokenizer: ModelText,
    ) -> Result<Self> {
        let device = cfg.train.device_spec()?;
        let elsewhere = weights
            .tensors()
            .iter()
            .find(|(_, t)| DeviceSpec::of(t.device()) != device);
        if let Some((name, t)) = elsewhere {
            return Err(TrainError::InvalidConfig {
                field: "train.device",
                reason: format!(
                    "the weight {name} lives on {}, not on the training device {device}",
                    DeviceSpec::of(t.device())
                ),
            });
        }
        let policy = TrainablePolicy::for_training(
            model_cfg,
            weights,
            cfg.train.precision()?,
            cfg.train.master_weights()?,
        )?;
        Self::assemble(cfg, policy, tokenizer, None)
    }

    /// A trainer restored from checkpoint `dir` (weights, moments, step, stream position).
    pub fn from_checkpoint(cfg: TrainConfig, dir: &Path) -> Result<Self> {
        let state = crate::rl::checkpoint::read_state(dir)?;
        if state.seed != cfg.seed {
            return Err(TrainError::CheckpointSeed {
                path: dir.to_path_buf(),
                checkpoint: state.seed,
                config: cfg.seed,
            });
        }
        let policy = load_policy(&cfg, dir)?;
        let tokenizer = ModelText::from_model_dir(dir)?;
        Self::assemble(cfg, policy, tokenizer, Some((dir, state)))
    }

    fn assemble(
        cfg: TrainConfig,
        mut policy: TrainablePolicy,
        mut tokenizer: ModelText,
        resume: Option<(&Path, TrainerState)>,
    ) -> Result<Self> {
        tokenizer.fit_model(policy.config().vocab_size)?;
        policy.set_score_tiles(cfg.algo.attention_tiles());
        let params = AdamWParams {
            beta1: cfg.optim.beta1,
            beta2: cfg.optim.beta2,
            eps: cfg.optim.adam_eps,
            weight_decay: cfg.optim.weight_decay,
        };
        // The rollout precision must hold every weight: at start (else the run stops, naming
        // the tensor) and after every update (else the update is skipped and counted in
        // `update.skipped`), so no checkpoint or sync holds a weight its engine cannot.
        let rollout_precision = rollout_dtype(&cfg.rollout.dtype)?.weight_precision();
        // Scanned where the weights live (on a GPU by its kernels: no host copy of them).
        check_map_holds(&policy.device_tensor_map(), rollout_precision)?;
        let mut optimizer = AdamW::new(policy.vars().to_vec(), params, decay_matrices_only)?;
        optimizer.set_weight_precision(rollout_precision);
        optimizer.set_staging(cfg.optim.update_staging);
        optimizer.set_rounding_seed(cfg.seed);
        optimizer.set_moment_dtype(cfg.optim.moment_dtype()?)?;
        if optimizer.moment_dtype() != candle_core::DType::F32 {
            tracing::info!(
                "AdamW's moments kept in bf16, rounded stochastically (optim.moments_dtype)"
            );
        }
        if optimizer.bf16_variables() > 0 {
            tracing::info!(
                matrices = optimizer.bf16_variables(),
                "weight matrices held in bf16 without f32 masters, updates rounded \
                 stochastically (train.master_weights = \"bf16\")"
            );
        }
        if cfg.train.holds_narrow_copies(&policy.device())? {
            // The optimiser rewrites the copies after every update it applies.
            let copies = policy.hold_narrow_copies()?;
            let bytes: usize = copies
                .iter()
                .map(|(_, c)| c.elem_count() * c.dtype().size_in_bytes())
                .sum();
            tracing::info!(
                matrices = copies.len(),
                mib = bytes >> 20,
                "holding 16-bit copies of the weight matrices (train.narrow_weight_copies)"
            );
            optimizer.hold_narrow_copies(copies)?;
        }
        // The memory settings that change no value, said once so a run's log shows them.
        if cfg.train.narrow_gradients || cfg.optim.update_staging != UpdateStaging::WholeStep {
            tracing::info!(
                narrow_gradients = cfg.train.narrow_gradients,
                update_staging = ?cfg.optim.update_staging,
                "memory: weight gradients kept in 16 bits where exact (train.narrow_gradients), \
                 the guarded update staged as optim.update_staging says"
            );
        }
        let eos = config_eos_ids(policy.config());
        let reward = Reward::from_spec(&cfg.reward, cfg.task.format_reward as f32);
        let prompt_room = cfg.prompt_room(policy.config().max_position_embeddings);
        let (step, prompts) = match resume {
            Some((dir, state)) => {
                load_optimizer(dir, &state, &mut optimizer)?;
                let prompts = PromptSource::new(
                    &cfg,
                    &tokenizer,
                    prompt_room,
                    Some(state.word_pos()?),
                    state.dataset_position,
                )?;
                (state.step, prompts)
            }
            None => (
                0,
                PromptSource::new(&cfg, &tokenizer, prompt_room, None, None)?,
            ),
        };
        // A fleet samples and evaluates: no second copy of the weights in this process.
        let backend = Backend::connect(&cfg, &policy, &tokenizer, step)?;
        Ok(Self {
            cfg,
            policy,
            optimizer,
            backend,
            eos,
            tokenizer,
            prompts,
            reward,
            step,
            start_precision: rollout_precision,
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

    /// With `data.total_epochs`, the prompts refill rounds of step `step` may still draw: those
    /// of the epochs the cursor has not reached, less what the run's later steps need, so a
    /// run that refills stays within its epochs and takes its steps; None: no limit.
    fn refill_budget(&self, step: u64) -> Option<u64> {
        let (rows, epochs) = match &self.prompts {
            PromptSource::Dataset { train, .. } if self.cfg.data.total_epochs > 0 => {
                (train.items.len() as u64, self.cfg.data.total_epochs)
            }
            _ => return None,
        };
        let at = self.prompts.dataset_position()?;
        let drawn = at
            .epoch
            .saturating_mul(rows)
            .saturating_add(at.index as u64);
        let later_steps = self.total_steps().saturating_sub(step);
        let later = later_steps.saturating_mul(self.cfg.rollout.prompts_per_step as u64);
        Some(
            rows.saturating_mul(epochs)
                .saturating_sub(drawn)
                .saturating_sub(later),
        )
    }

    /// The prompt stream's position after the last completed step: before the batch drawn
    /// ahead when there is one.
    pub fn prompt_position(&self) -> (u128, Option<DatasetPosition>) {
        match self.backend.ahead() {
            Some(ahead) => (ahead.stream_pos, ahead.dataset_position),
            None => (self.prompts.stream_pos(), self.prompts.dataset_position()),
        }
    }

    /// Held-out evaluation of the current weights (native routing, `[eval]` settings:
    /// `samples_per_prompt` samples per prompt), on the in-process engine or the fleet's
    /// workers.
    pub fn evaluate(&mut self) -> Result<EvalResult> {
        let items = self.prompts.eval_items(&self.tokenizer)?;
        evaluate_prompts(
            &mut self.backend,
            &self.eos,
            &self.tokenizer,
            &items,
            &self.reward,
            &self.cfg.eval_spec(),
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

    /// Runs RL step `self.step + 1` and returns its metrics line (without eval).
    pub fn rl_step(&mut self) -> Result<StepMetrics> {
        self.rl_step_with(None)
    }

    /// [`Trainer::rl_step`], also filling `trace` (when given) with the routes each pass used.
    pub fn rl_step_with(&mut self, mut trace: Option<&mut StepTrace>) -> Result<StepMetrics> {
        let step = self.step + 1;
        let cfg = self.cfg.clone();
        // The memory high-water mark is reset here and read (then reset) after each phase:
        // the step's mark is the highest of its phases'. Reading it computes nothing the
        // metrics depend on.
        let peaks_known = reset_peak();
        // On a GPU also the device's: its tensors' high-water mark over the step. A metric
        // the driver refuses is left out with a warning; it never stops the run.
        let device = self.policy.device();
        let device_peak_known = match r3_model::device::reset_device_memory_peak(&device) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("memory.device_peak_mib left out: {e}");
                false
            }
        };
        let data = self
            .sample_step(step, &cfg)
            .map_err(|e| StepPhase::Rollout.out_of_memory_in(step, e))?;
        let rollout_peak_mib = lap_peak();
        if let Some(trace) = trace.as_deref_mut() {
            trace.sequences = data.batch.sequences().to_vec();
            trace.prompt_lens = data
                .trajs
                .iter()
                .map(|t| t.sample.prompt_ids.len())
                .collect();
            trace.cached_tokens = data.trajs.iter().map(|t| t.sample.cached_tokens).collect();
            trace.rollout_tables = data.routes.as_ref().map(|r| r.tables().to_vec());
            trace.rewards = data.trajs.iter().map(|t| t.reward).collect();
            trace.advantages = data.advantages.clone();
        }
        let ctx = StepContext {
            step,
            cfg: &cfg,
            data: &data,
            settings: update_settings(&cfg)?,
            schedule: cfg.lr_schedule(self.total_steps()),
            trace,
        };
        // Every weight was checked at start and every update is kept by the optimiser's
        // guard, so the wider of those two precisions holds them all (the rollout's, unless
        // the guard was changed) and the engine need not scan them again. This rests on the
        // weights changing only through `step`'s update.
        let guard = self.optimizer.weight_precision();
        let held = if guard.max_finite() >= self.start_precision.max_finite() {
            guard
        } else {
            self.start_precision
        };
        // The in-process device engine's weights are the old ones until the sync: let go
        // for the update where the engine shares the policy's device (on a GPU, the whole
        // model in the engine's formats), built again by the sync.
        let released = self.backend.release_for_update(&self.policy)?;
        let updates = if cfg.rollout.async_rollout && step < self.total_steps() {
            self.updates_drawing_ahead(ctx)
        } else {
            run_updates(&self.policy, &mut self.optimizer, ctx)
        };
        let updates = match updates {
            Ok(updates) => updates,
            Err(e) => {
                // A released engine is built again from the policy's weights as they are
                // now (a failed update may have committed some of its mini-batches), so a
                // caller that goes on (or evaluates) still has an engine; the update's error
                // is the one reported. An engine that kept its weights is left as it is.
                if released {
                    if let Err(restore) =
                        self.backend
                            .sync(&self.policy, &self.tokenizer, self.step, held)
                    {
                        tracing::warn!(error = %restore, "the rollout engine's weights could not be built again after a failed update");
                    }
                }
                return Err(StepPhase::Update.out_of_memory_in(step, e));
            }
        };
        let update_peak_mib = lap_peak();
        // The sync straight after the update: nothing between may leave a released engine
        // without weights.
        let sync_s = self
            .backend
            .sync(&self.policy, &self.tokenizer, step, held)
            .map_err(|e| StepPhase::WeightSync.out_of_memory_in(step, e))?;
        let sync_peak_mib = lap_peak();
        let train_lp = data.batch.gather_responses(&updates.view.logp)?;
        let (mismatch, non_finite) = logp_mismatch(&train_lp, &data.rollout_lp)?;
        self.step = step;
        let mut metrics = finish_metrics(step, &cfg, &data, &updates, mismatch.as_ref(), sync_s);
        metrics.mismatch_non_finite_tokens = non_finite as u64;
        if peaks_known {
            metrics.rollout_peak_mib = rollout_peak_mib;
            metrics.old_logp_peak_mib = updates.old_logp_peak_mib;
            metrics.update_peak_mib = update_peak_mib;
            metrics.sync_peak_mib = sync_peak_mib;
            // Known only when every phase's lap is: a missing one could hold the peak.
            metrics.peak_mib = match (rollout_peak_mib, update_peak_mib, sync_peak_mib) {
                (Some(r), Some(u), Some(s)) => Some(
                    updates
                        .old_logp_peak_mib
                        .map_or(r, |o| r.max(o))
                        .max(u)
                        .max(s),
                ),
                _ => None,
            };
        }
        if device_peak_known {
            metrics.device_peak_mib = match r3_model::device::device_memory_peak(&device) {
                Ok(peak) => peak.map(|bytes| bytes as f64 / (1024.0 * 1024.0)),
                Err(e) => {
                    tracing::warn!("memory.device_peak_mib left out: {e}");
                    None
                }
            };
        }
        if let Some(pos) = self.prompt_position().1 {
            metrics.data_epoch = Some(pos.epoch);
            metrics.data_filtered_prompts = Some(self.prompts.filtered() as u64);
        }
        if let Some(f) = self.backend.fleet() {
            f.fill_metrics(&mut metrics);
        }
        Ok(metrics)
    }

    /// The `group_size` sampling requests per prompt of `items` for rollout round `round`
    /// of step `step`.
    fn step_requests(
        &self,
        cfg: &TrainConfig,
        items: &[PromptItem],
        step: u64,
        round: u64,
    ) -> Vec<GenerateRequest> {
        group_requests(
            &self.eos,
            &self.tokenizer,
            items,
            sampling_spec(cfg),
            cfg.seed,
            (step, round),
        )
    }

    /// Rollout, rewards and advantages of step `step`: the batch generated ahead during
    /// the previous step when there is one, otherwise sampled now.
    fn sample_step(&mut self, step: u64, cfg: &TrainConfig) -> Result<StepBatch> {
        let group = cfg.rollout.group_size;
        let t_rollout = Instant::now();
        let (prompts, outcomes, rollout_ahead_s) = match self.backend.take_ahead() {
            Some(ahead) => {
                debug_assert_eq!(ahead.step, step, "a batch generated ahead for another step");
                let outcomes = refuse_fleet_failures(ahead.results, ahead.stats)?;
                (ahead.items, outcomes, Some(ahead.generate_s))
            }
            None => {
                let prompts = self.next_prompts(cfg.rollout.prompts_per_step)?;
                let requests = self.step_requests(cfg, &prompts, step, 0);
                let outcomes = self.backend.generate_round(requests)?;
                (prompts, outcomes, None)
            }
        };
        // A group with a request the fleet could not serve for the request's own fault is
        // dropped whole (GRPO's advantages need every sample of a prompt); the others keep
        // their order and seeds. Refill rounds draw fresh prompts for them as for uniform
        // groups.
        let mut failed = FailedGroups::default();
        let (prompts, results) = drop_failed_groups(prompts, outcomes, group, 0, &mut failed)?;
        let trajs = score_groups(
            &self.eos,
            &self.tokenizer,
            &prompts,
            results,
            group,
            &self.reward,
        )?;
        let (trajs, rounds) = match cfg.algo.sampling_rounds {
            1 => (trajs, None),
            rounds => {
                let want = cfg.rollout.prompts_per_step;
                let (trajs, drawn) = fill_groups(trajs, group, want, rounds, |round| {
                    if self
                        .refill_budget(step)
                        .is_some_and(|left| left < want as u64)
                    {
                        return Ok(None);
                    }
                    let prompts = self.next_prompts(want)?;
                    let requests = self.step_requests(cfg, &prompts, step, round);
                    let outcomes = self.backend.generate_another_round(requests)?;
                    let (prompts, results) =
                        drop_failed_groups(prompts, outcomes, group, round, &mut failed)?;
                    score_groups(
                        &self.eos,
                        &self.tokenizer,
                        &prompts,
                        results,
                        group,
                        &self.reward,
                    )
                    .map(Some)
                })?;
                (trajs, Some(drawn))
            }
        };
        // Nothing to train on: the step fails rather than take an empty update.
        if trajs.is_empty() && failed.groups > 0 {
            return Err(failed.into_error(step));
        }
        failed.warn(step);
        let failed_counts = self
            .backend
            .fleet()
            .map(|_| (failed.groups, failed.requests));
        let stale_frac = match self.backend.fleet() {
            Some(_) => Some(stale_frac(&trajs, step, cfg.rollout.max_staleness)?),
            None => None,
        };
        let rollout_s = t_rollout.elapsed().as_secs_f64();
        let layout = &self.policy.config().layout;
        let device = self.policy.device();
        let mut batch = StepBatch::new(
            trajs,
            cfg,
            layout,
            &device,
            rollout_s,
            rollout_ahead_s,
            stale_frac,
        )?;
        if let Some(r) = rounds {
            batch.groups_dropped = r.groups_uniform;
            batch.sampling = Some(r);
        }
        batch.failed = failed_counts;
        Ok(batch)
    }

    /// The step's updates, with step `step + 1`'s batch generated by the fleet on another
    /// thread meanwhile (same prompts and seeds as the synchronous loop would use, on the
    /// weights before this step's update); see `ahead`.
    fn updates_drawing_ahead(&mut self, ctx: StepContext<'_>) -> Result<Updates> {
        let next = ctx.step + 1;
        let (stream_pos, dataset_position) = self.prompt_position();
        let items = self.next_prompts(ctx.cfg.rollout.prompts_per_step)?;
        let requests = self.step_requests(ctx.cfg, &items, next, 0);
        let Backend::Fleet(fleet) = &mut self.backend else {
            return Err(TrainError::InvalidConfig {
                field: "rollout.async",
                reason: "needs rollout.backend = \"sglang\"".into(),
            });
        };
        let (policy, optimizer) = (&self.policy, &mut self.optimizer);
        let (updates, generated) = generate_while(&fleet.fleet, requests, || {
            run_updates(policy, optimizer, ctx)
        });
        let updates = updates?;
        // The next step's rollout, whatever phase this step is in.
        let (results, stats, generate_s) =
            generated.map_err(|e| StepPhase::Rollout.out_of_memory_in(next, e))?;
        fleet.ahead = Some(AheadBatch {
            step: next,
            items,
            results,
            stats,
            generate_s,
            stream_pos,
            dataset_position,
        });
        Ok(updates)
    }
}

fn checkpoint_err(dir: &Path, e: TrainError) -> TrainError {
    TrainError::Load {
        path: dir.to_path_buf(),
        source: Box::new(e),
    }
}
