//! The engine worker: one thread owns the backend and runs continuous batching. HTTP
//! handlers send it commands over a channel and wait on a oneshot for the answer; requests
//! that arrive while a step runs join the batch at the next step. After every step the worker
//! checks running requests against their stop strings. While paused
//! (`/pause_generation`), and while the weights or KV cache are released
//! (`/release_memory_occupation`), it takes commands and queues requests but runs no step.
//!
//! A weight update waits for the requests in flight (SGLang's writer lock); batches and
//! further updates that arrive meanwhile are held, in arrival order, and go on once it is
//! done: updates are applied one at a time whatever the HTTP layer does. A held request
//! counts as waiting and can be aborted like a queued one.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::thread::JoinHandle;

use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use super::backend::{InferenceBackend, MemoryRegions, ModelSummary, StagedWeights};
use super::error::ApiError;
use super::heap::return_free_heap;
use super::stop::StopMatcher;
use r3_rollout::error::RolloutError;
use r3_rollout::prefix_cache::PrefixCacheStats;
use r3_rollout::request::{
    FinishReason, GenerateRequest, GenerateResult, PartialRollout, RequestId,
};

/// Weight version label before the first update (SGLang's default).
pub const INITIAL_WEIGHT_VERSION: &str = "default";

/// One request of a batch, with the id clients use to abort it.
#[derive(Debug, Clone)]
pub struct Job {
    /// Client-visible request id (`meta_info.id`, `/abort_request`).
    pub rid: String,
    /// What to generate.
    pub request: GenerateRequest,
    /// The request's stop strings, if it has any.
    pub stop: Option<StopMatcher>,
}

/// A finished job as the worker hands it back.
#[derive(Debug, Clone)]
pub struct Finished {
    /// The engine's result.
    pub result: GenerateResult,
    /// The stop string that ended it (finish reason `StopString`).
    pub matched_stop: Option<String>,
    /// Weight version label when it finished (`meta_info.weight_version`).
    pub weight_version: String,
}

/// How `/pause_generation` treats requests in flight (SGLang's modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    /// Abort them: their clients get the partial output with finish reason `abort`.
    Abort,
    /// Keep them where they are; they continue after `/continue_generation`.
    InPlace,
    /// Send them back to the queue and release their KV; on `/continue_generation` they are
    /// re-prefilled from their tokens and continue (same sampler stream, routes kept).
    Retract,
}

/// Answer to a batch: one result per job, in job order.
type BatchReply = oneshot::Sender<Result<Vec<Finished>, ApiError>>;

/// Where a streamed batch's tokens go as they are produced: `(job index, new token ids)`
/// after every engine step that added some.
pub type ProgressSender = mpsc::UnboundedSender<(usize, Vec<u32>)>;

/// The pending answer of a batch started with [`EngineHandle::start`]: a future of the
/// batch's results (an error when the worker stopped). Dropped before the answer came (the
/// handler's future dropped when its client went away), it tells the worker, which aborts
/// the batch's requests at once, held or queued or running.
pub struct BatchAnswer {
    rx: oneshot::Receiver<Result<Vec<Finished>, ApiError>>,
    tx: mpsc::UnboundedSender<Command>,
    answered: bool,
}

impl Future for BatchAnswer {
    type Output = Result<Result<Vec<Finished>, ApiError>, oneshot::error::RecvError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let polled = Pin::new(&mut self.rx).poll(cx);
        if polled.is_ready() {
            self.answered = true;
        }
        polled
    }
}

impl Drop for BatchAnswer {
    fn drop(&mut self) {
        if !self.answered {
            // Closed before the worker is woken, so it sees the batch abandoned.
            self.rx.close();
            let _ = self.tx.send(Command::Abandoned);
        }
    }
}

/// What handlers ask the worker to do.
enum Command {
    Generate {
        jobs: Vec<Job>,
        reply: BatchReply,
        progress: Option<ProgressSender>,
    },
    UpdateWeights {
        staged: StagedWeights,
        abort_all: bool,
        label: Option<String>,
        reply: oneshot::Sender<Result<String, ApiError>>,
    },
    Abort {
        rid: Option<String>,
        reply: oneshot::Sender<usize>,
    },
    Pause {
        mode: PauseMode,
        reply: oneshot::Sender<usize>,
    },
    Continue {
        reply: oneshot::Sender<()>,
    },
    /// A batch's answer was dropped unanswered: its requests are aborted.
    Abandoned,
    FlushCache {
        reply: oneshot::Sender<usize>,
    },
    ReleaseMemory {
        regions: MemoryRegions,
        reply: oneshot::Sender<Result<Option<usize>, ApiError>>,
    },
    ResumeMemory {
        regions: MemoryRegions,
        reply: oneshot::Sender<Result<(), ApiError>>,
    },
}

/// Counters of the worker (served at `/get_server_info` and `/v1/loads`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct WorkerStats {
    /// Engine steps run.
    pub steps: u64,
    /// Requests ended: finished, aborted (by a client, a pause, an update or a stop string)
    /// or failed; each counted once.
    pub finished_requests: u64,
    /// Largest number of requests in flight together during one step.
    pub max_batch_in_flight: usize,
    /// Sum over steps of the requests in flight (mean batch = this / steps).
    pub sum_batch_in_flight: u64,
    /// Weight version label (the last update's `weight_version`, else its number).
    pub weight_version: String,
    /// Requests queued for admission, those held behind a pending weight update included.
    pub waiting: usize,
    /// Requests running.
    pub running: usize,
    /// Weight updates waiting for the requests in flight: the pending one and those queued
    /// behind it (each applied in turn).
    pub updates_waiting: usize,
    /// Whether generation is paused.
    pub paused: bool,
    /// Memory regions released by `/release_memory_occupation` and not yet resumed (no
    /// step runs while the weights or the KV cache are).
    pub memory_released: Vec<&'static str>,
    /// Prefix cache counters of the backend, if it has a cache.
    pub prefix_cache: Option<PrefixCacheStats>,
}

/// The handlers' side of the worker: cheap to clone, one per server.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    stats: Arc<Mutex<WorkerStats>>,
}

/// One open request of a client batch.
struct Slot {
    batch: u64,
    index: usize,
    stop: Option<StopMatcher>,
    /// Streamed batches: where new tokens go, and how many were sent.
    progress: Option<(ProgressSender, usize)>,
}

/// The worker's bookkeeping of which engine request belongs to which client batch.
struct Book {
    /// Open batches by batch number.
    batches: HashMap<u64, Batch>,
    /// Engine request id -> its place.
    slots: HashMap<RequestId, Slot>,
    /// Client rid -> engine request id (for `/abort_request`).
    by_rid: HashMap<String, RequestId>,
    next_batch: u64,
    paused: bool,
    /// Regions `/release_memory_occupation` let go, not yet resumed.
    released: MemoryRegions,
    label: String,
    /// Requests ended so far (`WorkerStats::finished_requests`).
    ended: u64,
    stats: Arc<Mutex<WorkerStats>>,
    /// An update waiting for the requests in flight to finish: a sequence never spans two
    /// weight versions, as SGLang's update takes its writer lock once every request's reader
    /// lock is given back (unless generation is paused).
    pending_update: Option<PendingUpdate>,
    /// What arrived while `pending_update` waits, in arrival order: batches, admitted after
    /// it, and further updates, each pending in turn (SGLang's updates queue on its lock).
    /// Empty while no update is pending.
    held: VecDeque<Held>,
    /// Batch answers ready to go, sent by the next `publish` right after the counters: a
    /// client that reads `/v1/loads` once answered never sees its own request still
    /// counted as running or waiting, nor missing from the finished ones.
    answers: Vec<(BatchReply, Result<Vec<Finished>, ApiError>)>,
}

/// A command held back while an update is pending.
enum Held {
    Batch(HeldBatch),
    Update(PendingUpdate),
}

/// A weight update waiting for the requests in flight to finish (SGLang's writer lock).
struct PendingUpdate {
    staged: StagedWeights,
    abort_all: bool,
    label: Option<String>,
    reply: oneshot::Sender<Result<String, ApiError>>,
}

/// A `Generate` command held back while an update waits: admitted once it is done.
struct HeldBatch {
    jobs: Vec<HeldJob>,
    reply: BatchReply,
    progress: Option<ProgressSender>,
}

/// One job of a held batch.
enum HeldJob {
    /// Submitted once the update is done.
    Waiting(Job),
    /// Aborted while held: answered as an aborted queued request (no tokens).
    Aborted { rid: String, finished: Finished },
}

/// A client batch waiting for its results. `results`, `ids` and `rids` are in job order;
/// a job aborted before it was submitted has its result already and no engine id.
struct Batch {
    results: Vec<Option<Finished>>,
    ids: Vec<Option<RequestId>>,
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
        let stats = Arc::new(Mutex::new(WorkerStats {
            weight_version: INITIAL_WEIGHT_VERSION.to_string(),
            ..WorkerStats::default()
        }));
        let book = Book {
            batches: HashMap::new(),
            slots: HashMap::new(),
            by_rid: HashMap::new(),
            next_batch: 0,
            paused: false,
            released: MemoryRegions::default(),
            label: INITIAL_WEIGHT_VERSION.to_string(),
            ended: 0,
            stats: Arc::clone(&stats),
            pending_update: None,
            held: VecDeque::new(),
            answers: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("r3-engine".into())
            .spawn(move || {
                // The engine thread is worker 0 of a compute pool of its own, so each
                // parallel op of a step starts on its own queue and it works beside the
                // other workers; from outside a pool, every op was handed across to the
                // global pool's threads while it slept, and woken again. The pool is
                // dropped here, on the thread it was built on, as rayon requires.
                match rayon::ThreadPoolBuilder::new()
                    .thread_name(|i| format!("r3-engine-compute-{i}"))
                    .use_current_thread()
                    .build()
                {
                    Ok(pool) => pool.install(|| run(backend, rx, book)),
                    Err(e) => {
                        tracing::warn!(error = %e, "no compute pool for the engine thread; its parallel ops use the global pool");
                        run(backend, rx, book)
                    }
                }
            })?;
        Ok((EngineHandle { tx, stats }, summary, thread))
    }

    /// Runs a batch of jobs; results come back in job order once all have finished.
    /// Dropping the future before (a client that went away) aborts the batch's requests.
    pub async fn generate(&self, jobs: Vec<Job>) -> Result<Vec<Finished>, ApiError> {
        let answer = self.start(jobs, None)?;
        answer.await.map_err(|_| gone())?
    }

    /// Queues a batch of jobs and returns its pending answer at once; with `progress`, every
    /// step's new tokens of each job are sent there (token-by-token streaming). Dropping the
    /// answer (a client that went away) aborts the batch's requests.
    pub fn start(
        &self,
        jobs: Vec<Job>,
        progress: Option<ProgressSender>,
    ) -> Result<BatchAnswer, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Generate {
            jobs,
            reply,
            progress,
        })?;
        Ok(BatchAnswer {
            rx,
            tx: self.tx.clone(),
            answered: false,
        })
    }

    /// Swaps in new weights between steps, then (with `abort_all`) aborts the requests in
    /// flight; returns the new weight version label (`label`, or the backend's version
    /// number when None). Nothing is aborted when the swap fails. Without `abort_all` the
    /// swap waits for the requests in flight; an update sent while another waits goes after
    /// it (each caller gets its own answer), and batches sent meanwhile run after the update
    /// sent before them.
    pub async fn update_weights(
        &self,
        staged: StagedWeights,
        abort_all: bool,
        label: Option<String>,
    ) -> Result<String, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::UpdateWeights {
            staged,
            abort_all,
            label,
            reply,
        })?;
        rx.await.map_err(|_| gone())?
    }

    /// Aborts the request with client id `rid` (all requests when None), whether queued,
    /// running or held behind a pending update; returns how many.
    pub async fn abort(&self, rid: Option<String>) -> Result<usize, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Abort { rid, reply })?;
        rx.await.map_err(|_| gone())
    }

    /// Pauses generation; returns how many requests were aborted (mode `Abort`: those held
    /// behind a pending update too) or retracted (mode `Retract`).
    pub async fn pause(&self, mode: PauseMode) -> Result<usize, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Pause { mode, reply })?;
        rx.await.map_err(|_| gone())
    }

    /// Resumes generation after a pause (a no-op when not paused).
    pub async fn resume(&self) -> Result<(), ApiError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Continue { reply })?;
        rx.await.map_err(|_| gone())
    }

    /// Empties the prefix cache; returns how many blocks it released.
    pub async fn flush_cache(&self) -> Result<usize, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::FlushCache { reply })?;
        rx.await.map_err(|_| gone())
    }

    /// Lets go of the engine's memory in `regions` (no request may run: pause with mode
    /// `abort` or `retract` first); no step runs until the weights and KV cache are
    /// resumed. Returns the device's free bytes after, where the engine has a device.
    pub async fn release_memory(&self, regions: MemoryRegions) -> Result<Option<usize>, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::ReleaseMemory { regions, reply })?;
        rx.await.map_err(|_| gone())?
    }

    /// Takes back the released memory in `regions` (each must be released).
    pub async fn resume_memory(&self, regions: MemoryRegions) -> Result<(), ApiError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::ResumeMemory { regions, reply })?;
        rx.await.map_err(|_| gone())?
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

/// The worker loop: block for work when idle or paused, otherwise drain commands and step.
fn run<B: InferenceBackend>(
    mut backend: B,
    mut rx: mpsc::UnboundedReceiver<Command>,
    mut book: Book,
) {
    // The checkpoint the engine was built from is gone by now; its pages go back.
    return_free_heap();
    loop {
        book.apply_update_if_due(&mut backend);
        if backend.in_flight() == 0 || book.holds_steps() {
            // Never sleep on a queued answer: its client would wait for the next command.
            if !book.answers.is_empty() {
                book.publish(&backend, |_| {});
            }
            match rx.blocking_recv() {
                Some(cmd) => book.handle(&mut backend, cmd),
                None => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            book.handle(&mut backend, cmd);
        }
        book.abort_abandoned(&mut backend);
        book.apply_update_if_due(&mut backend);
        let batch = backend.in_flight();
        if batch == 0 || book.holds_steps() {
            book.publish(&backend, |_| {});
            continue;
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| backend.step()));
        match outcome {
            Ok(Ok(results)) => book.finish(results),
            Ok(Err(e)) => book.fail_named(&mut backend, e),
            Err(_) => book.fail_all(&mut backend, &ApiError::internal("the engine panicked")),
        }
        book.stop_on_strings(&mut backend);
        book.send_progress(&backend);
        book.publish(&backend, |s| {
            s.steps += 1;
            s.max_batch_in_flight = s.max_batch_in_flight.max(batch);
            s.sum_batch_in_flight += batch as u64;
        });
    }
}

impl Book {
    /// Whether no step may run: generation paused, or the weights or KV cache released.
    fn holds_steps(&self) -> bool {
        self.paused || self.released.holds_steps()
    }

    /// Refreshes the shared counters from the backend (and `more`), then sends the batch
    /// answers that were waiting for them.
    fn publish<B: InferenceBackend>(&mut self, backend: &B, more: impl FnOnce(&mut WorkerStats)) {
        self.publish_counters(backend, more);
        for (reply, answer) in self.answers.drain(..) {
            let _ = reply.send(answer);
        }
    }

    /// Queues `answer` for batch `reply`'s client, sent by the next `publish`.
    fn answer(&mut self, reply: BatchReply, answer: Result<Vec<Finished>, ApiError>) {
        self.answers.push((reply, answer));
    }

    fn publish_counters<B: InferenceBackend>(
        &self,
        backend: &B,
        more: impl FnOnce(&mut WorkerStats),
    ) {
        let (waiting, running) = backend.queue_lengths();
        let held = self.held_requests();
        let mut s = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
        more(&mut s);
        s.finished_requests = self.ended;
        s.weight_version.clone_from(&self.label);
        s.waiting = waiting + held;
        s.updates_waiting = usize::from(self.pending_update.is_some())
            + self
                .held
                .iter()
                .filter(|h| matches!(h, Held::Update(_)))
                .count();
        s.running = running;
        s.paused = self.paused;
        s.memory_released = self.released.tags();
        s.prefix_cache = backend.prefix_cache_stats();
    }

    fn handle<B: InferenceBackend>(&mut self, backend: &mut B, cmd: Command) {
        match cmd {
            Command::Generate {
                jobs,
                reply,
                progress,
            } => {
                if self.pending_update.is_some() {
                    self.held.push_back(Held::Batch(HeldBatch {
                        jobs: jobs.into_iter().map(HeldJob::Waiting).collect(),
                        reply,
                        progress,
                    }));
                } else {
                    self.submit(backend, jobs, reply, progress);
                }
                self.publish(backend, |_| {});
            }
            Command::UpdateWeights {
                staged,
                abort_all,
                label,
                reply,
            } => {
                let update = PendingUpdate {
                    staged,
                    abort_all,
                    label,
                    reply,
                };
                if self.pending_update.is_some() {
                    // Never replaced: it goes after the pending one (and after the batches
                    // held before it), as SGLang's second update waits for the first's lock.
                    tracing::info!(
                        in_flight = backend.in_flight(),
                        "a weight update is already waiting for the requests in flight; \
                         this one follows it"
                    );
                    self.held.push_back(Held::Update(update));
                } else {
                    self.pending_update = Some(update);
                    self.apply_update_if_due(backend);
                }
                self.publish(backend, |_| {});
            }
            Command::Abort { rid, reply } => {
                let pick = |r: &str| rid.as_deref().is_none_or(|rid| r == rid);
                let n = self.abort_where(backend, pick) + self.abort_held(backend, pick);
                // Published before the reply, as every other command: `/v1/loads` read right
                // after the abort no longer counts the aborted requests.
                self.publish(backend, |_| {});
                let _ = reply.send(n);
            }
            Command::Pause { mode, reply } => {
                let n = match mode {
                    // Held batches are in flight for their clients: aborted too.
                    PauseMode::Abort => {
                        self.abort_where(backend, |_| true) + self.abort_held(backend, |_| true)
                    }
                    PauseMode::Retract => backend.retract_all(),
                    PauseMode::InPlace => 0,
                };
                self.paused = true;
                self.publish(backend, |_| {});
                let _ = reply.send(n);
            }
            Command::Continue { reply } => {
                self.paused = false;
                self.publish(backend, |_| {});
                let _ = reply.send(());
            }
            // The loop aborts abandoned batches after every command.
            Command::Abandoned => {}
            Command::FlushCache { reply } => {
                let n = backend.flush_cache();
                self.publish(backend, |_| {});
                let _ = reply.send(n);
            }
            Command::ReleaseMemory { regions, reply } => {
                let result = self.release_memory(backend, regions);
                self.publish(backend, |_| {});
                let _ = reply.send(result);
            }
            Command::ResumeMemory { regions, reply } => {
                let result = self.resume_memory(backend, regions);
                self.publish(backend, |_| {});
                let _ = reply.send(result);
                // The host copy of weights brought back to the device is freed.
                return_free_heap();
            }
        }
    }

    /// Swaps in a pending update once it may go: with `abort_all_requests` at once (the
    /// requests are aborted after the swap), while steps are held (paused, memory released:
    /// SGLang skips its lock when paused), or once no request is in flight. Then admits what
    /// was held meanwhile in arrival order, up to the next held update, which is pending
    /// from then on (and applied here too if it is due already).
    fn apply_update_if_due<B: InferenceBackend>(&mut self, backend: &mut B) {
        loop {
            let due = self
                .pending_update
                .as_ref()
                .is_some_and(|u| u.abort_all || self.holds_steps() || backend.in_flight() == 0);
            if !due {
                return;
            }
            let Some(update) = self.pending_update.take() else {
                return;
            };
            self.apply_update(backend, update);
            while let Some(held) = self.held.pop_front() {
                match held {
                    Held::Batch(b) => self.submit_held(backend, b),
                    Held::Update(u) => {
                        self.pending_update = Some(u);
                        break;
                    }
                }
            }
            // The batches just admitted (and any refused among them, whose answers are
            // queued) are published now: with nothing in flight the worker may block next.
            self.publish(backend, |_| {});
        }
    }

    /// Swaps in `update` and answers its caller.
    fn apply_update<B: InferenceBackend>(&mut self, backend: &mut B, update: PendingUpdate) {
        let PendingUpdate {
            staged,
            abort_all,
            label,
            reply,
        } = update;
        let dir = staged.dir.clone();
        // Aborted only once the new weights are in place (a refused update leaves
        // every request running), and under the old label: their tokens came from
        // the old weights.
        let result = backend
            .swap_weights(staged)
            .map(|v| {
                if abort_all {
                    self.abort_where(backend, |_| true);
                }
                self.label = label.unwrap_or_else(|| v.to_string());
                self.label.clone()
            })
            .map_err(|e| match e {
                RolloutError::WeightDir { .. } => ApiError::from(e),
                e => ApiError::from(e).context(&format!("loading weights from {}", dir.display())),
            });
        // Published before the reply so `/get_server_info` shows the new version
        // as soon as the update call returns.
        self.publish(backend, |_| {});
        let _ = reply.send(result);
        // The staged weights and the ones they replaced (or a refused update's) are
        // freed by now.
        return_free_heap();
    }

    /// Requests held behind a pending update and not aborted (counted as waiting).
    fn held_requests(&self) -> usize {
        self.held
            .iter()
            .map(|h| match h {
                Held::Batch(b) => b
                    .jobs
                    .iter()
                    .filter(|j| matches!(j, HeldJob::Waiting(_)))
                    .count(),
                Held::Update(_) => 0,
            })
            .sum()
    }

    /// Aborts the held requests whose rid satisfies `pick`, answered as an aborted queued
    /// request is (finish reason `abort`, no tokens); a held batch whose every request is
    /// aborted is answered now, in job order, the others once submitted. Returns how many.
    fn abort_held<B: InferenceBackend>(
        &mut self,
        backend: &B,
        pick: impl Fn(&str) -> bool,
    ) -> usize {
        let version = backend.weight_version();
        let mut n = 0;
        for held in self.held.iter_mut() {
            let Held::Batch(b) = held else { continue };
            for job in b.jobs.iter_mut() {
                let HeldJob::Waiting(j) = job else { continue };
                if !pick(&j.rid) {
                    continue;
                }
                let finished = Finished {
                    result: unsubmitted_abort(&j.request, version),
                    matched_stop: None,
                    weight_version: self.label.clone(),
                };
                let rid = std::mem::take(&mut j.rid);
                *job = HeldJob::Aborted { rid, finished };
                n += 1;
            }
        }
        self.ended += n as u64;
        // Batches with nothing left to run are answered at once.
        let mut kept = VecDeque::with_capacity(self.held.len());
        for held in std::mem::take(&mut self.held) {
            match held {
                Held::Batch(b) if b.jobs.iter().all(|j| matches!(j, HeldJob::Aborted { .. })) => {
                    let results = b
                        .jobs
                        .into_iter()
                        .filter_map(|j| match j {
                            HeldJob::Aborted { finished, .. } => Some(finished),
                            HeldJob::Waiting(_) => None,
                        })
                        .collect();
                    self.answer(b.reply, Ok(results));
                }
                other => kept.push_back(other),
            }
        }
        self.held = kept;
        n
    }

    /// Submits a batch that was held behind an update (its client may have gone meanwhile).
    fn submit_held<B: InferenceBackend>(&mut self, backend: &mut B, b: HeldBatch) {
        if b.reply.is_closed() {
            self.drop_held(b);
            return;
        }
        self.submit_jobs(backend, b.jobs, b.reply, b.progress);
    }

    /// Forgets a held batch whose client went away (its requests count as ended).
    fn drop_held(&mut self, b: HeldBatch) {
        let waiting = b
            .jobs
            .iter()
            .filter(|j| matches!(j, HeldJob::Waiting(_)))
            .count();
        tracing::info!(
            requests = waiting,
            "client went away while its requests were held behind a weight update"
        );
        self.ended += waiting as u64;
    }

    /// `/release_memory_occupation`: refused while requests run (their keys and values are
    /// the engine's memory too), as SGLang asserts an idle engine; queued requests wait.
    fn release_memory<B: InferenceBackend>(
        &mut self,
        backend: &mut B,
        regions: MemoryRegions,
    ) -> Result<Option<usize>, ApiError> {
        let (_, running) = backend.queue_lengths();
        if running > 0 {
            return Err(ApiError::bad_request(format!(
                "{running} requests are running: pause generation with mode abort or retract \
                 before releasing memory (in_place keeps their keys and values)"
            )));
        }
        let free = backend.release_memory(regions)?;
        self.released = self.released.union(regions);
        Ok(free)
    }

    /// `/resume_memory_occupation`: each region named must be released (SGLang refuses
    /// the others too); a resume that fails leaves every region as it was.
    fn resume_memory<B: InferenceBackend>(
        &mut self,
        backend: &mut B,
        regions: MemoryRegions,
    ) -> Result<(), ApiError> {
        let not_released = regions.without(self.released);
        if !not_released.is_empty() {
            return Err(ApiError::bad_request(format!(
                "not released, so not resumed: {} (released: {})",
                not_released.tags().join(", "),
                match self.released.tags() {
                    t if t.is_empty() => "none".to_string(),
                    t => t.join(", "),
                }
            )));
        }
        backend.resume_memory(regions)?;
        self.released = self.released.without(regions);
        Ok(())
    }

    /// Submits every job of a batch, or none: on a rejected job the earlier ones are aborted.
    fn submit<B: InferenceBackend>(
        &mut self,
        backend: &mut B,
        jobs: Vec<Job>,
        reply: BatchReply,
        progress: Option<ProgressSender>,
    ) {
        let jobs = jobs.into_iter().map(HeldJob::Waiting).collect();
        self.submit_jobs(backend, jobs, reply, progress);
    }

    /// Submits every job of a batch still to run, or none (on a rejected job the earlier
    /// ones are aborted); jobs aborted while held keep their place and result.
    fn submit_jobs<B: InferenceBackend>(
        &mut self,
        backend: &mut B,
        jobs: Vec<HeldJob>,
        reply: BatchReply,
        progress: Option<ProgressSender>,
    ) {
        let total = jobs.len();
        let to_run = jobs.iter().filter_map(|j| match j {
            HeldJob::Waiting(job) => Some(job.rid.as_str()),
            HeldJob::Aborted { .. } => None,
        });
        if let Some(rid) = duplicate_rid(to_run, &self.by_rid) {
            self.answer(
                reply,
                Err(ApiError::bad_request(format!(
                    "rid {rid:?} is already in flight or repeated in the batch"
                ))),
            );
            return;
        }
        let mut ids: Vec<Option<RequestId>> = Vec::with_capacity(total);
        let mut rids = Vec::with_capacity(total);
        let mut stops = Vec::with_capacity(total);
        let mut results = Vec::with_capacity(total);
        for (i, job) in jobs.into_iter().enumerate() {
            let job = match job {
                HeldJob::Waiting(job) => job,
                HeldJob::Aborted { rid, finished } => {
                    ids.push(None);
                    rids.push(rid);
                    stops.push(None);
                    results.push(Some(finished));
                    continue;
                }
            };
            match backend.submit(job.request) {
                Ok(id) => {
                    ids.push(Some(id));
                    rids.push(job.rid);
                    stops.push(job.stop);
                    results.push(None);
                }
                Err(e) => {
                    for &id in ids.iter().flatten() {
                        let _ = backend.abort(id);
                    }
                    let err = ApiError::from(e);
                    let err = if total > 1 {
                        err.context(&format!("request {i} of the batch"))
                    } else {
                        err
                    };
                    self.answer(reply, Err(err));
                    return;
                }
            }
        }
        let batch = self.next_batch;
        self.next_batch += 1;
        for (index, ((&id, rid), stop)) in ids.iter().zip(&rids).zip(stops).enumerate() {
            let Some(id) = id else { continue };
            let progress = progress.clone().map(|p| (p, 0));
            self.slots.insert(
                id,
                Slot {
                    batch,
                    index,
                    stop,
                    progress,
                },
            );
            self.by_rid.insert(rid.clone(), id);
        }
        self.batches.insert(
            batch,
            Batch {
                results,
                ids,
                rids,
                reply,
            },
        );
        self.answer_if_complete(batch);
    }

    /// Files finished results; answers batches that are complete.
    fn finish(&mut self, results: Vec<GenerateResult>) {
        for mut r in results {
            let Some(slot) = self.slots.remove(&r.id) else {
                continue;
            };
            // A stop string completed by the very last token (the request also hit its
            // length budget in this step) still counts as a stop.
            let matched = match (&slot.stop, r.finish) {
                (Some(m), FinishReason::Length) => m.check(&r.output_ids),
                _ => None,
            };
            if matched.is_some() {
                r.finish = FinishReason::StopString;
            }
            self.file(slot, r, matched);
        }
    }

    /// Puts one finished result into its batch and answers the batch if complete. The
    /// request's rid is free for reuse from here, as SGLang frees a rid when its request
    /// ends (the batch's other requests may still run).
    fn file(&mut self, slot: Slot, result: GenerateResult, matched_stop: Option<String>) {
        self.ended += 1;
        if let Some(rid) = self.rid_of(&slot) {
            self.forget_rid(&rid, result.id);
        }
        let done = Finished {
            result,
            matched_stop,
            weight_version: self.label.clone(),
        };
        if let Some(place) = self
            .batches
            .get_mut(&slot.batch)
            .and_then(|b| b.results.get_mut(slot.index))
        {
            *place = Some(done);
        }
        self.answer_if_complete(slot.batch);
    }

    /// Ends the running requests whose output text now contains one of their stop strings.
    fn stop_on_strings<B: InferenceBackend>(&mut self, backend: &mut B) {
        let hits: Vec<(RequestId, String)> = self
            .slots
            .iter()
            .filter_map(|(&id, slot)| {
                let m = slot.stop.as_ref()?;
                let out = backend.generated_tokens(id)?;
                m.check(&out).map(|s| (id, s))
            })
            .collect();
        for (id, matched) in hits {
            let Some(slot) = self.slots.remove(&id) else {
                continue;
            };
            match backend.abort(id) {
                Ok(Some(p)) => {
                    let mut r = aborted_result(id, p, backend.weight_version());
                    r.finish = FinishReason::StopString;
                    self.file(slot, r, Some(matched));
                }
                // Finished already: a result a failed step held back comes out of the next
                // step, which files it in its slot (its rid stays in flight until then).
                Ok(None) => {
                    self.slots.insert(id, slot);
                }
                Err(e) => {
                    self.slots.insert(id, slot);
                    self.fail_after_abort(backend, id, e);
                }
            }
        }
    }

    /// The rid of the request in `slot`.
    fn rid_of(&self, slot: &Slot) -> Option<String> {
        self.batches
            .get(&slot.batch)
            .and_then(|b| b.rids.get(slot.index))
            .cloned()
    }

    /// Frees `rid` for reuse where it still names request `id`: once a request has ended
    /// its rid may be taken by a new request, whose entry must stay.
    fn forget_rid(&mut self, rid: &str, id: RequestId) {
        if self.by_rid.get(rid) == Some(&id) {
            self.by_rid.remove(rid);
        }
    }

    /// Sends each streamed request's tokens produced since the last send. A closed channel
    /// needs no handling here: its client dropped the batch answer too, which
    /// `abort_abandoned` sees.
    fn send_progress<B: InferenceBackend>(&mut self, backend: &B) {
        for (&id, slot) in self.slots.iter_mut() {
            let Some((tx, sent)) = slot.progress.as_mut() else {
                continue;
            };
            let Some(tokens) = backend.generated_tokens(id) else {
                continue;
            };
            if tokens.len() > *sent && tx.send((slot.index, tokens[*sent..].to_vec())).is_ok() {
                *sent = tokens.len();
            }
        }
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
            let results: Vec<Finished> = b.results.into_iter().flatten().collect();
            self.answer(b.reply, Ok(results));
        }
    }

    /// Aborts the requests whose client gave up waiting (connection closed), held ones too.
    fn abort_abandoned<B: InferenceBackend>(&mut self, backend: &mut B) {
        if self
            .held
            .iter()
            .any(|h| matches!(h, Held::Batch(b) if b.reply.is_closed()))
        {
            for held in std::mem::take(&mut self.held) {
                match held {
                    Held::Batch(b) if b.reply.is_closed() => self.drop_held(b),
                    other => self.held.push_back(other),
                }
            }
        }
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
                // Its answer goes nowhere; an abort that fails drops the batch the engine
                // names, whose clients fail.
                let dropped = self.fail_batch(backend, b, &ApiError::unavailable("client gone"));
                if !dropped.is_empty() {
                    let err = ApiError::unavailable(
                        "the engine dropped this request when another client's abort failed",
                    );
                    self.fail_requests(backend, &dropped, &err);
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
            let Some(slot) = self.slots.remove(&id) else {
                self.forget_rid(&rid, id);
                continue;
            };
            let result = match backend.abort(id) {
                Ok(Some(p)) => aborted_result(id, p, backend.weight_version()),
                // Finished already: a result a failed step held back comes out of the next
                // step, which files it in its slot (its rid stays in flight until then).
                Ok(None) => {
                    self.slots.insert(id, slot);
                    continue;
                }
                Err(e) => {
                    self.slots.insert(id, slot);
                    self.fail_after_abort(backend, id, e);
                    continue;
                }
            };
            n += 1;
            self.file(slot, result, None);
        }
        n
    }

    /// After an abort of `id` failed: the requests the engine names as dropped (a failed
    /// row move drops the whole running batch) fail with their batches, `id`'s among them.
    fn fail_after_abort<B: InferenceBackend>(
        &mut self,
        backend: &mut B,
        id: RequestId,
        e: RolloutError,
    ) {
        let mut ids = failed_requests(&e).unwrap_or_default();
        ids.push(id);
        tracing::error!(request = id, error = %e, "abort failed");
        self.fail_requests(backend, &ids, &ApiError::from(e));
    }

    /// After an engine call that failed: the engine names the requests it dropped, and only
    /// their batches fail, the others going on (what finished meanwhile comes out of the
    /// next step); an error that names none fails every open request.
    fn fail_named<B: InferenceBackend>(&mut self, backend: &mut B, e: RolloutError) {
        match failed_requests(&e) {
            Some(ids) => self.fail_requests(backend, &ids, &ApiError::from(e)),
            None => self.fail_all(backend, &ApiError::from(e)),
        }
    }

    /// After a step that failed the engine requests `ids`: each open batch holding one gets
    /// the error and its other requests are aborted; every other batch goes on. An abort
    /// here that fails drops what the engine names too, whose batches then fail alike.
    fn fail_requests<B: InferenceBackend>(
        &mut self,
        backend: &mut B,
        ids: &[RequestId],
        err: &ApiError,
    ) {
        tracing::error!(error = %err, requests = ids.len(), "engine step failed; failing the requests it named");
        let mut pending = ids.to_vec();
        // Each round removes the batches it fails, so the rounds end.
        while !pending.is_empty() {
            let hit: Vec<u64> = self
                .batches
                .iter()
                .filter(|(_, b)| b.ids.iter().flatten().any(|id| pending.contains(id)))
                .map(|(&n, _)| n)
                .collect();
            pending.clear();
            for number in hit {
                let Some(b) = self.batches.remove(&number) else {
                    continue;
                };
                pending.extend(self.fail_batch(backend, b, err));
            }
        }
    }

    /// Answers batch `b` with `err` (a 503 where the error is one, else a 500) and aborts and
    /// forgets its requests (those still open count as ended; its finished ones were counted
    /// when filed); returns the requests an abort that failed says the engine dropped
    /// besides.
    fn fail_batch<B: InferenceBackend>(
        &mut self,
        backend: &mut B,
        b: Batch,
        err: &ApiError,
    ) -> Vec<RequestId> {
        let mut dropped = Vec::new();
        for &id in b.ids.iter().flatten() {
            if let Err(e) = backend.abort(id) {
                dropped.extend(failed_requests(&e).unwrap_or_default());
            }
            if self.slots.remove(&id).is_some() {
                self.ended += 1;
            }
        }
        for (rid, id) in b.rids.iter().zip(&b.ids) {
            if let Some(id) = *id {
                self.forget_rid(rid, id);
            }
        }
        let message = format!("engine step failed: {}", err.message);
        // A step that ran the device out of memory is a 503 (retry later, or smaller);
        // any other failed step is the server's fault.
        let answer = if err.status == axum::http::StatusCode::SERVICE_UNAVAILABLE {
            ApiError::unavailable(message)
        } else {
            ApiError::internal(message)
        };
        self.answer(b.reply, Err(answer));
        dropped
    }

    /// After an engine failure: every open batch gets the error, every request is aborted.
    fn fail_all<B: InferenceBackend>(&mut self, backend: &mut B, err: &ApiError) {
        tracing::error!(error = %err, "engine step failed; failing all open requests");
        let batches: Vec<Batch> = self.batches.drain().map(|(_, b)| b).collect();
        for b in batches {
            // Every batch fails here: what an abort says it dropped is among them.
            self.fail_batch(backend, b, err);
        }
        self.slots.clear();
        self.by_rid.clear();
    }
}

/// The requests a failed step (or abort) dropped, as the engine names them; None where the
/// error names none (every open request then fails).
fn failed_requests(e: &RolloutError) -> Option<Vec<RequestId>> {
    match e {
        RolloutError::StepFailed { requests, .. } => Some(requests.to_vec()),
        _ => None,
    }
}

/// A rid of `rids` that is already in flight or appears twice in `rids`.
fn duplicate_rid<'a>(
    mut rids: impl Iterator<Item = &'a str>,
    in_flight: &HashMap<String, RequestId>,
) -> Option<&'a str> {
    let mut seen = HashSet::new();
    rids.find(|rid| in_flight.contains_key(*rid) || !seen.insert(*rid))
}

/// The engine id of a result for a job that was never submitted (aborted while held).
const NEVER_SUBMITTED: RequestId = RequestId::MAX;

/// The result of a request aborted before it reached the engine: what the engine answers
/// for a queued request aborted before its prefill (no tokens, no routes).
fn unsubmitted_abort(request: &GenerateRequest, weight_version: u64) -> GenerateResult {
    GenerateResult {
        id: NEVER_SUBMITTED,
        prompt_tokens: request.input_ids.len(),
        output_ids: Vec::new(),
        output_logprobs: Vec::new(),
        output_top_logprobs: Vec::new(),
        prompt_logprobs: None,
        finish: FinishReason::Abort,
        cached_tokens: 0,
        routes: None,
        weight_version,
    }
}

/// The result a client gets for an aborted request: what was generated until the abort.
fn aborted_result(id: RequestId, p: PartialRollout, weight_version: u64) -> GenerateResult {
    GenerateResult {
        id,
        prompt_tokens: p.request.input_ids.len(),
        output_ids: p.output_ids,
        output_logprobs: p.output_logprobs,
        output_top_logprobs: p.output_top_logprobs,
        prompt_logprobs: p.prompt_logprobs,
        finish: FinishReason::Abort,
        cached_tokens: p.cached_tokens,
        routes: p.routes,
        weight_version,
    }
}
