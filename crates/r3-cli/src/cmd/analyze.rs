//! `r3 analyze --model DIR`: the training–inference mismatch of an MoE model (paper Section
//! 3): rollouts (f16 or bf16), training passes (f32 or bf16) natively and with R3 replay, a
//! dense reference, two training passes compared, written as summary.json, summary.md and
//! PNGs; `--grid` runs every precision pair and writes grid.json / grid.md.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use r3_analysis::mismatch::grid::{run_grid, GRID_JSON};
use r3_analysis::mismatch::{run_analysis, AnalyzeOptions, SUMMARY_JSON};
use r3_model::{DeviceSpec, Precision};
use r3_rollout::sampler::GREEDY_TEMPERATURE;
use r3_rollout::{Dtype, RolloutDevice, RouterDtype};

/// Options of `r3 analyze`.
#[derive(Debug, Args)]
pub struct AnalyzeArgs {
    /// MoE checkpoint directory (config.json, model.safetensors, optional tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// Dense checkpoint for the reference point (default: a dense model of the same active
    /// size with seeded random weights).
    #[arg(long)]
    pub dense_model: Option<PathBuf>,
    /// Prompts to roll out (one completion each).
    #[arg(long, default_value_t = 64)]
    pub prompts: usize,
    /// Most tokens generated per prompt.
    #[arg(long, default_value_t = 48)]
    pub max_new_tokens: usize,
    /// Rollout sampling temperature (1 = the raw distribution, as RL samples).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Arithmetic difficulty level (1–5) when the model has r3's tokenizer.
    #[arg(long, default_value_t = 3)]
    pub level: u32,
    /// Sequences per training forward call.
    #[arg(long, default_value_t = 16)]
    pub micro_batch: usize,
    /// Token budget of one training forward call (sequences × the longest, prompt +
    /// output): a call past it is cut, in order; 0 = none (as `algo.max_tokens_per_micro_batch`).
    #[arg(long, default_value_t = r3_train::config::DEFAULT_MAX_TOKENS_PER_MICRO_BATCH)]
    pub max_tokens_per_micro_batch: usize,
    /// Seed of prompts, sampling and random dense weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Rollout engine precision: f16 or bf16 (bf16 rounds activations where SGLang / vLLM
    /// keep them in bf16).
    #[arg(long, default_value = "f16")]
    pub rollout_dtype: String,
    /// Training forward precision: f32, bf16 (Megatron-style mixed precision) or f16.
    #[arg(long, default_value = "f32")]
    pub train_dtype: String,
    /// Router precision on both sides in bf16 / f16 mode: `model` (each side's own dtype) or
    /// `f32`; a dtype's name (`bf16`, `f16`) only where it is both `--rollout-dtype` and
    /// `--train-dtype` (never with `--grid`, whose cells run several dtypes).
    #[arg(long, default_value = "model")]
    pub router_dtype: String,
    /// Run the grid rollout {f16, bf16} × training {f32, bf16} × {no replay, R3} instead of
    /// one cell, then the full analysis (figures) of the bf16/bf16 cell in `OUT/bf16_bf16`.
    #[arg(long)]
    pub grid: bool,
    /// Which rollout engine generates the rollouts (MoE and dense reference), and where:
    /// `cpu` (the CPU engine), `cpu-candle` (the device engine on the CPU), `cuda` /
    /// `cuda:N` (the device engine on a GPU; needs a build with the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    pub device: RolloutDevice,
    /// Where the training passes run: `cpu`, `cuda`, `cuda:N` (default: the GPU `--device`
    /// names, else the CPU).
    #[arg(long)]
    pub train_device: Option<DeviceSpec>,
    /// Output directory for summary.json, summary.md and the PNGs.
    #[arg(long, default_value = "analysis")]
    pub out: PathBuf,
}

/// The training precision named by `--train-dtype` and `--router-dtype`.
fn train_precision(dtype: &str, router_f32: bool) -> anyhow::Result<Precision> {
    match dtype {
        "f32" => Ok(Precision::F32),
        "bf16" => Ok(Precision::Bf16 { router_f32 }),
        "f16" => Ok(Precision::F16 { router_f32 }),
        other => anyhow::bail!("--train-dtype must be f32, bf16 or f16, got {other:?}"),
    }
}

/// Whether `--router-dtype` names an f32 router. A dtype's name stands for the model dtype
/// only where every side the router runs on computes in it: the rollout engine
/// (`rollout`), the training forward (`train`) and, with `--grid`, never (its cells run f16
/// and bf16 rollouts and f32 and bf16 training), since a router named `bf16` beside another
/// dtype would silently run in that one.
fn router_f32(text: &str, rollout: Dtype, train: &str, grid: bool) -> anyhow::Result<bool> {
    match text {
        "model" => Ok(false),
        "f32" | "fp32" => Ok(true),
        "bf16" | "f16" => {
            anyhow::ensure!(
                !grid,
                "--router-dtype {text}: --grid runs f16 and bf16 rollouts and f32 and bf16 \
                 training; the router runs in the model dtype (`model`) or in f32"
            );
            anyhow::ensure!(
                text == rollout.to_string() && text == train,
                "--router-dtype {text} is not the model dtype of both sides (--rollout-dtype \
                 {rollout}, --train-dtype {train}): the router runs in the model dtype \
                 (`model`) or in f32"
            );
            Ok(false)
        }
        other => anyhow::bail!(
            "--router-dtype must be `model` (the model dtype) or `f32`, got {other:?}"
        ),
    }
}

/// `--temperature` must be a finite number of at least [`GREEDY_TEMPERATURE`]: below it
/// (SGLang's rule) the rollout engine samples greedily and reports raw log-probs, so the
/// run would not be the sampled rollout the flag names.
fn check_temperature(temperature: f32) -> anyhow::Result<()> {
    anyhow::ensure!(
        temperature.is_finite() && temperature > 0.0,
        "--temperature must be a positive number, got {temperature}"
    );
    anyhow::ensure!(
        temperature >= GREEDY_TEMPERATURE,
        "--temperature {temperature:e} is below {GREEDY_TEMPERATURE:e} (SGLang's greedy \
         threshold, _SAMPLING_EPS): the engines sample greedily there and report raw \
         log-probs; use a temperature of at least {GREEDY_TEMPERATURE:e}"
    );
    Ok(())
}

/// Runs the analysis and prints the path of summary.json on stdout.
pub fn run(a: AnalyzeArgs) -> anyhow::Result<()> {
    check_temperature(a.temperature)?;
    anyhow::ensure!(a.max_new_tokens >= 1, "--max-new-tokens must be at least 1");
    let command: Vec<String> = std::env::args().collect();
    let rollout_dtype: Dtype = a.rollout_dtype.parse()?;
    anyhow::ensure!(
        rollout_dtype != Dtype::F32,
        "--rollout-dtype must be f16 or bf16 (an f32 rollout has no precision mismatch to measure)"
    );
    let router_f32 = router_f32(&a.router_dtype, rollout_dtype, &a.train_dtype, a.grid)?;
    let rollout_router_dtype = if router_f32 {
        RouterDtype::F32
    } else {
        RouterDtype::Model
    };
    let opts = AnalyzeOptions {
        model: a.model,
        dense_model: a.dense_model,
        prompts: a.prompts,
        level: a.level,
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        micro_batch: a.micro_batch,
        max_tokens_per_micro_batch: a.max_tokens_per_micro_batch,
        seed: a.seed,
        rollout_dtype,
        rollout_router_dtype,
        train_precision: train_precision(&a.train_dtype, router_f32)?,
        rollout_device: a.device,
        // `--device cuda` alone puts the whole analysis on the GPU; `cpu-candle` is the
        // device engine's CPU check, so its training passes stay on the CPU.
        train_device: a
            .train_device
            .unwrap_or_else(|| a.device.candle().unwrap_or(DeviceSpec::Cpu)),
        out: a.out,
        command: command.join(" "),
    };
    if a.grid {
        let bf16 = Precision::Bf16 { router_f32 };
        let grid = run_grid(&opts, &[Dtype::F16, Dtype::Bf16], &[Precision::F32, bf16])
            .context("r3 analyze --grid")?;
        print!("{}", grid.to_markdown());
        let cell = AnalyzeOptions {
            rollout_dtype: Dtype::Bf16,
            train_precision: bf16,
            out: opts.out.join("bf16_bf16"),
            ..opts.clone()
        };
        run_analysis(&cell).context("r3 analyze, bf16/bf16 cell")?;
        println!("{}", opts.out.join(GRID_JSON).display());
        return Ok(());
    }
    let summary = run_analysis(&opts).context("r3 analyze")?;
    tracing::info!(
        k3_kl_native = summary.moe.native.metrics.k3_kl,
        k3_kl_r3 = summary.moe.r3.metrics.k3_kl,
        k3_kl_dense = summary.dense.native.metrics.k3_kl,
        router_diff = summary.moe.routing_divergence.summary.router_diff_fraction,
        token_diff = summary.moe.routing_divergence.summary.token_diff_fraction,
        "analysis written"
    );
    println!("{}", opts.out.join(SUMMARY_JSON).display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--router-dtype bf16` is accepted only where both sides compute in bf16; beside an f16
    /// rollout, f32 training or the grid it would run in another dtype, and is refused.
    #[test]
    fn a_named_router_dtype_must_be_both_sides_dtype() {
        assert!(!router_f32("model", Dtype::F16, "f32", true).expect("model"));
        assert!(router_f32("f32", Dtype::Bf16, "bf16", true).expect("f32"));
        assert!(!router_f32("bf16", Dtype::Bf16, "bf16", false).expect("bf16 both"));
        assert!(!router_f32("f16", Dtype::F16, "f16", false).expect("f16 both"));
        for (text, rollout, train, grid) in [
            ("bf16", Dtype::F16, "bf16", false),
            ("bf16", Dtype::Bf16, "f32", false),
            ("f16", Dtype::Bf16, "bf16", false),
            ("bf16", Dtype::Bf16, "bf16", true),
        ] {
            let err = router_f32(text, rollout, train, grid)
                .expect_err(text)
                .to_string();
            assert!(
                err.contains("--router-dtype") && err.contains("model dtype"),
                "{err}"
            );
        }
        assert!(router_f32("fp8", Dtype::Bf16, "bf16", false).is_err());
    }

    /// Below SGLang's greedy threshold 1e-6 the engines sample greedily with raw log-probs:
    /// `--temperature` there (and 0, negative, NaN) is refused naming the flag; 1e-6 and
    /// above are accepted.
    #[test]
    fn a_temperature_the_engines_sample_greedily_is_refused() {
        for t in [1e-6, 2e-6, 0.7, 1.0] {
            assert!(check_temperature(t).is_ok(), "{t}");
        }
        for t in [1e-7, 5e-7, 9.9e-7] {
            let err = check_temperature(t).expect_err("greedy band").to_string();
            assert!(
                err.contains("--temperature") && err.contains("greedily"),
                "{err}"
            );
        }
        for t in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let err = check_temperature(t).expect_err("not positive").to_string();
            assert!(err.contains("--temperature"), "{err}");
        }
    }
}
