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

/// SGLang's RL fields on chat (miles' session router sends them): `input_ids` replace the
/// rendered messages, `rid` names the request (`meta_info.id`, `/abort_request`),
/// `return_meta_info` / `return_prompt_token_ids` fill each choice, `matched_stop` names the
/// stop id, and `return_routed_experts` answers SGLang's `sglext.routed_experts`.
#[test]
fn chat_takes_sglangs_rl_fields() {
    let server = server(Some(TEMPLATE));
    let prompt = [2u32, 10, 11, 3, 4, 9];
    let seed = (0..200u64)
        .find(|&s| fake::expected(&prompt, 12, &[fake::EOS, TEMPLATE_EOS], s).1)
        .expect("some seed reaches an eos within 12 tokens");
    let body = json!({"seed": seed, "max_tokens": 12, "input_ids": prompt, "rid": "turn-1",
        "messages": [{"role": "user", "content": "t20"}], "return_meta_info": true,
        "return_prompt_token_ids": true, "return_routed_experts": true, "logprobs": true});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text);
    let (want, stopped) = fake::expected(&prompt, 12, &[fake::EOS, TEMPLATE_EOS], seed);
    assert!(stopped);
    let choice = &r.body["choices"][0];
    assert_eq!(choice["token_ids"], json!(want));
    assert_eq!(choice["prompt_token_ids"], json!(prompt));
    assert_eq!(choice["matched_stop"], json!(want.last()));
    let meta = &choice["meta_info"];
    assert_eq!(meta["id"], "turn-1", "{}", r.text);
    assert_eq!(meta["prompt_tokens"], prompt.len());
    assert_eq!(meta["finish_reason"]["type"], "stop");
    assert_eq!(
        meta["output_token_logprobs"].as_array().map(Vec::len),
        Some(want.len())
    );
    let mut tokens = prompt.to_vec();
    tokens.extend(&want);
    let routes = json!({"routed_experts": r.body["sglext"]["routed_experts"]});
    let decoded = r3_routing::wire::sglang::decode_sglang_response(&routes, &fake::wire_shape(0))
        .expect("routes decode");
    assert_eq!(decoded, fake::routes_of(&tokens, 0));
    // With stream, return_meta_info is refused (as SGLang: its chunks have no place for it).
    let streamed = json!({"stream": true, "return_meta_info": true,
        "messages": [{"role": "user", "content": "t20"}]});
    let r = server.post("/v1/chat/completions", &streamed);
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.error_message().contains("return_meta_info"), "{}", r.text);
    // Ids past the vocabulary are refused by name.
    let bad = json!({"input_ids": [2, 99], "messages": [{"role": "user", "content": "t20"}]});
    let r = server.post("/v1/chat/completions", &bad);
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.error_message().contains("input_ids[1]"), "{}", r.text);
    // A field that would change generation and r3 lacks is refused by name.
    let r = server.post(
        "/v1/chat/completions",
        &json!({"stop_regex": "t9", "messages": [{"role": "user", "content": "t20"}]}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.error_message().contains("stop_regex"), "{}", r.text);
}

/// Without `max_tokens` a chat request generates what the context and the server's
/// `--max-new-tokens` (32 here) leave, as SGLang's scheduler does, not a default of its own.
#[test]
fn chat_without_max_tokens_runs_to_the_servers_cap() {
    let server = server(Some(TEMPLATE));
    let body = json!({"seed": 5, "ignore_eos": true,
        "messages": [{"role": "user", "content": "t10"}]});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.body["choices"][0]["token_ids"].as_array().map(Vec::len),
        Some(32),
        "{}",
        r.text
    );
}

/// `stream_options.include_usage`: a last chunk with no choices and the answer's usage
/// before `[DONE]`; `continuous_usage_stats`: usage so far on every content chunk.
#[test]
fn chat_and_completion_streams_report_usage_when_asked() {
    let server = server(Some(TEMPLATE));
    let body = json!({"seed": 1, "max_tokens": 4, "n": 2, "stream": true, "ignore_eos": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true},
        "messages": [{"role": "user", "content": "t10"}]});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text);
    let chunks = parse_event_stream(&r.text);
    let last = chunks.last().expect("chunks");
    assert_eq!(last["choices"], json!([]), "{}", r.text);
    assert_eq!(last["usage"]["prompt_tokens"], 4);
    assert_eq!(last["usage"]["completion_tokens"], 8);
    assert_eq!(last["usage"]["total_tokens"], 12);
    assert!(
        chunks
            .iter()
            .filter(|c| c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty()))
            .all(|c| c["usage"]["completion_tokens"].as_u64() > Some(0)),
        "{}",
        r.text
    );
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [[4, 5]], "max_tokens": 3, "stream": true, "ignore_eos": true,
                "stream_options": {"include_usage": true}}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let chunks = parse_event_stream(&r.text);
    let last = chunks.last().expect("chunks");
    assert_eq!(last["choices"], json!([]), "{}", r.text);
    assert_eq!(last["usage"]["total_tokens"], 5);
    // Not asked: no usage chunk.
    let plain = json!({"prompt": [[4, 5]], "max_tokens": 3, "stream": true});
    let r = server.post("/v1/completions", &plain);
    let chunks = parse_event_stream(&r.text);
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "{}",
        r.text
    );
}

/// A message whose `content` is null or absent reaches the template as `""`, as SGLang
/// 0.5.23's `_apply_jinja_template` sets it (`if msg_dict.get("content") is None:
/// msg_dict["content"] = ""`): defined and not none, printing as nothing (r3-text alone
/// would leave the key out, as transformers 5.24+ drops null keys).
#[test]
fn null_or_missing_content_reaches_the_template_as_an_empty_string() {
    let server = server(Some(
        "{% for m in messages %}{% if m.content is defined and m.content is not none %}t2{% else %}t8{% endif %} {{ m.content }} t3 {% endfor %}",
    ));
    let body = json!({"max_tokens": 1, "add_generation_prompt": false,
        "messages": [{"role": "user", "content": null}, {"role": "assistant"},
            {"role": "user", "content": "t10"}]});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text);
    // "t2  t3 t2  t3 t2 t10 t3 " (t8 would mark a content left out or none).
    assert_eq!(r.body["prompt_token_ids"], json!([2, 3, 2, 3, 2, 10, 3]));
}

/// A list of text parts is joined with a space, `input_text` parts taken as text, as SGLang
/// 0.5.23's `process_content_for_template_format` flattens content for a template that does
/// not loop over it (`" ".join(text_parts)`); an empty list is `""`.
#[test]
fn text_parts_join_with_a_space_and_input_text_is_text() {
    let server = server(Some(TEMPLATE));
    let body = json!({"max_tokens": 1, "add_generation_prompt": false,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "t10"},
            {"type": "input_text", "text": "t11"}]}, {"role": "assistant", "content": []}]});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text);
    // "t2 t10 t11 t3 t2  t3 ": joined without the space, "t10t11" would be one unknown word.
    assert_eq!(r.body["prompt_token_ids"], json!([2, 10, 11, 3, 2, 3]));
    // A part of another kind is still refused, naming it.
    let body = json!({"messages": [{"role": "user", "content": [{"type": "image_url",
        "image_url": {"url": "x"}}]}]});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.text.contains("messages[0].content[0]"), "{}", r.text);
}

/// `chat_template_kwargs` naming one of `apply_chat_template`'s own parameters is refused
/// naming the key (SGLang 0.5.23 spreads the kwargs beside `tokenize=False`,
/// `add_generation_prompt`, `tools` and `return_dict`, and transformers raises "got multiple
/// values"): before, r3 let them override its own settings or reach the template, `tools`
/// slipping past the refusal of the `tools` field.
#[test]
fn chat_template_kwargs_naming_apply_chat_template_arguments_are_refused() {
    let server = server(Some(TEMPLATE));
    for key in [
        "tools",
        "add_generation_prompt",
        "messages",
        "conversation",
        "chat_template",
        "tokenize",
    ] {
        let body = json!({"max_tokens": 1, "chat_template_kwargs": {key: false},
            "messages": [{"role": "user", "content": "t10"}]});
        let r = server.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{key}: {}", r.text);
        assert!(
            r.text.contains(&format!("chat_template_kwargs.{key}")),
            "{}",
            r.text
        );
    }
    // A template variable is still taken, and so are the arguments SGLang takes without an
    // error: `documents` (a template variable there too) and those that only shape
    // tokenisation, which never reach the template (its `messages` stay the rendered ones).
    for kwargs in [
        json!({"enable_thinking": false}),
        json!({"documents": [], "padding": true, "truncation": true, "max_length": 8,
            "return_tensors": "pt", "tokenizer_kwargs": {}}),
    ] {
        let body = json!({"max_tokens": 1, "chat_template_kwargs": kwargs,
            "messages": [{"role": "user", "content": "t10"}]});
        let r = server.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{kwargs}: {}", r.text);
    }
}
