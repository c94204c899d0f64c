//! The error type of the RL loop, pretraining and checkpoints: everything the loop can
//! hit in the crates it composes (model, rollout engine, tasks, routing, the pure training
//! pieces), plus its own failures (a replay that does not verify, a bad checkpoint).

use std::path::PathBuf;

/// Everything that can stop a training run.
#[derive(Debug, thiserror::Error)]
pub enum RlError {
    /// A pure training piece (loss, optimiser, config) failed.
    #[error(transparent)]
    Train(#[from] crate::error::TrainError),
    /// The training model failed.
    #[error("training model: {0}")]
    Model(#[from] r3_model::ModelError),
    /// The rollout engine failed.
    #[error("rollout engine: {0}")]
    Rollout(#[from] r3_rollout::RolloutError),
    /// The task (problems, tokenizer, reward) failed.
    #[error("task: {0}")]
    Task(#[from] r3_tasks::TaskError),
    /// Route tables or routing statistics failed.
    #[error("routes: {0}")]
    Route(#[from] r3_routing::RouteError),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A replayed forward did not use exactly the given experts on every cell.
    #[error("replay not verified ({mode} {pass} pass): {msg}")]
    ReplayNotVerified {
        /// `R2` or `R3`.
        mode: String,
        /// `old-logp` or `update`.
        pass: String,
        /// What differed.
        msg: String,
    },
    /// A checkpoint or run directory that cannot be used.
    #[error("checkpoint {path}: {msg}")]
    Checkpoint {
        /// The offending path.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
    /// Inputs that do not fit together (lengths, shapes).
    #[error("{0}")]
    Invalid(String),
}

impl RlError {
    /// An IO error tagged with the path it concerns.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> RlError {
        let path = path.into();
        move |source| RlError::Io { path, source }
    }
}

/// Result alias of the RL loop.
pub type RlResult<T> = std::result::Result<T, RlError>;
