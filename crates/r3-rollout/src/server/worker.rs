//! The engine worker: one thread owns the backend and runs continuous batching. HTTP
//! handlers send it commands over a channel and wait on a oneshot for the answer; requests
//! that arrive while a step runs join the batch at the next step.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use super::backend::{InferenceBackend, ModelSummary};
use super::error::ApiError;
use crate::error::RolloutError;
use crate::prefix_cache::PrefixCacheStats;
use crate::request::{FinishReason, GenerateRequest, GenerateResult, PartialRollout, RequestId};

/// One request of a batch, with the id clients use to abort it.
#[derive(Debug, Clone)]
pub struct Job {
    /// Client-visible request id (`meta_info.id`, `/abort_request`).
    pub rid: String,
    /// What to generate.
    pub request: GenerateRequest,
}

/// Answer to a batch: one result per job, in job order.
type BatchReply = oneshot::Sender<Result<Vec<GenerateResult>, ApiError>>;

/// What handlers ask the worker to do.
enum Command {
    Generate {
        jobs: Vec<Job>,
        reply: BatchReply,
    },
    UpdateWeights {
        dir: PathBuf,
        abort_all: bool,
        reply: oneshot::Sender<Result<u64, ApiError>>,
    },
    Abort {
        rid: Option<String>,
        reply: oneshot::Sender<usize>,
    },
}

/// Counters of the worker (served at `/get_server_info`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct WorkerStats {
    /// Engine steps run.
    pub steps: u64,
    /// Requests finished (including aborted ones).
    pub finished_requests: u64,
    /// Largest number of requests in flight together during one step.
    pub max_batch_in_flight: usize,
    /// Sum over steps of the requests in flight (mean batch = this / steps).
    pub sum_batch_in_flight: u64,
    /// Weight version of the backend.
    pub weight_version: u64,
    /// Prefix cache counters of the backend, if it has a cache.
    pub prefix_cache: Option<PrefixCacheStats>,
}

/// The handlers' side of the worker: cheap to clone, one per server.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    stats: Arc<Mutex<WorkerStats>>,
}

/// The worker's bookkeeping of which engine request belongs to which client batch.
#[derive(Default)]
struct Book {
    /// Open batches by batch number.
    batches: HashMap<u64, Batch>,
    /// Engine request id -> (batch number, index in the batch).
    slots: HashMap<RequestId, (u64, usize)>,
    /// Client rid -> engine request id (for `/abort_request`).
    by_rid: HashMap<String, RequestId>,
    next_batch: u64,
}

/// A client batch waiting for its results.
struct Batch {
    results: Vec<Option<GenerateResult>>,
    ids: Vec<RequestId>,
    rids: Vec<String>,
    reply: BatchReply,
}

impl EngineHandle {
    /// Starts the worker thread that owns `backend`; it stops when every handle is dropped.
    pub fn spawn<B: InferenceBackend>(
        backend: B,
    ) -> std::io::Result<(EngineHandle, ModelSummary, JoinHandle<()>)> {
        let summary = backend.summary();
        let (tx, rx) = mpsc::unbounded_channel();
        let stats = Arc::new(Mutex::new(WorkerStats::default()));
        let worker_stats = Arc::clone(&stats);
        let thread = std::thread::Builder::new()
            .name("r3-engine".into())
            .spawn(move || run(backend, rx, &worker_stats))?;
        Ok((EngineHandle { tx, stats }, summary, thread))
    }

    /// Runs a batch of jobs; results come back in job order once all have finished.
    pub async fn generate(&self, jobs: Vec<Job>) -> Result<Vec<GenerateResult>, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Generate { jobs, reply })?;
        rx.await.map_err(|_| gone())?
    }

    /// Loads new weights between steps; returns the new weight version.
    pub async fn update_weights(&self, dir: PathBuf, abort_all: bool) -> Result<u64, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::UpdateWeights {
            dir,
            abort_all,
            reply,
        })?;
        rx.await.map_err(|_| gone())?
    }

    /// Aborts the request with client id `rid` (all requests when None); returns how many.
    pub async fn abort(&self, rid: Option<String>) -> Result<usize, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Abort { rid, reply })?;
        rx.await.map_err(|_| gone())
    }

    /// Whether the worker thread is still taking commands.
    pub fn is_alive(&self) -> bool {
        !self.tx.is_closed()
    }

    /// A snapshot of the worker's counters.
    pub fn stats(&self) -> WorkerStats {
        self.stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn send(&self, cmd: Command) -> Result<(), ApiError> {
        self.tx.send(cmd).map_err(|_| gone())
    }
}

fn gone() -> ApiError {
    ApiError::unavailable("the engine worker has stopped")
}

/// The worker loop: block for work when idle, otherwise drain commands and step.
fn run<B: InferenceBackend>(
    mut backend: B,
    mut rx: mpsc::UnboundedReceiver<Command>,
    stats: &Mutex<WorkerStats>,
) {
    let mut book = Book::default();
    loop {
        if backend.in_flight() == 0 {
            match rx.blocking_recv() {
                Some(cmd) => book.handle(&mut backend, cmd),
                None => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            book.handle(&mut backend, cmd);
        }
        book.abort_abandoned(&mut backend);
        let batch = backend.in_flight();
        if batch == 0 {
            continue;
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| backend.step()));
        let finished = match outcome {
            Ok(Ok(results)) => book.finish(results),
            Ok(Err(e)) => book.fail_all(&mut backend, &ApiError::from(e)),
            Err(_) => book.fail_all(&mut backend, &ApiError::internal("the engine panicked")),
        };
        let mut s = stats.lock().unwrap_or_else(PoisonError::into_inner);
        s.steps += 1;
        s.finished_requests += finished as u64;
        s.max_batch_in_flight = s.max_batch_in_flight.max(batch);
        s.sum_batch_in_flight += batch as u64;
        s.weight_version = backend.weight_version();
        s.prefix_cache = backend.prefix_cache_stats();
    }
}

impl Book {
    fn handle<B: InferenceBackend>(&mut self, backend: &mut B, cmd: Command) {
        match cmd {
            Command::Generate { jobs, reply } => self.submit(backend, jobs, reply),
            Command::UpdateWeights {
                dir,
                abort_all,
                reply,
            } => {
                if abort_all {
                    self.abort_where(backend, |_| true);
                }
                let result = backend.update_weights_from_dir(&dir).map_err(|e| match e {
                    RolloutError::WeightDir { .. } => ApiError::from(e),
                    e => ApiError::from(e)
                        .context(&format!("loading weights from {}", dir.display())),
                });
                let _ = reply.send(result);
            }
            Command::Abort { rid, reply } => {
                let n = match rid {
                    Some(rid) => self.abort_where(backend, |r| r == rid),
                    None => self.abort_where(backend, |_| true),
                };
                let _ = reply.send(n);
            }
        }
    }

    /// Submits every job of a batch, or none: on a rejected job the earlier ones are aborted.
    fn submit<B: InferenceBackend>(&mut self, backend: &mut B, jobs: Vec<Job>, reply: BatchReply) {
        let total = jobs.len();
        if let Some(rid) = duplicate_rid(&jobs, &self.by_rid) {
            let _ = reply.send(Err(ApiError::bad_request(format!(
                "rid {rid:?} is already in flight or repeated in the batch"
            ))));
            return;
        }
        let mut ids = Vec::with_capacity(total);
        let mut rids = Vec::with_capacity(jobs.len());
        for (i, job) in jobs.into_iter().enumerate() {
            match backend.submit(job.request) {
                Ok(id) => {
                    ids.push(id);
                    rids.push(job.rid);
                }
                Err(e) => {
                    for &id in &ids {
                        let _ = backend.abort(id);
                    }
                    let err = ApiError::from(e);
                    let err = if total > 1 {
                        err.context(&format!("request {i} of the batch"))
                    } else {
                        err
                    };
                    let _ = reply.send(Err(err));
                    return;
                }
            }
        }
        let batch = self.next_batch;
        self.next_batch += 1;
        for (i, (&id, rid)) in ids.iter().zip(&rids).enumerate() {
            self.slots.insert(id, (batch, i));
            self.by_rid.insert(rid.clone(), id);
        }
        let results = vec![None; ids.len()];
        self.batches.insert(
            batch,
            Batch {
                results,
                ids,
                rids,
                reply,
            },
        );
    }

    /// Files finished results; answers batches that are complete. Returns how many finished.
    fn finish(&mut self, results: Vec<GenerateResult>) -> usize {
        let n = results.len();
        for r in results {
            let Some((batch, i)) = self.slots.remove(&r.id) else {
                continue;
            };
            if let Some(slot) = self
                .batches
                .get_mut(&batch)
                .and_then(|b| b.results.get_mut(i))
            {
                *slot = Some(r);
            }
            self.answer_if_complete(batch);
        }
        n
    }

    fn answer_if_complete(&mut self, batch: u64) {
        let complete = self
            .batches
            .get(&batch)
            .is_some_and(|b| b.results.iter().all(Option::is_some));
        if !complete {
            return;
        }
        if let Some(b) = self.batches.remove(&batch) {
            for rid in &b.rids {
                self.by_rid.remove(rid);
            }
            let results: Vec<GenerateResult> = b.results.into_iter().flatten().collect();
            let _ = b.reply.send(Ok(results));
        }
    }

    /// Aborts the requests whose client gave up waiting (connection closed).
    fn abort_abandoned<B: InferenceBackend>(&mut self, backend: &mut B) {
        let abandoned: Vec<u64> = self
            .batches
            .iter()
            .filter(|(_, b)| b.reply.is_closed())
            .map(|(&k, _)| k)
            .collect();
        for batch in abandoned {
            if let Some(b) = self.batches.remove(&batch) {
                tracing::info!(
                    requests = b.ids.len(),
                    "client went away; aborting its requests"
                );
                for (id, rid) in b.ids.iter().zip(&b.rids) {
                    self.slots.remove(id);
                    self.by_rid.remove(rid);
                    let _ = backend.abort(*id);
                }
            }
        }
    }

    /// Aborts the running requests whose rid satisfies `pick`; their batches get the partial
    /// output with finish reason `abort`. Returns how many were aborted.
    fn abort_where<B: InferenceBackend>(
        &mut self,
        backend: &mut B,
        pick: impl Fn(&str) -> bool,
    ) -> usize {
        let chosen: Vec<(String, RequestId)> = self
            .by_rid
            .iter()
            .filter(|(rid, _)| pick(rid))
            .map(|(rid, &id)| (rid.clone(), id))
            .collect();
        let mut n = 0;
        for (rid, id) in chosen {
            self.by_rid.remove(&rid);
            let Some((batch, i)) = self.slots.remove(&id) else {
                continue;
            };
            let partial = backend.abort(id);
            let result = match partial {
                Ok(Some(p)) => aborted_result(id, p, backend.weight_version()),
                Ok(None) | Err(_) => continue,
            };
            n += 1;
            if let Some(slot) = self
                .batches
                .get_mut(&batch)
                .and_then(|b| b.results.get_mut(i))
            {
                *slot = Some(result);
            }
            self.answer_if_complete(batch);
        }
        n
    }

    /// After an engine failure: every open batch gets the error, every request is aborted.
    fn fail_all<B: InferenceBackend>(&mut self, backend: &mut B, err: &ApiError) -> usize {
        tracing::error!(error = %err, "engine step failed; failing all open requests");
        let mut n = 0;
        for (_, b) in self.batches.drain() {
            for &id in &b.ids {
                let _ = backend.abort(id);
                n += 1;
            }
            let _ = b.reply.send(Err(ApiError::internal(format!(
                "engine step failed: {}",
                err.message
            ))));
        }
        self.slots.clear();
        self.by_rid.clear();
        n
    }
}

/// A rid of `jobs` that is already in flight or appears twice in `jobs`.
fn duplicate_rid<'a>(jobs: &'a [Job], in_flight: &HashMap<String, RequestId>) -> Option<&'a str> {
    let mut seen = std::collections::HashSet::new();
    jobs.iter()
        .map(|j| j.rid.as_str())
        .find(|rid| in_flight.contains_key(*rid) || !seen.insert(*rid))
}

/// The result a client gets for an aborted request: what was generated until the abort.
fn aborted_result(id: RequestId, p: PartialRollout, weight_version: u64) -> GenerateResult {
    GenerateResult {
        id,
        prompt_tokens: p.request.input_ids.len(),
        output_ids: p.output_ids,
        output_logprobs: p.output_logprobs,
        finish: FinishReason::Abort,
        cached_tokens: 0,
        routes: p.routes,
        weight_version,
    }
}
