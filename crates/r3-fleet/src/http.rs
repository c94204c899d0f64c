//! One pooled async HTTP/1.1 client (hyper-util) that sends and receives JSON, with a
//! per-call timeout and an optional Bearer key; every failure becomes a [`FleetError`]
//! naming the URL. An empty 2xx body reads as JSON `null` (SGLang answers `/health`,
//! `/abort_request` and others with a bare 200), and [`JsonClient::probe`] looks at the
//! status alone.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::error::{FleetError, Result};

/// Longest stretch of an error body kept in an error message.
const BODY_EXCERPT: usize = 300;

/// The shared client of all workers.
#[derive(Clone)]
pub struct JsonClient {
    client: Client<HttpConnector, Full<Bytes>>,
    api_key: Option<String>,
}

impl std::fmt::Debug for JsonClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonClient")
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl JsonClient {
    /// A client; must be created inside a tokio runtime context.
    pub fn new(api_key: Option<String>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        JsonClient { client, api_key }
    }

    /// `GET url`, the JSON reply.
    pub async fn get(&self, url: &str, timeout: Duration) -> Result<Value> {
        let reply = self.exchange(Method::GET, url, None, timeout).await?;
        json_reply(url, &reply)
    }

    /// `POST url` with a JSON body, the JSON reply.
    pub async fn post(&self, url: &str, body: &Value, timeout: Duration) -> Result<Value> {
        let reply = self
            .exchange(Method::POST, url, Some(body), timeout)
            .await?;
        json_reply(url, &reply)
    }

    /// `GET url` for its status alone (a health check): any 2xx is `Ok`, whatever the body.
    pub async fn probe(&self, url: &str, timeout: Duration) -> Result<()> {
        self.exchange(Method::GET, url, None, timeout)
            .await
            .map(|_| ())
    }

    /// One request; the body of a 2xx reply, any other status an error.
    async fn exchange(
        &self,
        method: Method,
        url: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<Bytes> {
        let transport = |message: String| FleetError::Transport {
            url: url.to_string(),
            message,
        };
        let bytes = match body {
            Some(v) => Bytes::from(serde_json::to_vec(v).map_err(|e| transport(e.to_string()))?),
            None => Bytes::new(),
        };
        let mut req = Request::builder().method(method).uri(url);
        if body.is_some() {
            req = req.header(CONTENT_TYPE, "application/json");
        }
        if let Some(key) = &self.api_key {
            req = req.header(AUTHORIZATION, format!("Bearer {key}"));
        }
        let req = req
            .body(Full::new(bytes))
            .map_err(|e| transport(format!("building the request: {e}")))?;
        let exchange = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| transport(error_chain(&e)))?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| transport(format!("reading the reply: {}", error_chain(&e))))?
                .to_bytes();
            Ok::<_, FleetError>((status, body))
        };
        let (status, body) = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| FleetError::Timeout {
                url: url.to_string(),
                secs: timeout.as_secs_f64(),
            })??;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body);
            return Err(FleetError::Status {
                url: url.to_string(),
                status: status.as_u16(),
                body: text.chars().take(BODY_EXCERPT).collect(),
            });
        }
        Ok(body)
    }
}

/// The JSON of a 2xx reply from `url`; an empty body is `null`.
fn json_reply(url: &str, body: &[u8]) -> Result<Value> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    serde_json::from_slice(body).map_err(|e| FleetError::BadReply {
        url: url.to_string(),
        reason: format!("not JSON ({e})"),
    })
}

/// An error with its sources, so "connection refused" is not hidden behind "client error".
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
