//! What the fleet's integration tests share: the shipped model and its facts, and an HTTP
//! server (the real r3 server, or any router a test builds as a fake worker or proxy) on
//! 127.0.0.1 with its own runtime.

use std::path::{Path, PathBuf};

use axum::Router;
use r3_fleet::ModelFacts;
use r3_rollout::{Engine, EngineConfig};
use r3_routing::LayerLayout;
use r3_server::{build_app, serve, ServerConfig};
use serde_json::Value;

/// The shipped test model.
pub fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/arith-moe")
}

/// The shipped model's facts, read from its config.json (4 MoE layers, 8 experts, top-2).
pub fn facts() -> ModelFacts {
    let text = std::fs::read_to_string(model_dir().join("config.json")).expect("config.json");
    let cfg: Value = serde_json::from_str(&text).expect("config json");
    let layers = cfg["num_hidden_layers"].as_u64().expect("layers") as usize;
    ModelFacts {
        vocab_size: cfg["vocab_size"].as_u64().expect("vocab") as usize,
        layout: LayerLayout::all_moe(layers),
        top_k: cfg["num_experts_per_tok"].as_u64().expect("top_k") as usize,
        num_experts: cfg["num_experts"].as_u64().expect("experts") as usize,
    }
}

/// A server on 127.0.0.1 with its own runtime; stops on drop.
pub struct Server {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// Serves the router for as long as the server lives.
    _runtime: tokio::runtime::Runtime,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Server {
    /// A one-thread runtime for a server (a test may need it before the router exists).
    pub fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// Serves `router` on a free port from `runtime`.
    pub fn start_on(runtime: tokio::runtime::Runtime, router: Router) -> Self {
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        runtime.spawn(async move {
            let _ = serve(listener, router, async {
                let _ = rx.await;
            })
            .await;
        });
        Server {
            url,
            _runtime: runtime,
            stop: Some(tx),
        }
    }

    /// Serves `router` on a free port from a runtime of its own.
    pub fn start(router: Router) -> Self {
        Self::start_on(Self::runtime(), router)
    }

    /// The real r3 server on the shipped model.
    pub fn real() -> Self {
        let engine = Engine::from_dir(&model_dir(), EngineConfig::default()).expect("engine");
        let app = build_app(engine, None, ServerConfig::default()).expect("app");
        Self::start(app.router)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}
