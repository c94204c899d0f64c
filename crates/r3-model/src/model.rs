//! The decoder-only MoE model: embeddings → decoder layers → norm → lm_head, run in f32
//! over a right-padded batch with routing given as an argument; [`decode`] runs it one step
//! at a time over a KV cache.

pub mod decode;
pub mod head_positions;
pub mod head_scores;
mod recompute;
pub mod shared_prefix;
pub mod step_mask;

pub use head_positions::HeadPositions;
use head_scores::head_scores;
pub use head_scores::ScoreTargets;
pub use recompute::LayerRecompute;
use recompute::RecomputeInputs;
use shared_prefix::SharedPrefixes;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Shape, Tensor, Var};

use crate::config::{AttentionConfig, Config};
use crate::error::{ModelError, Result};
use crate::layers::attention::mla::MlaAttention;
use crate::layers::attention::rope::{Rope, RopeTables};
use crate::layers::attention::{AttentionMask, GqaAttention, ScoreTiles, SlotRows};
use crate::layers::embedding_rows::{embedding_rows, rows_dtype};
use crate::layers::gather_rows::GatherRows;
use crate::layers::linear::Linear;
use crate::layers::mlp::SwiGlu;
use crate::layers::moe::divergence::{self, Divergence};
use crate::layers::moe::expert_gemm::ExpertGemmInputs;
use crate::layers::moe::padded_experts::PaddedExpertOps;
use crate::layers::moe::{Gates, MoeBlock, RoutedRows};
use crate::layers::norm::RmsNorm;
use crate::precision::{Precision, WeightGradients};
use crate::routing_mode::{
    plan_replay, record_tables, verify_replay, LayerPlan, ModelShape, ReplayPlan, ReplayProof,
    Routing,
};
use crate::spec::{
    attention_prefix, dense_mlp_prefix, input_norm, post_attention_norm, weight, EMBED, FINAL_NORM,
    LM_HEAD, SWIGLU_HF,
};
use crate::weights::Weights;
use r3_routing::RouteTable;

/// A right-padded batch of token sequences.
#[derive(Debug, Clone)]
pub struct Batch {
    input_ids: Tensor,
    /// `input_ids` on the host, flattened (the embedding's backward groups positions by
    /// token from them).
    host_ids: Vec<u32>,
    lengths: Vec<usize>,
    tokens: Vec<Vec<u32>>,
    /// Whether a training forward computes the positions its sequences hold alike once
    /// ([`Batch::sharing_prefixes`]).
    share_prefixes: bool,
}

impl Batch {
    /// Pads `sequences` on the right with `pad_id` into a `[B, T]` tensor.
    pub fn new(sequences: &[Vec<u32>], pad_id: u32, device: &Device) -> Result<Self> {
        if sequences.is_empty() {
            return Err(ModelError::Input("empty batch".into()));
        }
        if let Some(b) = sequences.iter().position(|s| s.is_empty()) {
            return Err(ModelError::Input(format!("sequence {b} is empty")));
        }
        let t = sequences.iter().map(Vec::len).max().unwrap_or(0);
        let mut flat = Vec::with_capacity(sequences.len() * t);
        for s in sequences {
            flat.extend_from_slice(s);
            flat.extend(std::iter::repeat_n(pad_id, t - s.len()));
        }
        Ok(Batch {
            input_ids: Tensor::from_slice(&flat, (sequences.len(), t), device)?,
            host_ids: flat,
            lengths: sequences.iter().map(Vec::len).collect(),
            tokens: sequences.to_vec(),
            share_prefixes: false,
        })
    }

    /// This batch, its forwards computing the positions its sequences hold alike once
    /// (`share`: a GRPO group's prompt, scored once for its samples; see
    /// [`shared_prefix`]). The values are the unshared forward's to float rounding. A
    /// forward that returns hidden states runs unshared; a recomputing one keeps each
    /// layer's computed rows.
    pub fn sharing_prefixes(mut self, share: bool) -> Self {
        self.share_prefixes = share;
        self
    }

    /// `[B, T]` u32 token ids.
    pub fn input_ids(&self) -> &Tensor {
        &self.input_ids
    }

    /// `input_ids` on the host, row-major `[B·T]`: what was uploaded.
    pub fn host_ids(&self) -> &[u32] {
        &self.host_ids
    }

    /// Real length of each sequence.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// The unpadded sequences.
    pub fn sequences(&self) -> &[Vec<u32>] {
        &self.tokens
    }

    /// Padded length `T`.
    pub fn seq_len(&self) -> usize {
        self.lengths.iter().copied().max().unwrap_or(0)
    }
}

/// Results of one forward call.
#[derive(Debug)]
pub struct ForwardOutput {
    /// The logits of the positions `head` names: `[B, T − from, vocab]` for
    /// [`HeadPositions::From`] (padding positions hold garbage), `[P, vocab]` for
    /// [`HeadPositions::Spans`]; from [`Model::forward_scores`] instead `[P, 2]`, each
    /// position's target log-prob and entropy (P the positions `head` names)
    pub logits: Tensor,
    /// The positions `logits` covers (every one, `From(0)`, unless the forward was asked for
    /// fewer: [`Model::forward_head`])
    pub head: HeadPositions,
    /// `Record`: one MoE-only route table per sequence, one row per real token
    pub routes: Option<Vec<RouteTable>>,
    /// `Replay`: what was replayed, verified against the tables
    pub replay: Option<ReplayProof>,
    /// with `capture_hidden`: embeddings, each layer's output except the last, and the
    /// final normed states (HF `output_hidden_states`), each `[B, T, H]`
    pub hidden_states: Option<Vec<Tensor>>,
    /// wall time of the host work `Record` / `Replay` add to a `Native` forward, timed where
    /// it runs: checking the tables and laying them out per layer, putting their ids in
    /// place of the routers' own, verifying and building the proof, recording the tables.
    /// Zero for `Native`. Everything else is the same computation in every mode.
    pub routing_overhead: Duration,
    /// Per sequence, what of it another sequence's rows stood for
    /// ([`Batch::sharing_prefixes`]); all 0 unshared.
    pub shared_lens: Vec<SharedLen>,
    /// The MoE layers whose routing waited for the device, and the host's time in those
    /// waits (on a GPU each drains the queued work before the router's choice is read).
    pub routing_waits: RoutingWaits,
}

/// The forward's waits for the device inside its MoE layers: a native layer reads its
/// router's choice to plan its experts; a replay forcing every row of a router that selects
/// on the device reads nothing until the forward's end.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RoutingWaits {
    /// MoE layers that waited.
    pub layers: usize,
    /// The host's wall time in those waits.
    pub time: Duration,
}

impl ForwardOutput {
    /// Real positions computed once for several sequences and not again for the others
    /// (the sum of [`SharedLen::positions`] over [`ForwardOutput::shared_lens`]).
    pub fn shared_positions(&self) -> usize {
        self.shared_lens.iter().map(|s| s.positions).sum()
    }
}

/// What of one sequence of a batch sharing prefixes another sequence's rows stood for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedLen {
    /// Its leading positions computed for another sequence: the layers did not run over them
    /// for it (on the CPU not even their queries' attention).
    pub positions: usize,
    /// Its leading positions whose vocabulary-head row, where the head reads them, another
    /// position computed: `positions` where the head ran once per distinct row, 0 where it
    /// ran per position.
    pub head: usize,
}

#[derive(Debug, Clone)]
enum Attention {
    Gqa(GqaAttention),
    Mla(MlaAttention),
}

#[derive(Debug, Clone)]
enum FeedForward {
    Dense(SwiGlu),
    Moe(MoeBlock),
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_norm: RmsNorm,
    attention: Attention,
    post_norm: RmsNorm,
    ffn: FeedForward,
}

/// The training-engine model (f32, autograd-safe).
#[derive(Debug, Clone)]
pub struct Model {
    cfg: Config,
    embed: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    precision: Precision,
}

impl Model {
    /// Builds the model from validated weights (use `Weights::into_trainable` first to train).
    pub fn new(cfg: &Config, weights: &Weights) -> Result<Self> {
        Self::with_precision(cfg, weights, Precision::F32)
    }

    /// [`Model::new`] with a mixed-precision forward (see [`Precision`]); the weights stay
    /// the f32 tensors given (the master weights).
    pub fn with_precision(cfg: &Config, weights: &Weights, precision: Precision) -> Result<Self> {
        let mut model = Self::build(cfg, weights)?;
        model.precision = precision;
        for layer in &mut model.layers {
            layer.input_norm.set_precision(precision);
            layer.post_norm.set_precision(precision);
            match &mut layer.attention {
                Attention::Gqa(a) => a.set_precision(precision),
                Attention::Mla(a) => a.set_precision(precision),
            }
            match &mut layer.ffn {
                FeedForward::Dense(mlp) => mlp.set_precision(precision),
                FeedForward::Moe(block) => block.set_precision(precision),
            }
        }
        model.norm.set_precision(precision);
        model.lm_head.set_precision(precision);
        Ok(model)
    }

    /// Sets how every MoE layer's routed-expert GEMMs take their f32 operands on a GPU in
    /// bf16 ([`ExpertGemmInputs`]; the CPU and other precisions are unaffected).
    pub fn set_expert_gemm_inputs(&mut self, inputs: ExpertGemmInputs) {
        for layer in &mut self.layers {
            if let FeedForward::Moe(block) = &mut layer.ffn {
                block.set_expert_gemm_inputs(inputs);
            }
        }
    }

    /// Sets how a GPU runs every MoE layer's routed experts in a differentiated forward
    /// ([`PaddedExpertOps`]: fused by default; the CPU is unaffected).
    pub fn set_padded_expert_ops(&mut self, ops: PaddedExpertOps) {
        for layer in &mut self.layers {
            if let FeedForward::Moe(block) = &mut layer.ffn {
                block.set_padded_expert_ops(ops);
            }
        }
    }

    /// Sets the dtype in which a 16-bit forward hands back the gradients of the weights it
    /// reads rounded ([`WeightGradients`]: the projections, routers, routed experts' stacks
    /// and the head; the same values either way): narrow for a trainer that keeps its weight
    /// gradients in 16 bits.
    pub fn set_weight_gradients(&mut self, grads: WeightGradients) {
        for layer in &mut self.layers {
            match &mut layer.attention {
                Attention::Gqa(a) => a.set_weight_gradients(grads),
                Attention::Mla(a) => a.set_weight_gradients(grads),
            }
            match &mut layer.ffn {
                FeedForward::Dense(mlp) => mlp.set_weight_gradients(grads),
                FeedForward::Moe(block) => block.set_weight_gradients(grads),
            }
        }
        self.lm_head.set_weight_gradients(grads);
    }

    /// Runs each GQA layer's q and k heads (per-head norm, rotation, rounding) again in a
    /// differentiated forward's backward, the graph keeping only the projections' outputs
    /// (selective recomputation, `algo.selective_recompute`: the same gradients bit for bit,
    /// less memory, the heads' forward once more). MLA layers are unaffected.
    pub fn set_selective_recompute(&mut self, on: bool) {
        for layer in &mut self.layers {
            if let Attention::Gqa(a) = &mut layer.attention {
                a.set_recompute_heads(on);
            }
        }
    }

    /// Bounds the scores one product of every attention layer holds in a forward on a device
    /// without the CPU's fused op (`algo.attention_tile_mib`): query rows in blocks, forward
    /// and backward; the same values, the keys' and values' gradients summed over the blocks.
    pub fn set_score_tiles(&mut self, tiles: ScoreTiles) {
        for layer in &mut self.layers {
            match &mut layer.attention {
                Attention::Gqa(a) => a.set_score_tiles(tiles),
                Attention::Mla(a) => a.set_score_tiles(tiles),
            }
        }
    }

    /// The forward's precision.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The device the weights live on (every forward runs there).
    pub fn device(&self) -> &Device {
        self.embed.device()
    }

    fn build(cfg: &Config, weights: &Weights) -> Result<Self> {
        weights.validate(cfg)?;
        // The MoE blocks run stacked experts; fusing a per-expert map copies its experts once
        // (and stays differentiable if they are variables).
        let weights = &weights.clone().fuse_experts(cfg)?;
        let eps = cfg.rms_norm_eps;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let attn_prefix = attention_prefix(i);
            let attention = match cfg.attention {
                AttentionConfig::Gqa { .. } => {
                    Attention::Gqa(GqaAttention::new(cfg, weights, &attn_prefix)?)
                }
                AttentionConfig::Mla { .. } => {
                    Attention::Mla(MlaAttention::new(cfg, weights, &attn_prefix)?)
                }
            };
            let ffn = if cfg.is_moe_layer(i) {
                FeedForward::Moe(MoeBlock::new(cfg, weights, i)?)
            } else {
                FeedForward::Dense(SwiGlu::new(weights, &dense_mlp_prefix(i), &SWIGLU_HF)?)
            };
            layers.push(DecoderLayer {
                input_norm: RmsNorm::new(weights, &input_norm(i), eps)?,
                attention,
                post_norm: RmsNorm::new(weights, &post_attention_norm(i), eps)?,
                ffn,
            });
        }
        let lm_head_name = if cfg.tie_word_embeddings {
            EMBED
        } else {
            LM_HEAD
        };
        Ok(Model {
            cfg: cfg.clone(),
            embed: weights.get(&weight(EMBED))?.clone(),
            layers,
            norm: RmsNorm::new(weights, FINAL_NORM, eps)?,
            lm_head: Linear::new(weights, lm_head_name, false)?,
            rope: Rope::new(&cfg.rope),
            precision: Precision::F32,
        })
    }

    /// The config this model was built from.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The MoE blocks, in layer order.
    fn moe_blocks(&self) -> impl Iterator<Item = &MoeBlock> {
        self.layers.iter().filter_map(|l| match &l.ffn {
            FeedForward::Moe(block) => Some(block),
            FeedForward::Dense(_) => None,
        })
    }

    /// Reads again from `weights` what the layers copied to the host when the model was
    /// built (the routers' score biases), after the tensors it was built from were written
    /// in place: every other weight the layers read where it lies.
    pub fn reload_host_copies(&mut self, weights: &Weights) -> Result<()> {
        for (i, layer) in self.layers.iter_mut().enumerate() {
            if let FeedForward::Moe(block) = &mut layer.ffn {
                block.reload_score_bias(&self.cfg, weights, i)?;
            }
        }
        Ok(())
    }

    /// Whether every MoE layer can choose its experts on the device
    /// ([`decode::StepRouting::Device`]; see [`MoeBlock::routes_on_device`]).
    pub fn routes_on_device(&self) -> bool {
        self.moe_blocks().all(MoeBlock::routes_on_device)
    }

    /// Bytes of the largest routed expert's matrices (0 without MoE layers): what a
    /// device-routed step reads per (row, slot) and MoE layer.
    pub fn routed_expert_bytes(&self) -> usize {
        self.moe_blocks()
            .map(MoeBlock::expert_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Embeddings of the token `ids` in `shape` (`[B, T, H]` of a padded batch, `[N, H]` of
    /// computed rows), rounded at the precision's embedding point: where the full forward and
    /// the cached decode step both start.
    fn embed_tokens(&self, ids: &Tensor, host_ids: &[u32], shape: &Shape) -> Result<Tensor> {
        let x = embedding_rows(&self.embed, ids, host_ids)?.reshape(shape)?;
        self.precision.round(&x)
    }

    /// Forward pass; see [`Routing`] for the modes.
    pub fn forward(&self, batch: &Batch, routing: Routing<'_>) -> Result<ForwardOutput> {
        self.forward_with(batch, routing, false)
    }

    /// [`Model::forward`] with logits for positions `from..T` only (HF's `logits_to_keep`,
    /// which TRL's GRPO trainer passes): [`Model::forward_head`] with
    /// [`HeadPositions::From`].
    pub fn forward_logits_from(
        &self,
        batch: &Batch,
        routing: Routing<'_>,
        from: usize,
    ) -> Result<ForwardOutput> {
        self.forward_head(batch, routing, HeadPositions::From(from))
    }

    /// [`Model::forward`] with logits for the positions `head` names only: a policy's loss
    /// reads the predictions of response tokens, and the head over the other positions is
    /// work thrown away. Every position still runs through the decoder layers; the final
    /// norm and the head see the named positions (each row normed and projected alone, so
    /// those logits are the values the whole forward gives them).
    pub fn forward_head(
        &self,
        batch: &Batch,
        routing: Routing<'_>,
        head: HeadPositions,
    ) -> Result<ForwardOutput> {
        Ok(self
            .forward_layers(batch, routing, false, false, head, None)?
            .0)
    }

    /// Forward pass that can also return per-layer hidden states.
    pub fn forward_with(
        &self,
        batch: &Batch,
        routing: Routing<'_>,
        capture_hidden: bool,
    ) -> Result<ForwardOutput> {
        Ok(self
            .forward_layers(
                batch,
                routing,
                capture_hidden,
                false,
                HeadPositions::From(0),
                None,
            )?
            .0)
    }

    /// The forward of [`Model::forward`] keeping only what its backward needs to run each
    /// decoder layer again (activation checkpointing: HF's `gradient_checkpointing`,
    /// Megatron's full recompute): each layer's input and the experts it dispatched. The
    /// logits' graph reaches back to the last layer's output only; [`LayerRecompute::backward`]
    /// gives the gradients of the whole model, the same values [`Model::forward`]'s graph
    /// gives. Every layer runs twice, so a step costs about one more forward; what the graph
    /// holds at a time is one layer's activations instead of every layer's.
    /// Logits for the positions `head` names only, as [`Model::forward_head`].
    pub fn forward_recomputing(
        &self,
        batch: &Batch,
        routing: Routing<'_>,
        head: HeadPositions,
    ) -> Result<(ForwardOutput, LayerRecompute<'_>)> {
        match self.forward_layers(batch, routing, false, true, head, None)? {
            (out, Some(recompute)) => Ok((out, recompute)),
            (_, None) => Err(ModelError::Input(
                "a recomputing forward kept no layer inputs".into(),
            )),
        }
    }

    /// [`Model::forward_head`] (with `recompute`, [`Model::forward_recomputing`]) whose head
    /// scores its rows against `targets` instead of handing back their logits: the
    /// output's `logits` is `[P, 2]`, per head position the log-prob of its target and the
    /// entropy of its next-token distribution, computed `targets.chunk_rows` rows at a time
    /// and differentiable with no logits kept ([`head_scores`](mod@head_scores)). For a policy's scoring at a
    /// large vocabulary, whose logits would be the largest tensors of a step.
    pub fn forward_scores(
        &self,
        batch: &Batch,
        routing: Routing<'_>,
        head: HeadPositions,
        targets: &ScoreTargets,
        recompute: bool,
    ) -> Result<(ForwardOutput, Option<LayerRecompute<'_>>)> {
        self.forward_layers(batch, routing, false, recompute, head, Some(targets))
    }

    /// The forward of [`Model::forward_with`]; with `recompute`, each layer's graph is
    /// dropped once it has run, and what its backward needs to run it again is returned;
    /// logits for the positions `head` names only, or with `scores` those positions'
    /// scores ([`Model::forward_scores`]).
    fn forward_layers(
        &self,
        batch: &Batch,
        routing: Routing<'_>,
        capture_hidden: bool,
        recompute: bool,
        head: HeadPositions,
        scores: Option<&ScoreTargets>,
    ) -> Result<(ForwardOutput, Option<LayerRecompute<'_>>)> {
        let cfg = &self.cfg;
        let device = self.embed.device();
        let (b, t) = batch.input_ids.dims2()?;
        self.check_tokens(batch)?;
        // The head's positions, checked before any layer runs.
        head.check(batch.lengths(), t)?;
        let lengths = batch.lengths();
        if cfg.moe.is_none() && !matches!(routing, Routing::Native) {
            return Err(ModelError::Input(
                "Record / Replay routing needs MoE layers; this model is dense".into(),
            ));
        }
        let mut routing_overhead = Duration::ZERO;
        let window = match cfg.attention {
            AttentionConfig::Gqa { sliding_window, .. } => sliding_window,
            AttentionConfig::Mla { .. } => None,
        };
        // In the activations' dtype: a bf16 embedding table (bf16 weights without f32
        // masters) gives f32 rows, and a GPU's RoPE kernel and masked softmax take tables of
        // their operands' dtype.
        let activations = rows_dtype(self.embed.dtype());
        let rope = self.rope.tables(t, device, activations)?;
        let mask = AttentionMask::new(lengths, t, window, device)?.to_dtype(activations)?;
        // A replay's plan is built when the first MoE layer needs it: by then the embedding's
        // and the first attention's kernels are queued, so on a GPU the host builds it while
        // the device runs them (built first, it held the device idle at every replayed
        // forward's start). A batch sharing prefixes builds it first: which positions share
        // depends on their replayed experts.
        let mut plan: Option<ReplayPlan> = None;
        let mut plan_pending = matches!(routing, Routing::Replay(_));
        // Which positions a batch sharing prefixes computes once (none under hidden-state
        // capture, which returns every padded slot's state).
        let shared = match batch.share_prefixes && !capture_hidden {
            true => {
                let started = Instant::now();
                plan = self.plan(routing, lengths)?;
                routing_overhead += started.elapsed();
                plan_pending = false;
                SharedPrefixes::find(batch.sequences(), t, plan.as_ref())
            }
            false => None,
        };
        // The rows the layers compute: every padded slot (`[B, T, H]`), or one row for each
        // position its sequences do not hold alike with another's (`[N, H]`), attention
        // reading them in the padded layout; a replay's plan then follows the rows.
        let (ctx, host_ids, row_plan, ids, embedded_shape) = match &shared {
            None => {
                let ctx = LayerContext {
                    rope,
                    mask,
                    rows: routed_rows(lengths, t),
                    slots: None,
                };
                let ids = batch.input_ids.to_device(device)?.flatten_all()?;
                let shape = Shape::from((b, t, cfg.hidden_size));
                let host_ids = Cow::Borrowed(batch.host_ids.as_slice());
                (ctx, host_ids, None, ids, shape)
            }
            Some(shared) => {
                let n = shared.rows();
                // A shared position's attention output is read from the sequence it is
                // computed for only: the others' queries there need not run.
                let mask = mask.reading_queries_from(shared.shared_lens().to_vec());
                let slots = SlotRows::new(
                    shared.row_of_slot().to_vec(),
                    shared.slot_of_row().to_vec(),
                    lengths,
                    (b, t),
                )?;
                let rows = RoutedRows {
                    host: (0..n as u32).collect(),
                    all: true,
                };
                let host_ids: Vec<u32> = shared
                    .slot_of_row()
                    .iter()
                    .map(|&slot| batch.host_ids[slot as usize])
                    .collect();
                let row_plan = plan
                    .as_ref()
                    .map(|p| p.for_rows(shared.owner_tokens(), Arc::new(shared.copies().to_vec())));
                let ctx = LayerContext {
                    rope,
                    mask,
                    rows,
                    slots: Some(slots),
                };
                let ids = Tensor::from_slice(&host_ids, n, device)?;
                let shape = Shape::from((n, cfg.hidden_size));
                (ctx, Cow::Owned(host_ids), row_plan, ids, shape)
            }
        };
        let mut x = self.embed_tokens(&ids, &host_ids, &embedded_shape)?;
        let mut hidden = capture_hidden.then(Vec::new);
        let mut moe = MoeRecord::default();
        let mut inputs = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            if let Some(h) = hidden.as_mut() {
                h.push(x.clone());
            }
            // The layer's graph goes with its detached output; its input stays.
            let input = match recompute {
                true => {
                    let input = x.detach();
                    inputs.push(input.clone());
                    input
                }
                false => x,
            };
            let h = self.attention_half(layer, input, &ctx)?;
            if plan_pending && cfg.layout.moe_column(i).is_some() {
                let started = Instant::now();
                plan = self.plan(routing, lengths)?;
                routing_overhead += started.elapsed();
                plan_pending = false;
            }
            let layer_plan = row_plan
                .as_ref()
                .or(plan.as_ref())
                .map(|p| p.layers.as_slice());
            let out = self.feed_forward(
                i,
                layer,
                h,
                &ctx.rows,
                layer_plan,
                Gates::Differentiable,
                &mut moe,
            )?;
            x = match recompute {
                true => out.detach(),
                false => out,
            };
        }
        if plan_pending {
            // No MoE layer asked for it: the tables are still checked.
            let started = Instant::now();
            plan = self.plan(routing, lengths)?;
            routing_overhead += started.elapsed();
        }
        routing_overhead += moe.replay_time;
        // The logits' graph starts at the last layer's output, a variable whose gradient
        // the layers' backward starts from.
        let top = match recompute {
            true => {
                let top = Var::from_tensor(&x)?;
                x = top.as_tensor().clone();
                Some(top)
            }
            false => None,
        };
        // The head sees the positions asked for: the norm is per row, so choosing the rows
        // before it or after gives the same values (after, where every normed state is
        // returned).
        let mut head_reused = vec![0; b];
        let logits = match (scores, &shared, hidden.as_mut()) {
            // Each head position's row of the last layer's states, scored chunk by chunk.
            (Some(scores), shared, _) => {
                let rows = match shared {
                    Some(shared) => {
                        let n = shared.rows();
                        let picks = head
                            .slots(lengths, t)?
                            .iter()
                            .map(|&slot| shared.row_of_slot()[slot as usize])
                            .collect();
                        GatherRows::new(picks, n, n)?.apply(&x)?
                    }
                    None => {
                        let rows = head_input(x, &head, lengths)?;
                        rows.reshape(((), cfg.hidden_size))?
                    }
                };
                head_scores(&rows, &self.norm, &self.lm_head, scores)?
            }
            // Each computed row the head reads normed once.
            (None, Some(shared), _) => {
                let slots = head.slots(lengths, t)?;
                let (logits, reused) = self.shared_head(&x, shared, &slots, t)?;
                head_reused = reused;
                match head {
                    HeadPositions::From(from) => {
                        let v = logits.dim(1)?;
                        logits.reshape((b, t - from, v))?
                    }
                    HeadPositions::Spans(_) => logits,
                }
            }
            (None, None, Some(h)) => {
                let x = self.norm.forward(&x)?;
                h.push(x.clone());
                self.lm_head.forward(&head_input(x, &head, lengths)?)?
            }
            (None, None, None) => self
                .lm_head
                .forward(&self.norm.forward(&head_input(x, &head, lengths)?)?)?,
        };
        let started = Instant::now();
        // The routes recorded or verified are every real position's: a shared row's at
        // each of the positions it stands for.
        let spread = shared.as_ref().map(|shared| MoeRecord {
            used: moe
                .used
                .iter()
                .map(|ids| shared.spread_ids(ids, cfg.top_k()))
                .collect(),
            differs: moe.differs.clone(),
            ..MoeRecord::default()
        });
        let routing_waits = RoutingWaits {
            layers: moe.waits,
            time: moe.device_wait,
        };
        let (routes, replay) =
            self.routing_result(routing, plan, spread.as_ref().unwrap_or(&moe), lengths)?;
        if !matches!(routing, Routing::Native) {
            routing_overhead += started.elapsed();
        }
        let recompute = match top {
            Some(top) => Some(LayerRecompute::new(
                self,
                RecomputeInputs {
                    top,
                    inputs,
                    dispatched: moe.used,
                    ids,
                    embedded_shape,
                    host_ids: host_ids.into_owned(),
                    ctx,
                },
            )),
            None => None,
        };
        let shared_lens = match &shared {
            Some(shared) => shared
                .shared_lens()
                .iter()
                .zip(head_reused)
                .map(|(&positions, head)| SharedLen { positions, head })
                .collect(),
            None => vec![SharedLen::default(); b],
        };
        let out = ForwardOutput {
            logits,
            head,
            routes,
            replay,
            hidden_states: hidden,
            routing_overhead,
            shared_lens,
            routing_waits,
        };
        Ok((out, recompute))
    }

    /// The replay plan of a `Replay` forward (tables checked against the model and batch).
    fn plan(&self, routing: Routing<'_>, lengths: &[usize]) -> Result<Option<ReplayPlan>> {
        let Routing::Replay(routes) = routing else {
            return Ok(None);
        };
        let shape = ModelShape {
            layout: &self.cfg.layout,
            num_experts: self.cfg.num_experts(),
            top_k: self.cfg.top_k(),
        };
        Ok(Some(plan_replay(routes, lengths, &shape)?))
    }

    /// Decoder layer `i` on `x` `[B, T, H]`: attention, then the dense or MoE feed-forward
    /// (`plan`, per MoE column, the ids forced on its rows; the dispatched ids go to `moe`),
    /// each with its residual.
    fn layer_forward(
        &self,
        i: usize,
        layer: &DecoderLayer,
        x: Tensor,
        ctx: &LayerContext,
        plan: Option<&[LayerPlan]>,
        moe: &mut MoeRecord,
    ) -> Result<Tensor> {
        let h = self.attention_half(layer, x, ctx)?;
        self.feed_forward(i, layer, h, &ctx.rows, plan, Gates::Differentiable, moe)
    }

    /// The first half of a decoder layer on `x` `[B, T, H]`: its input norm, attention and
    /// the residual.
    fn attention_half(
        &self,
        layer: &DecoderLayer,
        x: Tensor,
        ctx: &LayerContext,
    ) -> Result<Tensor> {
        let normed = layer.input_norm.forward(&x)?;
        let (rope, mask) = (&ctx.rope, &ctx.mask);
        let attn = match (&layer.attention, &ctx.slots) {
            (Attention::Gqa(a), None) => a.forward(&normed, rope, mask)?,
            (Attention::Mla(a), None) => a.forward(&normed, rope, mask)?,
            (Attention::Gqa(a), Some(slots)) => slots.attend(a, &normed, rope, mask)?,
            (Attention::Mla(a), Some(slots)) => slots.attend(a, &normed, rope, mask)?,
        };
        self.precision.add_rounded(&x, &attn)
    }

    /// The second half of decoder layer `i` on `h` `[B, T, H]` (the residual stream after
    /// attention): the dense or MoE feed-forward routing `rows` (whose dispatched ids go to
    /// `moe`; `plan` forces replayed ids; `gates` says where the gates are weighed), with its
    /// residual.
    #[allow(clippy::too_many_arguments)]
    fn feed_forward(
        &self,
        i: usize,
        layer: &DecoderLayer,
        h: Tensor,
        rows: &RoutedRows,
        plan: Option<&[LayerPlan]>,
        gates: Gates,
        moe: &mut MoeRecord,
    ) -> Result<Tensor> {
        self.feed_forward_with(layer, h, |block, normed| {
            let column =
                self.cfg.layout.moe_column(i).ok_or_else(|| {
                    ModelError::InvalidConfig(format!("layer {i} has no MoE column"))
                })?;
            let layer_plan = plan.and_then(|p| p.get(column));
            let out = block.forward(normed, rows, layer_plan, gates)?;
            moe.used.push(out.ids);
            moe.differs.push(out.differs_from_native);
            moe.replay_time += out.replay_time;
            moe.device_wait += out.device_wait;
            moe.waits += usize::from(out.waited);
            Ok(out.output)
        })
    }

    /// The second half of a decoder layer on `h` `[B, T, H]`: its post-attention norm, the
    /// dense MLP or `moe_block` (a MoE layer's block output from the normed `[B·T, H]` rows),
    /// and the residual.
    fn feed_forward_with<'m>(
        &self,
        layer: &'m DecoderLayer,
        h: Tensor,
        moe_block: impl FnOnce(&'m MoeBlock, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let hidden = self.cfg.hidden_size;
        // `[B, T, H]`, or `[N, H]` computed rows of a batch sharing prefixes
        let shape = h.shape().clone();
        let rows = shape.elem_count() / hidden.max(1);
        let normed = layer.post_norm.forward(&h)?.reshape((rows, hidden))?;
        let ffn = match &layer.ffn {
            FeedForward::Dense(mlp) => mlp.forward(&normed)?,
            FeedForward::Moe(block) => moe_block(block, &normed)?,
        };
        self.precision.add_rounded(&h, &ffn.reshape(shape)?)
    }

    /// The logits `[P, V]` of the head's slots `slots` (of the padded `[B, t]` batch) of a
    /// batch sharing prefixes, from its computed rows `x` `[N, H]`. Where at least a quarter
    /// of the head's positions repeat a row another position reads (responses that begin
    /// alike; padding where the head reads it), the norm and the head run once per distinct
    /// row and the logits are gathered to the positions (a gather's backward sums a row's
    /// uses): a head row costs `2·H·V` FLOPs, a gathered one a copy of `V` values, which that
    /// share pays for on a CPU (H ≈ 100) and a GPU (H ≈ 2,000) alike. Below it the rows are
    /// gathered and the head runs per position. With, per sequence, how many of its head
    /// positions read a head row another position computed (all 0 in the second case).
    fn shared_head(
        &self,
        x: &Tensor,
        shared: &SharedPrefixes,
        slots: &[u32],
        t: usize,
    ) -> Result<(Tensor, Vec<usize>)> {
        let n = shared.rows();
        let head = shared.head_rows(slots, t);
        if 4 * head.rows.len() <= 3 * slots.len() {
            let distinct = head.rows.len();
            let x = GatherRows::new(head.rows, n, n)?.apply(x)?;
            let logits = self.lm_head.forward(&self.norm.forward(&x)?)?;
            let logits = GatherRows::new(head.of_position, distinct, distinct)?.apply(&logits)?;
            return Ok((logits, head.reused));
        }
        let picks = head
            .of_position
            .iter()
            .map(|&i| head.rows[i as usize])
            .collect();
        let x = GatherRows::new(picks, n, n)?.apply(x)?;
        let unshared = vec![0; head.reused.len()];
        Ok((self.lm_head.forward(&self.norm.forward(&x)?)?, unshared))
    }

    /// What the routing mode returns: `Record` the chosen routes as tables, `Replay` the
    /// proof that the plan's experts were used.
    fn routing_result(
        &self,
        routing: Routing<'_>,
        plan: Option<ReplayPlan>,
        moe: &MoeRecord,
        lengths: &[usize],
    ) -> Result<(Option<Vec<RouteTable>>, Option<ReplayProof>)> {
        let cfg = &self.cfg;
        Ok(match (routing, plan) {
            (Routing::Record, _) => (
                Some(record_tables(
                    &moe.used,
                    lengths,
                    &cfg.layout,
                    cfg.num_experts(),
                    cfg.top_k(),
                )?),
                None,
            ),
            (Routing::Replay(_), Some(plan)) => (
                None,
                Some(verify_replay(
                    &plan,
                    &moe.used,
                    &divergence::resolve(&moe.differs)?,
                    lengths,
                    &cfg.layout,
                    cfg.top_k(),
                )?),
            ),
            _ => (None, None),
        })
    }

    fn check_tokens(&self, batch: &Batch) -> Result<()> {
        for (b, seq) in batch.sequences().iter().enumerate() {
            if let Some((t, &id)) = seq
                .iter()
                .enumerate()
                .find(|(_, &id)| id as usize >= self.cfg.vocab_size)
            {
                return Err(ModelError::Input(format!(
                    "token id {id} at sequence {b}, position {t} is outside the vocabulary of {}",
                    self.cfg.vocab_size
                )));
            }
        }
        Ok(())
    }
}

/// What every decoder layer of one forward shares.
struct LayerContext {
    rope: RopeTables,
    mask: AttentionMask,
    /// The rows the MoE blocks route (every real token's).
    rows: RoutedRows,
    /// Where a batch sharing prefixes computes `[N, H]` rows: attention reads them in the
    /// padded layout through these gathers.
    slots: Option<SlotRows>,
}

/// What the MoE layers of one forward did, in layer order.
#[derive(Default)]
struct MoeRecord {
    /// per MoE layer: `[rows · top_k]` dispatched ids
    used: Vec<Vec<u32>>,
    /// per MoE layer: forced rows whose experts differ from the layer's own top-k (read
    /// from the device, where counted there, once the forward is queued)
    differs: Vec<Divergence>,
    /// time spent forcing the plan's ids
    replay_time: Duration,
    /// time the host waited for the routers' choices
    device_wait: Duration,
    /// MoE layers that waited for the device
    waits: usize,
}

/// The head's input from the last layer's states `x` `[B, T, H]` of an unshared batch
/// (sequences of `lengths`): all of them (`From(0)`), positions `from..T` (`From`), or the
/// rows of the spans' slots `[P, H]` (`Spans`).
fn head_input(x: Tensor, head: &HeadPositions, lengths: &[usize]) -> Result<Tensor> {
    let (b, t, h) = x.dims3()?;
    match head {
        HeadPositions::From(0) => Ok(x),
        HeadPositions::From(from) => Ok(x.narrow(1, *from, t - from)?.contiguous()?),
        HeadPositions::Spans(_) => {
            let rows = x.reshape((b * t, h))?;
            GatherRows::new(head.slots(lengths, t)?, b * t, b * t)?.apply(&rows)
        }
    }
}

/// Flattened `[B·T]` indices of the real tokens, sequence-major.
fn routed_rows(lengths: &[usize], t: usize) -> RoutedRows {
    let host: Vec<u32> = lengths
        .iter()
        .enumerate()
        .flat_map(|(b, &len)| (0..len).map(move |i| (b * t + i) as u32))
        .collect();
    let all = host.len() == lengths.len() * t;
    RoutedRows { host, all }
}
