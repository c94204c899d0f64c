//! Test support: run an app on an ephemeral port in-process, and a tiny blocking HTTP/1.1
//! client over std's TcpStream (no client library to build).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::Duration;

use r3_server::{serve_with_limits, App, ConnectionLimits};
use serde_json::Value;

/// A server running on 127.0.0.1:<ephemeral> in a background thread; stopped on drop.
pub struct TestServer {
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl TestServer {
    /// Serves `app` (its handle is dropped so the worker ends with the server).
    pub fn start(app: App) -> Self {
        Self::start_with(app, ConnectionLimits::default())
    }

    /// Serves `app` with the given connection limits.
    pub fn start_with(app: App, limits: ConnectionLimits) -> Self {
        let App { router, handle, .. } = app;
        drop(handle);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind ephemeral port");
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let addr = listener.local_addr().expect("local addr");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
                serve_with_limits(listener, router, limits, async {
                    let _ = rx.await;
                })
                .await
                .expect("server runs");
            });
        });
        TestServer {
            addr,
            shutdown: Some(tx),
            thread: Some(thread),
        }
    }

    /// POSTs a JSON value.
    pub fn post(&self, path: &str, body: &Value) -> Reply {
        self.raw("POST", path, body.to_string().as_bytes())
    }

    /// GETs a path.
    pub fn get(&self, path: &str) -> Reply {
        self.raw("GET", path, b"")
    }

    /// Sends raw bytes as the body.
    pub fn raw(&self, method: &str, path: &str, body: &[u8]) -> Reply {
        request(self.addr, method, path, body)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Status and parsed JSON body (Null when the body is not JSON).
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
    pub text: String,
}

impl Reply {
    /// The error message of a JSON error body.
    pub fn error_message(&self) -> String {
        self.body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

/// One HTTP/1.1 request with `Connection: close`; reads the whole response.
pub fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Reply {
    let mut stream = TcpStream::connect(addr).expect("connect to test server");
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .expect("read timeout");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("write head");
    // The server may answer (413) before reading a large body and close; ignore write errors.
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    parse_response(&raw)
}

/// One HTTP/1.1 request with exactly `headers` (plus `Host` unless given, `Content-Length`
/// and `Connection: close`).
pub fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    let mut stream = TcpStream::connect(addr).expect("connect to test server");
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .expect("read timeout");
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    stream.write_all(head.as_bytes()).expect("write head");
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    parse_response(&raw)
}

/// Parses a raw HTTP/1.1 response; interim 1xx responses before it (a `100 Continue`
/// probing a half-closed connection) are skipped, as HTTP/1.1 clients skip them.
pub fn parse_response(mut raw: &[u8]) -> Reply {
    while raw.starts_with(b"HTTP/1.1 1") {
        match raw.windows(4).position(|w| w == b"\r\n\r\n") {
            Some(end) => raw = &raw[end + 4..],
            None => break,
        }
    }
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("response has a header block");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut payload = raw[split + 4..].to_vec();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status code");
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        payload = dechunk(&payload);
    }
    let text = String::from_utf8_lossy(&payload).to_string();
    let body = serde_json::from_str(&text).unwrap_or(Value::Null);
    Reply { status, body, text }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_str = String::from_utf8_lossy(&data[..eol]).to_string();
        let size = usize::from_str_radix(size_str.trim(), 16).unwrap_or(0);
        if size == 0 {
            return out;
        }
        let start = eol + 2;
        out.extend_from_slice(&data[start..start + size]);
        data = &data[start + size + 2..];
    }
}

/// Directory of a fixture model of the engine crate (`r3-rollout/tests/fixtures`).
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../r3-rollout/tests/fixtures")
        .join(name)
}

/// A fresh scratch directory for one call (removed by the caller when done).
///
/// Tests run in parallel threads and several call this with the same tag, so each call gets
/// its own directory: a shared one was deleted by one test while another was writing to it.
pub fn scratch_dir(tag: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("r3-server-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// JSON list of numbers -> Vec<u32>.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("a list")
        .iter()
        .map(|x| x.as_u64().expect("a token id") as u32)
        .collect()
}

/// A word-level tokenizer in `dir`: token `t<i>` is id i; text is the words joined by spaces.
pub fn write_tokenizer(dir: &std::path::Path, vocab: usize) {
    let vocab_map: serde_json::Map<String, Value> = (0..vocab)
        .map(|i| (format!("t{i}"), serde_json::json!(i)))
        .collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab_map, "unk_token": "t0"},
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).expect("write tokenizer.json");
}

/// A scratch checkpoint of fixture `name`'s architecture holding other weights (removed by
/// the caller): every router's weights negated, so tokens pick other experts, and the LM
/// head's rows rotated by one, so every token's logit is another's. A weight update to it
/// must change the answers, routes included.
pub fn other_weights(name: &str) -> PathBuf {
    use candle_core::{Device, Tensor};
    let dir = scratch_dir("other-weights");
    std::fs::copy(fixture(name).join("config.json"), dir.join("config.json")).expect("copy");
    let mut tensors =
        candle_core::safetensors::load(fixture(name).join("model.safetensors"), &Device::Cpu)
            .expect("fixture weights");
    let mut routers = 0;
    for (key, t) in tensors.iter_mut() {
        if key.ends_with(".mlp.gate.weight") {
            *t = t.neg().expect("negated");
            routers += 1;
        } else if key == "lm_head.weight" {
            let rows = t.dim(0).expect("rows");
            *t = Tensor::cat(
                &[
                    t.narrow(0, 1, rows - 1).expect("rows 1.."),
                    t.narrow(0, 0, 1).expect("row 0"),
                ],
                0,
            )
            .expect("rotated");
        }
    }
    assert!(routers > 0, "{name} has routers to negate");
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).expect("save");
    dir
}
