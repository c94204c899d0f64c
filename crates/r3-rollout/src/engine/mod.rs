//! The rollout engine: owns the model, the paged KV pool, the prefix cache and the requests;
//! `submit` queues a request, `step` runs one batched forward over every running sequence
//! (continuous batching: requests join and leave between steps).

pub mod next_token;
pub mod penalty;
mod prefix;
pub(crate) mod sequence;
mod step;

use std::collections::VecDeque;
use std::path::Path;

use r3_model::{check_map_holds, Config, HeldTensors, LoadOptions};
use r3_routing::{ExpertPlacement, MergePolicy};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::dtype::{Dtype, KvCacheDtype, RouterDtype};
use crate::error::RolloutError;
use crate::generate_call::{generate_all, StepEngine};
use crate::kernels::attention::SeqSpan;
use crate::kv_pool::KvPool;
use crate::model::tensors::{load_dir_with, TensorMap};
use crate::model::weights::ModelWeights;
use crate::model::{BatchInput, InferenceModel, Stage};
use crate::prefix_cache::{PrefixCache, PrefixCacheStats};
use crate::request::{GenerateRequest, GenerateResult, PartialRollout, RequestId};
pub use prefix::CachedBlock;
use sequence::{ResumeState, RouteGeometry, Sequence};

/// The device engine's default activation budget for one step: generous where no device
/// memory is read yet (composed attention alone holds 3 · heads · T² f32 per prefill: a
/// 32-head model's 4,096-token prompt, 6.4 GB).
pub const DEFAULT_ACTIVATION_BYTES: usize = 8 << 30;

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Compute precision (weights, matmuls and, in bf16, activations).
    pub dtype: Dtype,
    /// Precision of the MoE router: the model dtype or f32.
    pub router_dtype: RouterDtype,
    /// Token positions per KV block (and per prefix-cache block).
    pub block_size: usize,
    /// Memory budget of the KV pool in bytes.
    pub kv_cache_bytes: usize,
    /// What the KV pool stores keys and values in (default: the engine's dtype).
    pub kv_cache_dtype: KvCacheDtype,
    /// Keep finished prefixes (KV + routes) for reuse.
    pub prefix_cache: bool,
    /// Memory budget of the prefix cache in bytes (counted inside the KV budget).
    pub prefix_cache_bytes: usize,
    /// Tokens fed to the model per step at most (decode tokens + prefill chunks).
    pub max_batch_tokens: usize,
    /// Sequences in flight at most.
    pub max_running: usize,
    /// The device engine's activation budget for one step in bytes (its admission holds
    /// every step to it); the CPU engine sizes its buffers once and does not read it.
    pub activation_bytes: usize,
    /// The device engine's cap on the positions one prefill step feeds
    /// ([`crate::DeviceEngineConfig::max_prefill_tokens`]; None: none but the activation
    /// budget); the CPU engine's counterpart is `max_batch_tokens` less its decoding rows.
    pub max_prefill_tokens: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            dtype: Dtype::F16,
            router_dtype: RouterDtype::Model,
            block_size: 16,
            kv_cache_bytes: 2 << 30,
            kv_cache_dtype: KvCacheDtype::Auto,
            prefix_cache: true,
            prefix_cache_bytes: 1 << 30,
            max_batch_tokens: 4096,
            max_running: 256,
            activation_bytes: DEFAULT_ACTIVATION_BYTES,
            max_prefill_tokens: None,
        }
    }
}

/// The rollout engine; see the module docs.
#[derive(Debug)]
pub struct Engine {
    model: InferenceModel,
    cfg: EngineConfig,
    pool: KvPool,
    cache: Option<PrefixCache<CachedBlock>>,
    geo: RouteGeometry,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    next_id: RequestId,
    version: u64,
    eos: Vec<u32>,
    /// Time spent on route-capture work since the engine was built (see `capture_seconds`).
    capture_time: std::time::Duration,
}

impl Engine {
    /// Loads `config.json` and safetensors weights from a HF model directory.
    pub fn from_dir(dir: &Path, cfg: EngineConfig) -> Result<Self, RolloutError> {
        Self::from_dir_with(dir, cfg, &LoadOptions::default())
    }

    /// [`Engine::from_dir`] with explicit weight-load options (e.g. accepting non-finite
    /// weights, which are refused by default).
    pub fn from_dir_with(
        dir: &Path,
        cfg: EngineConfig,
        options: &LoadOptions,
    ) -> Result<Self, RolloutError> {
        let model_cfg = Config::from_file(&dir.join("config.json"))?;
        // The loader checks every value against the engine's precision (unless allowed).
        let options = LoadOptions {
            precision: cfg.dtype.weight_precision(),
            ..*options
        };
        let tensors = load_dir_with(dir, &model_cfg, &options)?;
        Self::build(model_cfg, &tensors, cfg)
    }

    /// Builds an engine from a parsed config and HF-named tensors (e.g. the trainer's); a
    /// tensor holding a value the engine's precision cannot hold (NaN, ±inf, or past its
    /// finite range) is refused, naming it.
    pub fn new(
        model_cfg: Config,
        tensors: &TensorMap,
        cfg: EngineConfig,
    ) -> Result<Self, RolloutError> {
        check_map_holds(tensors, cfg.dtype.weight_precision())?;
        Self::build(model_cfg, tensors, cfg)
    }

    /// [`Engine::new`] without the range check (done by the loader, or allowed).
    fn build(
        model_cfg: Config,
        tensors: &TensorMap,
        cfg: EngineConfig,
    ) -> Result<Self, RolloutError> {
        if cfg.max_batch_tokens == 0 || cfg.max_running == 0 {
            return Err(RolloutError::InvalidConfig(
                "max_batch_tokens and max_running must be > 0".into(),
            ));
        }
        let eos = config_eos_ids(&model_cfg);
        let model = InferenceModel::with_router(model_cfg, tensors, cfg.dtype, cfg.router_dtype)?;
        let layout = model.kv_layout(cfg.block_size);
        // By default the cache holds keys and values in the engine's dtype (see `kv_pool`).
        let kv_dtype = cfg.kv_cache_dtype.resolve(cfg.dtype);
        let block_bytes = KvPool::block_bytes_of(&layout, kv_dtype);
        let max_blocks = (cfg.kv_cache_bytes / block_bytes.max(1)).max(1);
        let pool = KvPool::new(layout, max_blocks, kv_dtype)?;
        let cache =
            PrefixCache::for_engine(cfg.prefix_cache, cfg.block_size, cfg.prefix_cache_bytes)?;
        let geo = RouteGeometry::of(model.config());
        tracing::info!(
            dtype = %cfg.dtype,
            router_dtype = %cfg.router_dtype,
            weight_mb = model.weight_bytes() >> 20,
            kv_dtype = %kv_dtype,
            kv_blocks = max_blocks,
            "rollout engine ready"
        );
        Ok(Engine {
            model,
            cfg,
            pool,
            cache,
            geo,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            version: 0,
            eos,
            capture_time: std::time::Duration::ZERO,
        })
    }

    /// Seconds of wall time this engine has spent on route capture so far: the capture
    /// buffers, copying each MoE layer's chosen ids, appending route rows to sequences and
    /// building the returned route tables. Measured where the work happens, so the capture
    /// cost can be read directly instead of as a difference of two noisy runs.
    pub fn capture_seconds(&self) -> f64 {
        self.capture_time.as_secs_f64()
    }

    /// The model config.
    pub fn model_config(&self) -> &Config {
        self.model.config()
    }

    /// The engine settings.
    pub fn engine_config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// `eos_token_id`(s) from config.json (not added to requests automatically).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Current weight version (0 at load, +1 per update).
    pub fn weight_version(&self) -> u64 {
        self.version
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Requests waiting for admission and requests running.
    pub fn queue_lengths(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    /// Prefix cache counters (None when the cache is off).
    pub fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        self.cache.as_ref().map(|c| c.stats())
    }

    /// Tokens generated so far by a waiting or running request in this call (None if the id
    /// is unknown or finished); the server checks stop strings and streams with it.
    pub fn generated_tokens(&self, id: RequestId) -> Option<&[u32]> {
        self.waiting
            .iter()
            .chain(&self.running)
            .find(|s| s.id == id)
            .map(|s| s.generated())
    }

    /// Empties the prefix cache; returns how many blocks it released.
    pub fn flush_prefix_cache(&mut self) -> usize {
        match self.cache.as_mut() {
            Some(cache) => cache.clear().len(),
            None => 0,
        }
    }

    fn validate(&self, req: &GenerateRequest) -> Result<(), RolloutError> {
        validate_request(self.model.config(), req)?;
        let need =
            (req.input_ids.len() + req.sampling.max_new_tokens).div_ceil(self.cfg.block_size);
        if need > self.pool.max_blocks() {
            return Err(RolloutError::RequestTooLong {
                prompt_tokens: req.input_ids.len(),
                max_new_tokens: req.sampling.max_new_tokens,
                blocks_needed: need,
                pool_blocks: self.pool.max_blocks(),
            });
        }
        Ok(())
    }

    fn enqueue(
        &mut self,
        req: GenerateRequest,
        rng: ChaCha8Rng,
        resume: Option<ResumeState>,
    ) -> RequestId {
        let id = self.next_id;
        self.next_id += 1;
        // The prefix cache keeps route rows (empty for a dense model) and their weight
        // versions beside the keys and values, so with it every sequence records them.
        let capture = self.cache.is_some() || (req.return_routes && self.geo.row() > 0);
        let prompt_logprobs_end = resume
            .as_ref()
            .map_or(req.input_ids.len(), |r| r.earlier.request.input_ids.len());
        self.waiting.push_back(Sequence {
            id,
            tokens: req.input_ids.clone(),
            prompt_len: req.input_ids.len(),
            request: req,
            computed: 0,
            blocks: Vec::new(),
            rng,
            logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            prompt_top_logprobs: Vec::new(),
            prompt_logprobs_end,
            routes: Vec::new(),
            route_versions: Vec::new(),
            capture,
            cached_tokens: 0,
            prefix_checked: false,
            resume,
            finish: None,
        });
        id
    }

    /// Validates and queues a request; it joins the batch at the next `step`.
    pub fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, RolloutError> {
        self.validate(&req)?;
        let rng = ChaCha8Rng::seed_from_u64(req.sampling.seed);
        Ok(self.enqueue(req, rng, None))
    }

    /// Stops a request. Returns what it produced so far (resumable with [`Engine::resume`]),
    /// or None if the id is unknown or already finished. Its computed prefix goes to the
    /// prefix cache, so a resume under the same weights does not recompute it.
    pub fn abort(&mut self, id: RequestId) -> Result<Option<PartialRollout>, RolloutError> {
        let seq = if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i)
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            Some(self.running.remove(i))
        } else {
            None
        };
        let Some(seq) = seq else { return Ok(None) };
        if let Some(cache) = self.cache.as_mut() {
            prefix::insert_sequence(
                cache,
                &seq,
                &self.geo,
                self.version,
                self.pool.block_bytes(),
            );
        }
        // A request that has sampled nothing in this call holds what the call it continues
        // made, if any, and no more (as the device engine's): route rows of a prefill not
        // done may not reach where the earlier call's, or `routed_experts_start_len`, ended,
        // which a merge with its continuation's would refuse.
        if seq.generated().is_empty() {
            return Ok(Some(match seq.resume {
                Some(resume) => resume.earlier,
                None => PartialRollout::unsampled(seq.request, seq.rng, self.version),
            }));
        }
        let original = match &seq.resume {
            Some(r) => r.earlier.request.clone(),
            None => seq.request.clone(),
        };
        let rng = seq.rng.clone();
        let result = seq.into_result(&self.geo, self.version)?;
        Ok(Some(PartialRollout::from_result(
            original,
            result,
            rng,
            self.version,
        )))
    }

    /// Sends every running request back to the front of the queue and releases its KV
    /// (SGLang's `retract`): on the next steps they are re-prefilled from their tokens and
    /// continue where they were (same RNG stream, captured route rows kept). Returns how many.
    pub fn retract_all(&mut self) -> usize {
        let n = self.running.len();
        for mut seq in self.running.drain(..).rev() {
            seq.blocks.clear();
            seq.computed = 0;
            seq.prefix_checked = false;
            self.waiting.push_front(seq);
        }
        n
    }

    /// Continues an aborted request (possibly under new weights): the prompt becomes the
    /// original prompt plus the tokens generated so far, the remaining token budget carries
    /// over, and the final routes combine both calls by `policy`.
    pub fn resume(
        &mut self,
        partial: PartialRollout,
        policy: MergePolicy,
    ) -> Result<RequestId, RolloutError> {
        let (req, rng, resume) = ResumeState::start(partial, policy, &self.geo)?;
        self.validate(&req)?;
        Ok(self.enqueue(req, rng, Some(resume)))
    }

    /// Submits all requests and steps until they finish; results in input order. On an
    /// error (a request refused, a step failed) none of them is left queued or running.
    pub fn generate(
        &mut self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<GenerateResult>, RolloutError> {
        generate_all(self, reqs)
    }

    /// Loads new weights (same config) from HF-named tensors, e.g. the trainer's, without a
    /// restart. Bumps the weight version and invalidates the prefix cache. Requests in flight
    /// continue under the new weights; their route rows carry the version that produced them.
    /// A tensor the engine's precision cannot hold is refused (naming it) and the old
    /// weights are kept.
    pub fn update_weights(&mut self, tensors: &TensorMap) -> Result<u64, RolloutError> {
        let held = HeldTensors::check(tensors, self.cfg.dtype.weight_precision())?;
        self.update_weights_held(held)
    }

    /// [`Engine::update_weights`] from tensors whose range is already known
    /// ([`HeldTensors`]): scanned only where that proof does not cover this engine's
    /// precision (a trainer whose guarded update keeps its weights in range vouches for
    /// them, and the sync skips a pass over every weight).
    pub fn update_weights_held(&mut self, held: HeldTensors<'_>) -> Result<u64, RolloutError> {
        held.ensure(self.cfg.dtype.weight_precision())?;
        self.model.load_weights(held.tensors())?;
        Ok(self.weights_swapped())
    }

    /// Swaps in weights built elsewhere for this engine's config and dtype (the server builds
    /// them on a loader thread while the engine keeps serving), with the same effects as
    /// [`Engine::update_weights`]; the swap itself costs no loading.
    pub fn swap_weights(&mut self, weights: ModelWeights) -> u64 {
        self.model.set_weights(weights);
        self.weights_swapped()
    }

    /// Bumps the version and drops the prefix cache after new weights are in place.
    fn weights_swapped(&mut self) -> u64 {
        self.version += 1;
        if let Some(cache) = self.cache.as_mut() {
            drop(cache.clear());
        }
        tracing::debug!(version = self.version, "weights updated");
        self.version
    }

    /// [`Engine::update_weights`] from a safetensors directory.
    pub fn update_weights_from_dir(&mut self, dir: &Path) -> Result<u64, RolloutError> {
        let options = LoadOptions {
            precision: self.cfg.dtype.weight_precision(),
            ..LoadOptions::default()
        };
        let tensors = load_dir_with(dir, self.model.config(), &options)?;
        self.model.load_weights(&tensors)?;
        Ok(self.weights_swapped())
    }

    /// Where a forward over `tokens` (a prompt and its response) first turns non-finite:
    /// the diagnostic re-run of a rollout whose log-probs were NaN or ±inf, on a KV cache of
    /// its own (the engine's requests and cache are untouched). None when every stage's
    /// output is finite.
    pub fn locate_non_finite(&mut self, tokens: &[u32]) -> Result<Option<Stage>, RolloutError> {
        if tokens.is_empty() {
            return Ok(None);
        }
        let vocab = self.model.config().vocab_size;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(RolloutError::InvalidRequest(format!(
                "token id {t} is outside the vocabulary of {vocab}"
            )));
        }
        let layout = self.model.kv_layout(self.cfg.block_size);
        let blocks_needed = tokens.len().div_ceil(layout.block_size.max(1));
        let mut pool = KvPool::new(layout, blocks_needed, self.pool.dtype())?;
        let blocks = (0..blocks_needed)
            .map(|_| pool.allocate())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| RolloutError::Weights("no KV block for the diagnostic pass".into()))?;
        let spans = [SeqSpan {
            first_token: 0,
            num_tokens: tokens.len(),
            start_pos: 0,
            blocks: blocks.iter().map(|b| b.id()).collect(),
        }];
        let rows: Vec<usize> = (0..tokens.len()).collect();
        let input = BatchInput {
            tokens,
            spans: &spans,
            logit_rows: &rows,
        };
        self.model.first_non_finite_stage(&mut pool, &input)
    }

    /// Runs experts on the physical slots of an EPLB placement (replicas share weights);
    /// captured routes stay logical expert ids.
    pub fn set_expert_placement(
        &mut self,
        placement: Option<ExpertPlacement>,
    ) -> Result<(), RolloutError> {
        self.model.set_placement(placement)
    }
}

/// Checks a request against a model, whichever engine runs it: a non-empty prompt of ids
/// below the vocabulary, stop ids likewise, valid sampling parameters, a prompt plus
/// `max_new_tokens` that fits a usize, room to generate within `max_position_embeddings`,
/// and `routed_experts_start_len` inside the prompt.
pub fn validate_request(cfg: &Config, req: &GenerateRequest) -> Result<(), RolloutError> {
    let vocab = cfg.vocab_size;
    if req.input_ids.is_empty() {
        return Err(RolloutError::InvalidRequest("input_ids is empty".into()));
    }
    if let Some((i, t)) = req
        .input_ids
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(RolloutError::InvalidRequest(format!(
            "input_ids[{i}] = {t} is not below the vocabulary size {vocab}"
        )));
    }
    if let Some(t) = req
        .sampling
        .stop_token_ids
        .iter()
        .find(|&&t| t as usize >= vocab)
    {
        return Err(RolloutError::InvalidRequest(format!(
            "stop token {t} is not below the vocabulary size {vocab}"
        )));
    }
    req.sampling.validate()?;
    // Both engines size a request by its prompt plus max_new_tokens: a sum that does not
    // fit a usize had wrapped to a small one and passed their KV checks.
    if req
        .input_ids
        .len()
        .checked_add(req.sampling.max_new_tokens)
        .is_none()
    {
        return Err(RolloutError::InvalidRequest(format!(
            "max_new_tokens {} beside a prompt of {} tokens overflows a position count",
            req.sampling.max_new_tokens,
            req.input_ids.len()
        )));
    }
    let max_pos = cfg.max_position_embeddings;
    if req.input_ids.len() >= max_pos {
        return Err(RolloutError::InvalidRequest(format!(
            "prompt of {} tokens does not leave room to generate within max_position_embeddings {max_pos}",
            req.input_ids.len()
        )));
    }
    if req.routed_experts_start_len > req.input_ids.len() {
        return Err(RolloutError::InvalidRequest(format!(
            "routed_experts_start_len {} is past the prompt ({} tokens)",
            req.routed_experts_start_len,
            req.input_ids.len()
        )));
    }
    Ok(())
}

/// `eos_token_id` of a model's config.json (a number or a list; none when absent).
pub fn config_eos_ids(cfg: &Config) -> Vec<u32> {
    match cfg.raw.get("eos_token_id") {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|v| vec![v as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as u32)
            .collect(),
        _ => Vec::new(),
    }
}

impl StepEngine for Engine {
    fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, RolloutError> {
        Engine::submit(self, req)
    }

    fn step(&mut self) -> Result<Vec<GenerateResult>, RolloutError> {
        Engine::step(self)
    }

    fn has_work(&self) -> bool {
        Engine::has_work(self)
    }

    fn abort_all_of(&mut self, ids: &[RequestId]) {
        for &id in ids {
            if let Err(e) = self.abort(id) {
                tracing::warn!(error = %e, id, "a failed generate's request could not be aborted");
            }
        }
    }
}
