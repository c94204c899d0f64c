//! The sampling fields OpenAI's `/v1/completions` and `/v1/chat/completions` bodies share
//! (with the SGLang / vLLM extensions r3 implements), their translation into the native
//! [`SamplingBody`], and what every sample of such a request reports ([`SampleOptions`]):
//! one place, so the two endpoints cannot drift apart.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;
use super::generate::start_past_prompt;
use super::openai::SampleOptions;
use super::sampling::SamplingBody;
use super::AppState;

/// Sampling fields of an OpenAI-style body (flattened into the endpoint's body).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct OpenAiSampling {
    /// Softmax temperature (default 1).
    pub temperature: Option<f32>,
    /// Nucleus mass (default 1).
    pub top_p: Option<f32>,
    /// Top-k cut (extension; -1 = off).
    pub top_k: Option<i64>,
    /// Min-p cut (extension).
    pub min_p: Option<f32>,
    /// Stop ids cannot be sampled before this many tokens (extension).
    pub min_tokens: Option<usize>,
    /// Base seed; choice `i` of a prompt samples with `seed + i`. Without one every choice
    /// draws its own server seed (so a batch repeating a prompt gets different samples). A
    /// negative one is taken as SGLang takes it ([`super::sampling::deserialize_seed`]).
    #[serde(default, deserialize_with = "super::sampling::deserialize_seed")]
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<Value>,
    /// Stop after these ids (extension, as vLLM / SGLang).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep the matched stop string in the text (extension).
    pub no_stop_trim: Option<bool>,
    /// No stop id ends the request, the model's or the request's own (extension, SGLang's
    /// `ignore_eos`).
    pub ignore_eos: Option<bool>,
    /// Skip special tokens in the text (extension, default true).
    pub skip_special_tokens: Option<bool>,
    /// OpenAI penalties (SGLang's formulas).
    pub frequency_penalty: Option<f32>,
    /// See `frequency_penalty`.
    pub presence_penalty: Option<f32>,
    /// Repetition penalty (extension).
    pub repetition_penalty: Option<f32>,
    /// Token id -> bias.
    pub logit_bias: Option<BTreeMap<String, f32>>,
}

impl OpenAiSampling {
    /// The native sampling body: at most `max_new_tokens` tokens (None: as many as the
    /// context and the server's `--max-new-tokens` leave, SGLang's rule for a chat request
    /// without `max_tokens`), stopping after `stop_token_ids`. The seed stays the client's:
    /// without one, [`super::AppState::prepare`] draws a fresh one per choice.
    pub fn to_native(
        &self,
        max_new_tokens: Option<usize>,
        stop_token_ids: Option<Vec<u32>>,
    ) -> SamplingBody {
        SamplingBody {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            max_new_tokens,
            rest_of_context: max_new_tokens.is_none(),
            min_new_tokens: self.min_tokens,
            stop_token_ids,
            stop: self.stop.clone(),
            no_stop_trim: self.no_stop_trim,
            ignore_eos: self.ignore_eos,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            repetition_penalty: self.repetition_penalty,
            logit_bias: self.logit_bias.clone(),
            n: None,
            seed: self.seed,
            sampling_seed: None,
            skip_special_tokens: self.skip_special_tokens,
        }
    }
}

/// SGLang's route fields of an OpenAI body (flattened into the endpoint's body).
#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct OpenAiRoutes {
    /// SGLang's `sglext.routed_experts` (the first choice's routes, base64 int32).
    pub return_routed_experts: Option<bool>,
    /// First position of those routes.
    pub routed_experts_start_len: Option<usize>,
}

impl OpenAiRoutes {
    /// What every sample of a request for `prompts` reports: `top_n` alternatives per token
    /// when log-probs are asked for, the prompt's log-probs with `prompt_logprobs`, and routes
    /// from `routed_experts_start_len` (default 0) when `return_routed_experts` asks for
    /// them, checked as SGLang checks them: a model with MoE layers, a start within every
    /// prompt.
    pub fn sample_options(
        &self,
        state: &AppState,
        top_n: Option<usize>,
        prompt_logprobs: bool,
        prompts: &[Vec<u32>],
    ) -> Result<SampleOptions, ApiError> {
        let mut opts = SampleOptions {
            top_n,
            prompt_logprobs,
            routes_from: None,
        };
        if !self.return_routed_experts.unwrap_or(false) {
            return Ok(opts);
        }
        if state.summary().layout.moe_layers().is_empty() {
            return Err(ApiError::bad_request(
                "return_routed_experts: the served model has no MoE layers",
            ));
        }
        let start = self.routed_experts_start_len.unwrap_or(0);
        for p in prompts {
            if let Some(message) = start_past_prompt(None, Some(start), p.len()) {
                return Err(ApiError::bad_request(message));
            }
        }
        opts.routes_from = Some(start);
        Ok(opts)
    }
}
