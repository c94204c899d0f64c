//! r3-server: the HTTP server (axum + tokio) around r3-rollout's engine, a drop-in SGLang
//! worker for RL rollout clients: SGLang's native `/generate`, OpenAI `/v1/completions`,
//! `/v1/chat/completions` (through the model's chat template) and `/v1/models`, and the
//! control endpoints
//! RL loops call (`/update_weights_from_disk`, `/pause_generation`, `/continue_generation`,
//! `/flush_cache`, `/abort_request`, `/health`, `/health_generate`, `/get_weight_version`,
//! `/get_model_info` = `/model_info`, `/get_server_info` = `/server_info`, `/v1/loads`).
//!
//! Request bodies follow the field policy of [`policy`]: implemented fields take effect,
//! unimplemented ones are accepted at neutral values, unknown ones are ignored. Handlers
//! validate requests (every bad field gets a 4xx naming it) and send jobs to one
//! engine worker thread ([`worker`]) that batches all clients together (continuous batching)
//! and answers each through a oneshot channel. The engine sits behind the small
//! [`InferenceBackend`] trait, so the HTTP layer is tested with a fake engine too.
//!
//! Seeds: a request without a seed gets `config.seed + k` where `k` counts seedless requests
//! since start, so a replayed request sequence samples the same tokens.

pub mod admin;
pub mod backend;
pub mod chat;
pub mod completions;
pub mod connections;
pub mod device_backend;
pub mod error;
pub mod fields;
pub mod generate;
pub mod generation;
pub mod heap;
pub mod limits;
pub mod memory;
pub mod openai;
pub mod openai_sampling;
pub mod policy;
pub mod request_tokens;
pub mod sampling;
pub mod security;
pub mod sse;
pub mod stop;
pub mod stream_text;
pub mod text;
pub mod weights_update;
pub mod worker;

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::middleware::from_fn_with_state;
use axum::routing::{get, post};
use axum::Router;

pub use backend::{InferenceBackend, MemoryRegions, ModelSummary, StagedWeights};
pub use connections::{serve_with_limits, ConnectionLimits};
pub use error::ApiError;
pub use generation::{ModelGeneration, SamplingDefaults, SamplingDefaultsMode};
pub use limits::{ClientLedger, ClientLimits};
pub use security::SecurityConfig;
pub use text::TextCodec;
pub use weights_update::WeightStager;
pub use worker::{EngineHandle, Finished, Job, PauseMode, WorkerStats};

use r3_rollout::sampler::{LogprobScale, SamplingParams};
use sampling::{ParamContext, SamplingBody};
use stop::{StopMatcher, TextOptions};

/// Size limits that protect the server from oversize requests. Per request, a client holds
/// at most `max_batch_requests` sequences, each of at most the model's context
/// (`max_position_embeddings`) tokens and at most `max_new_tokens` generated ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerLimits {
    /// Largest request body in bytes (larger: 413).
    pub max_body_bytes: usize,
    /// Largest `max_new_tokens` / `max_tokens` a request may ask for.
    pub max_new_tokens: usize,
    /// `max_new_tokens` when a `/generate` request gives none (SGLang's default is 128).
    pub default_max_new_tokens: usize,
    /// Most sequences one HTTP request may ask for (prompts × n).
    pub max_batch_requests: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_body_bytes: 16 << 20,
            max_new_tokens: 8192,
            default_max_new_tokens: 128,
            max_batch_requests: 1024,
        }
    }
}

/// Server settings.
#[derive(Debug, Clone, Default)]
pub struct ServerConfig {
    /// Request limits.
    pub limits: ServerLimits,
    /// Base of the seeds given to requests that carry none.
    pub seed: u64,
    /// The model directory (`model_path` of `/get_model_info`).
    pub model_name: String,
    /// Name reported as the OpenAI `model` and by `/v1/models`.
    pub served_model_name: String,
    /// Return routed experts for every `/generate` request, as if each asked for them
    /// (sglang-router drops the per-request flag but passes `meta_info` through).
    pub return_routed_experts_by_default: bool,
    /// Report every request's output log-probs (and top log-probs) at temperature 1,
    /// `log softmax(l)`, whatever its temperature ([`LogprobScale::Raw`]): what SGLang does
    /// with `SGLANG_RETURN_ORIGINAL_LOGPROB` set (`r3 serve --return-original-logprob`).
    /// Off (SGLang's default): a sampled request's are `log softmax(l / T)`, the
    /// distribution its token was drawn from before truncation. Prompt log-probs are raw
    /// either way.
    pub return_original_logprob: bool,
    /// Keys, allowed origins and hosts.
    pub security: SecurityConfig,
    /// `/update_weights_from_disk` reads only directories under this one (canonicalised);
    /// None: any directory (`r3 serve` always sets one, by default the model's parent).
    pub weights_root: Option<PathBuf>,
    /// Connection timeouts and the connection cap ([`serve_with_limits`]); the body timeout
    /// is applied by the app itself.
    pub connections: ConnectionLimits,
    /// Per-request and per-client limits of tokens and requests in flight ([`limits`]).
    pub clients: ClientLimits,
    /// What the model's `generation_config.json` adds: eos ids every request stops at, and
    /// (`--sampling-defaults model`) chat's sampling defaults.
    pub generation: ModelGeneration,
}

/// State shared by all handlers.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

struct Shared {
    handle: EngineHandle,
    summary: ModelSummary,
    text: Option<Arc<TextCodec>>,
    config: ServerConfig,
    /// The ids that end every request unless `ignore_eos` ([`generation::model_stop_ids`]).
    stop_ids: Vec<u32>,
    /// Seedless requests so far (their seed is `config.seed + this`).
    next_seed: AtomicU64,
    /// Builds new weights off the engine thread (None: the backend loads on its thread).
    stager: Option<weights_update::WeightStager>,
    /// Held while a weight update is read and swapped: one at a time.
    update_lock: tokio::sync::Mutex<()>,
}

impl AppState {
    /// The engine worker.
    pub fn handle(&self) -> &EngineHandle {
        &self.0.handle
    }

    /// Facts about the served model.
    pub fn summary(&self) -> &ModelSummary {
        &self.0.summary
    }

    /// The tokenizer, when the model directory has one.
    pub fn text(&self) -> Option<&TextCodec> {
        self.0.text.as_deref()
    }

    /// The backend's weight stager, if it builds weights off the engine thread.
    pub fn stager(&self) -> Option<weights_update::WeightStager> {
        self.0.stager.clone()
    }

    /// The lock that serialises weight updates.
    pub fn update_lock(&self) -> &tokio::sync::Mutex<()> {
        &self.0.update_lock
    }

    /// The server settings.
    pub fn config(&self) -> &ServerConfig {
        &self.0.config
    }

    /// Request limits.
    pub fn limits(&self) -> &ServerLimits {
        &self.0.config.limits
    }

    /// Name reported as the model.
    pub fn model_name(&self) -> &str {
        &self.0.config.model_name
    }

    /// The ids that end every request unless it sets `ignore_eos`: the model's eos ids from
    /// config.json, generation_config.json and the tokenizer ([`generation::model_stop_ids`]).
    pub fn stop_ids(&self) -> &[u32] {
        &self.0.stop_ids
    }

    /// A fresh default seed.
    pub fn next_seed(&self) -> u64 {
        let k = self.0.next_seed.fetch_add(1, Ordering::Relaxed);
        self.0.config.seed.wrapping_add(k)
    }

    /// A fresh server-made request id ([`generate::fresh_rid`]: random, as SGLang's).
    pub fn next_rid(&self) -> String {
        generate::fresh_rid()
    }

    /// Rejects requests that ask for more sequences than allowed (or none).
    pub fn check_batch_size(&self, n: usize) -> Result<(), ApiError> {
        let max = self.limits().max_batch_requests;
        if n == 0 {
            return Err(ApiError::bad_request("the request holds no prompt"));
        }
        if n > max {
            return Err(ApiError::too_large(format!(
                "the request asks for {n} sequences; the server limit is {max} per request"
            )));
        }
        Ok(())
    }

    /// Checks one prompt: non-empty, ids in the vocabulary, room left in the context.
    pub fn check_prompt(&self, ids: &[u32], field: &str) -> Result<(), ApiError> {
        let s = self.summary();
        if ids.is_empty() {
            return Err(ApiError::bad_request(format!("{field} is empty")));
        }
        if let Some((i, t)) = ids
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= s.vocab_size)
        {
            return Err(ApiError::bad_request(format!(
                "{field}[{i}] = {t} is out of the vocabulary (size {})",
                s.vocab_size
            )));
        }
        if ids.len() >= s.max_position_embeddings {
            return Err(ApiError::bad_request(format!(
                "{field} has {} tokens; the model's context is {} (max_position_embeddings)",
                ids.len(),
                s.max_position_embeddings
            )));
        }
        Ok(())
    }

    /// The engine's sampling parameters and the text options for one sample of a client's
    /// request: the server's limits, the prompt's context left, the model's stop ids
    /// ([`AppState::stop_ids`], unless `ignore_eos`), a seed (`seed + sample` when the client
    /// gave one, a fresh server seed otherwise), and the log-prob scale of
    /// [`ServerConfig::return_original_logprob`].
    pub fn prepare(
        &self,
        body: &SamplingBody,
        prompt_len: usize,
        sample: usize,
    ) -> Result<(SamplingParams, TextOptions, Option<StopMatcher>), ApiError> {
        let s = self.summary();
        let ctx = ParamContext {
            limits: self.limits(),
            vocab_size: s.vocab_size,
            max_position_embeddings: s.max_position_embeddings,
            eos: &self.0.stop_ids,
            prompt_len,
            default_seed: if body.has_seed() { 0 } else { self.next_seed() },
        };
        let (mut params, text) = body.to_params(&ctx)?;
        if self.0.config.return_original_logprob {
            params.logprob_scale = LogprobScale::Raw;
        }
        if body.has_seed() {
            params.seed = params.seed.wrapping_add(sample as u64);
        }
        let stop =
            match (&self.0.text, text.stop.is_empty()) {
                (_, true) => None,
                (Some(codec), false) => StopMatcher::new(Arc::clone(codec), &text),
                (None, false) => return Err(ApiError::bad_request(
                    "stop strings need a tokenizer.json in the model directory; use stop_token_ids",
                )),
            };
        Ok((params, text, stop))
    }
}

/// Turns the raw body extraction into bytes, or a JSON 4xx (413 when over the limit).
pub fn read_body(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(format!("the request body is larger than {limit} bytes"))
        } else {
            ApiError {
                status: rejection.status(),
                message: format!("cannot read the request body: {rejection}"),
            }
        }
    })
}

/// A running server's parts: the axum app and the engine worker thread.
pub struct App {
    /// The routes, ready for [`serve`].
    pub router: Router,
    /// The engine worker's handle (also held by the router).
    pub handle: EngineHandle,
    /// The engine worker thread; it ends once the router and every handle are dropped.
    pub worker: JoinHandle<()>,
    /// What each client holds in flight (the per-client limits' counts).
    pub clients: ClientLedger,
}

/// Starts the engine worker for `backend` and builds the routes.
pub fn build_app<B: InferenceBackend>(
    backend: B,
    text: Option<TextCodec>,
    config: ServerConfig,
) -> std::io::Result<App> {
    let stager = backend.weight_stager();
    let (handle, summary, worker) = EngineHandle::spawn(backend)?;
    let body_limit = config.limits.max_body_bytes;
    let body_timeout = config.connections.body_timeout;
    let access = Arc::new(config.security.clone());
    let client_limits = config.clients;
    let stop_ids = generation::model_stop_ids(
        &summary.eos_token_ids,
        &config.generation.eos_token_ids,
        text.as_ref().map(TextCodec::tokenizer),
    );
    log_generation_settings(&config.generation, &stop_ids);
    let state = AppState(Arc::new(Shared {
        handle: handle.clone(),
        summary,
        text: text.map(Arc::new),
        config,
        stop_ids,
        next_seed: AtomicU64::new(0),
        stager,
        update_lock: tokio::sync::Mutex::new(()),
    }));
    let clients = ClientLedger::default();
    let admission = limits::Admission::new(state.clone(), &client_limits, clients.clone());
    let router = Router::new()
        .route("/health", get(admin::health).post(admin::health))
        .route("/health_generate", get(admin::health_generate))
        .route("/get_model_info", get(admin::model_info))
        .route("/model_info", get(admin::model_info))
        .route("/get_server_info", get(admin::server_info))
        .route("/server_info", get(admin::server_info))
        .route("/get_weight_version", get(admin::weight_version))
        .route("/v1/models", get(admin::models))
        .route("/v1/loads", get(admin::loads))
        .route("/generate", post(generate::handle))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/chat/completions", post(chat::handle))
        .route("/update_weights_from_disk", post(admin::update_weights))
        .route("/abort_request", post(admin::abort))
        .route("/pause_generation", post(admin::pause))
        .route("/continue_generation", post(admin::resume))
        .route(
            "/flush_cache",
            get(admin::flush_cache).post(admin::flush_cache),
        )
        .route(
            "/release_memory_occupation",
            get(memory::release).post(memory::release),
        )
        .route(
            "/resume_memory_occupation",
            get(memory::resume).post(memory::resume),
        )
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(from_fn_with_state(admission, limits::admit))
        .layer(from_fn_with_state(
            (body_timeout, body_limit),
            connections::body_deadline,
        ))
        // Outermost: a refused request is answered before its body is read.
        .layer(from_fn_with_state(access, security::guard))
        .with_state(state);
    Ok(App {
        router,
        handle,
        worker,
        clients,
    })
}

/// Logs, at start, which sampling defaults chat requests take and the ids every request
/// stops at (SGLang logs the defaults it takes from the model once, too).
fn log_generation_settings(generation: &ModelGeneration, stop_ids: &[u32]) {
    match generation.mode {
        SamplingDefaultsMode::Model => tracing::info!(
            defaults = %generation.chat_defaults,
            "chat requests without their own sampling values take these from the model's generation_config.json (--sampling-defaults model)"
        ),
        SamplingDefaultsMode::OpenAi => tracing::info!(
            "chat requests without their own sampling values take OpenAI's defaults (--sampling-defaults openai)"
        ),
    }
    tracing::info!(
        ?stop_ids,
        "requests stop at the model's eos ids unless ignore_eos"
    );
}

/// Serves `router` on `listener` with the default [`ConnectionLimits`] until `shutdown`
/// completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with_limits(listener, router, ConnectionLimits::default(), shutdown).await
}
