//! `/release_memory_occupation` and `/resume_memory_occupation` (SGLang's, for an RL loop
//! whose trainer shares the GPU): which regions a body names (`tags`: `weights`, `kv_cache`,
//! `cuda_graph`; none or an empty list is all), and the handlers that ask the engine worker
//! to let them go and take them back.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::backend::MemoryRegions;
use super::error::ApiError;
use super::fields::parse_body;
use super::{read_body, AppState};

/// The body of both endpoints (empty is `{}`).
#[derive(Debug, Default, Deserialize)]
struct MemoryBody {
    /// The regions; None or empty: all.
    tags: Option<Vec<String>>,
}

/// The regions a request's body names.
fn regions_of(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<MemoryRegions, ApiError> {
    let bytes = read_body(body, state.limits().max_body_bytes)?;
    let body: MemoryBody = if bytes.iter().all(u8::is_ascii_whitespace) {
        MemoryBody::default()
    } else {
        parse_body(&bytes)?
    };
    MemoryRegions::from_tags(body.tags.as_deref()).map_err(ApiError::bad_request)
}

/// `GET|POST /release_memory_occupation`: lets the engine's memory in the named regions go
/// (the weights to the host, the prefix cache emptied), refused while requests run; no
/// step runs until they are resumed, and requests that arrive meanwhile are queued.
pub async fn release(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let regions = regions_of(&state, body)?;
    let free = state.handle().release_memory(regions).await?;
    Ok(Json(json!({
        "success": true,
        "message": format!("released: {}", regions.tags().join(", ")),
        "released": state.handle().stats().memory_released,
        "device_free_bytes": free,
    })))
}

/// `GET|POST /resume_memory_occupation`: takes back the named regions (each must have
/// been released); generation goes on once none is released (and it is not paused).
pub async fn resume(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let regions = regions_of(&state, body)?;
    state.handle().resume_memory(regions).await?;
    Ok(Json(json!({
        "success": true,
        "message": format!("resumed: {}", regions.tags().join(", ")),
        "released": state.handle().stats().memory_released,
    })))
}
