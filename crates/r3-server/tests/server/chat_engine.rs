//! `/v1/chat/completions` over the real engine (tiny HF Qwen3-MoE fixture): OpenAI chat
//! `logprobs` / `top_logprobs` agree with greedy choices, and a streamed chat answer arrives
//! token by token and adds up to the non-streamed answer (content, finish reason, log-probs).

use r3_rollout::{Dtype, Engine, EngineConfig};
use r3_server::sse::parse_event_stream;
use r3_server::{build_app, ServerConfig, TextCodec};
use serde_json::{json, Value};

use crate::support::{fixture, ids, scratch_dir, write_tokenizer, TestServer};

const MODEL: &str = "qwen3_moe_tiny";

/// Each message's content between `t2` and `t3`, then `t4` as the generation prompt.
const TEMPLATE: &str =
    "{% for m in messages %}t2 {{ m.content }} t3 {% endfor %}{% if add_generation_prompt %}t4{% endif %}";

fn server() -> TestServer {
    let cfg = EngineConfig {
        dtype: Dtype::F32,
        kv_cache_bytes: 32 << 20,
        prefix_cache_bytes: 8 << 20,
        ..EngineConfig::default()
    };
    let engine = Engine::from_dir(&fixture(MODEL), cfg).expect("engine loads the fixture");
    let vocab = engine.model_config().vocab_size;
    let dir = scratch_dir("chat-engine-tokenizer");
    write_tokenizer(&dir, vocab);
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"chat_template": TEMPLATE}).to_string(),
    )
    .expect("write tokenizer config");
    let codec = TextCodec::from_model_dir(&dir).expect("tokenizer loads");
    let _ = std::fs::remove_dir_all(&dir);
    let app = build_app(engine, codec, ServerConfig::default()).expect("app builds");
    TestServer::start(app)
}

/// Greedy with `top_logprobs = 3`: every generated token is its position's best
/// alternative, its log-prob equals that alternative's, the alternatives decrease, and
/// `content` has one entry per generated token, named as the tokenizer decodes it.
#[test]
fn chat_logprobs_agree_with_greedy_choices() {
    let server = server();
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "t9 t12"}], "max_tokens": 6,
                "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let choice = &r.body["choices"][0];
    let out = ids(&choice["token_ids"]);
    let content = choice["logprobs"]["content"].as_array().expect("content");
    assert_eq!(content.len(), out.len());
    for (&t, e) in out.iter().zip(content) {
        assert_eq!(e["token"], format!("t{t}"));
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .expect("bytes")
            .iter()
            .filter_map(|b| b.as_u64().map(|b| b as u8))
            .collect();
        assert_eq!(bytes, format!("t{t}").into_bytes());
        let top = e["top_logprobs"].as_array().expect("top_logprobs");
        assert_eq!(top.len(), 3);
        let values: Vec<f64> = top.iter().filter_map(|a| a["logprob"].as_f64()).collect();
        assert!(values.windows(2).all(|w| w[0] >= w[1]), "{values:?}");
        assert_eq!(top[0]["token"], e["token"]);
        let lp = e["logprob"].as_f64().expect("logprob");
        assert!(
            lp <= 0.0 && (lp - values[0]).abs() < 1e-6,
            "{lp} vs {values:?}"
        );
    }
    // Without `logprobs: true` there are none, and `top_logprobs` alone is refused.
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "t9"}], "max_tokens": 2}),
    );
    assert_eq!(r.body["choices"][0]["logprobs"], Value::Null, "{}", r.text);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "t9"}], "top_logprobs": 2}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.error_message().contains("logprobs"), "{}", r.text);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "t9"}], "logprobs": true, "top_logprobs": 21}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
}

/// Streamed with `n = 2`: per choice a role chunk first, then several content chunks, the
/// last one with the finish reason and the log-probs; the contents concatenate to the
/// non-streamed choice's content and the log-probs are the same.
#[test]
fn chat_streams_token_by_token_and_adds_up_to_the_plain_answer() {
    let server = server();
    let body = json!({"messages": [{"role": "user", "content": "t5 t9"}], "max_tokens": 30,
                      "seed": 7, "n": 2, "ignore_eos": true, "logprobs": true, "top_logprobs": 1});
    let plain = server.post("/v1/chat/completions", &body);
    assert_eq!(plain.status, 200, "{}", plain.text);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = server.post("/v1/chat/completions", &streamed);
    assert_eq!(r.status, 200, "{}", r.text);
    let chunks = parse_event_stream(&r.text);
    for (i, want) in plain.body["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .enumerate()
    {
        let mine: Vec<&Value> = chunks
            .iter()
            .inspect(|c| assert_eq!(c["object"], "chat.completion.chunk"))
            .filter_map(|c| c["choices"].as_array()?.first())
            .filter(|c| c["index"] == i)
            .collect();
        assert!(mine.len() > 3, "choice {i}: {} chunks", mine.len());
        assert_eq!(mine[0]["delta"]["role"], "assistant");
        let content: String = mine
            .iter()
            .map(|c| c["delta"]["content"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(
            content,
            want["message"]["content"].as_str().unwrap_or_default()
        );
        let last = mine.last().expect("a chunk");
        assert_eq!(last["finish_reason"], want["finish_reason"]);
        assert_eq!(last["logprobs"], want["logprobs"]);
        assert!(mine[..mine.len() - 1]
            .iter()
            .all(|c| c["finish_reason"].is_null()));
    }
}
