//! Model configuration: the normalised, validated view of an HF `config.json`.
//!
//! Parsing (key variants, HF defaults, rejection of unsupported options, and the
//! `Config::from_*` constructors) lives in `parse.rs`, size limits in `limits.rs`, value
//! checks in `validate.rs`; this module holds the typed result the rest of the crate builds
//! on, and so needs none of them (the checks read `spec.rs`, which reads these types).

mod limits;
mod parse;
mod validate;

pub use limits::ConfigLimits;

use r3_routing::{LayerLayout, LayoutRules};

/// Transformer family; decides tensor names and block flavours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Qwen3-MoE (`qwen3_moe`): per-head q/k RMSNorm, softmax router.
    Qwen3Moe,
    /// Qwen2-MoE (`qwen2_moe`): qkv bias, sigmoid-gated shared expert.
    Qwen2Moe,
    /// Mixtral (`mixtral`): `block_sparse_moe` with `w1/w2/w3` experts.
    Mixtral,
    /// OLMoE (`olmoe`): full-width q/k RMSNorm, optional qkv clipping.
    Olmoe,
    /// DeepSeek-V3 / Moonlight (`deepseek_v3`): MLA and grouped sigmoid routing.
    DeepseekV3,
    /// Dense Qwen3 (`qwen3`): the dense reference point.
    Qwen3,
    /// Dense Qwen2 (`qwen2`).
    Qwen2,
    /// Dense Llama / Mistral (`llama`, `mistral`).
    Llama,
}

impl Architecture {
    /// The HF `model_type` string for this family.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Qwen2Moe => "qwen2_moe",
            Architecture::Mixtral => "mixtral",
            Architecture::Olmoe => "olmoe",
            Architecture::DeepseekV3 => "deepseek_v3",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen2 => "qwen2",
            Architecture::Llama => "llama",
        }
    }
}

/// How q and k are normalised before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    /// No q/k norm.
    None,
    /// RMSNorm over each head's `head_dim` (Qwen3).
    PerHead,
    /// RMSNorm over the whole projected q (and k) before the head split (OLMoE).
    Full,
}

/// Attention flavour and its sizes.
#[derive(Debug, Clone, PartialEq)]
pub enum AttentionConfig {
    /// Grouped-query attention with separate q/k/v projections.
    Gqa {
        /// number of key/value heads
        num_kv_heads: usize,
        /// per-head width
        head_dim: usize,
        /// bias on q/k/v projections (Qwen2)
        qkv_bias: bool,
        /// q/k normalisation
        qk_norm: QkNorm,
        /// clamp q/k/v to ±value (OLMoE `clip_qkv`)
        clip_qkv: Option<f64>,
        /// attend only to the last `window` keys (Mixtral `sliding_window`)
        sliding_window: Option<usize>,
    },
    /// DeepSeek multi-head latent attention.
    Mla {
        /// rank of the q compression, `None` = plain `q_proj` (Moonlight)
        q_lora_rank: Option<usize>,
        /// rank of the kv compression
        kv_lora_rank: usize,
        /// per-head width of the non-rotary part
        qk_nope_head_dim: usize,
        /// per-head width of the rotary part
        qk_rope_head_dim: usize,
        /// per-head width of values
        v_head_dim: usize,
    },
}

/// RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// scale factor
        factor: f64,
    },
    /// YaRN (DeepSeek-V3 long context).
    Yarn {
        /// scale factor
        factor: f64,
        /// the pre-extension context length
        original_max_position_embeddings: usize,
        /// high-frequency boundary (rotations)
        beta_fast: f64,
        /// low-frequency boundary (rotations)
        beta_slow: f64,
        /// `mscale` key
        mscale: Option<f64>,
        /// `mscale_all_dim` key
        mscale_all_dim: Option<f64>,
        /// explicit attention factor, overrides the mscale rule
        attention_factor: Option<f64>,
        /// floor/ceil the correction range (HF default true)
        truncate: bool,
    },
}

/// Rotary position embedding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// base frequency
    pub theta: f64,
    /// rotated width per head
    pub dim: usize,
    /// interleaved pairs (DeepSeek `rope_interleave`) instead of half-split
    pub interleaved: bool,
    /// frequency scaling
    pub scaling: RopeScaling,
}

/// The router's gate formula; `select` and `weigh` both dispatch on it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterKind {
    /// softmax over all experts, top-k, renormalised iff `norm_topk_prob`.
    Softmax {
        /// renormalise the k gate weights to sum to one
        norm_topk_prob: bool,
    },
    /// DeepSeek-V3: sigmoid scores, grouped top-k over `sigmoid + e_score_correction_bias`.
    GroupedSigmoid {
        /// number of expert groups
        n_group: usize,
        /// groups kept per token
        topk_group: usize,
        /// normalise the k sigmoid scores to sum to one
        norm_topk_prob: bool,
        /// multiply the gates by this
        routed_scaling_factor: f64,
    },
}

/// Shared (always-on) expert of a MoE layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedExpert {
    /// None.
    None,
    /// DeepSeek `shared_experts`, added unweighted.
    Plain {
        /// hidden width
        intermediate_size: usize,
    },
    /// Qwen2-MoE `shared_expert` scaled by `sigmoid(shared_expert_gate(x))`.
    Gated {
        /// hidden width
        intermediate_size: usize,
    },
}

/// Mixture-of-experts settings.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// routed experts per MoE layer
    pub num_experts: usize,
    /// experts per token
    pub top_k: usize,
    /// hidden width of one routed expert
    pub expert_intermediate_size: usize,
    /// gate formula
    pub router: RouterKind,
    /// always-on expert
    pub shared: SharedExpert,
}

/// The HF keys that decide which layers are MoE layers (neutral values where a family lacks one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeLayerRules {
    /// DeepSeek: the first k layers are dense
    pub first_k_dense_replace: usize,
    /// Qwen: layer i is sparse iff (i+1) % step == 0
    pub decoder_sparse_step: usize,
    /// Qwen: layers forced dense
    pub mlp_only_layers: Vec<usize>,
    /// DeepSeek: layer i is sparse iff i % freq == 0
    pub moe_layer_freq: usize,
}

impl MoeLayerRules {
    /// Rules under which every layer of a MoE model is sparse.
    pub fn all_sparse() -> Self {
        MoeLayerRules {
            first_k_dense_replace: 0,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
            moe_layer_freq: 1,
        }
    }

    /// The r3-routing form of these rules.
    pub fn to_layout_rules(&self, num_hidden_layers: usize, num_experts: usize) -> LayoutRules {
        LayoutRules {
            num_hidden_layers,
            num_experts,
            first_k_dense_replace: self.first_k_dense_replace,
            decoder_sparse_step: self.decoder_sparse_step,
            mlp_only_layers: self.mlp_only_layers.clone(),
            moe_layer_freq: self.moe_layer_freq,
        }
    }
}

/// Normalised model configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// transformer family
    pub architecture: Architecture,
    /// vocabulary size
    pub vocab_size: usize,
    /// residual width
    pub hidden_size: usize,
    /// number of transformer layers
    pub num_hidden_layers: usize,
    /// number of query heads
    pub num_attention_heads: usize,
    /// width of dense MLP layers
    pub intermediate_size: usize,
    /// RMSNorm epsilon
    pub rms_norm_eps: f64,
    /// lm_head shares the embedding matrix
    pub tie_word_embeddings: bool,
    /// longest position the checkpoint was trained for
    pub max_position_embeddings: usize,
    /// attention flavour
    pub attention: AttentionConfig,
    /// rotary embedding
    pub rope: RopeConfig,
    /// experts; `None` for a dense model
    pub moe: Option<MoeConfig>,
    /// the HF rules deciding which layers are MoE layers
    pub layer_rules: MoeLayerRules,
    /// which layers are MoE layers (derived from `layer_rules`)
    pub layout: LayerLayout,
    /// the config.json this was parsed from, written back verbatim on save
    pub raw: serde_json::Value,
}

impl Config {
    /// The HF layout rules of this config (for `LayerLayout::from_rules`).
    pub fn layout_rules(&self) -> LayoutRules {
        self.layer_rules
            .to_layout_rules(self.num_hidden_layers, self.num_experts())
    }

    /// Which layers are MoE layers (global indices).
    pub fn layer_layout(&self) -> &LayerLayout {
        &self.layout
    }

    /// Whether layer `layer` is a MoE layer.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.layout.is_moe(layer)
    }

    /// Experts per token, 0 for a dense model.
    pub fn top_k(&self) -> usize {
        self.moe.as_ref().map_or(0, |m| m.top_k)
    }

    /// Routed experts per MoE layer, 0 for a dense model.
    pub fn num_experts(&self) -> usize {
        self.moe.as_ref().map_or(0, |m| m.num_experts)
    }

    /// Per-head width of values (the attention output per head).
    pub fn v_head_dim(&self) -> usize {
        match &self.attention {
            AttentionConfig::Gqa { head_dim, .. } => *head_dim,
            AttentionConfig::Mla { v_head_dim, .. } => *v_head_dim,
        }
    }

    /// Prefix of a layer's MoE block in HF tensor names (`mlp` or `block_sparse_moe`).
    pub fn moe_prefix(&self) -> &'static str {
        match self.architecture {
            Architecture::Mixtral => "block_sparse_moe",
            _ => "mlp",
        }
    }

    /// The config.json text to write beside saved weights.
    pub fn to_json_string(&self) -> String {
        serde_json::to_string_pretty(&self.raw).unwrap_or_else(|_| "{}".into())
    }
}
