//! The server over the device engine (`r3 serve --device cpu-candle`: r3-model's layers on
//! candle's CPU device, the code a GPU runs) and the tiny HF Qwen3-MoE oracle checkpoint: the
//! answers on the wire (tokens, log-probs, routes) equal the CPU engine's for the same
//! requests, one at a time and from concurrent clients (batched together), an abort of a
//! running request answers as on the CPU engine, and a second turn is served from the
//! device engine's prefix cache with the routes computed cold, until a weight update.

use r3_rollout::{DeviceEngine, DeviceEngineConfig};
use r3_server::{build_app, ServerConfig};

use crate::engine::{alone, check_answer, concurrent_replies, engine, request, wire_shape, MODEL};
use crate::support::{fixture, ids, TestServer};
use serde_json::json;

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
