//! Whose fault a failure is, and workers coming back, against real r3 servers (in-process,
//! 127.0.0.1) and fake SGLang workers:
//! - a prompt past the model's context gets HTTP 400 (as SGLang answers it): that request
//!   fails alone with the server's message, no worker is taken out, and the batch's other
//!   results are kept;
//! - the same 5xx from two workers is the request's fault too: both workers stay up (also
//!   when it happens during a sync); so is the same 5xx twice from the only worker;
//! - a 401 is a worker fault (a worker without the API key): it is taken out and the request
//!   goes to another worker, even when two workers give the same 401;
//! - the same 503 from two workers (an ingress's generic body) says nothing about the
//!   request: a third worker is tried;
//! - a worker that was out rejoins although its `/health` answers 200 with an empty body,
//!   as SGLang's does;
//! - a worker brought back while syncs run loads a checkpoint with its own version label.

use std::path::Path;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use r3_fleet::{Fleet, FleetConfig, FleetError, PartialMode};
use r3_rollout::{GenerateRequest, SamplingParams};
use r3_routing::MergePolicy;
use serde_json::json;

mod common;
#[path = "common/fake.rs"]
mod fake;
use common::{facts, model_dir, Server};

fn fleet(urls: Vec<String>) -> Fleet {
    let cfg = FleetConfig {
        urls,
        max_in_flight: 8,
        request_timeout: Duration::from_secs(30),
        max_retries: 3,
        api_key: None,
        max_staleness: 0,
        partial: PartialMode::Resume,
        merge: MergePolicy::KeepPerTokenOrigin,
    };
    Fleet::new(cfg, facts()).expect("fleet")
}

/// A request (sampled, seed 0) of at most 8 new tokens after a prompt of `prompt_len`
/// tokens, stopping at the model's eos (2) as the trainer's requests do.
fn request(prompt_len: usize) -> GenerateRequest {
    let prompt = (0..prompt_len).map(|i| 3 + (i % 17) as u32).collect();
    let (max_new_tokens, stop_token_ids) = (8, vec![2]);
    let sampling = SamplingParams {
        max_new_tokens,
        stop_token_ids,
        ..SamplingParams::default()
    };
    GenerateRequest::new(prompt, sampling)
}

#[test]
fn a_prompt_past_the_context_fails_alone_and_takes_no_worker_out() {
    let (a, b) = (Server::real(), Server::real());
    let f = fleet(vec![a.url.clone(), b.url.clone()]);
    f.sync(&model_dir(), 1).expect("sync");
    // The shipped model's context is 128 positions (max_position_embeddings).
    let batch = vec![request(6), request(200), request(7)];
    let err = f.generate(batch).expect_err("one request cannot be served");
    let text = err.to_string();
    let FleetError::Batch(batch) = err else {
        panic!("not a batch error: {text}");
    };
    assert!(
        batch.results[0].is_some() && batch.results[2].is_some(),
        "{text}"
    );
    assert!(batch.results[1].is_none(), "{text}");
    match &batch.failures[..] {
        [(
            1,
            FleetError::RequestFailed {
                request: 1, error, ..
            },
        )] => {
            assert!(
                matches!(**error, FleetError::Status { status: 400, .. }),
                "{text}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        text.contains("max_position_embeddings"),
        "the server's message: {text}"
    );
    assert_eq!(batch.stats.retries, 0, "{text}");
    assert_eq!(batch.stats.results, 2, "{text}");
    assert_eq!(f.workers_up(), 2, "{text}");
    // The workers serve the next batch as they were.
    let (results, stats) = f.generate(vec![request(6)]).expect("next batch");
    assert_eq!((results.len(), stats.retries), (1, 0));
}

#[test]
fn the_same_5xx_from_two_workers_is_the_requests_fault() {
    let boom = json!({"error": {"message": "the engine failed on this prompt"}});
    let (a, _) = fake::start(StatusCode::INTERNAL_SERVER_ERROR, boom.clone());
    let (b, _) = fake::start(StatusCode::INTERNAL_SERVER_ERROR, boom);
    let f = fleet(vec![a.url.clone(), b.url.clone()]);
    f.sync(Path::new("/ckpt/step_1"), 1).expect("sync");
    let (mut outcomes, stats) = f.generate_each(vec![request(6)]).expect("batch");
    let err = outcomes.remove(0).expect_err("both workers fail it");
    let text = err.to_string();
    assert!(
        matches!(err, FleetError::RequestFailed { request: 0, .. }),
        "{text}"
    );
    assert!(text.contains("the engine failed on this prompt"), "{text}");
    assert!(text.contains(&a.url), "names the first worker: {text}");
    assert_eq!(stats.retries, 1, "tried on the second worker once");
    assert_eq!(f.workers_up(), 2, "{}", f.pool().down_summary());
}

/// A fleet of one: a 5xx cannot go to another worker, so the worker is asked again; the
/// same answer twice is the request's fault. The worker stays up, and the next batch reaches
/// it (before, it was taken out and every later request failed with "no worker").
#[test]
fn the_same_5xx_twice_from_the_only_worker_is_the_requests_fault() {
    let boom = json!({"error": {"message": "the engine failed on this prompt"}});
    let (a, fake) = fake::start(StatusCode::INTERNAL_SERVER_ERROR, boom);
    let f = fleet(vec![a.url.clone()]);
    f.sync(Path::new("/ckpt/step_1"), 1).expect("sync");
    let (mut outcomes, stats) = f.generate_each(vec![request(6)]).expect("batch");
    let err = outcomes.remove(0).expect_err("the worker fails it twice");
    let text = err.to_string();
    assert!(
        matches!(err, FleetError::RequestFailed { request: 0, .. }),
        "{text}"
    );
    assert!(text.contains("the engine failed on this prompt"), "{text}");
    assert!(text.contains("gave the same answer twice"), "{text}");
    assert_eq!(stats.retries, 1, "asked twice");
    assert_eq!(f.workers_up(), 1, "{}", f.pool().down_summary());
    // Another answer the second time is no verdict yet: a third try, then the same answer
    // twice again.
    fake.answer_once(StatusCode::INTERNAL_SERVER_ERROR, json!({"error": "first"}));
    let (mut outcomes, stats) = f.generate_each(vec![request(6)]).expect("next batch");
    let err = outcomes.remove(0).expect_err("fails again");
    assert!(err.is_request_failure(), "{err}");
    assert_eq!(stats.retries, 2, "{err}");
    assert_eq!(f.workers_up(), 1, "{}", f.pool().down_summary());
}

#[test]
fn workers_answering_401_are_taken_out_and_the_batch_completes_on_a_good_one() {
    let denied = json!({"detail": "Invalid API key"});
    let (a, _) = fake::start(StatusCode::UNAUTHORIZED, denied.clone());
    let (b, _) = fake::start(StatusCode::UNAUTHORIZED, denied);
    let good = Server::real();
    let f = fleet(vec![a.url.clone(), b.url.clone(), good.url.clone()]);
    f.sync(&model_dir(), 1).expect("sync");
    let (results, stats) = f
        .generate(vec![request(6), request(7)])
        .expect("the good worker serves the batch");
    assert_eq!(results.len(), 2);
    assert!(stats.retries >= 2, "{stats:?}");
    assert_eq!(f.workers_up(), 1, "both 401 workers are out");
    let down = f.pool().down_summary();
    assert!(down.contains(&a.url) && down.contains(&b.url), "{down}");
    assert!(down.contains("HTTP 401"), "{down}");
}

#[test]
fn the_same_503_from_two_workers_sends_the_request_to_a_third() {
    let busy = json!({"message": "Service Temporarily Unavailable"});
    let (a, _) = fake::start(StatusCode::SERVICE_UNAVAILABLE, busy.clone());
    let (b, _) = fake::start(StatusCode::SERVICE_UNAVAILABLE, busy);
    let good = Server::real();
    let f = fleet(vec![a.url.clone(), b.url.clone(), good.url.clone()]);
    f.sync(&model_dir(), 1).expect("sync");
    let (results, stats) = f
        .generate(vec![request(6)])
        .expect("the third worker serves it");
    assert_eq!(results.len(), 1);
    assert_eq!(stats.retries, 2, "tried on the first two, then the third");
    assert_eq!(f.workers_up(), 1, "{}", f.pool().down_summary());
}

/// The same 500 from two workers while a sync to version 2 is under way (both still loading
/// it): the first worker, taken out for it, is put back although it has not confirmed
/// version 2 yet.
#[test]
fn the_same_5xx_during_a_sync_keeps_both_workers_up() {
    let boom = json!({"error": {"message": "the engine failed on this prompt"}});
    let (a, a_fake) = fake::start(StatusCode::INTERNAL_SERVER_ERROR, boom.clone());
    let (b, b_fake) = fake::start(StatusCode::INTERNAL_SERVER_ERROR, boom);
    let f = fleet(vec![a.url.clone(), b.url.clone()]);
    f.sync(Path::new("/ckpt/step_1"), 1).expect("sync 1");
    a_fake.slow_loads(Duration::from_secs(3));
    b_fake.slow_loads(Duration::from_secs(3));
    std::thread::scope(|s| {
        let sync = s.spawn(|| f.sync(Path::new("/ckpt/step_2"), 2));
        let started = Instant::now();
        let loading = |fake: &fake::Fake| fake.loads().iter().any(|(_, v)| v == "2");
        while !(loading(&a_fake) && loading(&b_fake)) {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "sync 2 never began"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let (mut outcomes, _) = f.generate_each(vec![request(6)]).expect("batch");
        let up = f.workers_up();
        assert!(!sync.is_finished(), "the check must run during the sync");
        let err = outcomes.remove(0).expect_err("both workers fail it");
        let text = err.to_string();
        assert!(
            matches!(err, FleetError::RequestFailed { request: 0, .. }),
            "{text}"
        );
        assert!(text.contains("both workers stay up"), "{text}");
        assert_eq!(up, 2, "{}", f.pool().down_summary());
        sync.join().expect("sync 2 thread").expect("sync 2");
    });
    assert_eq!(f.workers_up(), 2);
}

#[test]
fn a_worker_whose_health_is_an_empty_200_rejoins() {
    let (w, fake) = fake::start(StatusCode::OK, json!({}));
    let f = fleet(vec![w.url.clone()]);
    fake.refuse_loads(true);
    let err = f
        .sync(Path::new("/ckpt/step_1"), 1)
        .expect_err("the only worker refuses");
    assert!(err.to_string().contains("refused by the fake"), "{err}");
    fake.refuse_loads(false);
    assert_eq!(f.rejoin(), 1, "{}", f.pool().down_summary());
    assert_eq!(
        fake.loads().last(),
        Some(&("/ckpt/step_1".to_string(), "1".to_string()))
    );
}

/// Sync A (version 2) holds the sync gate while its slow worker loads; sync B (version 3)
/// waits for it; a worker that was out is brought back meanwhile. Every load any worker
/// receives pairs a checkpoint with its own version.
#[test]
fn a_worker_brought_back_during_syncs_loads_a_matching_checkpoint() {
    let (slow, slow_fake) = fake::start(StatusCode::OK, json!({}));
    let (out, out_fake) = fake::start(StatusCode::OK, json!({}));
    let f = fleet(vec![slow.url.clone(), out.url.clone()]);
    out_fake.refuse_loads(true);
    f.sync(Path::new("/ckpt/step_1"), 1).expect("sync 1");
    assert_eq!(f.workers_up(), 1);
    slow_fake.slow_loads(Duration::from_millis(1500));
    std::thread::scope(|s| {
        let a = s.spawn(|| f.sync(Path::new("/ckpt/step_2"), 2));
        let started = Instant::now();
        while !slow_fake.loads().iter().any(|(_, v)| v == "2") {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "sync 2 never began"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let b = s.spawn(|| f.sync(Path::new("/ckpt/step_3"), 3));
        std::thread::sleep(Duration::from_millis(200));
        out_fake.refuse_loads(false);
        f.rejoin();
        a.join().expect("sync 2 thread").expect("sync 2");
        b.join().expect("sync 3 thread").expect("sync 3");
    });
    for (worker, loads) in [("slow", slow_fake.loads()), ("out", out_fake.loads())] {
        for (path, label) in loads {
            assert_eq!(path, format!("/ckpt/step_{label}"), "{worker} worker");
        }
    }
    assert_eq!(f.workers_up(), 2);
    assert_eq!(f.version(), 3);
}
