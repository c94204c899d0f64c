//! The RL run: the run directory (`config.toml`, `metrics.jsonl`, `eval.jsonl`,
//! `checkpoints/`), the initial held-out evaluation, the step loop with periodic
//! evaluation and atomic checkpoints, and resuming a killed run from its newest verified
//! checkpoint. Progress is reported to an [`Observer`] (the CLI draws a progress bar).
//!
//! The base evaluation (step 0) is logged before step 1 whenever the log lacks it, so a
//! run killed before it was written gets it on resume.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::config::train::TrainConfig;
use crate::error::{Result, TrainError};
use crate::rl::checkpoint::verified_checkpoint;
use crate::rl::collapse::CollapseWatch;
use crate::rl::metrics_log::{
    read_eval_lines, truncate_after_step, EvalLine, JsonlWriter, StepMetrics,
};
use crate::rl::sampling::EvalResult;
use crate::rl::trainer::Trainer;

/// File names inside a run directory.
pub const CONFIG_FILE: &str = "config.toml";
/// Per-step metrics.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// Held-out evaluations.
pub const EVAL_FILE: &str = "eval.jsonl";

/// Receives progress events of a run.
pub trait Observer {
    /// The run will execute steps `first..=last`.
    fn started(&mut self, _first: u64, _last: u64) {}
    /// A held-out evaluation finished (step 0 = before training).
    fn evaluated(&mut self, _step: u64, _result: &EvalResult) {}
    /// A step finished; its metrics line is written.
    fn step_done(&mut self, _metrics: &StepMetrics) {}
    /// A checkpoint was written.
    fn checkpointed(&mut self, _step: u64, _dir: &Path) {}
}

/// An observer that ignores everything.
#[derive(Debug, Default)]
pub struct Quiet;

impl Observer for Quiet {}

/// What a finished run reports.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// The run directory.
    pub run_dir: PathBuf,
    /// Steps run by this invocation.
    pub steps_run: u64,
    /// Last completed step.
    pub last_step: u64,
    /// Evaluations of this invocation as (step, accuracy).
    pub evals: Vec<(u64, f64)>,
    /// The run's first evaluation as (step, accuracy) — the base model's (step 0), also
    /// after a resume, read back from `eval.jsonl`.
    pub eval_first: Option<(u64, f64)>,
    /// Wall-clock seconds of this invocation.
    pub wall_s: f64,
}

/// A run ready to execute: the trainer and the directory it logs into.
#[derive(Debug)]
pub struct Run {
    /// Trainer state.
    pub trainer: Trainer,
    /// The run directory.
    pub run_dir: PathBuf,
}

impl Run {
    /// A fresh run in `cfg.run_dir` (created; must not already hold a run).
    pub fn fresh(cfg: TrainConfig) -> Result<Self> {
        let run_dir = cfg.run_dir.clone();
        if run_dir.join(METRICS_FILE).exists() || run_dir.join(CONFIG_FILE).exists() {
            return Err(TrainError::RunExists { path: run_dir });
        }
        std::fs::create_dir_all(&run_dir).map_err(TrainError::io(&run_dir))?;
        cfg.save(&run_dir.join(CONFIG_FILE))?;
        let trainer = Trainer::new(cfg)?;
        Ok(Self { trainer, run_dir })
    }

    /// Continues the run in `run_dir` from its newest complete and verified checkpoint
    /// (or from the base model when it has none), with the config saved in the run
    /// directory; newer checkpoints that fail verification are skipped with a warning that
    /// says why. Log lines after the checkpoint's step are dropped, so the logs read as one
    /// uninterrupted run.
    pub fn resume(run_dir: &Path) -> Result<Self> {
        let cfg_path = run_dir.join(CONFIG_FILE);
        let text = std::fs::read_to_string(&cfg_path).map_err(TrainError::io(&cfg_path))?;
        let mut cfg = TrainConfig::from_toml_str(&text)?;
        cfg.run_dir = run_dir.to_path_buf();
        let trainer = match verified_checkpoint(run_dir)? {
            Some(chosen) => {
                for (dir, why) in &chosen.skipped {
                    tracing::warn!(dir = %dir.display(), reason = %why, "skipping checkpoint");
                }
                tracing::info!(
                    step = chosen.state.step,
                    dir = %chosen.dir.display(),
                    skipped = chosen.skipped.len(),
                    "resuming from the newest verified checkpoint"
                );
                Trainer::from_checkpoint(cfg, &chosen.dir)?
            }
            None => {
                tracing::warn!(run = %run_dir.display(), "no checkpoint yet: restarting from the base model");
                Trainer::new(cfg)?
            }
        };
        truncate_after_step(&run_dir.join(METRICS_FILE), trainer.step)?;
        truncate_after_step(&run_dir.join(EVAL_FILE), trainer.step)?;
        Ok(Self {
            trainer,
            run_dir: run_dir.to_path_buf(),
        })
    }

    /// Runs the remaining steps of the config.
    pub fn execute(&mut self, observer: &mut dyn Observer) -> Result<RunSummary> {
        let started = Instant::now();
        let t = &mut self.trainer;
        let total = t.total_steps();
        let first = t.step + 1;
        let mut metrics = JsonlWriter::append(&self.run_dir.join(METRICS_FILE))?;
        let eval_path = self.run_dir.join(EVAL_FILE);
        let has_base_eval = read_eval_lines(&eval_path)?.iter().any(|l| l.step == 0);
        let mut evals_log = JsonlWriter::append(&eval_path)?;
        let mut evals = Vec::new();
        let mut collapse = CollapseWatch::default();
        observer.started(first, total);
        let eval_every = t.cfg.eval.every;
        if eval_every > 0 && t.step == 0 && !has_base_eval {
            let r = t.evaluate()?;
            evals_log.write(&eval_line(0, &r))?;
            evals.push((0, r.accuracy));
            observer.evaluated(0, &r);
        }
        for step in first..=total {
            let mut m = t.rl_step()?;
            debug_assert_eq!(m.step, step);
            if eval_every > 0 && (step % eval_every == 0 || step == total) {
                let t_eval = Instant::now();
                let r = t.evaluate()?;
                m.eval_s = t_eval.elapsed().as_secs_f64();
                m.eval_accuracy = Some(r.accuracy);
                evals_log.write(&eval_line(step, &r))?;
                evals.push((step, r.accuracy));
                observer.evaluated(step, &r);
            }
            metrics.write(&m)?;
            tracing::debug!(step, reward = m.reward_mean, k3_kl = ?m.k3_kl, "step done");
            observer.step_done(&m);
            collapse.observe(&m);
            let every = t.cfg.checkpoint.every;
            if every > 0 && (step % every == 0 || step == total) {
                let dir = t.save_checkpoint(&self.run_dir)?;
                observer.checkpointed(step, &dir);
            }
        }
        let eval_first = read_eval_lines(&eval_path)?
            .iter()
            .min_by_key(|l| l.step)
            .map(|l| (l.step, l.eval_accuracy));
        Ok(RunSummary {
            run_dir: self.run_dir.clone(),
            steps_run: total.saturating_sub(first - 1),
            last_step: t.step,
            evals,
            eval_first,
            wall_s: started.elapsed().as_secs_f64(),
        })
    }
}

fn eval_line(step: u64, r: &EvalResult) -> EvalLine {
    EvalLine::of(step, r)
}
