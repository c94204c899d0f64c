//! Errors of the rollout fleet client: transport faults and worker replies that fail
//! validation (retried on another worker), a request's own faults (it alone fails), and the
//! final errors a step fails with.
//!
//! Whose fault: HTTP 400, 413 and 422 are the request's (SGLang answers 400 to a prompt +
//! `max_new_tokens` past the context): the request fails alone, with the server's message,
//! and the worker stays up. Refusals, timeouts, every other 4xx (401 / 403 / 404 / 405 mean
//! a misconfigured worker or a proxy in front of a restarting one), 5xx, replies that fail a
//! check and stale replies are the worker's: it is taken out and the request goes to another
//! worker — unless a second worker gives the same answer (same status and body, or the same
//! check failing the same way), which makes it the request's fault again. Where no other
//! worker could take the retry (a fleet of one), an HTTP error answer is asked of the same
//! worker once more, and the same answer from it twice is the request's fault: it stays up. Answers that say
//! nothing about the request never count as the same answer: refusals, timeouts, stale
//! replies, 401 / 403 / 404 / 405 / 407 / 408 / 429, the gateway answers 502 / 503 / 504 (an
//! ingress gives every one the same generic body) and a body that reads as out of memory.

use r3_rollout::GenerateResult;
use thiserror::Error;

use crate::fleet::RolloutStats;

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
    /// A reply came from weights older than the trainer's by more than `rollout.max_staleness`
    /// (counted from the version the request was sent at), or newer than the trainer's.
    #[error("{url}: reply from weight version {got}, trainer is at {current} (request sent at version {sent}, max_staleness {max_staleness})")]
    Stale {
        /// The worker's endpoint.
        url: String,
        /// `meta_info.weight_version` of the reply.
        got: String,
        /// The trainer's current version.
        current: u64,
        /// The last finished sync when the request was sent.
        sent: u64,
        /// Accepted version lag.
        max_staleness: u64,
    },
    /// A request failed for a reason of its own: a worker refused it (HTTP 400, 413 or 422), or two
    /// workers gave the same error. It alone fails; no worker is taken out for it.
    #[error("request {request} failed ({why}): {error}")]
    RequestFailed {
        /// Index of the request in the batch.
        request: usize,
        /// Why it is the request's fault.
        why: String,
        /// The worker's answer (its message included).
        error: Box<FleetError>,
    },
    /// Some requests of a batch failed; the others finished and their results are kept here.
    #[error("{0}")]
    Batch(Box<BatchFailure>),
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

/// What is left of a batch some of whose requests failed.
#[derive(Debug)]
pub struct BatchFailure {
    /// One slot per request, in request order: the result of each request that finished.
    pub results: Vec<Option<GenerateResult>>,
    /// Each failed request's index and error, in request order.
    pub failures: Vec<(usize, FleetError)>,
    /// What the batch cost (its `results` counts the finished requests).
    pub stats: RolloutStats,
}

impl BatchFailure {
    /// The batch's outcomes, one per request in request order, split into the finished
    /// results (a `None` slot where a request failed) and the failures with their indices.
    pub fn from_outcomes(
        outcomes: Vec<std::result::Result<GenerateResult, FleetError>>,
        stats: RolloutStats,
    ) -> Self {
        let mut results = Vec::with_capacity(outcomes.len());
        let mut failures = Vec::new();
        for (i, outcome) in outcomes.into_iter().enumerate() {
            match outcome {
                Ok(r) => results.push(Some(r)),
                Err(e) => {
                    results.push(None);
                    failures.push((i, e));
                }
            }
        }
        BatchFailure {
            results,
            failures,
            stats,
        }
    }
}

/// Failures named in full in a batch error's message; the rest are counted.
const NAMED_FAILURES: usize = 3;

impl std::fmt::Display for BatchFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let finished = self.results.iter().filter(|r| r.is_some()).count();
        write!(
            f,
            "{} of {} rollout requests failed ({finished} finished, their results kept)",
            self.failures.len(),
            self.results.len(),
        )?;
        for (i, e) in self.failures.iter().take(NAMED_FAILURES) {
            write!(f, "; request {i}: {e}")?;
        }
        if self.failures.len() > NAMED_FAILURES {
            write!(f, "; and {} more", self.failures.len() - NAMED_FAILURES)?;
        }
        Ok(())
    }
}

impl FleetError {
    /// Whether the fault belongs to one worker, so the request may go to another one.
    pub fn is_worker_fault(&self) -> bool {
        match self {
            FleetError::Status { .. } => !self.is_request_fault(),
            FleetError::Transport { .. }
            | FleetError::Timeout { .. }
            | FleetError::BadReply { .. }
            | FleetError::Stale { .. } => true,
            _ => false,
        }
    }

    /// Whether a worker's answer says the request itself is wrong: HTTP 400 (bad request),
    /// 413 (too large) or 422 (unprocessable). Other 4xx are about the worker's setup
    /// (401, 403, 404, 405) or load (408, 429): worker faults.
    pub fn is_request_fault(&self) -> bool {
        matches!(
            self,
            FleetError::Status {
                status: 400 | 413 | 422,
                ..
            }
        )
    }

    /// Whether this is a request's final error that is its own fault
    /// ([`FleetError::RequestFailed`]: HTTP 400 / 413 / 422, or the same answer from two
    /// workers, or twice from the only worker left): the workers and the batch's other requests are not affected, so a caller may
    /// drop that request and keep the rest. Every other final error of a request (worker
    /// faults out of retries, no worker left, an aborted request that never progressed, a
    /// fault of the client) says the fleet could not serve it.
    pub fn is_request_failure(&self) -> bool {
        matches!(self, FleetError::RequestFailed { .. })
    }

    /// The worker's answer without the worker's URL, for telling whether two workers gave
    /// the same one: a non-2xx status (status and body) or a reply that failed a check (the
    /// reason). `None` for answers that say nothing about the request: refusals, timeouts,
    /// stale replies, 401 / 403 / 404 / 405 / 407 (setup), 408 / 429 (load), 502 / 503 / 504
    /// (gateways answer them with the same generic body) and bodies that read as out of
    /// memory.
    pub fn answer(&self) -> Option<String> {
        match self {
            FleetError::Status { status, body, .. } => {
                let about_worker = matches!(
                    status,
                    401 | 403 | 404 | 405 | 407 | 408 | 429 | 502 | 503 | 504
                );
                let lower = body.to_ascii_lowercase();
                let oom = lower.contains("out of memory") || lower.contains("outofmemory");
                (!about_worker && !oom).then(|| format!("HTTP {status}: {body}"))
            }
            FleetError::BadReply { reason, .. } => Some(reason.clone()),
            _ => None,
        }
    }
}

/// Result of fleet operations.
pub type Result<T> = std::result::Result<T, FleetError>;

#[cfg(test)]
mod tests {
    use super::*;

    fn status(status: u16, body: &str) -> FleetError {
        FleetError::Status {
            url: "http://w".into(),
            status,
            body: body.into(),
        }
    }

    #[test]
    fn only_400_413_422_are_the_requests_fault() {
        for code in [400, 413, 422] {
            assert!(status(code, "").is_request_fault(), "{code}");
            assert!(!status(code, "").is_worker_fault(), "{code}");
        }
        for code in [401, 403, 404, 405, 408, 409, 429, 500, 502, 503] {
            assert!(!status(code, "").is_request_fault(), "{code}");
            assert!(status(code, "").is_worker_fault(), "{code}");
        }
    }

    /// Only a request's own final failure may be dropped by a caller: a worker's 400 before
    /// the fleet classified it, a request out of retries and a fleet with no worker are not.
    #[test]
    fn only_request_failed_is_a_request_failure() {
        let failed = FleetError::RequestFailed {
            request: 3,
            why: "refused".into(),
            error: Box::new(status(400, "too long")),
        };
        assert!(failed.is_request_failure());
        let exhausted = FleetError::RetriesExhausted {
            request: 3,
            attempts: 4,
            last: Box::new(status(500, "engine failed")),
        };
        let none_left = FleetError::NoWorkers {
            total: 2,
            detail: "both refused".into(),
        };
        for other in [status(400, "too long"), exhausted, none_left] {
            assert!(!other.is_request_failure(), "{other}");
        }
    }

    #[test]
    fn gateway_setup_and_memory_answers_are_never_the_same_answer() {
        for code in [401, 403, 404, 405, 407, 408, 429, 502, 503, 504] {
            assert_eq!(status(code, "Service Unavailable").answer(), None, "{code}");
        }
        let oom = status(
            500,
            r#"{"error": "CUDA out of memory. Tried to allocate 2 GiB"}"#,
        );
        assert_eq!(oom.answer(), None);
        assert_eq!(status(500, "torch.OutOfMemoryError").answer(), None);
        assert_eq!(
            status(500, "engine failed").answer().as_deref(),
            Some("HTTP 500: engine failed")
        );
        assert!(status(409, "conflict").answer().is_some());
    }
}
