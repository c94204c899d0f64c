//! Errors of report building: each names the file (and line) at fault.

use std::path::PathBuf;

use crate::plot::PlotError;

/// Why a report could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A line of a JSONL file is not a valid metrics record.
    #[error("{}:{line}: {what}", file.display())]
    Malformed {
        /// The JSONL file.
        file: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        what: String,
    },
    /// `config.toml` is not valid TOML.
    #[error("{}: {what}", file.display())]
    Config {
        /// The config file.
        file: PathBuf,
        /// The parser's message.
        what: String,
    },
    /// No run directory was given.
    #[error("no run directories given")]
    NoRuns,
    /// A plot failed for a reason other than missing data.
    #[error(transparent)]
    Plot(#[from] PlotError),
    /// The results table could not be serialised.
    #[error("serialising the results table: {0}")]
    Json(#[from] serde_json::Error),
}

impl ReportError {
    /// Wraps an I/O error with its path.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}
