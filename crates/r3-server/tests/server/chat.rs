//! `/v1/chat/completions` against the fake engine: messages rendered through the model's
//! chat template (with `add_generation_prompt` and `chat_template_kwargs`), the model's eos
//! ending the turn, and a clear 400 when the model has no template or the template refuses.

use r3_server::sse::parse_event_stream;
use r3_server::{build_app, TextCodec};
use serde_json::json;

use crate::fake::{self, FakeEngine};
use crate::support::{scratch_dir, write_tokenizer, TestServer};

/// A template over the word-level test vocabulary: `t2 <content> t3` per message, `t4` as
/// the generation prompt, `t5` when thinking is switched off; a `tool` role is refused.
const TEMPLATE: &str = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}t2 {{ m.content }} t3 {% endfor %}{% if add_generation_prompt %}t4{% endif %}{% if enable_thinking is defined and not enable_thinking %} t5{% endif %}";

/// The id the tokenizer config names as eos (`t7`).
const TEMPLATE_EOS: u32 = 7;

fn server(template: Option<&str>) -> TestServer {
    let cfg = fake::config();
    let dir = scratch_dir("chat-tokenizer");
    write_tokenizer(&dir, fake::VOCAB);
    let mut tc = json!({"eos_token": "t7"});
    if let Some(t) = template {
        tc["chat_template"] = json!(t);
    }
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).expect("write config");
    let codec = TextCodec::from_model_dir(&dir).expect("tokenizer loads");
    let _ = std::fs::remove_dir_all(&dir);
    TestServer::start(build_app(FakeEngine::new(0), codec, cfg).expect("app builds"))
}

fn words(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| format!("t{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn chat_renders_the_template_and_stops_at_the_models_eos() {
    let server = server(Some(TEMPLATE));
    let body = json!({"model": "fake", "seed": 3, "max_tokens": 12,
        "messages": [{"role": "system", "content": "t9"}, {"role": "user", "content": "t10 t11"}]});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text);
    let prompt = [2u32, 9, 3, 2, 10, 11, 3, 4];
    assert_eq!(r.body["prompt_token_ids"], json!(prompt));
    let (want, stopped) = fake::expected(&prompt, 12, &[fake::EOS, TEMPLATE_EOS], 3);
    let choice = &r.body["choices"][0];
    assert_eq!(choice["token_ids"], json!(want));
    assert_eq!(choice["message"]["role"], "assistant");
    let shown = if stopped {
        &want[..want.len() - 1]
    } else {
        &want[..]
    };
    assert_eq!(choice["message"]["content"], words(shown));
    assert_eq!(
        choice["finish_reason"],
        if stopped { "stop" } else { "length" }
    );
    assert_eq!(r.body["object"], "chat.completion");
    assert_eq!(r.body["usage"]["prompt_tokens"], prompt.len());

    // Without the generation prompt, and with a template kwarg, the prompt changes.
    let body = json!({"seed": 3, "max_tokens": 2, "add_generation_prompt": false,
        "chat_template_kwargs": {"enable_thinking": false},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "t10"}]}]});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["prompt_token_ids"], json!([2, 10, 3, 5]));
}

/// Streamed: per choice a role chunk, then the content; the last chunk of each choice has
/// its finish reason, and the content adds up to the non-streamed choice's content.
#[test]
fn chat_streams_a_role_chunk_then_the_content_per_choice() {
    let server = server(Some(TEMPLATE));
    let body = json!({"seed": 1, "max_tokens": 4, "n": 2,
        "messages": [{"role": "user", "content": "t10"}]});
    let plain = server.post("/v1/chat/completions", &body);
    assert_eq!(plain.status, 200, "{}", plain.text);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = server.post("/v1/chat/completions", &streamed);
    assert_eq!(r.status, 200, "{}", r.text);
    let chunks = parse_event_stream(&r.text);
    for i in 0..2 {
        let mine: Vec<&serde_json::Value> = chunks
            .iter()
            .inspect(|c| assert_eq!(c["object"], "chat.completion.chunk"))
            .filter_map(|c| c["choices"].as_array()?.first())
            .filter(|c| c["index"] == i)
            .collect();
        assert!(mine.len() >= 2, "{}", r.text);
        assert_eq!(mine[0]["delta"]["role"], "assistant");
        let content: String = mine
            .iter()
            .map(|c| c["delta"]["content"].as_str().unwrap_or_default())
            .collect();
        let want = &plain.body["choices"][i];
        assert_eq!(
            content,
            want["message"]["content"].as_str().unwrap_or_default()
        );
        assert_eq!(
            mine.last().expect("a chunk")["finish_reason"],
            want["finish_reason"]
        );
    }
}

/// `logprobs: true`: one `content` entry per generated token, with the fake engine's
/// log-prob of that token (`-id / 100`) and the token's text and bytes.
#[test]
fn chat_logprobs_list_every_generated_token() {
    let server = server(Some(TEMPLATE));
    let body = json!({"seed": 2, "max_tokens": 5, "logprobs": true,
        "messages": [{"role": "user", "content": "t10"}]});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text);
    let choice = &r.body["choices"][0];
    let out = crate::support::ids(&choice["token_ids"]);
    let content = choice["logprobs"]["content"].as_array().expect("content");
    assert_eq!(content.len(), out.len(), "{}", r.text);
    for (&t, e) in out.iter().zip(content) {
        assert_eq!(e["token"], format!("t{t}"));
        assert_eq!(e["bytes"], json!(format!("t{t}").into_bytes()));
        let lp = e["logprob"].as_f64().expect("logprob");
        assert!(
            (lp - f64::from(fake::logprob(t))).abs() < 1e-6,
            "{lp} for t{t}"
        );
        assert_eq!(e["top_logprobs"], json!([]));
    }
}

#[test]
fn chat_without_a_template_or_refused_by_it_is_a_400() {
    let r = server(None).post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "t1"}]}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.error_message().contains("no chat template"), "{}", r.text);

    let server = server(Some(TEMPLATE));
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "tool", "content": "t1"}]}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.error_message().contains("no tools here"), "{}", r.text);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"content": "t1"}]}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.error_message().contains("messages[0].role"), "{}", r.text);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "t1"}], "tools": [{"type": "function"}]}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.error_message().contains("tools"), "{}", r.text);
}

/// `ignore_eos: true` generates past the model's stop ids too (the template's eos `t7`
/// included), as SGLang's `ignore_eos`: for a seed whose output would stop at an eos, the
/// answer runs to `max_tokens` with the fake engine's unstopped tokens.
#[test]
fn chat_ignore_eos_also_ignores_the_models_stop_ids() {
    let server = server(Some(TEMPLATE));
    let prompt = [2u32, 10, 3, 4];
    let seed = (0..200u64)
        .find(|&s| fake::expected(&prompt, 12, &[fake::EOS, TEMPLATE_EOS], s).1)
        .expect("some seed reaches an eos within 12 tokens");
    let body = json!({"seed": seed, "max_tokens": 12, "ignore_eos": true,
        "messages": [{"role": "user", "content": "t10"}]});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["prompt_token_ids"], json!(prompt));
    let (want, stopped) = fake::expected(&prompt, 12, &[], seed);
    assert!(!stopped);
    assert_eq!(r.body["choices"][0]["token_ids"], json!(want));
    assert_eq!(r.body["choices"][0]["finish_reason"], "length");
}
