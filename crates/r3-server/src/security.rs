//! Who may call the server and from where: bearer keys (`--api-key` for every endpoint but
//! `/health*`, `--admin-api-key` for the control endpoints, as SGLang does), cross-site
//! protection (requests carrying an `Origin` header are refused unless the origin is listed;
//! a `Host` that is a DNS name other than `localhost` or a listed host is refused, which
//! defeats DNS rebinding) and the JSON-only rule for POST bodies (a browser form or a
//! `text/plain` "simple request" cannot reach a handler).

use axum::extract::{Request, State};
use axum::http::header::{
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN,
    AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, HOST, ORIGIN, TRANSFER_ENCODING, VARY,
};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;

/// Access rules of the server (all open when nothing is set, except cross-site requests).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SecurityConfig {
    /// Bearer key every endpoint except `/health*` requires (SGLang's `--api-key`).
    pub api_key: Option<String>,
    /// Bearer key the control endpoints require (weight updates, abort, pause, continue,
    /// flush); when set, `api_key` does not open them.
    pub admin_api_key: Option<String>,
    /// Origins (`scheme://host[:port]`, exactly as browsers send them) whose requests are
    /// served; `*` allows every origin. Requests with any other `Origin` get 403.
    pub allowed_origins: Vec<String>,
    /// Host names (without port) accepted in the `Host` header besides `localhost` and IP
    /// literals; `*` accepts every host.
    pub allowed_hosts: Vec<String>,
}

impl std::fmt::Debug for SecurityConfig {
    /// Says whether keys are set, never what they are (configs end up in logs).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecurityConfig")
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .field(
                "admin_api_key",
                &self.admin_api_key.as_ref().map(|_| "<set>"),
            )
            .field("allowed_origins", &self.allowed_origins)
            .field("allowed_hosts", &self.allowed_hosts)
            .finish()
    }
}

/// The endpoints that change what the server serves or cut other clients' requests.
pub const ADMIN_PATHS: &[&str] = &[
    "/update_weights_from_disk",
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/release_memory_occupation",
    "/resume_memory_occupation",
];

/// Which key a request needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Needs {
    Nothing,
    ApiKey,
    AdminKey,
}

impl SecurityConfig {
    fn needs(&self, method: &Method, path: &str) -> Needs {
        // As SGLang: liveness probes and CORS preflights carry no secrets.
        if method == Method::OPTIONS || path.starts_with("/health") {
            return Needs::Nothing;
        }
        if ADMIN_PATHS.contains(&path) && self.admin_api_key.is_some() {
            return Needs::AdminKey;
        }
        if self.api_key.is_some() {
            Needs::ApiKey
        } else {
            Needs::Nothing
        }
    }

    /// Checks the `Authorization` header against the key the endpoint needs.
    fn check_key(&self, method: &Method, path: &str, headers: &HeaderMap) -> Result<(), ApiError> {
        let key = match self.needs(method, path) {
            Needs::Nothing => return Ok(()),
            Needs::ApiKey => self.api_key.as_deref(),
            Needs::AdminKey => self.admin_api_key.as_deref(),
        };
        let given = headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        match (key, given) {
            (Some(key), Some(token)) if constant_time_eq(key.as_bytes(), token.as_bytes()) => {
                Ok(())
            }
            _ => Err(ApiError {
                status: StatusCode::UNAUTHORIZED,
                message: "Unauthorized: a valid `Authorization: Bearer <key>` header is required"
                    .into(),
            }),
        }
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        self.allowed_origins
            .iter()
            .any(|o| o == "*" || o.eq_ignore_ascii_case(origin))
    }

    /// IP literals cannot be rebound (a browser sends one only to that address) and
    /// `localhost` resolves locally; any other name must be listed.
    fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host);
        if name.parse::<std::net::IpAddr>().is_ok()
            || name.eq_ignore_ascii_case("localhost")
            || name.to_ascii_lowercase().ends_with(".localhost")
        {
            return true;
        }
        self.allowed_hosts
            .iter()
            .any(|h| h == "*" || h.eq_ignore_ascii_case(name))
    }
}

/// The host part of a `Host` header value: without the port, IPv6 brackets removed.
fn host_name(host: &str) -> &str {
    let host = host.trim();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name,
        _ => host,
    }
}

/// Compares secrets without returning early on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether a request declares a body (a length above zero, or a chunked one).
fn has_body(headers: &HeaderMap) -> bool {
    if headers.contains_key(TRANSFER_ENCODING) {
        return true;
    }
    headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|n| n > 0)
}

/// Whether the `Content-Type` is `application/json` (any parameters, any case).
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

fn forbidden(message: &str) -> ApiError {
    ApiError {
        status: StatusCode::FORBIDDEN,
        message: message.into(),
    }
}

/// Checks one request against the rules, in the order that reveals least: where it comes
/// from (Host, Origin), then the key, then the body's media type.
fn check(cfg: &SecurityConfig, req: &Request) -> Result<(), ApiError> {
    let headers = req.headers();
    if let Some(host) = headers.get(HOST) {
        let ok = host.to_str().is_ok_and(|h| cfg.host_allowed(h));
        if !ok {
            // The client sees a 403; the operator of a server reached by a service name
            // (Kubernetes, Docker) learns here which name to list.
            tracing::warn!(host = ?host, "refused a request whose Host is a DNS name not listed in --allowed-hosts (DNS-rebinding guard); list the name to serve it");
            return Err(forbidden(
                "this Host is not served (a DNS name must be localhost or listed in --allowed-hosts)",
            ));
        }
    }
    if let Some(origin) = headers.get(ORIGIN) {
        let ok = origin.to_str().is_ok_and(|o| cfg.origin_allowed(o));
        if !ok {
            return Err(forbidden(
                "cross-origin requests are refused (list the origin in --allowed-origins)",
            ));
        }
    }
    cfg.check_key(req.method(), req.uri().path(), headers)?;
    if req.method() == Method::POST && has_body(headers) && !is_json(headers) {
        return Err(ApiError {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            message: "POST bodies must be sent with `Content-Type: application/json`".into(),
        });
    }
    Ok(())
}

/// The middleware: refuses what [`SecurityConfig`] forbids, answers CORS preflights of
/// allowed origins, and marks responses to allowed origins so their browsers may read them.
pub async fn guard(
    State(cfg): State<std::sync::Arc<SecurityConfig>>,
    req: Request,
    next: Next,
) -> Response {
    if let Err(e) = check(&cfg, &req) {
        return e.into_response();
    }
    let origin = req.headers().get(ORIGIN).cloned();
    let preflight = req.method() == Method::OPTIONS && origin.is_some();
    let mut response = if preflight {
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(
            ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST"),
        );
        h.insert(
            ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        r
    } else {
        next.run(req).await
    };
    if let Some(origin) = origin {
        let h = response.headers_mut();
        h.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        h.insert(VARY, HeaderValue::from_static("Origin"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(api: Option<&str>, admin: Option<&str>) -> SecurityConfig {
        SecurityConfig {
            api_key: api.map(str::to_string),
            admin_api_key: admin.map(str::to_string),
            ..SecurityConfig::default()
        }
    }

    #[test]
    fn key_levels_follow_sglang() {
        let post = Method::POST;
        let both = keys(Some("a"), Some("b"));
        assert_eq!(both.needs(&post, "/generate"), Needs::ApiKey);
        assert_eq!(
            both.needs(&post, "/update_weights_from_disk"),
            Needs::AdminKey
        );
        assert_eq!(both.needs(&Method::GET, "/health_generate"), Needs::Nothing);
        let api_only = keys(Some("a"), None);
        assert_eq!(api_only.needs(&post, "/abort_request"), Needs::ApiKey);
        let admin_only = keys(None, Some("b"));
        assert_eq!(admin_only.needs(&post, "/generate"), Needs::Nothing);
        assert_eq!(admin_only.needs(&post, "/flush_cache"), Needs::AdminKey);
    }

    #[test]
    fn hosts_names_and_literals() {
        let cfg = SecurityConfig {
            allowed_hosts: vec!["rollout.internal".into()],
            ..SecurityConfig::default()
        };
        for ok in [
            "127.0.0.1:30000",
            "localhost",
            "LOCALHOST:1",
            "[::1]:8080",
            "10.0.0.7:30000",
            "rollout.internal:30000",
        ] {
            assert!(cfg.host_allowed(ok), "{ok}");
        }
        for bad in ["evil.example:30000", "rollout.internal.evil.example", ""] {
            assert!(!cfg.host_allowed(bad), "{bad}");
        }
    }

    #[test]
    fn json_media_type_with_parameters() {
        let mut h = HeaderMap::new();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("Application/JSON; charset=utf-8"),
        );
        assert!(is_json(&h));
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        assert!(!is_json(&h));
    }

    #[test]
    fn secrets_compare_by_content() {
        assert!(constant_time_eq(b"key", b"key"));
        assert!(!constant_time_eq(b"key", b"kez"));
        assert!(!constant_time_eq(b"key", b"key2"));
    }
}
