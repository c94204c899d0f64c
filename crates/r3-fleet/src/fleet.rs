//! The rollout fleet: SGLang-compatible workers driven over HTTP from a tokio runtime the
//! fleet owns. [`Fleet::generate`] sends every request as its own `/generate` call (many
//! in flight, least-outstanding-requests balancing), retries a request whose worker fails
//! on another worker, and returns exactly one checked result per request, in order.
//! [`Fleet::sync`] moves every worker to a new weight version; a worker that was out is
//! probed with `/health` before each batch and rejoins once a sync brings it to the
//! current version.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use r3_rollout::{GenerateRequest, GenerateResult};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::config::{FleetConfig, ModelFacts};
use crate::error::{FleetError, Result};
use crate::http::JsonClient;
use crate::pool::WorkerPool;
use crate::wire::{decode_reply, generate_body, parse_version, Reply};

/// Longest wait for `/health` when probing a worker that was out.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Shortest wait allowed for `/update_weights_from_disk` (loading weights takes a while).
const MIN_LOAD_TIMEOUT: Duration = Duration::from_secs(120);

/// What one batch of requests cost besides the results.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RolloutStats {
    /// Requests sent again after a worker fault.
    pub retries: u64,
    /// Results from an older weight version (accepted within `max_staleness`).
    pub stale: usize,
    /// Results returned.
    pub results: usize,
    /// Workers up when the batch finished.
    pub workers_up: usize,
    /// Client seconds spent checking and decoding parsed replies, summed over requests.
    pub decode_s: f64,
}

/// Counters the request tasks of one batch add to.
#[derive(Debug, Default)]
struct Counters {
    retries: AtomicU64,
    decode_ns: AtomicU64,
}

impl RolloutStats {
    /// Fraction of results from older weights.
    pub fn stale_frac(&self) -> f64 {
        if self.results == 0 {
            0.0
        } else {
            self.stale as f64 / self.results as f64
        }
    }
}

/// The client side of a fleet of rollout workers.
pub struct Fleet {
    runtime: tokio::runtime::Runtime,
    shared: Arc<Shared>,
    /// Weight version every reply should come from.
    version: u64,
    /// Checkpoint of `version`, for bringing a returning worker up to date.
    synced_dir: Option<PathBuf>,
}

/// What the request tasks share.
struct Shared {
    client: JsonClient,
    pool: Mutex<WorkerPool>,
    cfg: FleetConfig,
    model: ModelFacts,
    next_rid: AtomicU64,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("urls", &self.shared.cfg.urls)
            .field("version", &self.version)
            .finish()
    }
}

impl Shared {
    fn pool(&self) -> MutexGuard<'_, WorkerPool> {
        // A panic while holding the lock leaves plain counters behind; keep using them.
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn url(&self, worker: usize, path: &str) -> String {
        format!("{}{path}", self.pool().slots()[worker].url)
    }

    /// The version check of a reply: current, or older within `max_staleness`.
    fn check_version(&self, url: &str, reply: &Reply, current: u64) -> Result<bool> {
        let max = self.cfg.max_staleness;
        if reply.version == current {
            return Ok(false);
        }
        if reply.version < current && current - reply.version <= max {
            return Ok(true);
        }
        Err(FleetError::Stale {
            url: url.to_string(),
            got: reply.version.to_string(),
            expected: current,
            max_staleness: max,
        })
    }
}

impl Fleet {
    /// A client for the workers of `cfg` (none contacted yet: call [`Fleet::sync`] first).
    pub fn new(cfg: FleetConfig, model: ModelFacts) -> Result<Self> {
        cfg.validate()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(FleetError::Runtime)?;
        let client = {
            let _guard = runtime.enter();
            JsonClient::new(cfg.api_key.clone())
        };
        let shared = Arc::new(Shared {
            client,
            pool: Mutex::new(WorkerPool::new(&cfg.urls)),
            cfg,
            model,
            next_rid: AtomicU64::new(0),
        });
        Ok(Fleet {
            runtime,
            shared,
            version: 0,
            synced_dir: None,
        })
    }

    /// The weight version replies must come from.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Workers up now.
    pub fn workers_up(&self) -> usize {
        self.shared.pool().up_count()
    }

    /// The workers' state (URL, up, version, outstanding requests).
    pub fn pool(&self) -> WorkerPool {
        self.shared.pool().clone()
    }

    /// Loads the checkpoint `dir` as weight version `version` on every worker
    /// (`/pause_generation`, `/update_weights_from_disk`, `/continue_generation`, then
    /// `/get_weight_version` must say `version`). A worker that fails is taken out (it
    /// rejoins later); the sync fails only when no worker is left.
    pub fn sync(&mut self, dir: &Path, version: u64) -> Result<()> {
        self.version = version;
        self.synced_dir = Some(dir.to_path_buf());
        let n = self.shared.pool().slots().len();
        let shared = Arc::clone(&self.shared);
        let dir = dir.to_path_buf();
        self.runtime.block_on(async move {
            let mut set = JoinSet::new();
            for w in 0..n {
                let (shared, dir) = (Arc::clone(&shared), dir.clone());
                set.spawn(async move { (w, sync_worker(&shared, w, &dir, version).await) });
            }
            while let Some(done) = set.join_next().await {
                let Ok((w, res)) = done else { continue };
                match res {
                    Ok(()) => shared.pool().mark_up(w, version),
                    Err(e) => shared.pool().mark_down(w, e.to_string()),
                }
            }
        });
        self.require_workers()
    }

    /// Probes every worker that is out with `/health`; one that answers is synced to the
    /// current version and rejoins. Returns the workers up afterwards.
    pub fn rejoin(&mut self) -> usize {
        let Some(dir) = self.synced_dir.clone() else {
            return self.workers_up();
        };
        let down: Vec<usize> = {
            let pool = self.shared.pool();
            (0..pool.slots().len())
                .filter(|&i| !pool.slots()[i].up)
                .collect()
        };
        if down.is_empty() {
            return self.workers_up();
        }
        let shared = Arc::clone(&self.shared);
        let version = self.version;
        self.runtime.block_on(async move {
            let mut set = JoinSet::new();
            for w in down {
                let (shared, dir) = (Arc::clone(&shared), dir.clone());
                set.spawn(async move {
                    let url = shared.url(w, "/health");
                    let timeout = PROBE_TIMEOUT.min(shared.cfg.request_timeout);
                    let res = match shared.client.get(&url, timeout).await {
                        Ok(_) => sync_worker(&shared, w, &dir, version).await,
                        Err(e) => Err(e),
                    };
                    (w, res)
                });
            }
            while let Some(done) = set.join_next().await {
                let Ok((w, res)) = done else { continue };
                match res {
                    Ok(()) => shared.pool().mark_up(w, version),
                    Err(e) => {
                        tracing::debug!(error = %e, "rollout worker still out");
                        shared.pool().mark_down(w, e.to_string());
                    }
                }
            }
        });
        self.workers_up()
    }

    /// One checked result per request, in request order. Workers that were out are
    /// probed first; a request whose worker fails goes to another one, at most
    /// `max_retries` times; the batch fails only when a request runs out of attempts or
    /// no worker is left.
    pub fn generate(
        &mut self,
        requests: Vec<GenerateRequest>,
    ) -> Result<(Vec<GenerateResult>, RolloutStats)> {
        self.rejoin();
        self.require_workers()?;
        let n = requests.len();
        let shared = Arc::clone(&self.shared);
        let version = self.version;
        let counters = Arc::new(Counters::default());
        let counter = Arc::clone(&counters);
        let outcome = self.runtime.block_on(async move {
            let permits = Arc::new(Semaphore::new(shared.cfg.max_in_flight));
            let mut set = JoinSet::new();
            for (i, req) in requests.into_iter().enumerate() {
                let (shared, permits, counter) = (
                    Arc::clone(&shared),
                    Arc::clone(&permits),
                    Arc::clone(&counter),
                );
                set.spawn(async move {
                    let _permit = permits.acquire_owned().await;
                    (i, run_request(&shared, i, &req, version, &counter).await)
                });
            }
            let mut slots: Vec<Option<(GenerateResult, bool)>> = vec![None; n];
            while let Some(done) = set.join_next().await {
                let (i, res) = done.map_err(|e| FleetError::Transport {
                    url: "(local)".into(),
                    message: format!("request task failed: {e}"),
                })?;
                match res {
                    Ok(r) => {
                        if slots[i].replace(r).is_some() {
                            return Err(FleetError::Transport {
                                url: "(local)".into(),
                                message: format!("request {i} answered twice"),
                            });
                        }
                    }
                    Err(e) => {
                        set.abort_all();
                        return Err(e);
                    }
                }
            }
            Ok::<_, FleetError>(slots)
        })?;
        let mut results = Vec::with_capacity(n);
        let mut stale = 0;
        for (i, slot) in outcome.into_iter().enumerate() {
            let (mut r, was_stale) = slot.ok_or_else(|| FleetError::Transport {
                url: "(local)".into(),
                message: format!("request {i} got no result"),
            })?;
            r.id = i as u64;
            stale += usize::from(was_stale);
            results.push(r);
        }
        let stats = RolloutStats {
            retries: counters.retries.load(Ordering::Relaxed),
            stale,
            results: results.len(),
            workers_up: self.workers_up(),
            decode_s: counters.decode_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        };
        Ok((results, stats))
    }

    fn require_workers(&self) -> Result<()> {
        let pool = self.shared.pool();
        if pool.up_count() == 0 {
            return Err(FleetError::NoWorkers {
                total: pool.slots().len(),
                detail: pool.down_summary(),
            });
        }
        Ok(())
    }
}

/// One request until it succeeds or runs out of attempts; the result and whether it came
/// from older weights.
async fn run_request(
    shared: &Shared,
    index: usize,
    req: &GenerateRequest,
    version: u64,
    counters: &Counters,
) -> Result<(GenerateResult, bool)> {
    let rid = format!(
        "r3-train-{}-{index}",
        shared.next_rid.fetch_add(1, Ordering::Relaxed)
    );
    let body = generate_body(req, &rid);
    let mut avoid = Vec::new();
    let mut attempts = 0u32;
    loop {
        let picked = shared.pool().acquire(&avoid);
        let Some(w) = picked else {
            let pool = shared.pool();
            return Err(FleetError::NoWorkers {
                total: pool.slots().len(),
                detail: pool.down_summary(),
            });
        };
        attempts += 1;
        let url = shared.url(w, "/generate");
        let res = match shared
            .client
            .post(&url, &body, shared.cfg.request_timeout)
            .await
        {
            Ok(v) => timed_decode(&url, &v, req, shared, counters).and_then(|reply| {
                if reply.result.finish == r3_rollout::FinishReason::Abort {
                    return Err(FleetError::BadReply {
                        url: url.clone(),
                        reason: "the request was aborted by the worker".into(),
                    });
                }
                let stale = shared.check_version(&url, &reply, version)?;
                Ok((reply.result, stale))
            }),
            Err(e) => Err(e),
        };
        shared.pool().release(w);
        match res {
            Ok(r) => return Ok(r),
            Err(e) if e.is_worker_fault() => {
                tracing::warn!(request = index, attempt = attempts, error = %e, "rollout request failed; retrying on another worker");
                shared.pool().mark_down(w, e.to_string());
                avoid.push(w);
                if attempts > shared.cfg.max_retries {
                    return Err(FleetError::RetriesExhausted {
                        request: index,
                        attempts,
                        last: Box::new(e),
                    });
                }
                counters.retries.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => return Err(e),
        }
    }
}

/// [`decode_reply`], its time added to the batch's decode counter.
fn timed_decode(
    url: &str,
    v: &Value,
    req: &GenerateRequest,
    shared: &Shared,
    counters: &Counters,
) -> Result<Reply> {
    let started = std::time::Instant::now();
    let decoded = decode_reply(url, v, req, &shared.model);
    let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
    counters.decode_ns.fetch_add(ns, Ordering::Relaxed);
    decoded
}

/// Pause, load `dir` as `version`, continue, and confirm the version on worker `w`.
async fn sync_worker(shared: &Shared, w: usize, dir: &Path, version: u64) -> Result<()> {
    let timeout = shared.cfg.request_timeout;
    let label = version.to_string();
    let client = &shared.client;
    let fail = |url: &str, reason: String| FleetError::Sync {
        url: url.to_string(),
        version,
        reason,
    };
    client
        .post(&shared.url(w, "/pause_generation"), &json!({}), timeout)
        .await?;
    let url = shared.url(w, "/update_weights_from_disk");
    let body = json!({
        "model_path": dir.display().to_string(),
        "weight_version": label,
        "abort_all_requests": true,
    });
    let reply = client
        .post(&url, &body, timeout.max(MIN_LOAD_TIMEOUT))
        .await;
    // Generation must continue even when the load failed, so the worker is not left paused.
    let resumed = client
        .post(&shared.url(w, "/continue_generation"), &json!({}), timeout)
        .await;
    let reply = reply?;
    resumed?;
    if reply.get("success").and_then(Value::as_bool) == Some(false) {
        let msg = reply.get("message").cloned().unwrap_or(Value::Null);
        return Err(fail(
            &url,
            format!("update_weights_from_disk refused: {msg}"),
        ));
    }
    let url = shared.url(w, "/get_weight_version");
    let got = client.get(&url, timeout).await?;
    match got.get("weight_version").and_then(parse_version) {
        Some(v) if v == version => Ok(()),
        _ => Err(fail(
            &url,
            format!(
                "the worker reports weight_version {}",
                got["weight_version"]
            ),
        )),
    }
}
