//! `r3 train`: the RL run — rollout with the f16 engine, rewards, old log-probs with the
//! router replay mode (`disabled | R2 | R3`), GRPO, PPO/GSPO updates, weight sync — with a
//! progress bar, metrics in `<run_dir>/metrics.jsonl` and atomic checkpoints.
//!
//! With no arguments it runs the default experiment: `configs/default.toml` (built into
//! the binary) on the shipped model `models/arith-moe` with R3.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use r3_train::config::TrainConfig;
use r3_train::overrides::{apply_overrides, merge_known};
use r3_train::rollout::EvalResult;
use r3_train::{Observer, Run, StepMetrics};

/// The default experiment, as shipped in `configs/default.toml`.
pub const DEFAULT_CONFIG: &str = include_str!("../../../../configs/default.toml");

/// Arguments of `r3 train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// TOML config; without it the built-in `configs/default.toml` is used.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override one config key, e.g. `--set algo.router_replay=R2` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Continue the killed run in RUN_DIR from its newest checkpoint (uses its config.toml).
    #[arg(long, value_name = "RUN_DIR", conflicts_with_all = ["config", "set"])]
    pub resume: Option<PathBuf>,
    /// No progress bar (logs only).
    #[arg(long)]
    pub no_progress: bool,
}

/// Defaults ← `text` ← overrides, validated.
fn resolve_text(text: &str, overrides: &[String]) -> anyhow::Result<TrainConfig> {
    let mut value = toml::Value::try_from(TrainConfig::default())?;
    let incoming: toml::Value = toml::from_str(text).context("built-in default config")?;
    merge_known(&mut value, incoming, "")?;
    apply_overrides(&mut value, overrides)?;
    let cfg: TrainConfig = value
        .try_into()
        .map_err(|e: toml::de::Error| anyhow::anyhow!("config: {}", e.message()))?;
    cfg.validate()?;
    Ok(cfg)
}

/// `dir`, or `dir-2`, `dir-3`, … — the first that does not hold a run yet.
fn free_run_dir(dir: &Path) -> PathBuf {
    let taken = |d: &Path| d.join("metrics.jsonl").exists() || d.join("config.toml").exists();
    if !taken(dir) {
        return dir.to_path_buf();
    }
    let base = dir.as_os_str().to_string_lossy().into_owned();
    (2u32..)
        .map(|i| PathBuf::from(format!("{base}-{i}")))
        .find(|d| !taken(d))
        .unwrap_or_else(|| dir.to_path_buf())
}

/// Progress bar fed by the run's events.
struct Progress {
    bar: ProgressBar,
    last_eval: Option<f64>,
}

impl Observer for Progress {
    fn started(&mut self, first: u64, last: u64) {
        self.bar.set_length(last);
        self.bar.set_position(first.saturating_sub(1));
    }

    fn evaluated(&mut self, step: u64, r: &EvalResult) {
        self.last_eval = Some(r.accuracy);
        // Logged rather than `bar.println`, which prints nothing when the bar is hidden.
        self.bar
            .suspend(|| tracing::info!(step, accuracy = r.accuracy, held_out = r.n, "eval"));
    }

    fn step_done(&mut self, m: &StepMetrics) {
        self.bar.set_position(m.step);
        let k3 = m.k3_kl.map_or("-".to_string(), |v| format!("{v:.2e}"));
        let eval = self
            .last_eval
            .map_or("-".to_string(), |v| format!("{v:.3}"));
        self.bar.set_message(format!(
            "reward {:.3} k3 {k3} eval {eval}{}",
            m.reward_mean,
            if m.skipped_update { " SKIPPED" } else { "" }
        ));
    }

    fn checkpointed(&mut self, step: u64, dir: &Path) {
        self.bar
            .suspend(|| tracing::info!(step, dir = %dir.display(), "checkpoint written"));
    }
}

/// Runs `r3 train`.
pub fn run(a: TrainArgs) -> anyhow::Result<()> {
    let mut run = match &a.resume {
        Some(dir) => Run::resume(dir).with_context(|| format!("resuming {}", dir.display()))?,
        None => {
            let mut cfg = match &a.config {
                Some(path) => TrainConfig::resolve(Some(path), &a.set)?,
                None => resolve_text(DEFAULT_CONFIG, &a.set)?,
            };
            let dir = free_run_dir(&cfg.run_dir);
            if dir != cfg.run_dir {
                tracing::info!(run_dir = %dir.display(), "run_dir already holds a run: using a new one");
                cfg.run_dir = dir;
            }
            Run::fresh(cfg)?
        }
    };
    let cfg = &run.trainer.cfg;
    tracing::info!(
        run_dir = %run.run_dir.display(),
        model = %cfg.model_dir.display(),
        replay = ?cfg.algo.router_replay,
        loss = ?cfg.algo.loss,
        steps = cfg.steps,
        seed = cfg.seed,
        "training"
    );
    let bar = if a.no_progress {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(cfg.steps)
    };
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] step {pos}/{len} {msg}")?
            .progress_chars("=> "),
    );
    let mut progress = Progress {
        bar,
        last_eval: None,
    };
    let summary = run.execute(&mut progress)?;
    progress.bar.finish();
    let first = summary.evals.first().map(|e| e.1);
    let last = summary.evals.last().map(|e| e.1);
    println!(
        "{}",
        serde_json::json!({
            "run_dir": summary.run_dir,
            "steps_run": summary.steps_run,
            "last_step": summary.last_step,
            "eval_first": first,
            "eval_last": last,
            "evals": summary.evals,
            "wall_s": summary.wall_s,
        })
    );
    Ok(())
}
