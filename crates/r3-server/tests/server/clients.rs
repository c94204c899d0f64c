//! The request bodies real RL clients send, verbatim in shape, against the fake engine: each
//! is accepted and answered with the values the fake engine's rule gives. Sources (file @
//! commit) are cited per test. Also the control endpoints those clients call around weight
//! updates, the field policy (neutral values accepted, non-neutral unimplemented ones refused
//! by name), stop strings, `n`, and the `max_new_tokens` clipping rule.

use std::time::Duration;

use r3_routing::wire::sglang::decode_sglang_response;
use r3_server::sse::parse_event_stream;
use r3_server::{build_app, ServerConfig, TextCodec};
use serde_json::json;

use crate::fake::{self, wire_shape, FakeEngine};
use crate::paced::Paced;
use crate::support::{ids, scratch_dir, write_tokenizer, TestServer};

/// A fake-engine server; `text` gives it the word-level tokenizer (`t<i>` = id i).
fn server(text: bool, config: impl FnOnce(&mut ServerConfig)) -> TestServer {
    let mut cfg = fake::config();
    config(&mut cfg);
    let codec = if text {
        let dir = scratch_dir("clients-tokenizer");
        write_tokenizer(&dir, fake::VOCAB);
        let codec = TextCodec::from_model_dir(&dir).expect("tokenizer loads");
        let _ = std::fs::remove_dir_all(&dir);
        codec
    } else {
        None
    };
    TestServer::start(build_app(FakeEngine::new(0), codec, cfg).expect("app builds"))
}

fn words(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| format!("t{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// slime `generate()`: THUDM/slime slime/rollout/sglang_rollout.py @ 0044b40d6584 —
/// `GenerateState.sampling_params` (stop / stop_token_ids None by default,
/// `no_stop_trim=True`, `spaces_between_special_tokens=False`, `skip_special_tokens` from
/// `--rollout-skip-special-tokens`) and the payload of `generate` with R3 on.
#[test]
fn slime_generate_payload() {
    let server = server(true, |_| {});
    let prompt = [5u32, 9, 12];
    let r = server.post(
        "/generate",
        &json!({
            "sampling_params": {
                "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6,
                "stop": null, "stop_token_ids": null, "skip_special_tokens": false,
                "no_stop_trim": true, "spaces_between_special_tokens": false,
            },
            "return_logprob": true,
            "return_routed_experts": true,
            "input_ids": prompt,
        }),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    // The first seedless request gets the server seed 0.
    let (want, _) = fake::expected(&prompt, 6, &[fake::EOS], 0);
    assert_eq!(ids(&r.body["output_ids"]), want);
    assert_eq!(r.body["text"], words(&want));
    let meta = &r.body["meta_info"];
    assert_eq!(meta["weight_version"], "default");
    let lps = meta["output_token_logprobs"].as_array().expect("logprobs");
    for (e, &t) in lps.iter().zip(&want) {
        assert_eq!(e[1], t);
        assert!((e[0].as_f64().expect("lp") - f64::from(fake::logprob(t))).abs() < 1e-6);
    }
    let mut tokens = prompt.to_vec();
    tokens.extend(&want);
    let decoded = decode_sglang_response(meta, &wire_shape(0)).expect("routes decode");
    assert_eq!(decoded, fake::routes_of(&tokens, 0));
}

/// AReaL `RemoteSGLangEngine.agenerate` and `update_weights`: inclusionAI/AReaL
/// areal/engine/sglang_remote.py @ a040d27fcff7 — `image_data` None, `stream` False,
/// `frequency_penalty` 0.0, default `max_new_tokens` 16384 (clipped here to the server
/// limit), and `/pause_generation` + `/continue_generation` posted without a body around
/// `/update_weights_from_disk` with `abort_all_requests`.
#[test]
fn areal_generate_and_weight_update_cycle() {
    let server = server(false, |_| {});
    let prompt = [3u32, 4, 5];
    let body = json!({
        "input_ids": prompt,
        "image_data": null,
        "sampling_params": {
            "top_p": 1.0, "top_k": 100000000, "max_new_tokens": 16384, "temperature": 1.0,
            "stop_token_ids": [], "frequency_penalty": 0.0,
        },
        "return_logprob": true,
        "stream": false,
    });
    let r = server.post("/generate", &body);
    assert_eq!(r.status, 200, "{}", r.text);
    let (want, stopped) = fake::expected(&prompt, 32, &[fake::EOS], 0);
    assert_eq!(ids(&r.body["output_ids"]), want);
    if !stopped {
        assert_eq!(r.body["meta_info"]["finish_reason"]["type"], "length");
        assert_eq!(want.len(), 32, "clipped to the server limit");
    }
    let dir = crate::support::fixture("qwen3_moe_tiny");
    assert_eq!(server.raw("POST", "/pause_generation", b"").status, 200);
    let u = server.post(
        "/update_weights_from_disk",
        &json!({"model_path": dir, "abort_all_requests": true}),
    );
    assert_eq!(u.status, 200, "{}", u.text);
    assert_eq!(server.raw("POST", "/continue_generation", b"").status, 200);
    let r = server.post("/generate", &body);
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["meta_info"]["weight_version"], "1");
}

/// Every field of SGLang's `GenerateReqInput` at its dataclass default, as verl's in-process
/// request (volcengine/verl verl/workers/rollout/sglang_rollout/async_sglang_server.py @
/// 01217507c266: `image_data`, `return_logprob`, verl's `repetition_penalty` 1.0) and
/// sglang-router 0.3.2 (which adds `background`, `log_metrics`, `model`, `no_logs`,
/// `return_bytes`, `return_entropy`, `return_hidden_states`: its `GenerateRequest` serialises
/// these without `skip_serializing_if`, sgl-project/sglang sgl-router/src/protocols/generate.rs
/// @ b2e495858d2b) send them. Field list:
/// sgl-project/sglang python/sglang/srt/managers/io_struct.py @ 001067fffe33.
#[test]
fn sglang_generate_req_input_defaults_are_accepted() {
    let server = server(false, |_| {});
    let r = server.post(
        "/generate",
        &json!({
            "rid": null, "session_id": null, "text": null, "input_ids": [7, 8],
            "input_embeds": null, "image_data": null, "video_data": null, "audio_data": null,
            "mm_hashes": null, "mm_content_hashes": null, "use_audio_in_video": false,
            "video_config": null,
            "sampling_params": {
                "max_new_tokens": 5, "stop": null, "stop_token_ids": null, "stop_regex": null,
                "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                "min_new_tokens": 0, "n": 1, "json_schema": null, "regex": null, "ebnf": null,
                "structural_tag": null, "ignore_eos": false, "skip_special_tokens": true,
                "spaces_between_special_tokens": true, "no_stop_trim": false,
                "custom_params": null, "stream_interval": null, "logit_bias": null,
                "sampling_seed": 2,
            },
            "return_logprob": false, "logprob_start_len": -1, "top_logprobs_num": 0,
            "token_ids_logprob": null, "return_sampling_mask": null,
            "return_text_in_logprobs": false, "return_flat_raw_top_logprobs": false,
            "return_flat_raw_top_logprobs_b64": false, "stream": false, "log_metrics": true,
            "return_hidden_states": false, "return_routed_experts": false,
            "routed_experts_start_len": 0, "return_indexer_topk": false, "modalities": null,
            "session_params": null, "lora_path": null, "lora_id": null,
            "custom_logit_processor": null, "positional_embed_overrides": null,
            "bootstrap_host": null, "bootstrap_port": null, "bootstrap_room": null,
            "bootstrap_pair_key": null, "decode_tp_size": null, "routed_dp_rank": null,
            "data_parallel_rank": null, "disagg_prefill_dp_rank": null, "kv_router_hint": null,
            "routing_key": null, "conversation_id": null, "http_worker_ipc": null,
            "background": false, "require_reasoning": false, "max_thinking_tokens": null,
            "priority": null, "extra_key": null, "no_logs": false, "custom_labels": null,
            "return_bytes": false, "return_entropy": false, "return_prompt_token_ids": false,
            "external_trace_header": null, "received_time": null,
            "need_wait_for_mm_inputs": null, "num_items_assigned": null, "encoder_urls": null,
            "max_dynamic_patch": null, "min_dynamic_patch": null,
            "image_max_dynamic_patch": null, "video_max_dynamic_patch": null,
            "images_config": null, "multi_item_delimiter_indices": null, "cache_salt": null,
            "model": "fake", "a_field_no_schema_knows": {"x": 1},
        }),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let (want, _) = fake::expected(&[7, 8], 5, &[fake::EOS], 2);
    assert_eq!(ids(&r.body["output_ids"]), want);
}

/// Non-neutral values of fields r3 does not implement are refused by name, and the server
/// keeps serving.
#[test]
fn non_neutral_unimplemented_fields_are_refused_by_name() {
    let server = server(false, |_| {});
    for (body, field) in [
        (
            json!({"input_ids": [1], "image_data": ["img.png"]}),
            "generate.image_data",
        ),
        (
            json!({"input_ids": [1], "lora_path": "a"}),
            "generate.lora_path",
        ),
        (
            json!({"input_ids": [1], "return_hidden_states": true}),
            "generate.return_hidden_states",
        ),
        (
            json!({"input_ids": [1], "sampling_params": {"json_schema": "{}"}}),
            "sampling_params.json_schema",
        ),
        (
            json!({"input_ids": [1], "sampling_params": {"beam_width": 4}}),
            "sampling_params.beam_width",
        ),
        (
            json!({"input_ids": [1], "logprob_start_len": -2, "return_logprob": true}),
            "logprob_start_len must be",
        ),
    ] {
        let r = server.post("/generate", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text);
        assert!(r.error_message().contains(field), "{field}: {}", r.text);
    }
    let r = server.post("/generate", &json!({"input_ids": [1]}));
    assert_eq!(r.status, 200, "{}", r.text);
}

/// Stop strings end generation at the first token whose text completes one (HF
/// `generate`'s stop-string criterion); the text is cut before it unless `no_stop_trim`.
#[test]
fn stop_strings_cut_where_hf_generate_would() {
    let server = server(true, |_| {});
    let prompt = [5u32, 9, 12];
    let seed = 3;
    let (free, _) = fake::expected(&prompt, 20, &[], seed);
    // A stop string spanning output tokens 2 and 3.
    let stop = format!("t{} t{}", free[2], free[3]);
    // Independent truth: the first prefix whose text contains the stop string.
    let k = (1..=free.len())
        .find(|&k| words(&free[..k]).contains(&stop))
        .expect("the stop string occurs");
    for trim in [true, false] {
        let r = server.post(
            "/generate",
            &json!({"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 20, "seed": seed, "ignore_eos": true, "stop": [stop],
                "no_stop_trim": !trim,
            }}),
        );
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(ids(&r.body["output_ids"]), free[..k].to_vec());
        let finish = &r.body["meta_info"]["finish_reason"];
        assert_eq!(finish["type"], "stop");
        assert_eq!(finish["matched"], stop.as_str());
        let full = words(&free[..k]);
        let want = if trim {
            full[..full.find(&stop).expect("found")].to_string()
        } else {
            full
        };
        assert_eq!(r.body["text"], want);
    }
    // The same through /v1/completions (OpenAI `stop`).
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 20, "seed": seed, "ignore_eos": true, "stop": stop}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["choices"][0]["finish_reason"], "stop");
    assert_eq!(ids(&r.body["choices"][0]["token_ids"]), free[..k].to_vec());
}

/// `n` samples per prompt come back as a list in SGLang's order, prompt by prompt (its
/// tokenizer manager's `_expand_parallel_sample_requests`), sample `i` seeded `seed + i`,
/// rids and streamed `index` tags in the same order.
#[test]
fn n_samples_come_prompt_by_prompt() {
    let server = server(false, |_| {});
    let body = json!({"input_ids": [[4, 5], [6]], "rid": ["a", "b"],
        "sampling_params": {"max_new_tokens": 4, "seed": 10, "n": 2}});
    let r = server.post("/generate", &body);
    assert_eq!(r.status, 200, "{}", r.text);
    let list = r.body.as_array().expect("a list");
    assert_eq!(list.len(), 4);
    let want = [
        (vec![4u32, 5], 10u64, "a"),
        (vec![4, 5], 11, "a_1"),
        (vec![6], 10, "b"),
        (vec![6], 11, "b_1"),
    ];
    for (got, (prompt, seed, rid)) in list.iter().zip(&want) {
        let (out, _) = fake::expected(prompt, 4, &[fake::EOS], *seed);
        assert_eq!(ids(&got["output_ids"]), out);
        assert_eq!(got["meta_info"]["id"], *rid);
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = server.post("/generate", &streamed);
    assert_eq!(r.status, 200, "{}", r.text);
    let chunks = parse_event_stream(&r.text);
    for (i, (prompt, seed, rid)) in want.iter().enumerate() {
        let last = chunks
            .iter()
            .rfind(|c| c["index"] == i)
            .expect("chunks of every sample");
        let (out, _) = fake::expected(prompt, 4, &[fake::EOS], *seed);
        assert_eq!(ids(&last["output_ids"]), out, "{}", r.text);
        assert_eq!(last["meta_info"]["id"], *rid);
    }
}

/// A start past the prompt is SGLang's abort with status 400: a 400, or an abort chunk in a
/// stream; each start is read only where its switch is on (`routed_experts_start_len` with
/// routes, `logprob_start_len` and `top_logprobs_num` with `return_logprob`).
#[test]
fn starts_past_the_prompt_are_refused_only_where_read() {
    let server = server(false, |_| {});
    let r = server.post(
        "/generate",
        &json!({"input_ids": [1, 2], "routed_experts_start_len": 3, "return_routed_experts": true}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(
        r.error_message().contains("routed_experts_start_len=3"),
        "{}",
        r.text
    );
    let r = server.post(
        "/generate",
        &json!({"input_ids": [1, 2], "routed_experts_start_len": 3, "return_routed_experts": true,
                "stream": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let chunks = parse_event_stream(&r.text);
    let finish = &chunks.last().expect("a chunk")["meta_info"]["finish_reason"];
    assert_eq!(finish["type"], "abort", "{}", r.text);
    assert_eq!(finish["status_code"], 400, "{}", r.text);
    // Without routes the start is not read.
    let r = server.post(
        "/generate",
        &json!({"input_ids": [1, 2], "routed_experts_start_len": 3,
                "sampling_params": {"max_new_tokens": 2, "seed": 4}}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let (out, _) = fake::expected(&[1, 2], 2, &[fake::EOS], 4);
    assert_eq!(ids(&r.body["output_ids"]), out);
    let r = server.post(
        "/generate",
        &json!({"input_ids": [1, 2], "return_logprob": true, "logprob_start_len": 3}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(
        r.error_message().contains("logprob_start_len=3"),
        "{}",
        r.text
    );
    // At the prompt's length it is allowed, and without return_logprob never read.
    for body in [
        json!({"input_ids": [1, 2], "return_logprob": true, "logprob_start_len": 2}),
        json!({"input_ids": [1, 2], "logprob_start_len": 3}),
        json!({"input_ids": [1, 2], "logprob_start_len": -5, "top_logprobs_num": 50}),
    ] {
        let r = server.post("/generate", &body);
        assert_eq!(r.status, 200, "{body}: {}", r.text);
    }
}

/// A batch of one prompt repeated, without a seed, samples each choice with its own seed
/// (an OpenAI client's `n` emulated by repeating the prompt gets different samples).
#[test]
fn completions_without_a_seed_sample_every_choice_apart() {
    let server = server(false, |_| {});
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [[4, 5], [4, 5], [4, 5], [4, 5]], "temperature": 1, "max_tokens": 6,
                "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let outs: Vec<Vec<u32>> = r.body["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| ids(&c["token_ids"]))
        .collect();
    assert_eq!(outs.len(), 4);
    let distinct: std::collections::HashSet<&Vec<u32>> = outs.iter().collect();
    assert_eq!(distinct.len(), 4, "{outs:?}");
    // With a client seed choice i of every prompt samples with seed + i: equal prompts,
    // equal samples.
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [[4, 5], [4, 5]], "seed": 3, "max_tokens": 6, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.body["choices"][0]["token_ids"],
        r.body["choices"][1]["token_ids"]
    );
}

/// `"max_new_tokens": null` on `/generate` asks for no cap of the client's own: the
/// server's `--max-new-tokens` (32 here) bounds it, not the default (8).
#[test]
fn a_null_max_new_tokens_is_the_servers_cap() {
    let server = server(false, |_| {});
    let r = server.post(
        "/generate",
        &json!({"input_ids": [4], "sampling_params": {"max_new_tokens": null, "seed": 2,
                "ignore_eos": true}}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["output_ids"].as_array().map(Vec::len), Some(32));
    let r = server.post(
        "/generate",
        &json!({"input_ids": [4], "sampling_params": {"seed": 2, "ignore_eos": true}}),
    );
    assert_eq!(r.body["output_ids"].as_array().map(Vec::len), Some(8));
}

/// `cached_tokens` of a request ended by a stop string, or aborted, is the engine's count
/// (the fake engine reports all but the last prompt token of a prompt starting with
/// `CACHED`), as for one that ends by itself.
#[test]
fn cached_tokens_survive_stop_strings_and_aborts() {
    let server = server(true, |_| {});
    let prompt = [fake::CACHED, 5, 9];
    let seed = 1u64;
    let (free, _) = fake::expected(&prompt, 20, &[], seed);
    let stop = format!("t{} t{}", free[2], free[3]);
    let r = server.post(
        "/generate",
        &json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 20, "seed": seed,
                "ignore_eos": true, "stop": [stop]}}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.body["meta_info"]["finish_reason"]["type"], "stop",
        "{}",
        r.text
    );
    assert_eq!(r.body["meta_info"]["cached_tokens"], 2, "{}", r.text);
    let in_flight = || server.get("/v1/loads").body["loads"][0]["num_total_reqs"].clone();
    let p = server.post("/pause_generation", &json!({"mode": "in_place"}));
    assert_eq!(p.status, 200, "{}", p.text);
    std::thread::scope(|s| {
        let held = s.spawn(|| {
            server.post(
                "/generate",
                &json!({"input_ids": prompt, "rid": "held", "sampling_params": {"max_new_tokens": 8}}),
            )
        });
        assert!(
            (0..500).any(|_| {
                std::thread::sleep(Duration::from_millis(10));
                in_flight() == 1
            }),
            "the request never arrived"
        );
        let a = server.post("/abort_request", &json!({"rid": "held"}));
        assert_eq!(a.status, 200, "{}", a.text);
        let r = held.join().expect("client thread");
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(
            r.body["meta_info"]["finish_reason"]["type"], "abort",
            "{}",
            r.text
        );
        assert_eq!(r.body["meta_info"]["cached_tokens"], 2, "{}", r.text);
    });
    let c = server.post("/continue_generation", &json!({}));
    assert_eq!(c.status, 200, "{}", c.text);
}

/// The control endpoints RL loops call, and weight versions as strings everywhere at once.
#[test]
fn control_endpoints() {
    let server = server(false, |_| {});
    assert_eq!(server.get("/health_generate").status, 200);
    assert_eq!(server.get("/flush_cache").status, 200);
    assert_eq!(server.raw("POST", "/flush_cache", b"").status, 200);
    let models = server.get("/v1/models");
    assert_eq!(models.status, 200);
    assert_eq!(models.body["data"][0]["id"], "fake");
    for path in ["/model_info", "/get_model_info"] {
        let r = server.get(path);
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.body["model_path"], "models/fake");
    }
    assert_eq!(server.get("/server_info").body["served_model_name"], "fake");
    let dir = crate::support::fixture("qwen3_moe_tiny");
    let u = server.post(
        "/update_weights_from_disk",
        &json!({"model_path": dir, "weight_version": "step-7", "flush_cache": true,
                "load_format": null, "abort_all_requests": false}),
    );
    assert_eq!(u.status, 200, "{}", u.text);
    assert_eq!(u.body["weight_version"], "step-7");
    // Visible immediately, before any engine step.
    assert_eq!(
        server.get("/get_server_info").body["weight_version"],
        "step-7"
    );
    assert_eq!(
        server.get("/get_weight_version").body["weight_version"],
        "step-7"
    );
    let r = server.post("/generate", &json!({"input_ids": [1]}));
    assert_eq!(r.body["meta_info"]["weight_version"], "step-7");
    let chat = server.post(
        "/v1/chat/completions",
        &json!({"model": "fake", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(chat.status, 400, "{}", chat.text);
    assert!(
        chat.error_message().contains("chat template"),
        "{}",
        chat.text
    );
    let bad = server.post("/pause_generation", &json!({"mode": "sideways"}));
    assert_eq!(bad.status, 400, "{}", bad.text);
}

/// Paused (`in_place`), a request is queued, counted by `/v1/loads`, and runs after
/// `/continue_generation`; `abort` mode returns in-flight requests with finish `abort`.
#[test]
fn pause_queues_requests_until_continue() {
    let server = server(false, |_| {});
    let p = server.post("/pause_generation", &json!({"mode": "in_place"}));
    assert_eq!(p.status, 200, "{}", p.text);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            server.post(
                "/generate",
                &json!({"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 3, "seed": 1}}),
            )
        });
        let mut queued = false;
        for _ in 0..200 {
            let loads = server.get("/v1/loads");
            if loads.body["loads"][0]["num_total_reqs"] == 1 {
                queued = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(queued, "the request was not counted while paused");
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished(), "a paused server generated");
        assert_eq!(server.raw("POST", "/continue_generation", b"").status, 200);
        let r = waiter.join().expect("client thread");
        assert_eq!(r.status, 200, "{}", r.text);
        let (want, _) = fake::expected(&[2, 3], 3, &[fake::EOS], 1);
        assert_eq!(ids(&r.body["output_ids"]), want);
    });
    // Abort mode: a queued request comes back aborted.
    assert_eq!(
        server
            .post("/pause_generation", &json!({"mode": "in_place"}))
            .status,
        200
    );
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            server.post(
                "/generate",
                &json!({"input_ids": [2, 3], "rid": "victim", "sampling_params": {"max_new_tokens": 3}}),
            )
        });
        for _ in 0..200 {
            if server.get("/v1/loads").body["loads"][0]["num_total_reqs"] == 1 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let p = server.post("/pause_generation", &json!({"mode": "abort"}));
        assert_eq!(p.body["aborted"], 1, "{}", p.text);
        let r = waiter.join().expect("client thread");
        assert_eq!(r.body["meta_info"]["finish_reason"]["type"], "abort");
        assert_eq!(r.body["meta_info"]["id"], "victim");
    });
    assert_eq!(server.raw("POST", "/continue_generation", b"").status, 200);
}

/// sglang-router strips `return_routed_experts`; with `--return-routed-experts-by-default`
/// the routes still come back in `meta_info`.
#[test]
fn routes_by_default_survive_a_router_that_drops_the_flag() {
    let server = server(false, |c| c.return_routed_experts_by_default = true);
    let prompt = [8u32, 1, 30];
    let r = server.post(
        "/generate",
        &json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "seed": 5, "ignore_eos": true},
                "model": "fake", "log_metrics": true, "no_logs": false, "background": false,
                "return_bytes": false, "return_entropy": false, "return_hidden_states": false}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let (want, _) = fake::expected(&prompt, 4, &[], 5);
    let mut tokens = prompt.to_vec();
    tokens.extend(&want);
    let decoded = decode_sglang_response(&r.body["meta_info"], &wire_shape(0)).expect("routes");
    assert_eq!(decoded, fake::routes_of(&tokens, 0));
}

/// The `openai` Python client's `completions.create` with the arguments the issue lists
/// (openai/openai-python src/openai/resources/completions.py @ d30712744be0 sends every
/// given argument as a top-level field): neutral penalties, `best_of=1`, `logit_bias={}`,
/// `suffix=''`, `logprobs=2`, plus `text_offset` in the answer.
#[test]
fn openai_client_completion_body() {
    let server = server(true, |_| {});
    let r = server.post(
        "/v1/completions",
        &json!({
            "model": "fake", "prompt": "t5 t9 t12", "max_tokens": 4, "temperature": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "best_of": 1, "logit_bias": {},
            "suffix": "", "logprobs": 2, "n": 1, "echo": false, "stream": false, "seed": 6,
            "user": "me", "stop": null,
        }),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let choice = &r.body["choices"][0];
    let (want, _) = fake::expected(&[5, 9, 12], 4, &[fake::EOS], 6);
    assert_eq!(ids(&choice["token_ids"]), want);
    let lp = &choice["logprobs"];
    let tokens: Vec<String> = want.iter().map(|t| format!("t{t}")).collect();
    assert_eq!(lp["tokens"], json!(tokens));
    // Offsets are the running lengths of the token texts.
    let mut at = 0;
    let offsets: Vec<usize> = tokens
        .iter()
        .map(|t| {
            let o = at;
            at += t.len();
            o
        })
        .collect();
    assert_eq!(lp["text_offset"], json!(offsets));
    assert_eq!(r.body["model"], "fake");
}

/// `stream: true` (slime's streaming rollout, the `openai` client's `stream=True`): the
/// server-sent chunks concatenate to the non-streamed answer, routes in the final chunk.
#[test]
fn streamed_responses_concatenate_to_the_non_streamed_ones() {
    let server = server(true, |_| {});
    let body = json!({"input_ids": [5, 9, 12], "return_routed_experts": true,
                      "return_logprob": true,
                      "sampling_params": {"max_new_tokens": 6, "seed": 4, "ignore_eos": true}});
    let plain = server.post("/generate", &body);
    let mut streamed_body = body.clone();
    streamed_body["stream"] = json!(true);
    let streamed = server.post("/generate", &streamed_body);
    assert_eq!(streamed.status, 200, "{}", streamed.text);
    assert!(
        streamed.text.trim_end().ends_with("data: [DONE]"),
        "{}",
        streamed.text
    );
    let chunks = parse_event_stream(&streamed.text);
    let last = chunks.last().expect("a chunk");
    // SGLang chunks carry the cumulative output: the last one is the whole answer.
    assert_eq!(last["output_ids"], plain.body["output_ids"]);
    assert_eq!(last["text"], plain.body["text"]);
    assert_eq!(
        last["meta_info"]["routed_experts"],
        plain.body["meta_info"]["routed_experts"]
    );
    let c = json!({"prompt": [5, 9, 12], "max_tokens": 5, "seed": 2, "n": 2});
    let plain = server.post("/v1/completions", &c);
    let mut sc = c.clone();
    sc["stream"] = json!(true);
    let streamed = server.post("/v1/completions", &sc);
    assert_eq!(streamed.status, 200, "{}", streamed.text);
    let chunks = parse_event_stream(&streamed.text);
    for (i, want) in plain.body["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .enumerate()
    {
        // OpenAI chunks carry text deltas: a choice's deltas concatenate to its text.
        let text: String = chunks
            .iter()
            .flat_map(|ch| ch["choices"].as_array().cloned().unwrap_or_default())
            .filter(|ch| ch["index"] == i)
            .map(|ch| ch["text"].as_str().unwrap_or_default().to_string())
            .collect();
        assert_eq!(text, want["text"].as_str().unwrap_or_default());
    }
}

/// SGLang's frontend `select` (sgl-project/sglang python/sglang/lang/backend/runtime_endpoint.py,
/// `RuntimeEndpoint.select`, sglang 0.5.23 from the package index) first sends
/// `{"text": ..., "sampling_params": {"max_new_tokens": 0}}` and then scores each choice with
/// `max_new_tokens: 0`, `return_logprob`, `return_text_in_logprobs` and a
/// `logprob_start_len`: a prompt-only request, answered 200 with no output, finish reason
/// `length` 0, and routes for the prompt's `prompt - 1` positions.
#[test]
fn sglang_select_prompt_only_requests() {
    let server = server(true, |_| {});
    let r = server.post(
        "/generate",
        &json!({"text": "t5 t9 t12", "sampling_params": {"max_new_tokens": 0}}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["output_ids"], json!([]));
    assert_eq!(r.body["text"], "");
    assert_eq!(r.body["meta_info"]["prompt_tokens"], 3);
    assert_eq!(r.body["meta_info"]["completion_tokens"], 0);
    assert_eq!(
        r.body["meta_info"]["finish_reason"],
        json!({"type": "length", "length": 0})
    );
    let r = server.post(
        "/generate",
        &json!({"text": ["t5 t9 t12 t2", "t5 t9 t12 t3"],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": true, "return_text_in_logprobs": true,
                "logprob_start_len": 1, "return_routed_experts": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    for (i, last) in [2u32, 3].into_iter().enumerate() {
        let meta = &r.body[i]["meta_info"];
        assert_eq!(r.body[i]["output_ids"], json!([]), "{}", r.text);
        assert_eq!(meta["output_token_logprobs"], json!([]));
        assert_eq!(meta["completion_tokens"], 0);
        let prompt = [5u32, 9, 12, last];
        let decoded = decode_sglang_response(meta, &wire_shape(0)).expect("routes decode");
        assert_eq!(decoded.num_tokens(), prompt.len() - 1);
        assert_eq!(decoded, fake::routes_of(&prompt, 0));
    }
    // Streamed, the answer is the one final chunk: no sampled token leaks out.
    let r = server.post(
        "/generate",
        &json!({"input_ids": [5, 9], "stream": true, "sampling_params": {"max_new_tokens": 0}}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let chunks = parse_event_stream(&r.text);
    assert!(
        chunks.iter().all(|c| c["output_ids"] == json!([])),
        "{}",
        r.text
    );
}

/// A rid freed by an abort while its batch stays open may be taken by a new request, and
/// that request stays abortable by it when the old batch later completes (the old batch's
/// end must not forget the new request's rid); `/v1/loads` counts an aborted request out
/// as soon as the abort answers; `/get_server_info`'s `finished_requests` counts each
/// ended request once — aborted ones, and a failed batch's requests (one of which had
/// finished in the failed step, its result held back by the engine).
#[test]
fn a_reused_rid_stays_abortable_and_ended_requests_count_once() {
    let server = server(false, |_| {});
    let in_flight = || server.get("/v1/loads").body["loads"][0]["num_total_reqs"].clone();
    let ended = || server.get("/get_server_info").body["worker"]["finished_requests"].clone();
    let wait_for = |n: u64| {
        for _ in 0..500 {
            if in_flight() == n {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("never {n} requests in flight: {}", in_flight());
    };
    let p = server.post("/pause_generation", &json!({"mode": "in_place"}));
    assert_eq!(p.status, 200, "{}", p.text);
    std::thread::scope(|s| {
        let pair = s.spawn(|| {
            server.post(
                "/generate",
                &json!({"input_ids": [[2, 3], [4, 5]], "rid": ["a", "b"],
                        "sampling_params": {"max_new_tokens": 8}}),
            )
        });
        wait_for(2);
        let abort = |rid: &str| {
            let r = server.post("/abort_request", &json!({ "rid": rid }));
            assert_eq!(r.status, 200, "{}", r.text);
            r.body["aborted"].clone()
        };
        let aborted = abort("a");
        assert_eq!(in_flight(), 1, "counted out when the abort answers");
        assert_eq!(aborted, 1);
        let again = s.spawn(|| {
            server.post(
                "/generate",
                &json!({"input_ids": [7, 8], "rid": "a", "sampling_params": {"max_new_tokens": 8}}),
            )
        });
        wait_for(2);
        // The first batch completes; the new "a" must stay known.
        assert_eq!(abort("b"), 1);
        let first = pair.join().expect("client thread");
        assert_eq!(first.status, 200, "{}", first.text);
        wait_for(1);
        let aborted = abort("a");
        if aborted != 1 {
            // Generation goes on, so the client thread ends and the failure reads as one.
            server.raw("POST", "/continue_generation", b"");
        }
        assert_eq!(aborted, 1, "the new request of rid a is aborted by it");
        let second = again.join().expect("client thread");
        assert_eq!(second.status, 200, "{}", second.text);
        assert_eq!(second.body["meta_info"]["finish_reason"]["type"], "abort");
        assert_eq!(second.body["meta_info"]["id"], "a");
        assert_eq!(in_flight(), 0);
    });
    assert_eq!(ended(), 3, "three requests aborted");
    assert_eq!(server.raw("POST", "/continue_generation", b"").status, 200);
    // A batch whose poisoned sample fails the step its other sample finishes in: both end.
    let failed = server.post(
        "/generate",
        &json!({"input_ids": [[2, 3], [fake::POISON, 4]], "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(failed.status, 503, "{}", failed.text);
    wait_for(0);
    // The held result comes out of a later step; it must not count the request again.
    let done = server.post(
        "/generate",
        &json!({"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}),
    );
    assert_eq!(done.status, 200, "{}", done.text);
    assert_eq!(ended(), 6, "two failed, one finished");
}

/// A request's rid is free once the request ends, though its batch runs on (SGLang frees a
/// rid per request): a streaming client that saw one sample finish may send its rid again.
#[test]
fn the_rid_of_a_request_that_ended_is_free_while_its_batch_runs() {
    let engine = Paced::new(FakeEngine::new(0), Duration::from_millis(20));
    let server = TestServer::start(build_app(engine, None, fake::config()).expect("app builds"));
    let in_flight = || server.get("/v1/loads").body["loads"][0]["num_total_reqs"].clone();
    let abort = |rid: &str| {
        let r = server.post("/abort_request", &json!({ "rid": rid }));
        assert_eq!(r.status, 200, "{}", r.text);
        r.body["aborted"].clone()
    };
    let poll = |until: &dyn Fn() -> bool| {
        (0..500).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            until()
        })
    };
    std::thread::scope(|s| {
        let pair = s.spawn(|| {
            server.post(
                "/generate",
                &json!({"input_ids": [[2, 3], [4, 5]], "rid": ["x", "y"],
                        "sampling_params": [{"max_new_tokens": 1},
                                            {"max_new_tokens": 32, "ignore_eos": true}]}),
            )
        });
        let one_left = poll(&|| in_flight() == 1);
        let p = server.post("/pause_generation", &json!({"mode": "in_place"}));
        assert_eq!(p.status, 200, "{}", p.text);
        let again = s.spawn(|| {
            server.post(
                "/generate",
                &json!({"input_ids": [7, 8], "rid": "x", "sampling_params": {"max_new_tokens": 8}}),
            )
        });
        let taken = poll(&|| in_flight() == 2 || again.is_finished());
        // Abort whatever runs, so that every client thread ends whatever failed.
        let aborted = (abort("x"), abort("y"));
        assert_eq!(server.raw("POST", "/continue_generation", b"").status, 200);
        let first = pair.join().expect("client thread");
        let second = again.join().expect("client thread");
        assert!(one_left, "sample x never ended alone");
        assert!(taken, "the second x never ran");
        assert_eq!(second.status, 200, "{}", second.text);
        assert_eq!(
            aborted,
            (json!(1), json!(1)),
            "the new x and y were running"
        );
        assert_eq!(second.body["meta_info"]["id"], "x");
        assert_eq!(second.body["meta_info"]["finish_reason"]["type"], "abort");
        assert_eq!(first.status, 200, "{}", first.text);
        let reasons: Vec<&serde_json::Value> = first
            .body
            .as_array()
            .expect("batch answer")
            .iter()
            .map(|a| &a["meta_info"]["finish_reason"]["type"])
            .collect();
        assert_eq!(reasons, [&json!("length"), &json!("abort")]);
    });
}

/// An update arriving while a request runs waits for it (SGLang's update takes its writer
/// lock once every request's reader lock is back): the running request finishes under the
/// old weights, and one arriving meanwhile runs under the new ones.
#[test]
fn an_update_waits_for_the_requests_in_flight() {
    let engine = Paced::new(FakeEngine::new(0), Duration::from_millis(20));
    let server = TestServer::start(build_app(engine, None, fake::config()).expect("app builds"));
    let in_flight = || server.get("/v1/loads").body["loads"][0]["num_total_reqs"].clone();
    let dir = crate::support::fixture("qwen3_moe_tiny");
    std::thread::scope(|s| {
        let long = s.spawn(|| {
            server.post(
                "/generate",
                &json!({"input_ids": [3], "sampling_params": {"max_new_tokens": 30,
                        "ignore_eos": true}}),
            )
        });
        assert!(
            (0..500).any(|_| {
                std::thread::sleep(Duration::from_millis(5));
                in_flight() == 1
            }),
            "the request never arrived"
        );
        let update = s.spawn(|| {
            server.post(
                "/update_weights_from_disk",
                &json!({"model_path": dir, "weight_version": "v2"}),
            )
        });
        std::thread::sleep(Duration::from_millis(60));
        let later = s.spawn(|| {
            server.post(
                "/generate",
                &json!({"input_ids": [4], "sampling_params": {"max_new_tokens": 2}}),
            )
        });
        let r = long.join().expect("client thread");
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.body["output_ids"].as_array().map(Vec::len), Some(30));
        assert_eq!(
            r.body["meta_info"]["weight_version"], "default",
            "{}",
            r.text
        );
        let u = update.join().expect("client thread");
        assert_eq!(u.status, 200, "{}", u.text);
        let r = later.join().expect("client thread");
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.body["meta_info"]["weight_version"], "v2", "{}", r.text);
    });
}
