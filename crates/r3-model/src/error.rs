//! The crate's error type: every failure names what is wrong (field, tensor, layer, token).

use std::path::PathBuf;

use r3_routing::RouteError;

/// What [`ModelError::HostMemory`] names its memory: an error whose text holds it is the
/// host's allocation, never the device's ([`crate::device::reads_as_out_of_memory`]).
pub const PAGE_LOCKED_HOST_MEMORY: &str = "page-locked host memory";

/// Errors from config parsing, weight loading, routing and the forward pass.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `model_type` is not one of the supported architectures.
    #[error("unsupported model_type `{0}` (supported: qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3)")]
    UnsupportedModelType(String),
    /// A config option has a value this crate does not implement.
    #[error("unsupported config option `{field}` = {value}")]
    UnsupportedOption {
        /// config.json key
        field: String,
        /// the offending value
        value: String,
    },
    /// A key the architecture requires is absent from config.json.
    #[error("missing `{key}` (required for {model_type})")]
    MissingKey {
        /// config.json key (or the key names it may go by)
        key: &'static str,
        /// the architecture that requires it
        model_type: &'static str,
    },
    /// A size key that must be positive is 0.
    #[error("`{key}` must be > 0 for {model_type}")]
    ZeroSize {
        /// config.json key
        key: &'static str,
        /// the architecture
        model_type: &'static str,
    },
    /// Two spellings of the same quantity disagree.
    #[error("`{first}` = {first_value} conflicts with `{second}` = {second_value}")]
    ConflictingKeys {
        /// the key read first
        first: &'static str,
        /// its value
        first_value: usize,
        /// the key that disagrees
        second: &'static str,
        /// its value
        second_value: usize,
    },
    /// A size key above its documented limit ([`crate::config::ConfigLimits`]).
    #[error("config.json `{key}` = {value} exceeds the limit of {max}")]
    ConfigTooLarge {
        /// config.json key
        key: &'static str,
        /// the value declared
        value: usize,
        /// the largest value accepted
        max: usize,
    },
    /// A config value outside its valid range (`rms_norm_eps` ≤ 0, `eos_token_id` ≥ vocab, ...).
    #[error("config.json `{key}` = {value}: {rule}")]
    InvalidValue {
        /// config.json key (dotted for nested keys, e.g. `rope_scaling.factor`)
        key: String,
        /// the value found
        value: String,
        /// what it must be
        rule: String,
    },
    /// Config values that contradict each other (head counts, group sizes, ...).
    #[error("invalid config: {0}")]
    InvalidConfig(String),
    /// A tensor the config requires is not in the checkpoint.
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    /// A tensor has a different shape than the config requires.
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape {
        /// HF tensor name
        name: String,
        /// shape the config implies
        expected: Vec<usize>,
        /// shape found
        got: Vec<usize>,
    },
    /// A checkpoint file is malformed (safetensors header, index.json, dtype).
    #[error("bad checkpoint {}: {msg}", path.display())]
    Checkpoint {
        /// the file
        path: PathBuf,
        /// what is wrong
        msg: String,
    },
    /// Input to the forward pass is malformed (token id, lengths, shapes).
    #[error("invalid input: {0}")]
    Input(String),
    /// The host could not give a GPU's copies the page-locked memory they land in (the
    /// driver's out-of-memory here is the host's, not the device's).
    #[error(
        "cannot allocate {values} f32 of {}: {reason}",
        PAGE_LOCKED_HOST_MEMORY
    )]
    HostMemory {
        /// Values asked for.
        values: usize,
        /// The driver's error.
        reason: String,
    },
    /// A route table does not fit the model or the batch.
    #[error("route table for sequence {sequence} does not fit: {msg}")]
    RouteMismatch {
        /// batch index of the sequence
        sequence: usize,
        /// what does not fit
        msg: String,
    },
    /// Replay verification failed: the experts used differ from the experts given.
    #[error("replay not honoured at layer {layer}, sequence {sequence}, token {token}: used {used:?}, given {given:?}")]
    ReplayNotHonoured {
        /// global layer index
        layer: usize,
        /// batch index
        sequence: usize,
        /// token position
        token: usize,
        /// expert ids the dispatch actually used (sorted)
        used: Vec<u32>,
        /// expert ids the table gave (sorted)
        given: Vec<u32>,
    },
    /// A weight tensor holds NaN or ±inf (refused at load unless the caller allows it).
    #[error("tensor `{tensor}` holds a non-finite value {value} at flat index {index} (pass the allow-non-finite option to load it anyway)")]
    NonFiniteWeight {
        /// HF tensor name
        tensor: String,
        /// flat row-major index of the first non-finite element
        index: usize,
        /// the value
        value: f64,
    },
    /// A weight tensor holds a finite value past the range of the precision it is loaded
    /// for (refused at load and on every update unless the caller allows it).
    #[error("tensor `{tensor}` holds {value:e} at flat index {index}, outside the finite range of {precision} (±{max}): an {precision} engine would turn it into ±inf (pass the allow-non-finite option to load it anyway)")]
    OutOfPrecisionRange {
        /// HF tensor name
        tensor: String,
        /// flat row-major index of the first such element
        index: usize,
        /// the value
        value: f64,
        /// the precision that cannot hold it
        precision: crate::weights::precision::WeightPrecision,
        /// its largest finite magnitude
        max: f64,
    },
    /// Router scores are not finite, so top-k is undefined.
    #[error("non-finite router score at row {row}, expert {expert}: {value}")]
    NonFiniteScore {
        /// row in the router input
        row: usize,
        /// expert id
        expert: usize,
        /// the value
        value: f32,
    },
    /// Error from the route data model.
    #[error(transparent)]
    Route(#[from] RouteError),
    /// Error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// I/O error with the path involved.
    #[error("{}: {source}", path.display())]
    Io {
        /// the file
        path: PathBuf,
        /// the cause
        #[source]
        source: std::io::Error,
    },
    /// JSON error with the file involved.
    #[error("{}: {source}", path.display())]
    Json {
        /// the file (`config.json` when parsed from text)
        path: PathBuf,
        /// the cause
        #[source]
        source: serde_json::Error,
    },
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
