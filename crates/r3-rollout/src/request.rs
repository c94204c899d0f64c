//! Request and result types of the engine's public API.

use r3_routing::RouteTable;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::sampler::SamplingParams;

/// Engine-assigned id of a submitted request.
pub type RequestId = u64;

/// One generation request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Prompt token ids (non-empty, each below the vocabulary size).
    pub input_ids: Vec<u32>,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Capture and return the routed experts of every position from `routed_experts_start_len`.
    pub return_routes: bool,
    /// First absolute position whose route row is returned (SGLang `routed_experts_start_len`).
    pub routed_experts_start_len: usize,
}

impl GenerateRequest {
    /// A request with routes returned from position 0.
    pub fn new(input_ids: Vec<u32>, sampling: SamplingParams) -> Self {
        GenerateRequest {
            input_ids,
            sampling,
            return_routes: true,
            routed_experts_start_len: 0,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum FinishReason {
    /// `max_new_tokens` reached (or the model's maximum context).
    Length,
    /// A stop token was sampled (it is the last output id).
    Stop {
        /// the stop token
        token: u32,
    },
    /// Aborted by the caller.
    Abort,
    /// The output text reached one of the request's stop strings (set by the server, which
    /// owns the tokenizer).
    StopString,
}

/// Log-probs of prompt tokens (SGLang `input_token_logprobs`) under the raw model
/// distribution (temperature 1), f32.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptLogprobs {
    /// First reported prompt position; it has no log-prob (SGLang reports null there).
    pub start: usize,
    /// `log softmax(logits[p - 1])[token p]` for positions `p = start + 1 ..` the prompt end.
    pub logprobs: Vec<f32>,
    /// The `sampling.top_logprobs` most likely `(token, log-prob)` at those positions, or
    /// empty when not asked for.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
}

/// The outcome of one request.
#[derive(Debug, Clone)]
pub struct GenerateResult {
    /// The id `submit` returned.
    pub id: RequestId,
    /// Prompt length (for a resumed request: the original prompt).
    pub prompt_tokens: usize,
    /// Generated token ids (for a resumed request: all of them, earlier call first).
    pub output_ids: Vec<u32>,
    /// The log-prob of each output id under the distribution `sampling.logprob_scale` names
    /// (before top-k / top-p / min-p): `log softmax(l / T)[token]` for a sampled request under
    /// `LogprobScale::Sampling`, `log softmax(l)[token]` under `LogprobScale::Raw` or for a
    /// greedy one, `l` the logits after penalties and bias; f32.
    pub output_logprobs: Vec<f32>,
    /// The `sampling.top_logprobs` most likely `(token, log-prob)` at each output position
    /// (the same distribution as `output_logprobs`), or empty when not asked for.
    pub output_top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Prompt log-probs (of the original prompt), when `sampling.prompt_logprobs_from` asked.
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// Why generation ended.
    pub finish: FinishReason,
    /// Prompt tokens whose KV and routes came from the prefix cache (last call).
    pub cached_tokens: usize,
    /// Routes of positions `[routed_experts_start_len, prompt + output - 1)`: MoE-only layer
    /// space, global layer indices, logical expert ids, one weight version per row.
    /// `None` unless `return_routes` (or for a dense model).
    pub routes: Option<RouteTable>,
    /// Weight version when the request finished.
    pub weight_version: u64,
}

/// An aborted request, resumable with [`crate::Engine::resume`].
#[derive(Debug, Clone)]
pub struct PartialRollout {
    /// The original request.
    pub request: GenerateRequest,
    /// Tokens generated before the abort.
    pub output_ids: Vec<u32>,
    /// Their log-probs (under the weights that produced them).
    pub output_logprobs: Vec<f32>,
    /// Their most likely alternatives (when asked for).
    pub output_top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Prompt log-probs computed before the abort (possibly fewer than asked for).
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// Routes captured so far (positions fed to the model before the abort).
    pub routes: Option<RouteTable>,
    /// Sampler state, so a resumed request continues the same random stream.
    pub rng: ChaCha8Rng,
    /// Weight version at the abort.
    pub weight_version: u64,
    /// Prompt tokens its prefill took from the prefix cache (the result's `cached_tokens`;
    /// 0 before a prefill), so an aborted or stop-string-ended answer reports them.
    pub cached_tokens: usize,
}

impl PartialRollout {
    /// What an aborted request that sampled nothing made: nothing — no tokens, no prompt
    /// log-probs, no routes (its continuation feeds the whole prompt again and captures its
    /// routes from `routed_experts_start_len` itself) — with its sampler stream untouched.
    pub fn unsampled(request: GenerateRequest, rng: ChaCha8Rng, weight_version: u64) -> Self {
        PartialRollout {
            request,
            output_ids: Vec::new(),
            output_logprobs: Vec::new(),
            output_top_logprobs: Vec::new(),
            prompt_logprobs: None,
            routes: None,
            rng,
            weight_version,
            cached_tokens: 0,
        }
    }

    /// What an aborted request of the original request `request` made: the result its row
    /// or sequence gave at the abort (a resumed call's already completed with the call it
    /// continues), the sampler stream where it stopped and the weight version then.
    pub fn from_result(
        request: GenerateRequest,
        result: GenerateResult,
        rng: ChaCha8Rng,
        weight_version: u64,
    ) -> Self {
        PartialRollout {
            request,
            output_ids: result.output_ids,
            output_logprobs: result.output_logprobs,
            output_top_logprobs: result.output_top_logprobs,
            prompt_logprobs: result.prompt_logprobs,
            routes: result.routes,
            rng,
            weight_version,
            cached_tokens: result.cached_tokens,
        }
    }
}
