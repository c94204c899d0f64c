//! SGLang's native `/generate`: request parsing and validation, and the response with
//! `output_ids`, optional `text`, and `meta_info` (token counts, cached tokens, finish
//! reason, `output_token_logprobs`, `routed_experts` base64 + `routed_experts_dtype`).

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use r3_routing::wire::sglang::{encode_sglang, SGLANG_DTYPES};
use r3_routing::wire::WireDtype;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::fields::{parse_body, per_request, text_prompts, token_prompts};
use super::sampling::SamplingBody;
use super::worker::Job;
use super::{read_body, AppState};
use crate::request::{FinishReason, GenerateRequest, GenerateResult};

/// The `/generate` body (fields not listed are refused by name).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerateBody {
    /// A string or a list of strings (needs `tokenizer.json` in the model directory).
    text: Option<Value>,
    /// Token ids: one list or a batch of lists.
    input_ids: Option<Value>,
    /// One object for all prompts or one per prompt.
    sampling_params: Option<Value>,
    /// Return `output_token_logprobs` (bool or one per prompt).
    return_logprob: Option<Value>,
    /// Return `routed_experts` (bool or one per prompt).
    return_routed_experts: Option<Value>,
    /// First position whose routes are returned (number or one per prompt).
    routed_experts_start_len: Option<Value>,
    /// Wire dtype of `routed_experts`: `int32` (default), `uint16` or `uint8`.
    routed_experts_dtype: Option<String>,
    /// Client request id(s), usable with `/abort_request`.
    rid: Option<Value>,
    /// Streaming is not supported; only `false` is accepted.
    stream: Option<bool>,
    /// Accepted for compatibility; logprob entries never carry text.
    #[serde(rename = "return_text_in_logprobs")]
    _return_text_in_logprobs: Option<bool>,
}

/// What to put in one response besides the engine result.
#[derive(Debug, Clone)]
struct ResponseSpec {
    rid: String,
    return_logprob: bool,
    return_routes: bool,
    dtype: WireDtype,
}

/// `POST /generate`.
pub async fn handle(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let started = Instant::now();
    let bytes = read_body(body, state.limits().max_body_bytes)?;
    let body: GenerateBody = parse_body(&bytes)?;
    let (jobs, specs, is_batch) = build_jobs(&state, body)?;
    let results = state.handle().generate(jobs).await?;
    let latency = started.elapsed().as_secs_f64();
    let mut out = Vec::with_capacity(results.len());
    for (result, spec) in results.iter().zip(&specs) {
        out.push(response_for(&state, result, spec, latency)?);
    }
    if is_batch {
        Ok(Json(Value::Array(out)))
    } else {
        out.pop()
            .map(Json)
            .ok_or_else(|| ApiError::internal("the engine returned no result"))
    }
}

/// Validates the body and turns it into engine jobs (one per prompt).
fn build_jobs(
    state: &AppState,
    body: GenerateBody,
) -> Result<(Vec<Job>, Vec<ResponseSpec>, bool), ApiError> {
    if body.stream == Some(true) {
        return Err(ApiError::bad_request(
            "stream=true is not supported; use stream=false",
        ));
    }
    let (prompts, is_batch) = match (&body.input_ids, &body.text) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "give either input_ids or text, not both",
            ))
        }
        (None, None) => return Err(ApiError::bad_request("missing input_ids (or text)")),
        (Some(ids), None) => token_prompts(ids, "input_ids")?,
        (None, Some(text)) => {
            let codec = state.text().ok_or_else(|| {
                ApiError::bad_request(
                    "text prompts need a tokenizer.json in the model directory; send input_ids",
                )
            })?;
            let (texts, is_batch) = text_prompts(text, "text")?;
            let ids = texts
                .iter()
                .map(|t| codec.encode(t))
                .collect::<Result<Vec<_>, _>>()?;
            (ids, is_batch)
        }
    };
    let n = prompts.len();
    state.check_batch_size(n)?;
    let sampling: Vec<SamplingBody> = per_request(
        body.sampling_params.as_ref(),
        "sampling_params",
        n,
        SamplingBody::default(),
    )?;
    let logprob = per_request(body.return_logprob.as_ref(), "return_logprob", n, false)?;
    let routes = per_request(
        body.return_routed_experts.as_ref(),
        "return_routed_experts",
        n,
        false,
    )?;
    let start_len = per_request(
        body.routed_experts_start_len.as_ref(),
        "routed_experts_start_len",
        n,
        0usize,
    )?;
    let rids: Vec<Option<String>> = per_request(body.rid.as_ref(), "rid", n, None)?;
    let dtype = routes_dtype(state, body.routed_experts_dtype.as_deref())?;
    if routes.iter().any(|&r| r) && state.summary().layout.moe_layers().is_empty() {
        return Err(ApiError::bad_request(
            "return_routed_experts: the served model has no MoE layers",
        ));
    }
    let mut jobs = Vec::with_capacity(n);
    let mut specs = Vec::with_capacity(n);
    for (i, input_ids) in prompts.into_iter().enumerate() {
        let at = |e: ApiError| {
            if is_batch {
                e.context(&format!("prompt {i}"))
            } else {
                e
            }
        };
        state.check_prompt(&input_ids, "input_ids").map_err(at)?;
        let sampling = state.sampling_params(&sampling[i]).map_err(at)?;
        if start_len[i] > input_ids.len() {
            return Err(at(ApiError::bad_request(format!(
                "routed_experts_start_len {} is past the end of the {}-token prompt",
                start_len[i],
                input_ids.len()
            ))));
        }
        let rid = rids[i].clone().unwrap_or_else(|| state.next_rid());
        specs.push(ResponseSpec {
            rid: rid.clone(),
            return_logprob: logprob[i],
            return_routes: routes[i],
            dtype,
        });
        jobs.push(Job {
            rid,
            request: GenerateRequest {
                input_ids,
                sampling,
                return_routes: routes[i],
                routed_experts_start_len: start_len[i],
            },
        });
    }
    Ok((jobs, specs, is_batch))
}

/// The wire dtype asked for, checked against SGLang's set and the model's expert count.
fn routes_dtype(state: &AppState, name: Option<&str>) -> Result<WireDtype, ApiError> {
    let dtype = match name {
        None => WireDtype::I32,
        Some(s) => WireDtype::parse(s)
            .filter(|d| SGLANG_DTYPES.contains(d))
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "routed_experts_dtype {s:?} is not one of int32, uint16, uint8"
                ))
            })?,
    };
    let experts = state.summary().num_experts as i64;
    if experts > dtype.max_id() + 1 {
        return Err(ApiError::bad_request(format!(
            "routed_experts_dtype {} cannot hold expert ids up to {}",
            dtype.name(),
            experts - 1
        )));
    }
    Ok(dtype)
}

/// SGLang's `finish_reason` object.
pub fn sglang_finish_reason(finish: &FinishReason, completion_tokens: usize) -> Value {
    match finish {
        FinishReason::Length => json!({"type": "length", "length": completion_tokens}),
        FinishReason::Stop { token } => json!({"type": "stop", "matched": token}),
        FinishReason::Abort => json!({"type": "abort", "message": "aborted by request"}),
    }
}

/// One response object.
fn response_for(
    state: &AppState,
    r: &GenerateResult,
    spec: &ResponseSpec,
    latency: f64,
) -> Result<Value, ApiError> {
    let completion = r.output_ids.len();
    let mut meta = json!({
        "id": spec.rid,
        "finish_reason": sglang_finish_reason(&r.finish, completion),
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": completion,
        "cached_tokens": r.cached_tokens,
        "weight_version": r.weight_version,
        "e2e_latency": latency,
    });
    if spec.return_logprob {
        let lps: Vec<Value> = r
            .output_logprobs
            .iter()
            .zip(&r.output_ids)
            .map(|(lp, id)| json!([lp, id, null]))
            .collect();
        meta["output_token_logprobs"] = Value::Array(lps);
    }
    if spec.return_routes {
        let Some(table) = r.routes.as_ref() else {
            if r.finish == FinishReason::Abort {
                // Aborted before any position was captured.
                meta["routed_experts"] = Value::Null;
                return finish_response(state, r, meta);
            }
            return Err(ApiError::internal(
                "the engine returned no routes although asked to",
            ));
        };
        let layout = &state.summary().layout;
        let b64 = encode_sglang(table, spec.dtype, layout.num_hidden_layers(), Some(layout))
            .map_err(|e| ApiError::internal(format!("encoding routed_experts: {e}")))?;
        meta["routed_experts"] = Value::String(b64);
        meta["routed_experts_dtype"] = Value::String(spec.dtype.name().to_string());
        meta["routed_experts_start_len"] = json!(table.start_pos());
    }
    finish_response(state, r, meta)
}

/// `{"output_ids", "meta_info", "text"?}`.
fn finish_response(state: &AppState, r: &GenerateResult, meta: Value) -> Result<Value, ApiError> {
    let mut out = json!({"output_ids": r.output_ids, "meta_info": meta});
    if let Some(codec) = state.text() {
        out["text"] = Value::String(codec.decode(&r.output_ids)?);
    }
    Ok(out)
}
