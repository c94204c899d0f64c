//! Partial rollout over HTTP against a real r3 server (in-process, 127.0.0.1):
//! - a proxy in front of the server aborts the first `/generate` after a few tokens (the
//!   server's own reply, marked `abort`, carries exactly the rows fed so far, as an abort
//!   does); the fleet resumes the request, and with greedy sampling the merged result
//!   equals one uninterrupted request to the same server: same tokens, the prompt-prefix
//!   routes equal, the route rows the concatenation of the two pieces;
//! - a weight sync while a batch is in flight aborts its requests; they are resumed on
//!   the new version, every result is complete and its rows carry old-then-new versions;
//! - a request sent after a sync has begun but before the worker's pause is answered from
//!   the old weights, and that reply is accepted (counted stale), not refused.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use r3_fleet::http::JsonClient;
use r3_fleet::{resume_seed, Fleet, FleetConfig, PartialMode};
use r3_rollout::{FinishReason, GenerateRequest, SamplingParams};
use r3_routing::MergePolicy;
use serde_json::{json, Value};

mod common;
use common::{facts, model_dir, Server};

/// A request without stop ids (the proxies add `ignore_eos`, so it runs to its budget).
fn request(temperature: f32, max_new_tokens: usize, seed: u64) -> GenerateRequest {
    let sampling = SamplingParams {
        temperature,
        max_new_tokens,
        stop_token_ids: Vec::new(),
        seed,
        ..SamplingParams::default()
    };
    GenerateRequest::new(vec![1, 5, 9, 4, 12, 3], sampling)
}

/// The proxy's state: where to forward, the budget of the one `/generate` it cuts short,
/// and every `/generate` body it saw.
#[derive(Clone)]
struct Proxy {
    target: String,
    client: JsonClient,
    abort_after: Arc<Mutex<Option<usize>>>,
    seen: Arc<Mutex<Vec<Value>>>,
    /// How long `/pause_generation` is held before it is forwarded.
    pause_delay: Duration,
    /// Set when a `/pause_generation` arrives (before the delay).
    pause_seen: Arc<AtomicBool>,
}

async fn proxy_generate(State(p): State<Proxy>, Json(mut body): Json<Value>) -> Json<Value> {
    // Runs to the budget: the model's own eos would otherwise end it early.
    body["sampling_params"]["ignore_eos"] = json!(true);
    p.seen.lock().expect("lock").push(body.clone());
    let cut = p.abort_after.lock().expect("lock").take();
    if let Some(k) = cut {
        body["sampling_params"]["max_new_tokens"] = json!(k);
    }
    let url = format!("{}/generate", p.target);
    let mut reply = p
        .client
        .post(&url, &body, Duration::from_secs(60))
        .await
        .expect("real server");
    if cut.is_some() {
        reply["meta_info"]["finish_reason"] =
            json!({"type": "abort", "message": "cut by the proxy"});
    }
    Json(reply)
}

async fn forward_post(
    State(p): State<Proxy>,
    uri: axum::http::Uri,
    Json(body): Json<Value>,
) -> Json<Value> {
    if uri.path() == "/pause_generation" {
        p.pause_seen.store(true, Ordering::SeqCst);
        tokio::time::sleep(p.pause_delay).await;
    }
    let url = format!("{}{}", p.target, uri.path());
    Json(
        p.client
            .post(&url, &body, Duration::from_secs(120))
            .await
            .expect("forward"),
    )
}

async fn forward_get(State(p): State<Proxy>, uri: axum::http::Uri) -> Json<Value> {
    let url = format!("{}{}", p.target, uri.path());
    Json(
        p.client
            .get(&url, Duration::from_secs(60))
            .await
            .expect("forward"),
    )
}

fn proxy(target: &str, abort_after: Option<usize>) -> (Server, Proxy) {
    proxy_with_pause_delay(target, abort_after, Duration::ZERO)
}

fn proxy_with_pause_delay(
    target: &str,
    abort_after: Option<usize>,
    pause_delay: Duration,
) -> (Server, Proxy) {
    let runtime = Server::runtime();
    let client = {
        let _guard = runtime.enter();
        JsonClient::new(None)
    };
    let state = Proxy {
        target: target.to_string(),
        client,
        abort_after: Arc::new(Mutex::new(abort_after)),
        seen: Arc::new(Mutex::new(Vec::new())),
        pause_delay,
        pause_seen: Arc::new(AtomicBool::new(false)),
    };
    let router = Router::new()
        .route("/generate", post(proxy_generate))
        .route("/health", get(forward_get))
        .route("/get_weight_version", get(forward_get))
        .route("/pause_generation", post(forward_post))
        .route("/continue_generation", post(forward_post))
        .route("/update_weights_from_disk", post(forward_post))
        .with_state(state.clone());
    (Server::start_on(runtime, router), state)
}

fn fleet(urls: Vec<String>, merge: MergePolicy) -> Fleet {
    let cfg = FleetConfig {
        urls,
        max_in_flight: 64,
        request_timeout: Duration::from_secs(60),
        max_retries: 2,
        api_key: None,
        max_staleness: 0,
        partial: PartialMode::Resume,
        merge,
    };
    Fleet::new(cfg, facts()).expect("fleet")
}

#[test]
fn a_resumed_request_equals_one_uninterrupted_request() {
    let real = Server::real();
    let req = request(0.0, 20, 5);
    let prompt = req.input_ids.len();
    let k = 7;
    let (plain, _) = proxy(&real.url, None);
    let direct = fleet(vec![plain.url.clone()], MergePolicy::KeepPerTokenOrigin);
    direct.sync(&model_dir(), 1).expect("sync");
    let (want, stats) = direct.generate(vec![req.clone()]).expect("uninterrupted");
    assert_eq!(stats.partial_resumed, 0);
    let want = &want[0];
    let want_routes = want.routes.as_ref().expect("routes");
    assert_eq!(want.output_ids.len(), 20);

    for merge in [
        MergePolicy::KeepPerTokenOrigin,
        MergePolicy::ReplaceWithResumed,
    ] {
        let (px, state) = proxy(&real.url, Some(k));
        let f = fleet(vec![px.url.clone()], merge);
        f.sync(&model_dir(), 1).expect("sync");
        let (got, stats) = f.generate(vec![req.clone()]).expect("resumed");
        assert_eq!(stats.partial_resumed, 1, "{merge:?}");
        let got = &got[0];
        assert_eq!(got.output_ids, want.output_ids, "{merge:?}");
        assert_eq!(got.finish, FinishReason::Length, "{merge:?}");
        for (a, b) in got.output_logprobs.iter().zip(&want.output_logprobs) {
            assert!((a - b).abs() < 1e-3, "{merge:?}: log-prob {a} vs {b}");
        }
        // The continuation the fleet sent: prompt + 7 tokens, the rest of the budget, the
        // documented seed, routes from where the kept rows end (or from 0 to replace).
        let seen = state.seen.lock().expect("lock").clone();
        assert_eq!(seen.len(), 2, "{merge:?}");
        let cont = &seen[1];
        let mut ids: Vec<u32> = req.input_ids.clone();
        ids.extend_from_slice(&want.output_ids[..k]);
        assert_eq!(cont["input_ids"], json!(ids), "{merge:?}");
        assert_eq!(cont["sampling_params"]["max_new_tokens"], json!(20 - k));
        assert_eq!(
            cont["sampling_params"]["sampling_seed"],
            json!(resume_seed(5, k))
        );
        let start = match merge {
            MergePolicy::KeepPerTokenOrigin => prompt + k - 1,
            // The fleet asks for the routes from the original start for every policy but
            // keep-per-token-origin (`Pieces::next_request`).
            MergePolicy::ReplaceWithResumed | MergePolicy::PreferResumedFromItsStart => 0,
        };
        assert_eq!(cont["routed_experts_start_len"], json!(start), "{merge:?}");

        let routes = got.routes.as_ref().expect("routes");
        assert_eq!(routes.start_pos(), 0);
        assert_eq!(routes.num_tokens(), prompt + 20 - 1, "{merge:?}");
        for t in 0..routes.num_tokens() {
            for c in 0..routes.num_columns() {
                assert_eq!(
                    routes.experts(t, c),
                    want_routes.experts(t, c),
                    "{merge:?}: row {t} col {c}"
                );
            }
        }
    }
}

/// Waits until the server at `url` has a request running (at most 60 s).
fn wait_running(url: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let client = {
        let _guard = rt.enter();
        JsonClient::new(None)
    };
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(60) {
        let loads = rt
            .block_on(client.get(&format!("{url}/v1/loads"), Duration::from_secs(10)))
            .expect("loads");
        if loads["loads"][0]["num_running_reqs"].as_u64().unwrap_or(0) > 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn a_sync_mid_batch_resumes_the_aborted_requests_on_the_new_version() {
    let real = Server::real();
    let (plain, _) = proxy(&real.url, None);
    let f = fleet(vec![plain.url.clone()], MergePolicy::KeepPerTokenOrigin);
    f.sync(&model_dir(), 1).expect("sync");
    let mut batch = 16;
    // A batch that finishes before the sync starts, or is cut before any token, shows
    // nothing: grow it until one is cut mid-decode.
    for attempt in 0..4u64 {
        let version = f.version();
        let reqs: Vec<GenerateRequest> = (0..batch).map(|i| request(1.0, 96, i as u64)).collect();
        let (results, stats) = std::thread::scope(|s| {
            let rollout = s.spawn(|| f.generate(reqs.clone()));
            wait_running(&real.url);
            // After a try whose sync landed in prefill, give the batch time to decode.
            std::thread::sleep(Duration::from_millis(25 * attempt));
            f.sync(&model_dir(), version + 1).expect("sync mid batch");
            rollout.join().expect("rollout thread")
        })
        .expect("batch");
        assert_eq!(results.len(), batch, "one result per request");
        for (i, r) in results.iter().enumerate() {
            assert_eq!(r.id, i as u64);
            assert_eq!(r.output_ids.len(), 96, "request {i} ran to its budget");
            assert_eq!(r.output_logprobs.len(), 96);
            let t = r.routes.as_ref().expect("routes");
            assert_eq!(
                t.num_tokens(),
                6 + 96 - 1,
                "request {i}: every fed position"
            );
            let v = t.versions().expect("versions");
            assert!(
                v.windows(2).all(|w| w[0] <= w[1]),
                "request {i}: old rows then new"
            );
            assert!(v.iter().all(|&x| x == version || x == version + 1));
        }
        // A request aborted before its first token is resumed from scratch on the new
        // weights (its empty piece leaves no version behind), so `partial_resumed > 0` alone
        // does not show a request that spans the sync; on a loaded machine a sync can land
        // while the whole batch is still in prefill. Only a spanning request shows the merge.
        if stats.spanning == 0 {
            assert!(
                stats.partial_resumed as usize <= batch,
                "at most one resume per request here: {stats:?}"
            );
        } else {
            assert!(stats.partial_resumed > 0, "{stats:?}");
            assert!(stats.stale >= stats.spanning, "{stats:?}");
            assert_eq!(stats.retries, 0, "an abort is not a worker fault");
            assert_eq!(f.workers_up(), 1);
            let spanning = results
                .iter()
                .filter(|r| {
                    let v = r.routes.as_ref().and_then(|t| t.versions()).unwrap_or(&[]);
                    v.first() != v.last()
                })
                .count();
            assert_eq!(spanning, stats.spanning);
            return;
        }
        batch *= 4;
    }
    panic!("no batch was in flight at the sync");
}

#[test]
fn a_request_sent_as_a_sync_begins_is_answered_from_the_old_weights() {
    let real = Server::real();
    let (slow_pause, state) = proxy_with_pause_delay(&real.url, None, Duration::from_secs(2));
    let f = fleet(
        vec![slow_pause.url.clone()],
        MergePolicy::KeepPerTokenOrigin,
    );
    f.sync(&model_dir(), 1).expect("sync");
    state.pause_seen.store(false, Ordering::SeqCst);
    let (results, stats) = std::thread::scope(|s| {
        let sync = s.spawn(|| f.sync(&model_dir(), 2));
        let started = std::time::Instant::now();
        while !state.pause_seen.load(Ordering::SeqCst) {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "no pause arrived"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // The sync has begun (version 2 announced) but the worker still runs version 1.
        let out = f.generate(vec![request(1.0, 8, 3)]);
        sync.join().expect("sync thread").expect("sync to 2");
        out
    })
    .expect("a reply from the weights the worker had when the request reached it");
    let versions = results[0]
        .routes
        .as_ref()
        .and_then(|t| t.versions())
        .expect("versions");
    assert!(versions.iter().all(|&v| v == 1), "{versions:?}");
    assert_eq!(results[0].output_ids.len(), 8);
    assert_eq!(stats.stale, 1, "{stats:?}");
    assert_eq!(f.version(), 2);
    // Once the sync is over, requests are served by the new weights.
    let after = f
        .generate(vec![request(1.0, 8, 3)])
        .expect("after the sync");
    let v = after.0[0]
        .routes
        .as_ref()
        .and_then(|t| t.versions())
        .expect("versions");
    assert!(v.iter().all(|&x| x == 2), "{v:?}");
}
