//! `r3 pretrain`: supervised next-token training of the small Qwen3-MoE-style base model
//! on worked arithmetic solutions or GSM8K-format word problems (with a BPE tokenizer and a
//! ChatML template trained first); writes an HF-layout checkpoint (`config.json`,
//! `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` for a BPE, `pretrain.json`).

use std::path::PathBuf;

use clap::Args;
use r3_train::{pretrain, PretrainConfig, PretrainEvent};

use super::progress::{step_bar, STEP_TEMPLATE};

/// Arguments of `r3 pretrain`.
#[derive(Debug, Args)]
pub struct PretrainArgs {
    /// TOML config (defaults: the documented values of `configs/pretrain.toml`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Output directory (overrides `out_dir`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Override one config key, e.g. `--set steps=500` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// No progress bar (logs only).
    #[arg(long)]
    pub no_progress: bool,
}

/// Runs `r3 pretrain`.
pub fn run(a: PretrainArgs) -> anyhow::Result<()> {
    let mut cfg = PretrainConfig::resolve(a.config.as_deref(), &a.set)?;
    if let Some(out) = a.out {
        cfg.out_dir = out;
    }
    tracing::info!(out = %cfg.out_dir.display(), steps = cfg.steps, "pretraining");
    let bar = step_bar(cfg.steps, a.no_progress, STEP_TEMPLATE)?;
    let mut loss_sum = 0.0f64;
    let mut loss_n = 0u64;
    let log_every = cfg.log_every.max(1);
    let report = pretrain(&cfg, &mut |event| match event {
        PretrainEvent::Step { step, loss, .. } => {
            bar.set_position(step);
            loss_sum += f64::from(loss);
            loss_n += 1;
            if step % log_every == 0 {
                let mean = loss_sum / loss_n as f64;
                bar.set_message(format!("loss {mean:.4}"));
                tracing::debug!(step, loss = mean, "pretrain");
                loss_sum = 0.0;
                loss_n = 0;
            }
        }
        PretrainEvent::Eval { step, result } => {
            // Logged rather than `bar.println`, which prints nothing when the bar is hidden
            // (`--no-progress`, or stderr not a terminal).
            bar.suspend(|| {
                tracing::info!(
                    step,
                    accuracy = result.accuracy,
                    response_len_mean = result.response_len_mean,
                    "eval"
                )
            });
        }
    })?;
    bar.finish();
    println!(
        "{}",
        serde_json::json!({
            "out_dir": cfg.out_dir,
            "steps": report.steps,
            "wall_s": report.wall_s,
            "final_loss": report.final_loss,
            "evals": report.evals,
        })
    );
    Ok(())
}
