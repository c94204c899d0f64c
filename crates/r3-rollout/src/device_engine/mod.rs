//! The rollout engine on candle tensors (`DeviceEngine`): the same requests, seeded sampler,
//! log-prob semantics and route tables as the CPU [`crate::Engine`], computed by r3-model's
//! layers on any candle device (the CPU here, `Device::Cuda` in a `cuda` build) with the KV
//! cache held as device tensors.
//!
//! Scheduling is continuous admission into one left-padded batch: every step decodes one
//! token for each running sequence and, beside it, prefills the waiting requests that fit
//! (up to `max_running` and the KV budget) as a batch of their own, left-padded to their
//! longest prompt, and samples their first tokens; at the step boundary that batch joins
//! the running one (whichever holds fewer cache slots is left-padded to the other's count,
//! [`KvCache::pad_front`], and its rows' caches follow, [`KvCache::append_rows`]).
//! Finished sequences leave the batch (their cache rows dropped) and slots that are
//! padding for every remaining row are dropped from the front ([`KvCache::drop_front`]).
//! Padding is masked and every sequence keeps its own RoPE positions, so a request's tokens,
//! log-probs and routes do not depend on when it was admitted or beside whom.
//! Per step the rows of logits the sampler needs are copied to the host, where the CPU
//! engine's sampler picks each sequence's token with its own seeded stream; a row whose
//! sampling is plain greedy (no penalty, bias, minimum length or top log-probs this step)
//! stays on the device, which reduces it to its argmax and log-sum-exp (`greedy.rs`).
//! Routes are the experts r3-model's router chose at every fed position (the MoE layers
//! dispatch from host ids, so capture copies nothing from the device), one row per position
//! of prompt + output except the last token, which is never fed.
//!
//! A request whose prefill in one step would exceed the activation budget (a long prompt:
//! its hidden states grow with it, its mask with its square; the attention's scores are
//! held in query tiles within a quarter of the budget) or the token cap
//! (`max_prefill_tokens`) is fed in chunks instead, each the most positions whose step fits
//! both ([`memory::prefill_chunk`]), one chunk per step beside the running batch's decode:
//! the cache holds the chunks fed so far as it holds a cached prefix, the next chunk is fed
//! over them, and the last one samples the first token and joins the running batch. Other
//! requests are admitted meanwhile (counted with the chunked one as it will join), one
//! prefill running in chunks at a time.
//!
//! Prompt log-probs (when asked) come from the prefill's logits of every prompt slot (chunk
//! by chunk where it runs in chunks), copied to the host. An aborted request resumes as on
//! the CPU engine (its prompt extended by what it generated, its sampler stream carried
//! over, routes merged by a `MergePolicy`).
//! A retract (`retract.rs`) sends the running rows back to the queue without their keys and
//! values, to be prefilled again over all their tokens; the weights can move to the host and
//! back (`offload.rs`) while a trainer uses the device.
//!
//! The prefix cache (`prefix.rs`, on the CPU engine's radix tree `crate::prefix_cache`)
//! keeps, per full block of `block_size` fed positions, the keys and values of every layer
//! as device tensors and the route rows of those positions. A request admitted with a
//! cached prefix starts with it: its prefill batch's cache holds each row's cached prefix
//! right-aligned before the step, the step feeds only the uncached tails (left-padded to the
//! longest, so a row with a shorter tail has a gap between prefix and tail, masked), and
//! after the step the gaps are moved to the front ([`KvCache::permute_slots`]), so the batch
//! is the usual left-padded one. Its route rows for the cached positions are the cached
//! ones — what the first prefill of those positions recorded. Finished and aborted rows offer
//! their fed positions; a weight update empties the cache. Not here yet: a paged cache.

mod abort;
mod admission;
pub mod batch;
pub mod choice;
pub mod memory;
mod offload;
mod picks;
pub mod prefix;
mod retract;
pub mod routing;
mod weights;

use std::collections::VecDeque;
use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use r3_model::model::decode::{KvCache, ScoreTiles, Step, StepMask, StepRouting};
use r3_model::{check_map_holds, Config, DeviceSpec, HostStaging, LoadOptions, Model, Weights};
use r3_routing::RouteTable;
use rayon::prelude::*;
pub use routing::RoutingPlace;

use crate::dtype::{Dtype, KvCacheDtype, RouterDtype};
use crate::engine::config_eos_ids;
use crate::engine::next_token::{sample_slots, NextTokenLogits, NextTokenSlot};
use crate::engine::sequence::RouteGeometry;
use crate::error::RolloutError;
use crate::generate_call::{generate_all, StepEngine};
use crate::kernels::ops::log_softmax_at;
use crate::model::tensors::{load_dir_with, TensorMap};
use crate::prefix_cache::{PrefixCache, PrefixCacheStats};
use crate::request::{FinishReason, GenerateRequest, GenerateResult, PromptLogprobs, RequestId};
use crate::sampler::top_logprobs;
use batch::{capture_routes, decode_layout, gap_order, prefill_layout, Row, StepLayout};
use picks::{device_picks, PickWay};
use prefix::DeviceBlock;
use weights::{build_model, check_budgets_fit, kv_dtype};

/// Settings of the device engine.
#[derive(Debug, Clone)]
pub struct DeviceEngineConfig {
    /// Where the model, its KV cache and its forward live.
    pub device: DeviceSpec,
    /// Rounding points of the forward: f32, or r3-model's bf16 / f16 mixed precision (f32
    /// math rounded at the boundaries the trainer's mixed precision uses).
    pub dtype: Dtype,
    /// Router precision (f32 keeps the router projection in f32 under bf16 / f16).
    pub router_dtype: RouterDtype,
    /// Sequences in one batch at most.
    pub max_running: usize,
    /// Budget of the batch's KV cache in bytes (keys and values of every layer, in the
    /// cache's dtype, for every slot a batch can reach, and the room its buffers keep past
    /// them: `kv_capacity_for`); a request that alone exceeds it is refused.
    pub kv_cache_bytes: usize,
    /// The dtype the KV cache holds (SGLang's `--kv-cache-dtype`): `auto` the forward's own
    /// (a bf16 / f16 forward's keys and values are 16-bit values, held in half the bytes
    /// and read by the attention as they lie), or `f32`. Either holds them exactly.
    pub kv_cache_dtype: KvCacheDtype,
    /// Budget of one step's activations in bytes (the estimate of [`memory`]: attention
    /// scores, logits, hidden states of the step's tokens), beside `kv_cache_bytes`: a
    /// request whose last decode step alone exceeds it is refused, one whose prefill alone
    /// does is fed in chunks that fit, and waiting requests join a batch only while the
    /// prefill they are fed in and the decode steps of the batch they join stay within it.
    pub activation_bytes: usize,
    /// Positions one prefill step feeds at most, padding included (SGLang's
    /// `--chunked-prefill-size`): waiting requests join a prefill batch while its rows ×
    /// its longest uncached tail stay within it, and a request alone past it is fed in
    /// chunks of at most as many. None: the activation budget alone bounds a prefill.
    pub max_prefill_tokens: Option<usize>,
    /// Token positions per prefix-cache block (only full blocks are cached and matched).
    pub block_size: usize,
    /// Keep finished prefixes (keys and values on the device, and their route rows) for
    /// reuse by later requests that start with the same tokens.
    pub prefix_cache: bool,
    /// Memory budget of the prefix cache in bytes (device memory beside the batch's
    /// `kv_cache_bytes`, not inside it: a cached block is a copy of its own); least recently
    /// used blocks are evicted past it.
    pub prefix_cache_bytes: usize,
    /// Where the MoE layers choose their experts, step by step.
    pub routing: RoutingPlace,
}

impl Default for DeviceEngineConfig {
    fn default() -> Self {
        DeviceEngineConfig {
            device: DeviceSpec::Cpu,
            dtype: Dtype::F32,
            router_dtype: RouterDtype::Model,
            max_running: 256,
            kv_cache_bytes: 4 << 30,
            kv_cache_dtype: KvCacheDtype::Auto,
            activation_bytes: crate::engine::DEFAULT_ACTIVATION_BYTES,
            max_prefill_tokens: None,
            block_size: 16,
            prefix_cache: true,
            prefix_cache_bytes: 1 << 30,
            routing: RoutingPlace::Auto,
        }
    }
}

/// The error of a step whose forward failed: the requests it computed, and whether the
/// device ran out of memory.
fn step_failed(rows: &[Row], source: RolloutError) -> RolloutError {
    requests_failed(rows.iter().map(|r| r.id).collect(), source)
}

/// [`step_failed`] naming the requests `ids` (rows that may be gone by the failure).
fn requests_failed(ids: Vec<RequestId>, source: RolloutError) -> RolloutError {
    RolloutError::StepFailed {
        requests: ids.into_boxed_slice(),
        out_of_memory: r3_model::device::reads_as_out_of_memory(&source),
        source: Box::new(source),
    }
}

/// The request ids of `rows`, in batch order.
fn ids_of(rows: &[Row]) -> Vec<RequestId> {
    rows.iter().map(|r| r.id).collect()
}

/// The running batch and its cache.
#[derive(Debug)]
struct Running {
    rows: Vec<Row>,
    cache: KvCache,
    /// Whether its prefill has run to its end (before, the cache holds the cached prefixes
    /// and the chunks fed so far).
    prefilled: bool,
}

impl Running {
    /// Takes row `i` out as `Vec::swap_remove` does — the last row moves into its place —
    /// and its cache row the same way (one row of the cache copied, not the batch), so rows
    /// and cache rows stay side by side.
    fn swap_remove(&mut self, i: usize) -> Result<Row, RolloutError> {
        self.cache.swap_remove_row(i)?;
        Ok(self.rows.swap_remove(i))
    }
}

/// What the device engine holds of its model.
#[derive(Debug)]
enum HeldWeights {
    /// The model and its weights (boxed: the released state is a small map).
    Loaded(Box<Loaded>),
    /// Released: each weight's name and shape (experts fused), which the update that builds
    /// the model again must bring.
    Released(std::collections::BTreeMap<String, Vec<usize>>),
    /// Moved to the host ([`DeviceEngine::offload_weights`]): the engine's weights in its
    /// formats, from which [`DeviceEngine::onload_weights`] builds the model again; an
    /// update meanwhile writes over them.
    Offloaded(Box<Weights>),
}

impl HeldWeights {
    /// The model and weights, if loaded.
    fn loaded(&self) -> Option<&Loaded> {
        match self {
            HeldWeights::Loaded(l) => Some(l),
            HeldWeights::Released(_) | HeldWeights::Offloaded(_) => None,
        }
    }
}

/// The device engine's model and the weights its layers hold.
#[derive(Debug)]
struct Loaded {
    model: Model,
    /// The model's weights by HF name (experts fused, in the engine's formats): the same
    /// storage the model's layers read, which a weight update overwrites in place.
    weights: Weights,
}

/// The device engine; see the module docs.
#[derive(Debug)]
pub struct DeviceEngine {
    /// The model and its weights, or, once released ([`DeviceEngine::release_weights`])
    /// until an update brings them back, the names and shapes that update must bring.
    held: HeldWeights,
    /// The tensor a weight update stopped at, when a device failure left the weights partly
    /// written: no step runs until an update succeeds.
    torn: Option<String>,
    model_cfg: Config,
    cfg: DeviceEngineConfig,
    /// The dtype the KV cache holds (`cfg.kv_cache_dtype` resolved for this model).
    kv_dtype: candle_core::DType,
    device: Device,
    geo: RouteGeometry,
    eos: Vec<u32>,
    version: u64,
    next_id: RequestId,
    /// Requests waiting for admission, as the rows they will be: a new request's holds
    /// its prompt; a retracted one's ([`DeviceEngine::retract_all`]) everything it made so
    /// far, its keys and values dropped.
    waiting: VecDeque<Row>,
    running: Option<Running>,
    /// A batch whose prefill runs in chunks (one request whose whole prefill in one step
    /// would exceed the activation budget or the token cap): fed a chunk per step beside the
    /// running batch's decode, it joins that batch once fed to its end; other requests are
    /// admitted meanwhile, none of them fed in chunks.
    prefilling: Option<Running>,
    /// The prefix cache (None when off).
    cache: Option<PrefixCache<DeviceBlock>>,
    capture_time: Duration,
    /// Wall time the host waited for the device: each MoE layer's router logits and each
    /// step's logits (the queued work before a copy, then the copy).
    device_wait: Duration,
    /// Steps whose MoE layers chose their experts on the device, and all steps.
    steps_routed_on_device: (u64, u64),
    /// Where each step's copied rows of logits land on the host (page-locked on a GPU).
    staging: HostStaging,
    /// Results of a step whose later part failed, handed out by the next step.
    finished: Vec<GenerateResult>,
}

impl DeviceEngine {
    /// Loads `config.json` and safetensors weights from a HF model directory.
    pub fn from_dir(dir: &Path, cfg: DeviceEngineConfig) -> Result<Self, RolloutError> {
        Self::from_dir_with(dir, cfg, &LoadOptions::default())
    }

    /// [`DeviceEngine::from_dir`] with explicit weight-load options.
    pub fn from_dir_with(
        dir: &Path,
        cfg: DeviceEngineConfig,
        options: &LoadOptions,
    ) -> Result<Self, RolloutError> {
        let model_cfg = Config::from_file(&dir.join("config.json"))?;
        let options = LoadOptions {
            precision: cfg.dtype.weight_precision(),
            ..*options
        };
        let tensors = load_dir_with(dir, &model_cfg, &options)?;
        let device = cfg.device.open()?;
        Self::build(model_cfg, &tensors, cfg, device)
    }

    /// Builds the engine from a parsed config and HF-named tensors; a tensor the engine's
    /// precision cannot hold is refused, naming it.
    pub fn new(
        model_cfg: Config,
        tensors: &TensorMap,
        cfg: DeviceEngineConfig,
    ) -> Result<Self, RolloutError> {
        let device = cfg.device.open()?;
        Self::new_on(model_cfg, tensors, cfg, device)
    }

    /// [`DeviceEngine::new`] on an opened `device`, the one `cfg.device` names: a trainer's
    /// own handle where the engine runs on the trainer's GPU. One handle for one GPU lets
    /// the engine see the trainer's tensors as on its own device (candle tells two handles of
    /// one GPU apart), so a weight sync copies each tensor once, device to device, where a
    /// second handle's would first copy it to a fresh buffer of its own.
    pub fn new_on(
        model_cfg: Config,
        tensors: &TensorMap,
        cfg: DeviceEngineConfig,
        device: Device,
    ) -> Result<Self, RolloutError> {
        if DeviceSpec::of(&device) != cfg.device {
            return Err(RolloutError::InvalidConfig(format!(
                "the device engine is configured for {} but was given {}",
                cfg.device,
                DeviceSpec::of(&device)
            )));
        }
        check_map_holds(tensors, cfg.dtype.weight_precision())?;
        Self::build(model_cfg, tensors, cfg, device)
    }

    /// [`DeviceEngine::new`] on `held` (a handle the caller has: a trainer's, or the one the
    /// weights were drawn on) where it is the device `cfg.device` names, else on a handle of
    /// its own.
    pub fn new_beside(
        model_cfg: Config,
        tensors: &TensorMap,
        cfg: DeviceEngineConfig,
        held: &Device,
    ) -> Result<Self, RolloutError> {
        if DeviceSpec::of(held) == cfg.device {
            Self::new_on(model_cfg, tensors, cfg, held.clone())
        } else {
            Self::new(model_cfg, tensors, cfg)
        }
    }

    /// The engine on `device` (opened for `cfg.device`).
    fn build(
        model_cfg: Config,
        tensors: &TensorMap,
        cfg: DeviceEngineConfig,
        device: Device,
    ) -> Result<Self, RolloutError> {
        if cfg.max_running == 0 {
            return Err(RolloutError::InvalidConfig(
                "max_running must be > 0".into(),
            ));
        }
        let kv_dtype = kv_dtype(
            cfg.kv_cache_dtype,
            cfg.dtype,
            &model_cfg,
            &cfg.device.to_string(),
        )?;
        let cache =
            PrefixCache::for_engine(cfg.prefix_cache, cfg.block_size, cfg.prefix_cache_bytes)?;
        let (model, weights) = build_model(&model_cfg, tensors, &cfg, &device)?;
        // The weights' uploads, casts and fused stacks are queued on this thread's stream
        // (candle's per-thread default stream); a server steps the engine on a thread of its
        // own, whose stream the driver does not order after this one: done before it goes.
        device.synchronize()?;
        if cfg.routing == RoutingPlace::Device && !model.routes_on_device() {
            return Err(RolloutError::InvalidConfig(
                "routing = device: this model's routers choose their experts on the host \
                 (more experts, a larger top-k or expert groups other than the device's \
                 selection takes); use auto or host"
                    .into(),
            ));
        }
        check_budgets_fit(&cfg, &device)?;
        let geo = RouteGeometry::of(&model_cfg);
        tracing::info!(device = %cfg.device, dtype = %cfg.dtype, "device rollout engine ready");
        Ok(DeviceEngine {
            held: HeldWeights::Loaded(Box::new(Loaded { model, weights })),
            torn: None,
            eos: config_eos_ids(&model_cfg),
            model_cfg,
            cfg,
            kv_dtype,
            device,
            geo,
            version: 0,
            next_id: 0,
            waiting: VecDeque::new(),
            running: None,
            prefilling: None,
            cache,
            capture_time: Duration::ZERO,
            device_wait: Duration::ZERO,
            steps_routed_on_device: (0, 0),
            staging: HostStaging::new(),
            finished: Vec::new(),
        })
    }

    /// The model config.
    pub fn model_config(&self) -> &Config {
        &self.model_cfg
    }

    /// The engine settings.
    pub fn engine_config(&self) -> &DeviceEngineConfig {
        &self.cfg
    }

    /// The device handle the engine runs on (a trainer's own where it was given one,
    /// [`DeviceEngine::new_on`]).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `eos_token_id`(s) from config.json (not added to requests automatically).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Current weight version (0 at load, +1 per update).
    pub fn weight_version(&self) -> u64 {
        self.version
    }

    /// Seconds spent assembling route rows and tables (see [`crate::Engine::capture_seconds`]).
    pub fn capture_seconds(&self) -> f64 {
        self.capture_time.as_secs_f64()
    }

    /// Seconds the host spent waiting for the device so far: the copies routing and sampling
    /// read (each waits for the work queued before it). Against the wall time, the share of a
    /// step the host had nothing to do: near 1, the device's kernels bound the step; near 0,
    /// the host's own work and launches do.
    pub fn device_wait_seconds(&self) -> f64 {
        self.device_wait.as_secs_f64()
    }

    /// Steps so far whose MoE layers chose their experts on the device, and all steps (see
    /// [`DeviceEngineConfig::routing`]).
    pub fn steps_routed_on_device(&self) -> (u64, u64) {
        self.steps_routed_on_device
    }

    /// Prefix cache counters (None when the cache is off); `hit_blocks × block_size` are the
    /// prompt positions served from it.
    pub fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        self.cache.as_ref().map(PrefixCache::stats)
    }

    /// Empties the prefix cache; returns how many blocks it released.
    pub fn flush_prefix_cache(&mut self) -> usize {
        self.cache.as_mut().map_or(0, |c| c.clear().len())
    }

    /// Requests waiting for admission and requests running (those whose prefill runs in
    /// chunks included: they hold keys and values).
    pub fn queue_lengths(&self) -> (usize, usize) {
        let rows = |b: &Option<Running>| b.as_ref().map_or(0, |r| r.rows.len());
        (
            self.waiting.len(),
            rows(&self.running) + rows(&self.prefilling),
        )
    }

    /// Results of a step whose later part failed, held for the next step to hand out.
    pub fn held_results(&self) -> usize {
        self.finished.len()
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        let (w, r) = self.queue_lengths();
        w + r > 0 || !self.finished.is_empty()
    }

    /// Tokens generated so far by a running request (None if unknown, waiting — a
    /// retracted request generates nothing while it waits — or finished).
    pub fn generated_tokens(&self, id: RequestId) -> Option<&[u32]> {
        [&self.running, &self.prefilling]
            .into_iter()
            .flatten()
            .flat_map(|b| &b.rows)
            .find(|r| r.id == id)
            .map(Row::generated)
    }

    /// KV bytes one slot of one sequence takes (keys and values of every layer, in the
    /// cache's dtype).
    fn slot_bytes(&self) -> usize {
        self.model_cfg.num_hidden_layers
            * memory::layer_kv_floats(&self.model_cfg)
            * self.kv_dtype().size_in_bytes()
    }

    /// The dtype the KV cache holds: the forward's own (`auto`, where it holds the forward's
    /// keys and values exactly), or f32.
    fn kv_dtype(&self) -> candle_core::DType {
        self.kv_dtype
    }

    /// Submits all requests and steps until they finish; results in input order. On an
    /// error none of them is left queued or running (the next call's batches are its own).
    pub fn generate(
        &mut self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<GenerateResult>, RolloutError> {
        // An engine that can run no step (weights released or torn) takes nothing in.
        self.check_weights_whole()?;
        generate_all(self, reqs)
    }

    /// Runs one step: one decode token for every running sequence, then the prefill (and
    /// first token) of the waiting requests that fit beside the sequences still running,
    /// which join the batch — or, while a prefill runs in chunks, its next chunk, sampling
    /// and joining only after the last; returns the requests that finished in it.
    ///
    /// A step that fails (a device allocation that fails, above all) fails the requests it
    /// was computing, not the engine: the error names them and says whether the device ran
    /// out of memory; their rows and cache are dropped, the waiting requests stay queued, and
    /// what finished before the failure comes out of the next step. When it is the
    /// newcomers' admission or prefill that failed, the running batch keeps running. A
    /// weight update that failed part way leaves the engine refusing every step until one
    /// succeeds.
    pub fn step(&mut self) -> Result<Vec<GenerateResult>, RolloutError> {
        if let Err(e) = self.check_weights_whole() {
            // Results a failed step held back were made whole before: handed out first.
            if !self.finished.is_empty() {
                return Ok(std::mem::take(&mut self.finished));
            }
            return Err(e);
        }
        let mut results = std::mem::take(&mut self.finished);
        // What finished before a failure is held for the next step.
        if let Err(e) = self.step_into(&mut results) {
            self.finished = results;
            return Err(e);
        }
        Ok(results)
    }

    /// [`DeviceEngine::step`]'s work, what finishes added to `results`. An error names the
    /// requests it dropped; the running batch stays wherever it is still whole.
    fn step_into(&mut self, results: &mut Vec<GenerateResult>) -> Result<(), RolloutError> {
        let mut running = self.running.take();
        if let Some(batch) = running.as_mut() {
            let ids = ids_of(&batch.rows);
            let done = self
                .advance(batch)
                .and_then(|()| self.retire(batch))
                .map_err(|e| requests_failed(ids, e))?;
            results.extend(done);
        }
        let mut running = running.filter(|b| !b.rows.is_empty());
        let joined = self.admit_and_join(&mut running, results);
        let Some(mut batch) = running else {
            return joined;
        };
        if joined.is_ok() {
            trim(&mut batch).map_err(|e| step_failed(&batch.rows, e))?;
        }
        self.running = Some(batch);
        joined
    }

    /// Feeds the prefill running in chunks, if any, its next chunk (joining it to `running`
    /// once fed to its end), then admits the waiting requests that fit beside both,
    /// prefills them and joins them to `running`, what finishes in a first token added to
    /// `results`. An error names the requests it dropped: the newcomers, or both batches
    /// where the join itself failed (`running` is then taken: neither is whole).
    fn admit_and_join(
        &mut self,
        running: &mut Option<Running>,
        results: &mut Vec<GenerateResult>,
    ) -> Result<(), RolloutError> {
        if let Some(chunked) = self.prefilling.take() {
            self.prefill_and_join(chunked, running, results)?;
        }
        // Admission's errors name the newcomers it had taken from the queue.
        match self.admit(running.as_ref())? {
            Some(joining) => self.prefill_and_join(joining, running, results),
            None => Ok(()),
        }
    }

    /// Feeds `joining` its prefill, or its prefill's next chunk, and joins it to `running`
    /// once fed to its end (kept as the prefill in chunks until then), what finishes in its
    /// first token added to `results`; errors as [`DeviceEngine::admit_and_join`]'s.
    fn prefill_and_join(
        &mut self,
        mut joining: Running,
        running: &mut Option<Running>,
        results: &mut Vec<GenerateResult>,
    ) -> Result<(), RolloutError> {
        self.advance(&mut joining)
            .map_err(|e| step_failed(&joining.rows, e))?;
        if !joining.prefilled {
            // Admission runs one prefill in chunks at a time; should a second ever reach
            // here, its requests fail by name rather than the first being overwritten and
            // lost without an answer.
            if self.prefilling.is_some() {
                return Err(step_failed(
                    &joining.rows,
                    RolloutError::InvalidConfig(
                        "a second prefill in chunks while one runs (admission runs one at a time)"
                            .into(),
                    ),
                ));
            }
            self.prefilling = Some(joining);
            return Ok(());
        }
        // The prefilled rows offer their full blocks at once, not only when they retire:
        // requests held back for them (`admit`) read them next step.
        for (b, row) in joining.rows.iter().enumerate() {
            self.offer_or_warn(row, &joining.cache, b);
        }
        let ids = ids_of(&joining.rows);
        results.extend(
            self.retire(&mut joining)
                .map_err(|e| requests_failed(ids, e))?,
        );
        if joining.rows.is_empty() {
            return Ok(());
        }
        // Cached prefixes and tails side by side can leave slots no row uses.
        trim(&mut joining).map_err(|e| step_failed(&joining.rows, e))?;
        let mut ids = running.as_ref().map_or_else(Vec::new, |b| ids_of(&b.rows));
        ids.extend(ids_of(&joining.rows));
        let joined = match running.take() {
            Some(mut batch) => join(&mut batch, joining).map(|()| batch),
            None => Ok(joining),
        };
        *running = Some(joined.map_err(|e| requests_failed(ids, e))?);
        Ok(())
    }

    /// Feeds `batch` one step (its prefill, or its prefill's next chunk, if it has not run
    /// to its end, else one decode token per row), captures its routes and, unless a chunk
    /// left more to feed, samples each row's next token.
    fn advance(&mut self, batch: &mut Running) -> Result<(), RolloutError> {
        let window = self.window();
        let first = batch.cache.slots();
        let prefill = !batch.prefilled;
        // Prompt log-probs need the prefill's logits at every prompt slot.
        let all_logits = prefill && batch.rows.iter().any(Row::asks_prompt_logprobs);
        let layout = if prefill {
            let chunk = self.prefill_chunk(&batch.rows, first);
            prefill_layout(&batch.rows, first, window, chunk)
        } else {
            decode_layout(&batch.rows, first, window)
        };
        let model = self.model()?;
        let routing = self.cfg.routing.for_step(
            batch.rows.len() * layout.time,
            self.model_cfg.top_k(),
            model.routed_expert_bytes(),
            self.device.is_cuda(),
            model.routes_on_device(),
        );
        let out = model.forward_step(
            &Step {
                tokens: &layout.tokens,
                positions: &layout.positions,
                mask: StepMask::Seen(&layout.seen),
                batch: batch.rows.len(),
                time: layout.time,
                all_logits,
                routing,
                score_tiles: self.score_tiles(),
            },
            &mut batch.cache,
        )?;
        self.steps_routed_on_device.0 += u64::from(routing == StepRouting::Device);
        self.steps_routed_on_device.1 += 1;
        self.device_wait += out.device_wait;
        let started = Instant::now();
        capture_routes(
            &mut batch.rows,
            &out.routes,
            &self.geo,
            &layout,
            self.version,
        );
        self.capture_time += started.elapsed();
        if prefill {
            // Every row's position `p` in slot `pad + p` from here on.
            if let Some(order) = gap_order(&batch.rows, first, &layout) {
                batch.cache.permute_slots(&order)?;
            }
            for (row, &end) in batch.rows.iter_mut().zip(&layout.ends) {
                row.pad = first + layout.time - end;
                row.held = end;
            }
            batch.prefilled = batch.rows.iter().all(|r| r.held == r.tokens.len());
        }
        if !batch.prefilled {
            // A chunk with more to feed samples nothing; its prompt log-probs are kept.
            if all_logits {
                let waiting = Instant::now();
                let logits = self.staging.copy_f32(&out.logits)?;
                self.device_wait += waiting.elapsed();
                record_prompt_logprobs(&mut batch.rows, logits, &layout);
            }
            return Ok(());
        }
        // Rows that need only their greedy pick, or only a draw from their whole
        // distribution, get it made on the device; the others' rows of logits are copied to
        // the host, where the CPU engine's sampler reads them.
        let waiting = Instant::now();
        let (rows, slots_per_row, vocab) = out.logits.dims3()?;
        let ways: Vec<PickWay> = batch
            .rows
            .iter()
            .map(|r| {
                let generated = r.tokens.len() - r.prompt_len;
                PickWay::of(&r.request.sampling, generated, vocab, all_logits)
            })
            .collect();
        let picks = if ways.iter().all(|w| *w == PickWay::Host) {
            vec![None; rows]
        } else {
            // Sampling reads each row's last slot (the only one without prompt log-probs).
            let last = out
                .logits
                .narrow(1, slots_per_row.saturating_sub(1), 1)?
                .reshape((rows, vocab))?;
            let streams = batch
                .rows
                .iter_mut()
                .map(|r| (&mut r.rng, &r.request.sampling));
            device_picks(&last, &ways, streams)?
        };
        let copied: Vec<u32> = (0..rows as u32)
            .filter(|&i| picks[i as usize].is_none())
            .collect();
        // The copied rows, `[copied, slots_per_row, vocab]` row-major, in batch order.
        let copied_logits: &[f32] = if copied.is_empty() {
            &[]
        } else if copied.len() == batch.rows.len() {
            self.staging.copy_f32(&out.logits)?
        } else {
            let ids = Tensor::new(copied.as_slice(), out.logits.device())?;
            self.staging.copy_f32(&out.logits.index_select(&ids, 0)?)?
        };
        self.device_wait += waiting.elapsed();
        let row_span = slots_per_row * vocab;
        if all_logits {
            // Every row was copied (none is reduced when prompt log-probs are asked for).
            record_prompt_logprobs(&mut batch.rows, copied_logits, &layout);
        }
        let max_pos = self.model_cfg.max_position_embeddings;
        let mut next_copied = 0;
        let mut slots: Vec<NextTokenSlot<'_>> = Vec::with_capacity(batch.rows.len());
        for (i, row) in batch.rows.iter_mut().enumerate() {
            let logits = match picks[i] {
                Some(pick) => NextTokenLogits::Picked(pick),
                None => {
                    // Sampling reads the row's last slot.
                    let last = next_copied * row_span + row_span - vocab;
                    next_copied += 1;
                    NextTokenLogits::Row(&copied_logits[last..last + vocab])
                }
            };
            slots.push(NextTokenSlot {
                logits,
                params: &row.request.sampling,
                prompt_len: row.prompt_len,
                output_start: row.prompt_logprobs_end(),
                tokens: &mut row.tokens,
                rng: &mut row.rng,
                logprobs: &mut row.logprobs,
                top_logprobs: &mut row.top_logprobs,
                finish: &mut row.finish,
            });
        }
        sample_slots(&mut slots, max_pos);
        Ok(())
    }

    /// Positions each row of the prefill batch `rows` feeds in its next step over `first`
    /// cache slots: all it has left, unless that is a request alone whose step would exceed
    /// the activation budget or `max_prefill_tokens` (admission takes such a request into a
    /// batch of its own), fed in chunks within both ([`memory::prefill_chunk`]).
    fn prefill_chunk(&self, rows: &[Row], first: usize) -> usize {
        match rows {
            [row] => {
                let rest = row.tokens.len() - row.held;
                memory::prefill_chunk(&self.model_cfg, self.prefill_limits(row), first, rest)
            }
            _ => usize::MAX,
        }
    }

    /// The query tiles a step's attention runs in: its scores within a quarter of the
    /// activation budget ([`memory::score_tiles`]).
    fn score_tiles(&self) -> ScoreTiles {
        memory::score_tiles(self.cfg.activation_bytes)
    }

    /// How `row`'s prefill is cut into steps alone: the activation budget, the token cap,
    /// and the positions whose logits its prompt log-probs still need.
    fn prefill_limits(&self, row: &Row) -> memory::PrefillLimits {
        memory::PrefillLimits {
            budget: self.cfg.activation_bytes,
            cap: self.cfg.max_prefill_tokens,
            logits_until: row.prompt_logits_until(),
        }
    }

    /// Sliding window of the attention, if any.
    fn window(&self) -> Option<usize> {
        match self.model_cfg.attention {
            r3_model::AttentionConfig::Gqa { sliding_window, .. } => sliding_window,
            r3_model::AttentionConfig::Mla { .. } => None,
        }
    }

    /// Takes the finished rows out of `batch` (and their rows out of its cache); returns
    /// them as results, in batch order.
    fn retire(&mut self, batch: &mut Running) -> Result<Vec<GenerateResult>, RolloutError> {
        let finished: Vec<usize> = (0..batch.rows.len())
            .filter(|&b| batch.rows[b].finish.is_some())
            .collect();
        for &b in &finished {
            self.offer_or_warn(&batch.rows[b], &batch.cache, b);
        }
        // The highest index first, so the row moved into each place is one that stays.
        let mut gone = finished
            .iter()
            .rev()
            .map(|&b| batch.swap_remove(b))
            .collect::<Result<Vec<_>, _>>()?;
        gone.reverse();
        // A removed row's place stays allocated (moving rows is what removal avoids); once
        // the buffers hold twice the rows left, the places are freed in one copy of those
        // rows, so the memory admission counts (`buffer_rows`) stays within twice the rows.
        let rows = batch.rows.len();
        if rows > 0 && batch.cache.buffer_rows() >= 2 * rows {
            batch.cache.shrink_rows()?;
        }
        // A batch's rows often finish together (greedy runs of one length: all of them at
        // once), so their route tables, each a checked copy of the row's whole route
        // history, are built side by side.
        let started = Instant::now();
        let geo = &self.geo;
        let tables = gone
            .par_iter_mut()
            .map(|row| route_table(geo, row))
            .collect::<Vec<_>>();
        if gone.iter().any(|row| row.capture) {
            self.capture_time += started.elapsed();
        }
        gone.into_iter()
            .zip(tables)
            .map(|(row, routes)| self.result(row, routes?))
            .collect()
    }

    /// The result of a finished (or aborted) row, with its route table.
    fn result(&self, row: Row, routes: Option<RouteTable>) -> Result<GenerateResult, RolloutError> {
        // An empty range asked for (from the prompt's last token) computes nothing and is
        // reported empty.
        let empty = row.prompt_logprob_positions().map(|p| PromptLogprobs {
            start: p.start,
            ..PromptLogprobs::default()
        });
        let mut result = GenerateResult {
            id: row.id,
            prompt_tokens: row.prompt_len,
            output_ids: row.generated().to_vec(),
            output_logprobs: row.logprobs,
            output_top_logprobs: row.top_logprobs,
            prompt_logprobs: row.prompt_logprobs.or(empty),
            finish: row.finish.unwrap_or(FinishReason::Abort),
            cached_tokens: row.cached,
            routes,
            weight_version: self.version,
        };
        if let Some(resume) = &row.resume {
            resume.complete(&mut result)?;
        }
        Ok(result)
    }

    /// Offers the fed positions of `row` (row `b` of `kv`) to the prefix cache, if on. The
    /// cache is a saving, never a result: an offer that fails (its copy's allocation, above
    /// all) is logged and the row goes on without it.
    fn offer_or_warn(&mut self, row: &Row, kv: &KvCache, b: usize) {
        let Some(cache) = self.cache.as_mut() else {
            return;
        };
        if let Err(e) = prefix::offer(cache, row, kv, b, self.version, &self.geo) {
            tracing::warn!(error = %e, "prefix cache offer failed; continuing without it");
        }
    }
}

/// Joins the prefilled batch `joining` to `running` at a step boundary: whichever holds
/// fewer slots is left-padded to the other's count (its rows' pads grow by as much, so each
/// keeps its positions and sees none of the new slots), then the rows and cache rows of
/// `joining` follow those of `running`.
fn join(running: &mut Running, mut joining: Running) -> Result<(), RolloutError> {
    let (have, come) = (running.cache.slots(), joining.cache.slots());
    let shorter = if have < come {
        &mut *running
    } else {
        &mut joining
    };
    let extra = have.abs_diff(come);
    shorter.cache.pad_front(extra)?;
    for row in &mut shorter.rows {
        row.pad += extra;
    }
    running.cache.append_rows(&joining.cache)?;
    running.rows.append(&mut joining.rows);
    Ok(())
}

/// Drops the leading slots that are padding for every row of `batch` (left behind by rows
/// that finished or by a long prompt that joined earlier), so the cache and the attention
/// span stay as short as the rows still running need.
fn trim(batch: &mut Running) -> Result<(), RolloutError> {
    let unused = batch.rows.iter().map(|r| r.pad).min().unwrap_or(0);
    if unused > 0 {
        batch.cache.drop_front(unused)?;
        for row in &mut batch.rows {
            row.pad -= unused;
        }
    }
    Ok(())
}

/// Adds to each row of a prefill step the prompt log-probs it asks for among the positions
/// the step fed (`layout`), from the step's logits `logits` (`[rows, time, vocab]`,
/// row-major): `log softmax(logits[p − 1])[token p]` for prompt positions after the first
/// reported one (as the CPU engine reports them). Positions computed before (an earlier
/// chunk's, or a retracted row's first prefill) are kept; the prefix cache serves none of
/// the others (`prefix::servable`), so each is fed by one of the row's prefill steps.
fn record_prompt_logprobs(rows: &mut [Row], logits: &[f32], layout: &StepLayout) {
    let time = layout.time;
    let span = logits.len() / rows.len().max(1);
    let vocab = span / time.max(1);
    for (b, row) in rows.iter_mut().enumerate() {
        if !row.asks_prompt_logprobs() {
            continue;
        }
        let Some(positions) = row.prompt_logprob_positions() else {
            continue;
        };
        let (skip, end) = (layout.skip[b], layout.ends[b]);
        let fed_from = end - (time - skip);
        let top = row.request.sampling.top_logprobs;
        let tokens = &row.tokens;
        let out = row.prompt_logprobs.get_or_insert_with(|| PromptLogprobs {
            start: positions.start,
            ..PromptLogprobs::default()
        });
        let next = out.start + out.logprobs.len();
        for p in next.max(fed_from)..end.min(positions.end) {
            let at = b * span + (skip + p - fed_from) * vocab;
            let logits = &logits[at..at + vocab];
            // Prompt log-probs are the raw distribution's at any `logprob_scale`, as SGLang's
            // input log-probs are (its temperature-scaled ones are opt-in).
            out.logprobs
                .push(log_softmax_at(logits, tokens[p + 1] as usize));
            if top > 0 {
                out.top_logprobs.push(top_logprobs(logits, top, 1.0));
            }
        }
    }
}

impl StepEngine for DeviceEngine {
    fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, RolloutError> {
        DeviceEngine::submit(self, req)
    }

    fn step(&mut self) -> Result<Vec<GenerateResult>, RolloutError> {
        DeviceEngine::step(self)
    }

    fn has_work(&self) -> bool {
        DeviceEngine::has_work(self)
    }

    fn abort_all_of(&mut self, ids: &[RequestId]) {
        for &id in ids {
            if let Err(e) = self.abort(id) {
                tracing::warn!(error = %e, id, "a failed generate's request could not be aborted");
            }
        }
        // Results held back for the next step belong to this call too.
        self.finished.retain(|r| !ids.contains(&r.id));
    }
}

/// The route table `row` returns (when the model routes, the row captured and its request
/// asked for routes), its captured rows then dropped.
fn route_table(geo: &RouteGeometry, row: &mut Row) -> Result<Option<RouteTable>, RolloutError> {
    if !(row.capture && row.request.return_routes && geo.row() > 0) {
        return Ok(None);
    }
    let table = geo.table(
        &row.routes,
        &row.route_versions,
        row.request.routed_experts_start_len,
    )?;
    row.routes = Vec::new();
    Ok(Some(table))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::GenerateRequest;
    use crate::sampler::SamplingParams;
    use r3_model::RandomInit;

    /// `memory::tests::qwen_tiny` with seeded random weights (experts fused).
    fn qwen_tiny_weights(seed: u64) -> (r3_model::Config, crate::TensorMap) {
        let cfg = memory::tests::qwen_tiny();
        let tensors = r3_model::Weights::random(&cfg, &RandomInit::new(seed), &Device::Cpu)
            .and_then(|w| w.fuse_experts(&cfg))
            .expect("weights")
            .into_map();
        (cfg, tensors)
    }

    /// Rows retiring one by one free their KV places once they are half the buffer (one
    /// copy of the rows left), so the buffers never hold twice the rows still running —
    /// what admission counts; and every request's tokens are those it gets alone, its
    /// log-probs within a batch's rounding of them.
    #[test]
    fn retired_rows_places_are_freed_as_the_batch_shrinks() {
        let (cfg, tensors) = qwen_tiny_weights(5);
        let config = DeviceEngineConfig {
            max_running: 8,
            kv_cache_bytes: 64 << 20,
            prefix_cache: false,
            ..DeviceEngineConfig::default()
        };
        let request = |i: usize| {
            GenerateRequest::new(vec![3 + i as u32, 9, 14], SamplingParams::greedy(1 + 2 * i))
        };
        let mut engine = DeviceEngine::new(cfg.clone(), &tensors, config.clone()).expect("engine");
        let ids: Vec<RequestId> = (0..8)
            .map(|i| engine.submit(request(i)).expect("submit"))
            .collect();
        let mut done: Vec<GenerateResult> = Vec::new();
        let mut shrunk = 0;
        while engine.has_work() {
            done.extend(engine.step().expect("step"));
            if let Some(batch) = &engine.running {
                let (rows, held) = (batch.rows.len(), batch.cache.buffer_rows());
                assert!(held < 2 * rows, "{held} rows held for {rows} running");
                shrunk += usize::from(held < 8);
            }
        }
        assert!(shrunk > 0, "the places were freed");
        for (i, id) in ids.iter().enumerate() {
            let got = done.iter().find(|r| r.id == *id).expect("a result");
            let mut alone =
                DeviceEngine::new(cfg.clone(), &tensors, config.clone()).expect("engine");
            let want = alone.generate(vec![request(i)]).expect("alone").remove(0);
            assert_eq!(got.output_ids, want.output_ids, "request {i}");
            // A batch's GEMMs round their sums in another order than one row's.
            for (a, b) in got.output_logprobs.iter().zip(&want.output_logprobs) {
                assert!((a - b).abs() < 1e-5, "request {i}: {a} against {b} alone");
            }
        }
    }

    /// Whatever the KV budget, the running batch never holds more than admission promised
    /// (its rows' buffers × the capacity for the slots its furthest row may reach), when a
    /// prefill in chunks of 16 joins a batch that decoded meanwhile and another request is
    /// admitted between its chunks; and every request finishes.
    #[test]
    fn the_kv_budget_holds_while_a_prefill_runs_in_chunks() {
        use r3_model::layers::attention::kv_capacity_for;
        let (cfg, tensors) = qwen_tiny_weights(7);
        // (arrival step, prompt length, new tokens): a long-running row, a prompt of 60 fed
        // in 4 chunks once that row holds more slots than 60, and a row arriving between.
        let arrivals = [(0, 4, 120), (70, 60, 100), (71, 4, 100)];
        let slot_bytes = 2 * memory::layer_kv_floats(&cfg) * 4;
        // From the longest request alone to three rows past the longest reach, 4 slots apart
        // (an estimate off by the chunks' 3 decode steps is off by 2 rows × 4 slots here).
        let alone = kv_capacity_for(160);
        let mut chunked = 0;
        for budget in (alone..3 * kv_capacity_for(200))
            .step_by(4)
            .map(|s| s * slot_bytes)
        {
            let config = DeviceEngineConfig {
                kv_cache_bytes: budget,
                max_prefill_tokens: Some(16),
                prefix_cache: false,
                ..DeviceEngineConfig::default()
            };
            let mut engine = DeviceEngine::new(cfg.clone(), &tensors, config).expect("engine");
            let mut done = 0;
            for step in 0..2000 {
                for &(at, len, new) in &arrivals {
                    if at == step {
                        let prompt = (0..len as u32).map(|t| 3 + t % 50).collect();
                        let req = GenerateRequest::new(prompt, SamplingParams::greedy(new));
                        engine.submit(req).expect("fits alone");
                    }
                }
                done += engine.step().expect("step").len();
                chunked += usize::from(engine.prefilling.is_some());
                if let Some(batch) = &engine.running {
                    let reach = batch.rows.iter().map(Row::reach).max().unwrap_or(0);
                    let held = batch.cache.buffer_rows().max(batch.rows.len());
                    let holds = held * kv_capacity_for(reach) * slot_bytes;
                    assert!(
                        holds <= budget,
                        "budget {budget}, step {step}: {holds} held"
                    );
                }
                if done == arrivals.len() {
                    break;
                }
            }
            assert_eq!(done, arrivals.len(), "budget {budget}: all finish");
        }
        assert!(chunked > 0, "a prefill ran in chunks");
    }

    /// The steps admission counts for a prefill in chunks (`prefill_steps`, which the KV
    /// budget's join delay rests on) are the steps it takes, whether its prompt log-probs
    /// send every position through the head (from 0, from the middle, a resumed request
    /// whose reported prompt ends before its fed one) or none (not asked, or asked from the
    /// last prompt token, SGLang's default, which computes nothing).
    #[test]
    fn admission_counts_the_steps_a_prefill_in_chunks_takes() {
        use crate::MergePolicy;
        let (cfg, tensors) = qwen_tiny_weights(9);
        let shape = memory::StepShape {
            rows: 1,
            time: 12,
            slots: 12,
            logit_positions: 12,
        };
        let config = DeviceEngineConfig {
            activation_bytes: memory::step_activation_bytes(&cfg, shape, ScoreTiles::WHOLE),
            prefix_cache: false,
            ..DeviceEngineConfig::default()
        };
        let request = |from: Option<usize>| {
            let prompt = (0..60u32).map(|t| 5 + t % 40).collect();
            let mut r = GenerateRequest::new(prompt, SamplingParams::greedy(4));
            r.sampling.prompt_logprobs_from = from;
            r
        };
        // Steps until `id` (waiting, next to be admitted) samples, and the steps admission
        // counted for it.
        let run = |engine: &mut DeviceEngine, id: RequestId| {
            let row = engine.waiting.front().expect("waiting");
            assert_eq!(row.id, id);
            let len = row.tokens.len();
            let counted = memory::prefill_steps(&cfg, engine.prefill_limits(row), 0, len);
            let mut steps = 0;
            while engine.generated_tokens(id).is_none_or(<[u32]>::is_empty) {
                engine.step().expect("step");
                steps += 1;
            }
            (steps, counted)
        };
        let mut counts = Vec::new();
        for from in [None, Some(59), Some(30), Some(0)] {
            let mut engine =
                DeviceEngine::new(cfg.clone(), &tensors, config.clone()).expect("engine");
            let id = engine.submit(request(from)).expect("submit");
            let (steps, counted) = run(&mut engine, id);
            assert_eq!(steps, counted, "from {from:?}");
            counts.push(steps);
            while engine.has_work() {
                engine.step().expect("step");
            }
            if from == Some(0) {
                // Resumed after two tokens: 62 tokens fed, log-probs reported up to 60.
                let id = engine.submit(request(from)).expect("submit");
                while engine.generated_tokens(id).is_none_or(|t| t.len() < 2) {
                    engine.step().expect("step");
                }
                let partial = engine.abort(id).expect("abort").expect("running");
                let rid = engine
                    .resume(partial, MergePolicy::KeepPerTokenOrigin)
                    .expect("resume");
                let (steps, counted) = run(&mut engine, rid);
                assert_eq!(steps, counted, "resumed");
            }
        }
        assert_eq!(
            counts[0], counts[1],
            "from the last token computes nothing: {counts:?}"
        );
        assert!(counts[3] > counts[0] && counts[2] > counts[0], "{counts:?}");
    }

    #[test]
    fn a_cuda_allocation_failure_reads_as_out_of_memory() {
        let oom = RolloutError::Candle(candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        ));
        assert!(r3_model::device::reads_as_out_of_memory(&oom));
        let other = RolloutError::Candle(candle_core::Error::Msg("shape mismatch".into()));
        assert!(!r3_model::device::reads_as_out_of_memory(&other));
        let failed = step_failed(&[], oom);
        assert!(!failed.is_client_error());
        assert!(failed.to_string().contains("out of memory"), "{failed}");
    }
}
