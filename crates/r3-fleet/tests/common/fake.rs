//! A fake SGLang worker: `/generate` answers with the status and JSON body a test sets
//! (after any one-off answers queued),
//! `/health` answers 200 with an empty body (as SGLang's does), and weight loads
//! (`/update_weights_from_disk`) are recorded, may be slowed down, and may be refused with
//! SGLang's 400 `{"success": false, "message"}`.

// Each test file that includes this module uses part of it.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::common::Server;

/// The fake's state, shared with the test that drives it.
#[derive(Clone, Default)]
pub struct Fake {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    generate: Mutex<Option<(StatusCode, Value)>>,
    /// One-off answers, given in order before the standing one.
    first: Mutex<Vec<(StatusCode, Value)>>,
    version: Mutex<String>,
    loads: Mutex<Vec<(String, String)>>,
    load_delay: Mutex<Duration>,
    refuse_loads: AtomicBool,
}

impl Fake {
    /// What `/generate` answers from now on.
    pub fn answer(&self, status: StatusCode, body: Value) {
        *self.inner.generate.lock().expect("lock") = Some((status, body));
    }

    /// What the next `/generate` answers, once, before the standing answer (queued after
    /// any one-off answer not given yet).
    pub fn answer_once(&self, status: StatusCode, body: Value) {
        self.inner.first.lock().expect("lock").push((status, body));
    }

    /// Every `/update_weights_from_disk` received: `(model_path, weight_version)`.
    pub fn loads(&self) -> Vec<(String, String)> {
        self.inner.loads.lock().expect("lock").clone()
    }

    /// How long a weight load takes from now on (it is recorded when it arrives).
    pub fn slow_loads(&self, delay: Duration) {
        *self.inner.load_delay.lock().expect("lock") = delay;
    }

    /// Whether weight loads are refused from now on.
    pub fn refuse_loads(&self, refuse: bool) {
        self.inner.refuse_loads.store(refuse, Ordering::SeqCst);
    }
}

async fn generate(State(f): State<Fake>) -> (StatusCode, Json<Value>) {
    let once = {
        let mut first = f.inner.first.lock().expect("lock");
        (!first.is_empty()).then(|| first.remove(0))
    };
    let answer = once.or_else(|| f.inner.generate.lock().expect("lock").clone());
    let (status, body) = answer.unwrap_or((StatusCode::SERVICE_UNAVAILABLE, json!({})));
    (status, Json(body))
}

async fn load(State(f): State<Fake>, Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    let path = body["model_path"].as_str().unwrap_or("?").to_string();
    let label = body["weight_version"].as_str().unwrap_or("?").to_string();
    f.inner
        .loads
        .lock()
        .expect("lock")
        .push((path, label.clone()));
    let delay = *f.inner.load_delay.lock().expect("lock");
    tokio::time::sleep(delay).await;
    if f.inner.refuse_loads.load(Ordering::SeqCst) {
        let refusal = json!({"success": false, "message": "refused by the fake"});
        return (StatusCode::BAD_REQUEST, Json(refusal));
    }
    *f.inner.version.lock().expect("lock") = label.clone();
    (
        StatusCode::OK,
        Json(json!({"success": true, "message": format!("Weight version updated to {label}.")})),
    )
}

async fn version(State(f): State<Fake>) -> Json<Value> {
    Json(json!({"weight_version": f.inner.version.lock().expect("lock").clone()}))
}

/// A fake worker whose `/generate` answers `status` with `body`, and its state.
pub fn start(status: StatusCode, body: Value) -> (Server, Fake) {
    let fake = Fake::default();
    fake.answer(status, body);
    let ok = || async { Json(json!({"message": "ok", "status": "ok"})) };
    let router = Router::new()
        .route("/generate", post(generate))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/pause_generation", post(ok))
        .route("/continue_generation", post(ok))
        .route("/update_weights_from_disk", post(load))
        .route("/get_weight_version", get(version))
        .with_state(fake.clone());
    (Server::start(router), fake)
}
