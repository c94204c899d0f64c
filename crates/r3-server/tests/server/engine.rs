//! The server over the real engine and the tiny HF Qwen3-MoE oracle checkpoint: routes on
//! the wire equal the engine's own (what `r3 generate` prints), concurrent clients get the
//! answers they would get alone, the prefix cache reports hits, text works with a
//! tokenizer.json, a weight update bumps the version and empties the prefix cache, and one
//! to other weights serves them (the answers of an engine built from them).

use std::path::Path;

use r3_rollout::{Dtype, Engine, EngineConfig, GenerateRequest, SamplingParams};
use r3_routing::wire::sglang::decode_sglang_response;
use r3_routing::wire::WireShape;
use r3_routing::RouteTable;
use r3_server::{build_app, ServerConfig, TextCodec};
use serde_json::{json, Value};

use crate::support::{fixture, ids, other_weights, scratch_dir, write_tokenizer, TestServer};

pub(crate) const MODEL: &str = "qwen3_moe_tiny";

pub(crate) fn engine(dir: &Path) -> Engine {
    let cfg = EngineConfig {
        dtype: Dtype::F32,
        kv_cache_bytes: 32 << 20,
        prefix_cache_bytes: 8 << 20,
        ..EngineConfig::default()
    };
    Engine::from_dir(dir, cfg).expect("engine loads the fixture")
}

fn server(dir: &Path) -> TestServer {
    let text = TextCodec::from_model_dir(dir).expect("tokenizer loads if present");
    let app = build_app(engine(dir), text, ServerConfig::default()).expect("app builds");
    TestServer::start(app)
}

/// What the engine alone gives for a request (the reference for the server's answers).
pub(crate) fn alone(req: GenerateRequest) -> r3_rollout::GenerateResult {
    alone_with(&fixture(MODEL), req)
}

/// What an engine built from the checkpoint in `dir` gives for a request alone.
pub(crate) fn alone_with(dir: &Path, req: GenerateRequest) -> r3_rollout::GenerateResult {
    let mut e = engine(dir);
    e.generate(vec![req]).expect("engine generates").remove(0)
}

/// A weight update from disk to other weights (`other_weights`) serves them: the answer
/// after it — tokens, log-probs, routes on the wire — is what an engine built from that
/// checkpoint gives, and differs from the answer before it. `server` serves the fixture.
pub(crate) fn check_update_serves_the_new_weights(server: &TestServer) {
    let other = other_weights(MODEL);
    let (body, req) = request(&[3, 17, 42, 99, 7, 11], 6, 5, 0);
    let before = server.post("/generate", &body);
    assert_eq!(before.status, 200, "{}", before.text);
    let shape = wire_shape(&engine(&other), 0);
    check_answer(&before.body, &alone(req.clone()), &shape);
    let r = server.post("/update_weights_from_disk", &json!({"model_path": other}));
    assert_eq!(r.status, 200, "{}", r.text);
    let after = server.post("/generate", &body);
    assert_eq!(after.status, 200, "{}", after.text);
    check_answer(&after.body, &alone_with(&other, req), &shape);
    for what in ["output_ids", "meta_info"] {
        assert_ne!(after.body[what], before.body[what], "{what} changed");
    }
    let routes = |r: &Value| r["meta_info"]["routed_experts"].clone();
    assert_ne!(routes(&after.body), routes(&before.body), "routes changed");
    let _ = std::fs::remove_dir_all(&other);
}

pub(crate) fn request(
    prompt: &[u32],
    max_new: usize,
    seed: u64,
    start_len: usize,
) -> (Value, GenerateRequest) {
    let body = json!({
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0, "seed": seed, "ignore_eos": true},
        "return_logprob": true,
        "return_routed_experts": true,
        "routed_experts_start_len": start_len,
    });
    let sampling = SamplingParams {
        temperature: 1.0,
        max_new_tokens: max_new,
        seed,
        ..SamplingParams::default()
    };
    let req = GenerateRequest {
        input_ids: prompt.to_vec(),
        sampling,
        return_routes: true,
        routed_experts_start_len: start_len,
    };
    (body, req)
}

pub(crate) fn wire_shape(e: &Engine, start_len: usize) -> WireShape {
    let cfg = e.model_config();
    WireShape::new(cfg.num_hidden_layers, cfg.top_k(), cfg.num_experts())
        .with_start_len(start_len)
        .with_layout(cfg.layer_layout().clone())
        .expect("layout matches")
}

/// Cell-by-cell equality (the decoded table carries no per-row weight versions).
fn assert_same_routes(got: &RouteTable, want: &RouteTable) {
    assert_eq!(got.num_tokens(), want.num_tokens(), "route rows");
    assert_eq!(got.layers(), want.layers());
    assert_eq!(got.start_pos(), want.start_pos());
    for t in 0..got.num_tokens() {
        for c in 0..got.num_columns() {
            assert_eq!(got.experts(t, c), want.experts(t, c), "row {t} column {c}");
        }
    }
}

pub(crate) fn check_answer(body: &Value, want: &r3_rollout::GenerateResult, shape: &WireShape) {
    assert_eq!(ids(&body["output_ids"]), want.output_ids);
    let lps = body["meta_info"]["output_token_logprobs"]
        .as_array()
        .expect("logprobs");
    for (entry, &lp) in lps.iter().zip(&want.output_logprobs) {
        let got = entry[0].as_f64().expect("a number") as f32;
        assert!(
            (got - lp).abs() <= 1e-5 * lp.abs().max(1.0),
            "logprob {got} vs {lp}"
        );
    }
    let table = decode_sglang_response(body, shape).expect("routed_experts decode");
    assert_same_routes(&table, want.routes.as_ref().expect("engine routes"));
}

/// `/generate` replies of one client thread per `(prompt, max_new_tokens, seed)` case, all
/// in flight at once, in case order.
pub(crate) fn concurrent_replies(
    server: &TestServer,
    cases: &[(Vec<u32>, usize, u64)],
) -> Vec<Value> {
    std::thread::scope(|s| {
        let handles: Vec<_> = cases
            .iter()
            .map(|(prompt, max_new, seed)| {
                s.spawn(move || {
                    let r = server.post("/generate", &request(prompt, *max_new, *seed, 0).0);
                    assert_eq!(r.status, 200, "{}", r.text);
                    r.body
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect()
    })
}

#[test]
fn routed_experts_on_the_wire_equal_the_engines_routes() {
    let dir = fixture(MODEL);
    let server = server(&dir);
    let reference = engine(&dir);
    for (prompt, start_len) in [
        (vec![3u32, 17, 42, 99, 7], 0usize),
        (vec![11, 12, 13, 14, 15, 16, 17], 4),
    ] {
        let (body, req) = request(&prompt, 6, 5, start_len);
        let want = alone(req);
        let r = server.post("/generate", &body);
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(
            r.body["meta_info"]["prompt_tokens"]
                .as_u64()
                .map(|p| p as usize),
            Some(prompt.len())
        );
        check_answer(&r.body, &want, &wire_shape(&reference, start_len));
    }
}

#[test]
fn concurrent_clients_get_the_answers_they_would_get_alone() {
    let dir = fixture(MODEL);
    let server = server(&dir);
    let reference = engine(&dir);
    let cases: Vec<(Vec<u32>, usize, u64)> = (0..6u32)
        .map(|i| {
            (
                (0..4 + i).map(|t| (t * 31 + i * 7) % 256).collect(),
                4 + i as usize,
                u64::from(i),
            )
        })
        .collect();
    let replies = concurrent_replies(&server, &cases);
    for ((prompt, max_new, seed), body) in cases.iter().zip(&replies) {
        let want = alone(request(prompt, *max_new, *seed, 0).1);
        check_answer(body, &want, &wire_shape(&reference, 0));
    }
    let info = server.get("/get_server_info");
    let w = &info.body["worker"];
    eprintln!(
        "engine server: {} steps, max batch in flight {}, mean batch {:.2}",
        w["steps"],
        w["max_batch_in_flight"],
        w["sum_batch_in_flight"].as_f64().unwrap_or(0.0) / w["steps"].as_f64().unwrap_or(1.0)
    );
}

#[test]
fn second_turn_hits_the_prefix_cache_with_the_same_routes() {
    let dir = fixture(MODEL);
    let server = server(&dir);
    let reference = engine(&dir);
    let turn1: Vec<u32> = (0..40).map(|t| (t * 13 + 5) % 256).collect();
    let (body, _) = request(&turn1, 4, 1, 0);
    let r1 = server.post("/generate", &body);
    assert_eq!(r1.status, 200, "{}", r1.text);
    let mut turn2 = turn1.clone();
    turn2.extend(ids(&r1.body["output_ids"]));
    turn2.extend([7, 8, 9]);
    let (body, req) = request(&turn2, 4, 2, 0);
    let r2 = server.post("/generate", &body);
    assert_eq!(r2.status, 200, "{}", r2.text);
    let cached = r2.body["meta_info"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    assert!(
        cached >= 32,
        "the first turn's full blocks are reused, got {cached}"
    );
    // Routes of the cached part equal those computed cold.
    check_answer(&r2.body, &alone(req), &wire_shape(&reference, 0));
}

#[test]
fn update_weights_from_disk_bumps_version_and_empties_the_prefix_cache() {
    let dir = fixture(MODEL);
    let server = server(&dir);
    let prompt: Vec<u32> = (0..40).collect();
    let (body, _) = request(&prompt, 2, 1, 0);
    assert_eq!(server.post("/generate", &body).status, 200);
    let again = server.post("/generate", &body);
    assert!(
        again.body["meta_info"]["cached_tokens"].as_u64() > Some(0),
        "{}",
        again.text
    );
    let r = server.post("/update_weights_from_disk", &json!({"model_path": dir}));
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["weight_version"], "1");
    let after = server.post("/generate", &body);
    assert_eq!(after.status, 200, "{}", after.text);
    assert_eq!(after.body["meta_info"]["weight_version"], "1");
    assert_eq!(
        after.body["meta_info"]["cached_tokens"], 0,
        "new weights, no stale hit"
    );
    // Same weights were reloaded, so the answer is unchanged.
    assert_eq!(after.body["output_ids"], again.body["output_ids"]);
}

#[test]
fn an_update_from_disk_serves_the_new_weights() {
    check_update_serves_the_new_weights(&server(&fixture(MODEL)));
}

#[test]
fn text_prompts_and_text_outputs_with_a_tokenizer() {
    let dir = scratch_dir("text-model");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(MODEL).join(f), dir.join(f)).expect("copy fixture");
    }
    write_tokenizer(&dir, 256);
    let server = server(&dir);
    let by_text = server.post(
        "/generate",
        &json!({"text": "t5 t6 t7", "sampling_params": {"max_new_tokens": 3, "seed": 4, "ignore_eos": true}}),
    );
    let by_ids = server.post(
        "/generate",
        &json!({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "seed": 4, "ignore_eos": true}}),
    );
    assert_eq!(by_text.status, 200, "{}", by_text.text);
    assert_eq!(by_text.body["output_ids"], by_ids.body["output_ids"]);
    let out = ids(&by_text.body["output_ids"]);
    let words: Vec<String> = out.iter().map(|i| format!("t{i}")).collect();
    assert_eq!(by_text.body["text"], words.join(" "));
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "t5 t6 t7", "max_tokens": 3, "seed": 4, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["choices"][0]["token_ids"], by_ids.body["output_ids"]);
    assert_eq!(r.body["choices"][0]["text"], words.join(" "));
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// OpenAI `logprobs = 3` on the real engine, greedy: each sampled token is the most likely
/// alternative, its reported log-prob equals that alternative's, and the alternatives are
/// log-probabilities of distinct tokens in decreasing order.
#[test]
fn openai_top_logprobs_agree_with_greedy_choices() {
    let server = server(&fixture(MODEL));
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "logprobs": 3, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let choice = &r.body["choices"][0];
    let out = ids(&choice["token_ids"]);
    let lps = choice["logprobs"]["token_logprobs"]
        .as_array()
        .expect("token_logprobs");
    let tops = choice["logprobs"]["top_logprobs"]
        .as_array()
        .expect("top_logprobs");
    assert_eq!((lps.len(), tops.len()), (out.len(), out.len()));
    for ((&t, lp), top) in out.iter().zip(lps).zip(tops) {
        let top = top.as_object().expect("a map");
        assert_eq!(top.len(), 3);
        let values: Vec<f64> = top.values().filter_map(Value::as_f64).collect();
        let best = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        assert!(values.iter().all(|&v| v <= 0.0));
        let mine = top[&format!("token_id:{t}")]
            .as_f64()
            .expect("sampled token listed");
        assert_eq!(mine, best);
        assert!((lp.as_f64().expect("lp") - mine).abs() < 1e-6);
    }
}
