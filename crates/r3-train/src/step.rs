//! One RL step (DESIGN.md "the spine"): rollout → reward → old log-probs with the replay
//! mode's routing → mismatch and routing divergence at the old weights → GRPO advantages
//! (+ dynamic sampling) → mini-batch updates → weight sync to the rollout engine.
//!
//! Replay modes: R3 replays the rollout routes in the old-log-prob pass and every update;
//! R2 records the old pass's routes and replays them in every update; disabled routes
//! natively. With one mini-batch the old policy *is* the update forward (ratio 1, as in
//! the paper's single mini-step), so no separate old pass runs: the update forward's
//! detached log-probs serve as old log-probs and for the diagnostics.

use std::time::Instant;

use candle_core::{Device, Tensor};
use r3_model::{ReplayProof, Routing};
use r3_routing::{MismatchMetrics, RouteTable};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::advantage::{filter_uniform_groups, grpo_advantages, GrpoOptions};
use crate::config::RouterReplay;
use crate::diagnostics::{
    logp_mismatch, proof_divergence, recorded_divergence, verify_proof, RouteDivergence,
};
use crate::metrics_log::StepMetrics;
use crate::minibatch::{
    update_minibatch, MiniBatch, MiniBatchResult, UpdateRouting, UpdateSettings,
};
use crate::policy::{score, ResponseBatch};
use crate::rl_error::{RlError, RlResult};
use crate::rollout::{
    mix_seed, response_batch, rollout_routes, sample_groups, SamplingSpec, Trajectory,
};
use crate::trainer::Trainer;
use crate::update::UpdateOutcome;

/// The `replay_mode` label of the metrics schema.
pub fn mode_label(mode: RouterReplay) -> &'static str {
    match mode {
        RouterReplay::Disabled => "disabled",
        RouterReplay::R2 => "R2",
        RouterReplay::R3 => "R3",
    }
}

/// Which routes each pass of a step used, for checking the replay modes.
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

/// What the old-policy view of the batch gave.
struct OldView {
    logp: Tensor,
    recorded: Option<Vec<RouteTable>>,
    entropy: f32,
    verified_frac: Option<f64>,
    divergence: Option<RouteDivergence>,
}

impl Trainer {
    /// Runs RL step `self.step + 1` and returns its metrics line (without eval).
    pub fn rl_step(&mut self) -> RlResult<StepMetrics> {
        Ok(self.rl_step_traced()?.0)
    }

    /// [`Trainer::rl_step`], also returning which routes each pass used.
    pub fn rl_step_traced(&mut self) -> RlResult<(StepMetrics, StepTrace)> {
        let step = self.step + 1;
        let cfg = self.cfg.clone();
        let mode = cfg.algo.router_replay;
        let group = cfg.rollout.group_size;

        let t_rollout = Instant::now();
        let problems = self.next_problems(cfg.rollout.prompts_per_step)?;
        let spec = SamplingSpec {
            group_size: group,
            max_new_tokens: cfg.rollout.max_new_tokens,
            temperature: cfg.rollout.temperature as f32,
        };
        let trajs = sample_groups(
            &mut self.engine,
            &self.tokenizer,
            &problems,
            spec,
            &self.reward,
            cfg.seed,
            step,
        )?;
        let rollout_s = t_rollout.elapsed().as_secs_f64();

        let batch = response_batch(&trajs)?;
        let device = Device::Cpu;
        let rollout_lp: Vec<Vec<f32>> = trajs.iter().map(|t| t.rollout_logp.clone()).collect();
        let rollout_logp = batch.align(&rollout_lp, &device)?;
        let tables = match trajs.iter().all(|t| t.routes.is_some()) {
            true => Some(rollout_routes(&trajs)?),
            false if mode == RouterReplay::R3 => {
                return Err(RlError::Invalid(
                    "R3 needs rollout routes, the engine returned none (dense model?)".into(),
                ))
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
        let kept_rows: Vec<usize> = if cfg.algo.dynamic_sampling {
            filter.kept_rows()
        } else {
            (0..trajs.len()).collect()
        };
        let (groups_kept, groups_dropped) = if cfg.algo.dynamic_sampling {
            (filter.kept_groups.len(), filter.dropped_groups)
        } else {
            (trajs.len() / group, 0)
        };

        let settings = UpdateSettings {
            loss: cfg.algo.loss,
            clip: cfg.clip_range(),
            agg: cfg.algo.loss_agg,
            is: cfg.is_config(),
            entropy_coef: cfg.algo.entropy_coef,
            lr: 0.0,
            grad_clip: cfg.optim.grad_clip,
            mode_label: mode_label(mode),
        };
        let schedule = cfg.lr_schedule();
        let t_old = Instant::now();
        let mut results: Vec<MiniBatchResult> = Vec::new();
        let mut trace = StepTrace {
            sequences: batch.sequences().to_vec(),
            rollout_tables: tables.clone(),
            ..StepTrace::default()
        };
        let old = if cfg.algo.mini_batches > 1 {
            let (view, proof) = self.old_pass(&batch, tables.as_deref(), mode)?;
            trace.old_proof = proof;
            trace.old_recorded = view.recorded.clone();
            let old_logp_s = t_old.elapsed().as_secs_f64();
            let t_update = Instant::now();
            let mut rows = kept_rows.clone();
            rows.shuffle(&mut ChaCha8Rng::seed_from_u64(mix_seed(&[
                cfg.seed, step, 0x5155,
            ])));
            let chunk = rows.len().div_ceil(cfg.algo.mini_batches).max(1);
            for part in rows.chunks(chunk) {
                let mb_batch = batch.subset(part)?;
                let width = mb_batch.width();
                let idx = Tensor::from_vec(
                    part.iter().map(|&r| r as u32).collect(),
                    part.len(),
                    &device,
                )?;
                let pick = |t: &Tensor| -> RlResult<Tensor> {
                    Ok(t.index_select(&idx, 0)?.narrow(1, 0, width)?.contiguous()?)
                };
                let replay: Option<Vec<RouteTable>> = match mode {
                    RouterReplay::R3 => tables
                        .as_ref()
                        .map(|t| part.iter().map(|&r| t[r].clone()).collect()),
                    RouterReplay::R2 => view
                        .recorded
                        .as_ref()
                        .map(|t| part.iter().map(|&r| t[r].clone()).collect()),
                    RouterReplay::Disabled => None,
                };
                let routing = match &replay {
                    Some(t) => UpdateRouting::Replay(t),
                    None => UpdateRouting::Native,
                };
                let s = UpdateSettings {
                    lr: schedule.lr_at(self.optimizer.step_count()),
                    ..settings
                };
                let mb = MiniBatch {
                    batch: &mb_batch,
                    old_logp: Some(pick(&view.logp)?),
                    rollout_logp: pick(&rollout_logp)?,
                    advantages: part.iter().map(|&r| advantages[r]).collect(),
                    row_weight: None,
                    routing,
                };
                let r = update_minibatch(&self.policy, &mut self.optimizer, &mb, &s)?;
                trace.updates.push((part.to_vec(), r.replay.clone()));
                results.push(r);
            }
            (view, old_logp_s, t_update.elapsed().as_secs_f64())
        } else {
            let replay = match mode {
                RouterReplay::R3 => tables.as_deref().map(UpdateRouting::Replay),
                _ => None,
            };
            let mut row_weight = vec![0f32; trajs.len()];
            for &r in &kept_rows {
                row_weight[r] = 1.0;
            }
            let s = UpdateSettings {
                lr: schedule.lr_at(self.optimizer.step_count()),
                ..settings
            };
            let mb = MiniBatch {
                batch: &batch,
                old_logp: None,
                rollout_logp: rollout_logp.clone(),
                advantages: advantages.clone(),
                row_weight: Some(row_weight),
                routing: replay.unwrap_or(UpdateRouting::Record),
            };
            let r = update_minibatch(&self.policy, &mut self.optimizer, &mb, &s)?;
            trace
                .updates
                .push(((0..trajs.len()).collect(), r.replay.clone()));
            let update_s = t_old.elapsed().as_secs_f64();
            let divergence = match (&r.replay, &r.routes, &tables) {
                (Some(proof), _, _) => Some(proof_divergence(proof)),
                (None, Some(rec), Some(t)) => Some(recorded_divergence(t, rec)?),
                _ => None,
            };
            let view = OldView {
                logp: r.logp.clone(),
                recorded: None,
                entropy: r.entropy,
                verified_frac: r.verified_frac,
                divergence,
            };
            results.push(r);
            (view, 0.0, update_s)
        };
        let (view, old_logp_s, update_s) = old;
        let train_lp = batch.gather_responses(&view.logp)?;
        let mismatch = logp_mismatch(&train_lp, &rollout_lp)?;

        let sync_s = self.sync_weights()?;
        self.step = step;
        let total_s = rollout_s + old_logp_s + update_s + sync_s;
        let mut m = step_metrics(step, &cfg, &trajs, &results, mismatch.as_ref(), &view);
        m.groups_kept = groups_kept as u64;
        m.groups_dropped = groups_dropped as u64;
        m.rollout_s = rollout_s;
        m.old_logp_s = old_logp_s;
        m.update_s = update_s;
        m.sync_s = sync_s;
        let tokens: usize = batch.sequences().iter().map(Vec::len).sum();
        m.tokens_per_s = if total_s > 0.0 {
            tokens as f64 / total_s
        } else {
            0.0
        };
        Ok((m, trace))
    }

    /// The old-policy pass (no autograd graph) over the whole batch with the mode's
    /// routing: R3 replays the rollout routes, R2 and disabled record native routes.
    fn old_pass(
        &self,
        batch: &ResponseBatch,
        tables: Option<&[RouteTable]>,
        mode: RouterReplay,
    ) -> RlResult<(OldView, Option<ReplayProof>)> {
        let model = self.policy.frozen_model()?;
        let routing = match (mode, tables) {
            (RouterReplay::R3, Some(t)) => Routing::Replay(t),
            (RouterReplay::R3, None) => {
                return Err(RlError::Invalid(
                    "R3 old pass without rollout routes".into(),
                ))
            }
            _ => Routing::Record,
        };
        let scored = score(&model, batch, routing)?;
        let mask = batch.response_mask(None, &Device::Cpu)?;
        let entropy = scored.mean_entropy(&mask)?;
        let (verified_frac, divergence) = match (&scored.replay, &scored.routes, tables) {
            (Some(proof), _, Some(t)) => (
                Some(verify_proof(proof, t, mode_label(mode), "old-logp")?),
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

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// Assembles the metrics line from the step's pieces (timing filled in by the caller).
fn step_metrics(
    step: u64,
    cfg: &crate::config::TrainConfig,
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
        replay_mode: mode_label(cfg.algo.router_replay).to_string(),
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

    #[test]
    fn a_skipped_mini_batch_is_reported_and_kept_out_of_the_loss_means() {
        let cfg = crate::config::TrainConfig::default();
        let traj = Trajectory {
            group: 0,
            prompt_ids: vec![1, 4],
            response_ids: vec![5, 2],
            rollout_logp: vec![-0.1, -0.2],
            routes: None,
            stopped: true,
            completion: "3".into(),
            reward: 1.0,
            correct: true,
        };
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
}
