//! `r3 serve`: the rollout engine behind an HTTP server that RL clients use as an SGLang
//! worker (SGLang's `/generate`, OpenAI `/v1/completions`, and the control endpoints listed in
//! `r3_server`). Runs until Ctrl-C.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use r3_model::LoadOptions;
use r3_rollout::{Dtype, EngineConfig, KvCacheDtype, RolloutDevice, RolloutEngine, RouterDtype};
use r3_server::connections::connections_for_open_files;
use r3_server::{
    build_app, serve_with_limits, ClientLimits, ConnectionLimits, ModelGeneration,
    SamplingDefaultsMode, SecurityConfig, ServerConfig, ServerLimits, TextCodec,
};

/// Arguments of `r3 serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// HF model directory (config.json + safetensors; tokenizer.json optional, enables text,
    /// and must fit the model's vocabulary: serve token ids only from a directory without one).
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the chosen address is logged).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Compute precision: f16 (fast), bf16 (weights and activations at the boundaries a bf16
    /// SGLang / vLLM engine keeps in bf16) or f32 (reproduces HF).
    #[arg(long, default_value = "f16")]
    pub dtype: String,
    /// MoE router precision: the model dtype (`model`, or `--dtype`'s own name) or `f32`;
    /// another dtype's name is refused.
    #[arg(long, default_value = "model")]
    pub router_dtype: String,
    /// Which engine serves, and where: `cpu` (the CPU engine), `cpu-candle` (the device
    /// engine on the CPU), `cuda` / `cuda:N` (the device engine on a GPU; needs a build
    /// with the `cuda` feature). Both keep a prefix cache (`--prefix-cache-mib`).
    #[arg(long, default_value = "cpu")]
    pub device: RolloutDevice,
    /// KV cache budget in MiB (at least 1).
    #[arg(long, default_value_t = 2048)]
    pub kv_cache_mib: usize,
    /// What the KV cache holds keys and values in: `auto` (the engine's dtype, as SGLang's and
    /// vLLM's caches do), `f32`, `f16` or `bf16` for the CPU engine; `auto`, the engine's
    /// dtype or `f32` for the device engine (each exact there: a bf16 / f16 forward's keys
    /// and values are 16-bit values).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: KvCacheDtype,
    /// The device engine's activation budget for one step in MiB (its admission holds every
    /// step to it, beside the KV cache and the prefix cache; the CPU engine does not read it).
    #[arg(long, default_value_t = 8192)]
    pub activation_mib: usize,
    /// Positions one prefill step feeds at most, as SGLang's flag: on the device engine
    /// waiting requests join a prefill batch while its rows × their longest uncached prompt
    /// tail stay within it, and a longer prompt is fed in chunks of it; on the CPU engine,
    /// the prefill tokens of one step beside a token of each decoding row. Not given, or -1
    /// as SGLang takes it: the device engine's prefills are bounded by `--activation-mib`
    /// alone (a prompt past it is still fed in chunks), the CPU engine's steps by 4096
    /// tokens, decode and prefill together.
    #[arg(long, value_parser = parse_chunked_prefill_size, allow_hyphen_values = true)]
    pub chunked_prefill_size: Option<ChunkedPrefill>,
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
    /// Report output log-probs (and top log-probs) at temperature 1, `log softmax(logits)`,
    /// for every request whatever its temperature: SGLang's `SGLANG_RETURN_ORIGINAL_LOGPROB`
    /// as a flag. Without it a sampled request's are `log softmax(logits / T)` (the
    /// distribution its token was drawn from, before top-k / top-p / min-p), as SGLang
    /// reports them by default; a greedy request's and prompt log-probs are raw either way.
    #[arg(long)]
    pub return_original_logprob: bool,
    /// Where a chat request's unset `temperature`, `top_p`, `top_k`, `min_p` and
    /// `repetition_penalty` come from (SGLang's flag and default): `model`, the model's
    /// generation_config.json, then OpenAI's defaults; `openai`, OpenAI's defaults alone
    /// (temperature 1, no cuts). `/generate` and `/v1/completions` never take the model's, as
    /// in SGLang. The values taken are logged at start.
    #[arg(long, default_value = "model")]
    pub sampling_defaults: SamplingDefaultsMode,
    /// Require `Authorization: Bearer KEY` on every endpoint except `/health*` (SGLang's
    /// flag).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Require `Authorization: Bearer KEY` on the control endpoints (weight updates, abort,
    /// pause, continue, flush); when set, `--api-key` does not open them.
    #[arg(long)]
    pub admin_api_key: Option<String>,
    /// Browser origins (e.g. `http://localhost:3000`) whose requests are served; requests
    /// from any other origin get 403. `*` allows all.
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Host names accepted in the `Host` header besides `localhost` and IP addresses (DNS
    /// rebinding protection); `*` accepts all.
    #[arg(long, value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// `/update_weights_from_disk` reads only directories under this one (default: the
    /// model directory's parent).
    #[arg(long)]
    pub weights_root: Option<PathBuf>,
    /// Seconds a client may take to send a request's headers, counted from when the server
    /// waits for them (so also how long an idle keep-alive connection stays open).
    #[arg(long, default_value_t = 30)]
    pub header_timeout_secs: u64,
    /// Seconds a client may take to send a request's body (then 408).
    #[arg(long, default_value_t = 60)]
    pub body_timeout_secs: u64,
    /// Most client connections open at once. At the limit the connection idle longest (no
    /// request in flight, including one still sending its headers) is closed to make room;
    /// only when all have a request in flight does a new one get 503. Lowered to fit the
    /// process's open-file limit (`ulimit -n`, less 64 descriptors and an eighth) when that
    /// is lower.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Most connections one client (peer IP address) may hold open at once; past it that
    /// client's longest-idle connection is closed, or the new one gets 429 when all of its
    /// connections have a request in flight. Default: half of `--max-connections`.
    #[arg(long)]
    pub max_connections_per_client: Option<usize>,
    /// Load the initial weights even when they hold NaN or inf, or values past the
    /// `--dtype` range (65504 for f16), for inspecting a broken checkpoint; weight updates
    /// from disk are always checked.
    #[arg(long)]
    pub allow_non_finite_weights: bool,
    /// Most tokens one generating request may hold in flight (its prompts + n × their max
    /// new tokens; more: 413). Default: 64 × the model's context; 0: no limit.
    #[arg(long)]
    pub max_tokens_per_request: Option<usize>,
    /// Most generating requests one client (its IP address, or its key with `--api-key`)
    /// may have in flight (more: 429); 0: no limit.
    #[arg(long, default_value_t = r3_server::limits::DEFAULT_REQUESTS_PER_CLIENT)]
    pub max_requests_per_client: usize,
    /// Most tokens one client's requests may hold in flight together (more: 429). Default:
    /// 256 × the model's context; 0: no limit.
    #[arg(long)]
    pub max_tokens_per_client: Option<usize>,
}

/// The default weights root: the model directory's parent (where a trainer's sync
/// directories sit beside the model), or the model directory when it has none.
fn default_weights_root(model: &Path) -> anyhow::Result<PathBuf> {
    let model = model
        .canonicalize()
        .with_context(|| format!("resolving {}", model.display()))?;
    Ok(model.parent().map(Path::to_path_buf).unwrap_or(model))
}

/// `max_connections`, or fewer when the process's open-file limit (RLIMIT_NOFILE, soft)
/// cannot hold that many sockets besides the files the server needs itself.
fn fit_open_file_limit(max_connections: usize) -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a valid, exclusive pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return max_connections;
    }
    let fits = connections_for_open_files(limit.rlim_cur);
    if fits < max_connections {
        tracing::warn!(
            max_connections,
            open_file_limit = limit.rlim_cur,
            lowered_to = fits,
            "--max-connections lowered to fit the open-file limit (raise it with ulimit -n)"
        );
        return fits;
    }
    max_connections
}

/// `--chunked-prefill-size`: a cap on a prefill step's positions, or none (SGLang's -1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkedPrefill {
    /// At most this many positions.
    Cap(usize),
    /// No cap but the activation budget.
    Off,
}

/// Parses `--chunked-prefill-size`: a positive count, or -1 for none.
fn parse_chunked_prefill_size(text: &str) -> Result<ChunkedPrefill, String> {
    match text.trim().parse::<i64>() {
        Ok(-1) => Ok(ChunkedPrefill::Off),
        Ok(n) if n > 0 => usize::try_from(n)
            .map(ChunkedPrefill::Cap)
            .map_err(|_| format!("{n} is past this machine's counts")),
        _ => Err(format!(
            "`{text}` is not a positive number of positions, or -1 for no cap"
        )),
    }
}

/// Runs `r3 serve`.
pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    let dtype: Dtype = a.dtype.parse()?;
    let router_dtype = RouterDtype::parse_for(&a.router_dtype, dtype)
        .map_err(|e| anyhow::anyhow!("--router-dtype {}: {e}", a.router_dtype))?;
    check_kv_cache_dtype(a.kv_cache_dtype, a.device, dtype)?;
    let kv_cache_bytes = budget_bytes("--kv-cache-mib", a.kv_cache_mib, false)?;
    let activation_bytes = budget_bytes("--activation-mib", a.activation_mib, false)?;
    let prefix_cache_bytes = budget_bytes("--prefix-cache-mib", a.prefix_cache_mib, true)?;
    anyhow::ensure!(
        a.max_running >= 1,
        "--max-running must be at least 1 (no sequence could decode)"
    );
    let defaults = EngineConfig::default();
    // The CPU engine's step budget counts a token of each decoding row too.
    let (max_batch_tokens, max_prefill_tokens) = match a.chunked_prefill_size {
        Some(ChunkedPrefill::Cap(n)) => (n.saturating_add(a.max_running), Some(n)),
        Some(ChunkedPrefill::Off) | None => (defaults.max_batch_tokens, None),
    };
    let cfg = EngineConfig {
        dtype,
        router_dtype,
        kv_cache_bytes,
        kv_cache_dtype: a.kv_cache_dtype,
        prefix_cache: a.prefix_cache_mib > 0,
        prefix_cache_bytes,
        max_running: a.max_running,
        activation_bytes,
        max_batch_tokens,
        max_prefill_tokens,
        ..defaults
    };
    // The engine sets the precision the weights are checked against (its dtype).
    let load = LoadOptions {
        allow_non_finite: a.allow_non_finite_weights,
        ..LoadOptions::default()
    };
    let engine = RolloutEngine::from_dir_with(a.device, &a.model, cfg, &load)
        .with_context(|| format!("loading model from {}", a.model.display()))?;
    let mut text = TextCodec::from_model_dir(&a.model).map_err(anyhow::Error::msg)?;
    if let Some(codec) = &mut text {
        codec
            .fit_model(engine.model_config().vocab_size)
            .with_context(|| format!("model directory {}", a.model.display()))?;
    }
    let generation = ModelGeneration::from_model_dir(&a.model, a.sampling_defaults)
        .with_context(|| format!("model directory {}", a.model.display()))?;
    let config = ServerConfig {
        generation,
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
        return_original_logprob: a.return_original_logprob,
        security: SecurityConfig {
            api_key: a.api_key.clone().filter(|k| !k.is_empty()),
            admin_api_key: a.admin_api_key.clone().filter(|k| !k.is_empty()),
            allowed_origins: a.allowed_origins.clone(),
            allowed_hosts: a.allowed_hosts.clone(),
        },
        weights_root: Some(match &a.weights_root {
            Some(root) => root
                .canonicalize()
                .with_context(|| format!("--weights-root {}", root.display()))?,
            None => default_weights_root(&a.model)?,
        }),
        connections: ConnectionLimits {
            header_timeout: Duration::from_secs(a.header_timeout_secs.max(1)),
            body_timeout: Duration::from_secs(a.body_timeout_secs.max(1)),
            max_connections: fit_open_file_limit(a.max_connections.max(1)),
            max_connections_per_client: a.max_connections_per_client,
        },
        clients: ClientLimits {
            max_tokens_per_request: a.max_tokens_per_request,
            max_requests_per_client: a.max_requests_per_client,
            max_tokens_per_client: a.max_tokens_per_client,
        },
    };
    let connections = config.connections;
    if let Some(root) = &config.weights_root {
        tracing::info!(root = %root.display(), "weight updates read only under this directory");
    }
    let has_text = text.is_some();
    let app = match engine {
        RolloutEngine::Cpu(engine) => build_app(engine, text, config),
        RolloutEngine::Device(engine) => build_app(engine, text, config),
    }
    .context("starting the engine worker")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(a.http_threads.max(1))
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let addr = format!("{}:{}", a.host, a.port);
    let device = a.device;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr().context("reading the bound address")?;
        tracing::info!(%local, dtype = %dtype, device = %device, text = has_text, "r3 serve listening");
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("shutting down");
        };
        serve_with_limits(listener, app.router, connections, shutdown)
            .await
            .context("serving HTTP")
    })
}

/// Refuses a KV cache dtype other than `auto`, the engine's `dtype` or `f32` for the device
/// engine, whose cache holds its forward's keys and values exactly
/// (`RolloutDevice::check_kv_cache_dtype`), naming the flag, before anything loads.
fn check_kv_cache_dtype(
    kv: KvCacheDtype,
    device: RolloutDevice,
    dtype: Dtype,
) -> anyhow::Result<()> {
    device
        .check_kv_cache_dtype(kv, dtype)
        .map_err(|e| anyhow::anyhow!("--kv-cache-dtype {kv}: {e}"))
}

/// Bytes of the engine budget `flag` gives in MiB, refused naming the flag where it is 0 and
/// `zero_disables` is false (a zero KV cache or activation budget would be clamped to a
/// single block, as `r3 train` refuses `rollout.kv_cache_mib = 0`) or past
/// `MAX_ENGINE_BUDGET_MIB` (the byte count would wrap).
fn budget_bytes(flag: &str, mib: usize, zero_disables: bool) -> anyhow::Result<usize> {
    use r3_train::config::limits::MAX_ENGINE_BUDGET_MIB;
    anyhow::ensure!(
        mib > 0 || zero_disables,
        "{flag} must be at least 1 (MiB): the engine needs room to hold a sequence"
    );
    anyhow::ensure!(
        mib <= MAX_ENGINE_BUDGET_MIB,
        "{flag} {mib} is past the largest budget, {MAX_ENGINE_BUDGET_MIB} MiB"
    );
    Ok(mib << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `r3 serve --model m` with `extra` flags, as clap parses them.
    fn parse_serve(extra: &[&str]) -> Result<ServeArgs, clap::Error> {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let args = ["r3", "--model", "m"].iter().chain(extra);
        <Cli as clap::Parser>::try_parse_from(args).map(|c| c.serve)
    }

    /// A zero KV cache or activation budget is refused naming its flag (the engine would
    /// clamp it to one block); a zero prefix cache budget turns the prefix cache off.
    #[test]
    fn zero_engine_budgets_are_refused_naming_the_flag() {
        for flag in ["--kv-cache-mib", "--activation-mib"] {
            let err = budget_bytes(flag, 0, false).expect_err(flag).to_string();
            assert!(err.contains(flag) && err.contains("at least 1"), "{err}");
        }
        assert_eq!(budget_bytes("--prefix-cache-mib", 0, true).ok(), Some(0));
        assert_eq!(budget_bytes("--kv-cache-mib", 3, false).ok(), Some(3 << 20));
        let err = budget_bytes("--kv-cache-mib", usize::MAX >> 10, false).expect_err("wraps");
        assert!(err.to_string().contains("--kv-cache-mib"), "{err}");
    }

    /// `--chunked-prefill-size` as SGLang takes it: a positive count caps, -1 is no cap,
    /// anything else is refused naming what it takes.
    #[test]
    fn chunked_prefill_size_takes_a_count_or_minus_one() {
        let parse = |extra: &[&str]| parse_serve(extra).map(|serve| serve.chunked_prefill_size);
        assert_eq!(parse(&[]).expect("absent"), None);
        let cap = parse(&["--chunked-prefill-size", "2048"]).expect("a count");
        assert_eq!(cap, Some(ChunkedPrefill::Cap(2048)));
        let off = parse(&["--chunked-prefill-size", "-1"]).expect("-1");
        assert_eq!(off, Some(ChunkedPrefill::Off));
        for bad in ["0", "-2", "many"] {
            let err = parse(&["--chunked-prefill-size", bad]).expect_err(bad);
            assert!(err.to_string().contains("-1 for no cap"), "{bad}: {err}");
        }
    }

    /// `--sampling-defaults` as SGLang's flag: `model` by default, `openai`, anything else
    /// refused naming the two.
    #[test]
    fn sampling_defaults_take_model_or_openai() {
        let parse = |extra: &[&str]| parse_serve(extra).map(|serve| serve.sampling_defaults);
        assert_eq!(parse(&[]).expect("absent"), SamplingDefaultsMode::Model);
        let openai = parse(&["--sampling-defaults", "openai"]).expect("openai");
        assert_eq!(openai, SamplingDefaultsMode::OpenAi);
        let err = parse(&["--sampling-defaults", "vllm"]).expect_err("unknown");
        assert!(err.to_string().contains("model, openai"), "{err}");
    }

    #[test]
    fn the_device_engine_takes_only_exact_kv_cache_dtypes() {
        let candle: RolloutDevice = "cpu-candle".parse().expect("device");
        let [f32_cache, bf16_cache]: [KvCacheDtype; 2] =
            ["f32", "bf16"].map(|d| d.parse().expect("dtype"));
        check_kv_cache_dtype(bf16_cache, RolloutDevice::Cpu, Dtype::F32).expect("CPU engine");
        check_kv_cache_dtype(KvCacheDtype::Auto, candle, Dtype::F16).expect("auto anywhere");
        check_kv_cache_dtype(f32_cache, candle, Dtype::Bf16).expect("f32 on the device engine");
        check_kv_cache_dtype(bf16_cache, candle, Dtype::Bf16).expect("its own dtype");
        let err = check_kv_cache_dtype(bf16_cache, candle, Dtype::F16).expect_err("rounding");
        let text = err.to_string();
        assert!(
            text.contains("--kv-cache-dtype bf16") && text.contains("cpu-candle"),
            "{text}"
        );
    }
}
