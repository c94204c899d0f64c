//! Connection limits (over the fake engine): idle and slow-header connections are closed by
//! the header timeout, a slow body gets 408, connections past the cap get 503, and a client
//! that half-closes its write side after a full request still gets its answer.

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

#[test]
fn connections_past_the_cap_get_503_and_the_slot_frees() {
    let s = server(limits(30, 30, 2));
    let held: Vec<TcpStream> = (0..2).map(|_| connect(&s)).collect();
    // Each held connection is accepted before the next connect is tried.
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
        let mut again = connect(&s);
        let _ = again.write_all(full_request(true).as_bytes());
        let (_, raw) = closed_by_server(&mut again);
        let status = parse_response(&raw).status;
        if status == 200 {
            reply = Some(status);
            break;
        }
    }
    assert_eq!(reply, Some(200));
}
