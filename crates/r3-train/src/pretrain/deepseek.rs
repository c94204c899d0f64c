//! The DeepSeek-V3-style model `r3 pretrain` can write: the architecture switch of the
//! `[model]` table, the `[model.deepseek]` keys (grouped sigmoid routing with a selection
//! bias, shared expert, dense first layers, MLA sizes, the bias update rate) and the HF
//! `config.json` keys they add to those every family shares.

use serde::{Deserialize, Serialize};

/// Model family `r3 pretrain` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PretrainArchitecture {
    /// Qwen3-MoE: softmax top-k router, GQA with q/k norms, every layer MoE.
    Qwen3Moe,
    /// DeepSeek-V3: sigmoid scores + `e_score_correction_bias`, grouped top-k, shared
    /// expert, dense first layers, multi-head latent attention.
    DeepseekV3,
}

/// The DeepSeek-V3 sizes and routing constants (`[model.deepseek]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeepseekShape {
    /// Hidden width of the dense MLP of the first layers. Default 128.
    pub intermediate_size: usize,
    /// Leading dense (non-MoE) layers. Default 1.
    pub first_k_dense_replace: usize,
    /// Shared experts (one SwiGLU of `n · moe_intermediate_size`). Default 1.
    pub n_shared_experts: usize,
    /// Expert groups of the grouped top-k. Default 8.
    pub n_group: usize,
    /// Groups a token may pick experts from. Default 4.
    pub topk_group: usize,
    /// Factor on the normalised gates. Default 2.5.
    pub routed_scaling_factor: f64,
    /// Low-rank query width; 0 = a plain `q_proj` (Moonlight style). Default 0.
    pub q_lora_rank: usize,
    /// Compressed key/value width. Default 32.
    pub kv_lora_rank: usize,
    /// Per-head non-rotary query/key width. Default 16.
    pub qk_nope_head_dim: usize,
    /// Rotary query/key width (shared key part). Default 8.
    pub qk_rope_head_dim: usize,
    /// Per-head value width. Default 16.
    pub v_head_dim: usize,
    /// Aux-loss-free balancing: after every step each MoE layer's
    /// `e_score_correction_bias[e] += rate · sign(mean load − load[e])`; 0 = frozen bias.
    /// Default 1e-3 (DeepSeek-V3's γ for most of its pretraining).
    pub bias_update_rate: f64,
}

impl Default for DeepseekShape {
    fn default() -> Self {
        Self {
            intermediate_size: 128,
            first_k_dense_replace: 1,
            n_shared_experts: 1,
            n_group: 8,
            topk_group: 4,
            routed_scaling_factor: 2.5,
            q_lora_rank: 0,
            kv_lora_rank: 32,
            qk_nope_head_dim: 16,
            qk_rope_head_dim: 8,
            v_head_dim: 16,
            bias_update_rate: 1e-3,
        }
    }
}

impl DeepseekShape {
    /// Checks the keys against the expert count, top-k and depth; the reason on failure.
    pub fn validate(&self, experts: usize, top_k: usize, layers: usize) -> Result<(), String> {
        if self.n_group == 0 || !experts.is_multiple_of(self.n_group) {
            return Err(format!(
                "num_experts {experts} must be a multiple of n_group {}",
                self.n_group
            ));
        }
        // Groups are ranked by their two best scores.
        if experts / self.n_group < 2 {
            return Err("each expert group needs at least 2 experts".into());
        }
        if self.topk_group == 0 || self.topk_group > self.n_group {
            return Err(format!(
                "topk_group {} must be in 1..={}",
                self.topk_group, self.n_group
            ));
        }
        if self.topk_group * (experts / self.n_group) < top_k {
            return Err(format!(
                "topk_group {} groups of {} experts cannot hold top-{top_k}",
                self.topk_group,
                experts / self.n_group
            ));
        }
        if self.first_k_dense_replace >= layers {
            return Err(format!(
                "first_k_dense_replace {} leaves no MoE layer of {layers}",
                self.first_k_dense_replace
            ));
        }
        if self.kv_lora_rank == 0
            || self.qk_nope_head_dim == 0
            || self.v_head_dim == 0
            || self.intermediate_size == 0
            || self.qk_rope_head_dim == 0
            || !self.qk_rope_head_dim.is_multiple_of(2)
        {
            return Err(
                "kv_lora_rank, qk_nope_head_dim, v_head_dim and intermediate_size must be \
                 >= 1 and qk_rope_head_dim even and >= 2"
                    .into(),
            );
        }
        let finite_pos = |x: f64| x.is_finite() && x >= 0.0;
        if !finite_pos(self.bias_update_rate) || !finite_pos(self.routed_scaling_factor) {
            return Err(
                "bias_update_rate and routed_scaling_factor must be finite and >= 0".into(),
            );
        }
        Ok(())
    }
}

impl DeepseekShape {
    /// The keys of a DeepSeek-V3 `config.json` beyond those every family shares, for a
    /// model of `heads` attention heads (multi-head latent attention: as many key/value
    /// heads), `experts` routed experts and init std `init_std`.
    pub fn hf_keys(&self, heads: usize, experts: usize, init_std: f64) -> serde_json::Value {
        // Two literals: one would exceed `json!`'s macro recursion limit.
        let mut keys = serde_json::json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "intermediate_size": self.intermediate_size,
            "num_key_value_heads": heads,
            "n_shared_experts": self.n_shared_experts,
            "n_routed_experts": experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": 1,
            "num_nextn_predict_layers": 0,
            "initializer_range": init_std
        });
        let attention = serde_json::json!({
            "q_lora_rank": (self.q_lora_rank > 0).then_some(self.q_lora_rank),
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_head_dim": self.qk_nope_head_dim + self.qk_rope_head_dim,
            "head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rope_interleave": true
        });
        if let (Some(all), serde_json::Value::Object(rest)) = (keys.as_object_mut(), attention) {
            all.extend(rest);
        }
        keys
    }
}
