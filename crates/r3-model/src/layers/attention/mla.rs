//! DeepSeek multi-head latent attention (MLA): low-rank q (optional, Moonlight has none)
//! and kv compression, a shared rotary key part, per-head non-rotary keys and values.

use candle_core::{Tensor, D};

use super::recompute::NarrowOperands;
use super::rope::{mla_softmax_scale_multiplier, PositionTables, RopeTables, Rotary};
use crate::config::{AttentionConfig, Config};
use crate::error::{ModelError, Result};
use crate::layers::attention::{
    attend, attend_cached, heads_to_tokens, AttentionMask, CacheMask, LayerKv, RowAttention,
    ScoreTiles,
};
use crate::layers::linear::Linear;
use crate::layers::norm::RmsNorm;
use crate::precision::{Precision, WeightGradients};
use crate::weights::Weights;

/// How queries are projected.
#[derive(Debug, Clone)]
enum QueryProj {
    /// `q_b_proj(q_a_layernorm(q_a_proj(x)))`
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
    /// `q_proj(x)` (`q_lora_rank: null`)
    Plain(Linear),
}

/// MLA self-attention block.
#[derive(Debug, Clone)]
pub struct MlaAttention {
    q: QueryProj,
    kv_a: Linear,
    kv_a_norm: RmsNorm,
    kv_b: Linear,
    o_proj: Linear,
    num_heads: usize,
    kv_lora_rank: usize,
    nope: usize,
    rope_dim: usize,
    v_dim: usize,
    scale: f64,
    precision: Precision,
    /// How many scores one product of a differentiated forward's attention may hold.
    score_tiles: ScoreTiles,
}

impl MlaAttention {
    /// Builds `prefix` (`model.layers.{i}.self_attn`).
    ///
    /// `q_a_layernorm` and `kv_a_layernorm` take the config's `rms_norm_eps`, as SGLang
    /// (`DeepseekV2AttentionMLA`: `RMSNorm(.., eps=config.rms_norm_eps)`) and Megatron-Core
    /// (`layernorm_epsilon`) build them, and as r3's rollout engines (which mirror SGLang)
    /// apply them. HF transformers (v4 and v5, and DeepSeek's remote code) builds both
    /// without `eps`, so they take `DeepseekV3RMSNorm`'s default 1e-6: a deliberate
    /// divergence from HF, invisible where `rms_norm_eps` is 1e-6 (DeepSeek-V3) and seen
    /// where it is not (Moonlight's 1e-5), most in latents of small variance.
    pub fn new(cfg: &Config, weights: &Weights, prefix: &str) -> Result<Self> {
        let AttentionConfig::Mla {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        } = &cfg.attention
        else {
            return Err(ModelError::InvalidConfig(
                "MLA attention built for a GQA config".into(),
            ));
        };
        let lin = |name: &str| Linear::new(weights, &format!("{prefix}.{name}"), false);
        // The config's eps (SGLang's and Megatron's rule), not HF's 1e-6: see the doc above.
        let norm =
            |name: &str| RmsNorm::new(weights, &format!("{prefix}.{name}"), cfg.rms_norm_eps);
        let q = match q_lora_rank {
            Some(_) => QueryProj::LowRank {
                a: lin("q_a_proj")?,
                norm: norm("q_a_layernorm")?,
                b: lin("q_b_proj")?,
            },
            None => QueryProj::Plain(lin("q_proj")?),
        };
        let scale = 1.0 / ((qk_nope_head_dim + qk_rope_head_dim) as f64).sqrt()
            * mla_softmax_scale_multiplier(&cfg.rope);
        Ok(MlaAttention {
            q,
            kv_a: lin("kv_a_proj_with_mqa")?,
            kv_a_norm: norm("kv_a_layernorm")?,
            kv_b: lin("kv_b_proj")?,
            o_proj: lin("o_proj")?,
            num_heads: cfg.num_attention_heads,
            kv_lora_rank: *kv_lora_rank,
            nope: *qk_nope_head_dim,
            rope_dim: *qk_rope_head_dim,
            v_dim: *v_head_dim,
            scale,
            precision: Precision::F32,
            score_tiles: ScoreTiles::DEFAULT,
        })
    }

    /// Sets the precision of the projections and norms; bf16 also rounds the rotated q and
    /// k parts.
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
        match &mut self.q {
            QueryProj::LowRank { a, norm, b } => {
                a.set_precision(precision);
                norm.set_precision(precision);
                b.set_precision(precision);
            }
            QueryProj::Plain(p) => p.set_precision(precision),
        }
        for l in [&mut self.kv_a, &mut self.kv_b, &mut self.o_proj] {
            l.set_precision(precision);
        }
        self.kv_a_norm.set_precision(precision);
    }

    /// Bounds the scores one product of the attention holds on devices without the CPU's
    /// fused op (its query rows then attended in blocks, forward and backward).
    pub fn set_score_tiles(&mut self, tiles: ScoreTiles) {
        self.score_tiles = tiles;
    }

    /// Sets the dtype a 16-bit forward hands the projections' gradients back in.
    pub fn set_weight_gradients(&mut self, grads: WeightGradients) {
        match &mut self.q {
            QueryProj::LowRank { a, b, .. } => {
                a.set_weight_gradients(grads);
                b.set_weight_gradients(grads);
            }
            QueryProj::Plain(p) => p.set_weight_gradients(grads),
        }
        for l in [&mut self.kv_a, &mut self.kv_b, &mut self.o_proj] {
            l.set_weight_gradients(grads);
        }
    }

    /// `[B, T, H]` → `[B, T, H]`.
    pub fn forward(&self, x: &Tensor, rope: &RopeTables, mask: &AttentionMask) -> Result<Tensor> {
        self.attend_padded(x, rope, mask)
    }

    /// One step over a KV cache (the per-head keys and values, decompressed, are what is
    /// cached): `x` `[B, T, H]` at the positions `rope` rotates with, attending over every
    /// cached slot under `mask` (the decode kernel, or the query tiles `tiles` allows) →
    /// `[B, T, H]`.
    pub fn forward_cached(
        &self,
        x: &Tensor,
        rope: &PositionTables,
        cache: &mut LayerKv,
        mask: &CacheMask<'_>,
        tiles: ScoreTiles,
    ) -> Result<Tensor> {
        let t = x.dim(1)?;
        let (q, k, v) = self.project(x, rope)?;
        let (k, v) = cache.append(&k, &v)?;
        let out = attend_cached(&q, &k, &v, mask, self.scale, 1, tiles)?;
        self.o_proj.forward(&heads_to_tokens(&out, t)?)
    }
}

impl RowAttention for MlaAttention {
    /// The token-wise part of [`RowAttention::project`], over `x` `[.., H]`: the queries
    /// (`[.., NH·(nope + rope)]`), the shared key's rotary part before its rotation
    /// (`[.., rope]`), and the decompressed per-head keys and values
    /// (`[.., NH·(nope + v)]`).
    fn project_tokens(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let q = match &self.q {
            QueryProj::LowRank { a, norm, b } => b.forward(&norm.forward(&a.forward(x)?)?)?,
            QueryProj::Plain(p) => p.forward(x)?,
        };
        let compressed = self.kv_a.forward(x)?;
        let k_pass = compressed.narrow(D::Minus1, 0, self.kv_lora_rank)?;
        let k_rot = compressed.narrow(D::Minus1, self.kv_lora_rank, self.rope_dim)?;
        let kv = self.kv_b.forward(&self.kv_a_norm.forward(&k_pass)?)?;
        Ok((q, k_rot, kv))
    }

    /// [`MlaAttention::project_tokens`]' parts of a `[B, T]` batch (any shape holding its
    /// `B·T` tokens in order) → queries and keys `[B, NH, T, nope + rope]` (rotary parts
    /// rotated), values `[B, NH, T, v]`.
    fn to_heads(
        &self,
        (q, k_rot, kv): (Tensor, Tensor, Tensor),
        (b, t): (usize, usize),
        rope: &impl Rotary,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (nh, nope, rd, vd) = (self.num_heads, self.nope, self.rope_dim, self.v_dim);
        let q = q.reshape((b, t, nh, nope + rd))?.transpose(1, 2)?;
        let q_pass = q.narrow(D::Minus1, 0, nope)?;
        let q_rot = rope.rotate_rounded(&q.narrow(D::Minus1, nope, rd)?, self.precision)?;
        let k_rot = k_rot.reshape((b, t, 1, rd))?.transpose(1, 2)?;
        let k_rot = rope
            .rotate_rounded(&k_rot, self.precision)?
            .broadcast_as((b, nh, t, rd))?;
        let kv = kv.reshape((b, t, nh, nope + vd))?.transpose(1, 2)?;
        let k_nope = kv.narrow(D::Minus1, 0, nope)?;
        let v = kv.narrow(D::Minus1, nope, vd)?;

        let q = Tensor::cat(&[&q_pass, &q_rot], D::Minus1)?;
        let k = Tensor::cat(&[&k_nope, &k_rot], D::Minus1)?;
        Ok((q, k, v))
    }

    /// [`attend()`] over this layer's heads, its products reading their 16-bit operands as
    /// such where the precision rounds them.
    fn attend_heads(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &AttentionMask,
    ) -> Result<Tensor> {
        // At a 16-bit precision q's and k's parts are projection outputs (rounded) or
        // rotated (rounded), v a projection output, and the output's gradient is rounded by
        // the output projection's input rounding: their products may read them as 16-bit
        // values.
        let narrow_dtype = self.precision.narrow_dtype();
        let narrow = NarrowOperands {
            queries_keys: narrow_dtype,
            values_grad: narrow_dtype,
        };
        attend(q, k, v, mask, self.scale, 1, narrow, self.score_tiles)
    }

    fn output(&self, x: &Tensor) -> Result<Tensor> {
        self.o_proj.forward(x)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::{MlaAttention, QueryProj};
    use crate::config::Config;
    use crate::weights::{RandomInit, Weights};

    /// The latent norms use the config's `rms_norm_eps` (SGLang / Megatron), not HF's
    /// 1e-6. A latent row of 1e-3 everywhere (mean square 1e-6) through a unit-weight norm
    /// with `rms_norm_eps = 1e-5`: 1e-3 / sqrt(1e-6 + 1e-5) = 0.301511 per element, where
    /// HF's 1e-6 gives 1e-3 / sqrt(2e-6) = 0.707107.
    #[test]
    fn latent_norms_take_the_configs_eps_not_hfs_default() {
        let cfg = Config::from_value(serde_json::json!({
            "model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 24,
            "rms_norm_eps": 1e-5, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 0, "routed_scaling_factor": 1.0, "q_lora_rank": 12,
            "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4
        }))
        .expect("config");
        let prefix = "model.layers.0.self_attn";
        let mut tensors = Weights::random(&cfg, &RandomInit::new(1), &Device::Cpu)
            .expect("weights")
            .tensors()
            .clone();
        for (name, width) in [("q_a_layernorm", 12), ("kv_a_layernorm", 8)] {
            tensors.insert(
                format!("{prefix}.{name}.weight"),
                Tensor::ones(width, candle_core::DType::F32, &Device::Cpu).expect("ones"),
            );
        }
        let attn = MlaAttention::new(&cfg, &Weights::from_map(tensors), prefix).expect("attention");
        let QueryProj::LowRank { norm: q_norm, .. } = &attn.q else {
            panic!("q_lora_rank 12 is a low-rank q");
        };
        let want = 1e-3 / (1e-6f64 + 1e-5).sqrt();
        for (norm, width) in [(q_norm, 12), (&attn.kv_a_norm, 8)] {
            let row = Tensor::full(1e-3f32, (1, width), &Device::Cpu).expect("row");
            let out: Vec<f32> = norm
                .forward(&row)
                .expect("norm")
                .flatten_all()
                .expect("flat")
                .to_vec1()
                .expect("values");
            for v in out {
                assert!((f64::from(v) - want).abs() < 1e-5, "{v} vs {want}");
            }
        }
    }
}
