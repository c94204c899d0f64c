//! The sampling fields OpenAI's `/v1/completions` and `/v1/chat/completions` bodies share
//! (with the SGLang / vLLM extensions r3 implements), and their translation into the
//! native [`SamplingBody`]: one place, so the two endpoints cannot drift apart.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use super::sampling::SamplingBody;

/// Sampling fields of an OpenAI-style body (flattened into the endpoint's body).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct OpenAiSampling {
    /// Softmax temperature (default 1).
    pub temperature: Option<f32>,
    /// Nucleus mass (default 1).
    pub top_p: Option<f32>,
    /// Top-k cut (extension; -1 or 0 = off).
    pub top_k: Option<i64>,
    /// Min-p cut (extension).
    pub min_p: Option<f32>,
    /// Stop ids cannot be sampled before this many tokens (extension).
    pub min_tokens: Option<usize>,
    /// Base seed; choice `i` of a prompt samples with `seed + i`. Without one every choice
    /// draws its own server seed (so a batch repeating a prompt gets different samples).
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<Value>,
    /// Stop after these ids (extension, as vLLM / SGLang).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep the matched stop string in the text (extension).
    pub no_stop_trim: Option<bool>,
    /// Do not stop at `eos_token_id` (extension).
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
