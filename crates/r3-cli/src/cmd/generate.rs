//! `r3 generate`: one request through the rollout engine; prints JSON with the output ids,
//! their log-probs (as SGLang reports them: under the distribution each token was sampled
//! from, `log softmax(logits / T)`, or at temperature 1 when greedy or with
//! `--return-original-logprob`; `logprob_definition` says which) and the captured routes in r3's
//! canonical route JSON. The prompt is token ids, or text / chat messages tokenized with the
//! model's tokenizer and chat template (r3-text, as `r3 serve` does); then the output text
//! is printed too.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use r3_model::LoadOptions;
use r3_rollout::{
    Dtype, EngineConfig, GenerateRequest, LogprobScale, RolloutDevice, RolloutEngine, RouterDtype,
    SamplingParams,
};
use r3_text::{ChatMessage, ChatTemplate, RenderOptions, TextTokenizer};

/// Arguments of `r3 generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// HF model directory (config.json + safetensors; a tokenizer.json there must fit the
    /// model's vocabulary).
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt token ids, comma separated (e.g. `1,2,3`).
    #[arg(long, value_delimiter = ',', required_unless_present_any = ["text", "messages"], conflicts_with_all = ["text", "messages"])]
    pub input_ids: Vec<u32>,
    /// Prompt text, tokenized with the model's tokenizer (special tokens added as its
    /// tokenizer_config.json says, like transformers' `tokenizer(text)`).
    #[arg(long, conflicts_with = "messages")]
    pub text: Option<String>,
    /// A JSON file holding a list of `{"role", "content"}` messages, rendered with the model's
    /// chat template and an assistant generation prompt.
    #[arg(long)]
    pub messages: Option<PathBuf>,
    /// Extra chat-template variables as a JSON object (e.g. `{"enable_thinking": false}`).
    #[arg(long, requires = "messages")]
    pub chat_template_kwargs: Option<String>,
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
    /// Stop token ids, comma separated (the model's eos is not added implicitly for
    /// `--input-ids`; with `--text` / `--messages` the tokenizer's stop ids are added).
    #[arg(long, value_delimiter = ',')]
    pub stop_token_ids: Vec<u32>,
    /// RNG seed of the request.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Compute precision: f16 (fast), bf16 (weights and activations at the boundaries a bf16
    /// SGLang / vLLM engine keeps in bf16) or f32 (reproduces HF).
    #[arg(long, default_value = "f16")]
    pub dtype: String,
    /// MoE router precision: the model dtype (`model`, or `--dtype`'s own name) or `f32`;
    /// another dtype's name is refused.
    #[arg(long, default_value = "model")]
    pub router_dtype: String,
    /// First position whose routes are returned.
    #[arg(long, default_value_t = 0)]
    pub routes_start_len: usize,
    /// Which engine generates, and where: `cpu` (the CPU engine), `cpu-candle` (the device
    /// engine on the CPU), `cuda` / `cuda:N` (the device engine on a GPU; needs a build
    /// with the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    pub device: RolloutDevice,
    /// Report the log-probs at temperature 1, `log softmax(logits)`, whatever
    /// `--temperature` (SGLang's `SGLANG_RETURN_ORIGINAL_LOGPROB`, `r3 serve`'s flag of the
    /// same name); without it a sampled request's are `log softmax(logits / T)`.
    #[arg(long)]
    pub return_original_logprob: bool,
    /// Load weights holding NaN or inf, or values past the `--dtype` range (65504 for f16),
    /// instead of refusing them (for inspecting a broken checkpoint).
    #[arg(long)]
    pub allow_non_finite_weights: bool,
}

/// Runs `r3 generate`.
pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let dtype: Dtype = a.dtype.parse()?;
    let router_dtype = RouterDtype::parse_for(&a.router_dtype, dtype)
        .map_err(|e| anyhow::anyhow!("--router-dtype {}: {e}", a.router_dtype))?;
    let cfg = EngineConfig {
        dtype,
        router_dtype,
        prefix_cache: false,
        ..EngineConfig::default()
    };
    // The engine sets the precision the weights are checked against (its dtype).
    let load = LoadOptions {
        allow_non_finite: a.allow_non_finite_weights,
        ..LoadOptions::default()
    };
    let mut engine = RolloutEngine::from_dir_with(a.device, &a.model, cfg, &load)
        .with_context(|| format!("loading model from {}", a.model.display()))?;
    let mut stop_token_ids = a.stop_token_ids.clone();
    let tokenizer = super::model_tokenizer(&a.model, engine.model_config().vocab_size)?;
    let (input_ids, tokenizer) = prompt_ids(&a, tokenizer)?;
    if let Some(tok) = &tokenizer {
        stop_token_ids.extend(tok.stop_token_ids().iter().copied());
    }
    let req = GenerateRequest {
        input_ids,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k,
            max_new_tokens: a.max_new_tokens,
            stop_token_ids,
            seed: a.seed,
            logprob_scale: if a.return_original_logprob {
                LogprobScale::Raw
            } else {
                LogprobScale::Sampling
            },
            ..SamplingParams::default()
        },
        return_routes: true,
        routed_experts_start_len: a.routes_start_len,
    };
    let logprob_definition = logprob_definition(&req.sampling);
    let result = engine
        .generate(vec![req])?
        .pop()
        .context("the engine returned no result")?;
    let text = match &tokenizer {
        Some(tok) => Some(tok.decode(&result.output_ids, true)?),
        None => None,
    };
    let out = serde_json::json!({
        "text": text,
        "output_ids": result.output_ids,
        "logprobs": result.output_logprobs,
        "logprob_definition": logprob_definition,
        "finish_reason": result.finish,
        "prompt_tokens": result.prompt_tokens,
        "dtype": dtype.to_string(),
        "device": a.device.to_string(),
        "weight_version": result.weight_version,
        "routes": result.routes.map(|r| r.to_json()),
    });
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

/// The prompt ids of the request, with the model's tokenizer when text or messages were
/// given (`tokenizer`: the directory's, already checked against the model).
fn prompt_ids(
    a: &GenerateArgs,
    tokenizer: Option<TextTokenizer>,
) -> anyhow::Result<(Vec<u32>, Option<TextTokenizer>)> {
    if a.text.is_none() && a.messages.is_none() {
        return Ok((a.input_ids.clone(), None));
    }
    let tok = match tokenizer {
        Some(tok) => tok,
        // No tokenizer.json: r3-text's own error names the directory.
        None => TextTokenizer::from_model_dir(&a.model)?,
    };
    if let Some(text) = &a.text {
        let ids = tok.encode(text, true)?;
        return Ok((ids, Some(tok)));
    }
    let path = a.messages.as_ref().context("--messages is required here")?;
    let raw =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let messages: Vec<ChatMessage> = serde_json::from_str(&raw).with_context(|| {
        format!(
            "{}: expected a JSON list of {{\"role\", \"content\"}} messages",
            path.display()
        )
    })?;
    let kwargs = match &a.chat_template_kwargs {
        Some(s) => {
            serde_json::from_str(s).context("--chat-template-kwargs must be a JSON object")?
        }
        None => serde_json::Map::new(),
    };
    let template = ChatTemplate::from_model_dir(&a.model)?.with_context(|| {
        format!(
            "{} has no chat template (chat_template in tokenizer_config.json or chat_template.jinja)",
            a.model.display()
        )
    })?;
    let opts = RenderOptions {
        add_generation_prompt: true,
        kwargs,
        ..RenderOptions::default()
    };
    let prompt = template.render(&messages, &opts)?;
    let ids = tok.encode(&prompt, false)?;
    Ok((ids, Some(tok)))
}

/// What the reported log-probs of a request sampled by `sampling` are, in words: the
/// distribution `SamplingParams::logprob_inv_temperature` names.
fn logprob_definition(sampling: &SamplingParams) -> String {
    let inv_t = sampling.logprob_inv_temperature();
    if inv_t != 1.0 {
        format!(
            "log softmax(logits / {})[token]: the distribution the token was sampled from at \
             temperature {} (before top-k/top-p), as SGLang reports it by default",
            sampling.temperature, sampling.temperature
        )
    } else if sampling.logprob_scale == LogprobScale::Raw {
        "log softmax(logits)[token]: the raw model distribution (temperature 1, before \
         top-k/top-p), as SGLang reports it with SGLANG_RETURN_ORIGINAL_LOGPROB"
            .into()
    } else {
        "log softmax(logits)[token]: the raw model distribution (temperature 1, before \
         top-k/top-p; greedy or temperature-1 sampling)"
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition follows the temperature and the scale.
    #[test]
    fn the_definition_names_the_reported_distribution() {
        let at = |temperature: f32, logprob_scale: LogprobScale| SamplingParams {
            temperature,
            logprob_scale,
            ..SamplingParams::default()
        };
        let d = logprob_definition(&at(0.7, LogprobScale::Sampling));
        assert!(d.starts_with("log softmax(logits / 0.7)"), "{d}");
        let d = logprob_definition(&at(0.7, LogprobScale::Raw));
        assert!(
            d.starts_with("log softmax(logits)[token]") && d.contains("ORIGINAL"),
            "{d}"
        );
        let d = logprob_definition(&at(0.0, LogprobScale::Sampling));
        assert!(
            d.starts_with("log softmax(logits)[token]") && d.contains("greedy"),
            "{d}"
        );
    }
}
