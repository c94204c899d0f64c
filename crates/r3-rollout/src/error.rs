//! Errors of the rollout engine.

use thiserror::Error;

/// Everything that can go wrong in the rollout engine; each variant names what is wrong.
#[derive(Debug, Error)]
pub enum RolloutError {
    /// The engine configuration or a model option is not usable.
    #[error("invalid engine config: {0}")]
    InvalidConfig(String),
    /// A request is malformed (bad token id, empty prompt, bad sampling parameter, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A weight tensor is missing or has the wrong shape.
    #[error("weights: {0}")]
    Weights(String),
    /// The model architecture or one of its options is not supported by the engine.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A layer the config's layout routes cannot be routed (the trainer refuses it too).
    #[error("layer {layer} is a MoE layer without {missing}")]
    InconsistentMoeLayer {
        /// Global layer index.
        layer: usize,
        /// What the layer lacks.
        missing: &'static str,
    },
    /// The KV cache cannot hold a request even when it runs alone.
    #[error("kv cache: {0}")]
    KvCache(String),
    /// An unknown request id.
    #[error("unknown request id {0}")]
    UnknownRequest(u64),
    /// Error from the model crate (config parsing, weight loading, router math).
    #[error("model: {0}")]
    Model(#[from] r3_model::ModelError),
    /// Error from the routing crate (building or merging route tables).
    #[error("routes: {0}")]
    Routes(#[from] r3_routing::RouteError),
    /// Error from candle (tensor conversion during weight loading).
    #[error("tensor: {0}")]
    Candle(#[from] candle_core::Error),
    /// I/O error (reading a model directory).
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}
