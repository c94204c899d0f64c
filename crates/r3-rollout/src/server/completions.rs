//! OpenAI-style `/v1/completions`: prompts as text or token ids, `n` samples per prompt,
//! choices with text and token ids, finish reasons and usage.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::fields::{kind, parse_body, token_list, token_prompts};
use super::sampling::SamplingBody;
use super::worker::Job;
use super::{read_body, AppState};
use crate::request::{FinishReason, GenerateRequest, GenerateResult};

/// The `/v1/completions` body (fields not listed are refused by name).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CompletionBody {
    /// Name of the model (accepted, not checked: the server serves one model).
    #[serde(rename = "model")]
    _model: Option<String>,
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
    /// Choices per prompt (default 1); choice `i` of a prompt samples with `seed + i`.
    n: Option<usize>,
    /// Base seed.
    seed: Option<u64>,
    /// Return sampled-token log-probs; only 0 is supported (no top alternatives).
    logprobs: Option<u32>,
    /// Stop after these ids (extension, as vLLM).
    stop_token_ids: Option<Vec<u32>>,
    /// Do not stop at `eos_token_id` (extension, as vLLM).
    ignore_eos: Option<bool>,
    /// Streaming is not supported; only `false` is accepted.
    stream: Option<bool>,
    /// Echoing the prompt is not supported; only `false` is accepted.
    echo: Option<bool>,
    /// Accepted and ignored (an end-user tag).
    #[serde(rename = "user")]
    _user: Option<String>,
}

/// `POST /v1/completions`.
pub async fn handle(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let bytes = read_body(body, state.limits().max_body_bytes)?;
    let body: CompletionBody = parse_body(&bytes)?;
    if body.stream == Some(true) {
        return Err(ApiError::bad_request(
            "stream=true is not supported; use stream=false",
        ));
    }
    if body.echo == Some(true) {
        return Err(ApiError::bad_request("echo=true is not supported"));
    }
    let want_logprobs = match body.logprobs {
        None => false,
        Some(0) => true,
        Some(k) => {
            return Err(ApiError::bad_request(format!(
                "logprobs={k}: only logprobs=0 (log-probs of the sampled tokens) is supported"
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
    let base_seed = match body.seed {
        Some(s) => s,
        None => state.next_seed(),
    };
    let mut jobs = Vec::with_capacity(total);
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
            let sampling = SamplingBody {
                temperature: body.temperature,
                top_p: body.top_p,
                top_k: body.top_k,
                max_new_tokens: Some(body.max_tokens.unwrap_or(16)),
                stop_token_ids: body.stop_token_ids.clone(),
                ignore_eos: body.ignore_eos,
                seed: Some(base_seed.wrapping_add(i as u64)),
                ..SamplingBody::default()
            };
            let sampling = state.sampling_params(&sampling).map_err(at)?;
            jobs.push(Job {
                rid: state.next_rid(),
                request: GenerateRequest {
                    input_ids: input_ids.clone(),
                    sampling,
                    return_routes: false,
                    routed_experts_start_len: 0,
                },
            });
        }
    }
    let results = state.handle().generate(jobs).await?;
    let mut choices = Vec::with_capacity(results.len());
    for (index, r) in results.iter().enumerate() {
        choices.push(choice(&state, index, r, want_logprobs)?);
    }
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let completion_tokens: usize = results.iter().map(|r| r.output_ids.len()).sum();
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Json(json!({
        "id": format!("cmpl-{}", state.next_rid()),
        "object": "text_completion",
        "created": created,
        "model": state.model_name(),
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    })))
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

/// One OpenAI choice.
fn choice(
    state: &AppState,
    index: usize,
    r: &GenerateResult,
    logprobs: bool,
) -> Result<Value, ApiError> {
    let text = match state.text() {
        Some(codec) => codec.decode(&r.output_ids)?,
        None => String::new(),
    };
    let finish = match r.finish {
        FinishReason::Length => "length",
        FinishReason::Stop { .. } => "stop",
        FinishReason::Abort => "abort",
    };
    let logprobs = if logprobs {
        let tokens: Vec<String> = r
            .output_ids
            .iter()
            .map(|&id| match state.text() {
                Some(codec) => codec.token_str(id),
                None => format!("token_id:{id}"),
            })
            .collect();
        json!({"tokens": tokens, "token_logprobs": r.output_logprobs, "top_logprobs": null})
    } else {
        Value::Null
    };
    Ok(json!({
        "index": index,
        "text": text,
        "token_ids": r.output_ids,
        "logprobs": logprobs,
        "finish_reason": finish,
    }))
}
