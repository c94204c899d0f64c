//! `r3 bench step`: whole RL steps of a real config (rollout with route capture, old
//! log-probs where the config has a separate pass, the update's forward, backward and
//! optimiser, weight sync), the first two discarded as warm-up. Per phase: its time (median
//! over the measured steps), its share of the step, its matrix work and memory traffic,
//! its share of the limit of the machine it ran on, measured on the spot (a phase's limit
//! is min(GEMM peak, streaming bandwidth × its arithmetic intensity): the CPU's f32 GEMM
//! peak and STREAM triad, or — with `train.device` / `rollout.device` = `cuda` — the GPU's
//! GEMM peak in the phase's dtype and its copy rate), and the memory high-water mark of the
//! step and of each phase (and on a GPU its tensors' mark over the step).
//!
//! `--model mid` trains `r3 bench train`'s mid-size config (random weights, the config's
//! tokenizer and vocabulary) in place of the config's model. The accounting (phases, work,
//! limits, rows) is `step_phases.rs`; this file runs the steps and prints the table.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use r3_model::{presets, Config, DeviceSpec, RandomInit, Weights};
use r3_rollout::RolloutDevice;
use r3_train::config::train::RolloutBackend;
use r3_train::rl::backend::rollout_dtype;
use r3_train::rl::step::StepTrace;
use r3_train::{ModelText, Trainer};

use super::bench_optim::optimiser_bytes;
use super::matmul_work::{flops_per_token, machine_threads, MachineLimits};
use super::step_phases::{
    median, step_work, summarise, MicroBatching, ModelFacts, Phase, Row, Sample, PHASES,
};
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
    /// The model trained: `config` (the config's `model_dir`), or a `r3 bench train` shape
    /// with seeded random weights (drawn on the training device) and the config model's
    /// tokenizer and vocabulary: `mid` (208 M parameters with that vocabulary) or `a3b-8l`
    /// (Qwen3-30B-A3B's layers, 8 of them: a GPU's size, ≈ 5.0 B parameters with a small
    /// vocabulary).
    #[arg(long, default_value = "config", value_parser = ["config", "mid", "a3b-8l"])]
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
/// A bench config's shape (`r3 bench train`'s `mid`, or `a3b-8l`: Qwen3-30B-A3B's layers,
/// 8 of them) with the vocabulary and special-token ids of the model in `source` (so its
/// tokenizer fits), and seeded random weights drawn on `device` as `bench train` draws them
/// (by its own generator on a GPU: billions of values in seconds, never written to disk;
/// on the CPU exactly the host's draws).
fn preset_model(
    preset: &str,
    source: &Path,
    seed: u64,
    device: &Device,
) -> anyhow::Result<(Config, Weights)> {
    let path = source.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let source_cfg: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut raw = match preset {
        "a3b-8l" => presets::qwen3_30b_a3b_layers_config(8)?.raw,
        _ => presets::mid_size_bench_config()?.raw,
    };
    for key in ["vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"] {
        if let Some(v) = source_cfg.get(key) {
            raw[key] = v.clone();
        }
    }
    let cfg = Config::from_value(raw)?;
    let mut init = RandomInit::new(seed);
    init.std = 0.02;
    init.router_std = 0.02;
    init.norm_jitter = 0.0;
    let weights = Weights::random_on_device(&cfg, &init, device)?;
    Ok((cfg, weights))
}

/// Where a phase of the step runs: a device, and the dtype of its matrix work there.
#[derive(Debug, Clone)]
struct Place {
    device: Device,
    /// The GEMMs' dtype on a GPU (bf16 / f16 run on tensor cores); the CPU's limit is its
    /// f32 peak whatever the dtype (its 16-bit kernels compute in f32).
    dtype: DType,
}

impl Place {
    /// Whether `self` and `other` are measured as one machine: both the CPU, or the same
    /// GPU in the same dtype.
    fn same_machine(&self, other: &Place) -> bool {
        match (self.device.is_cpu(), other.device.is_cpu()) {
            (true, true) => true,
            (false, false) => self.device.same_device(&other.device) && self.dtype == other.dtype,
            _ => false,
        }
    }

    /// The dtype its GEMM peak is measured in (`f32`, `bf16`, `f16`).
    fn gemm_dtype(&self) -> String {
        let dtype = if self.device.is_cpu() {
            DType::F32
        } else {
            self.dtype
        };
        format!("{dtype:?}").to_lowercase()
    }

    /// What the table calls this machine.
    fn label(&self, threads: usize) -> String {
        let device = DeviceSpec::of(&self.device);
        match self.device.is_cpu() {
            true => format!("{device} ({threads} threads): f32 GEMM peak"),
            false => format!("{device}: {} GEMM peak", self.gemm_dtype()),
        }
    }
}

/// The machines a step's phases run on: the trainer's, and the rollout engine's where
/// rollouts are generated in this process (a fleet's machines are not measured).
struct StepPlaces {
    train: Place,
    rollout: Option<Place>,
}

impl StepPlaces {
    /// Where `trainer` trains and generates: its policy's device in `train.dtype`, and the
    /// in-process rollout engine's device (`rollout.device`) in `rollout.dtype`.
    fn of(trainer: &Trainer) -> anyhow::Result<Self> {
        let cfg = &trainer.cfg;
        let train_device = trainer.policy.device();
        let train = Place {
            dtype: trainer
                .policy
                .precision()
                .narrow_dtype()
                .unwrap_or(DType::F32),
            device: train_device.clone(),
        };
        let rollout = match cfg.rollout.backend {
            RolloutBackend::Sglang => None,
            RolloutBackend::Engine => {
                let dtype = match rollout_dtype(&cfg.rollout.dtype)? {
                    r3_rollout::Dtype::F32 => DType::F32,
                    r3_rollout::Dtype::Bf16 => DType::BF16,
                    r3_rollout::Dtype::F16 => DType::F16,
                };
                let spec = cfg
                    .rollout
                    .device
                    .parse::<RolloutDevice>()?
                    .candle()
                    .unwrap_or(DeviceSpec::Cpu);
                // The engine's GPU is the trainer's where they name the same one (one
                // handle, one memory pool); another is opened for its measurement.
                let device = if spec == DeviceSpec::of(&train_device) {
                    train_device
                } else {
                    spec.open()?
                };
                Some(Place { device, dtype })
            }
        };
        Ok(StepPlaces { train, rollout })
    }

    /// The distinct machines to measure, each with the phases it serves.
    fn machines(&self) -> Vec<(Place, Vec<Phase>)> {
        let trainer_phases = vec![
            Phase::OldLogp,
            Phase::UpdateForward,
            Phase::UpdateBackward,
            Phase::Optimiser,
        ];
        let mut out = vec![(self.train.clone(), trainer_phases)];
        if let Some(rollout) = &self.rollout {
            match out.iter_mut().find(|(p, _)| p.same_machine(rollout)) {
                Some((_, phases)) => phases.insert(0, Phase::Rollout),
                None => out.insert(0, (rollout.clone(), vec![Phase::Rollout])),
            }
            // The weights cross within one device: held to its bandwidth. Between two
            // devices they cross a link nothing here measures.
            if rollout.device.same_device(&self.train.device) {
                if let Some((_, phases)) = out.iter_mut().find(|(p, _)| p.same_machine(&self.train))
                {
                    phases.push(Phase::WeightSync);
                }
            }
        }
        out
    }
}

/// Each phase's machine, in [`PHASES`] order: the measurement of the machine serving it, or
/// none.
fn phase_machines(
    measured: &[(Vec<Phase>, MachineLimits)],
) -> [Option<MachineLimits>; PHASES.len()] {
    let mut out = [None; PHASES.len()];
    for (slot, phase) in out.iter_mut().zip(PHASES) {
        *slot = measured
            .iter()
            .find(|(phases, _)| phases.contains(&phase))
            .map(|(_, m)| *m);
    }
    out
}

/// How the trainer holds one variable, for the bytes its passes move.
#[derive(Debug, Clone, Copy, PartialEq)]
struct HeldVar {
    /// Values.
    elems: usize,
    /// Bytes a value of the variable (4 for an f32 master, 2 for a bf16 weight).
    value_bytes: u64,
    /// Bytes a value of its gradient as one micro-batch's backward leaves it.
    grad_bytes: u64,
    /// Bytes a value of its gradient summed over several micro-batches: 4 (f32 sums), or 2
    /// for a bf16 weight with `train.grad_accum_dtype = "bf16"`.
    summed_grad_bytes: u64,
    /// Whether a 16-bit copy is held beside it (read by the GEMMs, rewritten by AdamW).
    copied: bool,
}

/// The bytes a trainer's passes move ([`trainer_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq)]
struct TrainerBytes {
    /// One training forward's weight reads.
    forward: f64,
    /// One optimiser step after an update of one micro-batch.
    optimiser: f64,
    /// One optimiser step after an update of several micro-batches (gradient sums).
    summed_optimiser: f64,
    /// The weight sync.
    sync: f64,
}

/// The bytes a trainer's passes move, from how it holds its variables: a forward reads each
/// matrix once in the format its GEMMs read (the 16-bit copy or weight, else the variable);
/// the optimiser's step reads every gradient for the norm, then AdamW reads and writes the
/// variable and both moments (`moment_bytes` a value each), reads the gradient and writes
/// the copy (`optimiser_bytes`), the gradient as one micro-batch leaves it or as several
/// sum it; the sync reads each variable once and writes it at `rollout_bytes` a value.
fn trainer_bytes(vars: &[HeldVar], moment_bytes: u64, rollout_bytes: f64) -> TrainerBytes {
    let mut out = TrainerBytes {
        forward: 0.0,
        optimiser: 0.0,
        summed_optimiser: 0.0,
        sync: 0.0,
    };
    for v in vars {
        let n = v.elems as f64;
        out.forward += n * if v.copied { 2.0 } else { v.value_bytes as f64 };
        let step = |grad_bytes| {
            let bytes = optimiser_bytes(
                v.elems,
                grad_bytes,
                if v.copied { v.elems } else { 0 },
                if v.value_bytes == 2 { v.elems } else { 0 },
                moment_bytes,
            );
            (bytes.adamw + bytes.grad_norm) as f64
        };
        out.optimiser += step(v.grad_bytes);
        out.summed_optimiser += step(v.summed_grad_bytes);
        out.sync += n * (v.value_bytes as f64 + rollout_bytes);
    }
    out
}

/// [`HeldVar`]s of `trainer`'s policy: its variables' dtypes, its held 16-bit copies, and
/// the gradients' dtype — a 16-bit variable's own, a 16-bit forward's matrices' in bf16
/// with `train.narrow_gradients` (counted for every matrix; the few f32 sums the backward
/// hands back are not told apart here), f32 otherwise; summed over micro-batches, f32
/// unless a bf16 variable's sums are kept in bf16 (`train.grad_accum_dtype`).
fn held_vars(trainer: &Trainer) -> anyhow::Result<Vec<HeldVar>> {
    let copies = trainer.policy.detached();
    let copies = copies.narrow_copies();
    let narrow_grads =
        trainer.cfg.train.narrow_gradients && trainer.policy.precision().narrow_dtype().is_some();
    let bf16_sums = trainer.cfg.train.bf16_gradient_sums()?;
    Ok(trainer
        .policy
        .vars()
        .iter()
        .map(|(name, var)| {
            let value_bytes = var.dtype().size_in_bytes() as u64;
            let matrix = var.rank() >= 2;
            HeldVar {
                elems: var.elem_count(),
                value_bytes,
                grad_bytes: if value_bytes == 2 || (narrow_grads && matrix) {
                    2
                } else {
                    4
                },
                summed_grad_bytes: if bf16_sums && var.dtype() == DType::BF16 {
                    2
                } else {
                    4
                },
                copied: copies.contains_key(name),
            }
        })
        .collect())
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
    let source = cfg.model_dir.display().to_string();
    let rollout_weight_bytes = match cfg.rollout.dtype.as_str() {
        "f32" => 4.0,
        _ => 2.0,
    };
    let moment_bytes = cfg.optim.moment_dtype()?.size_in_bytes() as u64;
    let (mut trainer, model_name) = match args.model.as_str() {
        "config" => (Trainer::new(cfg).context("building the trainer")?, source),
        preset => {
            let device = cfg.train.device_spec()?.open()?;
            anyhow::ensure!(
                preset != "a3b-8l" || !device.is_cpu(),
                "--model a3b-8l is a GPU's size (≈ 5.0 B parameters, 20 GB in f32 before \
                 gradients and moments): train it with --set train.device=cuda"
            );
            let (model_cfg, weights) = preset_model(preset, &cfg.model_dir, cfg.seed, &device)?;
            let tokenizer = ModelText::from_model_dir(&cfg.model_dir)?;
            let trainer = Trainer::with_model(cfg, model_cfg, weights, tokenizer)
                .context("building the trainer")?;
            let name = match preset {
                "a3b-8l" => "Qwen3-30B-A3B's layer shape, 8 layers",
                _ => "mid-size bench config",
            };
            (
                trainer,
                format!("{name}, random weights, tokenizer and vocabulary of {source}"),
            )
        }
    };
    let model_cfg = trainer.policy.config().clone();
    let held = held_vars(&trainer)?;
    let params: usize = held.iter().map(|v| v.elems).sum();
    let bytes = trainer_bytes(&held, moment_bytes, rollout_weight_bytes);
    let facts = ModelFacts {
        cfg: &model_cfg,
        params: params as f64,
        rollout_weight_bytes,
        forward_weight_bytes: bytes.forward,
        optimiser_bytes: bytes.optimiser,
        summed_optimiser_bytes: bytes.summed_optimiser,
        micro_batches: MicroBatching {
            max_tokens: trainer.cfg.algo.max_tokens_per_micro_batch,
            share_prefixes: trainer.cfg.algo.share_prefixes,
        },
        sync_bytes: bytes.sync,
        shared_queries_run: !trainer.policy.device().is_cpu(),
    };
    let threads = machine_threads();
    let places = StepPlaces::of(&trainer)?;
    let machines = places.machines();
    let before = machines
        .iter()
        .map(|(place, _)| MachineLimits::measure_on(&place.device, place.dtype, threads))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let train_device = trainer.policy.device();

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
    let after = machines
        .iter()
        .map(|(place, _)| MachineLimits::measure_on(&place.device, place.dtype, threads))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let measured: Vec<(Vec<Phase>, MachineLimits)> = machines
        .iter()
        .zip(before.iter().zip(&after))
        .map(|((_, phases), (b, a))| (phases.clone(), b.highest(*a)))
        .collect();
    // The training machine's limits are the JSON's top-level figures (as before GPUs).
    let train_machine = measured
        .iter()
        .find(|(phases, _)| phases.contains(&Phase::UpdateForward))
        .map(|(_, m)| *m)
        .context("the trainer's machine was measured")?;
    let (rows, step) = summarise(&samples, &phase_machines(&measured));
    // On a GPU: its tensors' high-water mark over a step (the highest of the steps').
    let device_peak_mib = samples
        .iter()
        .filter_map(|s| s.metrics.device_peak_mib)
        .reduce(f64::max);
    let machine_lines: Vec<String> = machines
        .iter()
        .zip(before.iter().zip(&after))
        .map(|((place, phases), (b, a))| {
            let serves: Vec<&str> = phases.iter().map(|p| p.name()).collect();
            format!(
                "  {} {:.1} / {:.1} GFLOP/s, streaming bandwidth {:.1} / {:.1} GB/s — {}",
                place.label(threads),
                b.peak_gflops,
                a.peak_gflops,
                b.bandwidth_gbs,
                a.bandwidth_gbs,
                serves.join(", ")
            )
        })
        .collect();
    let machines_json: Vec<serde_json::Value> = machines
        .iter()
        .zip(&measured)
        .zip(before.iter().zip(&after))
        .map(|(((place, phases), (_, best)), (b, a))| {
            serde_json::json!({
                "device": DeviceSpec::of(&place.device).to_string(),
                "gemm_dtype": place.gemm_dtype(),
                "gemm_peak_gflops": best.peak_gflops,
                "bandwidth_gbs": best.bandwidth_gbs,
                "gemm_peak_gflops_before_after": [b.peak_gflops, a.peak_gflops],
                "bandwidth_gbs_before_after": [b.bandwidth_gbs, a.bandwidth_gbs],
                "phases": phases.iter().map(|p| p.name()).collect::<Vec<_>>(),
            })
        })
        .collect();
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
            "train_device": DeviceSpec::of(&train_device).to_string(),
            "gemm_peak_gflops": train_machine.peak_gflops,
            "stream_bandwidth_gbs": train_machine.bandwidth_gbs,
            "machines": machines_json,
            "device_peak_mib": device_peak_mib,
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
    println!("machines, measured before and after the steps (the better counts), and the phases each one's limits hold:");
    for line in &machine_lines {
        println!("{line}");
    }
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
            "{:<16} {:>9.4} {:>6.1}% {:>9} {:>8.3} {:>9} {:>9} {:>9} {:>9}",
            r.name,
            r.seconds,
            r.share_pct,
            fmt_opt(r.flops, |f| format!("{:.2}", f / 1e9)),
            r.bytes / 1e9,
            fmt_opt(rate, |v| format!("{v:.1}")),
            fmt_opt(r.limit_s, |l| format!("{l:.4}")),
            fmt_opt(r.of_limit_pct(), |p| format!("{p:.1}%")),
            fmt_opt(r.peak_mib, |m| format!("{m:.0}")),
        );
    }
    println!(
        "time: median per phase; share: of the phases' sum; limit: min(GEMM peak, bandwidth × FLOP/byte) for the phase's work on its machine \
         (-: a machine not measured, as a fleet's or the link weights cross between two devices); \
         of limit: limit s / time s; peak: the process's resident high-water mark (the update's three parts share one)"
    );
    if let Some(mib) = device_peak_mib {
        println!(
            "{}: its tensors' high-water mark over a step {mib:.0} MiB (the memory pool's, as torch's max_memory_allocated)",
            DeviceSpec::of(&train_device)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::train::resolve_config;

    /// By hand: an f32 matrix of 10 with a bf16 copy and bf16 gradients (summed in f32), an
    /// f32 vector of 4, a bf16 matrix of 6 (summed in bf16); f32 moments, an f16 rollout.
    #[test]
    fn a_trainers_bytes_by_hand() {
        let vars = [
            HeldVar {
                elems: 10,
                value_bytes: 4,
                grad_bytes: 2,
                summed_grad_bytes: 4,
                copied: true,
            },
            HeldVar {
                elems: 4,
                value_bytes: 4,
                grad_bytes: 4,
                summed_grad_bytes: 4,
                copied: false,
            },
            HeldVar {
                elems: 6,
                value_bytes: 2,
                grad_bytes: 2,
                summed_grad_bytes: 2,
                copied: false,
            },
        ];
        let TrainerBytes {
            forward,
            optimiser,
            summed_optimiser,
            sync,
        } = trainer_bytes(&vars, 4, 2.0);
        // The copy (2), the f32 vector (4), the bf16 matrix (2).
        assert_eq!(forward, 10.0 * 2.0 + 4.0 * 4.0 + 6.0 * 2.0);
        // Per value: θ read and written, m and v read and written, the gradient read twice
        // (norm, AdamW), the copy written.
        let matrix = 10.0 * (2.0 * 4.0 + 4.0 * 4.0 + 2.0 * 2.0 + 2.0);
        let vector = 4.0 * (2.0 * 4.0 + 4.0 * 4.0 + 2.0 * 4.0);
        let narrow = 6.0 * (2.0 * 2.0 + 4.0 * 4.0 + 2.0 * 2.0);
        assert_eq!(optimiser, matrix + vector + narrow);
        // Summed over micro-batches the matrix's gradient is read in f32, twice.
        assert_eq!(summed_optimiser, optimiser + 10.0 * 2.0 * 2.0);
        assert_eq!(sync, 10.0 * 6.0 + 4.0 * 6.0 + 6.0 * 4.0);
    }

    /// Every named phase is held to a machine when both engines run on the CPU; a fleet's
    /// rollout is held to none, and neither are the weights it is sent.
    #[test]
    fn the_phases_find_their_machines() {
        let cpu = |dtype| Place {
            device: Device::Cpu,
            dtype,
        };
        let local = StepPlaces {
            train: cpu(DType::BF16),
            rollout: Some(cpu(DType::F16)),
        };
        let machines = local.machines();
        assert_eq!(
            machines.len(),
            1,
            "the CPU is one machine whatever the dtype"
        );
        assert_eq!(machines[0].1, PHASES[..6].to_vec());
        let cpu_limits = MachineLimits {
            peak_gflops: 100.0,
            bandwidth_gbs: 10.0,
        };
        let measured: Vec<(Vec<Phase>, MachineLimits)> =
            machines.into_iter().map(|(_, p)| (p, cpu_limits)).collect();
        let each = phase_machines(&measured);
        assert!(each[..6].iter().all(|m| *m == Some(cpu_limits)));
        assert_eq!(each[6], None, "`other` has no machine");
        let fleet = StepPlaces {
            train: cpu(DType::F32),
            rollout: None,
        };
        let machines = fleet.machines();
        assert_eq!(machines.len(), 1);
        assert_eq!(
            machines[0].1,
            vec![
                Phase::OldLogp,
                Phase::UpdateForward,
                Phase::UpdateBackward,
                Phase::Optimiser
            ]
        );
        assert_eq!(
            phase_machines(&[(machines[0].1.clone(), cpu_limits)])[0],
            None
        );
    }

    fn default_task_trainer(sets: &[&str], tag: &str) -> Trainer {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let mut cfg = resolve_config(None, &sets).expect("config");
        cfg.model_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/arith-moe");
        cfg.run_dir =
            std::env::temp_dir().join(format!("r3-held-vars-{tag}-{}", std::process::id()));
        Trainer::new(cfg).expect("trainer")
    }

    /// The default task's trainer in bf16 with held copies and narrow gradients: every copy
    /// the policy holds is found under its variable's name, and only matrices are copied;
    /// the f32 masters' sums over micro-batches are f32.
    #[test]
    fn held_vars_find_every_copy_the_policy_holds() {
        let trainer = default_task_trainer(
            &[
                "train.dtype=bf16",
                "train.narrow_weight_copies=on",
                "train.narrow_gradients=true",
                "rollout.prompts_per_step=1",
            ],
            "copies",
        );
        let held = held_vars(&trainer).expect("held");
        let copies = trainer.policy.detached().narrow_copies().len();
        assert!(copies > 0, "bf16 with copies on holds some");
        assert_eq!(held.iter().filter(|v| v.copied).count(), copies);
        for (v, (name, var)) in held.iter().zip(trainer.policy.vars()) {
            assert_eq!(v.elems, var.elem_count(), "{name}");
            assert_eq!(v.value_bytes, 4, "{name}: f32 masters");
            assert!(!v.copied || var.rank() >= 2, "{name}: a copied vector");
            assert_eq!(v.grad_bytes, if var.rank() >= 2 { 2 } else { 4 }, "{name}");
            assert_eq!(v.summed_grad_bytes, 4, "{name}: f32 sums");
        }
        let _ = std::fs::remove_dir_all(&trainer.cfg.run_dir);
    }

    /// bf16 weights without masters: their gradients are bf16, and so are their sums over
    /// micro-batches with `train.grad_accum_dtype = "bf16"`, f32 without; the f32 norm
    /// scales' sums stay f32 either way.
    #[test]
    fn held_vars_follow_the_gradient_sums_dtype() {
        for (sums, bf16_sum_bytes) in [("f32", 4), ("bf16", 2)] {
            let accum = format!("train.grad_accum_dtype={sums}");
            let trainer = default_task_trainer(
                &[
                    "train.dtype=bf16",
                    "train.master_weights=bf16",
                    &accum,
                    "rollout.prompts_per_step=1",
                ],
                sums,
            );
            let held = held_vars(&trainer).expect("held");
            let mut narrow = 0;
            for (v, (name, var)) in held.iter().zip(trainer.policy.vars()) {
                let bf16 = var.dtype() == DType::BF16;
                narrow += usize::from(bf16);
                assert_eq!(v.value_bytes, if bf16 { 2 } else { 4 }, "{name}");
                assert_eq!(v.grad_bytes, if bf16 { 2 } else { 4 }, "{name}");
                let want = if bf16 { bf16_sum_bytes } else { 4 };
                assert_eq!(v.summed_grad_bytes, want, "{name}: {sums} sums");
            }
            assert!(narrow > 0, "bf16 masters hold bf16 variables");
            let _ = std::fs::remove_dir_all(&trainer.cfg.run_dir);
        }
    }
}
