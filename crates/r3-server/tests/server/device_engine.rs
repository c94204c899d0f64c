//! The server over the device engine (`r3 serve --device cpu-candle`: r3-model's layers on
//! candle's CPU device, the code a GPU runs) and the tiny HF Qwen3-MoE oracle checkpoint: the
//! answers on the wire (tokens, log-probs, routes) equal the CPU engine's for the same
//! requests, one at a time and from concurrent clients (batched together), an abort of a
//! running request answers as on the CPU engine, and a second turn is served from the
//! device engine's prefix cache with the routes computed cold, until a weight update; an
//! update to other weights serves them as a CPU engine built from them answers. A
//! colocated trainer's cycle — pause with `retract`, release the memory, update the
//! weights from disk, resume, continue — leaves the retracted request finishing as it
//! would have without it.

use std::time::{Duration, Instant};

use r3_rollout::{DeviceEngine, DeviceEngineConfig};
use r3_server::{build_app, ServerConfig};

use crate::engine::{
    alone, check_answer, check_update_serves_the_new_weights, concurrent_replies, engine, request,
    wire_shape, MODEL,
};
use crate::paced::Paced;
use crate::support::{fixture, ids, TestServer};
use serde_json::{json, Value};

fn server() -> TestServer {
    let device = DeviceEngine::from_dir(&fixture(MODEL), DeviceEngineConfig::default())
        .expect("device engine loads the fixture");
    let app = build_app(device, None, ServerConfig::default()).expect("app builds");
    TestServer::start(app)
}

#[test]
fn answers_equal_the_cpu_engines_alone_and_concurrent() {
    let server = server();
    let reference = engine(&fixture(MODEL));
    for (prompt, start_len) in [(vec![3u32, 17, 42, 99, 7], 0usize), (vec![11, 12, 13], 2)] {
        let (body, req) = request(&prompt, 6, 5, start_len);
        let r = server.post("/generate", &body);
        assert_eq!(r.status, 200, "{}", r.text);
        check_answer(&r.body, &alone(req), &wire_shape(&reference, start_len));
    }
    let cases: Vec<(Vec<u32>, usize, u64)> = (0..5u32)
        .map(|i| {
            let prompt = (0..3 + 2 * i).map(|t| (t * 29 + i * 11) % 256).collect();
            (prompt, 3 + i as usize, u64::from(i))
        })
        .collect();
    let replies = concurrent_replies(&server, &cases);
    for ((prompt, max_new, seed), body) in cases.iter().zip(&replies) {
        let want = alone(request(prompt, *max_new, *seed, 0).1);
        check_answer(body, &want, &wire_shape(&reference, 0));
    }
}

#[test]
fn an_update_from_disk_serves_the_new_weights() {
    check_update_serves_the_new_weights(&server());
}

#[test]
fn a_request_past_the_context_is_refused_as_on_the_cpu_engine() {
    let server = server();
    let max_pos = engine(&fixture(MODEL))
        .model_config()
        .max_position_embeddings;
    let prompt: Vec<u32> = vec![5; max_pos];
    let r = server.post("/generate", &request(&prompt, 2, 0, 0).0);
    assert_eq!(r.status, 400, "{}", r.text);
}

#[test]
fn a_second_turn_hits_the_prefix_cache_with_the_cold_routes_until_a_weight_update() {
    let server = server();
    let reference = engine(&fixture(MODEL));
    let turn1: Vec<u32> = (0..40).map(|t| (t * 13 + 5) % 256).collect();
    let r1 = server.post("/generate", &request(&turn1, 4, 1, 0).0);
    assert_eq!(r1.status, 200, "{}", r1.text);
    let mut turn2 = turn1.clone();
    turn2.extend(ids(&r1.body["output_ids"]));
    turn2.extend([7, 8, 9]);
    let (body, req) = request(&turn2, 4, 2, 0);
    let r2 = server.post("/generate", &body);
    assert_eq!(r2.status, 200, "{}", r2.text);
    let cached = r2.body["meta_info"]["cached_tokens"].as_u64();
    assert_eq!(
        cached,
        Some(32),
        "the first turn's full blocks of 16 are reused"
    );
    // Routes of the cached part equal those the CPU engine computes cold.
    check_answer(&r2.body, &alone(req), &wire_shape(&reference, 0));
    let r = server.post(
        "/update_weights_from_disk",
        &json!({"model_path": fixture(MODEL)}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let after = server.post("/generate", &body);
    assert_eq!(after.status, 200, "{}", after.text);
    assert_eq!(after.body["meta_info"]["cached_tokens"], 0, "no stale hit");
    assert_eq!(
        after.body["output_ids"], r2.body["output_ids"],
        "same weights"
    );
}

/// `/v1/loads`' queued and running requests.
fn queues(server: &TestServer) -> (u64, u64) {
    let loads = server.get("/v1/loads").body;
    let of = |key: &str| loads["loads"][0][key].as_u64().unwrap_or(u64::MAX);
    (of("num_waiting_reqs"), of("num_running_reqs"))
}

/// The cycle of a trainer sharing the GPU with `r3 serve --device` (AReaL's offload /
/// onload, slime's pause with retract): a request running when generation is paused with
/// `retract` waits through the memory's release, an update from disk and the resume, and
/// finishes with the tokens, routes and log-probs it has without the pause. Releasing under
/// a running request, an unknown tag and resuming what is not released are refused by name;
/// no step runs while the weights or KV cache are released, even once generation is
/// continued, and a `cuda_graph` left released holds nothing back.
#[test]
fn a_retracted_request_finishes_unchanged_through_release_update_and_resume() {
    let device = DeviceEngine::from_dir(&fixture(MODEL), DeviceEngineConfig::default())
        .expect("device engine loads the fixture");
    let paced = Paced::new(device, Duration::from_millis(3));
    let server = TestServer::start(build_app(paced, None, ServerConfig::default()).expect("app"));
    let body = json!({"input_ids": [7, 8, 9, 10], "return_routed_experts": true,
                      "return_logprob": true,
                      "sampling_params": {"max_new_tokens": 90, "seed": 4,
                                          "temperature": 1.0, "ignore_eos": true}});
    let plain = server.post("/generate", &body);
    assert_eq!(plain.status, 200, "{}", plain.text);

    let addr = server.addr;
    let sent = body.to_string();
    let client = std::thread::spawn(move || {
        crate::support::request(addr, "POST", "/generate", sent.as_bytes())
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while queues(&server).1 != 1 {
        assert!(Instant::now() < deadline, "the request never ran");
        std::thread::sleep(Duration::from_millis(2));
    }
    let busy = server.post("/release_memory_occupation", &json!({}));
    assert_eq!(busy.status, 400, "{}", busy.text);
    assert!(busy.error_message().contains("retract"), "{}", busy.text);

    let paused = server.post("/pause_generation", &json!({"mode": "retract"}));
    assert_eq!(paused.status, 200, "{}", paused.text);
    assert_eq!(paused.body["aborted"], 1, "{}", paused.text);
    assert_eq!(paused.body["running"], 0, "{}", paused.text);
    assert_eq!(queues(&server), (1, 0));

    let unknown = server.post("/release_memory_occupation", &json!({"tags": ["kv"]}));
    assert_eq!(unknown.status, 400, "{}", unknown.text);
    assert!(
        unknown.error_message().contains("\"kv\""),
        "{}",
        unknown.text
    );
    let released = server.post("/release_memory_occupation", &json!({}));
    assert_eq!(released.status, 200, "{}", released.text);
    assert_eq!(
        released.body["released"],
        json!(["kv_cache", "weights", "cuda_graph"])
    );
    let info = server.get("/get_server_info").body;
    assert_eq!(
        info["worker"]["memory_released"].as_array().map(Vec::len),
        Some(3)
    );
    // Continued, but nothing runs on released memory; liveness still answers.
    assert_eq!(server.post("/continue_generation", &json!({})).status, 200);
    assert_eq!(server.get("/health_generate").status, 200);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(queues(&server), (1, 0), "a step ran with memory released");

    // A trainer's update arrives while the weights are on the host.
    let version = server.get("/get_weight_version").body["weight_version"].clone();
    let update = server.post(
        "/update_weights_from_disk",
        &json!({"model_path": fixture(MODEL), "abort_all_requests": false}),
    );
    assert_eq!(update.status, 200, "{}", update.text);
    assert_ne!(
        server.get("/get_weight_version").body["weight_version"],
        version
    );
    let weights = server.post("/resume_memory_occupation", &json!({"tags": ["weights"]}));
    assert_eq!(weights.status, 200, "{}", weights.text);
    assert_eq!(weights.body["released"], json!(["kv_cache", "cuda_graph"]));
    let again = server.post("/resume_memory_occupation", &json!({"tags": ["weights"]}));
    assert_eq!(again.status, 400, "{}", again.text);
    assert!(
        again.error_message().contains("not released"),
        "{}",
        again.text
    );
    // As clients that resume only what they know of: `cuda_graph` left released holds
    // nothing back (r3 captures no CUDA graphs).
    let kv = server.post("/resume_memory_occupation", &json!({"tags": ["kv_cache"]}));
    assert_eq!(kv.status, 200, "{}", kv.text);
    assert_eq!(kv.body["released"], json!(["cuda_graph"]));
    let deadline = Instant::now() + Duration::from_secs(60);
    while queues(&server) != (0, 0) {
        if Instant::now() > deadline {
            // Answered, so the server can shut down when the test fails.
            server.post("/abort_request", &json!({"abort_all": true}));
            panic!("the retracted request never finished");
        }
        std::thread::sleep(Duration::from_millis(5));
    }

    let done = client.join().expect("client thread");
    assert_eq!(done.status, 200, "{}", done.text);
    assert_eq!(done.body["output_ids"], plain.body["output_ids"]);
    let (dm, pm) = (&done.body["meta_info"], &plain.body["meta_info"]);
    assert_eq!(dm["finish_reason"], pm["finish_reason"]);
    assert_eq!(dm["routed_experts"], pm["routed_experts"]);
    let logprobs = |m: &Value| -> Vec<f64> {
        m["output_token_logprobs"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|x| x[0].as_f64().unwrap_or(f64::NAN))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (a, b) = (logprobs(dm), logprobs(pm));
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    assert!(d < 1e-4, "log-probs differ by {d}");
}
