//! The error type of r3-train.

use std::path::PathBuf;

/// Everything that can go wrong in the trainer's pure pieces and its configuration.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A model kernel rejected its inputs.
    #[error(transparent)]
    Model(#[from] r3_model::ModelError),
    /// Inputs whose shapes or dtypes do not fit together.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// An argument outside its valid range.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A config key that does not exist.
    #[error("unknown config key `{key}` (known keys here: {known})")]
    UnknownConfigKey {
        /// The dotted key as written.
        key: String,
        /// The keys that exist at that level.
        known: String,
    },
    /// A `--set` override that is not `key=value` or whose value has the wrong type.
    #[error("override `{text}`: {reason}")]
    BadOverride {
        /// The override as given.
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A config whose values are individually typed right but make no sense.
    #[error("config: {0}")]
    Config(String),
    /// A config file that could not be read or parsed.
    #[error("config file {path}: {reason}")]
    ConfigFile {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// Writing a file failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
}

/// Result alias for r3-train.
pub type Result<T> = std::result::Result<T, TrainError>;
