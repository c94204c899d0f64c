//! The metrics line of a finished RL step: rollout statistics, the loss means over the
//! applied updates, the training–inference mismatch, route divergence and replay
//! verification, staleness of a fleet's rollouts, and the step's timings.

use r3_routing::MismatchMetrics;

use crate::algo::loss::PolicyLossKind;
use crate::algo::rollout_is::IsMetrics;
use crate::algo::update::{SkipReason, UpdateOutcome, UpdateTimes};
use crate::config::train::TrainConfig;
use crate::error::{Result, TrainError};
use crate::rl::metrics_log::StepMetrics;
use crate::rl::minibatch::MiniBatchResult;
use crate::rl::sampling::Trajectory;
use crate::rl::step::StepBatch;
use crate::rl::updates::{OldView, Updates};

/// The metrics line of a finished step, with its timings.
pub(crate) fn finish_metrics(
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
    m.sampling_rounds = data.sampling.map(|r| r.rounds as u64);
    m.sampling_groups_drawn = data.sampling.map(|r| r.groups_drawn as u64);
    m.rollout_s = data.rollout_s;
    m.rollout_ahead_s = data.rollout_ahead_s;
    m.rollout_stale_frac = data.stale_frac;
    m.rollout_failed_groups = data.failed.map(|(groups, _)| groups as u64);
    m.rollout_failed_requests = data.failed.map(|(_, requests)| requests as u64);
    m.old_logp_s = updates.old_logp_s;
    m.update_s = updates.update_s;
    let mut parts = UpdateTimes::default();
    for r in &updates.results {
        parts += r.times;
    }
    m.update_forward_s = parts.forward_s;
    m.update_backward_s = parts.backward_s;
    m.update_optim_s = parts.optim_s;
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

/// The fraction of trajectories of step `step` from weights older than the trainer's
/// (version `step − 1`); an error when one is more than `max_staleness` versions older.
pub(crate) fn stale_frac(trajs: &[Trajectory], step: u64, max_staleness: u64) -> Result<f64> {
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

/// The mean over the applied mini-batches of one IS statistic (`None` without TIS/MIS).
fn is_mean(applied: &[&MiniBatchResult], stat: impl Fn(&IsMetrics) -> f32) -> Option<f64> {
    mean(
        applied
            .iter()
            .filter_map(|r| r.is_metrics.as_ref().map(|m| f64::from(stat(m)))),
    )
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
    // An update with no loss token had nothing to learn (every group dropped): skipped,
    // but not the numerical failure `skipped_update` flags.
    let failed = results
        .iter()
        .filter(|r| match r.outcome {
            UpdateOutcome::Skipped { reason, .. } => reason != SkipReason::NoLossTokens,
            UpdateOutcome::Applied { .. } => false,
        })
        .count();
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
            PolicyLossKind::Ppo => "ppo".into(),
            PolicyLossKind::Gspo => "gspo".into(),
        },
        reward_mean: trajs.iter().map(|t| f64::from(t.reward)).sum::<f64>() / n,
        accuracy: trajs.iter().filter(|t| t.correct).count() as f64 / n,
        response_len_mean: trajs
            .iter()
            .map(|t| t.sample.response_ids.len() as f64)
            .sum::<f64>()
            / n,
        stop_frac: trajs.iter().filter(|t| t.stopped).count() as f64 / n,
        pg_loss: mean(applied.iter().map(|r| f64::from(r.loss_metrics.pg_loss))),
        clip_frac: mean(applied.iter().map(|r| f64::from(r.loss_metrics.clip_frac))),
        clip_frac_dual: cfg.clip_range().dual_clip.and_then(|_| {
            mean(
                applied
                    .iter()
                    .map(|r| f64::from(r.loss_metrics.dual_clip_frac)),
            )
        }),
        ppo_kl: mean(applied.iter().map(|r| f64::from(r.loss_metrics.ppo_kl))),
        entropy: Some(f64::from(view.entropy)),
        grad_norm: mean(grad_norms),
        lr,
        skipped_update: failed > 0,
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
        is_weight_mean: is_mean(&applied, |m| m.weight_mean),
        is_over_threshold_frac: is_mean(&applied, |m| m.over_threshold_frac),
        is_log_ratio_mean: is_mean(&applied, |m| m.log_ratio_mean),
        ..StepMetrics::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::grad_clip::GradNorm;
    use crate::algo::loss::PolicyLossMetrics;
    use crate::rl::sampling::RolloutSample;
    use candle_core::{Device, Tensor};

    fn result(outcome: UpdateOutcome, pg_loss: f32) -> MiniBatchResult {
        result_with(outcome, pg_loss, None)
    }

    fn result_with(
        outcome: UpdateOutcome,
        pg_loss: f32,
        is_metrics: Option<IsMetrics>,
    ) -> MiniBatchResult {
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
                dual_clip_frac: 0.25,
            },
            logp: Tensor::zeros((1, 1), candle_core::DType::F32, &Device::Cpu).expect("zeros"),
            entropy: 1.0,
            is_metrics,
            routes: None,
            replay: None,
            verified_frac: None,
            shared_lens: Vec::new(),
            times: UpdateTimes::default(),
        }
    }

    /// A correct two-token response from weight version `version`.
    fn trajectory(version: u64) -> Trajectory {
        Trajectory {
            group: 0,
            sample: RolloutSample {
                prompt_ids: vec![1, 4],
                response_ids: vec![5, 2],
                rollout_logp: vec![-0.1, -0.2],
                routes: None,
                cached_tokens: 0,
            },
            stopped: true,
            weight_version: version,
            completion: "3".into(),
            reward: 1.0,
            correct: true,
        }
    }

    #[test]
    fn a_skipped_mini_batch_is_reported_and_kept_out_of_the_loss_means() {
        let cfg = TrainConfig::default();
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
            shared_lens: Vec::new(),
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
        // The default run (no TIS/MIS, no dual-clip) writes the line it always did.
        for key in [
            "is.weight_mean",
            "is.over_threshold_frac",
            "is.log_ratio_mean",
            "clip_frac_dual",
        ] {
            assert!(line.get(key).is_none(), "{key} absent by default");
        }
    }

    #[test]
    fn is_statistics_and_the_dual_clip_fraction_are_means_over_applied_updates() {
        let mut cfg = TrainConfig::default();
        cfg.algo.is_mode = crate::algo::rollout_is::IsMode::Tis;
        cfg.algo.clip_ratio_c = 3.0;
        let applied = || UpdateOutcome::Applied {
            loss: 0.3,
            grad_norm: GradNorm {
                norm: 2.0,
                scale: 1.0,
            },
            lr: 1e-3,
        };
        let skipped = UpdateOutcome::Skipped {
            reason: SkipReason::NonFiniteLoss,
            loss: f32::NAN,
            grad_norm: None,
        };
        let is = |weight_mean, over_threshold_frac, log_ratio_mean| {
            Some(IsMetrics {
                weight_mean,
                over_threshold_frac,
                log_ratio_mean,
            })
        };
        let view = OldView {
            logp: Tensor::zeros((1, 1), candle_core::DType::F32, &Device::Cpu).expect("zeros"),
            recorded: None,
            entropy: 0.7,
            verified_frac: None,
            divergence: None,
            shared_lens: Vec::new(),
        };
        let results = [
            result_with(applied(), 0.3, is(1.5, 0.25, 0.5)),
            result_with(applied(), 0.1, is(1.0, 0.75, -0.25)),
            // A failed update's numbers stay out, as its loss does.
            result_with(skipped, f32::NAN, is(f32::NAN, 1.0, f32::NAN)),
        ];
        let m = step_metrics(2, &cfg, &[trajectory(1)], &results, None, &view);
        let line = serde_json::to_value(&m).expect("json");
        // (1.5 + 1) / 2, (0.25 + 0.75) / 2, (0.5 − 0.25) / 2; every value exact in binary.
        assert_eq!(line["is.weight_mean"], serde_json::json!(1.25));
        assert_eq!(line["is.over_threshold_frac"], serde_json::json!(0.5));
        assert_eq!(line["is.log_ratio_mean"], serde_json::json!(0.125));
        assert_eq!(line["clip_frac_dual"], serde_json::json!(0.25));
        let back: StepMetrics = serde_json::from_value(line).expect("read back");
        assert_eq!(back, m);
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
