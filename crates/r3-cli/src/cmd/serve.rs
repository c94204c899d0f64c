//! `r3 serve`: the rollout engine behind an HTTP server that RL clients use as an SGLang
//! worker (SGLang's `/generate`, OpenAI `/v1/completions`, and the control endpoints listed in
//! `r3_rollout::server`). Runs until Ctrl-C.

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
    /// Model name reported by `/v1/models` and in OpenAI responses (default: the model
    /// directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Return routed experts for every `/generate` request, also when the request does not
    /// ask (sglang-router drops the per-request flag but passes `meta_info` through).
    #[arg(long)]
    pub return_routed_experts_by_default: bool,
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
        served_model_name: a.served_model_name.clone().unwrap_or_else(|| {
            a.model
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| a.model.display().to_string())
        }),
        return_routed_experts_by_default: a.return_routed_experts_by_default,
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
