//! Connection limits (over the fake engine): idle and slow-header connections are closed by
//! the header timeout, a slow body gets 408, a flood of idle connections past the limit
//! makes room for real clients (the longest-idle are closed), connections past a cap of busy
//! ones get 503 (429 per client), and a client that half-closes its write side after a full
//! request still gets its answer.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use r3_server::{build_app, ConnectionLimits, ServerConfig};

use crate::fake::FakeEngine;
use crate::support::{parse_response, TestServer};

const GENERATE: &str =
    r#"{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "ignore_eos": true}}"#;

fn server(limits: ConnectionLimits) -> TestServer {
    let config = ServerConfig {
        model_name: "fake".into(),
        connections: limits,
        ..ServerConfig::default()
    };
    let app = build_app(FakeEngine::new(0), None, config).expect("app builds");
    TestServer::start_with(app, limits)
}

fn limits(header_secs: u64, body_secs: u64, max_connections: usize) -> ConnectionLimits {
    ConnectionLimits {
        header_timeout: Duration::from_secs(header_secs),
        body_timeout: Duration::from_secs(body_secs),
        max_connections,
        max_connections_per_client: None,
    }
}

fn connect(s: &TestServer) -> TcpStream {
    let stream = TcpStream::connect(s.addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    stream
}

/// Reads until the server closes; true when it closed (EOF or reset) rather than timing out.
fn closed_by_server(stream: &mut TcpStream) -> (bool, Vec<u8>) {
    let mut buf = Vec::new();
    match stream.read_to_end(&mut buf) {
        Ok(_) => (true, buf),
        Err(e) if e.kind() == ErrorKind::ConnectionReset => (true, buf),
        Err(_) => (false, buf),
    }
}

fn full_request(close: bool) -> String {
    let connection = if close { "Connection: close\r\n" } else { "" };
    format!(
        "POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{connection}\r\n{GENERATE}",
        GENERATE.len()
    )
}

#[test]
fn idle_and_slow_header_connections_are_closed_by_the_timeout() {
    let s = server(limits(1, 30, 64));
    let mut idle = connect(&s);
    let mut slow = connect(&s);
    slow.write_all(b"POST /generate HTTP/1.1\r\nHost: loc")
        .expect("write part of the headers");
    let started = Instant::now();
    let (closed, _) = closed_by_server(&mut idle);
    assert!(closed, "an idle connection is closed by the server");
    let (closed, _) = closed_by_server(&mut slow);
    assert!(closed, "a connection stuck in its headers is closed");
    assert!(started.elapsed() < Duration::from_secs(30));
    // After one answered request, a kept-alive connection that goes idle is closed too.
    let mut kept = connect(&s);
    kept.write_all(full_request(false).as_bytes())
        .expect("write request");
    let (closed, raw) = closed_by_server(&mut kept);
    assert!(closed);
    assert_eq!(parse_response(&raw).status, 200);
}

#[test]
fn a_slow_body_gets_408() {
    let s = server(limits(30, 1, 64));
    let mut stream = connect(&s);
    stream
        .write_all(
            b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"input_ids\":",
        )
        .expect("write part of the body");
    let (closed, raw) = closed_by_server(&mut stream);
    assert!(closed);
    let reply = parse_response(&raw);
    assert_eq!(reply.status, 408, "{}", reply.text);
}

#[test]
fn a_half_closed_request_is_answered() {
    let s = server(ConnectionLimits::default());
    let mut stream = connect(&s);
    stream
        .write_all(full_request(false).as_bytes())
        .expect("write request");
    stream.shutdown(Shutdown::Write).expect("half-close");
    let (closed, raw) = closed_by_server(&mut stream);
    assert!(closed);
    let reply = parse_response(&raw);
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.body["output_ids"].as_array().map(Vec::len), Some(2));
}

/// A connection whose request is in flight: headers complete, body still arriving (the
/// server waits for it up to the body timeout).
fn busy_connection(s: &TestServer) -> TcpStream {
    let mut stream = connect(s);
    stream
        .write_all(
            b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"input_ids\":",
        )
        .expect("write part of the body");
    stream
}

/// Sends one request on a fresh connection; the status and how long the answer took.
fn timed_request(s: &TestServer) -> (u16, Duration) {
    let started = Instant::now();
    let mut stream = connect(s);
    let _ = stream.write_all(full_request(true).as_bytes());
    let (_, raw) = closed_by_server(&mut stream);
    (parse_response(&raw).status, started.elapsed())
}

#[test]
fn connections_past_the_cap_of_busy_ones_get_503_and_the_slot_frees() {
    // All test clients are one IP: a per-client cap above the total one.
    let s = server(ConnectionLimits {
        max_connections_per_client: Some(3),
        ..limits(30, 30, 2)
    });
    let held = vec![busy_connection(&s), busy_connection(&s)];
    // Each held connection is dispatched before the next connect is tried.
    std::thread::sleep(Duration::from_millis(300));
    let mut third = connect(&s);
    let (closed, raw) = closed_by_server(&mut third);
    assert!(closed);
    assert_eq!(parse_response(&raw).status, 503);
    drop(held);
    // The server notices the closes and frees both slots.
    let mut reply = None;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let (status, _) = timed_request(&s);
        if status == 200 {
            reply = Some(status);
            break;
        }
    }
    assert_eq!(reply, Some(200));
}

#[test]
fn a_client_past_its_connection_cap_with_all_busy_gets_429() {
    let s = server(ConnectionLimits {
        max_connections_per_client: Some(2),
        ..limits(30, 30, 8)
    });
    let _held = [busy_connection(&s), busy_connection(&s)];
    std::thread::sleep(Duration::from_millis(300));
    let mut third = connect(&s);
    let (closed, raw) = closed_by_server(&mut third);
    assert!(closed);
    let reply = parse_response(&raw);
    assert_eq!(reply.status, 429, "{}", reply.text);
    assert!(
        reply.text.contains("--max-connections-per-client"),
        "{}",
        reply.text
    );
}

#[test]
fn an_idle_connection_flood_past_the_limit_does_not_lock_a_client_out() {
    // A small limit, so the flood (three times the limit) fits CI's open-file limit.
    let max = 16;
    // Every test client is 127.0.0.1: a per-client cap as large as the limit makes the
    // flood meet the limit itself (the per-client cap has its own test).
    let s = server(ConnectionLimits {
        max_connections_per_client: Some(max),
        ..limits(30, 30, max)
    });
    let addr = s.addr;
    let flooding = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flood = {
        let flooding = std::sync::Arc::clone(&flooding);
        std::thread::spawn(move || {
            // Idle sockets and sockets stuck in their headers, opened one every 40 ms and
            // held (the header timeout is 30 s: only eviction closes them here).
            let mut held = Vec::new();
            for i in 0..3 * max {
                let Ok(mut c) = TcpStream::connect(addr) else {
                    continue;
                };
                if i % 2 == 1 {
                    let _ = c.write_all(b"POST /generate HTTP/1.1\r\nHost: loc");
                }
                held.push(c);
                std::thread::sleep(Duration::from_millis(40));
            }
            while flooding.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
            }
            held
        })
    };
    // Real requests throughout the flood and after it, each on a fresh connection.
    std::thread::sleep(Duration::from_millis(200));
    let mut answers = Vec::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        answers.push(timed_request(&s));
        std::thread::sleep(Duration::from_millis(50));
    }
    flooding.store(false, std::sync::atomic::Ordering::Relaxed);
    let mut held = flood.join().expect("flood thread");
    assert!(answers.len() >= 20, "{} requests", answers.len());
    for (i, (status, took)) in answers.iter().enumerate() {
        assert_eq!(*status, 200, "request {i} of {} refused", answers.len());
        assert!(*took < Duration::from_secs(1), "request {i} took {took:?}");
    }
    // The flood was held open past the limit: the server closed the oldest idle ones, and
    // at most `max` of them can still be open.
    let mut closed = 0;
    for c in &mut held {
        c.set_read_timeout(Some(Duration::from_millis(20)))
            .expect("read timeout");
        if closed_by_server(c).0 {
            closed += 1;
        }
    }
    assert_eq!(held.len(), 3 * max, "every flood socket connected");
    assert!(
        closed >= held.len() - max,
        "{closed} of {} closed",
        held.len()
    );
}
