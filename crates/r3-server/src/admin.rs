//! Operational endpoints: health (`/health`, `/health_generate`), model and server facts
//! (`/get_model_info` = `/model_info`, `/get_server_info` = `/server_info`, `/v1/models`,
//! `/v1/loads`, `/get_weight_version`) and the control calls of RL loops
//! (`/update_weights_from_disk`, `/abort_request`, `/pause_generation`,
//! `/continue_generation`, `/flush_cache`).

use std::path::PathBuf;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::backend::StagedWeights;
use super::error::ApiError;
use super::fields::parse_body;
use super::heap::return_free_heap;
use super::policy::UPDATE_WEIGHTS;
use super::weights_update::allowed_dir;
use super::worker::{Job, PauseMode};
use super::{read_body, AppState};
use r3_rollout::error::RolloutError;
use r3_rollout::request::GenerateRequest;
use r3_rollout::sampler::SamplingParams;

/// `GET|POST /health`: 200 while the engine worker is alive.
pub async fn health(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    if state.handle().is_alive() {
        Ok(Json(json!({})))
    } else {
        Err(ApiError::unavailable("the engine worker has stopped"))
    }
}

/// `GET /health_generate`: generates one token through the engine (200 when it works).
/// While generation is paused or memory is released it answers from the worker's liveness,
/// as the engine cannot generate then.
pub async fn health_generate(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let stats = state.handle().stats();
    if stats.paused || !stats.memory_released.is_empty() {
        return health(State(state)).await;
    }
    let job = Job {
        rid: format!("health-{}", state.next_rid()),
        request: GenerateRequest {
            input_ids: vec![0],
            sampling: SamplingParams::greedy(1),
            return_routes: false,
            routed_experts_start_len: 0,
        },
        stop: None,
    };
    state.handle().generate(vec![job]).await?;
    Ok(Json(json!({})))
}

/// `GET /get_model_info` and `/model_info`. No eos ids, as SGLang 0.5.23's `model_info`
/// reports none (config.json's alone were an incomplete list: every request stops at
/// [`AppState::stop_ids`]).
pub async fn model_info(State(state): State<AppState>) -> Json<Value> {
    let s = state.summary();
    Json(json!({
        "model_path": state.model_name(),
        "tokenizer_path": state.model_name(),
        "served_model_name": state.config().served_model_name,
        "model_type": s.model_type,
        "is_generation": true,
        "weight_version": state.handle().stats().weight_version,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": s.max_position_embeddings,
        "num_hidden_layers": s.layout.num_hidden_layers(),
        "moe_layers": s.layout.moe_layers(),
        "num_experts_per_tok": s.top_k,
        "num_experts": s.num_experts,
        "has_tokenizer": state.text().is_some(),
    }))
}

/// `GET /get_server_info` and `/server_info`: settings, limits and the worker's counters.
pub async fn server_info(State(state): State<AppState>) -> Json<Value> {
    let l = state.limits();
    let stats = state.handle().stats();
    let s = state.summary();
    Json(json!({
        "model_path": state.model_name(),
        "served_model_name": state.config().served_model_name,
        "weight_version": stats.weight_version,
        "context_length": s.max_position_embeddings,
        "dp_size": 1,
        "tp_size": 1,
        "return_routed_experts_by_default": state.config().return_routed_experts_by_default,
        "return_original_logprob": state.config().return_original_logprob,
        "sampling_defaults": state.config().generation.mode.to_string(),
        "limits": {
            "max_body_bytes": l.max_body_bytes,
            "max_new_tokens": l.max_new_tokens,
            "default_max_new_tokens": l.default_max_new_tokens,
            "max_batch_requests": l.max_batch_requests,
        },
        "worker": stats,
    }))
}

/// `GET /get_weight_version`.
pub async fn weight_version(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"weight_version": state.handle().stats().weight_version}))
}

/// `GET /v1/models` (OpenAI): the one served model.
pub async fn models(State(state): State<AppState>) -> Json<Value> {
    let name = &state.config().served_model_name;
    Json(json!({
        "object": "list",
        "data": [{
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "r3",
            "root": state.model_name(),
            "max_model_len": state.summary().max_position_embeddings,
        }],
    }))
}

/// `GET /v1/loads`: queued and running requests (one data-parallel rank).
pub async fn loads(State(state): State<AppState>) -> Json<Value> {
    let s = state.handle().stats();
    Json(json!({
        "dp_rank_count": 1,
        "loads": [{
            "dp_rank": 0,
            "num_running_reqs": s.running,
            "num_waiting_reqs": s.waiting,
            "num_total_reqs": s.running + s.waiting,
            "paused": s.paused,
        }],
    }))
}

/// `/update_weights_from_disk` body, implemented fields only (see [`UPDATE_WEIGHTS`]).
#[derive(Debug, Deserialize)]
struct UpdateWeightsBody {
    /// Directory with safetensors weights of the same config.
    model_path: String,
    /// Only safetensors directories are read; `auto`/`safetensors`/null accepted.
    load_format: Option<String>,
    /// Abort in-flight requests first (they return what they generated, finish `abort`).
    abort_all_requests: Option<bool>,
    /// The new weight version label (default: the update count).
    weight_version: Option<String>,
}

/// `POST /update_weights_from_disk`: reads and checks the new weights on a loader thread
/// while the engine keeps serving, then swaps them in between two steps and sets the weight
/// version (the engine invalidates its prefix cache); `abort_all_requests` aborts only after
/// the swap. Only directories under the weights root are read; one update at a time: a
/// second waits for the first (SGLang's update lock), both answered. A client that leaves
/// does not cancel its update, which goes on to its end and holds the lock until then. A
/// failed update answers SGLang's `{"success": false, "message", "num_paused_requests"}`
/// (clients read `success`) beside r3's `error` object, under r3's status for the failure.
pub async fn update_weights(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match try_update_weights(state, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => {
            let mut body = e.body();
            body["success"] = json!(false);
            body["message"] = json!(e.message);
            body["num_paused_requests"] = json!(0);
            e.log();
            (e.status, Json(body)).into_response()
        }
    }
}

/// The update itself; its answer on success.
async fn try_update_weights(
    state: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Value, ApiError> {
    let bytes = read_body(body, state.limits().max_body_bytes)?;
    let body: UpdateWeightsBody = UPDATE_WEIGHTS.parse(parse_body::<Value>(&bytes)?)?;
    match body.load_format.as_deref() {
        None | Some("auto") | Some("safetensors") => {}
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "load_format {other:?} is not supported (safetensors only)"
            )))
        }
    }
    let dir = allowed_dir(state.config().weights_root.as_deref(), &body.model_path)?;
    // On a task of its own: a client that disconnects drops this handler but not the update,
    // so the lock is held until the worker has answered (a retry waits for it instead of
    // staging a second checkpoint beside the first; the worker queues updates besides).
    let abort_all = body.abort_all_requests.unwrap_or(false);
    let update = tokio::spawn(stage_and_swap(state, dir, abort_all, body.weight_version));
    let version = update
        .await
        .map_err(|_| ApiError::internal("the weight update task failed"))??;
    Ok(json!({
        "success": true,
        "message": format!("loaded weights from {}", body.model_path),
        "weight_version": version,
        "num_paused_requests": 0,
    }))
}

/// Reads `dir` on a loader thread, one update at a time, and has the worker swap it in;
/// returns the new weight version label.
async fn stage_and_swap(
    state: AppState,
    dir: PathBuf,
    abort_all: bool,
    label: Option<String>,
) -> Result<String, ApiError> {
    let _one_at_a_time = state.update_lock().lock().await;
    let weights = match state.stager() {
        Some(stager) => {
            let from = dir.clone();
            let staged = tokio::task::spawn_blocking(move || {
                let staged = stager.stage(&from);
                // A refused checkpoint never reaches the worker, whose trim after an update
                // would hand its memory back: done here.
                if staged.is_err() {
                    return_free_heap();
                }
                staged
            })
            .await
            .map_err(|_| ApiError::internal("the weight loader thread panicked"))?;
            Some(staged.map_err(|e| match e {
                RolloutError::WeightDir { .. } => ApiError::from(e),
                e => ApiError::from(e).context(&format!("loading weights from {}", dir.display())),
            })?)
        }
        None => None,
    };
    state
        .handle()
        .update_weights(StagedWeights { dir, weights }, abort_all, label)
        .await
}

/// `/abort_request` body.
#[derive(Debug, Deserialize)]
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
    let rid = body.rid.filter(|r| !r.is_empty());
    let target = match (rid, body.abort_all.unwrap_or(false)) {
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

/// `/pause_generation` body.
#[derive(Debug, Default, Deserialize)]
struct PauseBody {
    /// `abort` (default), `in_place`, `retract`, or `wait` (= `in_place`).
    mode: Option<String>,
}

/// `POST /pause_generation`: stop generating until `/continue_generation`. Mode `abort`
/// returns every in-flight request with what it generated (finish `abort`); `in_place`,
/// `wait` and `retract` keep them, and they continue where they stopped. Requests that
/// arrive while paused are queued. The answer counts the requests aborted or retracted
/// (`aborted`) and those still running (`running`).
pub async fn pause(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let bytes = read_body(body, state.limits().max_body_bytes)?;
    let body: PauseBody = if bytes.iter().all(u8::is_ascii_whitespace) {
        PauseBody::default()
    } else {
        parse_body(&bytes)?
    };
    let mode = match body.mode.as_deref() {
        None | Some("abort") => PauseMode::Abort,
        Some("in_place") | Some("wait") => PauseMode::InPlace,
        Some("retract") => PauseMode::Retract,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "mode {other:?} is not one of abort, in_place, retract, wait"
            )))
        }
    };
    let aborted = state.handle().pause(mode).await?;
    // Requests a pause left running (mode `in_place`) hold their keys and values: a client
    // about to release memory sees them here.
    let running = state.handle().stats().running;
    Ok(Json(json!({
        "success": true,
        "message": "generation paused",
        "aborted": aborted,
        "running": running,
    })))
}

/// `POST /continue_generation`.
pub async fn resume(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    state.handle().resume().await?;
    Ok(Json(
        json!({"success": true, "message": "generation continued"}),
    ))
}

/// `GET|POST /flush_cache`: empties the prefix cache.
pub async fn flush_cache(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let blocks = state.handle().flush_cache().await?;
    Ok(Json(json!({
        "success": true,
        "message": "Cache flushed.",
        "flushed_blocks": blocks,
    })))
}
