//! `r3 eval --model DIR`: the trainer's held-out evaluation of any checkpoint (a base model
//! or an RL checkpoint) without training — the same prompts, samples, seeds and estimators
//! as `eval.jsonl` (`mean@k`, `pass@k`, `maj@k` per data source with their errors), printed
//! as a table and written as one evaluation line (`--out`). With `--baseline` (another
//! `--out`, or a run directory / `eval.jsonl`) it states the paired difference over the same
//! prompts with its 95% interval and says whether it is inside the noise; a baseline scored
//! on other prompts or sampled with another `k` or temperature is refused before the
//! evaluation runs.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use r3_analysis::paired::{check_pairing, compare_evals, load_eval, PairingKey, ScoredEval};
use r3_tasks::estimators::Interval;
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
    // A baseline scored on other prompts or sampled otherwise cannot be paired: found from
    // the eval set and the config before the (long) evaluation runs, not after it.
    let items = trainer.prompts.eval_items(&trainer.tokenizer)?;
    let digest = prompts_digest(&items);
    let this_key = PairingKey {
        prompts: items.len(),
        digest: Some(&digest),
        k: trainer.cfg.eval.samples_per_prompt,
        temperature: Some(trainer.cfg.eval.temperature),
    };
    for b in &baselines {
        check_pairing(&path, &this_key, &b.path, &PairingKey::of(&b.line))?;
    }
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
        let c = compare_evals(std::slice::from_ref(&this), &baselines)?;
        for w in &c.warnings {
            println!("warning: {w}");
        }
        println!(
            "paired difference vs baseline: {}",
            c.difference.describe_points()
        );
    }
    Ok(())
}

/// The evaluation as a table a person reads: one row per data source and estimator, in
/// percent with the standard error and the 95% interval the estimators computed over that
/// source's own prompts (Wilson's where each prompt scores 0 or 1, else Student's t with the
/// source's prompts − 1 degrees of freedom, clipped to [0, 1]); `—` where a source has fewer
/// than two prompts.
pub fn eval_table(model: &str, r: &EvalResult) -> String {
    let k = r.samples_per_prompt;
    let mut s = format!(
        "{model}: {} prompts x {k} samples at temperature {}, mean@{k} {:.1}% ± {:.1}, mean \
         response {:.1} tokens\n",
        r.n,
        r.temperature,
        100.0 * r.accuracy,
        100.0 * r.accuracy_stderr,
        r.response_len_mean
    );
    s.push_str("| data source | estimator | value | ± s.e. | 95% interval |\n");
    s.push_str("|---|---|---:|---:|---|\n");
    let pct = |x: f64| format!("{:.1}%", 100.0 * x);
    let interval = |i: &Option<Interval>| {
        i.map_or("—".to_string(), |i| {
            format!("{} … {} ({})", pct(i.low), pct(i.high), i.method.label())
        })
    };
    for src in &r.sources {
        let sum = &src.summary;
        let name = &src.data_source;
        let kk = sum.samples_per_prompt;
        s.push_str(&format!(
            "| {name} | mean@{kk} | {} | {:.1} | {} |\n",
            pct(sum.mean_at_k.value),
            100.0 * sum.mean_at_k.stderr,
            interval(&sum.mean_interval)
        ));
        for p in &sum.pass_at_k {
            s.push_str(&format!(
                "| {name} | pass@{} | {} | {:.1} | {} |\n",
                p.k,
                pct(p.estimate.value),
                100.0 * p.estimate.stderr,
                interval(&p.interval)
            ));
        }
        if let Some(m) = &sum.maj_at_k {
            s.push_str(&format!(
                "| {name} | maj@{kk} | {} | {:.1} | {} |\n",
                pct(m.estimate.value),
                100.0 * m.estimate.stderr,
                interval(&m.interval)
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use r3_tasks::estimators::{summarise, PromptOutcome, SummaryOptions};
    use r3_train::rl::evaluation::SourceEval;

    /// A prompt with `c` of `k` samples correct (answers: the first `c` vote "1").
    fn prompt(c: usize, k: usize) -> PromptOutcome {
        PromptOutcome {
            correct: (0..k).map(|i| i < c).collect(),
            answers: Some(
                (0..k)
                    .map(|i| Some(if i < c { "1" } else { "2" }.into()))
                    .collect(),
            ),
        }
    }

    fn source(name: &str, outcomes: &[PromptOutcome]) -> SourceEval {
        let opts = SummaryOptions {
            bootstrap_resamples: 0,
            bootstrap_seed: 0,
        };
        SourceEval {
            data_source: name.into(),
            summary: summarise(outcomes, opts).unwrap(),
        }
    }

    /// The `(low, high)` of the row `| name | estimator | …` in percent.
    fn row_interval(table: &str, name: &str, estimator: &str) -> (f64, f64) {
        let row = table
            .lines()
            .find(|l| l.starts_with(&format!("| {name} | {estimator} |")))
            .unwrap_or_else(|| panic!("no row {name} {estimator} in\n{table}"));
        let cell = row.split('|').nth(5).unwrap().trim();
        let (low, rest) = cell.split_once(" … ").unwrap();
        let high = rest.split_whitespace().next().unwrap();
        let pct = |x: &str| x.trim_end_matches('%').parse::<f64>().unwrap();
        (pct(low), pct(high))
    }

    #[test]
    fn each_source_uses_its_own_prompt_count() {
        // A 3-prompt source (1/4, 2/4, 3/4: mean 50%, se 14.43 points) inside a 200-prompt
        // evaluation: its interval is t₂ = 4.303 wide per s.e., not the whole set's 1.972.
        let small: Vec<PromptOutcome> = (1..=3).map(|c| prompt(c, 4)).collect();
        let big: Vec<PromptOutcome> = (0..197).map(|i| prompt(i % 5, 4)).collect();
        let r = EvalResult {
            n: 200,
            samples_per_prompt: 4,
            temperature: 1.0,
            sources: vec![source("small", &small), source("big", &big)],
            ..EvalResult::default()
        };
        let t = eval_table("m", &r);
        let se = r.sources[0].summary.mean_at_k.stderr;
        assert!((se - 0.25 / 3f64.sqrt()).abs() < 1e-12);
        let (low, high) = row_interval(&t, "small", "mean@4");
        // 50 ± 4.303 · 14.434 = 50 ± 62.1, clipped to [0, 100].
        assert!(4.303 * se > 0.5, "{t}");
        assert_eq!((low, high), (0.0, 100.0), "{t}");
        // pass@2 of the small source: 0.5, 5/6, 1 -> mean 7/9, unclipped on the low side.
        let p2 = &r.sources[0].summary.pass_at_k[1];
        let (low, _) = row_interval(&t, "small", "pass@2");
        let want = 100.0 * (p2.estimate.value - 4.303 * p2.estimate.stderr);
        assert!((low - want).abs() < 0.051, "{low} vs {want}\n{t}");
        // The big source: t₁₉₆ over its own 197 prompts.
        let b = &r.sources[1].summary.mean_at_k;
        let (low, high) = row_interval(&t, "big", "mean@4");
        let half = 100.0 * (1.96 + 2.46 / 196.0) * b.stderr;
        assert!((low - (100.0 * b.value - half)).abs() < 0.051, "{t}");
        assert!((high - (100.0 * b.value + half)).abs() < 0.051, "{t}");
        // maj@4 of the small source (majorities "2", "1" by the tie rule, "1": 2 of 3
        // prompts, each 0 or 1): Wilson's interval.
        assert!(
            t.lines()
                .any(|l| l.starts_with("| small | maj@4 | 66.7% |") && l.contains("(Wilson)")),
            "{t}"
        );
    }

    #[test]
    fn one_prompt_prints_a_dash_not_nan() {
        let r = EvalResult {
            n: 1,
            samples_per_prompt: 4,
            sources: vec![source("one", &[prompt(2, 4)])],
            ..EvalResult::default()
        };
        let t = eval_table("m", &r);
        assert!(!t.contains("NaN") && !t.contains("inf"), "{t}");
        assert!(t.contains("| one | mean@4 | 50.0% | 0.0 | — |"), "{t}");
    }
}
