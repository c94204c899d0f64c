//! `r3 eval --model DIR`: the trainer's held-out evaluation of any checkpoint (a base model
//! or an RL checkpoint) without training — the same prompts, samples, seeds and estimators
//! as `eval.jsonl` (`mean@k`, `pass@k`, `maj@k` per data source with their errors), printed
//! as a table and written as one evaluation line (`--out`). With `--baseline` (another
//! `--out`, or a run directory / `eval.jsonl`) it states the paired difference over the same
//! prompts with its 95% interval and says whether it is inside the noise.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use r3_analysis::paired::{compare_evals, load_eval, PairedError, ScoredEval};
use r3_tasks::estimators::{t_quantile_975, Estimate};
use r3_train::rl::evaluation::{prompts_digest, EvalResult};
use r3_train::rl::metrics_log::EvalLine;
use r3_train::Trainer;

use super::train::resolve_config;

/// Arguments of `r3 eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The model or checkpoint directory (config.json, model.safetensors, tokenizer).
    #[arg(long)]
    pub model: PathBuf,
    /// TOML config giving the eval set, reward, rollout and `[eval]` settings (default: the
    /// built-in configs/default.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override one config key, e.g. `--set eval.size=50` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Samples per prompt (`eval.samples_per_prompt`).
    #[arg(long)]
    pub k: Option<usize>,
    /// Sampling temperature (`eval.temperature`; 0 = greedy).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Write the evaluation line (with per-prompt scores) to this JSON file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Compare with this evaluation: an `--out` file of an earlier call, or a run directory
    /// or `eval.jsonl` (its last evaluation, or `--baseline-step`); repeat for several seeds.
    #[arg(long)]
    pub baseline: Vec<PathBuf>,
    /// Step of the baseline evaluation inside a run's `eval.jsonl`.
    #[arg(long)]
    pub baseline_step: Option<u64>,
}

/// Runs `r3 eval`.
pub fn run(a: EvalArgs) -> anyhow::Result<()> {
    let mut set = a.set.clone();
    if let Some(k) = a.k {
        set.push(format!("eval.samples_per_prompt={k}"));
    }
    if let Some(t) = a.temperature {
        set.push(format!("eval.temperature={t}"));
    }
    let mut cfg = resolve_config(a.config.as_deref(), &set)?;
    cfg.model_dir = a.model.clone();
    cfg.validate()?;
    let baselines = a
        .baseline
        .iter()
        .map(|p| load_eval(p, a.baseline_step))
        .collect::<Result<Vec<_>, _>>()?;
    tracing::info!(
        model = %a.model.display(),
        k = cfg.eval.samples_per_prompt,
        temperature = cfg.eval.temperature,
        seed = cfg.eval.seed,
        "evaluating"
    );
    // The evaluation is named by its `--out` file, else by the model it evaluates.
    let path = a.out.clone().unwrap_or_else(|| a.model.clone());
    let started = std::time::Instant::now();
    let mut trainer =
        Trainer::new(cfg).with_context(|| format!("loading {}", a.model.display()))?;
    // A baseline scored on other prompts cannot be paired: found from the eval set itself
    // before the (long) evaluation runs, not after it.
    let items = trainer.prompts.eval_items(&trainer.tokenizer)?;
    check_baseline_prompts(&path, items.len(), &prompts_digest(&items), &baselines)?;
    let result = trainer.evaluate()?;
    let eval_s = started.elapsed().as_secs_f64();
    print!("{}", eval_table(&a.model.display().to_string(), &result));
    println!("eval time: {eval_s:.1} s");
    let line = EvalLine::of(trainer.step, &result);
    if let Some(out) = &a.out {
        let json = serde_json::to_string(&line)?;
        std::fs::write(out, json + "\n").with_context(|| format!("writing {}", out.display()))?;
        println!("written: {}", out.display());
    }
    if !baselines.is_empty() {
        let this = ScoredEval { path, line };
        let d = compare_evals(std::slice::from_ref(&this), &baselines)?;
        println!("paired difference vs baseline: {}", d.describe_points());
    }
    Ok(())
}

/// Refuses a baseline scored on another number of prompts, or on prompts whose digest is not
/// `digest` (the eval set `this` is about to be scored on), as `compare_evals` would after
/// the evaluation.
fn check_baseline_prompts(
    this: &Path,
    n: usize,
    digest: &str,
    baselines: &[ScoredEval],
) -> anyhow::Result<()> {
    for b in baselines {
        let differ = |what: String| PairedError::DifferentPrompts {
            a: this.to_path_buf(),
            b: b.path.clone(),
            what,
        };
        let m = b.line.prompt_scores.len();
        if m != n {
            return Err(differ(format!("{n} vs {m} prompts")).into());
        }
        // An evaluation written before digests were recorded pairs on its count alone.
        if b.line
            .prompts_digest
            .as_deref()
            .is_some_and(|d| d != digest)
        {
            return Err(differ("prompt digests differ".into()).into());
        }
    }
    Ok(())
}

/// The evaluation as a table a person reads: one row per data source and estimator, in
/// percent with the standard error (and `maj@k`'s bootstrap interval).
pub fn eval_table(model: &str, r: &EvalResult) -> String {
    let k = r.samples_per_prompt;
    let mut s = format!(
        "{model}: {} prompts x {k} samples, mean@{k} {:.1}% ± {:.1}, mean response {:.1} tokens\n",
        r.n,
        100.0 * r.accuracy,
        100.0 * r.accuracy_stderr,
        r.response_len_mean
    );
    s.push_str("| data source | estimator | value | ± s.e. | 95% interval |\n");
    s.push_str("|---|---|---:|---:|---|\n");
    let pct = |x: f64| format!("{:.1}%", 100.0 * x);
    // Student's t over prompts for the means; maj@k's interval is its bootstrap.
    let t = t_quantile_975(r.n.saturating_sub(1));
    let t_interval = |e: &Estimate| {
        format!(
            "{} … {} (t)",
            pct(e.value - t * e.stderr),
            pct(e.value + t * e.stderr)
        )
    };
    for src in &r.sources {
        let sum = &src.summary;
        let name = &src.data_source;
        let kk = sum.samples_per_prompt;
        s.push_str(&format!(
            "| {name} | mean@{kk} | {} | {:.1} | {} |\n",
            pct(sum.mean_at_k.value),
            100.0 * sum.mean_at_k.stderr,
            t_interval(&sum.mean_at_k)
        ));
        for p in &sum.pass_at_k {
            s.push_str(&format!(
                "| {name} | pass@{} | {} | {:.1} | {} |\n",
                p.k,
                pct(p.estimate.value),
                100.0 * p.estimate.stderr,
                t_interval(&p.estimate)
            ));
        }
        if let Some(m) = &sum.maj_at_k {
            let interval = m.bootstrap.map_or(String::new(), |b| {
                format!(
                    "{} … {} (bootstrap, {})",
                    pct(b.low),
                    pct(b.high),
                    b.resamples
                )
            });
            s.push_str(&format!(
                "| {name} | maj@{kk} | {} | {:.1} | {interval} |\n",
                pct(m.estimate.value),
                100.0 * m.estimate.stderr
            ));
        }
    }
    s
}
