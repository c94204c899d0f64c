//! Part (e), flood: more idle connections than the server's connection limit, opened from
//! several loopback addresses and reopened soon after the server closes them (an attacker
//! who keeps the flood up), are held while real clients are served. The real clients'
//! failures and latency are counted, and how often the server closed a flood socket to make
//! room (its header timeout is far longer than the part, so every close is an eviction).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use r3_fleet::http::JsonClient;
use serde_json::Value;
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

use super::slowloris::closed;
use super::traffic::{run_clients, Answer};

/// Loopback source addresses the flood comes from (127.0.0.2 onwards), so it meets the
/// total connection limit and not only one client's cap; real clients use 127.0.0.1.
pub const FLOOD_SOURCES: u8 = 4;

/// How long a flood socket waits after the server closed it before it reconnects.
const REOPEN_DELAY: Duration = Duration::from_millis(500);

/// Figures of the flood part.
#[derive(Debug, Clone)]
pub struct FloodFigures {
    /// Idle sockets the flood keeps open (each reopened when closed).
    pub sockets: usize,
    /// Connections the flood opened, reopens included.
    pub opened: usize,
    /// Connects that failed.
    pub connect_failures: usize,
    /// Flood connections the server closed to make room.
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

#[derive(Debug, Default)]
struct Counts {
    opened: AtomicUsize,
    connect_failures: AtomicUsize,
    closed_by_server: AtomicUsize,
}

/// A connection to `server` from loopback address `source` (any local address when the
/// system will not bind it).
async fn connect_from(source: IpAddr, server: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    if socket.bind(SocketAddr::new(source, 0)).is_err() {
        return TcpStream::connect(server).await;
    }
    socket.connect(server).await
}

/// Resolves once the server has closed `s`.
async fn wait_closed(s: &TcpStream) {
    loop {
        if s.readable().await.is_err() || closed(s) {
            return;
        }
    }
}

/// One flood socket: connects, sends nothing, and reconnects after the server closes it,
/// until `deadline`.
async fn idle_socket(source: IpAddr, server: SocketAddr, deadline: Instant, counts: Arc<Counts>) {
    while Instant::now() < deadline {
        let stream = match connect_from(source, server).await {
            Ok(s) => s,
            Err(_) => {
                counts.connect_failures.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep_until(deadline.min(Instant::now() + REOPEN_DELAY)).await;
                continue;
            }
        };
        counts.opened.fetch_add(1, Ordering::Relaxed);
        tokio::select! {
            () = wait_closed(&stream) => {
                counts.closed_by_server.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep_until(deadline.min(Instant::now() + REOPEN_DELAY)).await;
            }
            () = tokio::time::sleep_until(deadline) => return,
        }
    }
}

/// Holds `sockets` idle connections to `addr` (reopened when closed) while `clients` real
/// clients run for `duration`.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    client: &JsonClient,
    addr: SocketAddr,
    url: &str,
    pool: Arc<Vec<Value>>,
    reference: &[Answer],
    sockets: usize,
    clients: usize,
    duration: Duration,
    seed: u64,
) -> FloodFigures {
    let counts = Arc::new(Counts::default());
    // The flood is up before the real clients start and lasts until they stop.
    let lead = Duration::from_secs(1);
    let deadline = Instant::now() + lead + duration;
    let mut flood = Vec::with_capacity(sockets);
    for i in 0..sockets {
        let source = IpAddr::V4(Ipv4Addr::new(
            127,
            0,
            0,
            2 + (i % FLOOD_SOURCES as usize) as u8,
        ));
        flood.push(tokio::spawn(idle_socket(
            source,
            addr,
            deadline,
            Arc::clone(&counts),
        )));
    }
    tokio::time::sleep(lead).await;
    let t = run_clients(client, url, pool, clients, duration, seed).await;
    for task in flood {
        let _ = task.await;
    }
    FloodFigures {
        sockets,
        opened: counts.opened.load(Ordering::Relaxed),
        connect_failures: counts.connect_failures.load(Ordering::Relaxed),
        closed_by_server: counts.closed_by_server.load(Ordering::Relaxed),
        clients,
        sent: t.sent,
        failures: t.failures,
        mismatches: t.mismatches(reference),
        p50_ms: t.quantile_ms(0.5),
        p99_ms: t.quantile_ms(0.99),
    }
}
