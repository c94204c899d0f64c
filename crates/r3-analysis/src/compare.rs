//! The `r3 compare` experiment (paper Table 1, Figs. 5–6): one RL run per (setting, replay
//! mode, optional TIS / GSPO variant) and seed, all from the same config, each in its own run
//! directory under `<out>/runs/`, run in-process through r3-train's `Run` API (runs an earlier
//! call left are skipped or resumed); then one report over all of them with the
//! Table-1-style results table.

use std::path::{Path, PathBuf};
use std::time::Instant;

use r3_train::config::TrainConfig;
use r3_train::{IsMode, PolicyLossKind, RouterReplay, Run};
use serde::Serialize;

use crate::plot::Canvas;
use crate::report::{build_report, CrashRule, ReportOptions, ReportOutput, DEFAULT_SMOOTHING};
use crate::AnalysisError;

/// Single mini-step (whole batch, one update, old log-probs not recomputed) or multi
/// mini-step (old log-probs once, then several updates).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Setting {
    /// `algo.mini_batches = 1`.
    Single,
    /// `algo.mini_batches = n` (n > 1).
    Multi(usize),
}

impl Setting {
    /// Short name used in run names.
    pub fn name(self) -> &'static str {
        match self {
            Setting::Single => "single",
            Setting::Multi(_) => "multi",
        }
    }

    fn mini_batches(self) -> usize {
        match self {
            Setting::Single => 1,
            Setting::Multi(n) => n,
        }
    }
}

/// One run of the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Variant {
    /// Mini-step setting.
    pub setting: Setting,
    /// Router replay mode.
    pub replay: RouterReplay,
    /// Truncated importance sampling on the rollout log-probs.
    pub tis: bool,
    /// GSPO instead of PPO clip-higher.
    pub gspo: bool,
}

impl Variant {
    /// Run directory name, e.g. `single-R3-tis`.
    pub fn name(&self) -> String {
        let mut n = format!("{}-{}", self.setting.name(), self.replay);
        if self.tis {
            n.push_str("-tis");
        }
        if self.gspo {
            n.push_str("-gspo");
        }
        n
    }

    /// `base` with this variant's replay mode, loss, IS mode and mini-batches.
    pub fn apply(&self, base: &TrainConfig, run_dir: PathBuf) -> TrainConfig {
        let mut cfg = base.clone();
        cfg.run_dir = run_dir;
        cfg.algo.router_replay = self.replay;
        cfg.algo.mini_batches = self.setting.mini_batches();
        if self.tis {
            cfg.algo.is_mode = IsMode::Tis;
        }
        if self.gspo {
            cfg.algo.loss = PolicyLossKind::Gspo;
        }
        cfg
    }
}

/// Every variant: each setting × each mode, plus a TIS and/or a GSPO copy of each.
pub fn plan(
    settings: &[Setting],
    modes: &[RouterReplay],
    with_tis: bool,
    with_gspo: bool,
) -> Vec<Variant> {
    let mut out = Vec::new();
    for &setting in settings {
        for &replay in modes {
            let base = Variant {
                setting,
                replay,
                tis: false,
                gspo: false,
            };
            out.push(base);
            if with_tis {
                out.push(Variant { tis: true, ..base });
            }
            if with_gspo {
                out.push(Variant { gspo: true, ..base });
            }
        }
    }
    out
}

/// How one run went.
#[derive(Debug, Clone, Serialize)]
pub struct RunOutcome {
    /// Run directory name.
    pub name: String,
    /// What was run.
    pub variant: Variant,
    /// Its seed.
    pub seed: u64,
    /// The run directory.
    pub run_dir: PathBuf,
    /// Steps completed.
    pub steps_run: u64,
    /// Wall-clock seconds.
    pub wall_s: f64,
    /// The error that stopped the run early, if any (its metrics so far are still reported).
    pub error: Option<String>,
}

/// Everything `compare.json` records.
#[derive(Debug, Clone, Serialize)]
pub struct CompareSummary {
    /// The command line.
    pub command: String,
    /// The seeds; every variant runs once per seed.
    pub seeds: Vec<u64>,
    /// RL steps per run.
    pub steps: u64,
    /// One entry per run, in the order run.
    pub runs: Vec<RunOutcome>,
    /// The results table (Markdown) written by the report.
    pub table_md: PathBuf,
    /// The report page.
    pub report_html: PathBuf,
    /// Total wall-clock seconds.
    pub wall_s: f64,
}

/// Run directory name of `v` under `seed`: the variant's name, with `-s<seed>` when several
/// seeds run.
pub fn run_name(v: &Variant, seed: u64, several_seeds: bool) -> String {
    if several_seeds {
        format!("{}-s{seed}", v.name())
    } else {
        v.name()
    }
}

/// Runs every variant under every seed from `base` into `<out>/runs/<name>` in order, calling
/// `on_run` with the run's name before each; a run that fails is recorded and the rest still
/// run. A run directory already there from an earlier call with the same config is taken up
/// again: skipped when its metrics cover every step, else resumed from its newest checkpoint
/// (so a long comparison survives a stop); one with another config is an error naming it.
pub fn run_variants(
    base: &TrainConfig,
    variants: &[Variant],
    seeds: &[u64],
    out: &Path,
    on_run: &mut dyn FnMut(usize, &str) -> Box<dyn r3_train::Observer>,
) -> Result<Vec<RunOutcome>, AnalysisError> {
    let runs_dir = out.join("runs");
    std::fs::create_dir_all(&runs_dir).map_err(AnalysisError::io(&runs_dir))?;
    let mut outcomes = Vec::with_capacity(variants.len() * seeds.len());
    for &seed in seeds {
        for v in variants {
            let name = run_name(v, seed, seeds.len() > 1);
            let run_dir = runs_dir.join(&name);
            let mut cfg = v.apply(base, run_dir.clone());
            cfg.seed = seed;
            let started = Instant::now();
            let mut observer = on_run(outcomes.len(), &name);
            let result = match earlier_run(&cfg, &run_dir)? {
                EarlierRun::None => Run::fresh(cfg)
                    .and_then(|mut r| r.execute(observer.as_mut()))
                    .map(|s| s.steps_run),
                EarlierRun::Complete => {
                    tracing::info!(run = %name, "already complete: skipped");
                    Ok(0)
                }
                EarlierRun::Partial => {
                    tracing::info!(run = %name, "resuming from its newest checkpoint");
                    Run::resume(&run_dir)
                        .and_then(|mut r| r.execute(observer.as_mut()))
                        .map(|s| s.steps_run)
                }
            };
            let (steps_run, error) = match result {
                Ok(n) => (n, None),
                Err(e) => {
                    tracing::error!(run = %name, error = %e, "run stopped with an error");
                    (0, Some(e.to_string()))
                }
            };
            outcomes.push(RunOutcome {
                name,
                variant: *v,
                seed,
                run_dir,
                steps_run,
                wall_s: started.elapsed().as_secs_f64(),
                error,
            });
        }
    }
    Ok(outcomes)
}

/// What an earlier call left in a run directory.
enum EarlierRun {
    /// Nothing: a fresh run.
    None,
    /// Metrics for every step.
    Complete,
    /// Some steps: resume.
    Partial,
}

/// Reads what is in `run_dir` for `cfg`: nothing, a complete run or a partial one; a run
/// there made with another config is an error naming the directory.
fn earlier_run(cfg: &TrainConfig, run_dir: &Path) -> Result<EarlierRun, AnalysisError> {
    let config_file = run_dir.join(r3_train::rl::run::CONFIG_FILE);
    if !config_file.is_file() {
        return Ok(EarlierRun::None);
    }
    let text = std::fs::read_to_string(&config_file).map_err(AnalysisError::io(&config_file))?;
    let mut saved = TrainConfig::from_toml_str(&text)
        .map_err(|e| AnalysisError::Invalid(format!("{}: {e}", config_file.display())))?;
    saved.run_dir = cfg.run_dir.clone();
    if &saved != cfg {
        return Err(AnalysisError::Invalid(format!(
            "{} holds a run with another config; give another --out or remove it",
            run_dir.display()
        )));
    }
    let metrics = run_dir.join(r3_train::rl::run::METRICS_FILE);
    let last_step = std::fs::read_to_string(&metrics)
        .ok()
        .and_then(|t| {
            t.lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter_map(|v| v["step"].as_u64())
                .max()
        })
        .unwrap_or(0);
    Ok(if last_step >= cfg.steps {
        EarlierRun::Complete
    } else {
        EarlierRun::Partial
    })
}

/// The report over every run that logged at least one step.
pub fn report(
    outcomes: &[RunOutcome],
    opts: &ReportOptions,
) -> Result<ReportOutput, AnalysisError> {
    let dirs: Vec<PathBuf> = outcomes
        .iter()
        .filter(|o| o.run_dir.join("metrics.jsonl").is_file())
        .map(|o| o.run_dir.clone())
        .collect();
    if dirs.is_empty() {
        return Err(AnalysisError::Invalid(
            "no run logged a step; nothing to report".into(),
        ));
    }
    build_report(&dirs, opts).map_err(|e| AnalysisError::Invalid(format!("report: {e}")))
}

/// Runs every variant under every seed from `base` (see [`run_variants`]), reports over them into
/// `<out>/report/`, copies the results table to `<out>/results.{md,json}` and writes
/// `<out>/compare.json`; returns what compare.json records.
pub fn run_compare(
    base: &TrainConfig,
    variants: &[Variant],
    seeds: &[u64],
    out: &Path,
    crash_rule: CrashRule,
    command: String,
    on_run: &mut dyn FnMut(usize, &str) -> Box<dyn r3_train::Observer>,
) -> Result<CompareSummary, AnalysisError> {
    let started = Instant::now();
    let outcomes = run_variants(base, variants, seeds, out, on_run)?;
    let opts = ReportOptions {
        out_dir: out.join("report"),
        crash_rule,
        canvas: Canvas::default(),
        smoothing: DEFAULT_SMOOTHING,
    };
    let written = report(&outcomes, &opts)?;
    let table_md = out.join("results.md");
    std::fs::copy(&written.table_md, &table_md).map_err(AnalysisError::io(&table_md))?;
    let table_json = out.join("results.json");
    std::fs::copy(&written.table_json, &table_json).map_err(AnalysisError::io(&table_json))?;
    let summary = CompareSummary {
        command,
        seeds: seeds.to_vec(),
        steps: base.steps,
        runs: outcomes,
        table_md,
        report_html: written.html,
        wall_s: started.elapsed().as_secs_f64(),
    };
    let path = out.join("compare.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)? + "\n")
        .map_err(AnalysisError::io(&path))?;
    Ok(summary)
}
