//! Operational endpoints: `/health`, `/get_model_info`, `/get_server_info`,
//! `/update_weights_from_disk` and `/abort_request`.

use std::path::PathBuf;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::fields::parse_body;
use super::{read_body, AppState};

/// `GET|POST /health`: 200 while the engine worker is alive.
pub async fn health(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    if state.handle().is_alive() {
        Ok(Json(json!({})))
    } else {
        Err(ApiError::unavailable("the engine worker has stopped"))
    }
}

/// `GET /get_model_info`.
pub async fn model_info(State(state): State<AppState>) -> Json<Value> {
    let s = state.summary();
    Json(json!({
        "model_path": state.model_name(),
        "model_type": s.model_type,
        "is_generation": true,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": s.max_position_embeddings,
        "num_hidden_layers": s.layout.num_hidden_layers(),
        "moe_layers": s.layout.moe_layers(),
        "num_experts_per_tok": s.top_k,
        "num_experts": s.num_experts,
        "eos_token_ids": s.eos_token_ids,
        "has_tokenizer": state.text().is_some(),
    }))
}

/// `GET /get_server_info`: limits and the worker's counters (batching, prefix cache).
pub async fn server_info(State(state): State<AppState>) -> Json<Value> {
    let l = state.limits();
    Json(json!({
        "limits": {
            "max_body_bytes": l.max_body_bytes,
            "max_new_tokens": l.max_new_tokens,
            "default_max_new_tokens": l.default_max_new_tokens,
            "max_batch_requests": l.max_batch_requests,
        },
        "worker": state.handle().stats(),
    }))
}

/// `/update_weights_from_disk` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateWeightsBody {
    /// Directory with safetensors weights of the same config.
    model_path: String,
    /// Only safetensors directories are read; `auto`/`safetensors`/null accepted.
    load_format: Option<String>,
    /// Abort in-flight requests first (they return what they generated, finish `abort`).
    abort_all_requests: Option<bool>,
}

/// `POST /update_weights_from_disk`: reload weights between steps, bump the weight version
/// (the engine invalidates its prefix cache).
pub async fn update_weights(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let bytes = read_body(body, state.limits().max_body_bytes)?;
    let body: UpdateWeightsBody = parse_body(&bytes)?;
    match body.load_format.as_deref() {
        None | Some("auto") | Some("safetensors") => {}
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "load_format {other:?} is not supported (safetensors only)"
            )))
        }
    }
    let dir = PathBuf::from(&body.model_path);
    if !dir.is_dir() {
        return Err(ApiError::bad_request(format!(
            "model_path {:?} is not a directory",
            body.model_path
        )));
    }
    let version = state
        .handle()
        .update_weights(dir, body.abort_all_requests.unwrap_or(false))
        .await?;
    Ok(Json(json!({
        "success": true,
        "message": format!("loaded weights from {}", body.model_path),
        "weight_version": version,
    })))
}

/// `/abort_request` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AbortBody {
    /// Client id of the request to abort.
    rid: Option<String>,
    /// Abort every in-flight request.
    abort_all: Option<bool>,
}

/// `POST /abort_request`: the aborted request's client gets what was generated so far.
pub async fn abort(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let bytes = read_body(body, state.limits().max_body_bytes)?;
    let body: AbortBody = parse_body(&bytes)?;
    let target = match (body.rid, body.abort_all.unwrap_or(false)) {
        (Some(_), true) => {
            return Err(ApiError::bad_request(
                "give either rid or abort_all, not both",
            ))
        }
        (Some(rid), false) => Some(rid),
        (None, true) => None,
        (None, false) => return Err(ApiError::bad_request("missing rid (or abort_all: true)")),
    };
    let aborted = state.handle().abort(target).await?;
    Ok(Json(json!({"success": aborted > 0, "aborted": aborted})))
}
