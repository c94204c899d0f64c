//! A client that goes away while its request runs: the server sees it before any answer is
//! written (a request whose client closed its socket is probed and found reset), drops the
//! handler and the engine aborts the request, for non-streamed `/generate`,
//! `/v1/completions` and `/v1/chat/completions` and a stream still waiting for its first
//! token. A client that only half-closed its write side still gets its answer. The engine is
//! gated and never opened in the disconnect tests: a request there ends only if the server
//! aborts it, so each test either sees the abort or times out (no timing to tune).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use r3_server::{build_app, TextCodec};
use serde_json::{json, Value};

use crate::fake::{self, FakeEngine};
use crate::gated::{wait_for, Gate, Gated, OpenOnDrop};
use crate::support::{parse_response, scratch_dir, write_tokenizer, TestServer};

/// The fake engine behind `gate`, with a word-level tokenizer and a chat template.
fn server(gate: &Gate) -> TestServer {
    let dir = scratch_dir("client-gone-tokenizer");
    write_tokenizer(&dir, fake::VOCAB);
    let config = json!({"eos_token": "t7",
        "chat_template": "{% for m in messages %}t2 {{ m.content }} t3 {% endfor %}t4"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write");
    let codec = TextCodec::from_model_dir(&dir).expect("tokenizer loads");
    let _ = std::fs::remove_dir_all(&dir);
    let engine = Gated::new(FakeEngine::new(0), gate.clone());
    TestServer::start(build_app(engine, codec, fake::config()).expect("app builds"))
}

/// The worker's counters.
fn worker(s: &TestServer) -> Value {
    s.get("/get_server_info").body["worker"].clone()
}

/// Requests the worker has queued or running.
fn in_flight(s: &TestServer) -> u64 {
    let w = worker(s);
    w["waiting"].as_u64().expect("waiting") + w["running"].as_u64().expect("running")
}

/// Opens a connection and sends one POST (kept alive: the client decides when to close).
fn send(s: &TestServer, path: &str, body: &Value) -> TcpStream {
    let mut stream = TcpStream::connect(s.addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("read timeout");
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        s.addr,
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("write head");
    stream.write_all(body.as_bytes()).expect("write body");
    stream
}

/// Sends a request of `requests` engine requests that cannot finish (the gate stays shut),
/// closes the client once they run, and waits until the engine has ended them: only an
/// abort ends them.
fn leave_and_see_aborted(path: &str, body: Value, requests: u64) {
    let gate = Gate::closed();
    let s = server(&gate);
    let _open = OpenOnDrop(gate.clone());
    let stream = send(&s, path, &body);
    wait_for("the requests to run", || in_flight(&s) == requests);
    drop(stream);
    wait_for(
        "the server to abort the requests of a client that left",
        || in_flight(&s) == 0,
    );
    let w = worker(&s);
    assert_eq!(w["finished_requests"], requests, "{w}");
    // The server goes on serving.
    gate.open();
    let r = s.post(
        "/generate",
        &json!({"input_ids": [3], "sampling_params": {"max_new_tokens": 2}}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
}

#[test]
fn a_non_streamed_generate_whose_client_leaves_is_aborted() {
    leave_and_see_aborted(
        "/generate",
        json!({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 32,
               "ignore_eos": true}}),
        1,
    );
}

#[test]
fn a_completion_whose_client_leaves_is_aborted() {
    leave_and_see_aborted(
        "/v1/completions",
        json!({"model": "fake", "prompt": [3, 4], "max_tokens": 32, "n": 2,
               "ignore_eos": true}),
        2,
    );
}

#[test]
fn a_chat_completion_whose_client_leaves_is_aborted() {
    leave_and_see_aborted(
        "/v1/chat/completions",
        json!({"model": "fake", "max_tokens": 32, "ignore_eos": true,
               "messages": [{"role": "user", "content": "t10 t11"}]}),
        1,
    );
}

#[test]
fn a_stream_whose_client_leaves_before_its_first_token_is_aborted() {
    leave_and_see_aborted(
        "/generate",
        json!({"input_ids": [3, 4], "stream": true,
               "sampling_params": {"max_new_tokens": 32, "ignore_eos": true}}),
        1,
    );
}

#[test]
fn a_half_closed_client_of_a_long_request_gets_its_answer() {
    let gate = Gate::closed();
    let s = server(&gate);
    let _open = OpenOnDrop(gate.clone());
    let mut stream = send(
        &s,
        "/generate",
        &json!({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 5,
                "ignore_eos": true}}),
    );
    stream.shutdown(Shutdown::Write).expect("half-close");
    // The server probes the half-closed connection with an interim 100 response; the client
    // is still there, so the request goes on.
    let probe = b"HTTP/1.1 100 Continue\r\n\r\n";
    let mut raw = vec![0u8; probe.len()];
    stream.read_exact(&mut raw).expect("the probe");
    assert_eq!(raw, probe);
    // A few checks later the request is still running.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(in_flight(&s), 1);
    gate.open();
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).expect("the answer");
    raw.extend_from_slice(&rest);
    let reply = parse_response(&raw);
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.body["output_ids"].as_array().map(Vec::len), Some(5));
    assert_eq!(reply.body["meta_info"]["finish_reason"]["type"], "length");
}
