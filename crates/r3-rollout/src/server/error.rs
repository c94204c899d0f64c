//! The server's error type: every failure becomes an HTTP status and a JSON body
//! `{"error": {"message", "type", "code"}}` (OpenAI style; SGLang clients read `message`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::RolloutError;

/// An HTTP error with a message that names what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status (4xx: the request is at fault; 5xx: the server is).
    pub status: StatusCode,
    /// Human-readable explanation.
    pub message: String,
}

impl ApiError {
    /// 400: the request is malformed or asks for something invalid.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    /// 404: an unknown id or path.
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
        }
    }

    /// 413: the request is larger than the server accepts.
    pub fn too_large(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: message.into(),
        }
    }

    /// 500: the engine failed on a valid request.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
        }
    }

    /// 503: the engine worker is gone.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
        }
    }

    /// Prefixes the message with where the problem is (e.g. a field name).
    pub fn context(mut self, what: &str) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }

    fn kind(&self) -> &'static str {
        if self.status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl From<RolloutError> for ApiError {
    /// Request-shaped engine errors are the client's fault (4xx); the rest are the server's.
    fn from(e: RolloutError) -> Self {
        match e {
            RolloutError::InvalidRequest(_) | RolloutError::KvCache(_) => {
                ApiError::bad_request(e.to_string())
            }
            RolloutError::UnknownRequest(_) => ApiError::not_found(e.to_string()),
            other => ApiError::internal(other.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(status = self.status.as_u16(), message = %self.message, "request failed");
        } else {
            tracing::debug!(status = self.status.as_u16(), message = %self.message, "request rejected");
        }
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "code": self.status.as_u16(),
        }});
        (self.status, Json(body)).into_response()
    }
}
