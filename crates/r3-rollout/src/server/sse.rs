//! Server-sent events for `stream: true`. r3 answers a request when its engine work is done,
//! so a stream carries the whole answer in its chunks (SGLang: one chunk per response with
//! the cumulative `text`, `output_ids` and `meta_info`, routes included; OpenAI: one chunk per
//! choice with its text and finish reason), then `data: [DONE]`. Concatenating the chunks
//! gives the non-streamed response.

use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

/// An SSE body of `chunks` followed by `data: [DONE]`.
pub fn event_stream(chunks: &[Value]) -> Response {
    let mut body = String::new();
    for c in chunks {
        body.push_str("data: ");
        body.push_str(&c.to_string());
        body.push_str("\n\n");
    }
    body.push_str("data: [DONE]\n\n");
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// The JSON objects of an SSE body (everything but `[DONE]`), for tests and clients.
pub fn parse_event_stream(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data:"))
        .map(str::trim)
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}
