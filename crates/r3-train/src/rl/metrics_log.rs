//! The per-step metrics line and the run's JSONL logs: flat keys (dots are part of the
//! name), one object per RL step in `metrics.jsonl`, one per evaluation in `eval.jsonl`. `None` fields are written
//! as `null`, which readers tolerate.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::rl::evaluation::{EvalResult, SourceEval};

/// One RL step's metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// RL step, 1-based.
    pub step: u64,
    /// `disabled`, `R2` or `R3`.
    pub replay_mode: String,
    /// `ppo` or `gspo`.
    pub loss: String,
    /// Mean verifier reward of the rollouts.
    pub reward_mean: f64,
    /// Fraction of rollouts answered exactly.
    pub accuracy: f64,
    /// Mean response length in tokens.
    pub response_len_mean: f64,
    /// Fraction of rollouts that ended with `<eos>`.
    pub stop_frac: f64,
    /// Policy-gradient loss (mean over applied mini-batches).
    pub pg_loss: Option<f64>,
    /// Fraction of response tokens whose ratio was clipped.
    pub clip_frac: Option<f64>,
    /// Fraction of response tokens whose loss the PPO dual-clip capped (verl's
    /// `pg_clipfrac_lower`; mean over applied mini-batches). Absent without
    /// `algo.clip_ratio_c`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub clip_frac_dual: Option<f64>,
    /// k1 estimate of KL(old ‖ new) over the update mini-batches.
    pub ppo_kl: Option<f64>,
    /// Mean next-token entropy over response tokens at the old weights.
    pub entropy: Option<f64>,
    /// Global gradient norm before clipping (mean over mini-batches).
    pub grad_norm: Option<f64>,
    /// Learning rate of the last optimiser step.
    pub lr: Option<f64>,
    /// Whether any mini-batch update was skipped for a NaN/inf loss or gradient norm (or an
    /// update the guard refused); not for an update with no loss token to learn from.
    pub skipped_update: bool,
    /// Mini-batch updates skipped this step, those with no loss token included.
    #[serde(rename = "update.skipped")]
    pub updates_skipped: u64,
    /// Mini-batch updates applied this step.
    #[serde(rename = "update.applied")]
    pub updates_applied: u64,
    /// k3 estimate of KL(π_rollout ‖ π_train) at the old weights: tokens are sampled from
    /// the rollout, `mean(r − 1 − ln r)` with `r = π_train / π_rollout` (the R3 paper's eq. 2,
    /// which it writes D_KL(π_train ‖ π_infer)). Both sides at the rollout temperature (the
    /// rollout's T-scaled log-probs against training scored at `rollout.temperature`), so at
    /// T ≠ 1 it is not `r3 analyze`'s k3 KL, which compares the raw T = 1 distributions.
    #[serde(rename = "mismatch.k3_kl")]
    pub k3_kl: Option<f64>,
    /// F(τ=2).
    #[serde(rename = "mismatch.f_tau2")]
    pub f_tau2: Option<f64>,
    /// F(τ=5).
    #[serde(rename = "mismatch.f_tau5")]
    pub f_tau5: Option<f64>,
    /// Mean |Δ logp|.
    #[serde(rename = "mismatch.mean_abs_delta")]
    pub mean_abs_delta: Option<f64>,
    /// Mean Δ logp².
    #[serde(rename = "mismatch.mean_sq_delta")]
    pub mean_sq_delta: Option<f64>,
    /// max |p_train − p_rollout|.
    #[serde(rename = "mismatch.prob_diff_max")]
    pub prob_diff_max: Option<f64>,
    /// mean |p_train − p_rollout|.
    #[serde(rename = "mismatch.prob_diff_mean")]
    pub prob_diff_mean: Option<f64>,
    /// std |p_train − p_rollout|.
    #[serde(rename = "mismatch.prob_diff_std")]
    pub prob_diff_std: Option<f64>,
    /// Pearson correlation of the probabilities.
    #[serde(rename = "mismatch.pearson")]
    pub pearson: Option<f64>,
    /// Response tokens left out of the mismatch statistics because a log-prob was NaN or
    /// infinite (a training forward that overflowed; its update is skipped).
    #[serde(rename = "mismatch.non_finite_tokens", default)]
    pub mismatch_non_finite_tokens: u64,
    /// Fraction of (token, MoE layer) routers where rollout and training routes differ.
    #[serde(rename = "divergence.router_frac")]
    pub router_frac: Option<f64>,
    /// Fraction of tokens with a differing route in at least one MoE layer.
    #[serde(rename = "divergence.token_frac")]
    pub token_frac: Option<f64>,
    /// Fraction of replayed cells verified (1.0, or the step fails); null without replay.
    #[serde(rename = "replay.verified_frac")]
    pub verified_frac: Option<f64>,
    /// Mean TIS/MIS weight over the response tokens (mean over applied mini-batches).
    /// Absent with `algo.is_mode = none`, as the other `is.*` keys.
    #[serde(
        rename = "is.weight_mean",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub is_weight_mean: Option<f64>,
    /// Fraction of response tokens whose IS ratio passed `algo.is_threshold` (truncated by
    /// TIS, dropped by MIS).
    #[serde(
        rename = "is.over_threshold_frac",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub is_over_threshold_frac: Option<f64>,
    /// Mean untruncated IS log-ratio `old − rollout` (at `algo.is_level`).
    #[serde(
        rename = "is.log_ratio_mean",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub is_log_ratio_mean: Option<f64>,
    /// Rollout requests sent again after a worker fault (fleet backend; null otherwise).
    #[serde(rename = "rollout.retries", default)]
    pub rollout_retries: Option<u64>,
    /// Fraction of rollouts from older weights (fleet backend, `rollout.max_staleness`).
    #[serde(rename = "rollout.stale_frac", default)]
    pub rollout_stale_frac: Option<f64>,
    /// Rollout workers up after the step's rollout (fleet backend).
    #[serde(rename = "rollout.workers_up", default)]
    pub rollout_workers_up: Option<u64>,
    /// Continuations sent for rollout requests a worker aborted (fleet backend).
    #[serde(rename = "rollout.partial_resumed", default)]
    pub rollout_partial_resumed: Option<u64>,
    /// Groups dropped because a request of theirs failed for its own fault (the fleet's
    /// 400 / 413 / 422, or the same answer from two workers), over every rollout round
    /// (fleet backend; null otherwise).
    #[serde(rename = "rollout.failed_groups", default)]
    pub rollout_failed_groups: Option<u64>,
    /// The requests that failed so (fleet backend; null otherwise).
    #[serde(rename = "rollout.failed_requests", default)]
    pub rollout_failed_requests: Option<u64>,
    /// Groups kept by dynamic sampling.
    pub groups_kept: u64,
    /// Groups dropped by dynamic sampling (all rewards equal), over every rollout round.
    pub groups_dropped: u64,
    /// Rollout rounds the step drew to fill its groups (`algo.sampling_rounds` > 1).
    #[serde(rename = "sampling.rounds", default)]
    pub sampling_rounds: Option<u64>,
    /// Groups sampled over those rounds (those past `prompts_per_step` kept groups unused).
    #[serde(rename = "sampling.groups_drawn", default)]
    pub sampling_groups_drawn: Option<u64>,
    /// Seconds generating rollouts.
    #[serde(rename = "time.rollout_s")]
    pub rollout_s: f64,
    /// Seconds the fleet spent generating this step's batch while the previous step
    /// updated (`rollout.async`; absent otherwise).
    #[serde(
        rename = "time.rollout_ahead_s",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub rollout_ahead_s: Option<f64>,
    /// Seconds computing old log-probs (and diagnostics).
    #[serde(rename = "time.old_logp_s")]
    pub old_logp_s: f64,
    /// Seconds in forward/backward/optimiser updates.
    #[serde(rename = "time.update_s")]
    pub update_s: f64,
    /// Seconds of the update forwards and their losses (part of `time.update_s`).
    #[serde(rename = "time.update_forward_s", default)]
    pub update_forward_s: f64,
    /// Seconds of the update backwards (part of `time.update_s`).
    #[serde(rename = "time.update_backward_s", default)]
    pub update_backward_s: f64,
    /// Seconds of the guarded optimiser steps: gradient clipping, the checks and AdamW
    /// (part of `time.update_s`).
    #[serde(rename = "time.update_optim_s", default)]
    pub update_optim_s: f64,
    /// Seconds syncing weights to the rollout engine.
    #[serde(rename = "time.sync_s")]
    pub sync_s: f64,
    /// Seconds of held-out evaluation after this step (0 when none).
    #[serde(rename = "time.eval_s")]
    pub eval_s: f64,
    /// Rollout + training tokens processed per second of step time.
    #[serde(rename = "throughput.tokens_per_s")]
    pub tokens_per_s: f64,
    /// The process's resident-memory high-water mark over the step, MiB (absent where the
    /// kernel does not report it or refuses the reset of the mark).
    #[serde(
        rename = "memory.peak_mib",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub peak_mib: Option<f64>,
    /// The high-water mark over the rollout (generation, rewards, the batch), MiB.
    #[serde(
        rename = "memory.rollout_peak_mib",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub rollout_peak_mib: Option<f64>,
    /// The high-water mark over the separate old-log-prob pass, MiB (absent without one).
    #[serde(
        rename = "memory.old_logp_peak_mib",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub old_logp_peak_mib: Option<f64>,
    /// The high-water mark over the updates (forward, backward, optimiser), MiB.
    #[serde(
        rename = "memory.update_peak_mib",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub update_peak_mib: Option<f64>,
    /// The high-water mark over the weight sync, MiB.
    #[serde(
        rename = "memory.sync_peak_mib",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub sync_peak_mib: Option<f64>,
    /// On a GPU, the most memory its tensors held at once over the step (its memory pool's
    /// high-water mark: both engines' when the rollout engine shares the device), MiB;
    /// absent on the CPU.
    #[serde(
        rename = "memory.device_peak_mib",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub device_peak_mib: Option<f64>,
    /// Held-out accuracy after this step's update (eval steps only).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eval_accuracy: Option<f64>,
    /// Dataset runs: the epoch the next prompt comes from.
    #[serde(
        rename = "data.epoch",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub data_epoch: Option<u64>,
    /// Dataset runs: training prompts dropped at load for exceeding `data.max_prompt_length`.
    #[serde(
        rename = "data.filtered_prompts",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub data_filtered_prompts: Option<u64>,
}

impl StepMetrics {
    /// The line as a JSON value, with the measurement keys (timings, throughput, memory)
    /// removed (for comparing runs).
    pub fn without_timing(&self) -> Result<serde_json::Value> {
        let mut v = serde_json::to_value(self).map_err(TrainError::json("serialising metrics"))?;
        if let Some(map) = v.as_object_mut() {
            map.retain(|k, _| !is_measurement(k));
        }
        Ok(v)
    }
}

/// Whether a metrics key is a measurement of the machine (`time.*`, `throughput.*`,
/// `memory.*`): it varies from run to run, so comparisons of runs leave it out.
pub fn is_measurement(key: &str) -> bool {
    ["time.", "throughput.", "memory."]
        .iter()
        .any(|prefix| key.starts_with(prefix))
}

/// Appends JSON lines to a file, flushing after each one.
#[derive(Debug)]
pub struct JsonlWriter {
    path: PathBuf,
    file: File,
}

impl JsonlWriter {
    /// Opens `path` for appending (created if missing).
    pub fn append(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(TrainError::io(path))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Writes one value as a line.
    pub fn write<T: Serialize>(&mut self, value: &T) -> Result<()> {
        let line =
            serde_json::to_string(value).map_err(TrainError::json("serialising a metrics line"))?;
        writeln!(self.file, "{line}").map_err(TrainError::io(&self.path))?;
        self.file.flush().map_err(TrainError::io(&self.path))
    }
}

/// One held-out evaluation line of `eval.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalLine {
    /// RL step after which the evaluation ran (0 = the base model).
    pub step: u64,
    /// Exact-match accuracy.
    pub eval_accuracy: f64,
    /// Problems evaluated.
    pub n: usize,
    /// Mean response length.
    pub response_len_mean: f64,
    /// Standard error of `eval_accuracy` over prompts (absent in logs before it existed).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eval_accuracy_stderr: Option<f64>,
    /// Samples per prompt (`k`; absent: 1).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub samples_per_prompt: Option<usize>,
    /// Sampling temperature (0 = greedy; absent in lines written before it was recorded:
    /// unknown).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub temperature: Option<f64>,
    /// `mean@k`, `pass@k`, `maj@k` with their errors, per data source.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub sources: Vec<SourceEval>,
    /// Each prompt's fraction correct, in eval-set order (what paired comparisons pair).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub prompt_scores: Vec<f64>,
    /// sha256 of the eval prompts and answers: evaluations pair only when equal.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub prompts_digest: Option<String>,
}

impl EvalLine {
    /// The line of an evaluation after RL step `step`.
    pub fn of(step: u64, r: &EvalResult) -> Self {
        Self {
            step,
            eval_accuracy: r.accuracy,
            n: r.n,
            response_len_mean: r.response_len_mean,
            eval_accuracy_stderr: Some(r.accuracy_stderr),
            samples_per_prompt: Some(r.samples_per_prompt),
            temperature: Some(r.temperature),
            sources: r.sources.clone(),
            prompt_scores: r.prompt_scores.clone(),
            prompts_digest: Some(r.prompts_digest.clone()),
        }
    }
}

/// Keeps only the lines of a JSONL file whose `step` is at most `last_step` (a resumed run
/// drops what the killed run logged after its last checkpoint). Rewrites atomically.
pub fn truncate_after_step(path: &Path, last_step: u64) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let file = File::open(path).map_err(TrainError::io(path))?;
    let mut kept = String::new();
    for line in BufReader::new(file).lines() {
        let line = line.map_err(TrainError::io(path))?;
        if line.trim().is_empty() {
            continue;
        }
        // A line cut short by the kill does not parse: it goes too.
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if v.get("step")
            .and_then(|s| s.as_u64())
            .is_some_and(|s| s <= last_step)
        {
            kept.push_str(&line);
            kept.push('\n');
        }
    }
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, kept).map_err(TrainError::io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(TrainError::io(path))
}

/// The evaluation lines of an `eval.jsonl` that parse (a line torn by a kill is skipped);
/// none when the file does not exist.
pub fn read_eval_lines(path: &Path) -> Result<Vec<EvalLine>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(path).map_err(TrainError::io(path))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<EvalLine>(l).ok())
        .collect())
}
