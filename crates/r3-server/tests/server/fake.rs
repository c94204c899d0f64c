//! A deterministic fake engine for testing the HTTP layer: each step appends one token per
//! running request by a fixed rule, and routes are a fixed function of the token at each
//! position, so tests can compute every expected value by hand.

use std::path::Path;
use std::time::{Duration, Instant};

use r3_rollout::prefix_cache::PrefixCacheStats;
use r3_rollout::{
    FinishReason, GenerateRequest, GenerateResult, PartialRollout, RequestId, RolloutError,
};
use r3_routing::wire::WireShape;
use r3_routing::{LayerLayout, LayerSpace, RouteTable};
use r3_server::{InferenceBackend, ModelSummary, ServerConfig, ServerLimits};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

pub const VOCAB: usize = 64;
pub const MAX_POS: usize = 128;
pub const EOS: u32 = 1;
pub const TOP_K: usize = 2;
pub const EXPERTS: usize = 8;
/// A prompt starting with this token fails the step it runs in as the device engine fails
/// one (its request named in `StepFailed`, the device out of memory): that request is
/// dropped, the others advance, and what finished in that step comes out of the next one.
pub const POISON: u32 = 63;
/// Layer 0 is dense, layers 1 and 2 are MoE (the wire carries all 3).
pub const MOE_LAYERS: [usize; 2] = [1, 2];

/// A prompt starting with this id reports all but its last token as a prefix-cache hit.
pub const CACHED: u32 = 62;

/// The fake engine's `cached_tokens` for `prompt`: all but its last token when it starts with
/// [`CACHED`], none otherwise.
pub fn cached_tokens(prompt: &[u32]) -> usize {
    if prompt.first() == Some(&CACHED) {
        prompt.len() - 1
    } else {
        0
    }
}

/// The fake servers' configuration: small limits, seed 0.
pub fn config() -> ServerConfig {
    ServerConfig {
        limits: ServerLimits {
            max_body_bytes: 1 << 16,
            max_new_tokens: 32,
            default_max_new_tokens: 8,
            max_batch_requests: 16,
        },
        seed: 0,
        model_name: "models/fake".into(),
        served_model_name: "fake".into(),
        return_routed_experts_by_default: false,
        ..ServerConfig::default()
    }
}

/// The fake model's wire shape (3 layers, MoE layers 1 and 2) with rows from `start`.
pub fn wire_shape(start: usize) -> WireShape {
    WireShape::new(3, TOP_K, EXPERTS)
        .with_start_len(start)
        .with_layout(LayerLayout::new(3, MOE_LAYERS.to_vec()).expect("layout"))
        .expect("shape")
}

/// The next token after `prev` for a request with `seed` (wrapping: a negative client seed
/// arrives as its two's complement, near `u64::MAX`).
pub fn next_token(prev: u32, seed: u64) -> u32 {
    ((u64::from(prev) * 5 + 3).wrapping_add(seed) % VOCAB as u64) as u32
}

/// The reported log-prob of `token`.
pub fn logprob(token: u32) -> f32 {
    -(token as f32) / 100.0
}

/// Experts of the token `tok` in MoE column `c`.
pub fn experts(tok: u32, c: usize) -> [u32; 2] {
    let a = (tok as usize + c) % EXPERTS;
    [a as u32, ((a + 1) % EXPERTS) as u32]
}

/// What the fake generates for `prompt` (stop ids as given, eos included by the caller).
pub fn expected(prompt: &[u32], max_new: usize, stop: &[u32], seed: u64) -> (Vec<u32>, bool) {
    let mut out = Vec::new();
    let mut prev = *prompt.last().expect("non-empty prompt");
    while out.len() < max_new {
        let t = next_token(prev, seed);
        out.push(t);
        if stop.contains(&t) {
            return (out, true);
        }
        prev = t;
    }
    (out, false)
}

/// Route table of positions `[start, tokens.len() - 1)` in MoE-only space.
pub fn routes_of(tokens: &[u32], start: usize) -> RouteTable {
    let rows = tokens.len().saturating_sub(1);
    let ids: Vec<i64> = (start..rows)
        .flat_map(|p| (0..MOE_LAYERS.len()).flat_map(move |c| experts(tokens[p], c)))
        .map(i64::from)
        .collect();
    RouteTable::from_flat(
        EXPERTS,
        TOP_K,
        LayerSpace::MoeOnly,
        MOE_LAYERS.to_vec(),
        start,
        &ids,
    )
    .expect("valid fake routes")
}

struct Running {
    id: RequestId,
    req: GenerateRequest,
    out: Vec<u32>,
}

/// The fake engine. With `min_batch = k`, steps make no progress until k requests are in
/// flight (or 10 s pass): a server that serialised requests would never get there.
pub struct FakeEngine {
    running: Vec<Running>,
    /// Results of a failed step, handed out by the next.
    held: Vec<GenerateResult>,
    next_id: RequestId,
    version: u64,
    min_batch: usize,
    gate_since: Option<Instant>,
}

impl FakeEngine {
    pub fn new(min_batch: usize) -> Self {
        FakeEngine {
            running: Vec::new(),
            held: Vec::new(),
            next_id: 0,
            version: 0,
            min_batch,
            gate_since: None,
        }
    }

    fn result(&self, r: Running, finish: FinishReason) -> GenerateResult {
        let mut tokens = r.req.input_ids.clone();
        tokens.extend(&r.out);
        GenerateResult {
            id: r.id,
            prompt_tokens: r.req.input_ids.len(),
            output_logprobs: r.out.iter().map(|&t| logprob(t)).collect(),
            output_top_logprobs: Vec::new(),
            prompt_logprobs: None,
            output_ids: r.out,
            finish,
            cached_tokens: cached_tokens(&r.req.input_ids),
            routes: Some(routes_of(&tokens, r.req.routed_experts_start_len)),
            weight_version: self.version,
        }
    }
}

impl InferenceBackend for FakeEngine {
    fn summary(&self) -> ModelSummary {
        ModelSummary {
            model_type: "fake_moe".into(),
            vocab_size: VOCAB,
            max_position_embeddings: MAX_POS,
            layout: LayerLayout::new(3, MOE_LAYERS.to_vec()).expect("layout"),
            top_k: TOP_K,
            num_experts: EXPERTS,
            eos_token_ids: vec![EOS],
        }
    }

    fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, RolloutError> {
        let id = self.next_id;
        self.next_id += 1;
        self.running.push(Running {
            id,
            req,
            out: Vec::new(),
        });
        Ok(id)
    }

    fn step(&mut self) -> Result<Vec<GenerateResult>, RolloutError> {
        if self.running.len() < self.min_batch {
            let since = *self.gate_since.get_or_insert_with(Instant::now);
            if since.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(2));
                return Ok(Vec::new());
            }
        }
        self.min_batch = 0;
        let poisoned: Vec<RequestId> = self
            .running
            .iter()
            .filter(|r| r.req.input_ids.first() == Some(&POISON))
            .map(|r| r.id)
            .collect();
        self.running.retain(|r| !poisoned.contains(&r.id));
        let mut done = std::mem::take(&mut self.held);
        let mut still = Vec::new();
        for mut r in std::mem::take(&mut self.running) {
            let prev = r
                .out
                .last()
                .or(r.req.input_ids.last())
                .copied()
                .unwrap_or(0);
            let t = next_token(prev, r.req.sampling.seed);
            r.out.push(t);
            if r.req.sampling.stops_at(t) {
                done.push(self.result(r, FinishReason::Stop { token: t }));
            } else if r.out.len() >= r.req.sampling.max_new_tokens {
                done.push(self.result(r, FinishReason::Length));
            } else {
                still.push(r);
            }
        }
        self.running = still;
        if !poisoned.is_empty() {
            self.held = done;
            return Err(RolloutError::StepFailed {
                requests: poisoned.into_boxed_slice(),
                out_of_memory: true,
                source: Box::new(RolloutError::InvalidConfig(
                    "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
                )),
            });
        }
        Ok(done)
    }

    fn in_flight(&self) -> usize {
        self.running.len() + self.held.len()
    }

    fn abort(&mut self, id: RequestId) -> Result<Option<PartialRollout>, RolloutError> {
        let Some(i) = self.running.iter().position(|r| r.id == id) else {
            return Ok(None);
        };
        let r = self.running.remove(i);
        let seed = r.req.sampling.seed;
        let cached = cached_tokens(&r.req.input_ids);
        Ok(Some(PartialRollout {
            output_logprobs: r.out.iter().map(|&t| logprob(t)).collect(),
            output_top_logprobs: Vec::new(),
            prompt_logprobs: None,
            output_ids: r.out,
            request: r.req,
            routes: None,
            rng: ChaCha8Rng::seed_from_u64(seed),
            weight_version: self.version,
            cached_tokens: cached,
        }))
    }

    fn update_weights_from_dir(&mut self, dir: &Path) -> Result<u64, RolloutError> {
        if !dir.join("model.safetensors").exists() {
            // What the real loader reports for a directory without weights.
            return Err(RolloutError::WeightDir {
                dir: dir.to_path_buf(),
                source: Box::new(r3_model::ModelError::Checkpoint {
                    path: dir.to_path_buf(),
                    msg: "no model.safetensors".into(),
                }),
            });
        }
        self.version += 1;
        Ok(self.version)
    }

    fn weight_version(&self) -> u64 {
        self.version
    }

    fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        None
    }

    fn generated_tokens(&self, id: RequestId) -> Option<Vec<u32>> {
        self.running
            .iter()
            .find(|r| r.id == id)
            .map(|r| r.out.clone())
    }
}
