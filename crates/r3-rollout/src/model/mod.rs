//! The engine's own model: weights in the engine layout and a batched forward over a flat
//! batch of tokens from many sequences (prefill chunks and decode tokens mixed), reading and
//! writing the paged KV cache, optionally capturing the routed experts of every token.

pub mod attention;
pub mod moe;
pub mod tensors;
pub mod weights;

use r3_model::Config;
use r3_routing::ExpertPlacement;

use crate::dtype::{Dtype, RouterDtype};
use crate::error::RolloutError;
use crate::kernels::attention::SeqSpan;
use crate::kernels::ops::{rms_norm_into, rms_norm_rows, Rope};
use crate::kv_pool::{KvLayout, KvPool};
use attention::{attention_forward, AttnGeometry};
use moe::{ffn_forward, moe_forward, CaptureSlot};
use tensors::TensorMap;
use weights::{MlpWeights, ModelWeights};

/// One batched forward's input: flat tokens grouped in contiguous per-sequence spans.
#[derive(Debug)]
pub struct BatchInput<'a> {
    /// Token ids of every span, concatenated.
    pub tokens: &'a [u32],
    /// Spans in flat order; their blocks must already cover every position they write.
    pub spans: &'a [SeqSpan],
    /// Flat token indices whose next-token logits are wanted.
    pub logit_rows: &'a [usize],
}

/// One batched forward's output.
#[derive(Debug)]
pub struct BatchOutput {
    /// `[logit_rows.len(), vocab]` logits (f32).
    pub logits: Vec<f32>,
    /// `[tokens, moe_layers, top_k]` logical expert ids when capture was on.
    pub routes: Option<Vec<u16>>,
    /// Wall time spent on capture inside the forward (buffer and per-layer id copies).
    pub capture_time: std::time::Duration,
}

/// A point of the forward pass whose output can be inspected (see
/// [`InferenceModel::first_non_finite_stage`]), named by the HF module that computes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The embedding rows (`model.embed_tokens`).
    Embedding,
    /// Layer `i`'s attention output (`model.layers.i.self_attn`).
    Attention(usize),
    /// Layer `i`'s MLP or MoE block output (`model.layers.i.mlp`).
    Mlp(usize),
    /// The final norm (`model.norm`).
    FinalNorm,
    /// The logits (`lm_head`).
    LmHead,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stage::Embedding => f.write_str("the embeddings (model.embed_tokens)"),
            Stage::Attention(i) => write!(f, "layer {i}'s attention (model.layers.{i}.self_attn)"),
            Stage::Mlp(i) => write!(f, "layer {i}'s MLP / MoE block (model.layers.{i}.mlp)"),
            Stage::FinalNorm => f.write_str("the final norm (model.norm)"),
            Stage::LmHead => f.write_str("the logits (lm_head)"),
        }
    }
}

/// The inference model.
#[derive(Debug)]
pub struct InferenceModel {
    cfg: Config,
    dtype: Dtype,
    router_dtype: RouterDtype,
    weights: ModelWeights,
    geometry: AttnGeometry,
    rope: Rope,
    placement: Option<ExpertPlacement>,
}

impl InferenceModel {
    /// Builds the model from a config and HF-named tensors (router in the model dtype).
    pub fn new(cfg: Config, tensors: &TensorMap, dtype: Dtype) -> Result<Self, RolloutError> {
        Self::with_router(cfg, tensors, dtype, RouterDtype::Model)
    }

    /// [`InferenceModel::new`] with the router's precision chosen separately.
    pub fn with_router(
        cfg: Config,
        tensors: &TensorMap,
        dtype: Dtype,
        router_dtype: RouterDtype,
    ) -> Result<Self, RolloutError> {
        let weights = ModelWeights::from_tensors_with_router(&cfg, tensors, dtype, router_dtype)?;
        if let Some(m) = &cfg.moe {
            if m.num_experts > u16::MAX as usize {
                return Err(RolloutError::Unsupported(format!(
                    "{} experts: route capture holds at most 65535",
                    m.num_experts
                )));
            }
        }
        let geometry = AttnGeometry::new(&cfg);
        let rope = Rope::new(&cfg.rope);
        Ok(InferenceModel {
            cfg,
            dtype,
            router_dtype,
            weights,
            geometry,
            rope,
            placement: None,
        })
    }

    /// Replaces the weights (same config) from HF-named tensors.
    pub fn load_weights(&mut self, tensors: &TensorMap) -> Result<(), RolloutError> {
        self.weights
            .refill(&self.cfg, tensors, self.dtype, self.router_dtype)
    }

    /// Replaces the weights with ones already built for this model's config and dtype.
    pub fn set_weights(&mut self, weights: ModelWeights) {
        self.weights = weights;
    }

    /// Executes experts on physical slots of `placement` (EPLB replicas); captured ids stay
    /// logical. `None` restores one slot per expert.
    pub fn set_placement(
        &mut self,
        placement: Option<ExpertPlacement>,
    ) -> Result<(), RolloutError> {
        if let Some(p) = &placement {
            if p.num_logical() != self.cfg.num_experts() {
                return Err(RolloutError::InvalidConfig(format!(
                    "placement has {} logical experts, the model {}",
                    p.num_logical(),
                    self.cfg.num_experts()
                )));
            }
        }
        self.placement = placement;
        Ok(())
    }

    /// The model config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Compute precision.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Router precision.
    pub fn router_dtype(&self) -> RouterDtype {
        self.router_dtype
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> usize {
        self.weights.size_bytes()
    }

    /// KV geometry for a pool of `block_size`-token blocks.
    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        let (k_dim, v_dim) = self.geometry.kv_dims();
        KvLayout {
            num_layers: self.cfg.num_hidden_layers,
            k_dim,
            v_dim,
            block_size,
        }
    }

    /// Number of route columns (MoE layers) and experts per token.
    pub fn route_shape(&self) -> (usize, usize) {
        (self.cfg.layer_layout().moe_layers().len(), self.cfg.top_k())
    }

    /// Runs the batch through the model. Writes every token's keys and values into `pool`.
    pub fn forward(
        &mut self,
        pool: &mut KvPool,
        input: &BatchInput,
        capture: bool,
    ) -> Result<BatchOutput, RolloutError> {
        self.forward_watched(pool, input, capture, &mut |_, _| true)?
            .ok_or_else(|| RolloutError::Weights("a forward pass stopped without a watch".into()))
    }

    /// The first stage of the forward over `input` whose output holds NaN or ±inf (None when
    /// every output is finite): the diagnostic re-run of a rollout that produced non-finite
    /// log-probs. Logits are computed for every row of `input`.
    pub fn first_non_finite_stage(
        &mut self,
        pool: &mut KvPool,
        input: &BatchInput,
    ) -> Result<Option<Stage>, RolloutError> {
        let mut found = None;
        self.forward_watched(pool, input, false, &mut |stage, out| {
            if out.iter().all(|v| v.is_finite()) {
                return true;
            }
            found = Some(stage);
            false
        })?;
        Ok(found)
    }

    /// [`InferenceModel::forward`] showing every stage's output to `watch`, which stops the
    /// pass (None) by returning false.
    fn forward_watched(
        &mut self,
        pool: &mut KvPool,
        input: &BatchInput,
        capture: bool,
        watch: &mut dyn FnMut(Stage, &[f32]) -> bool,
    ) -> Result<Option<BatchOutput>, RolloutError> {
        let t = input.tokens.len();
        let hidden = self.cfg.hidden_size;
        let bs = pool.layout().block_size;
        let mut positions = Vec::with_capacity(t);
        let mut slots = Vec::with_capacity(t);
        for s in input.spans {
            for i in 0..s.num_tokens {
                let p = s.start_pos + i;
                positions.push(p);
                slots.push((s.blocks[p / bs], p % bs));
            }
        }
        let max_pos = positions.iter().copied().max().unwrap_or(0);
        self.rope.ensure(max_pos + 1);
        let (cols, top_k) = self.route_shape();
        let mut capture_time = std::time::Duration::ZERO;
        let mut routes = (capture && cols > 0).then(|| {
            let start = std::time::Instant::now();
            let buffer = vec![0u16; t * cols * top_k];
            capture_time += start.elapsed();
            buffer
        });
        let eps = self.cfg.rms_norm_eps as f32;
        let dtype = self.dtype;
        // In bf16 mode every boundary below rounds (see `Dtype`): embeddings are already bf16
        // values, norm outputs and the residual stream after each addition are rounded here,
        // projections, attention and MoE outputs inside their ops.
        let mut x = vec![0f32; t * hidden];
        for (row, &tok) in x.chunks_exact_mut(hidden).zip(input.tokens) {
            let tok = tok as usize;
            row.copy_from_slice(&self.weights.embed[tok * hidden..(tok + 1) * hidden]);
        }
        if !watch(Stage::Embedding, &x) {
            return Ok(None);
        }
        let mut h = vec![0f32; t * hidden];
        for (li, layer) in self.weights.layers.iter().enumerate() {
            rms_norm_into(&x, &mut h, &layer.input_norm, eps);
            dtype.round_activations(&mut h);
            let a = attention_forward(
                self.dtype,
                &layer.attn,
                &self.geometry,
                &self.rope,
                pool,
                li,
                input.spans,
                &positions,
                &slots,
                &h,
            );
            if !watch(Stage::Attention(li), &a) {
                return Ok(None);
            }
            x.iter_mut().zip(&a).for_each(|(xv, av)| *xv += av);
            dtype.round_activations(&mut x);
            rms_norm_into(&x, &mut h, &layer.post_norm, eps);
            dtype.round_activations(&mut h);
            let m = match &layer.mlp {
                MlpWeights::Dense(f) => ffn_forward(dtype, f, &h, t, true),
                MlpWeights::Moe(mw) => {
                    let capture = routes.as_mut().map(|ids| CaptureSlot {
                        ids: ids.as_mut_slice(),
                        spent: &mut capture_time,
                        stride: cols * top_k,
                        offset: mw.column * top_k,
                    });
                    moe_forward(dtype, mw, self.placement.as_ref(), &h, t, capture)?
                }
            };
            if !watch(Stage::Mlp(li), &m) {
                return Ok(None);
            }
            x.iter_mut().zip(&m).for_each(|(xv, mv)| *xv += mv);
            dtype.round_activations(&mut x);
        }
        // Final norm and lm_head only for the rows whose logits are wanted.
        let n = input.logit_rows.len();
        let mut last = Vec::with_capacity(n * hidden);
        for &r in input.logit_rows {
            last.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        rms_norm_rows(&mut last, &self.weights.norm, eps);
        dtype.round_activations(&mut last);
        if !watch(Stage::FinalNorm, &last) {
            return Ok(None);
        }
        let vocab = self.cfg.vocab_size;
        let mut logits = vec![0f32; n * vocab];
        self.weights.lm_head.forward(&last, n, &mut logits, true);
        if !watch(Stage::LmHead, &logits) {
            return Ok(None);
        }
        Ok(Some(BatchOutput {
            logits,
            routes,
            capture_time,
        }))
    }
}
