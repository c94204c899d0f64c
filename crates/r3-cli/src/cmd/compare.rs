//! `r3 compare`: no replay vs R2 vs R3 (optionally with TIS and GSPO variants) from one
//! config and one or several seeds, in the single- and multi-mini-step settings, each run in its own run
//! directory via r3-train's library API; then the report (PNGs, HTML) and the Table-1-style
//! results table with the crash rule stated.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use indicatif::ProgressBar;
use r3_train::config::TrainConfig;
use r3_train::Observer;
use r3_train::RouterReplay;

use super::progress::{step_bar, RunProgress};
use super::train::resolve_config;
use r3_analysis::compare::{plan, run_compare, Setting};
use r3_analysis::report::{CrashRule, DEFAULT_KL_THRESHOLD};

/// Options of `r3 compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Base TOML config of every run (default: the built-in configs/default.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override a config key of every run, e.g. `--set rollout.prompts_per_step=8`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// RL steps per run.
    #[arg(long, default_value_t = 12)]
    pub steps: u64,
    /// Evaluate every N steps (and after the last).
    #[arg(long, default_value_t = 4)]
    pub eval_every: u64,
    /// Output directory: `runs/<name>/` per run, the report, results.{md,json}, compare.json.
    #[arg(long, default_value = "compare")]
    pub out: PathBuf,
    /// Replay modes, comma separated: disabled, R2, R3.
    #[arg(long, value_delimiter = ',', default_value = "disabled,R2,R3")]
    pub modes: Vec<String>,
    /// Also run each mode with truncated importance sampling (TIS, threshold from the config).
    #[arg(long)]
    pub with_tis: bool,
    /// Also run each mode with GSPO instead of PPO clip-higher.
    #[arg(long)]
    pub with_gspo: bool,
    /// Settings, comma separated: single (one update per step), multi (several mini-steps).
    #[arg(long, value_delimiter = ',', default_value = "single,multi")]
    pub settings: Vec<String>,
    /// Mini-steps per RL step in the multi setting.
    #[arg(long, default_value_t = 4)]
    pub multi_mini_batches: usize,
    /// Seed of every run (default: the config's).
    #[arg(long, conflicts_with = "seeds")]
    pub seed: Option<u64>,
    /// Several seeds, comma separated: every variant runs once per seed, in
    /// `runs/<variant>-s<seed>` (the paper's Table 1 over seeds).
    #[arg(long, value_delimiter = ',')]
    pub seeds: Vec<u64>,
    /// A step whose mismatch.k3_kl exceeds this counts as a crash.
    #[arg(long, default_value_t = DEFAULT_KL_THRESHOLD)]
    pub kl_threshold: f64,
    /// No progress bars (logs only).
    #[arg(long)]
    pub no_progress: bool,
}

/// The base config: defaults ← file (or the built-in default) ← `--set`, validated.
fn base_config(a: &CompareArgs) -> anyhow::Result<TrainConfig> {
    let mut cfg = resolve_config(a.config.as_deref(), &a.set)?;
    cfg.steps = a.steps;
    cfg.eval.every = a.eval_every;
    if let Some(seed) = a.seed {
        cfg.seed = seed;
    }
    cfg.validate()?;
    Ok(cfg)
}

fn parse_settings(names: &[String], multi: usize) -> anyhow::Result<Vec<Setting>> {
    names
        .iter()
        .map(|s| match s.trim().to_ascii_lowercase().as_str() {
            "single" => Ok(Setting::Single),
            "multi" if multi >= 2 => Ok(Setting::Multi(multi)),
            "multi" => anyhow::bail!("--multi-mini-batches must be at least 2, got {multi}"),
            other => anyhow::bail!("unknown setting {other:?}: use single or multi"),
        })
        .collect()
}

/// Refuses a list flag whose values name one thing twice (`R3,R3`, `r3,R3`, `single,single`):
/// both would write the same run directory, which the results would then list twice.
/// `names` are the values as given, `parsed` what each names.
fn refuse_duplicates<T: PartialEq>(
    flag: &str,
    names: &[String],
    parsed: &[T],
) -> anyhow::Result<()> {
    for (j, later) in parsed.iter().enumerate() {
        if let Some(i) = parsed[..j].iter().position(|earlier| earlier == later) {
            anyhow::bail!(
                "{flag} names the same value twice ({:?} and {:?}): each runs once",
                names[i],
                names[j]
            );
        }
    }
    Ok(())
}

/// Runs `r3 compare`; prints the results table on stdout.
pub fn run(a: CompareArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.kl_threshold.is_finite() && a.kl_threshold > 0.0,
        "--kl-threshold must be a positive number, got {}",
        a.kl_threshold
    );
    anyhow::ensure!(a.steps >= 1, "--steps must be at least 1");
    let base = base_config(&a)?;
    let modes = a
        .modes
        .iter()
        .map(|m| m.parse::<RouterReplay>())
        .collect::<Result<Vec<_>, _>>()?;
    refuse_duplicates("--modes", &a.modes, &modes)?;
    let settings = parse_settings(&a.settings, a.multi_mini_batches)?;
    refuse_duplicates("--settings", &a.settings, &settings)?;
    let seed_names: Vec<String> = a.seeds.iter().map(u64::to_string).collect();
    refuse_duplicates("--seeds", &seed_names, &a.seeds)?;
    let variants = plan(&settings, &modes, a.with_tis, a.with_gspo);
    anyhow::ensure!(
        !variants.is_empty(),
        "no runs: give at least one mode and one setting"
    );
    tracing::info!(
        runs = variants.len(),
        steps = base.steps,
        seeds = ?a.seeds,
        model = %base.model_dir.display(),
        "compare"
    );
    let seeds = if a.seeds.is_empty() {
        vec![base.seed]
    } else {
        a.seeds.clone()
    };
    let total = variants.len() * seeds.len();
    let no_progress = a.no_progress;
    let mut on_run = |i: usize, name: &str| -> Box<dyn Observer> {
        tracing::info!(run = %name, "run {} of {total}", i + 1);
        let bar = step_bar(
            0,
            no_progress,
            "{prefix:18} {elapsed_precise} [{bar:25}] {pos}/{len} {msg}",
        )
        .unwrap_or_else(|_| ProgressBar::hidden());
        bar.set_prefix(name.to_string());
        Box::new(RunProgress::new(bar))
    };
    let crash_rule = CrashRule {
        kl_threshold: a.kl_threshold,
    };
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let summary = run_compare(
        &base,
        &variants,
        &seeds,
        &a.out,
        crash_rule,
        command,
        &mut on_run,
    )?;
    let failed = summary.runs.iter().filter(|r| r.error.is_some()).count();
    tracing::info!(
        wall_s = summary.wall_s,
        failed,
        report = %summary.report_html.display(),
        "compare done"
    );
    let table = std::fs::read_to_string(&summary.table_md)
        .with_context(|| format!("reading {}", summary.table_md.display()))?;
    print!("{table}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mode, setting or seed given twice (in any spelling) is refused naming the flag and
    /// both values, before any run; distinct values pass.
    #[test]
    fn duplicate_modes_settings_and_seeds_are_refused() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let modes = names(&["R3", "disabled", "r3"]);
        let parsed: Vec<RouterReplay> = modes.iter().map(|m| m.parse().expect(m)).collect();
        let err = refuse_duplicates("--modes", &modes, &parsed).expect_err("R3 twice");
        let text = err.to_string();
        assert!(
            text.contains("--modes") && text.contains("\"R3\"") && text.contains("\"r3\""),
            "{text}"
        );
        let settings = names(&["single", "single"]);
        let parsed = parse_settings(&settings, 4).expect("settings");
        let err = refuse_duplicates("--settings", &settings, &parsed).expect_err("twice");
        assert!(err.to_string().contains("--settings"), "{err}");
        let seeds = [1u64, 2, 1];
        let err = refuse_duplicates("--seeds", &names(&["1", "2", "1"]), &seeds).expect_err("1");
        assert!(err.to_string().contains("--seeds"), "{err}");
        let modes = names(&["disabled", "R2", "R3"]);
        let parsed: Vec<RouterReplay> = modes.iter().map(|m| m.parse().expect(m)).collect();
        refuse_duplicates("--modes", &modes, &parsed).expect("distinct");
    }
}
