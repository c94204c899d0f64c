//! Errors of the analysis library: each says which stage failed (rollout, training pass,
//! statistics, plotting, writing) and carries the underlying library error.

use std::path::PathBuf;

use crate::plot::PlotError;

/// Why the mismatch analysis or the comparison could not finish.
#[derive(Debug, thiserror::Error)]
pub enum AnalysisError {
    /// Loading a model, building a config or running the training forward failed.
    #[error("{stage}: {source}")]
    Model {
        /// What was being done.
        stage: String,
        /// The model error (boxed: keeps the crate's `Result`s small).
        source: Box<r3_model::ModelError>,
    },
    /// The device named for the rollouts or the training passes cannot be opened (a
    /// `cuda` this build or machine lacks; nothing falls back to the CPU).
    /// (Boxed: keeps the crate's `Result`s small.)
    #[error("device: {0}")]
    Device(#[source] Box<r3_model::DeviceError>),
    /// The rollout engine failed.
    #[error("rollout engine: {0}")]
    Rollout(#[from] r3_rollout::RolloutError),
    /// Sampling or scoring through r3-train failed (boxed: r3-train's error is large).
    #[error("r3-train: {0}")]
    Train(#[source] Box<r3_train::TrainError>),
    /// Prompt generation or the tokenizer failed.
    #[error("prompts: {0}")]
    Task(#[from] r3_tasks::TaskError),
    /// A route table or a statistic rejected its input.
    #[error("{stage}: {source}")]
    Route {
        /// What was being computed.
        stage: String,
        /// The routing error.
        source: r3_routing::RouteError,
    },
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Candle(#[from] candle_core::Error),
    /// A figure could not be drawn.
    #[error(transparent)]
    Plot(#[from] PlotError),
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The summary could not be serialised.
    #[error("serialising the summary: {0}")]
    Json(#[from] serde_json::Error),
    /// The options or the data do not allow the analysis (named in the message).
    #[error("{0}")]
    Invalid(String),
}

impl From<r3_model::DeviceError> for AnalysisError {
    fn from(e: r3_model::DeviceError) -> Self {
        AnalysisError::Device(Box::new(e))
    }
}

impl From<r3_train::TrainError> for AnalysisError {
    fn from(e: r3_train::TrainError) -> Self {
        Self::Train(Box::new(e))
    }
}

impl AnalysisError {
    /// Wraps an I/O error with its path.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }

    /// Wraps a model error with the stage it happened in.
    pub fn model(stage: impl Into<String>) -> impl FnOnce(r3_model::ModelError) -> Self {
        let stage = stage.into();
        move |source| Self::Model {
            stage,
            source: Box::new(source),
        }
    }

    /// Wraps a routing error with the statistic being computed.
    pub fn route(stage: impl Into<String>) -> impl FnOnce(r3_routing::RouteError) -> Self {
        let stage = stage.into();
        move |source| Self::Route { stage, source }
    }
}
