//! The rollout fleet: SGLang-compatible workers driven over HTTP from a tokio runtime the
//! fleet owns. [`Fleet::generate`] sends every request as its own `/generate` call (many
//! in flight, least-outstanding-requests balancing), retries a request whose worker fails
//! on another worker, and returns exactly one checked result per request, in order.
//! [`Fleet::sync`] moves every worker to a new weight version; a worker that was out is
//! probed with `/health` before each batch and rejoins once a sync brings it to the
//! current version.
//!
//! A request a worker aborts (a weight update with `abort_all_requests`, `/abort_request`,
//! `/pause_generation` in abort mode) is continued after the sync from the tokens it has
//! ([`crate::partial`]), or with `partial = restart` sent again from its prompt. `sync`
//! and `generate` take `&self`, so a sync may run while a batch is in flight (one thread
//! rolling out, another training and syncing); continuations wait until the sync is done.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use r3_rollout::{GenerateRequest, GenerateResult};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::config::{FleetConfig, ModelFacts, PartialMode};
use crate::error::{FleetError, Result};
use crate::http::JsonClient;
use crate::partial::Pieces;
use crate::pool::WorkerPool;
use crate::wire::{decode_reply, generate_body, parse_version, Reply};

/// Longest wait for `/health` when probing a worker that was out.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Shortest wait allowed for `/update_weights_from_disk` (loading weights takes a while).
const MIN_LOAD_TIMEOUT: Duration = Duration::from_secs(120);
/// Aborts in a row that bring no new token before a request is given up (a worker that
/// aborts everything it gets would otherwise be asked forever).
const MAX_IDLE_ABORTS: u32 = 8;

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
    /// Continuations sent for requests a worker aborted (`partial = resume`).
    pub partial_resumed: u64,
    /// Aborted requests sent again from their prompt (`partial = restart`).
    pub partial_restarted: u64,
    /// Results whose pieces came from more than one weight version.
    pub spanning: usize,
    /// Client seconds building request bodies, summed over requests.
    pub encode_s: f64,
    /// Client-observed seconds of the `/generate` calls (send to parsed reply), summed.
    pub request_s: f64,
    /// The workers' own time for those calls (`meta_info.e2e_latency`: from receiving the
    /// request to having its result, before encoding the reply), summed over the calls
    /// that report it.
    pub server_s: f64,
    /// Client-observed seconds of the calls that report `e2e_latency`, summed.
    pub timed_request_s: f64,
}

/// Counters the request tasks of one batch add to.
#[derive(Debug, Default)]
struct Counters {
    retries: AtomicU64,
    decode_ns: AtomicU64,
    resumed: AtomicU64,
    restarted: AtomicU64,
    encode_ns: AtomicU64,
    request_ns: AtomicU64,
    server_ns: AtomicU64,
    timed_request_ns: AtomicU64,
}

/// One finished request: the merged result and its pieces' weight versions.
struct Done {
    result: GenerateResult,
    versions: Vec<u64>,
}

impl RolloutStats {
    /// What HTTP, JSON and the client's checks cost as a fraction of the time requests
    /// took as the client saw them: (call time − the worker's own time + encode + decode)
    /// over (call time + encode + decode), over the calls whose worker reports its time.
    pub fn wire_overhead_frac(&self) -> Option<f64> {
        if self.timed_request_s <= 0.0 {
            return None;
        }
        let client = self.timed_request_s + self.encode_s + self.decode_s;
        let overhead =
            (self.timed_request_s - self.server_s).max(0.0) + self.encode_s + self.decode_s;
        Some(overhead / client)
    }

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
    /// Checkpoint of the current version, for bringing a returning worker up to date.
    synced_dir: Mutex<Option<PathBuf>>,
}

/// What the request tasks share.
struct Shared {
    client: JsonClient,
    pool: Mutex<WorkerPool>,
    cfg: FleetConfig,
    model: ModelFacts,
    next_rid: AtomicU64,
    /// Weight version every new reply should come from (set when a sync starts).
    version: AtomicU64,
    /// Version of the last finished sync. A request sent during a sync may reach a worker
    /// before its pause and be answered from the old weights, so staleness is judged
    /// against this, not against `version`.
    settled: AtomicU64,
    /// Held (write) for the length of a sync; continuations of aborted requests take it
    /// (read) first, so they run on the new weights.
    sync_gate: tokio::sync::RwLock<()>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("urls", &self.shared.cfg.urls)
            .field("version", &self.version())
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

    /// The version check of a reply to a request sent when the last finished sync was
    /// `sent`: not newer than the current version, and at most `max_staleness` older
    /// than `sent`.
    fn check_version(&self, url: &str, reply: &Reply, sent: u64) -> Result<()> {
        let max = self.cfg.max_staleness;
        let current = self.version.load(Ordering::SeqCst);
        if reply.version <= current && reply.version.saturating_add(max) >= sent {
            return Ok(());
        }
        Err(FleetError::Stale {
            url: url.to_string(),
            got: reply.version.to_string(),
            expected: sent,
            max_staleness: max,
        })
    }
}

impl Fleet {
    /// A client for the workers of `cfg` (none contacted yet: call [`Fleet::sync`] first).
    pub fn new(cfg: FleetConfig, model: ModelFacts) -> Result<Self> {
        cfg.validate()?;
        // Multi-threaded so that `sync` and `generate` may block on it from two threads.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
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
            version: AtomicU64::new(0),
            settled: AtomicU64::new(0),
            sync_gate: tokio::sync::RwLock::new(()),
        });
        Ok(Fleet {
            runtime,
            shared,
            synced_dir: Mutex::new(None),
        })
    }

    /// The weight version replies must come from.
    pub fn version(&self) -> u64 {
        self.shared.version.load(Ordering::SeqCst)
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
    pub fn sync(&self, dir: &Path, version: u64) -> Result<()> {
        *self.synced_dir.lock().unwrap_or_else(|p| p.into_inner()) = Some(dir.to_path_buf());
        let n = self.shared.pool().slots().len();
        let shared = Arc::clone(&self.shared);
        let dir = dir.to_path_buf();
        self.runtime.block_on(async move {
            let _gate = shared.sync_gate.write().await;
            shared.version.store(version, Ordering::SeqCst);
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
            shared.settled.store(version, Ordering::SeqCst);
        });
        self.require_workers()
    }

    /// Probes every worker that is out with `/health`; one that answers is synced to the
    /// current version and rejoins. Returns the workers up afterwards.
    pub fn rejoin(&self) -> usize {
        let synced = self
            .synced_dir
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(dir) = synced else {
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
        let version = self.version();
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
        &self,
        requests: Vec<GenerateRequest>,
    ) -> Result<(Vec<GenerateResult>, RolloutStats)> {
        self.rejoin();
        self.require_workers()?;
        let n = requests.len();
        let shared = Arc::clone(&self.shared);
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
                    (i, run_request(&shared, i, &req, &counter).await)
                });
            }
            let mut slots: Vec<Option<Done>> = (0..n).map(|_| None).collect();
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
        let (mut stale, mut spanning) = (0, 0);
        // Stale: some piece came from weights older than the trainer's at the batch's end.
        let current = self.version();
        for (i, slot) in outcome.into_iter().enumerate() {
            let done = slot.ok_or_else(|| FleetError::Transport {
                url: "(local)".into(),
                message: format!("request {i} got no result"),
            })?;
            let mut r = done.result;
            r.id = i as u64;
            stale += usize::from(done.versions.iter().any(|&v| v < current));
            spanning += usize::from(done.versions.windows(2).any(|w| w[0] != w[1]));
            results.push(r);
        }
        let stats = RolloutStats {
            retries: counters.retries.load(Ordering::Relaxed),
            stale,
            results: results.len(),
            workers_up: self.workers_up(),
            decode_s: counters.decode_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            partial_resumed: counters.resumed.load(Ordering::Relaxed),
            partial_restarted: counters.restarted.load(Ordering::Relaxed),
            spanning,
            encode_s: secs(&counters.encode_ns),
            request_s: secs(&counters.request_ns),
            server_s: secs(&counters.server_ns),
            timed_request_s: secs(&counters.timed_request_ns),
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

/// One request until it completes or runs out of attempts: worker faults are retried on
/// another worker; an aborted piece is continued (or restarted) after any sync under way.
async fn run_request(
    shared: &Shared,
    index: usize,
    req: &GenerateRequest,
    counters: &Counters,
) -> Result<Done> {
    let merge = shared.cfg.merge;
    let mut pieces = Pieces::new(req.clone());
    let mut avoid = Vec::new();
    let mut attempts = 0u32;
    let mut idle_aborts = 0u32;
    let mut after_abort = false;
    loop {
        if after_abort {
            drop(shared.sync_gate.read().await);
        }
        let piece_req = pieces.next_request(merge);
        let rid = format!(
            "r3-train-{}-{index}",
            shared.next_rid.fetch_add(1, Ordering::Relaxed)
        );
        let encoding = std::time::Instant::now();
        let body = generate_body(&piece_req, &rid);
        add_elapsed(&counters.encode_ns, encoding);
        let sent = shared.settled.load(Ordering::SeqCst);
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
        let calling = std::time::Instant::now();
        let res = match shared
            .client
            .post(&url, &body, shared.cfg.request_timeout)
            .await
        {
            Ok(v) => {
                let call = add_elapsed(&counters.request_ns, calling);
                if let Some(server) = server_latency(&v) {
                    counters.server_ns.fetch_add(server, Ordering::Relaxed);
                    counters.timed_request_ns.fetch_add(call, Ordering::Relaxed);
                }
                timed_decode(&url, &v, &piece_req, shared, counters).and_then(|reply| {
                    shared.check_version(&url, &reply, sent)?;
                    Ok(reply)
                })
            }
            Err(e) => Err(e),
        };
        shared.pool().release(w);
        match res {
            Ok(reply) => {
                let aborted = reply.result.finish == r3_rollout::FinishReason::Abort;
                let progress = !reply.result.output_ids.is_empty();
                if aborted && shared.cfg.partial == PartialMode::Restart {
                    tracing::debug!(request = index, worker = %url, "request aborted; restarting it");
                    pieces = Pieces::new(req.clone());
                    counters.restarted.fetch_add(1, Ordering::Relaxed);
                } else {
                    let complete =
                        pieces
                            .add(reply.result, reply.version, merge)
                            .map_err(|reason| FleetError::BadReply {
                                url: url.clone(),
                                reason,
                            })?;
                    if complete {
                        let versions = pieces.versions().to_vec();
                        let result = pieces.finish().ok_or_else(|| FleetError::BadReply {
                            url: url.clone(),
                            reason: "complete request without a result".into(),
                        })?;
                        return Ok(Done { result, versions });
                    }
                    tracing::debug!(request = index, worker = %url, generated = pieces.generated(), "request aborted; resuming it");
                    counters.resumed.fetch_add(1, Ordering::Relaxed);
                }
                idle_aborts = if progress && shared.cfg.partial == PartialMode::Resume {
                    0
                } else {
                    idle_aborts + 1
                };
                if idle_aborts > MAX_IDLE_ABORTS {
                    return Err(FleetError::BadReply {
                        url,
                        reason: format!(
                            "request {index} aborted {idle_aborts} times in a row without progress"
                        ),
                    });
                }
                attempts = 0;
                avoid.clear();
                after_abort = true;
            }
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

/// Adds the nanoseconds since `from` to `counter`; returns them.
fn add_elapsed(counter: &AtomicU64, from: std::time::Instant) -> u64 {
    let ns = u64::try_from(from.elapsed().as_nanos()).unwrap_or(u64::MAX);
    counter.fetch_add(ns, Ordering::Relaxed);
    ns
}

fn secs(counter: &AtomicU64) -> f64 {
    counter.load(Ordering::Relaxed) as f64 * 1e-9
}

/// `meta_info.e2e_latency` of a reply (one object or a one-element list), in nanoseconds.
fn server_latency(v: &Value) -> Option<u64> {
    let reply = match v {
        Value::Array(items) => items.first()?,
        other => other,
    };
    let s = reply.get("meta_info")?.get("e2e_latency")?.as_f64()?;
    (s.is_finite() && s >= 0.0).then_some((s * 1e9) as u64)
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
