//! A rollout fleet request that fails for its own fault (`rollout.backend = "sglang"`): real
//! r3 workers (in-process, 127.0.0.1, r3-fleet's test server) behind a layer that answers
//! chosen prompts' `/generate` with SGLang's HTTP 400.
//! - one prompt refused: the step trains on the other groups, `rollout.failed_groups` = 1,
//!   and their sequences, rewards and advantages are those of the same step without the
//!   refusal (their order and seeds kept); also for a step drawn ahead (`rollout.async`);
//! - with refill rounds (`algo.sampling_rounds`) a first round that lost every group is
//!   refilled with fresh prompts;
//! - every group refused: the step fails naming the first failure, also over refill rounds;
//! - every worker down: the step fails with the fleet's error, nothing dropped.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Json;
use r3_rollout::{Engine, EngineConfig};
use r3_server::{build_app, ServerConfig};
use r3_train::config::{RolloutBackend, TrainConfig};
use r3_train::rl::metrics_log::StepMetrics;
use r3_train::rl::step::StepTrace;
use r3_train::Trainer;
use serde_json::{json, Value};

mod common;
// The fleet's own test server: an r3 server on a free port with its own runtime.
#[allow(dead_code)]
#[path = "../../r3-fleet/tests/common/mod.rs"]
mod fleet_common;

use common::Scratch;
use fleet_common::{model_dir, Server};

/// Samples per prompt in these runs.
const GROUP: usize = 4;
/// Prompts per step.
const PROMPTS: usize = 4;
/// What the fake refusal says (the step's error must carry the worker's message).
const REFUSAL: &str = "the test refuses this prompt";

/// Which `/generate` prompts the worker refuses with HTTP 400.
#[derive(Clone)]
enum Refuse {
    Nothing,
    Prompts(Vec<Vec<u32>>),
    Everything,
}

impl Refuse {
    fn refuses(&self, ids: &[u32]) -> bool {
        match self {
            Refuse::Nothing => false,
            Refuse::Prompts(prompts) => prompts.iter().any(|p| p == ids),
            Refuse::Everything => true,
        }
    }
}

/// A real r3 worker on the shipped model whose `/generate` answers the prompts `refuse`
/// names as SGLang answers a bad request (400, an OpenAI-style error body).
fn worker(refuse: Refuse) -> Server {
    let engine = Engine::from_dir(&model_dir(), EngineConfig::default()).expect("engine");
    let app = build_app(engine, None, ServerConfig::default()).expect("app");
    let refuse = Arc::new(refuse);
    let router = app
        .router
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            let refuse = Arc::clone(&refuse);
            async move { refuse_or_pass(&refuse, req, next).await }
        }));
    Server::start(router)
}

async fn refuse_or_pass(refuse: &Refuse, req: Request, next: Next) -> Response {
    if req.uri().path() != "/generate" {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let ids: Option<Vec<u32>> = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| serde_json::from_value(v["input_ids"].clone()).ok());
    if ids.is_some_and(|ids| refuse.refuses(&ids)) {
        let body = json!({"object": "error", "message": REFUSAL, "type": "BadRequestError",
                          "param": null, "code": 400});
        return (StatusCode::BAD_REQUEST, Json(body)).into_response();
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// A small fleet run on the shipped model: `PROMPTS` × `GROUP`, 8 new tokens, no dynamic
/// sampling (every surviving group enters the update), `steps` steps.
fn fleet_config(dir: &Scratch, url: &str, steps: u64) -> TrainConfig {
    let mut cfg = TrainConfig {
        model_dir: model_dir(),
        run_dir: dir.path().join("run"),
        steps,
        seed: 11,
        ..TrainConfig::default()
    };
    cfg.rollout.backend = RolloutBackend::Sglang;
    cfg.rollout.urls = vec![url.to_string()];
    cfg.rollout.prompts_per_step = PROMPTS;
    cfg.rollout.group_size = GROUP;
    cfg.rollout.max_new_tokens = 8;
    cfg.rollout.request_timeout_s = 60.0;
    cfg.algo.dynamic_sampling = false;
    cfg.eval.every = 0;
    cfg.checkpoint.every = 0;
    cfg
}

/// The steps of a run with a trace each (the run stops at the first failed step).
fn run_steps(cfg: TrainConfig, steps: usize) -> Vec<(StepMetrics, StepTrace)> {
    cfg.validate().expect("valid config");
    let mut trainer = Trainer::new(cfg).expect("trainer");
    (0..steps)
        .map(|_| {
            let mut trace = StepTrace::default();
            let m = trainer
                .rl_step_with(Some(&mut trace))
                .unwrap_or_else(|e| panic!("step: {e}"));
            (m, trace)
        })
        .collect()
}

/// The first step's error.
fn first_step_error(cfg: TrainConfig) -> String {
    cfg.validate().expect("valid config");
    let mut trainer = Trainer::new(cfg).expect("trainer");
    trainer
        .rl_step()
        .expect_err("the step must fail")
        .to_string()
}

/// The prompt of each group of a traced step, group-major.
fn group_prompts(trace: &StepTrace) -> Vec<Vec<u32>> {
    trace
        .sequences
        .iter()
        .zip(&trace.prompt_lens)
        .step_by(GROUP)
        .map(|(seq, &len)| seq[..len].to_vec())
        .collect()
}

/// A group of the traced step whose prompt appears once in it and in none of `elsewhere`.
fn lone_group(trace: &StepTrace, elsewhere: &[Vec<u32>]) -> usize {
    let prompts = group_prompts(trace);
    (0..prompts.len())
        .rev()
        .find(|&g| {
            prompts.iter().filter(|p| **p == prompts[g]).count() == 1
                && !elsewhere.contains(&prompts[g])
        })
        .expect("a group with a prompt of its own")
}

/// The rows of `v` outside group `g`.
fn without_group<T: Clone>(v: &[T], g: usize) -> Vec<T> {
    v.iter()
        .enumerate()
        .filter(|(n, _)| n / GROUP != g)
        .map(|(_, x)| x.clone())
        .collect()
}

/// `got` (the step with group `g` refused) is `full` (the same step without refusals)
/// less group `g`: the same sequences in the same order (so the same seeds), rewards and
/// advantages; the failed group counted, the worker still up.
fn assert_trained_without(
    got: &(StepMetrics, StepTrace),
    full: &(StepMetrics, StepTrace),
    g: usize,
) {
    let ((m, trace), (full_m, full_trace)) = (got, full);
    assert_eq!(full_m.rollout_failed_groups, Some(0));
    assert_eq!(full_m.rollout_failed_requests, Some(0));
    assert_eq!(m.rollout_failed_groups, Some(1));
    assert_eq!(m.rollout_failed_requests, Some(GROUP as u64));
    assert_eq!(m.groups_kept, (PROMPTS - 1) as u64);
    assert_eq!(
        m.rollout_workers_up,
        Some(1),
        "a request's fault takes no worker out"
    );
    assert_eq!(trace.sequences, without_group(&full_trace.sequences, g));
    assert_eq!(trace.rewards, without_group(&full_trace.rewards, g));
    assert_eq!(trace.advantages, without_group(&full_trace.advantages, g));
    assert_eq!(trace.advantages.len(), (PROMPTS - 1) * GROUP);
}

#[test]
fn a_refused_prompt_costs_the_step_its_group_only() {
    let (dir_a, dir_b) = (
        Scratch::new("fleet-fail-full"),
        Scratch::new("fleet-fail-one"),
    );
    let full_worker = worker(Refuse::Nothing);
    let full = run_steps(fleet_config(&dir_a, &full_worker.url, 1), 1).remove(0);
    let g = lone_group(&full.1, &[]);
    let bad = group_prompts(&full.1)[g].clone();
    let refusing = worker(Refuse::Prompts(vec![bad]));
    let got = run_steps(fleet_config(&dir_b, &refusing.url, 1), 1).remove(0);
    assert_trained_without(&got, &full, g);
}

/// The batch a fleet draws ahead (`rollout.async`) drops a refused prompt's group the same
/// way: step 2, drawn during step 1, trains on the rest.
#[test]
fn a_refused_prompt_in_a_batch_drawn_ahead_costs_its_group_only() {
    let (dir_a, dir_b) = (
        Scratch::new("fleet-fail-sync"),
        Scratch::new("fleet-fail-async"),
    );
    let full_worker = worker(Refuse::Nothing);
    let mut sync = fleet_config(&dir_a, &full_worker.url, 2);
    sync.rollout.max_staleness = 1;
    let full = run_steps(sync, 2);
    let g = lone_group(&full[1].1, &group_prompts(&full[0].1));
    let bad = group_prompts(&full[1].1)[g].clone();
    let refusing = worker(Refuse::Prompts(vec![bad]));
    let mut ahead = fleet_config(&dir_b, &refusing.url, 2);
    ahead.rollout.max_staleness = 1;
    ahead.rollout.async_rollout = true;
    let got = run_steps(ahead, 2);
    assert_eq!(got[0].0.rollout_failed_groups, Some(0));
    // Step 2 ran on weights one version older than the synchronous run's: its sequences
    // differ, so only what refusing one group must do is checked.
    let (m, trace) = &got[1];
    assert_eq!(m.rollout_failed_groups, Some(1));
    assert_eq!(m.rollout_failed_requests, Some(GROUP as u64));
    assert_eq!(m.groups_kept, (PROMPTS - 1) as u64);
    let mut expected = group_prompts(&full[1].1);
    expected.remove(g);
    assert_eq!(group_prompts(trace), expected);
}

/// With refill rounds, a first round that lost every group is refilled with fresh prompts:
/// the step trains.
#[test]
fn groups_of_refused_prompts_are_refilled() {
    let (dir_a, dir_b) = (
        Scratch::new("fleet-refill-full"),
        Scratch::new("fleet-refill"),
    );
    let full_worker = worker(Refuse::Nothing);
    let full = run_steps(fleet_config(&dir_a, &full_worker.url, 1), 1).remove(0);
    let first_round = group_prompts(&full.1);
    let refusing = worker(Refuse::Prompts(first_round.clone()));
    let mut cfg = fleet_config(&dir_b, &refusing.url, 1);
    cfg.algo.dynamic_sampling = true;
    cfg.algo.sampling_rounds = 4;
    let (m, trace) = run_steps(cfg, 1).remove(0);
    let failed = m.rollout_failed_groups.expect("fleet metric");
    assert!(failed >= PROMPTS as u64, "{failed}");
    assert_eq!(m.rollout_failed_requests, Some(failed * GROUP as u64));
    assert!(m.sampling_rounds.expect("rounds") >= 2);
    let trained = group_prompts(&trace);
    assert!(!trained.is_empty());
    assert!(
        trained.iter().all(|p| !first_round.contains(p)),
        "{trained:?}"
    );
}

#[test]
fn a_step_whose_every_group_failed_names_the_first_failure() {
    let refusing = worker(Refuse::Everything);
    for rounds in [1, 2] {
        let dir = Scratch::new("fleet-fail-all");
        let mut cfg = fleet_config(&dir, &refusing.url, 1);
        cfg.algo.sampling_rounds = rounds;
        cfg.algo.dynamic_sampling = rounds > 1;
        let text = first_step_error(cfg);
        assert!(text.contains("every rollout group failed"), "{text}");
        assert!(
            text.contains(&format!("{} groups dropped", PROMPTS * rounds)),
            "{text}"
        );
        assert!(
            text.contains("HTTP 400") && text.contains(REFUSAL),
            "{text}"
        );
    }
}

/// A fleet whose only worker is gone is not a request's fault: the step fails with the
/// fleet's error (no worker left), nothing is dropped.
#[test]
fn a_fleet_with_every_worker_down_fails_the_step() {
    let dir = Scratch::new("fleet-down");
    let up = worker(Refuse::Nothing);
    let cfg = fleet_config(&dir, &up.url, 1);
    cfg.validate().expect("valid config");
    let mut trainer = Trainer::new(cfg).expect("trainer");
    drop(up);
    let text = trainer.rl_step().expect_err("no worker").to_string();
    assert!(text.contains("no rollout worker left"), "{text}");
    assert!(!text.contains("every rollout group failed"), "{text}");
}
