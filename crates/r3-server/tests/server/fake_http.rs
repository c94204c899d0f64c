//! The HTTP layer over the fake engine: response shapes, batching of concurrent clients,
//! routed_experts wire encoding, aborts, weight updates and the OpenAI endpoint.

use r3_routing::wire::sglang::decode_sglang_response;
use r3_server::{build_app, ServerConfig, ServerLimits};
use serde_json::{json, Value};

use crate::fake::{self, wire_shape, FakeEngine};
use crate::support::{ids, TestServer};

pub fn fake_server(min_batch: usize) -> TestServer {
    let config = ServerConfig {
        limits: ServerLimits {
            max_body_bytes: 4096,
            max_new_tokens: 32,
            default_max_new_tokens: 8,
            max_batch_requests: 8,
        },
        seed: 0,
        model_name: "fake".into(),
        ..ServerConfig::default()
    };
    let app = build_app(FakeEngine::new(min_batch), None, config).expect("app builds");
    TestServer::start(app)
}

#[test]
fn generate_single_returns_sglang_shape() {
    let server = fake_server(0);
    let prompt = vec![5u32, 9, 12];
    let r = server.post(
        "/generate",
        &json!({
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6, "seed": 3, "temperature": 0.7},
            "return_logprob": true,
            "return_routed_experts": true,
            "routed_experts_start_len": 1,
            "rid": "req-a",
        }),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let (want, stopped) = fake::expected(&prompt, 6, &[fake::EOS], 3);
    assert_eq!(ids(&r.body["output_ids"]), want);
    let meta = &r.body["meta_info"];
    assert_eq!(meta["id"], "req-a");
    assert_eq!(meta["prompt_tokens"], 3);
    assert_eq!(meta["completion_tokens"], want.len());
    assert_eq!(meta["cached_tokens"], 0);
    let finish = if stopped {
        json!({"type": "stop", "matched": fake::EOS})
    } else {
        json!({"type": "length", "length": want.len()})
    };
    assert_eq!(meta["finish_reason"], finish);
    // [[logprob, token_id, null], ...]
    let lps = meta["output_token_logprobs"]
        .as_array()
        .expect("logprobs list");
    assert_eq!(lps.len(), want.len());
    for (entry, &t) in lps.iter().zip(&want) {
        assert_eq!(entry[1], t);
        assert!(entry[2].is_null());
        let lp = entry[0].as_f64().expect("a number") as f32;
        assert!((lp - fake::logprob(t)).abs() < 1e-6);
    }
    assert_eq!(meta["routed_experts_dtype"], "int32");
    assert!(r.body.get("text").is_none(), "no tokenizer, no text");
    // The wire decodes (dense layer 0 is a zero column) to the routes of positions 1.. .
    let table = decode_sglang_response(&r.body, &wire_shape(1)).expect("routes decode");
    let mut tokens = prompt.clone();
    tokens.extend(&want);
    assert_eq!(table, fake::routes_of(&tokens, 1));
}

#[test]
fn batch_input_and_per_request_options() {
    let server = fake_server(0);
    let r = server.post(
        "/generate",
        &json!({
            "input_ids": [[2, 3], [4, 5, 6]],
            "sampling_params": [{"max_new_tokens": 2, "seed": 1}, {"max_new_tokens": 3, "seed": 2, "ignore_eos": true}],
            "return_routed_experts": [false, true],
            "routed_experts_dtype": "uint8",
        }),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let out = r.body.as_array().expect("a batch answers with a list");
    assert_eq!(out.len(), 2);
    assert_eq!(
        ids(&out[0]["output_ids"]),
        fake::expected(&[2, 3], 2, &[fake::EOS], 1).0
    );
    assert_eq!(
        ids(&out[1]["output_ids"]),
        fake::expected(&[4, 5, 6], 3, &[], 2).0
    );
    assert!(out[0]["meta_info"].get("routed_experts").is_none());
    assert_eq!(out[1]["meta_info"]["routed_experts_dtype"], "uint8");
    let table = decode_sglang_response(&out[1], &wire_shape(0)).expect("uint8 routes decode");
    let mut tokens = vec![4, 5, 6];
    tokens.extend(ids(&out[1]["output_ids"]));
    assert_eq!(table, fake::routes_of(&tokens, 0));
    assert_ne!(out[0]["meta_info"]["id"], out[1]["meta_info"]["id"]);
}

#[test]
fn concurrent_clients_are_batched_and_each_answered() {
    // The fake makes no progress until 6 requests are in flight together.
    let server = fake_server(6);
    let answers: Vec<(Vec<u32>, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..6u32)
            .map(|i| {
                let server = &server;
                s.spawn(move || {
                    let prompt = vec![10 + i, 20 + i];
                    let body = json!({
                        "input_ids": prompt,
                        "sampling_params": {"max_new_tokens": 4 + i as usize, "seed": i, "ignore_eos": true},
                    });
                    let r = server.post("/generate", &body);
                    assert_eq!(r.status, 200, "{}", r.text);
                    (prompt, r.body)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect()
    });
    for (i, (prompt, body)) in answers.iter().enumerate() {
        let want = fake::expected(prompt, 4 + i, &[], i as u64).0;
        assert_eq!(ids(&body["output_ids"]), want, "client {i}");
    }
    let info = server.get("/get_server_info");
    assert_eq!(info.status, 200);
    let max_batch = info.body["worker"]["max_batch_in_flight"]
        .as_u64()
        .expect("counter");
    assert!(
        max_batch >= 6,
        "requests were not batched together: max batch {max_batch}"
    );
}

/// A step that fails one request (the engine names it; the device ran out of memory) fails
/// that request's client alone, with a 503 naming the cause; the clients batched with it
/// get their whole answers, the ones that finished in the failed step included.
#[test]
fn a_failed_request_fails_its_client_alone() {
    // The fake makes no progress until 3 requests are in flight together.
    let server = fake_server(3);
    let answers: Vec<(u32, u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = [fake::POISON, 10, 11]
            .into_iter()
            .enumerate()
            .map(|(i, first)| {
                let server = &server;
                s.spawn(move || {
                    // The second client finishes in the step that fails.
                    let max_new = [1, 1, 4][i];
                    let body = json!({
                        "input_ids": [first, 20],
                        "sampling_params": {"max_new_tokens": max_new, "seed": i, "ignore_eos": true},
                    });
                    let r = server.post("/generate", &body);
                    (first, r.status, r.body)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect()
    });
    for (i, (first, status, body)) in answers.iter().enumerate() {
        if *first == fake::POISON {
            assert_eq!(*status, 503, "{body}");
            let message = body["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("out of memory"), "{message}");
            continue;
        }
        assert_eq!(*status, 200, "client {i}: {body}");
        let want = fake::expected(&[*first, 20], [1, 1, 4][i], &[], i as u64).0;
        assert_eq!(ids(&body["output_ids"]), want, "client {i}");
    }
}

#[test]
fn seedless_requests_get_distinct_reproducible_seeds() {
    // Two servers see the same request sequence: same outputs; within a server the two
    // identical prompts get different default seeds.
    let run = || {
        let server = fake_server(0);
        let body = json!({"input_ids": [[7, 8], [7, 8]], "sampling_params": {"max_new_tokens": 5, "ignore_eos": true}});
        let r = server.post("/generate", &body);
        assert_eq!(r.status, 200, "{}", r.text);
        (ids(&r.body[0]["output_ids"]), ids(&r.body[1]["output_ids"]))
    };
    let (a0, a1) = run();
    let (b0, b1) = run();
    assert_eq!((&a0, &a1), (&b0, &b1));
    assert_ne!(a0, a1);
}

#[test]
fn abort_request_returns_partial_output() {
    // min_batch 2 holds the lone request in flight until the abort arrives.
    let server = fake_server(2);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            server.post(
                "/generate",
                &json!({"input_ids": [3, 4], "rid": "victim", "sampling_params": {"max_new_tokens": 20}}),
            )
        });
        let mut aborted = 0;
        for _ in 0..200 {
            let r = server.post("/abort_request", &json!({"rid": "victim"}));
            assert_eq!(r.status, 200, "{}", r.text);
            aborted = r.body["aborted"].as_u64().unwrap_or(0);
            if aborted == 1 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(aborted, 1);
        let r = waiter.join().expect("client thread");
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.body["meta_info"]["finish_reason"]["type"], "abort");
        assert_eq!(r.body["meta_info"]["id"], "victim");
    });
}

#[test]
fn update_weights_bumps_version() {
    let server = fake_server(0);
    let dir = crate::support::fixture("qwen3_moe_tiny");
    let r = server.post("/update_weights_from_disk", &json!({"model_path": dir}));
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["success"], true);
    assert_eq!(r.body["weight_version"], "1");
    let r = server.post(
        "/generate",
        &json!({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(r.body["meta_info"]["weight_version"], "1");
    // A directory without weights is the client's error; the server keeps its weights.
    let empty = crate::support::scratch_dir("empty-weights");
    let r = server.post("/update_weights_from_disk", &json!({"model_path": empty}));
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(
        r.error_message().contains("model.safetensors"),
        "{}",
        r.text
    );
    let _ = std::fs::remove_dir_all(&empty);
    assert_eq!(server.get("/health").status, 200);
}

#[test]
fn openai_completions_shape() {
    let server = fake_server(0);
    let r = server.post(
        "/v1/completions",
        &json!({"model": "fake", "prompt": [[9, 10], [11]], "max_tokens": 3, "n": 2, "seed": 40,
                "logprobs": 0, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["object"], "text_completion");
    let choices = r.body["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 4);
    let prompts = [vec![9u32, 10], vec![11]];
    for (index, c) in choices.iter().enumerate() {
        let (p, i) = (index / 2, index % 2);
        let want = fake::expected(&prompts[p], 3, &[], 40 + i as u64).0;
        assert_eq!(c["index"], index);
        assert_eq!(ids(&c["token_ids"]), want);
        assert_eq!(c["finish_reason"], "length");
        assert_eq!(
            c["logprobs"]["token_logprobs"].as_array().map(Vec::len),
            Some(3)
        );
    }
    assert_eq!(r.body["usage"]["prompt_tokens"], 3);
    assert_eq!(r.body["usage"]["completion_tokens"], 12);
    assert_eq!(r.body["usage"]["total_tokens"], 15);
}
