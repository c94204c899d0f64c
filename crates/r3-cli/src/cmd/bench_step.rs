//! `r3 bench step`: whole RL steps of a real config (rollout with route capture, old
//! log-probs where the config has a separate pass, the update's forward, backward and
//! optimiser, weight sync), the first two discarded as warm-up. Per phase: its time (median
//! over the measured steps), its share of the step, its matrix work and memory traffic,
//! its share of the machine's limit measured on the spot (the f32 GEMM peak and the
//! streaming bandwidth: a phase's limit is min(peak, bandwidth × its arithmetic
//! intensity)), and the memory high-water mark of the step and of each phase.
//!
//! `--model mid` trains `r3 bench train`'s mid-size config (random weights, the config's
//! tokenizer and vocabulary) in place of the config's model. The accounting (phases, work,
//! limits, rows) is `step_phases.rs`; this file runs the steps and prints the table.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use r3_model::{presets, Config, RandomInit, Weights};
use r3_train::rl::step::StepTrace;
use r3_train::{ModelText, Trainer};

use super::matmul_work::{f32_gemm_peak, flops_per_token, machine_threads, stream_bandwidth};
use super::step_phases::{median, step_work, summarise, Machine, ModelFacts, Row, Sample, PHASES};
use super::train::{model_dir_from_cwd, resolve_config};

/// Options of `r3 bench step`.
#[derive(Debug, Args)]
pub struct BenchStepArgs {
    /// TOML config; without it the built-in `configs/default.toml`.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override one config key, e.g. `--set rollout.prompts_per_step=4` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// The model trained: `config` (the config's `model_dir`) or `mid` (`r3 bench train`'s
    /// mid-size config with seeded random weights and the config model's tokenizer).
    #[arg(long, default_value = "config", value_parser = ["config", "mid"])]
    pub model: String,
    /// Measured steps (after the warm-up).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Warm-up steps, run and discarded. Two by default: the optimiser's first two steps
    /// write into memory the process has not touched before (the staged new values, then the
    /// buffers the first step freed, whose moments had been untouched zero pages), and its
    /// page faults cost more than the pass itself (mid: 559 k and 248 k faults, 2.2 s and
    /// 1.2 s, against 0.19–0.28 s and 0–9 k faults from the third step on, on a 2-core VM).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}
/// A temporary model directory, removed when dropped.
struct ScratchModel(PathBuf);

impl Drop for ScratchModel {
    fn drop(&mut self) {
        // Best effort: a leftover directory in the temp dir harms nothing.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `r3 bench train`'s mid-size config with the vocabulary and special-token ids of the
/// model in `source` (so its tokenizer fits), seeded random weights (as `bench train`
/// draws them), written with that tokenizer into a temporary directory.
fn mid_model(source: &Path, seed: u64) -> anyhow::Result<ScratchModel> {
    let path = source.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let source_cfg: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut raw = presets::mid_size_bench_config()?.raw;
    for key in ["vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"] {
        if let Some(v) = source_cfg.get(key) {
            raw[key] = v.clone();
        }
    }
    let cfg = Config::from_value(raw)?;
    let dir = std::env::temp_dir().join(format!("r3-bench-step-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let scratch = ScratchModel(dir);
    let mut init = RandomInit::new(seed);
    init.std = 0.02;
    init.router_std = 0.02;
    init.norm_jitter = 0.0;
    Weights::random(&cfg, &init, &candle_core::Device::Cpu)?.save(&scratch.0, &cfg)?;
    ModelText::from_model_dir(source)?.save(&scratch.0)?;
    Ok(scratch)
}

/// The f32 GEMM peak on `threads` threads and the streaming bandwidth, measured now.
fn measure_machine(threads: usize) -> Machine {
    Machine {
        peak_flops: f32_gemm_peak(threads) * 1e9,
        bandwidth: stream_bandwidth() * 1e9,
    }
}

fn fmt_opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or("-".into(), f)
}

/// Runs `r3 bench step`.
pub fn run(args: BenchStepArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.steps > 0, "need --steps ≥ 1");
    let mut cfg = resolve_config(args.config.as_deref(), &args.set)?;
    cfg.model_dir = model_dir_from_cwd(&cfg.model_dir)?;
    let config_name = args
        .config
        .as_ref()
        .map_or("configs/default.toml (built in)".to_string(), |p| {
            p.display().to_string()
        });
    let mut model_name = cfg.model_dir.display().to_string();
    let _scratch = match args.model.as_str() {
        "mid" => {
            let m = mid_model(&cfg.model_dir, cfg.seed)?;
            model_name =
                format!("mid-size bench config, random weights, tokenizer of {model_name}");
            cfg.model_dir = m.0.clone();
            Some(m)
        }
        _ => None,
    };
    let rollout_weight_bytes = match cfg.rollout.dtype.as_str() {
        "f32" => 4.0,
        _ => 2.0,
    };
    let mut trainer = Trainer::new(cfg).context("building the trainer")?;
    let model_cfg = trainer.policy.config().clone();
    let params: usize = trainer
        .policy
        .vars()
        .iter()
        .map(|(_, v)| v.as_tensor().elem_count())
        .sum();
    let facts = ModelFacts {
        cfg: &model_cfg,
        params: params as f64,
        rollout_weight_bytes,
    };
    let threads = machine_threads();
    let before = measure_machine(threads);

    let total = args.warmup + args.steps;
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total as u64)
    };
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} steps {msg}",
    )?);
    let mut samples = Vec::new();
    for i in 0..total {
        bar.set_message(if i < args.warmup {
            "warm-up"
        } else {
            "measured"
        });
        let mut trace = StepTrace::default();
        let t = Instant::now();
        let metrics = trainer.rl_step_with(Some(&mut trace))?;
        let wall_s = t.elapsed().as_secs_f64();
        bar.inc(1);
        anyhow::ensure!(
            trace.prompt_lens.len() == trace.sequences.len(),
            "the step's trace has {} prompt lengths for {} sequences",
            trace.prompt_lens.len(),
            trace.sequences.len()
        );
        if i < args.warmup {
            continue;
        }
        let mut seconds = [0.0; 7];
        for (s, phase) in seconds.iter_mut().zip(PHASES) {
            *s = phase.seconds(&metrics, wall_s);
        }
        samples.push(Sample {
            wall_s,
            seconds,
            work: step_work(&facts, &trace, metrics.old_logp_s > 0.0),
            tokens: trace.sequences.iter().map(Vec::len).sum(),
            sequences: trace.sequences.len(),
            prompt_tokens: (
                trace.prompt_lens.iter().sum(),
                trace.cached_tokens.iter().sum(),
            ),
            shared_positions: trace.update_shared_lens.iter().map(|s| s.positions).sum(),
            metrics,
        });
    }
    bar.finish_and_clear();
    // Measured before and after the steps; the better of each is the machine's limit (the
    // least disturbed by other tenants of a shared machine).
    let after = measure_machine(threads);
    let machine = Machine {
        peak_flops: before.peak_flops.max(after.peak_flops),
        bandwidth: before.bandwidth.max(after.bandwidth),
    };

    let (rows, step) = summarise(&samples, &machine);
    let wall = median(&samples.iter().map(|s| s.wall_s).collect::<Vec<_>>());
    let tokens = median(&samples.iter().map(|s| s.tokens as f64).collect::<Vec<_>>());
    let sequences = samples.first().map_or(0, |s| s.sequences);
    let prompt_tokens = median(
        &samples
            .iter()
            .map(|s| s.prompt_tokens.0 as f64)
            .collect::<Vec<_>>(),
    );
    let shared_positions = median(
        &samples
            .iter()
            .map(|s| s.shared_positions as f64)
            .collect::<Vec<_>>(),
    );
    let cached_tokens = median(
        &samples
            .iter()
            .map(|s| s.prompt_tokens.1 as f64)
            .collect::<Vec<_>>(),
    );
    let response_len = median(
        &samples
            .iter()
            .map(|s| s.metrics.response_len_mean)
            .collect::<Vec<_>>(),
    );
    let active = flops_per_token(&model_cfg, 0, false) / 2.0;
    if args.json {
        let out = serde_json::json!({
            "config": config_name,
            "model": model_name,
            "params": params,
            "active_params_per_token": active,
            "warmup_steps": args.warmup,
            "measured_steps": args.steps,
            "sequences_per_step": sequences,
            "tokens_per_step": tokens,
            "prompt_tokens_per_step": prompt_tokens,
            "prefix_cached_tokens_per_step": cached_tokens,
            "update_shared_positions_per_step": shared_positions,
            "response_len_mean": response_len,
            "wall_s_per_step": wall,
            "threads": threads,
            "gemm_peak_gflops": machine.peak_flops / 1e9,
            "stream_bandwidth_gbs": machine.bandwidth / 1e9,
            "gemm_peak_gflops_before_after": [before.peak_flops / 1e9, after.peak_flops / 1e9],
            "stream_bandwidth_gbs_before_after": [before.bandwidth / 1e9, after.bandwidth / 1e9],
            "phases": rows.iter().map(Row::json).collect::<Vec<_>>(),
            "step": step.json(),
        });
        println!("{}", serde_json::to_string(&out)?);
        return Ok(());
    }
    println!(
        "r3 bench step: {config_name}, model {model_name}: {:.1} M parameters, {:.1} M active per token (without embedding and head)",
        params as f64 / 1e6,
        active / 1e6,
    );
    println!(
        "{sequences} sequences per step, {tokens:.0} tokens (mean response {response_len:.1}; of the {prompt_tokens:.0} prompt tokens {cached_tokens:.0} read from the rollout's prefix cache; {shared_positions:.0} positions of the update computed once for several sequences); {} warm-up + {} measured steps, median wall {wall:.3} s per step",
        args.warmup, args.steps
    );
    println!(
        "machine, measured before and after the steps (the better counts): f32 GEMM peak {:.1} / {:.1} GFLOP/s ({threads} threads), streaming bandwidth {:.1} / {:.1} GB/s",
        before.peak_flops / 1e9,
        after.peak_flops / 1e9,
        before.bandwidth / 1e9,
        after.bandwidth / 1e9
    );
    println!(
        "{:<16} {:>9} {:>7} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9}",
        "phase", "time s", "share", "GFLOP", "GB", "GFLOP/s", "limit s", "of limit", "peak MiB"
    );
    for r in rows.iter().chain(std::iter::once(&step)) {
        let rate = r
            .flops
            .filter(|_| r.seconds > 0.0)
            .map(|f| f / r.seconds / 1e9);
        println!(
            "{:<16} {:>9.4} {:>6.1}% {:>9} {:>8.3} {:>9} {:>9.4} {:>9} {:>9}",
            r.name,
            r.seconds,
            r.share_pct,
            fmt_opt(r.flops, |f| format!("{:.2}", f / 1e9)),
            r.bytes / 1e9,
            fmt_opt(rate, |v| format!("{v:.1}")),
            r.limit_s,
            fmt_opt(r.of_limit_pct(), |p| format!("{p:.1}%")),
            fmt_opt(r.peak_mib, |m| format!("{m:.0}")),
        );
    }
    println!(
        "time: median per phase; share: of the phases' sum; limit: min(GEMM peak, bandwidth × FLOP/byte) for the phase's work; \
         of limit: limit s / time s; peak: the process's resident high-water mark (the update's three parts share one)"
    );
    Ok(())
}
