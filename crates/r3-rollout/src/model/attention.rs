//! Attention layers of the inference path: projections, q/k norms, RoPE, writing this step's
//! keys and values into the paged cache, paged attention and the output projection.
//! MLA is run naively: the compressed kv is decompressed per token and the full per-head
//! keys and values are cached, so the attention kernel is the same as for GQA.

use r3_model::layers::attention::rope::mla_softmax_scale_multiplier;
use r3_model::{AttentionConfig, Config, QkNorm};

use rayon::prelude::*;

use crate::dtype::Dtype;
use crate::kernels::attention::{paged_attention, AttnShape, SeqSpan};
use crate::kernels::ops::{rms_norm_rows, Rope};
use crate::kv_pool::KvPool;
use crate::model::weights::AttnWeights;

/// Rows a task of the per-row work (q/k norms, RoPE) takes at least: a decode step's
/// few rows stay on one thread.
const ROWS_PER_TASK: usize = 32;

/// Per-layer attention geometry derived from the config once.
#[derive(Debug, Clone, Copy)]
pub struct AttnGeometry {
    /// Shape the attention kernel needs.
    pub shape: AttnShape,
    /// Width of the rotated part of a query/key head.
    pub rope_dim: usize,
    /// MLA: width of the non-rotary part (0 for GQA).
    pub nope_dim: usize,
    /// MLA: kv compression rank (0 for GQA).
    pub kv_lora_rank: usize,
    /// Clamp of q/k/v (OLMoE `clip_qkv`).
    pub clip_qkv: Option<f32>,
    /// Kind of q/k norm (GQA only).
    pub qk_norm: QkNorm,
    /// RMSNorm epsilon: the config's `rms_norm_eps`, MLA's `q_a` / `kv_a` norms included
    /// (SGLang's and Megatron's rule, not HF's fixed 1e-6 there; see r3-model's
    /// `MlaAttention::new`).
    pub eps: f32,
}

impl AttnGeometry {
    /// Geometry of `cfg`'s attention (MLA's softmax scale with r3-model's YaRN multiplier).
    pub fn new(cfg: &Config) -> Self {
        let nh = cfg.num_attention_heads;
        let eps = cfg.rms_norm_eps as f32;
        match &cfg.attention {
            AttentionConfig::Gqa {
                num_kv_heads,
                head_dim,
                qk_norm,
                clip_qkv,
                sliding_window,
                ..
            } => AttnGeometry {
                shape: AttnShape {
                    num_heads: nh,
                    num_kv_heads: *num_kv_heads,
                    qk_dim: *head_dim,
                    v_dim: *head_dim,
                    scale: 1.0 / (*head_dim as f32).sqrt(),
                    window: *sliding_window,
                },
                rope_dim: cfg.rope.dim,
                nope_dim: 0,
                kv_lora_rank: 0,
                clip_qkv: clip_qkv.map(|c| c as f32),
                qk_norm: *qk_norm,
                eps,
            },
            AttentionConfig::Mla {
                kv_lora_rank,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
                ..
            } => {
                let qk = qk_nope_head_dim + qk_rope_head_dim;
                let scale_mult = mla_softmax_scale_multiplier(&cfg.rope) as f32;
                AttnGeometry {
                    shape: AttnShape {
                        num_heads: nh,
                        num_kv_heads: nh,
                        qk_dim: qk,
                        v_dim: *v_head_dim,
                        scale: scale_mult / (qk as f32).sqrt(),
                        window: None,
                    },
                    rope_dim: *qk_rope_head_dim,
                    nope_dim: *qk_nope_head_dim,
                    kv_lora_rank: *kv_lora_rank,
                    clip_qkv: None,
                    qk_norm: QkNorm::None,
                    eps,
                }
            }
        }
    }

    /// Floats per token of cached keys and of cached values.
    pub fn kv_dims(&self) -> (usize, usize) {
        let s = self.shape;
        (s.num_kv_heads * s.qk_dim, s.num_kv_heads * s.v_dim)
    }
}

/// Where each flat token's KV goes: (block id, slot) per token.
pub type KvSlots = [(crate::kv_pool::KvBlockId, usize)];

/// Runs one attention layer on normalised inputs `h [T, hidden]`; returns `[T, hidden]`.
/// In bf16 mode q/k norm outputs, rotated q and k (what the KV cache holds), MLA's latent norm
/// and the attention output are rounded to bf16, as a bf16 engine stores them.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    dtype: Dtype,
    w: &AttnWeights,
    g: &AttnGeometry,
    rope: &Rope,
    pool: &mut KvPool,
    layer: usize,
    spans: &[SeqSpan],
    positions: &[usize],
    slots: &KvSlots,
    h: &[f32],
) -> Vec<f32> {
    let t = positions.len();
    let s = g.shape;
    let (nh, qk) = (s.num_heads, s.qk_dim);
    let (kd, vd) = g.kv_dims();
    let mut q = vec![0f32; t * nh * qk];
    let o_proj = match w {
        AttnWeights::Gqa {
            qkv,
            o,
            q_norm,
            k_norm,
        } => {
            let width = qkv.out_features();
            let mut buf = vec![0f32; t * width];
            qkv.forward(h, t, &mut buf, true);
            let qd = nh * qk;
            // Rows side by side (a decode step's 256 rows in turn were ≈ 10% of a GRPO
            // rollout's time); each row's values are the same whichever thread runs it.
            buf.par_chunks_exact_mut(width)
                .zip(q.par_chunks_exact_mut(qd))
                .enumerate()
                .with_min_len(ROWS_PER_TASK)
                .for_each(|(i, (row, q_row))| {
                    let (qr, kv) = row.split_at_mut(qd);
                    let (kr, vr) = kv.split_at_mut(kd);
                    match g.qk_norm {
                        QkNorm::None => {}
                        QkNorm::PerHead | QkNorm::Full => {
                            if let (Some(qn), Some(kn)) = (q_norm, k_norm) {
                                rms_norm_rows(qr, qn, g.eps);
                                rms_norm_rows(kr, kn, g.eps);
                                dtype.round_activations(qr);
                                dtype.round_activations(kr);
                            }
                        }
                    }
                    // HF `OlmoeAttention.forward` clamps q, k and v after the q/k norms (as
                    // r3-model's `GqaAttention` does).
                    if let Some(c) = g.clip_qkv {
                        qr.iter_mut()
                            .chain(kr.iter_mut())
                            .chain(vr.iter_mut())
                            .for_each(|v| *v = v.clamp(-c, c));
                    }
                    for head in qr.chunks_exact_mut(qk).chain(kr.chunks_exact_mut(qk)) {
                        rope.apply(&mut head[..g.rope_dim], positions[i]);
                    }
                    dtype.round_activations(qr);
                    dtype.round_activations(kr);
                    q_row.copy_from_slice(qr);
                });
            for (row, &(blk, slot)) in buf.chunks_exact(width).zip(slots) {
                let (kr, vr) = row[qd..].split_at(kd);
                pool.write(blk, layer, slot, kr, vr);
            }
            o
        }
        AttnWeights::Mla {
            q_a,
            q_b,
            kv_a,
            kv_a_norm,
            kv_b,
            o,
        } => {
            // Queries.
            match q_a {
                Some((qa, qa_norm)) => {
                    let mut c = vec![0f32; t * qa.out_features()];
                    qa.forward(h, t, &mut c, true);
                    rms_norm_rows(&mut c, qa_norm, g.eps);
                    dtype.round_activations(&mut c);
                    q_b.forward(&c, t, &mut q, true);
                }
                None => q_b.forward(h, t, &mut q, true),
            }
            // Compressed kv and the shared rotary key.
            let (r, rd, nd) = (g.kv_lora_rank, g.rope_dim, g.nope_dim);
            let mut ckv = vec![0f32; t * (r + rd)];
            kv_a.forward(h, t, &mut ckv, true);
            let mut lat = vec![0f32; t * r];
            for i in 0..t {
                lat[i * r..(i + 1) * r].copy_from_slice(&ckv[i * (r + rd)..i * (r + rd) + r]);
            }
            rms_norm_rows(&mut lat, kv_a_norm, g.eps);
            dtype.round_activations(&mut lat);
            let kvb_w = nh * (nd + s.v_dim);
            let mut kvb = vec![0f32; t * kvb_w];
            kv_b.forward(&lat, t, &mut kvb, true);
            let mut krow = vec![0f32; kd];
            let mut vrow = vec![0f32; vd];
            for i in 0..t {
                let pos = positions[i];
                let mut k_pe = ckv[i * (r + rd) + r..(i + 1) * (r + rd)].to_vec();
                rope.apply(&mut k_pe, pos);
                dtype.round_activations(&mut k_pe);
                for hh in 0..nh {
                    let src = &kvb[i * kvb_w + hh * (nd + s.v_dim)..][..nd + s.v_dim];
                    krow[hh * qk..hh * qk + nd].copy_from_slice(&src[..nd]);
                    krow[hh * qk + nd..(hh + 1) * qk].copy_from_slice(&k_pe);
                    vrow[hh * s.v_dim..(hh + 1) * s.v_dim].copy_from_slice(&src[nd..]);
                    let qh = &mut q[(i * nh + hh) * qk..(i * nh + hh + 1) * qk];
                    rope.apply(&mut qh[nd..], pos);
                    dtype.round_activations(&mut qh[nd..]);
                }
                let (blk, slot) = slots[i];
                pool.write(blk, layer, slot, &krow, &vrow);
            }
            o
        }
    };
    let mut attn = vec![0f32; t * nh * s.v_dim];
    paged_attention(pool, layer, spans, &q, &mut attn, s, true);
    dtype.round_activations(&mut attn);
    let mut out = vec![0f32; t * o_proj.out_features()];
    o_proj.forward(&attn, t, &mut out, true);
    out
}
