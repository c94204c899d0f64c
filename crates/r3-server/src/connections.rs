//! The connection layer: an accept loop over HTTP/1.1 (hyper) with the limits that keep
//! slow or idle clients from holding the server — a deadline for a request's headers that
//! also closes idle keep-alive connections, a deadline for its body, and caps on open
//! connections, in all and per client (peer IP address). At a cap, the connection that has
//! been idle longest (no request in flight: a kept-alive connection between requests, or one
//! that has not sent a complete request header yet) is closed to make room, so a flood of
//! idle or slow connections cannot lock real clients out; only when every connection has a
//! request in flight does a new one get an immediate 503 (429 past the per-client cap).
//! Clients that half-close their write side after a full request still get their answer.
//!
//! A client that goes away while its request runs is seen before the answer is written, so
//! the handler's future is dropped and the engine aborts the request (SGLang's tokenizer
//! manager polls `is_disconnected` likewise): every [`PEER_CHECK`] the socket of a
//! connection with a request in flight is peeked. A reset means the client is gone. The end
//! of its stream alone could be a half-close, so the connection's first request is probed
//! once with an interim `100 Continue` (HTTP/1.1 clients skip 1xx responses before the final
//! one): a client that closed its socket answers it with a reset, one that half-closed
//! reads on and gets its answer.

use std::collections::HashMap;
use std::future::Future;
use std::io::{ErrorKind, Write};
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::header::CONTENT_LENGTH;
use axum::http::{StatusCode, Version};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Router};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};

use super::error::ApiError;

/// Time and count limits of client connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// How long the server waits for a request's complete headers, counted from when it
    /// starts waiting: for a fresh connection and between requests on a kept-alive one,
    /// so it is also the idle keep-alive timeout. Past it the connection is closed.
    pub header_timeout: Duration,
    /// How long a request's whole body may take to arrive (past it: 408).
    pub body_timeout: Duration,
    /// Most connections open at once; past it the longest-idle connection is closed to make
    /// room, or, when every connection has a request in flight, the new one gets 503.
    pub max_connections: usize,
    /// Most connections one client (peer IP address) may hold open at once; past it that
    /// client's longest-idle connection is closed, or the new one gets 429. None: half of
    /// `max_connections`.
    pub max_connections_per_client: Option<usize>,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            max_connections: 512,
            max_connections_per_client: None,
        }
    }
}

impl ConnectionLimits {
    /// The per-client cap in force (at least one connection).
    pub fn per_client(&self) -> usize {
        self.max_connections_per_client
            .unwrap_or(self.max_connections / 2)
            .max(1)
    }
}

/// File descriptors the process keeps for itself (model and checkpoint files, the listener,
/// logs, the runtime) out of its open-file limit.
pub const RESERVED_DESCRIPTORS: u64 = 64;

/// The most connections a process with an open-file limit of `open_files` descriptors can
/// hold: the limit less [`RESERVED_DESCRIPTORS`], less an eighth for the connections that
/// are being refused or closed at any moment (each still holds its descriptor briefly).
pub fn connections_for_open_files(open_files: u64) -> usize {
    let usable = open_files.saturating_sub(RESERVED_DESCRIPTORS);
    usize::try_from(usable - usable / 8)
        .unwrap_or(usize::MAX)
        .max(1)
}

/// A refusal written without parsing the request: `status` with a JSON error body naming
/// the limit, and `connection: close`.
fn refusal(status: StatusCode, message: &str) -> Vec<u8> {
    let body = serde_json::json!({
        "error": {"message": message, "type": "server_error", "code": status.as_u16()}
    })
    .to_string();
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n{body}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes()
}

/// How long an evicted (or, at shutdown, closing) connection with no request in flight is
/// still polled before it is dropped: a request that arrives meanwhile is answered (the
/// connection then closes after it), and a kept-alive one finishes flushing.
const CLOSE_GRACE: Duration = Duration::from_millis(50);

/// How often the socket of a connection with a request in flight is checked for a client
/// that went away.
pub const PEER_CHECK: Duration = Duration::from_millis(250);

/// What a connection whose client ended its stream is probed with while its request runs
/// and no response has started.
const PROBE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// One open connection as the table sees it.
#[derive(Debug)]
struct Conn {
    ip: IpAddr,
    /// Requests dispatched and not yet fully answered.
    in_flight: AtomicUsize,
    /// Requests dispatched so far (numbers them from 1).
    dispatched: AtomicU64,
    /// The request whose response has not started (0: none): until then an interim
    /// response may still be written.
    unanswered: AtomicU64,
    /// Whether that request may get an interim response (HTTP/1.1; HTTP/1.0 knows no 1xx).
    interim_ok: AtomicBool,
    /// Told when a request is dispatched, so the connection's task starts watching its
    /// client.
    started: Notify,
    /// Milliseconds since the table's start when it last became idle (opened or answered).
    idle_since_ms: AtomicU64,
    /// Told when the table closes it to make room.
    evict: Notify,
}

/// The open connections: counts in all and per client, and which to close at a cap.
#[derive(Debug)]
struct ConnTable {
    started: Instant,
    inner: Mutex<TableInner>,
}

#[derive(Debug, Default)]
struct TableInner {
    next_id: u64,
    conns: HashMap<u64, Arc<Conn>>,
    per_ip: HashMap<IpAddr, usize>,
}

/// What the table decided about a new connection.
enum Admission {
    /// Serve it (its id and state; any connection evicted for it has been told).
    Open(u64, Arc<Conn>),
    /// Refuse it: all connections (or all of this client's) have a request in flight.
    Refuse(StatusCode, String),
}

impl ConnTable {
    fn new() -> Self {
        ConnTable {
            started: Instant::now(),
            inner: Mutex::new(TableInner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TableInner> {
        // Every update is a single insert or remove, so a poisoned table is consistent.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Admits a connection from `ip` under `limits`, evicting the longest-idle connection of
    /// the client (at its cap) or of anyone (at the total cap) when that makes room.
    fn admit(&self, ip: IpAddr, limits: &ConnectionLimits) -> Admission {
        let mut t = self.lock();
        let per_client = limits.per_client();
        if t.per_ip.get(&ip).copied().unwrap_or(0) >= per_client {
            match t.longest_idle(Some(ip)) {
                Some(id) => t.evict(id),
                None => {
                    return Admission::Refuse(
                        StatusCode::TOO_MANY_REQUESTS,
                        format!(
                            "client {ip} has {per_client} open connections with requests in \
                             flight; the limit is {per_client} per client \
                             (--max-connections-per-client)"
                        ),
                    )
                }
            }
        }
        if t.conns.len() >= limits.max_connections.max(1) {
            match t.longest_idle(None) {
                Some(id) => t.evict(id),
                None => {
                    return Admission::Refuse(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "too many open connections; retry later".into(),
                    )
                }
            }
        }
        let id = t.next_id;
        t.next_id += 1;
        let conn = Arc::new(Conn {
            ip,
            in_flight: AtomicUsize::new(0),
            dispatched: AtomicU64::new(0),
            unanswered: AtomicU64::new(0),
            interim_ok: AtomicBool::new(false),
            started: Notify::new(),
            idle_since_ms: AtomicU64::new(self.now_ms()),
            evict: Notify::new(),
        });
        t.conns.insert(id, Arc::clone(&conn));
        *t.per_ip.entry(ip).or_default() += 1;
        Admission::Open(id, conn)
    }

    /// Forgets connection `id` once it has ended (a no-op when it was evicted).
    fn remove(&self, id: u64) {
        self.lock().forget(id);
    }

    fn len(&self) -> usize {
        self.lock().conns.len()
    }
}

impl TableInner {
    /// The connection (of `ip`, when given) with no request in flight that has been idle
    /// longest; ties go to the oldest.
    fn longest_idle(&self, ip: Option<IpAddr>) -> Option<u64> {
        self.conns
            .iter()
            .filter(|(_, c)| ip.is_none_or(|ip| c.ip == ip))
            .filter(|(_, c)| c.in_flight.load(Ordering::Acquire) == 0)
            .min_by_key(|(&id, c)| (c.idle_since_ms.load(Ordering::Acquire), id))
            .map(|(&id, _)| id)
    }

    fn forget(&mut self, id: u64) -> Option<Arc<Conn>> {
        let conn = self.conns.remove(&id)?;
        if let Some(n) = self.per_ip.get_mut(&conn.ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&conn.ip);
            }
        }
        Some(conn)
    }

    /// Takes connection `id` out of the counts and tells its task to close it.
    fn evict(&mut self, id: u64) {
        if let Some(conn) = self.forget(id) {
            tracing::debug!(ip = %conn.ip, "closing the longest-idle connection to make room");
            conn.evict.notify_one();
        }
    }
}

/// A request in flight on a connection: marks it busy until dropped.
struct InFlight {
    conn: Arc<Conn>,
    table: Arc<ConnTable>,
}

impl InFlight {
    fn start(conn: &Arc<Conn>, table: &Arc<ConnTable>) -> Self {
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight {
            conn: Arc::clone(conn),
            table: Arc::clone(table),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // Stamp the idle time before the count reaches zero, so a scan never sees an idle
        // connection with a stale stamp.
        self.conn
            .idle_since_ms
            .store(self.table.now_ms(), Ordering::Release);
        self.conn.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that holds `guard` until the body is finished or dropped (a request's
/// in-flight mark, a client's admission lease).
pub(crate) struct GuardedBody<G> {
    inner: Body,
    guard: Option<G>,
}

impl<G: Send + Unpin + 'static> GuardedBody<G> {
    /// `inner`, holding `guard` until it ends.
    pub(crate) fn wrap(inner: Body, guard: G) -> Body {
        Body::new(GuardedBody {
            inner,
            guard: Some(guard),
        })
    }
}

impl<G: Unpin> HttpBody for GuardedBody<G> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.guard = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The router as one connection's hyper service: every request is marked in flight from
/// its dispatch until its response body is finished or dropped.
#[derive(Clone)]
struct TrackedService {
    inner: TowerToHyperService<Router>,
    conn: Arc<Conn>,
    table: Arc<ConnTable>,
}

type ServiceFuture =
    Pin<Box<dyn Future<Output = Result<Response, std::convert::Infallible>> + Send>>;

impl hyper::service::Service<hyper::Request<Incoming>> for TrackedService {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = ServiceFuture;

    fn call(&self, req: hyper::Request<Incoming>) -> Self::Future {
        // Marked at dispatch, synchronously: an eviction decided after this sees it busy.
        let busy = InFlight::start(&self.conn, &self.table);
        let number = self.conn.dispatched.fetch_add(1, Ordering::AcqRel) + 1;
        self.conn
            .interim_ok
            .store(req.version() == Version::HTTP_11, Ordering::Release);
        self.conn.unanswered.store(number, Ordering::Release);
        self.conn.started.notify_one();
        let conn = Arc::clone(&self.conn);
        let answer = hyper::service::Service::call(&self.inner, req);
        Box::pin(async move {
            let response = answer.await?;
            // hyper writes the head from here on (in this poll of the connection, before its
            // task can probe again): no interim response any more.
            let _ =
                conn.unanswered
                    .compare_exchange(number, 0, Ordering::AcqRel, Ordering::Acquire);
            Ok(response.map(|body| GuardedBody::wrap(body, busy)))
        })
    }
}

/// Serves `router` on `listener` with `limits` until `shutdown` completes; then stops
/// accepting, answers the requests in flight and closes every connection.
pub async fn serve_with_limits(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let table = Arc::new(ConnTable::new());
    let (stop_tx, stop_rx) = watch::channel(false);
    // Every connection task holds a clone; `recv` returns None once all have ended.
    let (alive_tx, mut alive_rx) = mpsc::channel::<()>(1);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true)
        .half_close(true);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let (id, conn) = match table.admit(peer.ip(), &limits) {
            Admission::Open(id, conn) => (id, conn),
            Admission::Refuse(status, message) => {
                tracing::warn!(%peer, open = table.len(), %message, "connection refused");
                let reply = refusal(status, &message);
                tokio::spawn(async move {
                    let _ =
                        tokio::time::timeout(Duration::from_secs(1), refuse(stream, &reply)).await;
                });
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let watch = PeerWatch::new(&stream);
        let service = TrackedService {
            // The peer address, for the per-client limits (axum's `ConnectInfo`).
            inner: TowerToHyperService::new(router.clone().layer(Extension(ConnectInfo(peer)))),
            conn: Arc::clone(&conn),
            table: Arc::clone(&table),
        };
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        let table = Arc::clone(&table);
        let stop = stop_rx.clone();
        let alive = alive_tx.clone();
        tokio::spawn(async move {
            drive(connection, &conn, watch, stop, peer).await;
            table.remove(id);
            drop(alive);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(alive_tx);
    let _ = alive_rx.recv().await;
    Ok(())
}

/// One served connection: hyper's HTTP/1.1 state machine over the socket.
type Connection = hyper::server::conn::http1::Connection<TokioIo<TcpStream>, TrackedService>;

/// Runs one connection until it ends, or until it is evicted or the server stops: then it
/// is shut down gracefully (a request in flight is answered, keep-alive is off) and dropped
/// as soon as it has no request in flight. While a request is in flight its client is
/// checked every [`PEER_CHECK`]; once it is gone the connection is dropped with the request's
/// handler, which aborts its engine requests.
async fn drive(
    connection: Connection,
    conn: &Conn,
    mut watch: PeerWatch,
    mut stop: watch::Receiver<bool>,
    peer: SocketAddr,
) {
    tokio::pin!(connection);
    let mut closing = *stop.borrow();
    if closing {
        connection.as_mut().graceful_shutdown();
    }
    // When the client is checked next; None while no request is in flight.
    let mut next_check: Option<tokio::time::Instant> = None;
    loop {
        let busy = conn.in_flight.load(Ordering::Acquire) > 0;
        next_check = match (busy, next_check) {
            (false, _) => None,
            (true, None) => Some(tokio::time::Instant::now() + PEER_CHECK),
            (true, at) => at,
        };
        let check_at = next_check.unwrap_or_else(tokio::time::Instant::now);
        tokio::select! {
            // A request was dispatched: its client is watched from the next round.
            () = conn.started.notified(), if !busy => {}
            () = tokio::time::sleep_until(check_at), if next_check.is_some() => {
                next_check = Some(check_at + PEER_CHECK);
                if let Peer::Gone = watch.check(conn) {
                    tracing::info!(
                        %peer,
                        "client went away with its request in flight; dropping the request"
                    );
                    return;
                }
            }
            result = connection.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                return;
            }
            () = conn.evict.notified(), if !closing => {
                closing = true;
                connection.as_mut().graceful_shutdown();
            }
            changed = stop.changed(), if !closing => {
                if changed.is_err() || *stop.borrow() {
                    closing = true;
                    connection.as_mut().graceful_shutdown();
                }
            }
            () = tokio::time::sleep(CLOSE_GRACE), if closing => {
                if conn.in_flight.load(Ordering::Acquire) == 0 {
                    return;
                }
            }
        }
    }
}

/// Whether a connection's client is still there.
enum Peer {
    /// Connected, or half-closed and reading (or not known otherwise).
    Present,
    /// Gone: its socket was reset.
    Gone,
}

/// Watches the client of a connection with a request in flight, through a second handle on
/// its socket (hyper owns the first and reads nothing while a request runs on a
/// connection that may be half-closed).
struct PeerWatch {
    /// None where the platform gives no second handle: nothing is checked then.
    socket: Option<std::net::TcpStream>,
    /// The request the connection was last probed for (one probe per request).
    probed: u64,
}

impl PeerWatch {
    fn new(stream: &TcpStream) -> Self {
        #[cfg(unix)]
        let socket = {
            use std::os::fd::AsFd;
            // A duplicate descriptor of the same socket, non-blocking as tokio set it; it
            // lives as long as the connection's task, which drops it with hyper's.
            stream
                .as_fd()
                .try_clone_to_owned()
                .ok()
                .map(std::net::TcpStream::from)
        };
        #[cfg(not(unix))]
        let socket = {
            let _ = stream;
            None
        };
        PeerWatch { socket, probed: 0 }
    }

    /// Peeks at the socket (consuming nothing): a reset means the client is gone; the end
    /// of its stream while no response has started gets the request's one probe.
    fn check(&mut self, conn: &Conn) -> Peer {
        let Some(socket) = &self.socket else {
            return Peer::Present;
        };
        match peek_one(socket) {
            // The end of the client's stream.
            Ok(0) => {}
            // A pipelined request, or nothing yet.
            Ok(_) => return Peer::Present,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                return Peer::Present
            }
            Err(_) => return Peer::Gone,
        }
        // Once the stream has ended a read reports its end, not a reset that came after:
        // the socket's pending error does.
        if reset(socket) {
            return Peer::Gone;
        }
        // The client's stream ended: gone, or half-closed and waiting for its answer.
        let request = conn.unanswered.load(Ordering::Acquire);
        // Only a connection's first request is probed: behind a later one hyper may still
        // hold bytes of the response before it (it reads the next request once a response is
        // buffered, not sent), and the probe, written beside hyper, would land inside them.
        // Clients that half-close send one request per connection.
        if request != 1 || request == self.probed || !conn.interim_ok.load(Ordering::Acquire) {
            return Peer::Present;
        }
        match (&*socket).write(PROBE) {
            Ok(n) if n == PROBE.len() => self.probed = request,
            // Nothing written: tried again at the next check.
            Ok(0) => return Peer::Present,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                return Peer::Present
            }
            // Part of it: the connection can carry no answer any more. Or a write error:
            // the client is gone.
            Ok(_) | Err(_) => return Peer::Gone,
        }
        // A closed socket answers the probe with a reset: on loopback at once, else within
        // a round trip (seen at a later check).
        if reset(socket) {
            Peer::Gone
        } else {
            Peer::Present
        }
    }
}

/// Whether `socket` holds an error (a reset by its peer); taking it.
fn reset(socket: &std::net::TcpStream) -> bool {
    !matches!(socket.take_error(), Ok(None))
}

/// Peeks at one byte of `socket` without waiting.
fn peek_one(socket: &std::net::TcpStream) -> std::io::Result<usize> {
    let mut byte = [0u8; 1];
    socket.peek(&mut byte)
}

/// Answers a refused connection and closes it: write the answer, half-close, then read
/// what the client sent until it closes (closing with its request unread would reset the
/// connection, and the reset can discard the answer before the client reads it).
async fn refuse(stream: TcpStream, reply: &[u8]) -> std::io::Result<()> {
    let mut sent = 0;
    while sent < reply.len() {
        stream.writable().await?;
        match stream.try_write(&reply[sent..]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    let std_stream = stream.into_std()?;
    std_stream.shutdown(std::net::Shutdown::Write)?;
    let stream = tokio::net::TcpStream::from_std(std_stream)?;
    let mut sink = [0u8; 4096];
    loop {
        stream.readable().await?;
        match stream.try_read(&mut sink) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}

/// Middleware: reads the request body within `body_timeout` (408 past it) and hands the
/// handler the buffered body. A body larger than the server's limit is refused with 413
/// without waiting for the rest.
pub async fn body_deadline(
    State((timeout, max_bytes)): State<(Duration, usize)>,
    req: Request,
    next: Next,
) -> Response {
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > max_bytes as u64) {
        return ApiError::too_large(format!("the request body is larger than {max_bytes} bytes"))
            .into_response();
    }
    let (parts, body) = req.into_parts();
    let bytes = match tokio::time::timeout(timeout, axum::body::to_bytes(body, max_bytes)).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(e)) if is_length_limit(&e) => {
            return ApiError::too_large(format!(
                "the request body is larger than {max_bytes} bytes"
            ))
            .into_response()
        }
        Ok(Err(e)) => {
            return ApiError::bad_request(format!("cannot read the request body: {e}"))
                .into_response()
        }
        Err(_) => {
            return ApiError {
                status: StatusCode::REQUEST_TIMEOUT,
                message: format!(
                    "the request body did not arrive within {} s",
                    timeout.as_secs_f64()
                ),
            }
            .into_response()
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// Whether a body error is the size limit (http-body-util's `LengthLimitError`, reached
/// through axum's error wrapper).
fn is_length_limit(e: &axum::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.to_string().contains("length limit exceeded") {
            return true;
        }
        cause = c.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_declare_their_body_length() {
        for status in [
            StatusCode::SERVICE_UNAVAILABLE,
            StatusCode::TOO_MANY_REQUESTS,
        ] {
            let raw = refusal(status, "too many open connections; retry later");
            let text = String::from_utf8(raw).expect("ascii");
            let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
            assert!(head.starts_with(&format!("HTTP/1.1 {} ", status.as_u16())));
            assert!(head.contains(&format!("content-length: {}", body.len())));
            let json: serde_json::Value = serde_json::from_str(body).expect("json body");
            assert_eq!(json["error"]["code"], status.as_u16());
        }
    }

    #[test]
    fn the_open_file_limit_bounds_the_connections() {
        // 1024 descriptors: 960 after the reserve, less an eighth for closing ones.
        assert_eq!(connections_for_open_files(1024), 840);
        assert_eq!(connections_for_open_files(10), 1);
    }

    fn limits(max: usize, per_client: usize) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: max,
            max_connections_per_client: Some(per_client),
            ..ConnectionLimits::default()
        }
    }

    fn opened(a: Admission) -> (u64, Arc<Conn>) {
        match a {
            Admission::Open(id, conn) => (id, conn),
            Admission::Refuse(status, m) => panic!("refused with {status}: {m}"),
        }
    }

    #[test]
    fn at_the_cap_the_longest_idle_connection_makes_room() {
        let table = Arc::new(ConnTable::new());
        let a = IpAddr::from([127, 0, 0, 1]);
        let b = IpAddr::from([127, 0, 0, 2]);
        let caps = limits(3, 3);
        let (_, first) = opened(table.admit(a, &caps));
        let (_, second) = opened(table.admit(a, &caps));
        let (_, third) = opened(table.admit(b, &caps));
        // The first is busy; the second became idle before the third.
        let busy = InFlight::start(&first, &table);
        second.idle_since_ms.store(1, Ordering::Release);
        third.idle_since_ms.store(2, Ordering::Release);
        let (_, fourth) = opened(table.admit(b, &caps));
        assert_eq!(table.len(), 3);
        // The second was told to close (its permit is stored), the others were not.
        tokio_test_notified(&second.evict, true);
        tokio_test_notified(&third.evict, false);
        tokio_test_notified(&first.evict, false);
        // All busy: the next connection is refused with 503.
        let _b3 = InFlight::start(&third, &table);
        let _b4 = InFlight::start(&fourth, &table);
        match table.admit(a, &caps) {
            Admission::Refuse(status, _) => assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE),
            Admission::Open(..) => panic!("opened past a cap of busy connections"),
        }
        // The first finishes its request: it is idle now and makes room.
        drop(busy);
        opened(table.admit(a, &caps));
        tokio_test_notified(&first.evict, true);
    }

    #[test]
    fn a_client_at_its_cap_makes_room_from_its_own_connections_only() {
        let table = Arc::new(ConnTable::new());
        let a = IpAddr::from([127, 0, 0, 1]);
        let b = IpAddr::from([127, 0, 0, 2]);
        let caps = limits(10, 2);
        let (_, other) = opened(table.admit(b, &caps));
        other.idle_since_ms.store(0, Ordering::Release);
        let (_, a1) = opened(table.admit(a, &caps));
        let (_, a2) = opened(table.admit(a, &caps));
        let _busy = InFlight::start(&a2, &table);
        a1.idle_since_ms.store(5, Ordering::Release);
        let (_, a3) = opened(table.admit(a, &caps));
        tokio_test_notified(&a1.evict, true);
        tokio_test_notified(&other.evict, false);
        // Both of a's connections busy now: refused with 429, b untouched.
        let _busy3 = InFlight::start(&a3, &table);
        match table.admit(a, &caps) {
            Admission::Refuse(status, m) => {
                assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
                assert!(m.contains("--max-connections-per-client"), "{m}");
            }
            Admission::Open(..) => panic!("opened past the per-client cap"),
        }
        tokio_test_notified(&other.evict, false);
        assert_eq!(table.len(), 3);
    }

    /// Whether `notify` holds a stored permit (it was told to close), without waiting.
    fn tokio_test_notified(notify: &Notify, expected: bool) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let got = rt.block_on(async {
            tokio::time::timeout(Duration::from_millis(1), notify.notified())
                .await
                .is_ok()
        });
        assert_eq!(got, expected);
    }
}
