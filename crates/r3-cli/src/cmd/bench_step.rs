//! `r3 bench step`: whole RL steps of a real config (rollout with route capture, old
//! log-probs where the config has a separate pass, the update's forward, backward and
//! optimiser, weight sync), the first discarded as warm-up. Per phase: its time (median
//! over the measured steps), its share of the step, its matrix work and memory traffic,
//! its share of the machine's limit measured on the spot (the f32 GEMM peak and the
//! streaming bandwidth: a phase's limit is min(peak, bandwidth × its arithmetic
//! intensity)), and the memory high-water mark of the step and of each phase.
//!
//! `--model mid` trains `r3 bench train`'s mid-size config (random weights, the config's
//! tokenizer and vocabulary) in place of the config's model.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use r3_model::{presets, Config, RandomInit, Weights};
use r3_train::rl::step::StepTrace;
use r3_train::{ModelText, StepMetrics, Trainer};

use super::matmul_work::{f32_gemm_peak, flops_per_token, generation_flops, stream_bandwidth};
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
    /// Warm-up steps, run and discarded.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// The phases of a step as the bench names them, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Rollout,
    OldLogp,
    UpdateForward,
    UpdateBackward,
    Optimiser,
    WeightSync,
    Other,
}

const PHASES: [Phase; 7] = [
    Phase::Rollout,
    Phase::OldLogp,
    Phase::UpdateForward,
    Phase::UpdateBackward,
    Phase::Optimiser,
    Phase::WeightSync,
    Phase::Other,
];

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Rollout => "rollout+capture",
            Phase::OldLogp => "old log-probs",
            Phase::UpdateForward => "update forward",
            Phase::UpdateBackward => "update backward",
            Phase::Optimiser => "optimiser",
            Phase::WeightSync => "weight sync",
            Phase::Other => "other",
        }
    }

    /// Seconds of this phase in a step's metrics line; `Other` is the rest of `wall_s`.
    fn seconds(self, m: &StepMetrics, wall_s: f64) -> f64 {
        match self {
            Phase::Rollout => m.rollout_s,
            Phase::OldLogp => m.old_logp_s,
            Phase::UpdateForward => m.update_forward_s,
            Phase::UpdateBackward => m.update_backward_s,
            Phase::Optimiser => m.update_optim_s,
            Phase::WeightSync => m.sync_s,
            Phase::Other => {
                let named = m.rollout_s
                    + m.old_logp_s
                    + m.update_forward_s
                    + m.update_backward_s
                    + m.update_optim_s
                    + m.sync_s;
                (wall_s - named).max(0.0)
            }
        }
    }

    /// The memory high-water mark of the part of the step this phase is in (the update's
    /// forward, backward and optimiser share the update's mark).
    fn peak_mib(self, m: &StepMetrics) -> Option<f64> {
        match self {
            Phase::Rollout => m.rollout_peak_mib,
            Phase::OldLogp => m.old_logp_peak_mib,
            Phase::UpdateForward | Phase::UpdateBackward | Phase::Optimiser => m.update_peak_mib,
            Phase::WeightSync => m.sync_peak_mib,
            Phase::Other => None,
        }
    }
}

/// The matrix work and the memory traffic of a phase.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Work {
    /// Multiply-add FLOPs (2 per MAC); `None` where the model's attention is not counted.
    flops: Option<f64>,
    /// Bytes the phase must at least move between memory and the cores.
    bytes: f64,
}

/// This machine's two limits, measured on the spot.
#[derive(Debug, Clone, Copy)]
struct Machine {
    /// f32 GEMM peak, FLOP/s.
    peak_flops: f64,
    /// Streaming bandwidth, bytes/s.
    bandwidth: f64,
}

impl Machine {
    /// The roofline: the best FLOP rate at arithmetic intensity `flops_per_byte`.
    fn attainable(&self, flops_per_byte: f64) -> f64 {
        self.peak_flops.min(self.bandwidth * flops_per_byte)
    }

    /// Fewest seconds this machine needs for `w`: its FLOPs at the roofline's rate for its
    /// intensity, or its bytes at the bandwidth where it does no counted matrix work.
    fn limit_seconds(&self, w: Work) -> f64 {
        match w.flops {
            Some(f) if f > 0.0 && w.bytes > 0.0 => f / self.attainable(f / w.bytes),
            Some(f) if f > 0.0 => f / self.peak_flops,
            _ => w.bytes / self.bandwidth,
        }
    }
}

/// Each value's share of their sum, in percent (all 0 for a zero sum).
fn shares_percent(values: &[f64]) -> Vec<f64> {
    let total: f64 = values.iter().sum();
    values
        .iter()
        .map(|v| if total > 0.0 { 100.0 * v / total } else { 0.0 })
        .collect()
}

/// The median (the mean of the middle two for an even count); 0 for none.
fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// FLOPs of a training forward over one sequence of `len` tokens: every position through
/// the model and the vocabulary head, attending over the positions before it.
fn training_forward_flops(cfg: &Config, len: usize) -> Option<f64> {
    (1..=len).map(|t| flops_per_token(cfg, t, true)).sum()
}

/// Sums `f` over `rows` of the step's sequences, `None` when any is uncounted.
fn sum_rows(
    trace: &StepTrace,
    rows: impl Iterator<Item = usize>,
    f: impl Fn(usize, usize) -> Option<f64>,
) -> Option<f64> {
    rows.map(|r| f(trace.sequences[r].len(), trace.prompt_lens[r]))
        .sum()
}

/// What the bench knows of the model trained.
struct ModelFacts<'a> {
    cfg: &'a Config,
    /// Trainable parameters.
    params: f64,
    /// Bytes per weight of the rollout engine's precision.
    rollout_weight_bytes: f64,
}

/// Bytes of weights the rollout engine reads over the step: the whole model per forward,
/// the routed experts only in the expected share a forward of `tokens` tokens hits (with
/// routing uniform over the experts). The first forward is the prefill of every prompt,
/// then one per new token of the longest response, over the sequences still generating
/// (all at once: the step's sequences fit the engine's running batch).
fn rollout_bytes(model: &ModelFacts<'_>, trace: &StepTrace) -> f64 {
    let cfg = model.cfg;
    let (experts, miss) = match &cfg.moe {
        Some(moe) => {
            let layers = (0..cfg.num_hidden_layers)
                .filter(|&l| cfg.is_moe_layer(l))
                .count();
            let per_expert = 3.0 * (cfg.hidden_size * moe.expert_intermediate_size) as f64;
            let experts = (layers * moe.num_experts) as f64 * per_expert;
            (experts, 1.0 - moe.top_k as f64 / moe.num_experts as f64)
        }
        None => (0.0, 1.0),
    };
    let dense = model.params - experts;
    let responses: Vec<usize> = (0..trace.sequences.len())
        .map(|r| trace.sequences[r].len() - trace.prompt_lens[r])
        .collect();
    let longest = responses.iter().copied().max().unwrap_or(0);
    (0..longest)
        .map(|j| match j {
            0 => trace.prompt_lens.iter().sum::<usize>(),
            _ => responses.iter().filter(|&&n| n > j).count(),
        })
        .map(|tokens| {
            let hit = 1.0 - miss.powi(i32::try_from(tokens).unwrap_or(i32::MAX));
            (dense + experts * hit) * model.rollout_weight_bytes
        })
        .sum()
}

/// The work of each phase of one step, from what it ran: the sequences of its trace (their
/// prompts and responses), the updates it applied, and whether it had an old-log-prob pass.
fn step_work(model: &ModelFacts<'_>, trace: &StepTrace, old_pass: bool) -> [Work; 7] {
    let cfg = model.cfg;
    let n = trace.sequences.len();
    let f32_weights = 4.0 * model.params;
    let all_forward = sum_rows(trace, 0..n, |len, _| training_forward_flops(cfg, len));
    let update_rows = trace
        .updates
        .iter()
        .flat_map(|(rows, _)| rows.iter().copied());
    let update_forward = sum_rows(trace, update_rows, |len, _| {
        training_forward_flops(cfg, len)
    });
    let updates = trace.updates.len() as f64;
    let mut work = [Work::default(); 7];
    for (slot, phase) in work.iter_mut().zip(PHASES) {
        *slot = match phase {
            Phase::Rollout => Work {
                flops: sum_rows(trace, 0..n, |len, prompt| {
                    generation_flops(cfg, 1, prompt, len - prompt)
                }),
                bytes: rollout_bytes(model, trace),
            },
            Phase::OldLogp if old_pass => Work {
                flops: all_forward,
                bytes: f32_weights,
            },
            Phase::UpdateForward => Work {
                flops: update_forward,
                bytes: updates * f32_weights,
            },
            // Backward ≈ 2 × forward: the gradients of the activations and of the weights.
            Phase::UpdateBackward => Work {
                flops: update_forward.map(|f| 2.0 * f),
                bytes: updates * 2.0 * f32_weights,
            },
            // AdamW reads parameter, gradient and both moments and writes parameter and
            // moments: 7 f32 per parameter per update, no matrix work.
            Phase::Optimiser => Work {
                flops: None,
                bytes: updates * 7.0 * f32_weights,
            },
            // The f32 map is read twice (range check, conversion) and written once at the
            // rollout precision.
            Phase::WeightSync => Work {
                flops: None,
                bytes: model.params * (8.0 + model.rollout_weight_bytes),
            },
            Phase::OldLogp | Phase::Other => Work::default(),
        };
    }
    work
}

/// One measured step.
struct Sample {
    wall_s: f64,
    seconds: [f64; 7],
    work: [Work; 7],
    metrics: StepMetrics,
    tokens: usize,
    sequences: usize,
}

/// The bench's result for one phase (or the whole step).
#[derive(Debug, Clone)]
struct Row {
    name: &'static str,
    seconds: f64,
    share_pct: f64,
    flops: Option<f64>,
    bytes: f64,
    limit_s: f64,
    peak_mib: Option<f64>,
}

impl Row {
    /// The share of the machine's limit the phase reaches (limit time over its time).
    fn of_limit_pct(&self) -> Option<f64> {
        (self.seconds > 0.0 && self.limit_s > 0.0).then(|| 100.0 * self.limit_s / self.seconds)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "phase": self.name,
            "seconds": self.seconds,
            "share_pct": self.share_pct,
            "gflop": self.flops.map(|f| f / 1e9),
            "gbytes": self.bytes / 1e9,
            "limit_s": self.limit_s,
            "of_limit_pct": self.of_limit_pct(),
            "peak_mib": self.peak_mib,
        })
    }
}

/// The table's rows from the measured steps: medians of time and work per phase, shares
/// of their sum, and the highest memory mark seen.
fn summarise(samples: &[Sample], machine: &Machine) -> (Vec<Row>, Row) {
    let times: Vec<f64> = (0..PHASES.len())
        .map(|i| median(&samples.iter().map(|s| s.seconds[i]).collect::<Vec<_>>()))
        .collect();
    let shares = shares_percent(&times);
    let max_of = |v: Vec<Option<f64>>| v.into_iter().flatten().reduce(f64::max);
    let rows: Vec<Row> = PHASES
        .iter()
        .enumerate()
        .map(|(i, &phase)| {
            let flops: Option<Vec<f64>> = samples.iter().map(|s| s.work[i].flops).collect();
            let work = Work {
                flops: flops.map(|f| median(&f)),
                bytes: median(&samples.iter().map(|s| s.work[i].bytes).collect::<Vec<_>>()),
            };
            Row {
                name: phase.name(),
                seconds: times[i],
                share_pct: shares[i],
                flops: work.flops,
                bytes: work.bytes,
                limit_s: machine.limit_seconds(work),
                peak_mib: max_of(samples.iter().map(|s| phase.peak_mib(&s.metrics)).collect()),
            }
        })
        .collect();
    let step = Row {
        name: "step",
        seconds: rows.iter().map(|r| r.seconds).sum(),
        share_pct: shares.iter().sum(),
        // Counted where the rollout's is (the same attention counts every phase's).
        flops: rows[0]
            .flops
            .map(|_| rows.iter().filter_map(|r| r.flops).sum()),
        bytes: rows.iter().map(|r| r.bytes).sum(),
        limit_s: rows.iter().map(|r| r.limit_s).sum(),
        peak_mib: max_of(samples.iter().map(|s| s.metrics.peak_mib).collect()),
    };
    (rows, step)
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

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
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
    let threads = rayon_threads();
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
    let response_len = median(
        &samples
            .iter()
            .map(|s| s.metrics.response_len_mean)
            .collect::<Vec<_>>(),
    );
    let active = flops_per_token(&model_cfg, 0, false).map(|f| f / 2.0);
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
        "r3 bench step: {config_name}, model {model_name}: {:.1} M parameters, {} active per token (without embedding and head)",
        params as f64 / 1e6,
        fmt_opt(active, |a| format!("{:.1} M", a / 1e6)),
    );
    println!(
        "{sequences} sequences per step, {tokens:.0} tokens (mean response {response_len:.1}); {} warm-up + {} measured steps, median wall {wall:.3} s per step",
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Config {
        Config::from_value(serde_json::json!({
            "model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 4,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 2, "intermediate_size": 8, "moe_intermediate_size": 5,
            "num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": true,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
            "tie_word_embeddings": false
        }))
        .expect("config")
    }

    #[test]
    fn the_roofline_is_the_lower_of_compute_and_bandwidth() {
        let m = Machine {
            peak_flops: 100e9,
            bandwidth: 10e9,
        };
        // 1 FLOP/byte: bandwidth-bound at 10 GFLOP/s; 100 FLOP/byte: compute-bound.
        assert_eq!(m.attainable(1.0), 10e9);
        assert_eq!(m.attainable(100.0), 100e9);
        let low = Work {
            flops: Some(1e9),
            bytes: 1e9,
        };
        let high = Work {
            flops: Some(100e9),
            bytes: 1e9,
        };
        assert_eq!(m.limit_seconds(low), 0.1, "1 GB at 10 GB/s");
        assert_eq!(m.limit_seconds(high), 1.0, "100 GFLOP at 100 GFLOP/s");
        // the same as the larger of the two times, as a roofline must be
        for w in [low, high] {
            let f = w.flops.expect("counted");
            assert_eq!(
                m.limit_seconds(w),
                (f / m.peak_flops).max(w.bytes / m.bandwidth)
            );
        }
        // no matrix work: the bytes at the bandwidth; no bytes: the FLOPs at the peak
        let optimiser = Work {
            flops: None,
            bytes: 28e9,
        };
        assert_eq!(m.limit_seconds(optimiser), 2.8);
        let pure = Work {
            flops: Some(50e9),
            bytes: 0.0,
        };
        assert_eq!(m.limit_seconds(pure), 0.5);
    }

    #[test]
    fn shares_add_up_and_the_median_takes_the_middle() {
        let s = shares_percent(&[1.0, 3.0, 0.0, 4.0]);
        assert_eq!(s, vec![12.5, 37.5, 0.0, 50.0]);
        assert_eq!(s.iter().sum::<f64>(), 100.0);
        assert_eq!(shares_percent(&[0.0, 0.0]), vec![0.0, 0.0]);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    /// By hand on matmul_work's tiny config: per token 2 · (48 projection MACs + 2·4·ctx
    /// attention + 144 experts and router + 40 head) FLOPs.
    #[test]
    fn a_step_counts_its_work_by_hand() {
        let cfg = tiny();
        let per = |ctx: f64| 2.0 * (48.0 + 8.0 * ctx + 144.0 + 40.0);
        // one sequence of 2 prompt + 1 response tokens, one update, an old pass
        let trace = StepTrace {
            sequences: vec![vec![1, 2, 3]],
            prompt_lens: vec![2],
            updates: vec![(vec![0], None)],
            ..StepTrace::default()
        };
        let facts = ModelFacts {
            cfg: &cfg,
            params: 1000.0,
            rollout_weight_bytes: 2.0,
        };
        let w = step_work(&facts, &trace, true);
        let forward = per(1.0) + per(2.0) + per(3.0);
        assert_eq!(w[1].flops, Some(forward), "old pass: all three positions");
        assert_eq!(w[2].flops, Some(forward), "update forward");
        assert_eq!(w[3].flops, Some(2.0 * forward), "backward = 2 × forward");
        // rollout: prefill of 2 (head on the last only), then no decode step for 1 token
        let prefill = per(1.0) - 2.0 * 40.0 + per(2.0);
        assert_eq!(w[0].flops, Some(prefill));
        // One forward (the prefill of 2 tokens): 360 expert weights (6 experts of 3·4·5),
        // of which 2 tokens top-2 of 6 hit 1 − (4/6)² = 5/9; 640 others, all in f16.
        assert!(
            (w[0].bytes - (640.0 + 200.0) * 2.0).abs() < 1e-9,
            "{}",
            w[0].bytes
        );
        assert_eq!(w[4].bytes, 7.0 * 4.0 * 1000.0, "AdamW: 7 f32 per parameter");
        assert_eq!(w[4].flops, None);
        assert_eq!(
            w[5].bytes,
            1000.0 * 10.0,
            "sync: f32 read twice, f16 written"
        );
        assert_eq!(w[6], Work::default());
        // no old pass: no work there
        assert_eq!(step_work(&facts, &trace, false)[1], Work::default());
    }
}
