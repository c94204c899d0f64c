//! `r3 train`: the RL run — rollout with the f16 engine, rewards, old log-probs with the
//! router replay mode (`disabled | R2 | R3`), GRPO, PPO/GSPO updates, weight sync — with a
//! progress bar, metrics in `<run_dir>/metrics.jsonl` and atomic checkpoints.
//!
//! With no arguments it runs the default experiment: `configs/default.toml` (built into
//! the binary) on the shipped model `models/arith-moe` with R3.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use r3_train::config::TrainConfig;
use r3_train::Run;

use super::progress::{step_bar, RunProgress, STEP_TEMPLATE};

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

/// Defaults ← the TOML file (or the built-in default experiment) ← `--set` overrides.
pub fn resolve_config(config: Option<&Path>, set: &[String]) -> anyhow::Result<TrainConfig> {
    Ok(match config {
        Some(path) => TrainConfig::resolve(Some(path), set)?,
        None => TrainConfig::resolve_text(DEFAULT_CONFIG, set)?,
    })
}

/// A relative `model_dir` resolved against the working directory (so the run's saved
/// config works from anywhere), with a clear error when it does not exist: the built-in
/// config names `models/arith-moe`, found only from the repository root.
pub(super) fn model_dir_from_cwd(model_dir: &Path) -> anyhow::Result<PathBuf> {
    let cwd = std::env::current_dir().context("reading the working directory")?;
    let dir = cwd.join(model_dir);
    if !dir.is_dir() {
        anyhow::bail!(
            "model_dir `{}` not found (looked in {}): run from the repository root or pass \
             --set model_dir=PATH",
            model_dir.display(),
            dir.display()
        );
    }
    Ok(dir)
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

/// Runs `r3 train`.
pub fn run(a: TrainArgs) -> anyhow::Result<()> {
    let mut run = match &a.resume {
        Some(dir) => Run::resume(dir).with_context(|| format!("resuming {}", dir.display()))?,
        None => {
            let mut cfg = resolve_config(a.config.as_deref(), &a.set)?;
            cfg.model_dir = model_dir_from_cwd(&cfg.model_dir)?;
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
        replay = %cfg.algo.router_replay,
        loss = ?cfg.algo.loss,
        steps = cfg.steps,
        seed = cfg.seed,
        "training"
    );
    let total = run.trainer.total_steps();
    let mut progress = RunProgress::new(step_bar(total, a.no_progress, STEP_TEMPLATE)?);
    let summary = run.execute(&mut progress)?;
    progress.bar.finish();
    let first = summary.eval_first.map(|e| e.1);
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
