//! Errors of the rollout engine: one enum whose variants say whose fault a failure is (the
//! request's, the weights', the engine's), so the HTTP server can answer 4xx or 500.

use std::path::PathBuf;

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
    /// A request that can never fit in the KV cache, even when it runs alone.
    #[error(
        "a request of {prompt_tokens} prompt + {max_new_tokens} new tokens needs {blocks_needed} \
         KV blocks, the pool holds {pool_blocks}"
    )]
    RequestTooLong {
        /// Tokens in the prompt.
        prompt_tokens: usize,
        /// Tokens the request may generate.
        max_new_tokens: usize,
        /// KV blocks the whole request needs.
        blocks_needed: usize,
        /// KV blocks the pool has in all.
        pool_blocks: usize,
    },
    /// A request whose forward step alone needs more device memory for its activations
    /// than the device engine's budget for one step (`activation_bytes`); the text names
    /// the request's size, the estimate, the step and the budget.
    #[error("{0}")]
    ActivationsTooLarge(String),
    /// The KV pool ran dry in the middle of a step although every admitted request fits
    /// alone: a fault of the engine's scheduling, not of any request.
    #[error("kv cache exhausted: {needed} more blocks needed, {free} free")]
    KvCacheExhausted {
        /// Blocks the step still needed.
        needed: usize,
        /// Blocks free when it gave up.
        free: usize,
    },
    /// A forward step of the device engine failed (a device allocation, above all); its
    /// requests are dropped, the engine serves the next ones.
    #[error(
        "a step of requests {requests:?} failed{}: {source}",
        if *out_of_memory { " (the device ran out of memory; lower max_running, \
         kv_cache_bytes or activation_bytes — `r3 serve --max-running / --kv-cache-mib / \
         --activation-mib`, `r3 train`'s rollout.max_running / rollout.kv_cache_mib / \
         rollout.activation_mib — or send shorter requests)" } else { "" }
    )]
    StepFailed {
        /// The requests the failed step computed (all dropped; a boxed slice keeps every
        /// engine `Result` small).
        requests: Box<[u64]>,
        /// Whether the device ran out of memory.
        out_of_memory: bool,
        /// The forward's error.
        #[source]
        source: Box<RolloutError>,
    },
    /// A weight tensor is missing or has the wrong shape.
    #[error("weights: {0}")]
    Weights(String),
    /// A weight tensor that cannot be converted to the engine's f32 host buffers.
    #[error("weights: tensor {name}: {source}")]
    TensorConversion {
        /// HF tensor name.
        name: String,
        /// The conversion error (boxed: the engine's error stays small enough to carry in
        /// the trainer's without boxing there).
        #[source]
        source: Box<candle_core::Error>,
    },
    /// A weight directory could not be loaded (missing, unreadable or not a checkpoint of
    /// this model's config).
    #[error("loading weights from {}: {source}", dir.display())]
    WeightDir {
        /// The directory that was read.
        dir: PathBuf,
        /// Why it could not be loaded (boxed: keeps every engine `Result` small).
        #[source]
        source: Box<r3_model::ModelError>,
    },
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
    /// An unknown request id.
    #[error("unknown request id {0}")]
    UnknownRequest(u64),
    /// Error from the model crate (config parsing, router math).
    #[error("model: {0}")]
    Model(#[from] r3_model::ModelError),
    /// Error from the routing crate (building or merging route tables).
    #[error("routes: {0}")]
    Routes(#[from] r3_routing::RouteError),
    /// The device asked for cannot be opened (a build without CUDA, no GPU or driver).
    #[error(transparent)]
    Device(#[from] r3_model::DeviceError),
    /// Error from candle (tensor conversion during weight loading).
    #[error("tensor: {0}")]
    Candle(#[from] candle_core::Error),
    /// I/O error with the file involved.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl RolloutError {
    /// Whether the caller (a client of the server) caused the error, as opposed to the
    /// engine or the machine: the HTTP server answers 4xx for these and 500 otherwise.
    pub fn is_client_error(&self) -> bool {
        match self {
            RolloutError::InvalidRequest(_)
            | RolloutError::RequestTooLong { .. }
            | RolloutError::ActivationsTooLarge(_)
            | RolloutError::UnknownRequest(_) => true,
            RolloutError::WeightDir { source, .. } => weight_dir_is_clients(source),
            _ => false,
        }
    }
}

/// Whether a weight-directory failure is the directory's fault (missing, unreadable, not a
/// checkpoint of this config) rather than the server's (out of memory, a device error).
fn weight_dir_is_clients(e: &r3_model::ModelError) -> bool {
    use r3_model::ModelError as M;
    use std::io::ErrorKind;
    match e {
        M::Io { source, .. } => matches!(
            source.kind(),
            ErrorKind::NotFound
                | ErrorKind::PermissionDenied
                | ErrorKind::InvalidData
                | ErrorKind::InvalidInput
                | ErrorKind::UnexpectedEof
                | ErrorKind::NotADirectory
                | ErrorKind::IsADirectory
        ),
        M::Json { .. }
        | M::Checkpoint { .. }
        | M::MissingTensor(_)
        | M::TensorShape { .. }
        | M::InvalidConfig(_)
        | M::InvalidValue { .. }
        | M::ConfigTooLarge { .. }
        | M::NonFiniteWeight { .. }
        | M::OutOfPrecisionRange { .. }
        | M::UnsupportedOption { .. }
        | M::UnsupportedModelType(_) => true,
        _ => false,
    }
}
