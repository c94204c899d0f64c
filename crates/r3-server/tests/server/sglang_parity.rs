//! What r3 serves as SGLang 0.5.23 serves it, where the two once differed: the eos ids every
//! endpoint stops at (config.json's, generation_config.json's and the tokenizer's), chat's
//! sampling defaults from generation_config.json (`--sampling-defaults`), stop strings matched
//! with special tokens kept and cut after the match with `no_stop_trim`, SGLang's validation
//! (`top_k` 0, `min_new_tokens` past `max_new_tokens`, negative seeds, `max_tokens` 0), the
//! completions `logprobs` / `echo` format, and text prompts encoded with the tokenizer's bos.

use std::path::Path;

use r3_rollout::{Dtype, Engine, EngineConfig};
use r3_server::sse::parse_event_stream;
use r3_server::{build_app, ModelGeneration, SamplingDefaultsMode, ServerConfig, TextCodec};
use serde_json::{json, Value};

use crate::fake::{self, FakeEngine};
use crate::support::{fixture, ids, scratch_dir, write_tokenizer, Reply, TestServer};

/// generation_config.json's extra eos id in the fake tests: the fake engine's third token
/// after prompt `[5]` with seed 0 (28, 15, 14, …).
const GEN_EOS: u32 = 14;
/// The tokenizer's eos (`t40`): the fake engine's second token after prompt `[6]` with seed 0
/// (33, 40, …).
const TOKENIZER_EOS: u32 = 40;
/// Id of the special token `<|endoftext|>` in [`special_tokenizer`].
const SPECIAL: u32 = 63;
/// Id of the special bos `<s>` of [`bos_server`]'s tokenizer (in the real engine's vocabulary).
const BOS: u32 = 62;

/// A fake-engine server over a model directory holding `files` (name, JSON), with the
/// word-level tokenizer when `tokenizer` is set, and generation_config.json read as
/// `r3 serve` reads it under `mode`.
fn fake_server(files: &[(&str, Value)], tokenizer: bool, mode: SamplingDefaultsMode) -> TestServer {
    let dir = scratch_dir("parity-model");
    if tokenizer {
        write_tokenizer(&dir, fake::VOCAB);
    }
    for (name, v) in files {
        std::fs::write(dir.join(name), v.to_string()).expect("write model file");
    }
    let text = TextCodec::from_model_dir(&dir).expect("tokenizer loads if present");
    let generation = ModelGeneration::from_model_dir(&dir, mode).expect("generation config");
    let _ = std::fs::remove_dir_all(&dir);
    let config = ServerConfig {
        generation,
        ..fake::config()
    };
    TestServer::start(build_app(FakeEngine::new(0), text, config).expect("app builds"))
}

/// A Llama-3 / DeepSeek-V3 style `TemplateProcessing` post-processor putting the token
/// `bos` (id `id`) before every encoded text: with a tokenizer.json, transformers 5.x (and so
/// SGLang 0.5.23) adds special tokens by the post-processor alone, `add_bos_token` ignored.
fn bos_post_processor(bos: &str, id: u32) -> Value {
    json!({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [id], "tokens": [bos]}}})
}

/// A tokenizer over the fake vocabulary whose id 63 is the special token `<|endoftext|>`
/// (ids 0..63 are the words `t<i>`), with `post_processor` (`Value::Null` for none).
fn special_tokenizer(dir: &Path, post_processor: Value) {
    let vocab: serde_json::Map<String, Value> =
        (0..SPECIAL).map(|i| (format!("t{i}"), json!(i))).collect();
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": SPECIAL, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": post_processor,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).expect("write tokenizer.json");
}

/// A real-engine server (the fake returns no prompt log-probs) whose word-level tokenizer
/// has the special token `<s>` as id [`BOS`] in place of the word `t62`, added to every text
/// prompt by its post-processor.
fn bos_server() -> TestServer {
    let engine = crate::engine::engine(&fixture(crate::engine::MODEL));
    let dir = scratch_dir("parity-bos");
    write_tokenizer(&dir, engine.model_config().vocab_size);
    let path = dir.join("tokenizer.json");
    let mut tok: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    let vocab = tok["model"]["vocab"].as_object_mut().expect("vocab");
    vocab.remove(&format!("t{BOS}"));
    vocab.insert("<s>".into(), json!(BOS));
    tok["added_tokens"] = json!([{"id": BOS, "content": "<s>", "single_word": false,
        "lstrip": false, "rstrip": false, "normalized": false, "special": true}]);
    tok["post_processor"] = bos_post_processor("<s>", BOS);
    std::fs::write(&path, tok.to_string()).expect("write tokenizer.json");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"bos_token": "<s>"}).to_string(),
    )
    .expect("write tokenizer_config.json");
    let text = TextCodec::from_model_dir(&dir).expect("tokenizer loads");
    let _ = std::fs::remove_dir_all(&dir);
    TestServer::start(build_app(engine, text, ServerConfig::default()).expect("app builds"))
}

/// A fake-engine server with [`special_tokenizer`] (no post-processor) and
/// `tokenizer_config`.
fn special_server(tokenizer_config: Value) -> TestServer {
    special_server_with(tokenizer_config, Value::Null)
}

/// A fake-engine server with [`special_tokenizer`] under `post_processor` and
/// `tokenizer_config`.
fn special_server_with(tokenizer_config: Value, post_processor: Value) -> TestServer {
    let dir = scratch_dir("parity-special");
    special_tokenizer(&dir, post_processor);
    std::fs::write(
        dir.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .expect("write tokenizer_config.json");
    let text = TextCodec::from_model_dir(&dir).expect("tokenizer loads");
    let _ = std::fs::remove_dir_all(&dir);
    TestServer::start(build_app(FakeEngine::new(0), text, fake::config()).expect("app builds"))
}

fn ok(r: &Reply) -> &Value {
    assert_eq!(r.status, 200, "{}", r.text);
    &r.body
}

fn refused(r: &Reply, needle: &str) {
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(
        r.error_message().contains(needle),
        "{needle:?} not in {}",
        r.text
    );
}

/// `/generate` and `/v1/completions` stop at generation_config.json's eos ids and the
/// tokenizer's eos, as SGLang's `_check_token_based_finish` does on every endpoint (before,
/// only config.json's: the requests ran to `max_new_tokens`), token-id prompts and no
/// tokenizer included; `ignore_eos` still runs past them.
#[test]
fn every_endpoint_stops_at_generation_config_and_tokenizer_eos() {
    // The fake's outputs the constants are read from, with the fake's config eos (1) absent.
    let (five, _) = fake::expected(&[5], 8, &[], 0);
    let (six, _) = fake::expected(&[6], 8, &[], 0);
    assert_eq!((five[2], six[1]), (GEN_EOS, TOKENIZER_EOS));
    assert!(!five[..2].contains(&TOKENIZER_EOS) && !six[..1].contains(&GEN_EOS));
    assert!(!five[..3].contains(&fake::EOS) && !six[..2].contains(&fake::EOS));
    let gen = (
        "generation_config.json",
        json!({"eos_token_id": [fake::EOS, GEN_EOS]}),
    );
    let tok = (
        "tokenizer_config.json",
        json!({"eos_token": format!("t{TOKENIZER_EOS}")}),
    );
    let with_tokenizer = fake_server(&[gen.clone(), tok], true, SamplingDefaultsMode::Model);
    let ids_only = fake_server(&[gen], false, SamplingDefaultsMode::Model);
    let generate = |server: &TestServer, prompt: u32, extra: Value| {
        let mut sp = json!({"max_new_tokens": 8, "seed": 0});
        sp.as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        server.post(
            "/generate",
            &json!({"input_ids": [prompt], "sampling_params": sp}),
        )
    };
    for server in [&with_tokenizer, &ids_only] {
        let b = ok(&generate(server, 5, json!({}))).clone();
        assert_eq!(ids(&b["output_ids"]), five[..3]);
        assert_eq!(
            b["meta_info"]["finish_reason"],
            json!({"type": "stop", "matched": GEN_EOS})
        );
        let r = server.post(
            "/v1/completions",
            &json!({"prompt": [5], "max_tokens": 8, "seed": 0}),
        );
        let c = &ok(&r)["choices"][0];
        assert_eq!(
            (c["finish_reason"].clone(), c["matched_stop"].clone()),
            (json!("stop"), json!(GEN_EOS))
        );
        assert_eq!(ids(&c["token_ids"]), five[..3]);
        let b = ok(&generate(server, 5, json!({"ignore_eos": true}))).clone();
        assert_eq!(ids(&b["output_ids"]), five);
    }
    let b = ok(&generate(&with_tokenizer, 6, json!({}))).clone();
    assert_eq!(ids(&b["output_ids"]), six[..2]);
    assert_eq!(
        b["meta_info"]["finish_reason"],
        json!({"type": "stop", "matched": TOKENIZER_EOS})
    );
    // /get_model_info reports no eos list, as SGLang's (config.json's alone was incomplete).
    let info = ok(&with_tokenizer.get("/get_model_info")).clone();
    assert_eq!(info["model_path"], "models/fake");
    assert!(info.get("eos_token_ids").is_none(), "{info}");
    // Without a tokenizer its eos is unknown, as in SGLang with `--skip-tokenizer-init`.
    let b = ok(&generate(&ids_only, 6, json!({}))).clone();
    assert_eq!(ids(&b["output_ids"]), six);
}

/// generation_config.json's extra eos in the real-engine tests (beside config.json's 2).
const GEN_EOS_REAL: u32 = 77;

/// A real-engine server (no tokenizer) whose generation_config.json names the eos ids
/// `[2, GEN_EOS_REAL]`.
fn generation_eos_server() -> TestServer {
    let model = fixture(crate::engine::MODEL);
    let dir = scratch_dir("parity-gen-eos");
    std::fs::write(
        dir.join("generation_config.json"),
        json!({"eos_token_id": [2, GEN_EOS_REAL]}).to_string(),
    )
    .expect("write generation_config.json");
    let generation =
        ModelGeneration::from_model_dir(&dir, SamplingDefaultsMode::Model).expect("reads");
    let _ = std::fs::remove_dir_all(&dir);
    let config = ServerConfig {
        generation,
        ..ServerConfig::default()
    };
    TestServer::start(build_app(crate::engine::engine(&model), None, config).expect("app"))
}

/// The real engine with a generation_config.json naming an extra eos B beside config.json's:
/// `logit_bias` forcing B ends `/generate` at once with `matched: B`, and `min_new_tokens`
/// masks B (the union is what SGLang's min-new-tokens penalizer masks too).
#[test]
fn the_real_engine_stops_at_and_masks_generation_config_eos() {
    const B: u32 = GEN_EOS_REAL;
    let server = generation_eos_server();
    let body = |min: usize| {
        json!({"input_ids": [3, 17, 42], "sampling_params": {"max_new_tokens": 6,
            "temperature": 0, "logit_bias": {B.to_string(): 100.0}, "min_new_tokens": min}})
    };
    let b = ok(&server.post("/generate", &body(0))).clone();
    assert_eq!(ids(&b["output_ids"]), vec![B]);
    assert_eq!(
        b["meta_info"]["finish_reason"],
        json!({"type": "stop", "matched": B})
    );
    let b = ok(&server.post("/generate", &body(3))).clone();
    let out = ids(&b["output_ids"]);
    assert_eq!(out.len(), 4, "{out:?}");
    assert!(!out[..3].contains(&B) && out[3] == B, "{out:?}");
}

/// `ignore_eos` as SGLang's (`Req._check_token_based_finish` returns before it looks at any
/// stop id; the min-new-tokens penalizer masks the client's stop ids and the eos ids
/// whatever the flag says): a client stop id X forced by `logit_bias` ends nothing (6 X's,
/// finish length; before, one X and `matched: X`), and with `min_new_tokens` 3 the model's
/// eos B forced by `logit_bias` is still kept out of the first 3 tokens (before, the eos ids
/// left the stop list under `ignore_eos` and B came first).
#[test]
fn ignore_eos_ignores_every_stop_id_but_min_new_tokens_still_masks_them() {
    const X: u32 = 91;
    const B: u32 = GEN_EOS_REAL;
    let server = generation_eos_server();
    let ask = |sampling: Value| {
        let body = json!({"input_ids": [3, 17, 42], "sampling_params": sampling});
        ok(&server.post("/generate", &body)).clone()
    };
    let b = ask(
        json!({"max_new_tokens": 6, "temperature": 0, "ignore_eos": true,
        "stop_token_ids": [X], "logit_bias": {X.to_string(): 100.0}}),
    );
    assert_eq!(ids(&b["output_ids"]), vec![X; 6]);
    assert_eq!(
        b["meta_info"]["finish_reason"],
        json!({"type": "length", "length": 6})
    );
    let b = ask(
        json!({"max_new_tokens": 6, "temperature": 0, "ignore_eos": true,
        "min_new_tokens": 3, "logit_bias": {B.to_string(): 100.0}}),
    );
    let out = ids(&b["output_ids"]);
    assert_eq!(out.len(), 6, "{out:?}");
    assert!(!out[..3].contains(&B) && out[3..] == [B; 3], "{out:?}");
    assert_eq!(b["meta_info"]["finish_reason"]["type"], "length");
}

/// A stop string that is a special token's text ends the request when that token is sampled
/// (SGLang matches the text with special tokens kept), whatever `skip_special_tokens` says;
/// before, the tail was decoded with them skipped and the request ran on.
#[test]
fn a_special_tokens_text_is_a_stop_string() {
    let server = special_server(json!({}));
    let (out, _) = fake::expected(&[5], 8, &[], 35);
    assert_eq!(out[0], SPECIAL);
    for skip in [true, false] {
        let r = server.post(
            "/generate",
            &json!({"input_ids": [5], "sampling_params": {"max_new_tokens": 8, "seed": 35,
                "stop": ["<|endoftext|>"], "skip_special_tokens": skip}}),
        );
        let b = ok(&r);
        assert_eq!(ids(&b["output_ids"]), vec![SPECIAL], "skip {skip}");
        assert_eq!(
            b["meta_info"]["finish_reason"],
            json!({"type": "stop", "matched": "<|endoftext|>"})
        );
        assert_eq!(b["text"], "", "skip {skip}");
    }
}

/// `no_stop_trim` keeps the text up to the end of the matched stop string, not past it
/// (SGLang's `trim_matched_stop`): the token `t28` completes the stop string `t2`.
#[test]
fn no_stop_trim_cuts_right_after_the_stop_string() {
    let server = fake_server(&[], true, SamplingDefaultsMode::Model);
    let (out, _) = fake::expected(&[5], 8, &[], 0);
    assert_eq!(out[0], 28);
    let ask = |no_stop_trim: bool| {
        let r = server.post(
            "/generate",
            &json!({"input_ids": [5], "sampling_params": {"max_new_tokens": 8, "seed": 0,
                "stop": "t2", "no_stop_trim": no_stop_trim}}),
        );
        let b = ok(&r).clone();
        assert_eq!(ids(&b["output_ids"]), vec![28]);
        b["text"].clone()
    };
    assert_eq!(ask(true), "t2");
    assert_eq!(ask(false), "");
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [5], "max_tokens": 8, "seed": 0, "stop": ["t2"], "no_stop_trim": true}),
    );
    assert_eq!(ok(&r)["choices"][0]["text"], "t2");
}

/// SGLang's `SamplingParams.verify` and `CompletionRequest`: `top_k` 0 and a
/// `min_new_tokens` above `max_new_tokens` are 400s naming the field; `max_tokens` 0 on
/// completions is SGLang's "max_tokens must be positive"; negative seeds are taken (as their
/// two's complement, SGLang's cast to uint64), a fractional one is refused.
#[test]
fn validation_follows_sglang() {
    let server = fake_server(&[], false, SamplingDefaultsMode::Model);
    let generate = |sp: Value| {
        server.post(
            "/generate",
            &json!({"input_ids": [5], "sampling_params": sp}),
        )
    };
    refused(
        &generate(json!({"top_k": 0})),
        "top_k must be -1 (disable) or at least 1, got 0",
    );
    // SGLang makes a temperature below 1e-6 greedy (top_k 1) before it checks top_k: the
    // request is taken and answers the greedy tokens.
    let greedy = ok(&generate(
        json!({"temperature": 0, "max_new_tokens": 4, "seed": 0}),
    ))
    .clone();
    for (temperature, top_k) in [(0.0, 0), (0.0, -5), (5e-7, 0)] {
        let b = ok(&generate(
            json!({"temperature": temperature, "top_k": top_k, "max_new_tokens": 4, "seed": 0}),
        ))
        .clone();
        assert_eq!(
            b["output_ids"], greedy["output_ids"],
            "T {temperature} k {top_k}"
        );
    }
    refused(
        &generate(json!({"temperature": 1e-5, "top_k": 0})),
        "top_k must be -1 (disable) or at least 1, got 0",
    );
    refused(
        &generate(json!({"max_new_tokens": 2, "min_new_tokens": 3})),
        "min_new_tokens must be in [0, max_new_tokens(2)], got 3",
    );
    refused(
        &generate(json!({"max_new_tokens": 0, "min_new_tokens": 1})),
        "min_new_tokens",
    );
    let r = server.post("/v1/completions", &json!({"prompt": [5], "top_k": 0}));
    refused(&r, "top_k");
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [5], "max_tokens": 2, "min_tokens": 3}),
    );
    refused(&r, "min_new_tokens");
    let r = server.post("/v1/completions", &json!({"prompt": [5], "max_tokens": 0}));
    refused(&r, "max_tokens must be positive");
    // The server's own clipping is not the client's fault: min = max past the cap is fine.
    ok(&generate(
        json!({"max_new_tokens": 100, "min_new_tokens": 100}),
    ));

    let out = |seed: Value| {
        let b = ok(&generate(
            json!({"max_new_tokens": 4, "sampling_seed": seed}),
        ))
        .clone();
        ids(&b["output_ids"])
    };
    assert_eq!(out(json!(-1)), out(json!(u64::MAX)));
    assert_eq!(out(json!(i64::MIN)), out(json!(1u64 << 63)));
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [5], "max_tokens": 3, "seed": -5}),
    );
    let b = ok(&r);
    let want = fake::expected(&[5], 3, &[fake::EOS], (-5i64) as u64).0;
    assert_eq!(ids(&b["choices"][0]["token_ids"]), want);
    refused(&generate(json!({"seed": 1.5})), "seed");
}

/// Completions as SGLang formats them: `logprobs: 0` has `top_logprobs: []` (not null), and
/// with `echo` no prompt log-probs (only a truthy `logprobs` asks for them); the echoed text
/// of token ids skips special tokens, a text prompt is echoed as sent; `text_offset` starts
/// after the echoed text when its tokens are not listed.
#[test]
fn completions_logprobs_and_echo_follow_sglang() {
    let server = special_server(json!({}));
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [5, SPECIAL], "max_tokens": 2, "seed": 0, "logprobs": 0, "echo": true}),
    );
    let c = &ok(&r)["choices"][0];
    let out = fake::expected(&[5, SPECIAL], 2, &[], 0).0;
    assert!(
        !out.contains(&fake::EOS) && !out.contains(&SPECIAL),
        "{out:?}"
    );
    let words: Vec<String> = out.iter().map(|t| format!("t{t}")).collect();
    assert_eq!(c["text"], format!("t5{}", words.join(" ")));
    let lp = &c["logprobs"];
    assert_eq!(lp["top_logprobs"], json!([]));
    assert_eq!(lp["tokens"], json!(words));
    assert_eq!(lp["token_logprobs"].as_array().map(Vec::len), Some(2));
    assert!(lp["token_logprobs"][0].is_number(), "{lp}");
    assert_eq!(lp["text_offset"], json!([2, 2 + words[0].len()]));
    // Without echo, `logprobs: 0` still gives an empty list.
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [5], "max_tokens": 2, "seed": 0, "logprobs": 0}),
    );
    assert_eq!(ok(&r)["choices"][0]["logprobs"]["top_logprobs"], json!([]));
    // A text prompt is echoed exactly as sent (two spaces kept).
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "t4  t5", "max_tokens": 1, "seed": 0, "echo": true}),
    );
    let c = &ok(&r)["choices"][0];
    let out = fake::expected(&[4, 5], 1, &[], 0).0;
    assert_eq!(c["text"], format!("t4  t5t{}", out[0]));
}

/// Text prompts are encoded with the tokenizer's special tokens (SGLang calls the HF tokenizer
/// with `add_special_tokens=True`): under a bos-adding post-processor (Llama-3's,
/// DeepSeek-V3's) a `/generate` text and a completions prompt start with the bos; a chat
/// prompt (the rendered template) gets none added.
#[test]
fn text_prompts_start_with_the_bos_the_tokenizer_adds() {
    let server = special_server_with(
        json!({"bos_token": "t60",
            "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}),
        bos_post_processor("t60", 60),
    );
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "t5 t6", "max_tokens": 1, "return_token_ids": true}),
    );
    assert_eq!(ok(&r)["choices"][0]["prompt_token_ids"], json!([60, 5, 6]));
    let r = server.post(
        "/generate",
        &json!({"text": "t5 t6", "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(ok(&r)["meta_info"]["prompt_tokens"], 3);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 1}),
    );
    assert_eq!(ok(&r)["prompt_token_ids"], json!([5, 6]));
}

/// With `echo` and `logprobs` ≥ 1, `text_offset` indexes the choice's text: a bos the
/// tokenizer added to a text prompt (echoed as sent, without it) and a special token in an id
/// prompt (echoed with special tokens skipped) sit where the next visible text starts, and the
/// output starts where the echoed text ends (before, every prompt token's text was counted).
#[test]
fn echoed_text_offsets_index_the_choice_text() {
    let server = bos_server();
    let choice = |prompt: Value| {
        let r = server.post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": true,
                "logprobs": 1, "echo": true, "return_token_ids": true}),
        );
        ok(&r)["choices"][0].clone()
    };
    let c = choice(json!("t5 t6"));
    assert_eq!(c["prompt_token_ids"], json!([BOS, 5, 6]));
    let tokens = c["logprobs"]["tokens"].as_array().expect("tokens").clone();
    assert_eq!(tokens[..3], [json!("<s>"), json!("t5"), json!("t6")]);
    let first = tokens[3].as_str().expect("token").chars().count();
    assert!(
        c["text"].as_str().is_some_and(|t| t.starts_with("t5 t6")),
        "{c}"
    );
    // "t5 t6": the bos and t5 at 0, t6 after "t5" (token texts run without the space), the
    // output at 5 and its second token after the first's text.
    assert_eq!(c["logprobs"]["text_offset"], json!([0, 0, 2, 5, 5 + first]));

    // An id prompt echoed with its special token skipped: "t5".
    let c = choice(json!([5, BOS]));
    let tokens = c["logprobs"]["tokens"].as_array().expect("tokens").clone();
    let first = tokens[2].as_str().expect("token").chars().count();
    assert!(
        c["text"].as_str().is_some_and(|t| t.starts_with("t5")),
        "{c}"
    );
    assert_eq!(c["logprobs"]["text_offset"], json!([0, 2, 2, 2 + first]));
}

/// A real-engine chat server over a model directory with a tokenizer, a chat template and
/// `generation_config`, its defaults taken under `mode`.
fn chat_server(generation_config: Value, mode: SamplingDefaultsMode) -> TestServer {
    let cfg = EngineConfig {
        dtype: Dtype::F32,
        kv_cache_bytes: 32 << 20,
        prefix_cache_bytes: 8 << 20,
        ..EngineConfig::default()
    };
    let engine = Engine::from_dir(&fixture(crate::engine::MODEL), cfg).expect("engine loads");
    let dir = scratch_dir("parity-chat");
    write_tokenizer(&dir, engine.model_config().vocab_size);
    let template = "{% for m in messages %}t2 {{ m.content }} t3 {% endfor %}t4";
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"chat_template": template}).to_string(),
    )
    .expect("write tokenizer config");
    std::fs::write(
        dir.join("generation_config.json"),
        generation_config.to_string(),
    )
    .expect("write generation config");
    let codec = TextCodec::from_model_dir(&dir).expect("tokenizer loads");
    let generation = ModelGeneration::from_model_dir(&dir, mode).expect("generation config");
    let _ = std::fs::remove_dir_all(&dir);
    let config = ServerConfig {
        generation,
        ..ServerConfig::default()
    };
    TestServer::start(build_app(engine, codec, config).expect("app builds"))
}

/// The tokens of a chat answer.
fn chat_tokens(server: &TestServer, extra: Value) -> Vec<u32> {
    let mut body = json!({"messages": [{"role": "user", "content": "t9 t12"}],
        "max_tokens": 8, "ignore_eos": true});
    body.as_object_mut()
        .expect("object")
        .extend(extra.as_object().expect("object").clone());
    let r = server.post("/v1/chat/completions", &body);
    ids(&ok(&r)["choices"][0]["token_ids"])
}

/// generation_config.json's `temperature: 0` (SGLang's `--sampling-defaults model`): a chat
/// request without a temperature is greedy for every seed, one with its own samples; the
/// same server's `/generate` and completions keep their fixed defaults (temperature 1), as in
/// SGLang; under `--sampling-defaults openai` chat samples at temperature 1 too.
#[test]
fn chat_takes_the_models_sampling_defaults() {
    let server = chat_server(json!({"temperature": 0.0}), SamplingDefaultsMode::Model);
    let greedy = chat_tokens(&server, json!({"temperature": 0}));
    for seed in [1, 2, 3] {
        assert_eq!(
            chat_tokens(&server, json!({"seed": seed})),
            greedy,
            "seed {seed}"
        );
    }
    let sampled = |s: &TestServer, extra: Value| {
        (1..=4).any(|seed| {
            let mut e = extra.clone();
            e["seed"] = json!(seed);
            chat_tokens(s, e) != greedy
        })
    };
    assert!(
        sampled(&server, json!({"temperature": 1.0})),
        "its own temperature"
    );
    // The rendered chat prompt, sent to /generate and completions as ids: temperature 1.
    let prompt = [2u32, 9, 12, 3, 4];
    let not_greedy = (1..=4).any(|seed| {
        let r = server.post(
            "/generate",
            &json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 8,
                "ignore_eos": true, "seed": seed}}),
        );
        ids(&ok(&r)["output_ids"]) != greedy
    });
    assert!(not_greedy, "/generate took chat's defaults");
    let not_greedy = (1..=4).any(|seed| {
        let r = server.post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 8, "ignore_eos": true, "seed": seed}),
        );
        ids(&ok(&r)["choices"][0]["token_ids"]) != greedy
    });
    assert!(not_greedy, "completions took chat's defaults");
    assert_eq!(
        ok(&server.get("/get_server_info"))["sampling_defaults"],
        "model"
    );

    let openai = chat_server(json!({"temperature": 0.0}), SamplingDefaultsMode::OpenAi);
    assert!(sampled(&openai, json!({})), "openai defaults sample");
    assert_eq!(
        ok(&openai.get("/get_server_info"))["sampling_defaults"],
        "openai"
    );
}

/// Chat's `max_tokens` / `max_completion_tokens` of 0 as SGLang 0.5.23 reads them
/// (entrypoints/openai/protocol.py `to_sampling_params`: `"max_new_tokens":
/// self.max_completion_tokens or self.max_tokens`, so a 0 `max_completion_tokens` falls
/// through to `max_tokens`; the scheduler's `init_req_max_new_tokens` gives None the rest of
/// the context; 0 is its prefill-only request, finished `length` with no output):
/// `max_completion_tokens: 0` alone generates the rest of the 128-position context, beside
/// `max_tokens: 3` it generates 3, and `max_tokens: 0` answers empty content, no ids, no
/// log-prob entries, finish `length` 0 and no completion tokens, streamed too; a `min_tokens`
/// above it is refused as SGLang's `verify` refuses it. Before, each was a 400.
#[test]
fn chat_max_tokens_zero_follows_sglang() {
    let server = chat_server(json!({}), SamplingDefaultsMode::Model);
    let ask = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "t9 t12"}],
            "ignore_eos": true});
        body.as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        server.post("/v1/chat/completions", &body)
    };
    let b = ok(&ask(json!({"max_completion_tokens": 0}))).clone();
    let prompt = b["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
    assert_eq!(b["usage"]["completion_tokens"], 128 - prompt, "{b}");
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    let b = ok(&ask(json!({"max_completion_tokens": 0, "max_tokens": 3}))).clone();
    assert_eq!(b["usage"]["completion_tokens"], 3, "{b}");
    let b = ok(&ask(
        json!({"max_tokens": 0, "logprobs": true, "return_meta_info": true,
        "return_routed_experts": true}),
    ))
    .clone();
    let c = &b["choices"][0];
    assert_eq!(c["message"]["content"], "", "{b}");
    assert_eq!(c["token_ids"], json!([]));
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(c["logprobs"]["content"], json!([]));
    assert_eq!(
        c["meta_info"]["finish_reason"],
        json!({"type": "length", "length": 0})
    );
    assert_eq!(b["usage"]["completion_tokens"], 0);
    assert_eq!(b["usage"]["prompt_tokens"], prompt);
    // Routes for the prompt's positions but its last (none is fed after it).
    assert!(b["sglext"]["routed_experts"].is_string(), "{b}");
    let r = ask(json!({"max_tokens": 0, "stream": true}));
    assert_eq!(r.status, 200, "{}", r.text);
    let chunks = parse_event_stream(&r.text);
    let choices: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].as_array()?.first())
        .collect();
    let content: String = choices
        .iter()
        .filter_map(|c| c["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "", "{}", r.text);
    assert_eq!(choices.last().expect("a chunk")["finish_reason"], "length");
    refused(
        &ask(json!({"max_tokens": 0, "min_tokens": 2})),
        "min_new_tokens must be in [0, max_new_tokens(0)], got 2",
    );
}

/// Streamed completions carry each chunk's new token ids (SGLang's
/// `_generate_completion_stream`: `chunk_token_ids = output_ids[n_prev_token_id:]`) and, with
/// `return_token_ids`, the prompt's ids on the first chunk of each choice only
/// (`is_first_chunk`): a choice's chunks' ids concatenate to the non-streamed `token_ids`,
/// every chunk carrying the tokens generated since the previous one. Before, the ids (all of
/// them) and the prompt's came in the last chunk alone.
#[test]
fn streamed_completions_carry_each_chunks_token_ids() {
    let server = fake_server(&[], true, SamplingDefaultsMode::Model);
    let body = json!({"prompt": [[5], [6]], "max_tokens": 6, "seed": 0, "ignore_eos": true,
        "return_token_ids": true});
    let plain = ok(&server.post("/v1/completions", &body)).clone();
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = server.post("/v1/completions", &streamed);
    assert_eq!(r.status, 200, "{}", r.text);
    let chunks = parse_event_stream(&r.text);
    for (i, want) in plain["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .enumerate()
    {
        let mine: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"].as_array()?.first())
            .filter(|c| c["index"] == i)
            .collect();
        assert!(mine.len() > 2, "choice {i}: {} chunks", mine.len());
        let sent: Vec<u32> = mine.iter().flat_map(|c| ids(&c["token_ids"])).collect();
        assert_eq!(sent, ids(&want["token_ids"]), "choice {i}");
        // The fake generates a word a step, each sent at once: one id per content chunk.
        for c in &mine[..mine.len() - 1] {
            assert_eq!(ids(&c["token_ids"]).len(), 1, "choice {i}: {c}");
        }
        assert_eq!(mine[0]["prompt_token_ids"], want["prompt_token_ids"]);
        assert!(
            mine[1..]
                .iter()
                .all(|c| c.get("prompt_token_ids").is_none()),
            "choice {i}"
        );
    }
}
