//! One RL step, the spine of training: rollout → reward → GRPO advantages (+ dynamic
//! sampling) → the updates → weight sync to the rollout engine → metrics.
//!
//! Replay modes: R3 replays the rollout routes in the old-log-prob pass and every update;
//! R2 records the old pass's routes and replays them in every update; disabled routes
//! natively. With one mini-batch the old policy *is* the update forward (ratio 1, as in
//! the paper's single mini-step), so no separate old pass runs: the update forward's
//! detached log-probs serve as old log-probs and for the diagnostics
//! ([`Trainer::single_update`]). With more, the old log-probs come from a separate pass
//! and the kept rows are shuffled into mini-batches ([`Trainer::minibatch_updates`]).

use std::time::Instant;

use candle_core::Tensor;
use r3_model::{ReplayProof, ReplayRoutes, Routing};
use r3_rollout::GenerateRequest;
use r3_routing::{MismatchMetrics, RouteTable};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::advantage::{filter_uniform_groups, grpo_advantages, GrpoOptions};
use crate::config::{RouterReplay, TrainConfig};
use crate::diagnostics::{
    logp_mismatch, proof_divergence, recorded_divergence, verify_proof, RouteDivergence,
};
use crate::error::{Result, TrainError};
use crate::metrics_log::StepMetrics;
use crate::minibatch::{update_minibatch, MiniBatch, MiniBatchResult, UpdateSettings};
use crate::policy::{score, ResponseBatch};
use crate::prompt_source::PromptItem;
use crate::rollout::{
    group_requests, mix_seed, response_batch, rollout_routes, score_groups, SamplingSpec,
    Trajectory,
};
use crate::trainer::{generator, Trainer};
use crate::update::UpdateOutcome;

/// Which routes each pass of a step used, for checking the replay modes (opt in with
/// [`Trainer::rl_step_with`]).
#[derive(Debug, Clone, Default)]
pub struct StepTrace {
    /// Prompt+response tokens of the step's trajectories.
    pub sequences: Vec<Vec<u32>>,
    /// Rollout route tables of the step's trajectories (`len − 1` rows each).
    pub rollout_tables: Option<Vec<RouteTable>>,
    /// Replay proof of the separate old-log-prob pass (R3, multi mini-step).
    pub old_proof: Option<ReplayProof>,
    /// Routes recorded by the old-log-prob pass (R2 and disabled, multi mini-step).
    pub old_recorded: Option<Vec<RouteTable>>,
    /// Per update mini-batch: its trajectory rows and the replay proof of its forward.
    pub updates: Vec<(Vec<usize>, Option<ReplayProof>)>,
}

/// The sampled and scored batch of a step: what the updates work on.
pub(crate) struct StepBatch {
    trajs: Vec<Trajectory>,
    batch: ResponseBatch,
    /// Rollout log-probs per response token.
    rollout_lp: Vec<Vec<f32>>,
    /// The same aligned to the batch, `[n, W]`.
    rollout_logp: Tensor,
    /// Rollout routes of every trajectory, if the engine returned them.
    routes: Option<ReplayRoutes>,
    advantages: Vec<f32>,
    /// Rows that enter the loss (all, or those of non-uniform groups).
    kept_rows: Vec<usize>,
    groups_kept: usize,
    groups_dropped: usize,
    rollout_s: f64,
    /// Seconds the fleet generated this batch in the previous step's shadow (`rollout.async`).
    rollout_ahead_s: Option<f64>,
    /// Fraction of trajectories from weights older than the trainer's (fleet backend).
    stale_frac: Option<f64>,
}

/// What the old-policy view of the batch gave.
struct OldView {
    logp: Tensor,
    recorded: Option<Vec<RouteTable>>,
    entropy: f32,
    verified_frac: Option<f64>,
    divergence: Option<RouteDivergence>,
}

/// What the updates of a step did.
pub(crate) struct Updates {
    view: OldView,
    results: Vec<MiniBatchResult>,
    old_logp_s: f64,
    update_s: f64,
}

impl Trainer {
    /// Runs RL step `self.step + 1` and returns its metrics line (without eval).
    pub fn rl_step(&mut self) -> Result<StepMetrics> {
        self.rl_step_with(None)
    }

    /// [`Trainer::rl_step`], also filling `trace` (when given) with the routes each pass used.
    pub fn rl_step_with(&mut self, mut trace: Option<&mut StepTrace>) -> Result<StepMetrics> {
        let step = self.step + 1;
        let cfg = self.cfg.clone();
        let data = self.sample_step(step, &cfg)?;
        if let Some(trace) = trace.as_deref_mut() {
            trace.sequences = data.batch.sequences().to_vec();
            trace.rollout_tables = data.routes.as_ref().map(|r| r.tables().to_vec());
        }
        let settings = update_settings(&cfg);
        let updates = if cfg.rollout.async_rollout && step < self.total_steps() {
            self.updates_with_rollout_ahead(step, &cfg, &data, settings, trace)?
        } else {
            self.updates(step, &cfg, &data, settings, trace)?
        };
        let train_lp = data.batch.gather_responses(&updates.view.logp)?;
        let mismatch = logp_mismatch(&train_lp, &data.rollout_lp)?;
        let sync_s = self.sync_weights()? + self.sync_fleet(step)?;
        self.step = step;
        let mut metrics = finish_metrics(step, &cfg, &data, &updates, mismatch.as_ref(), sync_s);
        if let Some(pos) = self.prompt_position().1 {
            metrics.data_epoch = Some(pos.epoch);
            metrics.data_filtered_prompts = Some(self.prompts.filtered() as u64);
        }
        if let Some(f) = &self.fleet {
            f.fill_metrics(&mut metrics);
        }
        Ok(metrics)
    }

    /// The updates of step `step` on its batch: one, or one per mini-batch.
    pub(crate) fn updates(
        &mut self,
        step: u64,
        cfg: &TrainConfig,
        data: &StepBatch,
        settings: UpdateSettings,
        trace: Option<&mut StepTrace>,
    ) -> Result<Updates> {
        if cfg.algo.mini_batches > 1 {
            self.minibatch_updates(step, cfg, data, settings, trace)
        } else {
            self.single_update(cfg, data, settings, trace)
        }
    }

    /// The `group_size` sampling requests per prompt of `items` for step `step`.
    pub(crate) fn step_requests(
        &self,
        cfg: &TrainConfig,
        items: &[PromptItem],
        step: u64,
    ) -> Vec<GenerateRequest> {
        group_requests(
            &self.eos,
            &self.tokenizer,
            items,
            sampling_spec(cfg),
            cfg.seed,
            step,
        )
    }

    /// Rollout, rewards and advantages of step `step`: the batch generated ahead during
    /// the previous step when there is one, otherwise sampled now.
    fn sample_step(&mut self, step: u64, cfg: &TrainConfig) -> Result<StepBatch> {
        let group = cfg.rollout.group_size;
        let t_rollout = Instant::now();
        let (prompts, results, rollout_ahead_s) = match self.ahead.take() {
            Some(ahead) => {
                debug_assert_eq!(ahead.step, step, "a batch generated ahead for another step");
                if let Some(f) = self.fleet.as_mut() {
                    f.last = ahead.stats;
                }
                (ahead.items, ahead.results, Some(ahead.generate_s))
            }
            None => {
                let prompts = self.next_prompts(cfg.rollout.prompts_per_step)?;
                let requests = self.step_requests(cfg, &prompts, step);
                let results = generator(&mut self.engine, &mut self.fleet)?.generate(requests)?;
                (prompts, results, None)
            }
        };
        let trajs = score_groups(&self.tokenizer, &prompts, results, group, &self.reward)?;
        let stale_frac = match self.fleet {
            Some(_) => Some(stale_frac(&trajs, step, cfg.rollout.max_staleness)?),
            None => None,
        };
        let rollout_s = t_rollout.elapsed().as_secs_f64();

        let batch = response_batch(&trajs)?;
        let rollout_lp: Vec<Vec<f32>> = trajs.iter().map(|t| t.rollout_logp.clone()).collect();
        let rollout_logp = batch.align(&rollout_lp, &self.policy.device())?;
        let routes = match trajs.iter().all(|t| t.routes.is_some()) {
            true => Some(rollout_routes(&trajs, &self.policy.config().layout)?),
            false if cfg.algo.router_replay == RouterReplay::R3 => {
                let missing = trajs.iter().position(|t| t.routes.is_none()).unwrap_or(0);
                return Err(TrainError::MissingRolloutRoutes {
                    trajectory: missing,
                });
            }
            false => None,
        };

        let rewards: Vec<f32> = trajs.iter().map(|t| t.reward).collect();
        let opts = GrpoOptions {
            norm_by_std: cfg.algo.adv_norm_by_std,
            eps: cfg.algo.adv_eps as f32,
        };
        let (advantages, _) = grpo_advantages(&rewards, group, opts)?;
        let filter = filter_uniform_groups(&rewards, group)?;
        let (kept_rows, groups_kept, groups_dropped) = if cfg.algo.dynamic_sampling {
            let kept = filter.kept_groups.len();
            (filter.kept_rows(), kept, filter.dropped_groups)
        } else {
            ((0..trajs.len()).collect(), trajs.len() / group, 0)
        };
        Ok(StepBatch {
            trajs,
            batch,
            rollout_lp,
            rollout_logp,
            routes,
            advantages,
            kept_rows,
            groups_kept,
            groups_dropped,
            rollout_s,
            rollout_ahead_s,
            stale_frac,
        })
    }

    /// One update over the whole batch: its forward is the old policy (R3 replays the
    /// rollout routes, R2 and disabled record native routes for the divergence), and rows
    /// dropped by dynamic sampling get loss weight 0.
    fn single_update(
        &mut self,
        cfg: &TrainConfig,
        data: &StepBatch,
        settings: UpdateSettings,
        trace: Option<&mut StepTrace>,
    ) -> Result<Updates> {
        let started = Instant::now();
        let routing = match (cfg.algo.router_replay, &data.routes) {
            (RouterReplay::R3, Some(routes)) => Routing::Replay(routes),
            _ => Routing::Record,
        };
        let mut row_weight = vec![0f32; data.trajs.len()];
        for &r in &data.kept_rows {
            row_weight[r] = 1.0;
        }
        let s = UpdateSettings {
            lr: cfg.lr_schedule().lr_at(self.optimizer.step_count()),
            ..settings
        };
        let mb = MiniBatch {
            batch: &data.batch,
            old_logp: None,
            rollout_logp: data.rollout_logp.clone(),
            advantages: data.advantages.clone(),
            row_weight: Some(row_weight),
            routing,
        };
        let r = update_minibatch(&self.policy, &mut self.optimizer, &mb, &s)?;
        if let Some(trace) = trace {
            trace
                .updates
                .push(((0..data.trajs.len()).collect(), r.replay.clone()));
        }
        let update_s = started.elapsed().as_secs_f64();
        let divergence = match (&r.replay, &r.routes, &data.routes) {
            (Some(proof), _, _) => Some(proof_divergence(proof)),
            (None, Some(recorded), Some(rollout)) => {
                Some(recorded_divergence(rollout.tables(), recorded)?)
            }
            _ => None,
        };
        let view = OldView {
            logp: r.logp.clone(),
            recorded: None,
            entropy: r.entropy,
            verified_frac: r.verified_frac,
            divergence,
        };
        Ok(Updates {
            view,
            results: vec![r],
            old_logp_s: 0.0,
            update_s,
        })
    }

    /// The old-log-prob pass, then one update per mini-batch of the shuffled kept rows,
    /// each replaying the mode's routes (R3: rollout, R2: the old pass's) for its rows.
    fn minibatch_updates(
        &mut self,
        step: u64,
        cfg: &TrainConfig,
        data: &StepBatch,
        settings: UpdateSettings,
        mut trace: Option<&mut StepTrace>,
    ) -> Result<Updates> {
        let mode = cfg.algo.router_replay;
        let t_old = Instant::now();
        let (view, proof) = self.old_pass(&data.batch, data.routes.as_ref(), mode)?;
        if let Some(trace) = trace.as_deref_mut() {
            trace.old_proof = proof;
            trace.old_recorded = view.recorded.clone();
        }
        let replayed = match mode {
            RouterReplay::R3 => data.routes.clone(),
            RouterReplay::R2 => {
                let layout = &self.policy.config().layout;
                let recorded = view.recorded.clone();
                recorded.map(|t| ReplayRoutes::new(t, layout)).transpose()?
            }
            RouterReplay::Disabled => None,
        };
        let old_logp_s = t_old.elapsed().as_secs_f64();

        let t_update = Instant::now();
        let mut rows = data.kept_rows.clone();
        rows.shuffle(&mut ChaCha8Rng::seed_from_u64(mix_seed(&[
            cfg.seed, step, 0x5155,
        ])));
        let chunk = rows.len().div_ceil(cfg.algo.mini_batches).max(1);
        let schedule = cfg.lr_schedule();
        let mut results = Vec::new();
        for part in rows.chunks(chunk) {
            let mb_batch = data.batch.subset(part)?;
            let width = mb_batch.width();
            let idx = Tensor::from_vec(
                part.iter().map(|&r| r as u32).collect(),
                part.len(),
                &self.policy.device(),
            )?;
            let pick = |t: &Tensor| -> Result<Tensor> {
                Ok(t.index_select(&idx, 0)?.narrow(1, 0, width)?.contiguous()?)
            };
            let part_routes = replayed.as_ref().map(|r| r.select(part)).transpose()?;
            let s = UpdateSettings {
                lr: schedule.lr_at(self.optimizer.step_count()),
                ..settings
            };
            let mb = MiniBatch {
                batch: &mb_batch,
                old_logp: Some(pick(&view.logp)?),
                rollout_logp: pick(&data.rollout_logp)?,
                advantages: part.iter().map(|&r| data.advantages[r]).collect(),
                row_weight: None,
                routing: part_routes
                    .as_ref()
                    .map_or(Routing::Native, Routing::Replay),
            };
            let r = update_minibatch(&self.policy, &mut self.optimizer, &mb, &s)?;
            if let Some(trace) = trace.as_deref_mut() {
                trace.updates.push((part.to_vec(), r.replay.clone()));
            }
            results.push(r);
        }
        Ok(Updates {
            view,
            results,
            old_logp_s,
            update_s: t_update.elapsed().as_secs_f64(),
        })
    }

    /// The old-policy pass (no autograd graph) over the whole batch with the mode's
    /// routing: R3 replays the rollout routes, R2 and disabled record native routes.
    fn old_pass(
        &self,
        batch: &ResponseBatch,
        routes: Option<&ReplayRoutes>,
        mode: RouterReplay,
    ) -> Result<(OldView, Option<ReplayProof>)> {
        let model = self.policy.frozen_model()?;
        let routing = match (mode, routes) {
            (RouterReplay::R3, Some(r)) => Routing::Replay(r),
            (RouterReplay::R3, None) => {
                return Err(TrainError::MissingRolloutRoutes { trajectory: 0 })
            }
            _ => Routing::Record,
        };
        let scored = score(&model, batch, routing)?;
        let mask = batch.response_mask(None, &self.policy.device())?;
        let entropy = scored.mean_entropy(&mask)?;
        let rollout = routes.map(ReplayRoutes::tables);
        let (verified_frac, divergence) = match (&scored.replay, &scored.routes, rollout) {
            (Some(proof), _, Some(t)) => (
                Some(verify_proof(proof, t, mode, "old-logp")?),
                Some(proof_divergence(proof)),
            ),
            (None, Some(rec), Some(t)) => (None, Some(recorded_divergence(t, rec)?)),
            _ => (None, None),
        };
        let view = OldView {
            logp: scored.logp.detach(),
            recorded: scored.routes,
            entropy,
            verified_frac,
            divergence,
        };
        Ok((view, scored.replay))
    }
}

/// Loss and optimiser settings of the step's updates (the LR is set per update).
fn update_settings(cfg: &TrainConfig) -> UpdateSettings {
    UpdateSettings {
        loss: cfg.algo.loss,
        clip: cfg.clip_range(),
        agg: cfg.algo.loss_agg,
        is: cfg.is_config(),
        entropy_coef: cfg.algo.entropy_coef,
        lr: 0.0,
        grad_clip: cfg.optim.grad_clip,
        mode: cfg.algo.router_replay,
        grad_hook: None,
    }
}

/// The metrics line of a finished step, with its timings.
fn finish_metrics(
    step: u64,
    cfg: &TrainConfig,
    data: &StepBatch,
    updates: &Updates,
    mismatch: Option<&MismatchMetrics>,
    sync_s: f64,
) -> StepMetrics {
    let mut m = step_metrics(
        step,
        cfg,
        &data.trajs,
        &updates.results,
        mismatch,
        &updates.view,
    );
    m.groups_kept = data.groups_kept as u64;
    m.groups_dropped = data.groups_dropped as u64;
    m.rollout_s = data.rollout_s;
    m.rollout_ahead_s = data.rollout_ahead_s;
    m.rollout_stale_frac = data.stale_frac;
    m.old_logp_s = updates.old_logp_s;
    m.update_s = updates.update_s;
    m.sync_s = sync_s;
    let total_s = data.rollout_s + updates.old_logp_s + updates.update_s + sync_s;
    let tokens: usize = data.batch.sequences().iter().map(Vec::len).sum();
    m.tokens_per_s = if total_s > 0.0 {
        tokens as f64 / total_s
    } else {
        0.0
    };
    m
}

/// How step `step`'s batch is sampled.
pub(crate) fn sampling_spec(cfg: &TrainConfig) -> SamplingSpec {
    SamplingSpec {
        group_size: cfg.rollout.group_size,
        max_new_tokens: cfg.rollout.max_new_tokens,
        temperature: cfg.rollout.temperature as f32,
    }
}

/// The fraction of trajectories of step `step` from weights older than the trainer's
/// (version `step − 1`); an error when one is more than `max_staleness` versions older.
fn stale_frac(trajs: &[Trajectory], step: u64, max_staleness: u64) -> Result<f64> {
    let policy = step - 1;
    let mut stale = 0usize;
    for t in trajs {
        let version = t.oldest_version();
        let age = policy.saturating_sub(version);
        if age > max_staleness {
            return Err(TrainError::StaleRollout {
                step,
                version,
                policy,
                age,
                max: max_staleness,
            });
        }
        stale += usize::from(age > 0);
    }
    Ok(stale as f64 / trajs.len().max(1) as f64)
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// Assembles the metrics line from the step's pieces (timing filled in by the caller).
fn step_metrics(
    step: u64,
    cfg: &TrainConfig,
    trajs: &[Trajectory],
    results: &[MiniBatchResult],
    mismatch: Option<&MismatchMetrics>,
    view: &OldView,
) -> StepMetrics {
    let n = trajs.len().max(1) as f64;
    let applied: Vec<&MiniBatchResult> = results.iter().filter(|r| r.outcome.applied()).collect();
    let skipped = results.len() - applied.len();
    let grad_norms = results.iter().filter_map(|r| match r.outcome {
        UpdateOutcome::Applied { grad_norm, .. } => Some(f64::from(grad_norm.norm)),
        UpdateOutcome::Skipped { grad_norm, .. } => grad_norm.map(f64::from),
    });
    let lr = results.iter().rev().find_map(|r| match r.outcome {
        UpdateOutcome::Applied { lr, .. } => Some(lr),
        UpdateOutcome::Skipped { .. } => None,
    });
    StepMetrics {
        step,
        replay_mode: cfg.algo.router_replay.to_string(),
        loss: match cfg.algo.loss {
            crate::loss::PolicyLossKind::Ppo => "ppo".into(),
            crate::loss::PolicyLossKind::Gspo => "gspo".into(),
        },
        reward_mean: trajs.iter().map(|t| f64::from(t.reward)).sum::<f64>() / n,
        accuracy: trajs.iter().filter(|t| t.correct).count() as f64 / n,
        response_len_mean: trajs
            .iter()
            .map(|t| t.response_ids.len() as f64)
            .sum::<f64>()
            / n,
        stop_frac: trajs.iter().filter(|t| t.stopped).count() as f64 / n,
        pg_loss: mean(applied.iter().map(|r| f64::from(r.loss_metrics.pg_loss))),
        clip_frac: mean(applied.iter().map(|r| f64::from(r.loss_metrics.clip_frac))),
        ppo_kl: mean(applied.iter().map(|r| f64::from(r.loss_metrics.ppo_kl))),
        entropy: Some(f64::from(view.entropy)),
        grad_norm: mean(grad_norms),
        lr,
        skipped_update: skipped > 0,
        updates_skipped: skipped as u64,
        updates_applied: applied.len() as u64,
        k3_kl: mismatch.map(|m| m.k3_kl),
        f_tau2: mismatch.map(|m| m.extreme_frac_tau2),
        f_tau5: mismatch.map(|m| m.extreme_frac_tau5),
        mean_abs_delta: mismatch.map(|m| m.mean_abs_log_diff),
        mean_sq_delta: mismatch.map(|m| m.mean_sq_log_diff),
        prob_diff_max: mismatch.map(|m| m.prob_diff_max),
        prob_diff_mean: mismatch.map(|m| m.prob_diff_mean),
        prob_diff_std: mismatch.map(|m| m.prob_diff_std),
        pearson: mismatch.and_then(|m| m.prob_pearson),
        router_frac: view.divergence.map(|d| d.router_frac),
        token_frac: view.divergence.and_then(|d| d.token_frac),
        verified_frac: results
            .iter()
            .filter_map(|r| r.verified_frac)
            .chain(view.verified_frac)
            .reduce(f64::min),
        ..StepMetrics::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grad_clip::GradNorm;
    use crate::loss::PolicyLossMetrics;
    use crate::update::SkipReason;
    use candle_core::Device;

    fn result(outcome: UpdateOutcome, pg_loss: f32) -> MiniBatchResult {
        MiniBatchResult {
            outcome,
            loss_metrics: PolicyLossMetrics {
                pg_loss,
                clip_frac: 0.5,
                clip_frac_low: 0.0,
                clip_frac_high: 0.5,
                ppo_kl: 0.01,
                ppo_kl_k3: 0.01,
                ratio_mean: 1.0,
            },
            logp: Tensor::zeros((1, 1), candle_core::DType::F32, &Device::Cpu).expect("zeros"),
            entropy: 1.0,
            routes: None,
            replay: None,
            verified_frac: None,
        }
    }

    /// A correct two-token response from weight version `version`.
    fn trajectory(version: u64) -> Trajectory {
        Trajectory {
            group: 0,
            prompt_ids: vec![1, 4],
            response_ids: vec![5, 2],
            rollout_logp: vec![-0.1, -0.2],
            routes: None,
            stopped: true,
            weight_version: version,
            completion: "3".into(),
            reward: 1.0,
            correct: true,
        }
    }

    #[test]
    fn a_skipped_mini_batch_is_reported_and_kept_out_of_the_loss_means() {
        let cfg = crate::config::TrainConfig::default();
        let traj = trajectory(0);
        let applied = UpdateOutcome::Applied {
            loss: 0.3,
            grad_norm: GradNorm {
                norm: 2.0,
                scale: 0.5,
            },
            lr: 1e-3,
        };
        let skipped = UpdateOutcome::Skipped {
            reason: SkipReason::NonFiniteLoss,
            loss: f32::NAN,
            grad_norm: None,
        };
        let view = OldView {
            logp: Tensor::zeros((1, 1), candle_core::DType::F32, &Device::Cpu).expect("zeros"),
            recorded: None,
            entropy: 0.7,
            verified_frac: Some(1.0),
            divergence: None,
        };
        let results = [result(applied, 0.3), result(skipped, f32::NAN)];
        let m = step_metrics(3, &cfg, &[traj], &results, None, &view);
        assert!(m.skipped_update);
        assert_eq!((m.updates_applied, m.updates_skipped), (1, 1));
        assert_eq!(
            m.pg_loss,
            Some(f64::from(0.3f32)),
            "the NaN loss does not enter the mean"
        );
        assert_eq!(m.grad_norm, Some(2.0));
        assert_eq!(m.lr, Some(1e-3));
        assert_eq!(m.accuracy, 1.0);
        let line = serde_json::to_value(&m).expect("json");
        assert_eq!(line["skipped_update"], serde_json::json!(true));
        assert!(
            line.get("mismatch.k3_kl").is_some(),
            "schema key present (null)"
        );
        assert!(line.get("eval_accuracy").is_none(), "absent off eval steps");
    }

    #[test]
    fn staleness_counts_trajectories_behind_the_trainer_and_refuses_older_than_allowed() {
        // Step 5 trains on version 4: two of four trajectories are one version behind.
        let batch = [trajectory(4), trajectory(3), trajectory(4), trajectory(3)];
        assert_eq!(stale_frac(&batch, 5, 1).expect("within staleness"), 0.5);
        assert_eq!(stale_frac(&batch[..1], 5, 0).expect("fresh"), 0.0);
        match stale_frac(&[trajectory(4), trajectory(2)], 5, 1) {
            Err(TrainError::StaleRollout {
                version, age, max, ..
            }) => assert_eq!((version, age, max), (2, 2, 1)),
            other => panic!("expected StaleRollout, got {other:?}"),
        }
    }
}
