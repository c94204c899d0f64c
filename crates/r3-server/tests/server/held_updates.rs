//! The engine worker while a weight update waits for the requests in flight (driven through
//! its handle, below the HTTP layer): batches that arrive meanwhile are held, counted as
//! waiting, abortable by rid, by abort-all and by a pause with mode abort (answered as an
//! aborted queued request, in job order) and dropped when their client goes; a second update
//! queues behind the first instead of replacing it, every caller gets its own answer, and a
//! refused update lets what it held run on the old weights; and the counters are published
//! before the answers they count. The engine is gated, so nothing
//! finishes before the test opens the gate: every check is deterministic.

use std::future::Future;
use std::path::{Path, PathBuf};

use r3_rollout::request::{FinishReason, GenerateRequest};
use r3_rollout::sampler::SamplingParams;
use r3_server::worker::BatchAnswer;
use r3_server::{ApiError, EngineHandle, Finished, Job, PauseMode, StagedWeights};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use crate::fake::FakeEngine;
use crate::gated::{wait_for, Gate, Gated};
use crate::support::scratch_dir;

/// A worker over the gated fake engine, and a runtime to await its answers on.
struct Worker {
    handle: EngineHandle,
    gate: Gate,
    rt: Runtime,
    /// A directory the fake engine accepts as new weights, and one it refuses.
    good: PathBuf,
    bad: PathBuf,
}

impl Worker {
    fn new() -> Self {
        let gate = Gate::closed();
        let (handle, _, _) =
            EngineHandle::spawn(Gated::new(FakeEngine::new(0), gate.clone())).expect("worker");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let good = scratch_dir("held-updates-good");
        std::fs::write(good.join("model.safetensors"), b"").expect("weights file");
        let bad = scratch_dir("held-updates-bad");
        Worker {
            handle,
            gate,
            rt,
            good,
            bad,
        }
    }

    /// Starts a batch of `(rid, prompt)` jobs of `max_new` greedy tokens each.
    fn start(&self, jobs: &[(&str, &[u32])], max_new: usize) -> BatchAnswer {
        let jobs = jobs
            .iter()
            .map(|&(rid, prompt)| Job {
                rid: rid.to_string(),
                request: GenerateRequest {
                    input_ids: prompt.to_vec(),
                    sampling: SamplingParams::greedy(max_new),
                    return_routes: false,
                    routed_experts_start_len: 0,
                },
                stop: None,
            })
            .collect();
        self.handle.start(jobs, None).expect("sent")
    }

    /// Starts request `long` (4 greedy tokens) and waits until it runs: the gate is
    /// closed, so it stays in flight and an update sent next is held behind it.
    fn start_long(&self) -> BatchAnswer {
        let long = self.start(&[("long", &[3])], 4);
        wait_for("the long request to run", || {
            self.handle.stats().running == 1
        });
        long
    }

    /// Sends an update from `dir` labelled `label`; it is pending (or applied) once this
    /// returns.
    fn update(&self, dir: &Path, label: &str) -> JoinHandle<Result<String, ApiError>> {
        let before = self.handle.stats().updates_waiting;
        let handle = self.handle.clone();
        let staged = StagedWeights {
            dir: dir.to_path_buf(),
            weights: None,
        };
        let label = label.to_string();
        let update = self
            .rt
            .spawn(async move { handle.update_weights(staged, false, Some(label)).await });
        wait_for("the update to reach the worker", || {
            self.handle.stats().updates_waiting > before || update.is_finished()
        });
        update
    }

    fn wait<F: Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    fn answer(&self, answer: BatchAnswer) -> Vec<Finished> {
        self.wait(answer)
            .expect("the worker answers")
            .expect("the batch succeeds")
    }

    fn updated(&self, update: JoinHandle<Result<String, ApiError>>) -> Result<String, ApiError> {
        self.wait(update).expect("update task")
    }

    /// Waits until the worker counts `waiting` requests waiting (held ones included).
    fn wait_waiting(&self, waiting: usize) {
        wait_for(&format!("{waiting} requests waiting"), || {
            self.handle.stats().waiting == waiting
        });
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.good);
        let _ = std::fs::remove_dir_all(&self.bad);
    }
}

fn is_abort(f: &Finished) -> bool {
    matches!(f.result.finish, FinishReason::Abort)
}

fn is_length(f: &Finished) -> bool {
    matches!(f.result.finish, FinishReason::Length)
}

/// A held request aborted before it ran: finish abort, no tokens, its prompt counted.
fn assert_aborted_unstarted(f: &Finished, prompt_len: usize) {
    assert!(is_abort(f), "{:?}", f.result.finish);
    assert!(f.result.output_ids.is_empty(), "{:?}", f.result.output_ids);
    assert!(f.result.output_logprobs.is_empty());
    assert_eq!(f.result.prompt_tokens, prompt_len);
    assert_eq!(f.result.cached_tokens, 0);
}

#[test]
fn held_requests_count_as_waiting_and_abort_by_rid_and_a_second_update_queues() {
    let w = Worker::new();
    let long = w.start_long();
    let first = w.update(&w.good, "v1");
    assert_eq!(w.handle.stats().updates_waiting, 1);
    // Held behind the update: counted as waiting (what /get_load, /v1/loads and
    // /get_server_info publish).
    let held = w.start(&[("b0", &[4]), ("b1", &[5, 6]), ("b2", &[7])], 3);
    w.wait_waiting(3);
    // One job of the held batch aborted by its rid; the others still wait.
    assert_eq!(w.wait(w.handle.abort(Some("b1".into()))).expect("abort"), 1);
    assert_eq!(w.handle.stats().waiting, 2);
    assert_eq!(w.handle.stats().finished_requests, 1);
    // A second update while the first waits: queued behind it (and behind the batch that
    // came before it), not replacing it.
    let second = w.update(&w.good, "v2");
    assert_eq!(w.handle.stats().updates_waiting, 2);
    assert!(!first.is_finished() && !second.is_finished());
    let later = w.start(&[("c0", &[8])], 2);
    w.wait_waiting(3);
    w.gate.open();
    let long = w.answer(long);
    assert!(is_length(&long[0]));
    assert_eq!(long[0].weight_version, "default");
    assert_eq!(w.updated(first).expect("first update"), "v1");
    // The held batch ran between the two updates, its aborted job in its place.
    let held = w.answer(held);
    assert_eq!(held.len(), 3);
    assert!(is_length(&held[0]) && is_length(&held[2]));
    assert_eq!(held[0].result.output_ids.len(), 3);
    assert_eq!(held[0].result.prompt_tokens, 1);
    assert_eq!(held[0].weight_version, "v1");
    assert_eq!(held[2].weight_version, "v1");
    assert_aborted_unstarted(&held[1], 2);
    assert_eq!(w.updated(second).expect("second update"), "v2");
    let later = w.answer(later);
    assert!(is_length(&later[0]));
    assert_eq!(later[0].weight_version, "v2");
    wait_for("the worker to publish its idle state", || {
        let s = w.handle.stats();
        s.waiting == 0 && s.running == 0 && s.updates_waiting == 0 && s.finished_requests == 5
    });
    assert_eq!(w.handle.stats().weight_version, "v2");
}

#[test]
fn abort_all_answers_held_batches_at_once_in_job_order() {
    let w = Worker::new();
    let long = w.start_long();
    let update = w.update(&w.good, "v1");
    let held = w.start(&[("h0", &[4, 5, 6]), ("h1", &[7])], 3);
    w.wait_waiting(2);
    assert_eq!(w.wait(w.handle.abort(None)).expect("abort all"), 3);
    let held = w.answer(held);
    assert_aborted_unstarted(&held[0], 3);
    assert_aborted_unstarted(&held[1], 1);
    assert_eq!(held[0].weight_version, "default");
    assert!(is_abort(&w.answer(long)[0]));
    // Nothing in flight any more: the update goes in, though the gate never opened.
    assert_eq!(w.updated(update).expect("update"), "v1");
    let s = w.handle.stats();
    assert_eq!((s.waiting, s.running, s.finished_requests), (0, 0, 3));
}

#[test]
fn pause_with_abort_aborts_held_batches_too() {
    let w = Worker::new();
    let long = w.start_long();
    let update = w.update(&w.good, "v1");
    let held = w.start(&[("h0", &[4]), ("h1", &[5])], 3);
    w.wait_waiting(2);
    assert_eq!(w.wait(w.handle.pause(PauseMode::Abort)).expect("pause"), 3);
    let held = w.answer(held);
    assert!(held
        .iter()
        .all(|f| is_abort(f) && f.result.output_ids.is_empty()));
    assert!(is_abort(&w.answer(long)[0]));
    // Paused: the update goes in at once; a request sent now waits for the continue and
    // runs under the new weights.
    assert_eq!(w.updated(update).expect("update"), "v1");
    let after = w.start(&[("a0", &[6])], 2);
    w.gate.open();
    w.wait(w.handle.resume()).expect("continue");
    let after = w.answer(after);
    assert!(is_length(&after[0]));
    assert_eq!(after[0].weight_version, "v1");
}

#[test]
fn a_refused_update_lets_its_held_batches_run_on_the_old_weights() {
    let w = Worker::new();
    let long = w.start_long();
    let refused = w.update(&w.bad, "v1");
    let held = w.start(&[("h0", &[4])], 3);
    w.wait_waiting(1);
    let good = w.update(&w.good, "v2");
    let later = w.start(&[("l0", &[5])], 3);
    w.wait_waiting(2);
    w.gate.open();
    assert!(is_length(&w.answer(long)[0]));
    let e = w.updated(refused).expect_err("no weights there");
    assert!(e.status.is_client_error(), "{} {}", e.status, e.message);
    let held = w.answer(held);
    assert!(is_length(&held[0]));
    assert_eq!(held[0].weight_version, "default");
    assert_eq!(w.updated(good).expect("the next update"), "v2");
    let later = w.answer(later);
    assert_eq!(later[0].weight_version, "v2");
}

#[test]
fn a_held_batch_whose_client_leaves_is_dropped() {
    let w = Worker::new();
    let long = w.start_long();
    let update = w.update(&w.good, "v1");
    let held = w.start(&[("h0", &[4]), ("h1", &[5])], 3);
    w.wait_waiting(2);
    drop(held);
    wait_for("the held requests to end", || {
        let s = w.handle.stats();
        s.waiting == 0 && s.finished_requests == 2
    });
    // Their rids are free: a new request may take one (it waits for the update too).
    let again = w.start(&[("h0", &[6])], 2);
    w.wait_waiting(1);
    w.gate.open();
    assert!(is_length(&w.answer(long)[0]));
    assert_eq!(w.updated(update).expect("update"), "v1");
    assert_eq!(w.answer(again)[0].weight_version, "v1");
}

#[test]
fn a_dropped_answer_aborts_its_request_while_the_worker_waits_for_commands() {
    // Paused, the worker runs no step and sleeps until a command comes: dropping the answer
    // wakes it, and it aborts the request at once (no other command needed).
    let w = Worker::new();
    w.gate.open();
    w.wait(w.handle.pause(PauseMode::InPlace)).expect("pause");
    let queued = w.start(&[("q0", &[3])], 4);
    wait_for("the request to be queued", || {
        let s = w.handle.stats();
        s.waiting + s.running == 1
    });
    drop(queued);
    wait_for("the abandoned request to end", || {
        let s = w.handle.stats();
        s.waiting + s.running == 0 && s.finished_requests == 1
    });
}

/// The counters a client reads right after its answer already count its requests as ended
/// and no longer running: the worker publishes them before it sends the answers of a step.
#[test]
fn a_batch_answered_is_already_counted_as_ended() {
    let w = Worker::new();
    w.gate.open();
    for round in 0..300u64 {
        let (a, b) = (format!("a{round}"), format!("b{round}"));
        let answer = w.answer(w.start(&[(&a, &[3]), (&b, &[4, 5])], 1 + round as usize % 3));
        let s = w.handle.stats();
        assert_eq!(answer.len(), 2);
        assert_eq!(
            (s.running, s.waiting, s.finished_requests),
            (0, 0, 2 * (round + 1)),
            "round {round}"
        );
    }
}

/// A held batch refused when it is admitted after the update (a rid repeated in it) is
/// answered at once, though nothing is in flight then and no command follows: the worker
/// never sleeps on a queued answer.
#[test]
fn a_held_batch_refused_after_the_update_is_answered_without_another_command() {
    let w = Worker::new();
    let long = w.start_long();
    let update = w.update(&w.good, "v1");
    let refused = w.start(&[("d", &[4]), ("d", &[5])], 2);
    w.wait_waiting(2);
    w.gate.open();
    assert!(is_length(&w.answer(long)[0]));
    assert_eq!(w.updated(update).expect("update"), "v1");
    let answer =
        w.wait(async { tokio::time::timeout(std::time::Duration::from_secs(20), refused).await });
    let err = answer
        .expect("answered without another command")
        .expect("the worker answers")
        .expect_err("a rid repeated in the batch is refused");
    assert!(err.message.contains("\"d\""), "{}", err.message);
}
