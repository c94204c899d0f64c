//! `r3 analyze --model DIR`: the training–inference mismatch of an MoE model (paper Section
//! 3): f16 rollouts, f32 training passes natively and with R3 replay, a dense reference, two
//! training passes compared, written as summary.json, summary.md and PNGs.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use r3_analysis::mismatch::{run_analysis, AnalyzeOptions, SUMMARY_JSON};

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
    /// Seed of prompts, sampling and random dense weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory for summary.json, summary.md and the PNGs.
    #[arg(long, default_value = "analysis")]
    pub out: PathBuf,
}

/// Runs the analysis and prints the path of summary.json on stdout.
pub fn run(a: AnalyzeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.temperature.is_finite() && a.temperature > 0.0,
        "--temperature must be a positive number, got {}",
        a.temperature
    );
    anyhow::ensure!(a.max_new_tokens >= 1, "--max-new-tokens must be at least 1");
    let command: Vec<String> = std::env::args().collect();
    let opts = AnalyzeOptions {
        model: a.model,
        dense_model: a.dense_model,
        prompts: a.prompts,
        level: a.level,
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        micro_batch: a.micro_batch,
        seed: a.seed,
        out: a.out,
        command: command.join(" "),
    };
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
