//! The client traffic every part sends: a fixed pool of seeded `/generate` requests, half
//! greedy and half sampled with a seed (so each has exactly one right answer for given
//! weights), their single-client reference answers, and clients that send pool requests
//! until a deadline and count failures, mismatches and latency.

use std::sync::Arc;
use std::time::{Duration, Instant};

use r3_fleet::http::JsonClient;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

/// Time limit of one request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// `n` seeded requests over a vocabulary of `vocab` ids: prompts of 8–24 ids, 16 new tokens,
/// even ones greedy, odd ones sampled at temperature 1 with their own seed.
pub fn request_pool(n: usize, vocab: usize, seed: u64) -> Vec<Value> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let hi = u32::try_from(vocab).unwrap_or(u32::MAX).max(4);
    (0..n)
        .map(|i| {
            let len = rng.random_range(8..=24);
            let ids: Vec<u32> = (0..len).map(|_| rng.random_range(3..hi)).collect();
            let sampling = if i % 2 == 0 {
                json!({"temperature": 0.0, "max_new_tokens": 16})
            } else {
                json!({"temperature": 1.0, "seed": 1000 + i, "max_new_tokens": 16})
            };
            json!({"input_ids": ids, "sampling_params": sampling})
        })
        .collect()
}

/// One answer: its tokens, whether it was aborted, the weight version it reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// `output_ids`.
    pub tokens: Vec<u32>,
    /// `meta_info.finish_reason.type == "abort"`.
    pub aborted: bool,
    /// `meta_info.weight_version`.
    pub version: String,
}

/// Reads an answer from a `/generate` reply.
pub fn answer(v: &Value) -> Option<Answer> {
    let tokens = v["output_ids"]
        .as_array()?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()?;
    let meta = &v["meta_info"];
    let version = match &meta["weight_version"] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    Some(Answer {
        tokens,
        aborted: meta["finish_reason"]["type"] == "abort",
        version,
    })
}

/// Sends one request; the answer (None: failed or unreadable) and the latency.
pub async fn send(client: &JsonClient, url: &str, body: &Value) -> (Option<Answer>, Duration) {
    let t0 = Instant::now();
    let reply = client.post(url, body, REQUEST_TIMEOUT).await;
    let elapsed = t0.elapsed();
    match reply {
        Ok(v) => (answer(&v), elapsed),
        Err(e) => {
            tracing::debug!(error = %e, "request failed");
            (None, elapsed)
        }
    }
}

/// The pool's answers from one client, one request at a time (the reference).
pub async fn reference(
    client: &JsonClient,
    url: &str,
    pool: &[Value],
) -> anyhow::Result<Vec<Answer>> {
    let mut out = Vec::with_capacity(pool.len());
    for (i, body) in pool.iter().enumerate() {
        match send(client, url, body).await {
            (Some(a), _) if !a.aborted => out.push(a),
            _ => anyhow::bail!("reference request {i} failed"),
        }
    }
    Ok(out)
}

/// What the clients saw.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    /// Requests sent.
    pub sent: usize,
    /// Requests with no valid answer (transport error, non-2xx, unreadable).
    pub failures: usize,
    /// Latencies of answered requests.
    pub latencies: Vec<Duration>,
    /// Answers with their pool index, for the caller to check.
    pub answers: Vec<(usize, Answer)>,
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        self.sent += other.sent;
        self.failures += other.failures;
        self.latencies.extend(other.latencies);
        self.answers.extend(other.answers);
    }

    /// Answers that were aborted or differ from the reference answer of their pool request.
    pub fn mismatches(&self, reference: &[Answer]) -> usize {
        self.answers
            .iter()
            .filter(|(i, a)| a.aborted || a.tokens != reference[*i].tokens)
            .count()
    }

    /// The `q` quantile of the latencies in ms (0 when none).
    pub fn quantile_ms(&self, q: f64) -> f64 {
        let mut l: Vec<f64> = self
            .latencies
            .iter()
            .map(|d| d.as_secs_f64() * 1e3)
            .collect();
        if l.is_empty() {
            return 0.0;
        }
        l.sort_by(f64::total_cmp);
        let i = ((l.len() - 1) as f64 * q).round() as usize;
        l[i.min(l.len() - 1)]
    }
}

/// `clients` concurrent clients, each sending random pool requests back to back until
/// `duration` has passed.
pub async fn run_clients(
    client: &JsonClient,
    url: &str,
    pool: Arc<Vec<Value>>,
    clients: usize,
    duration: Duration,
    seed: u64,
) -> Tally {
    let deadline = Instant::now() + duration;
    let mut tasks = Vec::with_capacity(clients);
    for c in 0..clients {
        let client = client.clone();
        let url = url.to_string();
        let pool = Arc::clone(&pool);
        tasks.push(tokio::spawn(async move {
            let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(c as u64));
            let mut t = Tally::default();
            while Instant::now() < deadline {
                let i = rng.random_range(0..pool.len());
                t.sent += 1;
                match send(&client, &url, &pool[i]).await {
                    (Some(a), dt) => {
                        t.latencies.push(dt);
                        t.answers.push((i, a));
                    }
                    (None, _) => t.failures += 1,
                }
            }
            t
        }));
    }
    let mut all = Tally::default();
    for task in tasks {
        match task.await {
            Ok(t) => all.merge(t),
            Err(e) => tracing::warn!(error = %e, "client task failed"),
        }
    }
    all
}
