//! OpenAI `/v1/completions` (also streamed, see [`super::sse`]): prompts as text or token ids, `n` samples per prompt, stop
//! strings and token ids, penalties, choices with text and token ids, finish reasons, usage,
//! and `logprobs` with up to [`MAX_LOGPROBS`] alternatives per token and `text_offset`.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::fields::{kind, parse_body, token_list, token_prompts};
use super::policy::COMPLETIONS;
use super::sampling::SamplingBody;
use super::sse::event_stream;
use super::stop::response_text;
use super::worker::{Finished, Job};
use super::{read_body, AppState};
use crate::request::{FinishReason, GenerateRequest};

/// Most alternatives per token `logprobs` may ask for (OpenAI's own limit).
pub const MAX_LOGPROBS: u32 = 5;

/// The `/v1/completions` body, implemented fields only (the rest is screened by
/// [`COMPLETIONS`]).
#[derive(Debug, Deserialize)]
struct CompletionBody {
    /// A string, a list of strings, a list of token ids or a list of such lists.
    prompt: Value,
    /// Tokens to generate per choice (default 16, as OpenAI).
    max_tokens: Option<usize>,
    /// Softmax temperature (default 1).
    temperature: Option<f32>,
    /// Nucleus mass (default 1).
    top_p: Option<f32>,
    /// Top-k cut (extension; -1 or 0 = off).
    top_k: Option<i64>,
    /// Min-p cut (extension).
    min_p: Option<f32>,
    /// Stop ids cannot be sampled before this many tokens (extension).
    min_tokens: Option<usize>,
    /// Choices per prompt (default 1); choice `i` of a prompt samples with `seed + i`.
    n: Option<usize>,
    /// Base seed.
    seed: Option<u64>,
    /// Log-probs of the sampled tokens plus this many alternatives (0..=MAX_LOGPROBS).
    logprobs: Option<u32>,
    /// Stop strings.
    stop: Option<Value>,
    /// Stop after these ids (extension, as vLLM / SGLang).
    stop_token_ids: Option<Vec<u32>>,
    /// Keep the matched stop string in the text (extension).
    no_stop_trim: Option<bool>,
    /// Do not stop at `eos_token_id` (extension).
    ignore_eos: Option<bool>,
    /// Skip special tokens in the text (extension, default true).
    skip_special_tokens: Option<bool>,
    /// OpenAI penalties (SGLang's formulas).
    frequency_penalty: Option<f32>,
    /// See `frequency_penalty`.
    presence_penalty: Option<f32>,
    /// Repetition penalty (extension).
    repetition_penalty: Option<f32>,
    /// Token id -> bias.
    logit_bias: Option<BTreeMap<String, f32>>,
    /// Answer as server-sent events: one chunk per choice, then `[DONE]`.
    stream: Option<bool>,
}

/// `POST /v1/completions`.
pub async fn handle(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = read_body(body, state.limits().max_body_bytes)?;
    let body: CompletionBody = COMPLETIONS.parse(parse_body::<Value>(&bytes)?)?;
    let top_n = match body.logprobs {
        None => None,
        Some(k) if k <= MAX_LOGPROBS => Some(k as usize),
        Some(k) => {
            return Err(ApiError::bad_request(format!(
                "logprobs={k}: r3 returns at most {MAX_LOGPROBS} alternatives per token"
            )))
        }
    };
    let prompts = prompt_ids(&state, &body.prompt)?;
    let n = body.n.unwrap_or(1);
    if n == 0 {
        return Err(ApiError::bad_request("n must be at least 1"));
    }
    let total = prompts.len().saturating_mul(n);
    state.check_batch_size(total)?;
    let sampling = SamplingBody {
        temperature: body.temperature,
        top_p: body.top_p,
        top_k: body.top_k,
        min_p: body.min_p,
        max_new_tokens: Some(body.max_tokens.unwrap_or(16)),
        min_new_tokens: body.min_tokens,
        stop_token_ids: body.stop_token_ids.clone(),
        stop: body.stop.clone(),
        no_stop_trim: body.no_stop_trim,
        ignore_eos: body.ignore_eos,
        frequency_penalty: body.frequency_penalty,
        presence_penalty: body.presence_penalty,
        repetition_penalty: body.repetition_penalty,
        logit_bias: body.logit_bias.clone(),
        n: None,
        seed: Some(body.seed.unwrap_or_else(|| state.next_seed())),
        sampling_seed: None,
        skip_special_tokens: body.skip_special_tokens,
    };
    let mut jobs = Vec::with_capacity(total);
    let mut texts = Vec::with_capacity(total);
    for (p, input_ids) in prompts.iter().enumerate() {
        let at = |e: ApiError| {
            if prompts.len() > 1 {
                e.context(&format!("prompt {p}"))
            } else {
                e
            }
        };
        state.check_prompt(input_ids, "prompt").map_err(at)?;
        for i in 0..n {
            let (mut params, text, stop) =
                state.prepare(&sampling, input_ids.len(), i).map_err(at)?;
            params.top_logprobs = top_n.unwrap_or(0);
            texts.push(text);
            jobs.push(Job {
                rid: state.next_rid(),
                request: GenerateRequest {
                    input_ids: input_ids.clone(),
                    sampling: params,
                    return_routes: false,
                    routed_experts_start_len: 0,
                },
                stop,
            });
        }
    }
    let results = state.handle().generate(jobs).await?;
    let mut choices = Vec::with_capacity(results.len());
    for (index, (f, text)) in results.iter().zip(&texts).enumerate() {
        let text = match state.text() {
            Some(codec) => response_text(
                codec,
                &f.result.output_ids,
                &f.result.finish,
                f.matched_stop.as_deref(),
                text,
            )?,
            None => String::new(),
        };
        choices.push(choice(&state, index, f, text, top_n));
    }
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let completion_tokens: usize = results.iter().map(|f| f.result.output_ids.len()).sum();
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let id = format!("cmpl-{}", state.next_rid());
    let model = state.config().served_model_name.clone();
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    if body.stream.unwrap_or(false) {
        let chunks: Vec<Value> = choices
            .into_iter()
            .map(|c| {
                json!({"id": id, "object": "text_completion", "created": created,
                       "model": model, "choices": [c]})
            })
            .collect();
        return Ok(event_stream(&chunks));
    }
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }))
    .into_response())
}

/// The prompts as token ids, whatever form they were sent in.
fn prompt_ids(state: &AppState, prompt: &Value) -> Result<Vec<Vec<u32>>, ApiError> {
    let needs_text = match prompt {
        Value::String(_) => true,
        Value::Array(items) => items.first().is_some_and(Value::is_string),
        _ => false,
    };
    if !needs_text {
        if !prompt.is_array() {
            return Err(ApiError::bad_request(format!(
                "prompt must be a string, a list of strings, a list of token ids or a list of such lists, got {}",
                kind(prompt)
            )));
        }
        return Ok(token_prompts(prompt, "prompt")?.0);
    }
    let codec = state.text().ok_or_else(|| {
        ApiError::bad_request(
            "text prompts need a tokenizer.json in the model directory; send token ids",
        )
    })?;
    match prompt {
        Value::String(s) => Ok(vec![codec.encode(s)?]),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, t)| match t {
                Value::String(s) => codec.encode(s),
                Value::Array(_) => token_list(t, &format!("prompt[{i}]")),
                other => Err(ApiError::bad_request(format!(
                    "prompt[{i}] must be a string, got {}",
                    kind(other)
                ))),
            })
            .collect(),
        _ => Err(ApiError::bad_request("prompt must be a string or a list")),
    }
}

/// The text of one token for `logprobs` (its decoded text; `token_id:N` without tokenizer).
fn token_text(state: &AppState, id: u32) -> String {
    match state.text() {
        Some(codec) => codec
            .decode(&[id], false)
            .unwrap_or_else(|_| codec.token_str(id)),
        None => format!("token_id:{id}"),
    }
}

/// One OpenAI choice.
fn choice(state: &AppState, index: usize, f: &Finished, text: String, top: Option<usize>) -> Value {
    let r = &f.result;
    let finish = match r.finish {
        FinishReason::Length => "length",
        FinishReason::Stop { .. } | FinishReason::StopString => "stop",
        FinishReason::Abort => "abort",
    };
    let matched = match r.finish {
        FinishReason::Stop { token } => json!(token),
        FinishReason::StopString => json!(f.matched_stop),
        _ => Value::Null,
    };
    let logprobs = match top {
        None => Value::Null,
        Some(k) => {
            let tokens: Vec<String> = r
                .output_ids
                .iter()
                .map(|&id| token_text(state, id))
                .collect();
            // Offsets into the choice's text, by the running length of the token texts (as
            // vLLM and SGLang compute them).
            let mut offset = 0usize;
            let text_offset: Vec<usize> = tokens
                .iter()
                .map(|t| {
                    let at = offset;
                    offset += t.chars().count();
                    at
                })
                .collect();
            let top_logprobs = if k == 0 {
                Value::Null
            } else {
                Value::Array(
                    r.output_top_logprobs
                        .iter()
                        .map(|pos| {
                            let mut m = Map::new();
                            for &(id, lp) in pos.iter().take(k) {
                                m.entry(token_text(state, id)).or_insert(json!(lp));
                            }
                            Value::Object(m)
                        })
                        .collect(),
                )
            };
            json!({
                "tokens": tokens,
                "token_logprobs": r.output_logprobs,
                "top_logprobs": top_logprobs,
                "text_offset": text_offset,
            })
        }
    };
    json!({
        "index": index,
        "text": text,
        "token_ids": r.output_ids,
        "logprobs": logprobs,
        "finish_reason": finish,
        "matched_stop": matched,
    })
}
