//! The connection layer: an accept loop over HTTP/1.1 (hyper) with the limits that keep
//! slow or idle clients from holding the server — a deadline for a request's headers that
//! also closes idle keep-alive connections, a deadline for its body, and a cap on open
//! connections (past it a connection gets an immediate 503 and is closed). Clients that
//! half-close their write side after a full request still get their answer.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::header::CONTENT_LENGTH;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

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
    /// Most connections open at once; one more gets 503 and is closed.
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            max_connections: 512,
        }
    }
}

/// The answer to a connection over the cap, written without parsing its request.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
connection: close\r\ncontent-length: 95\r\n\r\n\
{\"error\":{\"message\":\"too many open connections; retry later\",\"type\":\"server_error\",\"code\":503}}";

/// Serves `router` on `listener` with `limits` until `shutdown` completes; then stops
/// accepting and waits for open requests to be answered.
pub async fn serve_with_limits(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
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
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::warn!(%peer, max = limits.max_connections, "connection refused: too many open");
            tokio::spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(1), refuse_busy(stream)).await;
            });
            continue;
        };
        let _ = stream.set_nodelay(true);
        // The peer address, for the per-client limits (axum's `ConnectInfo`).
        let service = TowerToHyperService::new(router.clone().layer(Extension(ConnectInfo(peer))));
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Answers 503 on a connection over the cap and closes it: write the answer, half-close,
/// then read what the client sent until it closes (closing with its request unread would
/// reset the connection, and the reset can discard the answer before the client reads it).
async fn refuse_busy(stream: tokio::net::TcpStream) -> std::io::Result<()> {
    let mut sent = 0;
    while sent < BUSY.len() {
        stream.writable().await?;
        match stream.try_write(&BUSY[sent..]) {
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
    use super::BUSY;

    #[test]
    fn busy_reply_declares_its_body_length() {
        let text = std::str::from_utf8(BUSY).expect("ascii");
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let json: serde_json::Value = serde_json::from_str(body).expect("json body");
        assert_eq!(json["error"]["code"], 503);
    }
}
