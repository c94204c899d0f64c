//! The shape of the model `r3 pretrain` trains and the HF `config.json` it produces: a
//! Qwen3-MoE-style model by default, or DeepSeek-V3-style (`architecture = "deepseek_v3"`,
//! its own keys in `deepseek`). The keys both families share are written in one place.
//!
//! Default model (the shipped `models/arith-moe`): `qwen3_moe`, hidden 64, 4 layers, all
//! MoE, 8 experts of width 64, top-2 with renormalised softmax gates, 4 query heads and 2
//! key/value heads of width 16 with per-head q/k RMSNorm, RoPE θ = 10000, untied lm_head,
//! the 23-token character vocabulary of r3-tasks. About 0.17 M parameters.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::pretrain::deepseek::{DeepseekShape, PretrainArchitecture};

/// Sizes of the model (Qwen3-MoE style unless `architecture = "deepseek_v3"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelShape {
    /// Model family written to `config.json`. Default `qwen3_moe`.
    pub architecture: PretrainArchitecture,
    /// Residual width. Default 64.
    pub hidden_size: usize,
    /// Transformer layers (all MoE). Default 4.
    pub num_hidden_layers: usize,
    /// Query heads. Default 4.
    pub num_attention_heads: usize,
    /// Key/value heads. Default 2.
    pub num_key_value_heads: usize,
    /// Per-head width. Default 16.
    pub head_dim: usize,
    /// Routed experts per layer. Default 8.
    pub num_experts: usize,
    /// Experts per token. Default 2.
    pub num_experts_per_tok: usize,
    /// Hidden width of one expert. Default 64.
    pub moe_intermediate_size: usize,
    /// Longest sequence. Default 128.
    pub max_position_embeddings: usize,
    /// RoPE base. Default 10000.
    pub rope_theta: f64,
    /// Std of the random init of matrices. Default 0.05.
    pub init_std: f64,
    /// Std of the random init of router matrices. Default 0.05.
    pub router_init_std: f64,
    /// Renormalise the top-k gates to sum to 1. Default true.
    pub norm_topk_prob: bool,
    /// The DeepSeek-V3 keys, TOML `[model.deepseek]` (read only with
    /// `architecture = "deepseek_v3"`).
    pub deepseek: DeepseekShape,
}

impl Default for ModelShape {
    fn default() -> Self {
        Self {
            architecture: PretrainArchitecture::Qwen3Moe,
            hidden_size: 64,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            num_experts: 8,
            num_experts_per_tok: 2,
            moe_intermediate_size: 64,
            max_position_embeddings: 128,
            rope_theta: 10000.0,
            init_std: 0.05,
            router_init_std: 0.05,
            norm_topk_prob: true,
            deepseek: DeepseekShape::default(),
        }
    }
}

impl ModelShape {
    /// The HF `config.json` of a model of this shape over `vocab_size` tokens.
    pub fn hf_config(&self, vocab_size: usize) -> Value {
        let mut cfg = json!({
            "vocab_size": vocab_size,
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "tie_word_embeddings": false,
            "bos_token_id": r3_tasks::BOS_ID,
            "eos_token_id": r3_tasks::EOS_ID,
            "pad_token_id": r3_tasks::PAD_ID,
            "torch_dtype": "float32",
            "use_cache": true
        });
        let family = match self.architecture {
            PretrainArchitecture::Qwen3Moe => self.qwen3_moe_keys(),
            PretrainArchitecture::DeepseekV3 => {
                self.deepseek
                    .hf_keys(self.num_attention_heads, self.num_experts, self.init_std)
            }
        };
        if let (Some(all), Value::Object(own)) = (cfg.as_object_mut(), family) {
            all.extend(own);
        }
        cfg
    }

    /// The keys of a Qwen3-MoE `config.json` beyond those every family shares.
    fn qwen3_moe_keys(&self) -> Value {
        json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "intermediate_size": self.moe_intermediate_size * 2,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": false,
            "sliding_window": null,
            "router_aux_loss_coef": 0.0,
            "output_router_logits": false
        })
    }
}
