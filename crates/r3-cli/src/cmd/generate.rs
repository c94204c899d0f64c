//! `r3 generate`: one request through the rollout engine; prints JSON with the output ids,
//! their log-probs (raw model distribution, temperature 1) and the captured routes in r3's
//! canonical route JSON.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use r3_model::LoadOptions;
use r3_rollout::{Dtype, Engine, EngineConfig, GenerateRequest, SamplingParams};

/// Arguments of `r3 generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// HF model directory (config.json + safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt token ids, comma separated (e.g. `1,2,3`).
    #[arg(long, value_delimiter = ',', required = true)]
    pub input_ids: Vec<u32>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 16)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Top-k truncation (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Stop token ids, comma separated (the model's eos is not added implicitly).
    #[arg(long, value_delimiter = ',')]
    pub stop_token_ids: Vec<u32>,
    /// RNG seed of the request.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Matmul precision: f16 (fast) or f32 (reproduces HF).
    #[arg(long, default_value = "f16")]
    pub dtype: String,
    /// First position whose routes are returned.
    #[arg(long, default_value_t = 0)]
    pub routes_start_len: usize,
    /// Load weights holding NaN or inf instead of refusing them (for inspecting a broken
    /// checkpoint).
    #[arg(long)]
    pub allow_non_finite_weights: bool,
}

/// Runs `r3 generate`.
pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let dtype: Dtype = a.dtype.parse()?;
    let cfg = EngineConfig {
        dtype,
        prefix_cache: false,
        ..EngineConfig::default()
    };
    let load = LoadOptions {
        allow_non_finite: a.allow_non_finite_weights,
    };
    let mut engine = Engine::from_dir_with(&a.model, cfg, &load)
        .with_context(|| format!("loading model from {}", a.model.display()))?;
    let req = GenerateRequest {
        input_ids: a.input_ids,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k,
            max_new_tokens: a.max_new_tokens,
            stop_token_ids: a.stop_token_ids,
            seed: a.seed,
            ..SamplingParams::default()
        },
        return_routes: true,
        routed_experts_start_len: a.routes_start_len,
    };
    let result = engine
        .generate(vec![req])?
        .pop()
        .context("the engine returned no result")?;
    let out = serde_json::json!({
        "output_ids": result.output_ids,
        "logprobs": result.output_logprobs,
        "logprob_definition": "log softmax(logits)[token], raw model distribution (temperature 1, before top-k/top-p)",
        "finish_reason": result.finish,
        "prompt_tokens": result.prompt_tokens,
        "dtype": dtype.to_string(),
        "weight_version": result.weight_version,
        "routes": result.routes.map(|r| r.to_json()),
    });
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}
