//! Token-by-token streaming, prompt log-probs and `/pause_generation` mode `retract` over
//! the real engine (tiny HF Qwen3-MoE fixture): chunks leave while the request is still
//! generating, streamed chunks add up to the non-streamed answer, and a retracted request is
//! re-prefilled and finishes unchanged; and, over a paced fake engine, a client that
//! disconnects aborts its request.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use r3_rollout::{Dtype, Engine, EngineConfig};
use r3_server::sse::parse_event_stream;
use r3_server::{build_app, ServerConfig, TextCodec};
use serde_json::{json, Value};

use crate::fake::FakeEngine;
use crate::paced::Paced;
use crate::support::{fixture, parse_response, scratch_dir, write_tokenizer, Reply, TestServer};

const MODEL: &str = "qwen3_moe_tiny";

fn server() -> TestServer {
    serve(None)
}

/// The fixture engine served at one step per `pace` at most ([`Paced`]).
fn paced_server(pace: Duration) -> TestServer {
    serve(Some(pace))
}

fn serve(pace: Option<Duration>) -> TestServer {
    let cfg = EngineConfig {
        dtype: Dtype::F32,
        kv_cache_bytes: 32 << 20,
        prefix_cache_bytes: 8 << 20,
        ..EngineConfig::default()
    };
    let engine = Engine::from_dir(&fixture(MODEL), cfg).expect("engine loads the fixture");
    let vocab = engine.model_config().vocab_size;
    let dir = scratch_dir("streaming-tokenizer");
    write_tokenizer(&dir, vocab);
    let codec = TextCodec::from_model_dir(&dir).expect("tokenizer loads");
    let _ = std::fs::remove_dir_all(&dir);
    let config = ServerConfig::default();
    let app = match pace {
        None => build_app(engine, codec, config),
        Some(pace) => build_app(Paced::new(engine, pace), codec, config),
    };
    TestServer::start(app.expect("app builds"))
}

/// An open streamed request: the raw bytes read so far.
struct Stream {
    socket: TcpStream,
    raw: Vec<u8>,
}

impl Stream {
    fn open(addr: SocketAddr, path: &str, body: &Value) -> Self {
        let mut socket = TcpStream::connect(addr).expect("connect");
        socket
            .set_read_timeout(Some(Duration::from_secs(120)))
            .expect("read timeout");
        let body = body.to_string();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        socket.write_all(head.as_bytes()).expect("write head");
        socket.write_all(body.as_bytes()).expect("write body");
        Stream {
            socket,
            raw: Vec::new(),
        }
    }

    /// Reads until the first complete `data:` event has arrived; returns it.
    fn first_event(&mut self) -> Value {
        let mut buf = [0u8; 4096];
        loop {
            let text = String::from_utf8_lossy(&self.raw).to_string();
            if let Some(at) = text.find("data: ") {
                if let Some(end) = text[at..].find("\n\n") {
                    let event = &text[at + 6..at + end];
                    return serde_json::from_str(event).expect("event is JSON");
                }
            }
            let n = self.socket.read(&mut buf).expect("read");
            assert!(n > 0, "stream closed before its first event");
            self.raw.extend_from_slice(&buf[..n]);
        }
    }

    /// Reads the rest and parses the whole response.
    fn finish(mut self) -> Reply {
        let _ = self.socket.read_to_end(&mut self.raw);
        parse_response(&self.raw)
    }
}

/// Waits (bounded, as a hang guard only) until the worker has nothing in flight.
fn wait_idle(server: &TestServer) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let loads = server.get("/v1/loads").body;
        if loads["loads"][0]["num_total_reqs"] == 0 || Instant::now() > deadline {
            return loads;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn steps(server: &TestServer) -> u64 {
    let info = server.get("/get_server_info").body;
    info["worker"]["steps"]
        .as_u64()
        .unwrap_or_else(|| panic!("steps counter in {info}"))
}

#[test]
fn generate_chunks_leave_while_generating_and_end_with_the_full_answer() {
    let server = server();
    let body = json!({"input_ids": [5, 9, 12, 40], "return_routed_experts": true,
                      "return_logprob": true, "logprob_start_len": 0, "top_logprobs_num": 2,
                      "sampling_params": {"max_new_tokens": 100, "seed": 4,
                                          "temperature": 1.0, "ignore_eos": true}});
    let plain = server.post("/generate", &body);
    assert_eq!(plain.status, 200, "{}", plain.text);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let mut s = Stream::open(server.addr, "/generate", &streamed);
    let first = s.first_event();
    // Produced mid-generation: no finish reason yet, fewer tokens than the answer.
    assert_eq!(first["meta_info"]["finish_reason"], Value::Null, "{first}");
    let early = first["output_ids"].as_array().expect("ids").len();
    assert!((1..100).contains(&early), "first chunk has {early} tokens");
    let r = s.finish();
    assert_eq!(r.status, 200);
    assert!(r.text.trim_end().ends_with("data: [DONE]"), "{}", r.text);
    let chunks = parse_event_stream(&r.text);
    assert!(chunks.len() > 2, "one chunk per step, got {}", chunks.len());
    // Cumulative output: each chunk extends the previous one.
    for w in chunks.windows(2) {
        let a = w[0]["output_ids"].as_array().expect("ids");
        let b = w[1]["output_ids"].as_array().expect("ids");
        assert!(
            b.len() >= a.len() && b[..a.len()] == a[..],
            "chunks are cumulative"
        );
    }
    let last = chunks.last().expect("a chunk");
    for key in ["output_ids", "text"] {
        assert_eq!(last[key], plain.body[key], "{key}");
    }
    let (lm, pm) = (&last["meta_info"], &plain.body["meta_info"]);
    for key in [
        "routed_experts",
        "output_token_logprobs",
        "input_token_logprobs",
        "input_top_logprobs",
        "finish_reason",
    ] {
        assert_eq!(lm[key], pm[key], "meta_info.{key}");
    }
}

#[test]
fn completion_chunks_concatenate_to_the_non_streamed_text() {
    let server = server();
    let body = json!({"prompt": [5, 9, 12], "max_tokens": 60, "seed": 7, "n": 2,
                      "ignore_eos": true, "logprobs": 1});
    let plain = server.post("/v1/completions", &body);
    assert_eq!(plain.status, 200, "{}", plain.text);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let mut s = Stream::open(server.addr, "/v1/completions", &streamed);
    let first = s.first_event();
    assert_eq!(first["choices"][0]["finish_reason"], Value::Null, "{first}");
    let chunks = parse_event_stream(&s.finish().text);
    for (i, want) in plain.body["choices"]
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
        let text: String = mine
            .iter()
            .map(|c| c["text"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(
            text,
            want["text"].as_str().unwrap_or_default(),
            "choice {i}"
        );
        let last = mine.last().expect("a chunk");
        assert_eq!(last["finish_reason"], want["finish_reason"]);
        assert_eq!(last["logprobs"], want["logprobs"]);
    }
}

#[test]
fn a_client_that_disconnects_aborts_its_streamed_request() {
    // On a fake engine taking 2 ms a step, finishing the 120 tokens would take at least
    // 240 ms, far longer than the server takes to see the client gone, on a loaded machine
    // too (the fixture model runs 120 steps in a few ms, and under CPU contention its engine
    // could finish before the disconnect was seen).
    let engine = Paced::new(FakeEngine::new(0), Duration::from_millis(2));
    let server = TestServer::start(build_app(engine, None, ServerConfig::default()).expect("app"));
    let body = json!({"input_ids": [3, 4], "stream": true,
                      "sampling_params": {"max_new_tokens": 120, "ignore_eos": true}});
    let before = steps(&server);
    let mut s = Stream::open(server.addr, "/generate", &body);
    let _ = s.first_event();
    drop(s);
    let loads = wait_idle(&server);
    assert_eq!(loads["loads"][0]["num_total_reqs"], 0, "{loads}");
    // Finishing would have taken one step per token.
    let ran = steps(&server) - before;
    assert!(
        ran < 120,
        "the request ran {ran} steps after its client left"
    );
}

#[test]
fn retracted_requests_are_re_prefilled_and_finish_unchanged() {
    // Paced, so the streamed request is still running when the pause arrives (110 tokens
    // take ≥ 220 ms; unpaced the fixture finished them in a few ms and could win the race).
    let server = paced_server(Duration::from_millis(2));
    let body = json!({"input_ids": [7, 8, 9], "return_routed_experts": true,
                      "return_logprob": true,
                      "sampling_params": {"max_new_tokens": 110, "seed": 2,
                                          "temperature": 1.0, "ignore_eos": true}});
    let plain = server.post("/generate", &body);
    assert_eq!(plain.status, 200, "{}", plain.text);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let mut s = Stream::open(server.addr, "/generate", &streamed);
    let _ = s.first_event();
    let paused = server.post("/pause_generation", &json!({"mode": "retract"}));
    assert_eq!(paused.status, 200, "{}", paused.text);
    assert_eq!(
        paused.body["aborted"], 1,
        "one request retracted: {}",
        paused.text
    );
    let loads = server.get("/v1/loads").body;
    assert_eq!(loads["loads"][0]["num_waiting_reqs"], 1, "{loads}");
    assert_eq!(loads["loads"][0]["num_running_reqs"], 0, "{loads}");
    let resumed = server.post("/continue_generation", &json!({}));
    assert_eq!(resumed.status, 200);
    let chunks = parse_event_stream(&s.finish().text);
    let last = chunks.last().expect("a chunk");
    assert_eq!(last["output_ids"], plain.body["output_ids"]);
    let (lm, pm) = (&last["meta_info"], &plain.body["meta_info"]);
    assert_eq!(lm["finish_reason"], pm["finish_reason"]);
    assert_eq!(lm["routed_experts"], pm["routed_experts"]);
    let close = |a: &Value, b: &Value| {
        let (a, b) = (a.as_array().expect("list"), b.as_array().expect("list"));
        a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| {
                (x[0].as_f64().unwrap_or(f64::NAN) - y[0].as_f64().unwrap_or(f64::NAN)).abs() < 1e-4
                    && x[1] == y[1]
            })
    };
    assert!(close(
        &lm["output_token_logprobs"],
        &pm["output_token_logprobs"]
    ));
}

#[test]
fn prompt_logprobs_on_the_wire_match_teacher_forcing_and_echo() {
    let server = server();
    let prompt = [11u32, 23, 5, 60, 2, 19];
    let gen = server.post(
        "/generate",
        &json!({"input_ids": prompt, "return_logprob": true,
                "sampling_params": {"max_new_tokens": 5, "seed": 1, "temperature": 1.0,
                                    "ignore_eos": true}}),
    );
    assert_eq!(gen.status, 200, "{}", gen.text);
    let out: Vec<u64> = gen.body["output_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    // SGLang's default (-1): only the last prompt token, with a null log-prob.
    assert_eq!(
        gen.body["meta_info"]["input_token_logprobs"],
        json!([[null, prompt[5], null]])
    );
    let mut forced: Vec<u64> = prompt.iter().map(|&t| u64::from(t)).collect();
    forced.extend(&out);
    let start = prompt.len() - 1;
    let scored = server.post(
        "/generate",
        &json!({"input_ids": forced, "return_logprob": true, "logprob_start_len": start,
                "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(scored.status, 200, "{}", scored.text);
    let input = scored.body["meta_info"]["input_token_logprobs"]
        .as_array()
        .expect("input_token_logprobs")
        .clone();
    assert_eq!(input.len(), forced.len() - start);
    assert_eq!(input[0][0], Value::Null, "the first entry has no log-prob");
    let output = gen.body["meta_info"]["output_token_logprobs"]
        .as_array()
        .expect("output_token_logprobs");
    for (p, o) in input[1..].iter().zip(output) {
        assert_eq!(p[1], o[1], "same token");
        let (a, b) = (p[0].as_f64().expect("lp"), o[0].as_f64().expect("lp"));
        assert!((a - b).abs() < 1e-4, "prompt {a} vs output {b}");
    }
    // OpenAI echo: the prompt's tokens and log-probs before the output's.
    let c = server.post(
        "/v1/completions",
        &json!({"prompt": forced, "echo": true, "logprobs": 1, "max_tokens": 1}),
    );
    assert_eq!(c.status, 200, "{}", c.text);
    let lp = &c.body["choices"][0]["logprobs"];
    let tl = lp["token_logprobs"].as_array().expect("token_logprobs");
    assert_eq!(tl.len(), forced.len() + 1);
    assert_eq!(tl[0], Value::Null);
    assert_eq!(lp["top_logprobs"][0], Value::Null);
    for (i, o) in output.iter().enumerate() {
        let a = tl[start + 1 + i].as_f64().expect("lp");
        let b = o[0].as_f64().expect("lp");
        assert!((a - b).abs() < 1e-4, "echo {a} vs output {b}");
    }
    let text = c.body["choices"][0]["text"].as_str().expect("text");
    let prompt_text: String = forced
        .iter()
        .map(|t| format!("t{t}"))
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        text.starts_with(&prompt_text),
        "{text} starts with the prompt"
    );
}
