//! Part (a), load: many concurrent clients send greedy and seeded requests; every answer is
//! compared with the single-client reference of its request.

use std::sync::Arc;
use std::time::Duration;

use r3_fleet::http::JsonClient;
use serde_json::Value;

use super::traffic::{run_clients, Answer};

/// Figures of the load part.
#[derive(Debug, Clone)]
pub struct LoadFigures {
    /// Concurrent clients.
    pub clients: usize,
    /// Requests sent.
    pub sent: usize,
    /// Requests without a valid answer.
    pub failures: usize,
    /// Answers that differ from the reference (or were aborted).
    pub mismatches: usize,
    /// Median latency, ms.
    pub p50_ms: f64,
    /// 99th percentile latency, ms.
    pub p99_ms: f64,
}

/// Runs `clients` clients against `url` for `duration`.
pub async fn run(
    client: &JsonClient,
    url: &str,
    pool: Arc<Vec<Value>>,
    reference: &[Answer],
    clients: usize,
    duration: Duration,
    seed: u64,
) -> LoadFigures {
    let t = run_clients(client, url, pool, clients, duration, seed).await;
    let mismatches = t.mismatches(reference);
    LoadFigures {
        clients,
        sent: t.sent,
        failures: t.failures,
        mismatches,
        p50_ms: t.quantile_ms(0.5),
        p99_ms: t.quantile_ms(0.99),
    }
}
