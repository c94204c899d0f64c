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
use crate::kernels::linear::{copy_parallel, Linear};
use crate::kernels::packed_f16::StackedRows;
use crate::model::tensors::{cpu_f32_map, F32Values, Fetcher, TensorMap};

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

/// Overwrites `dst` with `src` (same length), stored as [`stored`] would.
fn fill_stored(name: &str, dst: &mut [f32], src: &[f32], dtype: Dtype) -> Result<(), RolloutError> {
    if dst.len() != src.len() {
        return Err(layout_mismatch(format!(
            "{name} has {} values, the engine {}",
            src.len(),
            dst.len()
        )));
    }
    copy_parallel(dst, src);
    dtype.round_activations(dst);
    Ok(())
}

/// The error of an in-place update whose engine weights do not have the layout the config
/// gives (weights swapped in for another config): the update builds them afresh instead.
fn layout_mismatch(what: String) -> RolloutError {
    RolloutError::Weights(format!(
        "the engine's weights do not have the config's layout: {what}"
    ))
}

/// The column count of a row-major matrix with the shape the spec checked.
fn columns(name: &str, shape: &[usize]) -> Result<usize, RolloutError> {
    match shape {
        &[_, cols] => Ok(cols),
        _ => Err(RolloutError::Weights(format!(
            "{name}: expected a matrix, got shape {shape:?}"
        ))),
    }
}

/// A layer from a row-major matrix with the shape the spec checked.
fn matrix(
    name: &str,
    w: &[f32],
    shape: &[usize],
    bias: Option<Vec<f32>>,
    dtype: Dtype,
) -> Result<Linear, RolloutError> {
    let block = [w];
    let rows = StackedRows::new(&block, columns(name, shape)?);
    Linear::from_rows(name, &rows, bias.map(|b| stored(b, dtype)), dtype)
}

/// A tensor's f32 values and its shape, as [`Fetcher::get`] hands them out.
type Fetched<'a> = (F32Values<'a>, Vec<usize>);

/// The weight `{prefix}.weight`, its shape and (when `bias`) `{prefix}.bias`.
fn weight_and_bias<'a>(
    f: &Fetcher<'a>,
    prefix: &str,
    bias: bool,
) -> Result<(Fetched<'a>, Option<Vec<f32>>), RolloutError> {
    let (w, shape) = f.get(&spec::weight(prefix))?;
    let b = if bias {
        Some(f.vector(&spec::bias(prefix))?)
    } else {
        None
    };
    Ok(((w, shape), b))
}

/// The layer `{prefix}.weight` (and `{prefix}.bias` when `bias`).
fn linear(f: &Fetcher, prefix: &str, bias: bool, dtype: Dtype) -> Result<Linear, RolloutError> {
    let ((w, shape), b) = weight_and_bias(f, prefix, bias)?;
    matrix(prefix, &w, &shape, b, dtype)
}

/// [`linear`] into the existing layer `dst`, in place.
fn refill_linear(
    f: &Fetcher,
    prefix: &str,
    bias: bool,
    dst: &mut Linear,
) -> Result<(), RolloutError> {
    let ((w, shape), b) = weight_and_bias(f, prefix, bias)?;
    let block = [&*w];
    let rows = StackedRows::new(&block, columns(prefix, &shape)?);
    dst.refill(prefix, &rows, b.as_deref())
}

/// The blocks of row-major matrices with the same column count, to stack (used to fuse
/// projections), and that count.
fn stacked<'v>(
    name: &str,
    parts: &'v [Fetched<'_>],
) -> Result<(Vec<&'v [f32]>, usize), RolloutError> {
    let cols = parts.first().and_then(|p| p.1.get(1).copied()).unwrap_or(0);
    for (_, shape) in parts {
        if shape.len() != 2 || shape[1] != cols {
            return Err(RolloutError::Weights(format!(
                "{name}: cannot stack a {shape:?} part onto {cols} columns"
            )));
        }
    }
    Ok((parts.iter().map(|p| &*p.0).collect(), cols))
}

/// Stacks row-major matrices with the same column count (used to fuse projections).
fn stack(
    name: &str,
    parts: &[Fetched<'_>],
    bias: Option<Vec<f32>>,
    dtype: Dtype,
) -> Result<Linear, RolloutError> {
    let (blocks, cols) = stacked(name, parts)?;
    let rows = StackedRows::new(&blocks, cols);
    Linear::from_rows(name, &rows, bias.map(|b| stored(b, dtype)), dtype)
}

/// [`stack`] into the existing layer `dst`, in place.
fn refill_stack(
    name: &str,
    parts: &[Fetched<'_>],
    bias: Option<&[f32]>,
    dst: &mut Linear,
) -> Result<(), RolloutError> {
    let (blocks, cols) = stacked(name, parts)?;
    dst.refill(name, &StackedRows::new(&blocks, cols), bias)
}

/// The gate and up projections of a SwiGLU block under `prefix`, the name of their stack
/// and the block's hidden width.
fn gate_up<'a>(
    f: &Fetcher<'a>,
    prefix: &str,
    names: &SwigluNames,
) -> Result<([Fetched<'a>; 2], String, usize), RolloutError> {
    let gate = f.get(&spec::weight(&format!("{prefix}.{}", names.gate)))?;
    let up = f.get(&spec::weight(&format!("{prefix}.{}", names.up)))?;
    let inter = gate.1.first().copied().unwrap_or(0);
    let name = format!("{prefix}.{}+{}", names.gate, names.up);
    Ok(([gate, up], name, inter))
}

/// The q, k and v projections of the attention under `prefix`, to stack, and their biases
/// concatenated in the same order when the config has them.
fn qkv_parts<'a>(
    f: &Fetcher<'a>,
    prefix: &str,
    with_bias: bool,
) -> Result<(Vec<Fetched<'a>>, Option<Vec<f32>>), RolloutError> {
    let name = |leaf: &str| format!("{prefix}.{leaf}");
    let parts = QKV_PROJ
        .iter()
        .map(|p| f.get(&spec::weight(&name(p))))
        .collect::<Result<Vec<_>, _>>()?;
    let bias = if with_bias {
        let mut b = Vec::new();
        for p in QKV_PROJ {
            b.extend(f.vector(&spec::bias(&name(p)))?);
        }
        Some(b)
    } else {
        None
    };
    Ok((parts, bias))
}

/// A SwiGLU block from its three HF projections under `prefix`.
fn ffn(f: &Fetcher, prefix: &str, names: &SwigluNames, dtype: Dtype) -> Result<Ffn, RolloutError> {
    let (parts, name, inter) = gate_up(f, prefix, names)?;
    let gate_up = stack(&name, &parts, None, dtype)?;
    let down = linear(f, &format!("{prefix}.{}", names.down), false, dtype)?;
    Ok(Ffn {
        gate_up,
        down,
        inter,
    })
}

/// [`ffn`] into the existing block `dst`, in place.
fn refill_ffn(
    f: &Fetcher,
    prefix: &str,
    names: &SwigluNames,
    dst: &mut Ffn,
) -> Result<(), RolloutError> {
    let (parts, name, inter) = gate_up(f, prefix, names)?;
    if inter != dst.inter {
        return Err(layout_mismatch(format!(
            "{name} is {inter} wide, the engine's {}",
            dst.inter
        )));
    }
    refill_stack(&name, &parts, None, &mut dst.gate_up)?;
    refill_linear(f, &format!("{prefix}.{}", names.down), false, &mut dst.down)
}

/// Every routed expert from the fused `gate_up_proj` `[E, 2I, H]` and `down_proj`
/// `[E, H, I]` of a MoE block: expert `j`'s slices are its `[gate; up]` and down matrices.
fn fused_experts(f: &Fetcher, moe_prefix: &str, dtype: Dtype) -> Result<Vec<Ffn>, RolloutError> {
    let fused = FusedExperts::get(f, moe_prefix)?;
    fused
        .experts()
        .enumerate()
        .map(|(j, (gu, d))| {
            Ok(Ffn {
                gate_up: Linear::from_rows(
                    &format!("{}[{j}]", fused.gate_up_name),
                    &StackedRows::new(&[gu], fused.h),
                    None,
                    dtype,
                )?,
                down: Linear::from_rows(
                    &format!("{}[{j}]", fused.down_name),
                    &StackedRows::new(&[d], fused.inter),
                    None,
                    dtype,
                )?,
                inter: fused.inter,
            })
        })
        .collect()
}

/// [`fused_experts`] into the existing experts `dst`, in place.
fn refill_fused_experts(
    f: &Fetcher,
    moe_prefix: &str,
    dst: &mut [Ffn],
) -> Result<(), RolloutError> {
    let fused = FusedExperts::get(f, moe_prefix)?;
    if dst.len() != fused.e {
        return Err(layout_mismatch(format!(
            "{moe_prefix} has {} experts, the engine {}",
            fused.e,
            dst.len()
        )));
    }
    for (j, ((gu, d), ffn)) in fused.experts().zip(dst).enumerate() {
        ffn.gate_up.refill(
            &format!("{}[{j}]", fused.gate_up_name),
            &StackedRows::new(&[gu], fused.h),
            None,
        )?;
        ffn.down.refill(
            &format!("{}[{j}]", fused.down_name),
            &StackedRows::new(&[d], fused.inter),
            None,
        )?;
    }
    Ok(())
}

/// The fused `gate_up_proj` `[E, 2I, H]` and `down_proj` `[E, H, I]` of a MoE block, checked
/// to hold every expert in full.
struct FusedExperts<'a> {
    gate_up_name: String,
    down_name: String,
    gate_up: F32Values<'a>,
    down: F32Values<'a>,
    e: usize,
    two_inter: usize,
    h: usize,
    inter: usize,
}

impl<'a> FusedExperts<'a> {
    fn get(f: &Fetcher<'a>, moe_prefix: &str) -> Result<Self, RolloutError> {
        let (gate_up_name, down_name) = spec::fused_expert_names(moe_prefix);
        let (gate_up, gu_shape) = f.get(&gate_up_name)?;
        let (down, down_shape) = f.get(&down_name)?;
        let (&[e, two_inter, h], &[_, _, inter]) = (gu_shape.as_slice(), down_shape.as_slice())
        else {
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
        Ok(FusedExperts {
            gate_up_name,
            down_name,
            gate_up,
            down,
            e,
            two_inter,
            h,
            inter,
        })
    }

    /// Expert `j`'s `[gate; up]` and down matrices, in order.
    fn experts(&self) -> impl Iterator<Item = (&[f32], &[f32])> {
        self.gate_up
            .chunks_exact(self.two_inter * self.h)
            .zip(self.down.chunks_exact(self.h * self.inter))
            .take(self.e)
    }
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
            let (parts, bias) = qkv_parts(f, &prefix, *qkv_bias)?;
            let qkv = stack(&name("qkv"), &parts, bias, dtype)?;
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

/// [`attention`] into the existing projections `dst`, in place.
fn refill_attention(
    f: &Fetcher,
    cfg: &Config,
    layer: usize,
    dst: &mut AttnWeights,
    dtype: Dtype,
) -> Result<(), RolloutError> {
    let prefix = spec::attention_prefix(layer);
    let name = |leaf: &str| format!("{prefix}.{leaf}");
    let norm = |leaf: &str, dst: &mut Vec<f32>| {
        let n = spec::weight(&name(leaf));
        fill_stored(&n, dst, &f.get(&n)?.0, dtype)
    };
    match (&cfg.attention, dst) {
        (
            AttentionConfig::Gqa {
                qkv_bias, qk_norm, ..
            },
            AttnWeights::Gqa {
                qkv,
                o,
                q_norm,
                k_norm,
            },
        ) => {
            let (parts, bias) = qkv_parts(f, &prefix, *qkv_bias)?;
            refill_stack(&name("qkv"), &parts, bias.as_deref(), qkv)?;
            refill_linear(f, &name(O_PROJ), false, o)?;
            for (leaf, dst) in [(Q_NORM, q_norm), (K_NORM, k_norm)] {
                match (qk_norm, dst) {
                    (QkNorm::None, None) => {}
                    (QkNorm::PerHead | QkNorm::Full, Some(v)) => norm(leaf, v)?,
                    _ => return Err(layout_mismatch(format!("{} (q/k norm)", name(leaf)))),
                }
            }
            Ok(())
        }
        (
            AttentionConfig::Mla { q_lora_rank, .. },
            AttnWeights::Mla {
                q_a,
                q_b,
                kv_a,
                kv_a_norm,
                kv_b,
                o,
            },
        ) => {
            match (q_lora_rank, q_a) {
                (Some(_), Some((q_a, q_a_norm))) => {
                    refill_linear(f, &name(MLA_Q_A), false, q_a)?;
                    norm(MLA_Q_A_NORM, q_a_norm)?;
                    refill_linear(f, &name(MLA_Q_B), false, q_b)?;
                }
                (None, None) => refill_linear(f, &name(MLA_Q), false, q_b)?,
                _ => return Err(layout_mismatch(format!("{prefix} (q compression)"))),
            }
            refill_linear(f, &name(MLA_KV_A), false, kv_a)?;
            norm(MLA_KV_A_NORM, kv_a_norm)?;
            refill_linear(f, &name(MLA_KV_B), false, kv_b)?;
            refill_linear(f, &name(O_PROJ), false, o)
        }
        _ => Err(layout_mismatch(format!("{prefix} (attention kind)"))),
    }
}

/// [`mlp`] into the existing block `dst`, in place (the router keeps its dtype).
fn refill_mlp(
    f: &Fetcher,
    cfg: &Config,
    layer: usize,
    dst: &mut MlpWeights,
) -> Result<(), RolloutError> {
    let m = match (cfg.layer_layout().moe_column(layer), dst) {
        (None, MlpWeights::Dense(d)) => {
            return refill_ffn(f, &spec::dense_mlp_prefix(layer), &SWIGLU_HF, d)
        }
        (Some(column), MlpWeights::Moe(m)) if m.column == column => m,
        _ => return Err(layout_mismatch(format!("layer {layer} (dense or MoE)"))),
    };
    let moe = cfg.moe.as_ref().ok_or_else(|| dense_config_error(layer))?;
    let p = spec::moe_prefix(cfg, layer);
    refill_linear(f, &format!("{p}.{ROUTER}"), false, &mut m.router)?;
    match (&moe.router, &mut m.score_bias) {
        (RouterKind::GroupedSigmoid { .. }, Some(b)) => {
            let n = format!("{p}.{SCORE_BIAS}");
            fill_stored(&n, b, &f.get(&n)?.0, Dtype::F32)?;
        }
        (RouterKind::Softmax { .. }, None) => {}
        _ => return Err(layout_mismatch(format!("{p} (score bias)"))),
    }
    match f.layout() {
        ExpertLayout::Fused => refill_fused_experts(f, &p, &mut m.experts)?,
        ExpertLayout::PerExpert => {
            if m.experts.len() != moe.num_experts {
                return Err(layout_mismatch(format!("{p} (expert count)")));
            }
            let names = expert_names(cfg);
            for (j, e) in m.experts.iter_mut().enumerate() {
                refill_ffn(f, &spec::expert_prefix(&p, j), &names, e)?;
            }
        }
    }
    match (spec::shared_expert(&p, moe.shared), &mut m.shared) {
        (Some((prefix, _)), Some(s)) => refill_ffn(f, &prefix, &SWIGLU_HF, s)?,
        (None, None) => {}
        _ => return Err(layout_mismatch(format!("{p} (shared expert)"))),
    }
    match (moe.shared, &mut m.shared_gate) {
        (SharedExpert::Gated { .. }, Some(g)) => {
            refill_linear(f, &format!("{p}.{SHARED_EXPERT_GATE}"), false, g)
        }
        (SharedExpert::None | SharedExpert::Plain { .. }, None) => Ok(()),
        _ => Err(layout_mismatch(format!("{p} (shared expert gate)"))),
    }
}

/// [`ModelWeights::refill`]'s walk: every buffer overwritten in place, or the first layout
/// mismatch (possibly after some buffers were written).
fn refill_all(
    w: &mut ModelWeights,
    f: &Fetcher,
    cfg: &Config,
    dtype: Dtype,
) -> Result<(), RolloutError> {
    if w.layers.len() != cfg.num_hidden_layers {
        return Err(layout_mismatch(format!(
            "{} layers, the config {}",
            w.layers.len(),
            cfg.num_hidden_layers
        )));
    }
    let ModelWeights {
        embed,
        layers,
        norm,
        lm_head,
    } = w;
    let (layers, head) = rayon::join(
        || {
            layers
                .par_iter_mut()
                .enumerate()
                .map(|(i, l)| {
                    for (n, dst) in [
                        (spec::weight(&spec::input_norm(i)), &mut l.input_norm),
                        (
                            spec::weight(&spec::post_attention_norm(i)),
                            &mut l.post_norm,
                        ),
                    ] {
                        fill_stored(&n, dst, &f.get(&n)?.0, dtype)?;
                    }
                    refill_attention(f, cfg, i, &mut l.attn, dtype)?;
                    refill_mlp(f, cfg, i, &mut l.mlp)
                })
                .collect::<Vec<Result<(), RolloutError>>>()
        },
        || {
            let embed_name = spec::weight(EMBED);
            let (values, shape) = f.get(&embed_name)?;
            if cfg.tie_word_embeddings {
                let block = [&*values];
                let rows = StackedRows::new(&block, columns(&embed_name, &shape)?);
                lm_head.refill("lm_head (tied)", &rows, None)?;
            } else {
                refill_linear(f, LM_HEAD, false, lm_head)?;
            }
            fill_stored(&embed_name, embed, &values, dtype)?;
            let n = spec::weight(FINAL_NORM);
            fill_stored(&n, norm, &f.get(&n)?.0, dtype)
        },
    );
    layers.into_iter().collect::<Result<(), RolloutError>>()?;
    head
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
        // Layers pack independently (from the tensors' storage, borrowed), so they run on the
        // rayon pool; each layer's result depends only on its tensors, and the first error in
        // layer order is reported.
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
            matrix("lm_head (tied)", &embed, &embed_shape, None, dtype)?
        } else {
            linear(&f, LM_HEAD, false, dtype)?
        };
        // Rows are gathered, not multiplied: bf16 mode stores the bf16 values in f32.
        let embed = stored(embed.to_vec(), dtype);
        Ok(ModelWeights {
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// Overwrites these weights with HF-named tensors for `cfg` in place (no allocation: a
    /// weight sync reuses every buffer), holding exactly what
    /// [`ModelWeights::from_tensors_with_router`] would build from them; each matmul weight
    /// keeps its dtype (`dtype` rounds norms and biases, as there). Tensors are read from
    /// their storage, borrowed. The map is checked (names, shapes, conversions) before
    /// anything is written: an error there leaves the weights as they were. Weights without
    /// `cfg`'s layout (swapped in for another config) are built afresh from the tensors.
    pub fn refill(
        &mut self,
        cfg: &Config,
        map: &TensorMap,
        dtype: Dtype,
        router_dtype: RouterDtype,
    ) -> Result<(), RolloutError> {
        check_moe_layers(cfg)?;
        let map = cpu_f32_map(map)?;
        let f = Fetcher::new(&map, cfg)?;
        if let Err(mismatch) = refill_all(self, &f, cfg, dtype) {
            tracing::debug!(%mismatch, "weights built afresh");
            *self = Self::from_tensors_with_router(cfg, &map, dtype, router_dtype)?;
        }
        Ok(())
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
