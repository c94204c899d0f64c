//! Per-request and per-client admission limits on the generating endpoints (`/generate`,
//! `/v1/completions`, `/v1/chat/completions`): a request may hold at most
//! `max_tokens_per_request` tokens in flight (prompts + n × max new tokens, see
//! [`super::request_tokens`]; more: 413), and one client — its peer IP address, or its API
//! key when the server has one — at most `max_requests_per_client` requests and
//! `max_tokens_per_client` tokens in flight together (more: 429 naming the limit).
//!
//! A request's share is held by a [`Lease`] that travels with its response body, so it is
//! given back when the response has been sent — for a stream, when its last event is out —
//! or when it is dropped unsent (client gone, error, abort).

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::connections::GuardedBody;
use super::error::ApiError;
use super::request_tokens::{tokens_in_flight, TokenContext, GENERATING_PATHS};
use super::AppState;

/// Default `max_tokens_per_request`, in model contexts (`max_position_embeddings`).
pub const DEFAULT_CONTEXTS_PER_REQUEST: usize = 64;
/// Default `max_tokens_per_client`, in model contexts.
pub const DEFAULT_CONTEXTS_PER_CLIENT: usize = 256;
/// Default `max_requests_per_client`.
pub const DEFAULT_REQUESTS_PER_CLIENT: usize = 1024;

/// The admission limits as configured (token limits may be derived from the context).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientLimits {
    /// Most tokens one request may hold in flight; None: [`DEFAULT_CONTEXTS_PER_REQUEST`] ×
    /// the context; Some(0): no limit.
    pub max_tokens_per_request: Option<usize>,
    /// Most requests one client may have in flight; 0: no limit.
    pub max_requests_per_client: usize,
    /// Most tokens one client's requests may hold in flight together; None:
    /// [`DEFAULT_CONTEXTS_PER_CLIENT`] × the context; Some(0): no limit.
    pub max_tokens_per_client: Option<usize>,
}

impl Default for ClientLimits {
    fn default() -> Self {
        ClientLimits {
            max_tokens_per_request: None,
            max_requests_per_client: DEFAULT_REQUESTS_PER_CLIENT,
            max_tokens_per_client: None,
        }
    }
}

/// The limits in force for a model with `context` positions (`usize::MAX`: no limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedLimits {
    /// Tokens per request.
    pub tokens_per_request: usize,
    /// Requests per client.
    pub requests_per_client: usize,
    /// Tokens per client.
    pub tokens_per_client: usize,
}

impl ClientLimits {
    /// The limits in force for a model whose context is `context` tokens.
    pub fn resolve(&self, context: usize) -> ResolvedLimits {
        let tokens = |set: Option<usize>, contexts: usize| match set {
            Some(0) => usize::MAX,
            Some(n) => n,
            None => context.max(1).saturating_mul(contexts),
        };
        ResolvedLimits {
            tokens_per_request: tokens(self.max_tokens_per_request, DEFAULT_CONTEXTS_PER_REQUEST),
            requests_per_client: match self.max_requests_per_client {
                0 => usize::MAX,
                n => n,
            },
            tokens_per_client: tokens(self.max_tokens_per_client, DEFAULT_CONTEXTS_PER_CLIENT),
        }
    }
}

/// Who a request counts against.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClientId {
    /// The peer's IP address (every port of one host is one client).
    Peer(IpAddr),
    /// A hash of the bearer key (the key itself is never kept or shown).
    ApiKey(u64),
    /// A request served without a connection address (in-process routers).
    Unknown,
}

impl std::fmt::Display for ClientId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientId::Peer(ip) => write!(f, "client {ip}"),
            ClientId::ApiKey(_) => f.write_str("this API key"),
            ClientId::Unknown => f.write_str("this client"),
        }
    }
}

/// Requests and tokens in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Requests admitted and not yet finished.
    pub requests: usize,
    /// Their tokens.
    pub tokens: usize,
}

/// What every client holds in flight now; cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct ClientLedger(Arc<Mutex<HashMap<ClientId, Usage>>>);

impl ClientLedger {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ClientId, Usage>> {
        // A panic while holding the lock leaves the counts consistent (updates are single
        // assignments), so a poisoned lock is still usable.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// All clients together.
    pub fn total(&self) -> Usage {
        self.lock().values().fold(Usage::default(), |a, u| Usage {
            requests: a.requests + u.requests,
            tokens: a.tokens.saturating_add(u.tokens),
        })
    }

    /// One client's usage.
    pub fn usage(&self, client: &ClientId) -> Usage {
        self.lock().get(client).copied().unwrap_or_default()
    }

    /// Admits a request of `tokens` for `client`, or says which per-client limit it breaks.
    pub fn admit(
        &self,
        client: ClientId,
        tokens: usize,
        limits: &ResolvedLimits,
    ) -> Result<Lease, ApiError> {
        let mut map = self.lock();
        let now = map.get(&client).copied().unwrap_or_default();
        if now.requests >= limits.requests_per_client {
            return Err(too_many(format!(
                "{client} already has {} requests in flight; the limit is {} per client \
                 (--max-requests-per-client)",
                now.requests, limits.requests_per_client
            )));
        }
        if now.tokens.saturating_add(tokens) > limits.tokens_per_client {
            return Err(too_many(format!(
                "{client} has {} tokens in flight and this request adds up to {tokens}; the \
                 limit is {} per client (--max-tokens-per-client)",
                now.tokens, limits.tokens_per_client
            )));
        }
        let entry = map.entry(client.clone()).or_default();
        entry.requests += 1;
        entry.tokens = entry.tokens.saturating_add(tokens);
        Ok(Lease {
            ledger: self.clone(),
            client,
            tokens,
        })
    }

    fn release(&self, client: &ClientId, tokens: usize) {
        let mut map = self.lock();
        if let Some(u) = map.get_mut(client) {
            u.requests = u.requests.saturating_sub(1);
            u.tokens = u.tokens.saturating_sub(tokens);
            if u.requests == 0 {
                map.remove(client);
            }
        }
    }
}

fn too_many(message: String) -> ApiError {
    ApiError {
        status: StatusCode::TOO_MANY_REQUESTS,
        message,
    }
}

/// One admitted request's share of its client's limits; given back on drop.
#[derive(Debug)]
pub struct Lease {
    ledger: ClientLedger,
    client: ClientId,
    tokens: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.ledger.release(&self.client, self.tokens);
    }
}

/// The admission middleware's state: the app (model context, tokenizer, request limits),
/// the limits in force and the ledger.
#[derive(Clone)]
pub struct Admission {
    app: AppState,
    limits: ResolvedLimits,
    ledger: ClientLedger,
    keyed: bool,
}

impl Admission {
    /// Admission for `app` under `limits`, counting in `ledger`.
    pub fn new(app: AppState, limits: &ClientLimits, ledger: ClientLedger) -> Self {
        let resolved = limits.resolve(app.summary().max_position_embeddings);
        let keyed = app.config().security.api_key.is_some();
        Admission {
            app,
            limits: resolved,
            ledger,
            keyed,
        }
    }

    /// The client a request counts against: its bearer key when the server has an API key,
    /// else its peer address.
    fn client_of(&self, req: &Request) -> ClientId {
        if self.keyed {
            if let Some(key) = req
                .headers()
                .get(AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
            {
                let mut h = DefaultHasher::new();
                key.trim().hash(&mut h);
                return ClientId::ApiKey(h.finish());
            }
        }
        match req.extensions().get::<ConnectInfo<SocketAddr>>() {
            Some(ConnectInfo(addr)) => ClientId::Peer(addr.ip()),
            None => ClientId::Unknown,
        }
    }
}

/// Middleware: counts a generating request against the per-request and per-client limits
/// (413 / 429 past them) and holds its share until its response is finished or dropped.
/// Runs after the body is buffered, so reading it here costs no waiting.
pub async fn admit(State(gate): State<Admission>, req: Request, next: Next) -> Response {
    if req.method() != Method::POST || !GENERATING_PATHS.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    let client = gate.client_of(&req);
    let path = req.uri().path().to_string();
    let (parts, body) = req.into_parts();
    let max_body = gate.app.limits().max_body_bytes;
    let bytes = match axum::body::to_bytes(body, max_body).await {
        Ok(b) => b,
        Err(e) => {
            return ApiError::bad_request(format!("cannot read the request body: {e}"))
                .into_response()
        }
    };
    let tokens = match serde_json::from_slice::<Value>(&bytes) {
        Ok(v) => {
            let ctx = TokenContext {
                text: gate.app.text(),
                limits: gate.app.limits(),
                context: gate.app.summary().max_position_embeddings,
            };
            tokens_in_flight(&path, &v, &ctx)
        }
        Err(_) => 0,
    };
    if tokens > gate.limits.tokens_per_request {
        return ApiError::too_large(format!(
            "the request may hold {tokens} tokens in flight (prompt + n × max new tokens); \
             the limit is {} per request (--max-tokens-per-request)",
            gate.limits.tokens_per_request
        ))
        .into_response();
    }
    let lease = match gate.ledger.admit(client, tokens, &gate.limits) {
        Ok(lease) => lease,
        Err(e) => {
            tracing::debug!(message = %e.message, "request refused by a per-client limit");
            return e.into_response();
        }
    };
    let response = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    let (parts, body) = response.into_parts();
    Response::from_parts(parts, GuardedBody::wrap(body, lease))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_derive_from_the_context_and_zero_means_no_limit() {
        let r = ClientLimits::default().resolve(128);
        assert_eq!(r.tokens_per_request, 128 * DEFAULT_CONTEXTS_PER_REQUEST);
        assert_eq!(r.tokens_per_client, 128 * DEFAULT_CONTEXTS_PER_CLIENT);
        assert_eq!(r.requests_per_client, DEFAULT_REQUESTS_PER_CLIENT);
        let off = ClientLimits {
            max_tokens_per_request: Some(0),
            max_requests_per_client: 0,
            max_tokens_per_client: Some(0),
        }
        .resolve(128);
        assert_eq!(off.tokens_per_request, usize::MAX);
        assert_eq!(off.requests_per_client, usize::MAX);
        assert_eq!(off.tokens_per_client, usize::MAX);
    }

    #[test]
    fn leases_count_per_client_and_are_given_back_on_drop() {
        let ledger = ClientLedger::default();
        let limits = ResolvedLimits {
            tokens_per_request: 100,
            requests_per_client: 2,
            tokens_per_client: 50,
        };
        let a = ClientId::Peer(IpAddr::from([10, 0, 0, 1]));
        let b = ClientId::Peer(IpAddr::from([10, 0, 0, 2]));
        let first = ledger.admit(a.clone(), 20, &limits).expect("first fits");
        let second = ledger.admit(a.clone(), 20, &limits).expect("second fits");
        // A third request from `a` breaks the request count, whatever its size.
        let e = ledger
            .admit(a.clone(), 1, &limits)
            .expect_err("third refused");
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(
            e.message.contains("--max-requests-per-client"),
            "{}",
            e.message
        );
        // Another client is counted apart.
        let other = ledger.admit(b.clone(), 45, &limits).expect("b fits");
        drop(second);
        // 20 + 31 > 50 tokens for `a`.
        let e = ledger
            .admit(a.clone(), 31, &limits)
            .expect_err("tokens refused");
        assert!(
            e.message.contains("--max-tokens-per-client"),
            "{}",
            e.message
        );
        assert_eq!(
            ledger.usage(&a),
            Usage {
                requests: 1,
                tokens: 20
            }
        );
        drop(first);
        drop(other);
        assert_eq!(ledger.total(), Usage::default());
    }
}
