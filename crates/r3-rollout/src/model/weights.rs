//! The engine's own weight layout, built from HF-named tensors: fused q/k/v and gate/up
//! projections, every matmul weight in the engine dtype, norms and biases in f32.

use r3_model::{Architecture, AttentionConfig, Config, QkNorm, SharedExpert};

use crate::dtype::Dtype;
use crate::error::RolloutError;
use crate::kernels::linear::Linear;
use crate::model::tensors::Fetcher;

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

fn linear(
    f: &Fetcher,
    name: &str,
    out: usize,
    inp: usize,
    bias: bool,
    dtype: Dtype,
) -> Result<Linear, RolloutError> {
    let w = f.get(&format!("{name}.weight"), &[out, inp])?;
    let b = if bias {
        Some(f.get(&format!("{name}.bias"), &[out])?)
    } else {
        None
    };
    Linear::new(name, w, out, inp, b, dtype)
}

/// Stacks row-major matrices with the same column count (used to fuse projections).
fn stack(
    name: &str,
    parts: Vec<(Vec<f32>, usize)>,
    cols: usize,
    bias: Option<Vec<f32>>,
    dtype: Dtype,
) -> Result<Linear, RolloutError> {
    let rows: usize = parts.iter().map(|p| p.1).sum();
    let mut w = Vec::with_capacity(rows * cols);
    for (p, _) in parts {
        w.extend_from_slice(&p);
    }
    Linear::new(name, w, rows, cols, bias, dtype)
}

fn ffn(
    f: &Fetcher,
    prefix: &str,
    names: [&str; 3],
    hidden: usize,
    inter: usize,
    dtype: Dtype,
) -> Result<Ffn, RolloutError> {
    let [g, u, d] = names;
    let gate = f.get(&format!("{prefix}.{g}.weight"), &[inter, hidden])?;
    let up = f.get(&format!("{prefix}.{u}.weight"), &[inter, hidden])?;
    let gate_up = stack(
        &format!("{prefix}.{g}+{u}"),
        vec![(gate, inter), (up, inter)],
        hidden,
        None,
        dtype,
    )?;
    let down = linear(f, &format!("{prefix}.{d}"), hidden, inter, false, dtype)?;
    Ok(Ffn {
        gate_up,
        down,
        inter,
    })
}

fn attention(
    f: &Fetcher,
    cfg: &Config,
    p: &str,
    dtype: Dtype,
) -> Result<AttnWeights, RolloutError> {
    let h = cfg.hidden_size;
    let nh = cfg.num_attention_heads;
    match &cfg.attention {
        AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            qkv_bias,
            qk_norm,
            ..
        } => {
            let (qd, kd) = (nh * head_dim, num_kv_heads * head_dim);
            let get =
                |n: &str, rows: usize| f.get(&format!("{p}.self_attn.{n}.weight"), &[rows, h]);
            let parts = vec![
                (get("q_proj", qd)?, qd),
                (get("k_proj", kd)?, kd),
                (get("v_proj", kd)?, kd),
            ];
            let bias = if *qkv_bias {
                let mut b = f.get(&format!("{p}.self_attn.q_proj.bias"), &[qd])?;
                b.extend(f.get(&format!("{p}.self_attn.k_proj.bias"), &[kd])?);
                b.extend(f.get(&format!("{p}.self_attn.v_proj.bias"), &[kd])?);
                Some(b)
            } else {
                None
            };
            let qkv = stack(&format!("{p}.self_attn.qkv"), parts, h, bias, dtype)?;
            let (qn, kn) = match qk_norm {
                QkNorm::None => (None, None),
                QkNorm::PerHead => (Some(*head_dim), Some(*head_dim)),
                QkNorm::Full => (Some(qd), Some(kd)),
            };
            let q_norm = qn
                .map(|n| f.get(&format!("{p}.self_attn.q_norm.weight"), &[n]))
                .transpose()?;
            let k_norm = kn
                .map(|n| f.get(&format!("{p}.self_attn.k_norm.weight"), &[n]))
                .transpose()?;
            let o = linear(f, &format!("{p}.self_attn.o_proj"), h, qd, false, dtype)?;
            Ok(AttnWeights::Gqa {
                qkv,
                o,
                q_norm,
                k_norm,
            })
        }
        AttentionConfig::Mla {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        } => {
            let qk = qk_nope_head_dim + qk_rope_head_dim;
            let a = format!("{p}.self_attn");
            let (q_a, q_b) = match q_lora_rank {
                Some(r) => {
                    let qa = linear(f, &format!("{a}.q_a_proj"), *r, h, false, dtype)?;
                    let qn = f.get(&format!("{a}.q_a_layernorm.weight"), &[*r])?;
                    (
                        Some((qa, qn)),
                        linear(f, &format!("{a}.q_b_proj"), nh * qk, *r, false, dtype)?,
                    )
                }
                None => (
                    None,
                    linear(f, &format!("{a}.q_proj"), nh * qk, h, false, dtype)?,
                ),
            };
            let kv_a = linear(
                f,
                &format!("{a}.kv_a_proj_with_mqa"),
                kv_lora_rank + qk_rope_head_dim,
                h,
                false,
                dtype,
            )?;
            let kv_a_norm = f.get(&format!("{a}.kv_a_layernorm.weight"), &[*kv_lora_rank])?;
            let kv_b = linear(
                f,
                &format!("{a}.kv_b_proj"),
                nh * (qk_nope_head_dim + v_head_dim),
                *kv_lora_rank,
                false,
                dtype,
            )?;
            let o = linear(f, &format!("{a}.o_proj"), h, nh * v_head_dim, false, dtype)?;
            Ok(AttnWeights::Mla {
                q_a,
                q_b,
                kv_a,
                kv_a_norm,
                kv_b,
                o,
            })
        }
    }
}

fn mlp(
    f: &Fetcher,
    cfg: &Config,
    layer: usize,
    p: &str,
    dtype: Dtype,
) -> Result<MlpWeights, RolloutError> {
    let h = cfg.hidden_size;
    let names = match cfg.architecture {
        Architecture::Mixtral => ["w1", "w3", "w2"],
        _ => ["gate_proj", "up_proj", "down_proj"],
    };
    let moe = match (&cfg.moe, cfg.is_moe_layer(layer)) {
        (Some(m), true) => m,
        _ => {
            let d = ffn(
                f,
                &format!("{p}.mlp"),
                ["gate_proj", "up_proj", "down_proj"],
                h,
                cfg.intermediate_size,
                dtype,
            )?;
            return Ok(MlpWeights::Dense(d));
        }
    };
    let mp = format!("{p}.{}", cfg.moe_prefix());
    let (e, inter) = (moe.num_experts, moe.expert_intermediate_size);
    let router = linear(f, &format!("{mp}.gate"), e, h, false, dtype)?;
    let bias_name = format!("{mp}.gate.e_score_correction_bias");
    let score_bias = if f.has(&bias_name) {
        Some(f.get(&bias_name, &[e])?)
    } else {
        None
    };
    let experts = (0..e)
        .map(|i| ffn(f, &format!("{mp}.experts.{i}"), names, h, inter, dtype))
        .collect::<Result<Vec<_>, _>>()?;
    let std3 = ["gate_proj", "up_proj", "down_proj"];
    let (shared, shared_gate) = match moe.shared {
        SharedExpert::None => (None, None),
        SharedExpert::Plain { intermediate_size } => (
            Some(ffn(
                f,
                &format!("{mp}.shared_experts"),
                std3,
                h,
                intermediate_size,
                dtype,
            )?),
            None,
        ),
        SharedExpert::Gated { intermediate_size } => (
            Some(ffn(
                f,
                &format!("{mp}.shared_expert"),
                std3,
                h,
                intermediate_size,
                dtype,
            )?),
            Some(linear(
                f,
                &format!("{mp}.shared_expert_gate"),
                1,
                h,
                false,
                dtype,
            )?),
        ),
    };
    Ok(MlpWeights::Moe(Box::new(MoeWeights {
        router,
        score_bias,
        experts,
        shared,
        shared_gate,
    })))
}

impl ModelWeights {
    /// Builds the engine weights from HF-named tensors; a missing or mis-shaped tensor is an
    /// error naming it.
    pub fn from_tensors(cfg: &Config, f: &Fetcher, dtype: Dtype) -> Result<Self, RolloutError> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let embed = f.get("model.embed_tokens.weight", &[v, h])?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                Ok(LayerWeights {
                    input_norm: f.get(&format!("{p}.input_layernorm.weight"), &[h])?,
                    post_norm: f.get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                    attn: attention(f, cfg, &p, dtype)?,
                    mlp: mlp(f, cfg, i, &p, dtype)?,
                })
            })
            .collect::<Result<Vec<_>, RolloutError>>()?;
        let norm = f.get("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings && !f.has("lm_head.weight") {
            Linear::new("lm_head (tied)", embed.clone(), v, h, None, dtype)?
        } else {
            linear(f, "lm_head", v, h, false, dtype)?
        };
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
