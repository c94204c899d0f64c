//! The rollout fleet: SGLang-compatible workers driven over HTTP from a tokio runtime the
//! fleet owns. [`Fleet::generate_each`] sends every request as its own `/generate` call
//! (many in flight, least-outstanding-requests balancing), retries a request whose worker
//! fails on another worker, and returns exactly one outcome per request, in order: a checked
//! result, or the error of that request alone (see [`crate::error`] for whose fault is
//! whose); [`Fleet::generate`] is the same batch as all results or one error that keeps the
//! finished ones. [`Fleet::sync`] moves every worker to a new weight version; a worker that
//! was out is probed with `/health` (its status only) before each batch and rejoins once it
//! has loaded the current version.
//!
//! A request a worker aborts (a weight update with `abort_all_requests`, `/abort_request`,
//! `/pause_generation` in abort mode) is continued after the sync from the tokens it has
//! ([`crate::partial`]), or with `partial = restart` sent again from its prompt. `sync`
//! and `generate` take `&self`, so a sync may run while a batch is in flight (one thread
//! rolling out, another training and syncing); continuations wait until the sync is done.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use r3_rollout::{GenerateRequest, GenerateResult};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::config::{FleetConfig, ModelFacts, PartialMode};
use crate::error::{BatchFailure, FleetError, Result};
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
    /// Results returned (requests that finished).
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

impl RolloutStats {
    /// The cost of this batch and a `later` one taken together (two rollout rounds of one
    /// RL step): counts and seconds summed, the workers up those at the later one's end.
    pub fn then(self, later: RolloutStats) -> RolloutStats {
        RolloutStats {
            retries: self.retries + later.retries,
            stale: self.stale + later.stale,
            results: self.results + later.results,
            workers_up: later.workers_up,
            decode_s: self.decode_s + later.decode_s,
            partial_resumed: self.partial_resumed + later.partial_resumed,
            partial_restarted: self.partial_restarted + later.partial_restarted,
            spanning: self.spanning + later.spanning,
            encode_s: self.encode_s + later.encode_s,
            request_s: self.request_s + later.request_s,
            server_s: self.server_s + later.server_s,
            timed_request_s: self.timed_request_s + later.timed_request_s,
        }
    }
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
    /// (read) first, so they run on the new weights, and so does a rejoin, so it loads the
    /// checkpoint and version of one finished sync.
    sync_gate: tokio::sync::RwLock<()>,
    /// The last sync's checkpoint and its version (for bringing a returning worker up to
    /// date), written together while the gate is held.
    synced: Mutex<Option<(PathBuf, u64)>>,
}

/// A request's hold on a worker, which counts as outstanding on it until the lease is
/// dropped — also when the request's task is cancelled in the middle of its call.
struct Lease<'a> {
    shared: &'a Shared,
    worker: usize,
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.shared.pool().release(self.worker);
    }
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

    fn synced(&self) -> MutexGuard<'_, Option<(PathBuf, u64)>> {
        self.synced.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn url(&self, worker: usize, path: &str) -> String {
        format!("{}{path}", self.pool().slots()[worker].url)
    }

    /// The least-loaded worker that is up (see [`WorkerPool::acquire`]), held until the
    /// lease is dropped.
    fn acquire(&self, avoid: &[usize]) -> Option<Lease<'_>> {
        let worker = self.pool().acquire(avoid)?;
        Some(Lease {
            shared: self,
            worker,
        })
    }

    /// The error for "no worker is up".
    fn no_workers(&self) -> FleetError {
        let pool = self.pool();
        FleetError::NoWorkers {
            total: pool.slots().len(),
            detail: pool.down_summary(),
        }
    }
}

/// The version check of a reply from weight version `got` to a request sent when the last
/// finished sync was `sent`, the trainer being at `current` now: not newer than `current`,
/// and at most `max_staleness` older than `sent`.
fn check_version(url: &str, got: u64, sent: u64, current: u64, max_staleness: u64) -> Result<()> {
    if got <= current && got.saturating_add(max_staleness) >= sent {
        return Ok(());
    }
    Err(FleetError::Stale {
        url: url.to_string(),
        got: got.to_string(),
        current,
        sent,
        max_staleness,
    })
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
            synced: Mutex::new(None),
        });
        Ok(Fleet { runtime, shared })
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
        let n = self.shared.pool().slots().len();
        let shared = Arc::clone(&self.shared);
        let dir = dir.to_path_buf();
        self.runtime.block_on(async move {
            let _gate = shared.sync_gate.write().await;
            shared.version.store(version, Ordering::SeqCst);
            *shared.synced() = Some((dir.clone(), version));
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

    /// Probes every worker that is out with `/health` (a 2xx status, whatever the body:
    /// SGLang's is empty); one that answers is synced to the last sync's checkpoint and
    /// version and rejoins. When a worker is out, a sync under way finishes first (with all
    /// workers up nothing waits). Returns the workers up afterwards.
    pub fn rejoin(&self) -> usize {
        if self.workers_up() == self.shared.pool().slots().len() {
            return self.workers_up();
        }
        let shared = Arc::clone(&self.shared);
        self.runtime.block_on(async move {
            let _gate = shared.sync_gate.read().await;
            let Some((dir, version)) = shared.synced().clone() else {
                return;
            };
            let down: Vec<usize> = {
                let pool = shared.pool();
                (0..pool.slots().len())
                    .filter(|&i| !pool.slots()[i].up)
                    .collect()
            };
            let mut set = JoinSet::new();
            for w in down {
                let (shared, dir) = (Arc::clone(&shared), dir.clone());
                set.spawn(async move {
                    let url = shared.url(w, "/health");
                    let timeout = PROBE_TIMEOUT.min(shared.cfg.request_timeout);
                    let res = match shared.client.probe(&url, timeout).await {
                        Ok(()) => sync_worker(&shared, w, &dir, version).await,
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

    /// One checked result per request, in request order, or an error. Workers that were
    /// out are probed first. A request whose worker fails goes to another one, at most
    /// `max_retries` times; a request at fault fails alone (see [`crate::error`]). Every
    /// request runs to its end: when some fail, the error is [`FleetError::Batch`], which
    /// keeps the finished results and names each failure. With no worker up at the start
    /// the error is [`FleetError::NoWorkers`].
    pub fn generate(
        &self,
        requests: Vec<GenerateRequest>,
    ) -> Result<(Vec<GenerateResult>, RolloutStats)> {
        let (outcomes, stats) = self.generate_each(requests)?;
        if outcomes.iter().all(Result::is_ok) {
            return Ok((outcomes.into_iter().filter_map(Result::ok).collect(), stats));
        }
        Err(FleetError::Batch(Box::new(BatchFailure::from_outcomes(
            outcomes, stats,
        ))))
    }

    /// The batch of [`Fleet::generate`] as one outcome per request, in request order: a
    /// failed request does not cost the others their results. The error is only for a
    /// batch that cannot start (no worker up).
    pub fn generate_each(
        &self,
        requests: Vec<GenerateRequest>,
    ) -> Result<(Vec<Result<GenerateResult>>, RolloutStats)> {
        self.rejoin();
        self.require_workers()?;
        let n = requests.len();
        let shared = Arc::clone(&self.shared);
        let counters = Arc::new(Counters::default());
        let counter = Arc::clone(&counters);
        let outcomes = self.runtime.block_on(async move {
            let permits = Arc::new(Semaphore::new(shared.cfg.max_in_flight));
            let mut set = JoinSet::new();
            let mut index_of = HashMap::with_capacity(n);
            for (i, req) in requests.into_iter().enumerate() {
                let (shared, permits, counter) = (
                    Arc::clone(&shared),
                    Arc::clone(&permits),
                    Arc::clone(&counter),
                );
                let task = set.spawn(async move {
                    let _permit = permits.acquire_owned().await;
                    run_request(&shared, i, &req, &counter).await
                });
                index_of.insert(task.id(), i);
            }
            let mut slots: Vec<Option<Result<Done>>> = (0..n).map(|_| None).collect();
            while let Some(joined) = set.join_next_with_id().await {
                let (id, outcome) = match joined {
                    Ok((id, outcome)) => (id, outcome),
                    Err(e) => (
                        e.id(),
                        Err(local(format!("the request's task failed: {e}"))),
                    ),
                };
                if let Some(&i) = index_of.get(&id) {
                    slots[i] = Some(outcome);
                }
            }
            slots
        });
        // Stale: some piece came from weights older than the trainer's at the batch's end.
        let current = self.version();
        let (mut stale, mut spanning, mut finished) = (0, 0, 0);
        let mut results = Vec::with_capacity(n);
        for (i, slot) in outcomes.into_iter().enumerate() {
            let outcome = slot.unwrap_or_else(|| Err(local(format!("request {i} got no result"))));
            results.push(outcome.map(|done| {
                stale += usize::from(done.versions.iter().any(|&v| v < current));
                spanning += usize::from(done.versions.windows(2).any(|w| w[0] != w[1]));
                finished += 1;
                let mut r = done.result;
                r.id = i as u64;
                r
            }));
        }
        let stats = RolloutStats {
            retries: counters.retries.load(Ordering::Relaxed),
            stale,
            results: finished,
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
        if self.shared.pool().up_count() == 0 {
            return Err(self.shared.no_workers());
        }
        Ok(())
    }
}

/// An error of the client itself (not of a worker).
fn local(message: String) -> FleetError {
    FleetError::Transport {
        url: "(local)".into(),
        message,
    }
}

/// A worker fault one request met: the worker, its answer (see [`FleetError::answer`]) and
/// the reason it was taken out for.
struct Fault {
    worker: usize,
    answer: Option<String>,
    reason: String,
}

/// One piece's tries: the attempts so far, the workers that failed it and how.
#[derive(Default)]
struct Tries {
    attempts: u32,
    avoid: Vec<usize>,
    faults: Vec<Fault>,
}

/// One request until it completes or fails: worker faults are retried on another worker; a
/// request fault (HTTP 400 / 413 / 422, or the same answer from two workers) fails it at once; an aborted
/// piece is continued (or restarted) after any sync under way; pieces that cannot be merged
/// count as the last worker's bad reply, and the request starts again from its prompt.
async fn run_request(
    shared: &Shared,
    index: usize,
    req: &GenerateRequest,
    counters: &Counters,
) -> Result<Done> {
    let merge = shared.cfg.merge;
    let mut pieces = Pieces::new(req.clone());
    let mut tries = Tries::default();
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
        let lease = shared
            .acquire(&tries.avoid)
            .ok_or_else(|| shared.no_workers())?;
        let w = lease.worker;
        tries.attempts += 1;
        let url = shared.url(w, "/generate");
        let res = call_generate(shared, &url, &body, &piece_req, sent, counters).await;
        drop(lease);
        let fault = match res {
            Err(e) => e,
            Ok(reply) => {
                let aborted = reply.result.finish == r3_rollout::FinishReason::Abort;
                let progress = !reply.result.output_ids.is_empty();
                if aborted && shared.cfg.partial == PartialMode::Restart {
                    tracing::debug!(request = index, worker = %url, "request aborted; restarting it");
                    pieces = Pieces::new(req.clone());
                    counters.restarted.fetch_add(1, Ordering::Relaxed);
                } else {
                    match pieces.add(reply.result, reply.version, merge) {
                        Ok(true) => {
                            let versions = pieces.versions().to_vec();
                            let result = pieces.finish().ok_or_else(|| FleetError::BadReply {
                                url: url.clone(),
                                reason: "complete request without a result".into(),
                            })?;
                            return Ok(Done { result, versions });
                        }
                        Ok(false) => {
                            tracing::debug!(request = index, worker = %url, generated = pieces.generated(), "request aborted; resuming it");
                            counters.resumed.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(reason) => {
                            // What the pieces hold cannot be trusted: from the prompt again.
                            pieces = Pieces::new(req.clone());
                            let fault = FleetError::BadReply { url, reason };
                            handle_fault(shared, index, w, fault, &mut tries, counters)?;
                            continue;
                        }
                    }
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
                tries = Tries::default();
                after_abort = true;
                continue;
            }
        };
        handle_fault(shared, index, w, fault, &mut tries, counters)?;
    }
}

/// Decides what `fault` from worker `w` means for request `index`: `Ok` to try again on
/// another worker (`w` taken out), or the request's final error. HTTP 400 / 413 / 422 is
/// the request's fault; so is an answer another worker already gave for this piece (see
/// [`FleetError::answer`]), and that worker, taken out for it, comes back. Neither takes a
/// worker out. Where no other worker could take the retry, `w` is asked again instead
/// ([`retry_on_the_last_worker`]).
fn handle_fault(
    shared: &Shared,
    index: usize,
    w: usize,
    fault: FleetError,
    tries: &mut Tries,
    counters: &Counters,
) -> Result<()> {
    if fault.is_request_fault() {
        return Err(FleetError::RequestFailed {
            request: index,
            why: "the worker refused it: HTTP 400 / 413 / 422 is the request's own fault, no \
                  worker is taken out"
                .into(),
            error: Box::new(fault),
        });
    }
    if !fault.is_worker_fault() {
        return Err(fault);
    }
    let answer = fault.answer();
    let same = answer.as_ref().and_then(|a| {
        tries
            .faults
            .iter()
            .find(|f| f.worker != w && f.answer.as_ref() == Some(a))
    });
    if let Some(first) = same {
        // During a sync the first worker may still hold the settled version, or already the
        // announced one: either is current enough to take requests.
        let settled = shared.settled.load(Ordering::SeqCst);
        let version = shared.version.load(Ordering::SeqCst);
        let back = shared
            .pool()
            .reinstate(first.worker, &first.reason, settled..=version);
        let stay = if back {
            "both workers stay up"
        } else {
            "the first stays out (taken out since for another reason, or behind the weights)"
        };
        return Err(FleetError::RequestFailed {
            request: index,
            why: format!(
                "{} gave the same answer before: the request's own fault, {stay}",
                shared.url(first.worker, "")
            ),
            error: Box::new(fault),
        });
    }
    // Only an HTTP error answer: a reply failing r3's checks from the only worker is more
    // likely that worker's bug than the request's (it would fail again the same way), so it
    // takes the worker out and fails the batch, as before, rather than drop groups quietly.
    let http_answer = matches!(fault, FleetError::Status { .. }) && answer.is_some();
    if http_answer && !shared.pool().another_up(w, &tries.avoid) {
        return retry_on_the_last_worker(shared, index, w, fault, answer, tries, counters);
    }
    tracing::warn!(request = index, attempt = tries.attempts, error = %fault, "rollout request failed; retrying on another worker");
    let reason = fault.to_string();
    shared.pool().mark_down(w, reason.clone());
    tries.avoid.push(w);
    tries.faults.push(Fault {
        worker: w,
        answer,
        reason,
    });
    if tries.attempts > shared.cfg.max_retries {
        return Err(FleetError::RetriesExhausted {
            request: index,
            attempts: tries.attempts,
            last: Box::new(fault),
        });
    }
    counters.retries.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// [`handle_fault`] where no other worker could take the retry (a fleet of one, or every
/// other worker out or already tried): taking `w` out would leave the request, and every
/// request after it, no worker at all. An HTTP error answer about the request (a 500 with
/// its body, say) is asked of `w` once more instead, and the same answer from it twice is
/// the request's fault (as the same answer from two workers is); `w` stays up either way.
/// A worker broken for every request then fails each request alone, as a request fault,
/// where before it failed the batch.
fn retry_on_the_last_worker(
    shared: &Shared,
    index: usize,
    w: usize,
    fault: FleetError,
    answer: Option<String>,
    tries: &mut Tries,
    counters: &Counters,
) -> Result<()> {
    let again = tries
        .faults
        .iter()
        .any(|f| f.worker == w && f.answer.is_some() && f.answer == answer);
    if again {
        return Err(FleetError::RequestFailed {
            request: index,
            why: format!(
                "{} gave the same answer twice and no other worker could take the request: \
                 the request's own fault, the worker stays up",
                shared.url(w, "")
            ),
            error: Box::new(fault),
        });
    }
    if tries.attempts > shared.cfg.max_retries {
        return Err(FleetError::RetriesExhausted {
            request: index,
            attempts: tries.attempts,
            last: Box::new(fault),
        });
    }
    tracing::warn!(request = index, attempt = tries.attempts, error = %fault, "rollout request failed and no other worker can take it; asking the same worker again");
    tries.faults.push(Fault {
        worker: w,
        answer,
        reason: fault.to_string(),
    });
    counters.retries.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// One `/generate` call: the checked reply (version included) of the worker at `url`.
async fn call_generate(
    shared: &Shared,
    url: &str,
    body: &Value,
    piece_req: &GenerateRequest,
    sent: u64,
    counters: &Counters,
) -> Result<Reply> {
    let calling = std::time::Instant::now();
    let v = shared
        .client
        .post(url, body, shared.cfg.request_timeout)
        .await?;
    let call = add_elapsed(&counters.request_ns, calling);
    if let Some(server) = server_latency(&v) {
        counters.server_ns.fetch_add(server, Ordering::Relaxed);
        counters.timed_request_ns.fetch_add(call, Ordering::Relaxed);
    }
    let reply = timed_decode(url, &v, piece_req, shared, counters)?;
    let current = shared.version.load(Ordering::SeqCst);
    check_version(url, reply.version, sent, current, shared.cfg.max_staleness)?;
    Ok(reply)
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

#[cfg(test)]
mod tests {
    use super::*;
    use r3_rollout::SamplingParams;
    use r3_routing::{LayerLayout, MergePolicy};

    /// Two rounds of one step: counts and seconds summed, the workers up the later round's.
    #[test]
    fn two_batches_cost_their_sum() {
        let a = RolloutStats {
            retries: 1,
            results: 8,
            workers_up: 3,
            decode_s: 0.5,
            partial_resumed: 2,
            request_s: 1.0,
            ..RolloutStats::default()
        };
        let b = RolloutStats {
            retries: 2,
            stale: 1,
            results: 8,
            workers_up: 2,
            decode_s: 0.25,
            request_s: 3.0,
            ..RolloutStats::default()
        };
        let sum = a.then(b);
        assert_eq!((sum.retries, sum.stale, sum.results), (3, 1, 16));
        assert_eq!((sum.workers_up, sum.partial_resumed), (2, 2));
        assert_eq!((sum.decode_s, sum.request_s), (0.75, 4.0));
    }

    fn fleet(url: String) -> Fleet {
        let cfg = FleetConfig {
            urls: vec![url],
            max_in_flight: 1,
            request_timeout: Duration::from_secs(60),
            max_retries: 0,
            api_key: None,
            max_staleness: 0,
            partial: PartialMode::Resume,
            merge: MergePolicy::KeepPerTokenOrigin,
        };
        let model = ModelFacts {
            vocab_size: 16,
            layout: LayerLayout::all_moe(1),
            top_k: 1,
            num_experts: 2,
        };
        Fleet::new(cfg, model).expect("fleet")
    }

    /// A request cancelled while its call is in flight (as a batch's tasks are when the
    /// batch is dropped) gives its worker's outstanding count back.
    #[test]
    fn a_request_cancelled_mid_call_releases_its_worker() {
        // Connections complete in the listener's backlog; nothing ever answers.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", silent.local_addr().expect("addr"));
        let f = fleet(url);
        f.shared.pool().mark_up(0, 0);
        let shared = Arc::clone(&f.shared);
        let task = f.runtime.spawn(async move {
            let req = GenerateRequest::new(vec![1, 2], SamplingParams::default());
            run_request(&shared, 0, &req, &Counters::default()).await
        });
        let started = std::time::Instant::now();
        while f.pool().slots()[0].outstanding == 0 {
            assert!(started.elapsed() < Duration::from_secs(30), "never sent");
            std::thread::sleep(Duration::from_millis(5));
        }
        task.abort();
        let joined = f.runtime.block_on(task);
        assert!(joined.is_err_and(|e| e.is_cancelled()));
        assert_eq!(f.pool().slots()[0].outstanding, 0);
    }

    #[test]
    fn a_stale_reply_names_the_trainers_current_version() {
        // Sent when version 3 was the last finished sync, answered from 1, trainer now at 5.
        let err = check_version("http://w", 1, 3, 5, 1).expect_err("too old");
        let text = err.to_string();
        assert!(text.contains("trainer is at 5"), "{text}");
        assert!(text.contains("sent at version 3"), "{text}");
        assert!(check_version("http://w", 2, 3, 5, 1).is_ok());
        assert!(
            check_version("http://w", 6, 3, 5, 1).is_err(),
            "newer than the trainer"
        );
    }
}
