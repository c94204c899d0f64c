//! The engine's own weight layout, built from HF-named tensors whose names and shapes come
//! from r3-model's spec: fused q/k/v and gate/up projections, every matmul weight in the
//! engine dtype (the router in its own dtype), norms and biases in f32 buffers (holding bf16
//! values in bf16 mode, as a bf16 checkpoint would). Routed experts are read per expert or taken from
//! the fused `[E, 2I, H]` / `[E, H, I]` tensors as they are (gate rows first, as packed here).

use r3_model::spec::{
    self, expert_names, SwigluNames, EMBED, FINAL_NORM, K_NORM, LM_HEAD, MLA_KV_A, MLA_KV_A_NORM,
    MLA_KV_B, MLA_Q, MLA_Q_A, MLA_Q_A_NORM, MLA_Q_B, O_PROJ, QKV_PROJ, Q_NORM, ROUTER, SCORE_BIAS,
    SHARED_EXPERT_GATE, SWIGLU_HF,
};
use r3_model::{AttentionConfig, Config, ExpertLayout, QkNorm, Router, RouterKind, SharedExpert};

use rayon::prelude::*;

use crate::dtype::{Dtype, RouterDtype};
use crate::error::RolloutError;
use crate::kernels::linear::Linear;
use crate::model::tensors::{Fetcher, TensorMap};

/// A SwiGLU feed-forward block (dense MLP, routed expert or shared expert).
#[derive(Debug, Clone)]
pub struct Ffn {
    /// `[gate; up]` stacked: `[2·inter, hidden]`.
    pub gate_up: Linear,
    /// `[hidden, inter]`.
    pub down: Linear,
    /// Hidden width of the block.
    pub inter: usize,
}

/// Attention projections of one layer.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one per layer; boxing buys nothing
pub enum AttnWeights {
    /// Grouped-query attention.
    Gqa {
        /// `[q; k; v]` stacked rows, with bias when the model has one.
        qkv: Linear,
        /// Output projection.
        o: Linear,
        /// q norm weight (per head or full width, see config).
        q_norm: Option<Vec<f32>>,
        /// k norm weight.
        k_norm: Option<Vec<f32>>,
    },
    /// DeepSeek multi-head latent attention (naive: keys/values decompressed into the cache).
    Mla {
        /// `q_a_proj` and its norm, when q is compressed.
        q_a: Option<(Linear, Vec<f32>)>,
        /// `q_b_proj` (or `q_proj` without compression).
        q_b: Linear,
        /// `kv_a_proj_with_mqa`.
        kv_a: Linear,
        /// `kv_a_layernorm` weight.
        kv_a_norm: Vec<f32>,
        /// `kv_b_proj`.
        kv_b: Linear,
        /// Output projection.
        o: Linear,
    },
}

/// Mixture-of-experts block of one layer.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// Route column of this layer (its index among the MoE layers).
    pub column: usize,
    /// Selection and gate rule (r3-model's router math).
    pub rule: Router,
    /// Router `[num_experts, hidden]`.
    pub router: Linear,
    /// DeepSeek `e_score_correction_bias`.
    pub score_bias: Option<Vec<f32>>,
    /// Routed experts, by logical id.
    pub experts: Vec<Ffn>,
    /// Always-on expert.
    pub shared: Option<Ffn>,
    /// Qwen2-MoE `shared_expert_gate` `[1, hidden]`.
    pub shared_gate: Option<Linear>,
}

/// Feed-forward part of one layer.
#[derive(Debug, Clone)]
pub enum MlpWeights {
    /// Dense SwiGLU.
    Dense(Ffn),
    /// Mixture of experts (boxed: far larger than a dense block).
    Moe(Box<MoeWeights>),
}

/// One transformer layer.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// `input_layernorm`.
    pub input_norm: Vec<f32>,
    /// `post_attention_layernorm`.
    pub post_norm: Vec<f32>,
    /// Attention projections.
    pub attn: AttnWeights,
    /// Feed-forward block.
    pub mlp: MlpWeights,
}

/// All weights of the model in the engine's layout.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// `embed_tokens` `[vocab, hidden]` (f32; rows are gathered, not multiplied).
    pub embed: Vec<f32>,
    /// Layers in order.
    pub layers: Vec<LayerWeights>,
    /// Final norm.
    pub norm: Vec<f32>,
    /// `lm_head` (the embedding when tied).
    pub lm_head: Linear,
}

/// A norm scale or bias as the engine stores it: bf16 values in bf16 mode (where the whole
/// checkpoint is bf16), f32 otherwise.
fn stored(mut v: Vec<f32>, dtype: Dtype) -> Vec<f32> {
    dtype.round_activations(&mut v);
    v
}

/// A layer from a row-major matrix with the shape the spec checked.
fn matrix(
    name: &str,
    w: Vec<f32>,
    shape: &[usize],
    bias: Option<Vec<f32>>,
    dtype: Dtype,
) -> Result<Linear, RolloutError> {
    let &[rows, cols] = shape else {
        return Err(RolloutError::Weights(format!(
            "{name}: expected a matrix, got shape {shape:?}"
        )));
    };
    Linear::new(name, w, rows, cols, bias.map(|b| stored(b, dtype)), dtype)
}

/// The layer `{prefix}.weight` (and `{prefix}.bias` when `bias`).
fn linear(f: &Fetcher, prefix: &str, bias: bool, dtype: Dtype) -> Result<Linear, RolloutError> {
    let (w, shape) = f.get(&spec::weight(prefix))?;
    let b = if bias {
        Some(f.vector(&spec::bias(prefix))?)
    } else {
        None
    };
    matrix(prefix, w, &shape, b, dtype)
}

/// Stacks row-major matrices with the same column count (used to fuse projections).
fn stack(
    name: &str,
    parts: Vec<(Vec<f32>, Vec<usize>)>,
    bias: Option<Vec<f32>>,
    dtype: Dtype,
) -> Result<Linear, RolloutError> {
    let cols = parts.first().and_then(|p| p.1.get(1).copied()).unwrap_or(0);
    let mut rows = 0;
    let mut w = Vec::new();
    for (values, shape) in parts {
        if shape.len() != 2 || shape[1] != cols {
            return Err(RolloutError::Weights(format!(
                "{name}: cannot stack a {shape:?} part onto {cols} columns"
            )));
        }
        rows += shape[0];
        w.extend_from_slice(&values);
    }
    Linear::new(name, w, rows, cols, bias.map(|b| stored(b, dtype)), dtype)
}

/// A SwiGLU block from its three HF projections under `prefix`.
fn ffn(f: &Fetcher, prefix: &str, names: &SwigluNames, dtype: Dtype) -> Result<Ffn, RolloutError> {
    let gate = f.get(&spec::weight(&format!("{prefix}.{}", names.gate)))?;
    let up = f.get(&spec::weight(&format!("{prefix}.{}", names.up)))?;
    let inter = gate.1[0];
    let gate_up = stack(
        &format!("{prefix}.{}+{}", names.gate, names.up),
        vec![gate, up],
        None,
        dtype,
    )?;
    let down = linear(f, &format!("{prefix}.{}", names.down), false, dtype)?;
    Ok(Ffn {
        gate_up,
        down,
        inter,
    })
}

/// Every routed expert from the fused `gate_up_proj` `[E, 2I, H]` and `down_proj`
/// `[E, H, I]` of a MoE block: expert `j`'s slices are its `[gate; up]` and down matrices.
fn fused_experts(f: &Fetcher, moe_prefix: &str, dtype: Dtype) -> Result<Vec<Ffn>, RolloutError> {
    let (gate_up_name, down_name) = spec::fused_expert_names(moe_prefix);
    let (gate_up, gu_shape) = f.get(&gate_up_name)?;
    let (down, down_shape) = f.get(&down_name)?;
    let (&[e, two_inter, h], &[_, _, inter]) = (gu_shape.as_slice(), down_shape.as_slice()) else {
        return Err(RolloutError::Weights(format!(
            "{moe_prefix}: fused experts of shapes {gu_shape:?} / {down_shape:?}"
        )));
    };
    // The spec checked the shapes; the buffers must still hold every expert in full, or the
    // zip below would silently build fewer experts than the router can pick.
    let (gu_len, down_len) = (
        e.checked_mul(two_inter).and_then(|n| n.checked_mul(h)),
        e.checked_mul(h).and_then(|n| n.checked_mul(inter)),
    );
    if e == 0 || gu_len != Some(gate_up.len()) || down_len != Some(down.len()) {
        return Err(RolloutError::Weights(format!(
            "{moe_prefix}: fused experts hold {} / {} values, which does not match shapes {gu_shape:?} / {down_shape:?}",
            gate_up.len(),
            down.len()
        )));
    }
    gate_up
        .chunks_exact(two_inter * h)
        .zip(down.chunks_exact(h * inter))
        .take(e)
        .enumerate()
        .map(|(j, (gu, d))| {
            Ok(Ffn {
                gate_up: Linear::new(
                    &format!("{gate_up_name}[{j}]"),
                    gu.to_vec(),
                    two_inter,
                    h,
                    None,
                    dtype,
                )?,
                down: Linear::new(
                    &format!("{down_name}[{j}]"),
                    d.to_vec(),
                    h,
                    inter,
                    None,
                    dtype,
                )?,
                inter,
            })
        })
        .collect()
}

fn attention(
    f: &Fetcher,
    cfg: &Config,
    layer: usize,
    dtype: Dtype,
) -> Result<AttnWeights, RolloutError> {
    let prefix = spec::attention_prefix(layer);
    let name = |leaf: &str| format!("{prefix}.{leaf}");
    match &cfg.attention {
        AttentionConfig::Gqa {
            qkv_bias, qk_norm, ..
        } => {
            let parts = QKV_PROJ
                .iter()
                .map(|p| f.get(&spec::weight(&name(p))))
                .collect::<Result<Vec<_>, _>>()?;
            let bias = if *qkv_bias {
                let mut b = Vec::new();
                for p in QKV_PROJ {
                    b.extend(f.vector(&spec::bias(&name(p)))?);
                }
                Some(b)
            } else {
                None
            };
            let qkv = stack(&name("qkv"), parts, bias, dtype)?;
            let norm = |leaf: &str| match qk_norm {
                QkNorm::None => Ok(None),
                QkNorm::PerHead | QkNorm::Full => f
                    .vector(&spec::weight(&name(leaf)))
                    .map(|v| Some(stored(v, dtype))),
            };
            Ok(AttnWeights::Gqa {
                qkv,
                o: linear(f, &name(O_PROJ), false, dtype)?,
                q_norm: norm(Q_NORM)?,
                k_norm: norm(K_NORM)?,
            })
        }
        AttentionConfig::Mla { q_lora_rank, .. } => {
            let (q_a, q_b) = match q_lora_rank {
                Some(_) => (
                    Some((
                        linear(f, &name(MLA_Q_A), false, dtype)?,
                        stored(f.vector(&spec::weight(&name(MLA_Q_A_NORM)))?, dtype),
                    )),
                    linear(f, &name(MLA_Q_B), false, dtype)?,
                ),
                None => (None, linear(f, &name(MLA_Q), false, dtype)?),
            };
            Ok(AttnWeights::Mla {
                q_a,
                q_b,
                kv_a: linear(f, &name(MLA_KV_A), false, dtype)?,
                kv_a_norm: stored(f.vector(&spec::weight(&name(MLA_KV_A_NORM)))?, dtype),
                kv_b: linear(f, &name(MLA_KV_B), false, dtype)?,
                o: linear(f, &name(O_PROJ), false, dtype)?,
            })
        }
    }
}

/// A MoE layer's missing MoE settings: what the trainer refuses, the engine refuses too.
fn dense_config_error(layer: usize) -> RolloutError {
    RolloutError::InconsistentMoeLayer {
        layer,
        missing: "MoE settings (the config has none)",
    }
}

/// Checks that every layer the layout routes has MoE settings to route with.
fn check_moe_layers(cfg: &Config) -> Result<(), RolloutError> {
    match (cfg.layer_layout().moe_layers().first(), &cfg.moe) {
        (Some(&layer), None) => Err(dense_config_error(layer)),
        _ => Ok(()),
    }
}

fn mlp(
    f: &Fetcher,
    cfg: &Config,
    layer: usize,
    dtype: Dtype,
    router_dtype: RouterDtype,
) -> Result<MlpWeights, RolloutError> {
    let Some(column) = cfg.layer_layout().moe_column(layer) else {
        let dense = ffn(f, &spec::dense_mlp_prefix(layer), &SWIGLU_HF, dtype)?;
        return Ok(MlpWeights::Dense(dense));
    };
    let moe = cfg.moe.as_ref().ok_or_else(|| dense_config_error(layer))?;
    let m = spec::moe_prefix(cfg, layer);
    let gate_dtype = match router_dtype {
        RouterDtype::Model => dtype,
        RouterDtype::F32 => Dtype::F32,
    };
    let router = linear(f, &format!("{m}.{ROUTER}"), false, gate_dtype)?;
    let score_bias = match moe.router {
        RouterKind::GroupedSigmoid { .. } => Some(f.vector(&format!("{m}.{SCORE_BIAS}"))?),
        RouterKind::Softmax { .. } => None,
    };
    let experts = match f.layout() {
        ExpertLayout::Fused => fused_experts(f, &m, dtype)?,
        ExpertLayout::PerExpert => {
            let names = expert_names(cfg);
            (0..moe.num_experts)
                .map(|j| ffn(f, &spec::expert_prefix(&m, j), &names, dtype))
                .collect::<Result<Vec<_>, _>>()?
        }
    };
    let shared = spec::shared_expert(&m, moe.shared)
        .map(|(prefix, _)| ffn(f, &prefix, &SWIGLU_HF, dtype))
        .transpose()?;
    let shared_gate = match moe.shared {
        SharedExpert::Gated { .. } => Some(linear(
            f,
            &format!("{m}.{SHARED_EXPERT_GATE}"),
            false,
            dtype,
        )?),
        SharedExpert::None | SharedExpert::Plain { .. } => None,
    };
    Ok(MlpWeights::Moe(Box::new(MoeWeights {
        column,
        rule: Router::new(moe),
        router,
        score_bias,
        experts,
        shared,
        shared_gate,
    })))
}

impl ModelWeights {
    /// Builds the engine weights from HF-named tensors (experts per expert or fused); a
    /// missing or mis-shaped tensor is an error naming it, a MoE layer without MoE settings
    /// is [`RolloutError::InconsistentMoeLayer`]. The router runs in the model dtype.
    pub fn from_tensors(cfg: &Config, map: &TensorMap, dtype: Dtype) -> Result<Self, RolloutError> {
        Self::from_tensors_with_router(cfg, map, dtype, RouterDtype::Model)
    }

    /// [`ModelWeights::from_tensors`] with the router's precision chosen separately.
    pub fn from_tensors_with_router(
        cfg: &Config,
        map: &TensorMap,
        dtype: Dtype,
        router_dtype: RouterDtype,
    ) -> Result<Self, RolloutError> {
        check_moe_layers(cfg)?;
        let f = Fetcher::new(map, cfg)?;
        let (embed, embed_shape) = f.get(&spec::weight(EMBED))?;
        let norm_vec = |name: &str| Ok::<_, RolloutError>(stored(f.vector(name)?, dtype));
        // Layers convert and pack independently (one weight sync of a 200 M-parameter model
        // is ~2 GB of copying and packing), so they run on the rayon pool; each layer's
        // result depends only on its tensors, and the first error in layer order is reported.
        let layers = (0..cfg.num_hidden_layers)
            .into_par_iter()
            .map(|i| {
                Ok(LayerWeights {
                    input_norm: norm_vec(&spec::weight(&spec::input_norm(i)))?,
                    post_norm: norm_vec(&spec::weight(&spec::post_attention_norm(i)))?,
                    attn: attention(&f, cfg, i, dtype)?,
                    mlp: mlp(&f, cfg, i, dtype, router_dtype)?,
                })
            })
            .collect::<Vec<Result<LayerWeights, RolloutError>>>()
            .into_iter()
            .collect::<Result<Vec<_>, RolloutError>>()?;
        let norm = norm_vec(&spec::weight(FINAL_NORM))?;
        let lm_head = if cfg.tie_word_embeddings {
            matrix("lm_head (tied)", embed.clone(), &embed_shape, None, dtype)?
        } else {
            linear(&f, LM_HEAD, false, dtype)?
        };
        // Rows are gathered, not multiplied: bf16 mode stores the bf16 values in f32.
        let embed = stored(embed, dtype);
        Ok(ModelWeights {
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// Bytes held by all weights.
    pub fn size_bytes(&self) -> usize {
        let ffn_bytes = |f: &Ffn| f.gate_up.size_bytes() + f.down.size_bytes();
        let mut total = self.embed.len() * 4 + self.norm.len() * 4 + self.lm_head.size_bytes();
        for l in &self.layers {
            total += (l.input_norm.len() + l.post_norm.len()) * 4;
            total += match &l.attn {
                AttnWeights::Gqa { qkv, o, .. } => qkv.size_bytes() + o.size_bytes(),
                AttnWeights::Mla {
                    q_a,
                    q_b,
                    kv_a,
                    kv_b,
                    o,
                    ..
                } => {
                    q_a.as_ref().map_or(0, |q| q.0.size_bytes())
                        + q_b.size_bytes()
                        + kv_a.size_bytes()
                        + kv_b.size_bytes()
                        + o.size_bytes()
                }
            };
            total += match &l.mlp {
                MlpWeights::Dense(d) => ffn_bytes(d),
                MlpWeights::Moe(m) => {
                    m.router.size_bytes()
                        + m.experts.iter().map(ffn_bytes).sum::<usize>()
                        + m.shared.as_ref().map_or(0, ffn_bytes)
                }
            };
        }
        total
    }
}
