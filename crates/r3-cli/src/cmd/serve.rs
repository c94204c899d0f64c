//! `r3 serve`: the rollout engine behind an HTTP server with SGLang's native `/generate`,
//! an OpenAI-style `/v1/completions`, `/health`, `/get_model_info`, `/get_server_info`,
//! `/update_weights_from_disk` and `/abort_request`. Runs until Ctrl-C.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use r3_rollout::server::{build_app, serve, ServerConfig, ServerLimits, TextCodec};
use r3_rollout::{Dtype, Engine, EngineConfig};

/// Arguments of `r3 serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// HF model directory (config.json + safetensors; tokenizer.json optional, enables text).
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the chosen address is logged).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Matmul precision: f16 (fast) or f32 (reproduces HF).
    #[arg(long, default_value = "f16")]
    pub dtype: String,
    /// KV cache budget in MiB.
    #[arg(long, default_value_t = 2048)]
    pub kv_cache_mib: usize,
    /// Prefix cache budget in MiB (0 disables the prefix cache).
    #[arg(long, default_value_t = 1024)]
    pub prefix_cache_mib: usize,
    /// Sequences decoding at once at most.
    #[arg(long, default_value_t = 256)]
    pub max_running: usize,
    /// Largest `max_new_tokens` a request may ask for.
    #[arg(long, default_value_t = 8192)]
    pub max_new_tokens: usize,
    /// Largest request body in MiB.
    #[arg(long, default_value_t = 16)]
    pub max_body_mib: usize,
    /// Base seed of requests that carry none (request k gets seed + k).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// HTTP worker threads (the engine runs on its own thread).
    #[arg(long, default_value_t = 2)]
    pub http_threads: usize,
}

/// Runs `r3 serve`.
pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    let dtype: Dtype = a.dtype.parse()?;
    let cfg = EngineConfig {
        dtype,
        kv_cache_bytes: a.kv_cache_mib << 20,
        prefix_cache: a.prefix_cache_mib > 0,
        prefix_cache_bytes: a.prefix_cache_mib << 20,
        max_running: a.max_running,
        ..EngineConfig::default()
    };
    let engine = Engine::from_dir(&a.model, cfg)
        .with_context(|| format!("loading model from {}", a.model.display()))?;
    let text = TextCodec::from_model_dir(&a.model).map_err(anyhow::Error::msg)?;
    let config = ServerConfig {
        limits: ServerLimits {
            max_body_bytes: a.max_body_mib << 20,
            max_new_tokens: a.max_new_tokens,
            ..ServerLimits::default()
        },
        seed: a.seed,
        model_name: a.model.display().to_string(),
    };
    let has_text = text.is_some();
    let app = build_app(engine, text, config).context("starting the engine worker")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(a.http_threads.max(1))
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let addr = format!("{}:{}", a.host, a.port);
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr().context("reading the bound address")?;
        tracing::info!(%local, dtype = %dtype, text = has_text, "r3 serve listening");
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("shutting down");
        };
        serve(listener, app.router, shutdown)
            .await
            .context("serving HTTP")
    })
}
