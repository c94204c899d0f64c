//! Part (b), slowloris: hundreds of connections that never finish a request — idle ones,
//! ones that send half a header block and then one more header line a second, ones that
//! send headers and half a body — are held open while real clients keep being served. The
//! real clients' failures and latency are counted, and how many slow connections the server
//! closed (its header and body timeouts).

use std::sync::Arc;
use std::time::Duration;

use r3_fleet::http::JsonClient;
use serde_json::Value;
use tokio::net::TcpStream;

use super::traffic::{run_clients, Answer};

/// Figures of the slowloris part.
#[derive(Debug, Clone)]
pub struct SlowlorisFigures {
    /// Slow connections opened.
    pub opened: usize,
    /// Slow connections that could not be opened.
    pub connect_failures: usize,
    /// Slow connections the server had closed by the end.
    pub closed_by_server: usize,
    /// Real clients.
    pub clients: usize,
    /// Real requests sent.
    pub sent: usize,
    /// Real requests without a valid answer.
    pub failures: usize,
    /// Real answers that differ from the reference.
    pub mismatches: usize,
    /// Median latency of real requests, ms.
    pub p50_ms: f64,
    /// 99th percentile latency of real requests, ms.
    pub p99_ms: f64,
}

/// How a slow connection misbehaves.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Idle,
    HalfHeader,
    HalfBody,
}

/// One slow connection: opens, sends its partial request, then (half-header) dribbles a
/// header line a second until `hold` has passed. Returns whether it was opened and whether
/// the server closed it.
async fn slow_connection(addr: String, kind: Kind, hold: Duration) -> (bool, bool) {
    let Ok(s) = TcpStream::connect(&addr).await else {
        return (false, false);
    };
    let head = format!("POST /generate HTTP/1.1\r\nHost: {addr}\r\n");
    let sent = match kind {
        Kind::Idle => Ok(()),
        Kind::HalfHeader => write_all(&s, head.as_bytes()).await,
        Kind::HalfBody => {
            let req = format!(
                "{head}Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"input_ids\": ["
            );
            write_all(&s, req.as_bytes()).await
        }
    };
    if sent.is_err() {
        return (true, true);
    }
    let deadline = tokio::time::Instant::now() + hold;
    let mut k = 0u64;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if let Kind::HalfHeader = kind {
            k += 1;
            if write_all(&s, format!("X-Slow-{k}: 1\r\n").as_bytes())
                .await
                .is_err()
            {
                return (true, true);
            }
        }
        if closed(&s) {
            return (true, true);
        }
    }
    (true, closed(&s))
}

/// Writes all of `data` (the CLI's tokio has no `io-util`, so no `AsyncWriteExt`).
async fn write_all(s: &TcpStream, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        s.writable().await?;
        match s.try_write(data) {
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Whether the peer has closed the connection (a read sees end of stream or an error).
pub(super) fn closed(s: &TcpStream) -> bool {
    let mut buf = [0u8; 512];
    loop {
        match s.try_read(&mut buf) {
            Ok(0) => return true,
            // The server's 408 answer to a slow body: keep reading to the close.
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// Holds `slow` slow connections to `addr` while `clients` real clients run for `duration`.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    client: &JsonClient,
    addr: &str,
    url: &str,
    pool: Arc<Vec<Value>>,
    reference: &[Answer],
    slow: usize,
    clients: usize,
    duration: Duration,
    seed: u64,
) -> SlowlorisFigures {
    let kinds = [Kind::Idle, Kind::HalfHeader, Kind::HalfBody];
    let mut holders = Vec::with_capacity(slow);
    for i in 0..slow {
        holders.push(tokio::spawn(slow_connection(
            addr.to_string(),
            kinds[i % kinds.len()],
            duration,
        )));
    }
    // Let the slow connections take their places before the real clients start.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t = run_clients(client, url, pool, clients, duration, seed).await;
    let (mut opened, mut connect_failures, mut closed_by_server) = (0, 0, 0);
    for h in holders {
        match h.await {
            Ok((true, was_closed)) => {
                opened += 1;
                closed_by_server += usize::from(was_closed);
            }
            _ => connect_failures += 1,
        }
    }
    let mismatches = t.mismatches(reference);
    SlowlorisFigures {
        opened,
        connect_failures,
        closed_by_server,
        clients,
        sent: t.sent,
        failures: t.failures,
        mismatches,
        p50_ms: t.quantile_ms(0.5),
        p99_ms: t.quantile_ms(0.99),
    }
}
