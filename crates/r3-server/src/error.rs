//! The server's error type: every failure becomes an HTTP status and a JSON body
//! `{"error": {"message", "type", "code"}}` (OpenAI style; SGLang clients read `message`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use r3_rollout::error::RolloutError;

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
    /// What the client caused is a 4xx (an unknown id 404, the rest 400); what the engine or
    /// the machine caused is a 500 (see [`RolloutError::is_client_error`]).
    fn from(e: RolloutError) -> Self {
        match e {
            RolloutError::UnknownRequest(_) => ApiError::not_found(e.to_string()),
            // The device ran out of memory in a step: the server is out of room for now,
            // not broken, so a client may retry later (or with a smaller request).
            RolloutError::StepFailed {
                out_of_memory: true,
                ..
            } => ApiError::unavailable(e.to_string()),
            e if e.is_client_error() => ApiError::bad_request(e.to_string()),
            e => ApiError::internal(e.to_string()),
        }
    }
}

impl ApiError {
    /// The JSON body of this error: `{"error": {"message", "type", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "code": self.status.as_u16(),
        }})
    }

    /// Logs the error as it is answered: a server fault as an error, a refusal at debug.
    pub fn log(&self) {
        if self.status.is_server_error() {
            tracing::error!(status = self.status.as_u16(), message = %self.message, "request failed");
        } else {
            tracing::debug!(status = self.status.as_u16(), message = %self.message, "request rejected");
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.log();
        (self.status, Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Error as IoError, ErrorKind};
    use std::path::PathBuf;

    use axum::http::StatusCode;
    use r3_model::{Config, ModelError};

    use super::ApiError;
    use r3_rollout::error::RolloutError;
    use r3_rollout::model::tensors::load_dir;

    fn status(e: RolloutError) -> StatusCode {
        ApiError::from(e).status
    }

    fn weight_dir(source: ModelError) -> RolloutError {
        RolloutError::WeightDir {
            dir: PathBuf::from("/ckpt"),
            source: Box::new(source),
        }
    }

    #[test]
    fn request_errors_are_the_clients() {
        let too_long = RolloutError::RequestTooLong {
            prompt_tokens: 100,
            max_new_tokens: 10,
            blocks_needed: 7,
            pool_blocks: 4,
        };
        assert_eq!(status(too_long), StatusCode::BAD_REQUEST);
        let bad = RolloutError::InvalidRequest("input_ids is empty".into());
        assert_eq!(status(bad), StatusCode::BAD_REQUEST);
        assert_eq!(
            status(RolloutError::UnknownRequest(3)),
            StatusCode::NOT_FOUND
        );
    }

    #[test]
    fn device_memory_refusals_and_failures_name_themselves() {
        let too_big = RolloutError::ActivationsTooLarge(
            "a request of 4096 prompt + 16 new tokens needs about 9000.0 MiB".into(),
        );
        assert_eq!(status(too_big), StatusCode::BAD_REQUEST);
        let oom = RolloutError::StepFailed {
            requests: vec![3, 4].into(),
            out_of_memory: true,
            source: Box::new(RolloutError::Candle(candle_core::Error::Msg(
                "CUDA_ERROR_OUT_OF_MEMORY".into(),
            ))),
        };
        let api = ApiError::from(oom);
        assert_eq!(api.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(api.message.contains("out of memory"), "{}", api.message);
    }

    #[test]
    fn engine_faults_are_the_servers() {
        let exhausted = RolloutError::KvCacheExhausted { needed: 2, free: 0 };
        assert_eq!(status(exhausted), StatusCode::INTERNAL_SERVER_ERROR);
        let weights = RolloutError::Weights("missing tensor lm_head.weight".into());
        assert_eq!(status(weights), StatusCode::INTERNAL_SERVER_ERROR);
        let io = RolloutError::Io {
            path: PathBuf::from("/x"),
            source: IoError::from(ErrorKind::NotFound),
        };
        assert_eq!(status(io), StatusCode::INTERNAL_SERVER_ERROR);
        let candle = RolloutError::Candle(candle_core::Error::Msg("device lost".into()));
        assert_eq!(status(candle), StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[test]
    fn a_bad_weight_directory_is_the_clients_a_machine_fault_the_servers() {
        let missing = ModelError::Io {
            path: "/ckpt/model.safetensors".into(),
            source: IoError::from(ErrorKind::NotFound),
        };
        assert_eq!(status(weight_dir(missing)), StatusCode::BAD_REQUEST);
        let denied = ModelError::Io {
            path: "/ckpt/model.safetensors".into(),
            source: IoError::from(ErrorKind::PermissionDenied),
        };
        assert_eq!(status(weight_dir(denied)), StatusCode::BAD_REQUEST);
        let shape = ModelError::TensorShape {
            name: "lm_head.weight".into(),
            expected: vec![4, 2],
            got: vec![2, 4],
        };
        assert_eq!(status(weight_dir(shape)), StatusCode::BAD_REQUEST);
        let out_of_memory = ModelError::Io {
            path: "/ckpt/model.safetensors".into(),
            source: IoError::from(ErrorKind::OutOfMemory),
        };
        assert_eq!(
            status(weight_dir(out_of_memory)),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        let device = ModelError::Candle(candle_core::Error::Msg("device lost".into()));
        assert_eq!(
            status(weight_dir(device)),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    /// The real loader on directories a client could name: each failure is a 400 whose
    /// message names the directory.
    #[test]
    fn real_loader_failures_on_client_directories_are_400() {
        let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../r3-rollout/tests/fixtures/qwen3_moe_tiny");
        let cfg = Config::from_file(&fixture.join("config.json")).expect("fixture config");
        let scratch = std::env::temp_dir().join(format!("r3-weight-dir-{}", std::process::id()));
        std::fs::create_dir_all(&scratch).expect("scratch dir");
        let empty = load_dir(&scratch, &cfg).expect_err("an empty directory has no weights");
        std::fs::write(scratch.join("model.safetensors"), b"not safetensors").expect("write");
        let corrupt = load_dir(&scratch, &cfg).expect_err("a corrupt file is no checkpoint");
        let _ = std::fs::remove_dir_all(&scratch);
        for e in [empty, corrupt] {
            assert!(matches!(e, RolloutError::WeightDir { .. }), "{e:?}");
            let api = ApiError::from(e);
            assert_eq!(api.status, StatusCode::BAD_REQUEST, "{}", api.message);
            assert!(api.message.contains("r3-weight-dir"), "{}", api.message);
        }
    }
}
