//! Per-request and per-client limits (over the fake engine, paused in place so requests stay
//! in flight as long as a test needs): a request over its token limit gets 413, a client
//! over its request or token limit gets 429 naming the flag, other requests keep being
//! served, and the counts return to 0 when requests end — answered, aborted, refused by
//! their handler, streamed, or dropped by a client that went away.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use r3_server::limits::Usage;
use r3_server::{build_app, ClientLedger, ClientLimits, ServerConfig};
use serde_json::{json, Value};

use crate::fake::FakeEngine;
use crate::support::{request, Reply, TestServer};

fn server(limits: ClientLimits) -> (TestServer, ClientLedger) {
    let config = ServerConfig {
        model_name: "fake".into(),
        clients: limits,
        ..ServerConfig::default()
    };
    let app = build_app(FakeEngine::new(0), None, config).expect("app builds");
    let ledger = app.clients.clone();
    (TestServer::start(app), ledger)
}

/// `prompt_len` ids and `n` samples of `new` tokens: `prompt_len + n * new` tokens.
fn generate(prompt_len: usize, n: usize, new: usize) -> Value {
    json!({
        "input_ids": vec![2; prompt_len],
        "sampling_params": {"n": n, "max_new_tokens": new, "ignore_eos": true},
    })
}

/// Waits until the ledger shows `want` (the server updates it from its own threads).
fn wait_for(ledger: &ClientLedger, want: Usage) {
    let t0 = Instant::now();
    while ledger.total() != want {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "in flight: {:?}, expected {want:?}",
            ledger.total()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn pause(s: &TestServer) {
    let r = s.post("/pause_generation", &json!({"mode": "in_place"}));
    assert_eq!(r.status, 200, "{}", r.text);
}

fn resume(s: &TestServer) {
    let r = s.post("/continue_generation", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text);
}

/// Sends `body` to `/generate` on a thread; the reply comes back through the handle.
fn send(s: &TestServer, body: Value) -> std::thread::JoinHandle<Reply> {
    let addr = s.addr;
    std::thread::spawn(move || request(addr, "POST", "/generate", body.to_string().as_bytes()))
}

#[test]
fn a_request_over_its_token_limit_gets_413_naming_the_flag() {
    let (s, ledger) = server(ClientLimits {
        max_tokens_per_request: Some(50),
        ..ClientLimits::default()
    });
    // 3 + 5 × 10 = 53 > 50.
    let r = s.post("/generate", &generate(3, 5, 10));
    assert_eq!(r.status, 413, "{}", r.text);
    let m = r.error_message();
    assert!(
        m.contains("53") && m.contains("--max-tokens-per-request"),
        "{m}"
    );
    // 3 + 4 × 10 = 43 fits; the same limit applies to OpenAI completions (default 16 new).
    let r = s.post("/generate", &generate(3, 4, 10));
    assert_eq!(r.status, 200, "{}", r.text);
    let r = s.post("/v1/completions", &json!({"prompt": [2, 2, 2], "n": 3}));
    assert_eq!(r.status, 413, "3 + 3 × 16 = 51 tokens: {}", r.text);
    assert_eq!(ledger.total(), Usage::default());
}

#[test]
fn a_client_over_its_request_limit_gets_429_until_one_ends() {
    let (s, ledger) = server(ClientLimits {
        max_requests_per_client: 2,
        ..ClientLimits::default()
    });
    pause(&s);
    let a = send(&s, generate(2, 1, 3));
    let b = send(&s, generate(2, 1, 3));
    wait_for(
        &ledger,
        Usage {
            requests: 2,
            tokens: 10,
        },
    );
    let r = s.post("/generate", &generate(2, 1, 3));
    assert_eq!(r.status, 429, "{}", r.text);
    let m = r.error_message();
    assert!(
        m.contains("client 127.0.0.1") && m.contains("--max-requests-per-client"),
        "{m}"
    );
    // Endpoints that generate nothing are not counted.
    assert_eq!(s.get("/health").status, 200);
    resume(&s);
    for h in [a, b] {
        let r = h.join().expect("client thread");
        assert_eq!(r.status, 200, "{}", r.text);
    }
    wait_for(&ledger, Usage::default());
    assert_eq!(s.post("/generate", &generate(2, 1, 3)).status, 200);
}

#[test]
fn a_client_over_its_token_limit_gets_429_and_aborted_requests_give_theirs_back() {
    let (s, ledger) = server(ClientLimits {
        max_tokens_per_client: Some(60),
        ..ClientLimits::default()
    });
    pause(&s);
    // 4 + 4 × 10 = 44 tokens held.
    let held = send(&s, generate(4, 4, 10));
    wait_for(
        &ledger,
        Usage {
            requests: 1,
            tokens: 44,
        },
    );
    // 44 + (2 + 20) = 66 > 60.
    let r = s.post("/generate", &generate(2, 1, 20));
    assert_eq!(r.status, 429, "{}", r.text);
    assert!(
        r.error_message().contains("--max-tokens-per-client"),
        "{}",
        r.text
    );
    // Aborting the held request ends it; its tokens are given back.
    let r = s.post("/abort_request", &json!({"abort_all": true}));
    assert_eq!(r.status, 200, "{}", r.text);
    let r = held.join().expect("client thread");
    assert_eq!(r.status, 200, "{}", r.text);
    wait_for(&ledger, Usage::default());
    resume(&s);
    assert_eq!(s.post("/generate", &generate(2, 1, 20)).status, 200);
}

#[test]
fn refused_streamed_and_abandoned_requests_all_return_the_count_to_zero() {
    let (s, ledger) = server(ClientLimits::default());
    // Refused by its handler (token id out of the vocabulary): counted, then given back.
    let r = s.post("/generate", &json!({"input_ids": [9999]}));
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(ledger.total(), Usage::default());

    pause(&s);
    // A streamed request holds its share until its last event is sent.
    let mut body = generate(3, 1, 4);
    body["stream"] = json!(true);
    let streamed = send(&s, body.clone());
    wait_for(
        &ledger,
        Usage {
            requests: 1,
            tokens: 7,
        },
    );
    // A client that sends a request and goes away: its request ends, its share is freed.
    let mut gone = TcpStream::connect(s.addr).expect("connect");
    let text = body.to_string();
    let head = format!(
        "POST /generate HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{text}",
        s.addr,
        text.len()
    );
    gone.write_all(head.as_bytes()).expect("send");
    wait_for(
        &ledger,
        Usage {
            requests: 2,
            tokens: 14,
        },
    );
    drop(gone);
    resume(&s);
    let r = streamed.join().expect("client thread");
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.text.contains("data: [DONE]"), "{}", r.text);
    wait_for(&ledger, Usage::default());
}
