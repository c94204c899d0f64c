//! Errors of the rollout fleet client: transport faults and worker replies that fail
//! validation (retried on another worker), and the final errors a step fails with.

use thiserror::Error;

/// A fleet error.
#[derive(Debug, Error)]
pub enum FleetError {
    /// The fleet configuration is unusable.
    #[error("rollout fleet config: {0}")]
    Config(String),
    /// The async runtime could not start.
    #[error("starting the rollout fleet's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// Connecting to or talking with a worker failed (refused, reset, dead).
    #[error("{url}: {message}")]
    Transport {
        /// The worker's endpoint.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// A worker took longer than `rollout.request_timeout_s`.
    #[error("{url}: no answer within {secs} s")]
    Timeout {
        /// The worker's endpoint.
        url: String,
        /// The timeout.
        secs: f64,
    },
    /// A worker answered with a non-2xx status.
    #[error("{url}: HTTP {status}: {body}")]
    Status {
        /// The worker's endpoint.
        url: String,
        /// HTTP status code.
        status: u16,
        /// The start of the reply body.
        body: String,
    },
    /// A worker's reply is not what the request asked for (wrong row count, ids out of
    /// range, dense columns not empty, truncated base64, missing fields, ...).
    #[error("{url}: invalid /generate reply: {reason}")]
    BadReply {
        /// The worker's endpoint.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A reply came from weights older than the trainer's by more than `rollout.max_staleness`.
    #[error("{url}: reply from weight version {got}, trainer is at {expected} (max_staleness {max_staleness})")]
    Stale {
        /// The worker's endpoint.
        url: String,
        /// `meta_info.weight_version` of the reply.
        got: String,
        /// The trainer's current version.
        expected: u64,
        /// Accepted version lag.
        max_staleness: u64,
    },
    /// A request failed on every attempt.
    #[error("request {request} failed after {attempts} attempts; last: {last}")]
    RetriesExhausted {
        /// Index of the request in the batch.
        request: usize,
        /// Attempts made.
        attempts: u32,
        /// The last attempt's error.
        last: Box<FleetError>,
    },
    /// No worker is reachable at the current weight version.
    #[error("no rollout worker left (of {total}: {detail})")]
    NoWorkers {
        /// Workers configured.
        total: usize,
        /// Why each is out.
        detail: String,
    },
    /// A weight sync step failed on a worker.
    #[error("{url}: weight sync to version {version}: {reason}")]
    Sync {
        /// The worker's endpoint.
        url: String,
        /// The version being synced.
        version: u64,
        /// What failed.
        reason: String,
    },
}

impl FleetError {
    /// Whether the fault belongs to one worker, so the request may go to another one.
    pub fn is_worker_fault(&self) -> bool {
        matches!(
            self,
            FleetError::Transport { .. }
                | FleetError::Timeout { .. }
                | FleetError::Status { .. }
                | FleetError::BadReply { .. }
                | FleetError::Stale { .. }
        )
    }
}

/// Result of fleet operations.
pub type Result<T> = std::result::Result<T, FleetError>;
