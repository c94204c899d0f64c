//! config.json → [`Config`]: key variants real checkpoints use, HF defaults for
//! flags (and for DeepSeek-V3's sizes, as `DeepseekV3Config` has them), and an error naming
//! every option whose math this crate does not implement.

use std::path::Path;

use serde::Deserialize;

use super::{
    validate, Architecture, AttentionConfig, Config, ConfigLimits, MoeConfig, MoeLayerRules,
    QkNorm, RopeConfig, RopeScaling, RouterKind, SharedExpert,
};
use crate::error::{ModelError, Result};
use r3_routing::LayerLayout;

/// The keys of an HF config.json this crate reads; everything optional so that
/// defaults and key variants are resolved explicitly below.
#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: String,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    attention_dropout: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<serde_json::Value>,
    rope_scaling: Option<serde_json::Value>,
    partial_rotary_factor: Option<f64>,
    rope_interleave: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    layer_types: Option<Vec<String>>,
    clip_qkv: Option<f64>,
    qkv_bias: Option<bool>,
    quantization_config: Option<serde_json::Value>,
    // experts
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    n_routed_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    first_k_dense_replace: Option<usize>,
    moe_layer_freq: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    n_shared_experts: Option<usize>,
    routed_scaling_factor: Option<f64>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    topk_method: Option<String>,
    scoring_func: Option<String>,
    router_jitter_noise: Option<f64>,
    // MLA
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
}

/// HF `Qwen2MoeConfig`'s default `shared_expert_intermediate_size`.
const QWEN2_MOE_SHARED_EXPERT_INTERMEDIATE_SIZE: usize = 5632;

/// HF `DeepseekV3Config.__init__`'s defaults (transformers v5,
/// `configuration_deepseek_v3.py`) for the keys a DeepSeek-V3 config.json may leave out:
/// transformers builds the model from these, so r3 does too (as for `n_shared_experts`,
/// default 1) rather than refusing the config. An explicit `null` is not a default: HF
/// stores `None` and cannot build the model, and r3 names the key (except `q_lora_rank`,
/// whose `null` is the plain `q_proj` of Moonlight). The keys that decide routing come from
/// r3-routing, whose route layouts read config.json alike.
mod deepseek_v3_default {
    /// `vocab_size`.
    pub const VOCAB_SIZE: usize = 129_280;
    /// `hidden_size`.
    pub const HIDDEN_SIZE: usize = 7168;
    /// `intermediate_size` (the dense layers' MLP).
    pub const INTERMEDIATE_SIZE: usize = 18_432;
    /// `moe_intermediate_size` (each routed and shared expert).
    pub const MOE_INTERMEDIATE_SIZE: usize = 2048;
    /// `num_hidden_layers`.
    pub const NUM_HIDDEN_LAYERS: usize = r3_routing::deepseek_v3_default::NUM_HIDDEN_LAYERS;
    /// `num_attention_heads`.
    pub const NUM_ATTENTION_HEADS: usize = 128;
    /// `n_routed_experts`.
    pub const N_ROUTED_EXPERTS: usize = r3_routing::deepseek_v3_default::N_ROUTED_EXPERTS;
    /// `routed_scaling_factor`.
    pub const ROUTED_SCALING_FACTOR: f64 = 2.5;
    /// `kv_lora_rank`.
    pub const KV_LORA_RANK: usize = 512;
    /// `q_lora_rank` (a low-rank q: `q_a_proj`, `q_a_layernorm`, `q_b_proj`).
    pub const Q_LORA_RANK: usize = 1536;
    /// `qk_rope_head_dim`.
    pub const QK_ROPE_HEAD_DIM: usize = 64;
    /// `v_head_dim`.
    pub const V_HEAD_DIM: usize = 128;
    /// `qk_nope_head_dim`.
    pub const QK_NOPE_HEAD_DIM: usize = 128;
    /// `n_group`.
    pub const N_GROUP: usize = 8;
    /// `topk_group`.
    pub const TOPK_GROUP: usize = 4;
    /// `num_experts_per_tok`.
    pub const NUM_EXPERTS_PER_TOK: usize = r3_routing::deepseek_v3_default::NUM_EXPERTS_PER_TOK;
    /// `first_k_dense_replace`.
    pub const FIRST_K_DENSE_REPLACE: usize = r3_routing::deepseek_v3_default::FIRST_K_DENSE_REPLACE;
}

fn unsupported(field: &str, value: impl std::fmt::Display) -> ModelError {
    ModelError::UnsupportedOption {
        field: field.into(),
        value: value.to_string(),
    }
}

fn required(value: Option<usize>, key: &'static str, arch: Architecture) -> Result<usize> {
    match value {
        Some(v) if v > 0 => Ok(v),
        Some(_) => Err(ModelError::ZeroSize {
            key,
            model_type: arch.model_type(),
        }),
        None => Err(ModelError::MissingKey {
            key,
            model_type: arch.model_type(),
        }),
    }
}

/// A key's value, or `hf_default` where config.json leaves the key out; an explicit `null`
/// (which HF would keep as `None`, then fail on) is an error naming the key.
fn or_hf_default<T>(
    doc: &serde_json::Value,
    value: Option<T>,
    key: &str,
    hf_default: T,
) -> Result<T> {
    match (value, doc.get(key)) {
        (Some(v), _) => Ok(v),
        (None, None) => Ok(hf_default),
        (None, Some(_)) => Err(ModelError::InvalidConfig(format!(
            "`{key}` is null; leave it out for transformers' default"
        ))),
    }
}

/// A positive size key: [`required`], except that a DeepSeek-V3 config without the key
/// takes `deepseek_default` (HF `DeepseekV3Config`'s, see `deepseek_v3_default`).
fn required_or_deepseek(
    doc: &serde_json::Value,
    value: Option<usize>,
    key: &'static str,
    arch: Architecture,
    deepseek_default: usize,
) -> Result<usize> {
    let value = match arch {
        Architecture::DeepseekV3 => Some(or_hf_default(doc, value, key, deepseek_default)?),
        _ => value,
    };
    required(value, key, arch)
}

fn architecture(model_type: &str) -> Result<Architecture> {
    Ok(match model_type {
        "qwen3_moe" => Architecture::Qwen3Moe,
        "qwen2_moe" => Architecture::Qwen2Moe,
        "mixtral" => Architecture::Mixtral,
        "olmoe" => Architecture::Olmoe,
        "deepseek_v3" => Architecture::DeepseekV3,
        "qwen3" => Architecture::Qwen3,
        "qwen2" => Architecture::Qwen2,
        "llama" | "mistral" => Architecture::Llama,
        other => return Err(ModelError::UnsupportedModelType(other.into())),
    })
}

impl Config {
    /// Parses and validates a config.json document.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|source| ModelError::Json {
                path: "config.json".into(),
                source,
            })?;
        Self::from_value(value)
    }

    /// Parses and validates a config.json value.
    pub fn from_value(value: serde_json::Value) -> Result<Self> {
        parse(value)
    }

    /// Reads `config.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| ModelError::Json {
                path: path.to_path_buf(),
                source,
            })?;
        Self::from_value(value)
    }
}

/// Parses a config.json value into a validated [`Config`].
fn parse(value: serde_json::Value) -> Result<Config> {
    let raw: RawConfig =
        serde_json::from_value(value.clone()).map_err(|source| ModelError::Json {
            path: "config.json".into(),
            source,
        })?;
    let arch = architecture(&raw.model_type)?;
    reject_unsupported(&raw, arch)?;
    check_limits(&raw)?;

    use deepseek_v3_default as ds;
    let size = |v, key, ds_default| required_or_deepseek(&value, v, key, arch, ds_default);
    let hidden_size = size(raw.hidden_size, "hidden_size", ds::HIDDEN_SIZE)?;
    let num_hidden_layers = size(
        raw.num_hidden_layers,
        "num_hidden_layers",
        ds::NUM_HIDDEN_LAYERS,
    )?;
    let num_attention_heads = size(
        raw.num_attention_heads,
        "num_attention_heads",
        ds::NUM_ATTENTION_HEADS,
    )?;
    let vocab_size = size(raw.vocab_size, "vocab_size", ds::VOCAB_SIZE)?;
    let moe = moe_config(&raw, &value, arch)?;
    // OLMoE's `intermediate_size` is the expert width; it has no dense layers.
    let intermediate_size = match (arch, &moe) {
        (Architecture::Olmoe | Architecture::Mixtral, Some(m)) => {
            raw.intermediate_size.unwrap_or(m.expert_intermediate_size)
        }
        _ => size(
            raw.intermediate_size,
            "intermediate_size",
            ds::INTERMEDIATE_SIZE,
        )?,
    };
    let attention = attention_config(&raw, &value, arch, hidden_size, num_attention_heads)?;
    let rope = rope_config(&raw, arch, &attention)?;
    let layer_rules = layer_rules(&raw, &value, arch)?;
    let layout = LayerLayout::from_rules(
        &layer_rules.to_layout_rules(num_hidden_layers, moe.as_ref().map_or(0, |m| m.num_experts)),
    )?;
    let default_eps = match arch {
        Architecture::Mixtral | Architecture::Olmoe => 1e-5,
        _ => 1e-6,
    };
    let config = Config {
        architecture: arch,
        vocab_size,
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        intermediate_size,
        rms_norm_eps: raw.rms_norm_eps.unwrap_or(default_eps),
        tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
        attention,
        rope,
        moe,
        layer_rules,
        layout,
        raw: value,
    };
    validate::validate(&config)?;
    Ok(config)
}

/// Every size key against [`ConfigLimits`], before anything is built from it.
fn check_limits(raw: &RawConfig) -> Result<()> {
    type L = ConfigLimits;
    let sizes = [
        ("num_hidden_layers", raw.num_hidden_layers, L::MAX_LAYERS),
        (
            "first_k_dense_replace",
            raw.first_k_dense_replace,
            L::MAX_LAYERS,
        ),
        (
            "decoder_sparse_step",
            raw.decoder_sparse_step,
            L::MAX_LAYERS,
        ),
        ("moe_layer_freq", raw.moe_layer_freq, L::MAX_LAYERS),
        ("vocab_size", raw.vocab_size, L::MAX_VOCAB),
        ("hidden_size", raw.hidden_size, L::MAX_HIDDEN),
        (
            "intermediate_size",
            raw.intermediate_size,
            L::MAX_INTERMEDIATE,
        ),
        (
            "moe_intermediate_size",
            raw.moe_intermediate_size,
            L::MAX_INTERMEDIATE,
        ),
        (
            "shared_expert_intermediate_size",
            raw.shared_expert_intermediate_size,
            L::MAX_INTERMEDIATE,
        ),
        ("num_attention_heads", raw.num_attention_heads, L::MAX_HEADS),
        ("num_key_value_heads", raw.num_key_value_heads, L::MAX_HEADS),
        ("head_dim", raw.head_dim, L::MAX_HEAD_DIM),
        (
            "max_position_embeddings",
            raw.max_position_embeddings,
            L::MAX_POSITIONS,
        ),
        ("sliding_window", raw.sliding_window, L::MAX_POSITIONS),
        ("num_experts", raw.num_experts, L::MAX_EXPERTS),
        ("num_local_experts", raw.num_local_experts, L::MAX_EXPERTS),
        ("n_routed_experts", raw.n_routed_experts, L::MAX_EXPERTS),
        ("n_shared_experts", raw.n_shared_experts, L::MAX_EXPERTS),
        ("n_group", raw.n_group, L::MAX_EXPERTS),
        ("topk_group", raw.topk_group, L::MAX_EXPERTS),
        ("num_experts_per_tok", raw.num_experts_per_tok, L::MAX_TOP_K),
        ("q_lora_rank", raw.q_lora_rank, L::MAX_HIDDEN),
        ("kv_lora_rank", raw.kv_lora_rank, L::MAX_HIDDEN),
        ("qk_nope_head_dim", raw.qk_nope_head_dim, L::MAX_HEAD_DIM),
        ("qk_rope_head_dim", raw.qk_rope_head_dim, L::MAX_HEAD_DIM),
        ("v_head_dim", raw.v_head_dim, L::MAX_HEAD_DIM),
    ];
    for (key, value, max) in sizes {
        L::check_opt(key, value, max)?;
    }
    L::check_opt(
        "mlp_only_layers (entries)",
        raw.mlp_only_layers.as_ref().map(Vec::len),
        L::MAX_LAYERS,
    )
}

/// Options that would change the math in ways this crate does not implement.
fn reject_unsupported(raw: &RawConfig, arch: Architecture) -> Result<()> {
    if let Some(q) = &raw.quantization_config {
        let method = q
            .get("quant_method")
            .and_then(|m| m.as_str())
            .unwrap_or("?");
        return Err(unsupported("quantization_config", method));
    }
    if let Some(act) = &raw.hidden_act {
        if act != "silu" {
            return Err(unsupported("hidden_act", act));
        }
    }
    if raw.attention_bias == Some(true) {
        return Err(unsupported("attention_bias", true));
    }
    if raw.mlp_bias == Some(true) {
        return Err(unsupported("mlp_bias", true));
    }
    if let Some(p) = raw.attention_dropout.filter(|p| *p != 0.0) {
        return Err(unsupported("attention_dropout", p));
    }
    if let Some(p) = raw.router_jitter_noise.filter(|p| *p != 0.0) {
        return Err(unsupported("router_jitter_noise", p));
    }
    if let Some(f) = raw.partial_rotary_factor.filter(|f| *f != 1.0) {
        return Err(unsupported("partial_rotary_factor", f));
    }
    if raw.use_sliding_window == Some(true) {
        return Err(unsupported("use_sliding_window", true));
    }
    if let Some(types) = &raw.layer_types {
        if let Some(t) = types.iter().find(|t| t.as_str() != "full_attention") {
            return Err(unsupported("layer_types", t));
        }
    }
    if arch == Architecture::DeepseekV3 {
        if let Some(f) = raw.scoring_func.as_deref().filter(|f| *f != "sigmoid") {
            return Err(unsupported("scoring_func", f));
        }
        if let Some(m) = raw.topk_method.as_deref().filter(|m| *m != "noaux_tc") {
            return Err(unsupported("topk_method", m));
        }
    } else if let Some(f) = raw.scoring_func.as_deref().filter(|f| *f != "softmax") {
        return Err(unsupported("scoring_func", f));
    }
    Ok(())
}

/// Routed-expert count under any of its three key names; conflicting values are an error.
fn expert_count(raw: &RawConfig) -> Result<Option<usize>> {
    let named = [
        ("num_experts", raw.num_experts),
        ("num_local_experts", raw.num_local_experts),
        ("n_routed_experts", raw.n_routed_experts),
    ];
    let mut found: Option<(&'static str, usize)> = None;
    for (key, v) in named {
        if let Some(v) = v {
            match found {
                Some((k0, v0)) if v0 != v => {
                    return Err(ModelError::ConflictingKeys {
                        first: k0,
                        first_value: v0,
                        second: key,
                        second_value: v,
                    })
                }
                _ => found = Some((key, v)),
            }
        }
    }
    Ok(found.map(|(_, v)| v))
}

fn moe_config(
    raw: &RawConfig,
    doc: &serde_json::Value,
    arch: Architecture,
) -> Result<Option<MoeConfig>> {
    use deepseek_v3_default as ds;
    let dense_family = matches!(
        arch,
        Architecture::Qwen3 | Architecture::Qwen2 | Architecture::Llama
    );
    let num_experts = match (expert_count(raw)?, arch) {
        (None, Architecture::DeepseekV3) => Some(or_hf_default(
            doc,
            None,
            "n_routed_experts",
            ds::N_ROUTED_EXPERTS,
        )?),
        (n, _) => n,
    };
    if dense_family {
        if let Some(n) = num_experts.filter(|n| *n > 0) {
            return Err(unsupported("num_experts", n));
        }
        return Ok(None);
    }
    let num_experts =
        match num_experts {
            Some(0) => return Ok(None),
            Some(n) => n,
            None => return Err(ModelError::MissingKey {
                key:
                    "num_experts` (or `num_local_experts`, `n_routed_experts`; 0 for a dense model",
                model_type: arch.model_type(),
            }),
        };
    let top_k = required_or_deepseek(
        doc,
        raw.num_experts_per_tok,
        "num_experts_per_tok",
        arch,
        ds::NUM_EXPERTS_PER_TOK,
    )?;
    if top_k > num_experts {
        return Err(ModelError::InvalidConfig(format!(
            "num_experts_per_tok = {top_k} exceeds the {num_experts} experts"
        )));
    }
    let expert_intermediate_size = match arch {
        Architecture::Mixtral | Architecture::Olmoe => {
            required(raw.intermediate_size, "intermediate_size", arch)?
        }
        _ => required_or_deepseek(
            doc,
            raw.moe_intermediate_size,
            "moe_intermediate_size",
            arch,
            ds::MOE_INTERMEDIATE_SIZE,
        )?,
    };
    let (router, shared) = match arch {
        Architecture::DeepseekV3 => {
            let n_group = required_or_deepseek(doc, raw.n_group, "n_group", arch, ds::N_GROUP)?;
            let topk_group =
                required_or_deepseek(doc, raw.topk_group, "topk_group", arch, ds::TOPK_GROUP)?;
            if num_experts % n_group != 0 || topk_group == 0 || topk_group > n_group {
                return Err(ModelError::InvalidConfig(format!(
                    "n_group = {n_group} / topk_group = {topk_group} do not fit {num_experts} experts"
                )));
            }
            if num_experts / n_group < 2 {
                return Err(unsupported(
                    "n_group",
                    format!("{n_group} (needs ≥ 2 experts per group)"),
                ));
            }
            if top_k > topk_group * (num_experts / n_group) {
                return Err(ModelError::InvalidConfig(format!(
                    "num_experts_per_tok = {top_k} exceeds the experts of {topk_group} groups"
                )));
            }
            let router = RouterKind::GroupedSigmoid {
                n_group,
                topk_group,
                norm_topk_prob: raw.norm_topk_prob.unwrap_or(true),
                routed_scaling_factor: or_hf_default(
                    doc,
                    raw.routed_scaling_factor,
                    "routed_scaling_factor",
                    ds::ROUTED_SCALING_FACTOR,
                )?,
            };
            // HF `DeepseekV3Config` defaults `n_shared_experts` to 1: a config without the
            // key has one shared expert of the routed experts' width.
            let shared = match raw.n_shared_experts.unwrap_or(1) {
                0 => SharedExpert::None,
                n => SharedExpert::Plain {
                    intermediate_size: n.checked_mul(expert_intermediate_size).ok_or(
                        ModelError::ConfigTooLarge {
                            key: "n_shared_experts",
                            value: n,
                            max: ConfigLimits::MAX_INTERMEDIATE / expert_intermediate_size,
                        },
                    )?,
                },
            };
            (router, shared)
        }
        Architecture::Qwen2Moe => {
            // HF `Qwen2MoeConfig` defaults `shared_expert_intermediate_size` to 5632 (always
            // builds the shared expert); an explicit 0 gives an empty one, which adds nothing.
            let shared = match raw
                .shared_expert_intermediate_size
                .unwrap_or(QWEN2_MOE_SHARED_EXPERT_INTERMEDIATE_SIZE)
            {
                0 => SharedExpert::None,
                n => SharedExpert::Gated {
                    intermediate_size: n,
                },
            };
            (
                RouterKind::Softmax {
                    norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
                },
                shared,
            )
        }
        // Mixtral renormalises the top-k softmax weights unconditionally.
        Architecture::Mixtral => (
            RouterKind::Softmax {
                norm_topk_prob: true,
            },
            SharedExpert::None,
        ),
        _ => (
            RouterKind::Softmax {
                norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
            },
            SharedExpert::None,
        ),
    };
    Ok(Some(MoeConfig {
        num_experts,
        top_k,
        expert_intermediate_size,
        router,
        shared,
    }))
}

fn attention_config(
    raw: &RawConfig,
    doc: &serde_json::Value,
    arch: Architecture,
    hidden_size: usize,
    num_heads: usize,
) -> Result<AttentionConfig> {
    if arch == Architecture::DeepseekV3 {
        use deepseek_v3_default as ds;
        let size = |v, key, ds_default| required_or_deepseek(doc, v, key, arch, ds_default);
        // A missing `q_lora_rank` is HF's default rank (a low-rank q); an explicit `null`
        // (Moonlight) or 0 is a plain `q_proj`.
        let q_lora_rank = match (raw.q_lora_rank, doc.get("q_lora_rank")) {
            (None, None) => Some(ds::Q_LORA_RANK),
            (rank, _) => rank.filter(|r| *r > 0),
        };
        return Ok(AttentionConfig::Mla {
            q_lora_rank,
            kv_lora_rank: size(raw.kv_lora_rank, "kv_lora_rank", ds::KV_LORA_RANK)?,
            qk_nope_head_dim: size(
                raw.qk_nope_head_dim,
                "qk_nope_head_dim",
                ds::QK_NOPE_HEAD_DIM,
            )?,
            qk_rope_head_dim: size(
                raw.qk_rope_head_dim,
                "qk_rope_head_dim",
                ds::QK_ROPE_HEAD_DIM,
            )?,
            v_head_dim: size(raw.v_head_dim, "v_head_dim", ds::V_HEAD_DIM)?,
        });
    }
    let head_dim = match raw.head_dim {
        Some(d) => d,
        None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
        None => {
            return Err(ModelError::InvalidConfig(format!(
                "hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads} and head_dim is missing"
            )))
        }
    };
    let num_kv_heads = raw.num_key_value_heads.unwrap_or(num_heads);
    if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
        return Err(ModelError::InvalidConfig(format!(
            "num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
        )));
    }
    let qk_norm = match arch {
        Architecture::Qwen3Moe | Architecture::Qwen3 => QkNorm::PerHead,
        Architecture::Olmoe => QkNorm::Full,
        _ => QkNorm::None,
    };
    // Qwen2-MoE reads `qkv_bias` (transformers 5; default true, and configs written before
    // the key existed had the bias); Qwen2 always has it; the others never.
    let qkv_bias = match arch {
        Architecture::Qwen2Moe => raw.qkv_bias.unwrap_or(true),
        Architecture::Qwen2 => true,
        _ => false,
    };
    let clip_qkv = raw.clip_qkv;
    if clip_qkv.is_some() && arch != Architecture::Olmoe {
        return Err(unsupported("clip_qkv", format!("{clip_qkv:?}")));
    }
    // Qwen configs carry `sliding_window` even when `use_sliding_window` is false (then HF
    // ignores it); Mixtral / Mistral apply it whenever it is set.
    let sliding_window = match arch {
        Architecture::Mixtral | Architecture::Llama => raw.sliding_window,
        _ => None,
    };
    Ok(AttentionConfig::Gqa {
        num_kv_heads,
        head_dim,
        qkv_bias,
        qk_norm,
        clip_qkv,
        sliding_window,
    })
}

fn f64_key(obj: &serde_json::Value, key: &str) -> Result<Option<f64>> {
    match obj.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| ModelError::InvalidConfig(format!("rope `{key}` is not a number: {v}"))),
    }
}

/// A rope dict that counts as given: transformers tests it with Python's `or`, so `null`
/// and `{}` are as good as absent.
fn rope_dict(value: Option<&serde_json::Value>) -> Option<&serde_json::Value> {
    value.filter(|v| match v {
        serde_json::Value::Null => false,
        serde_json::Value::Object(m) => !m.is_empty(),
        _ => true,
    })
}

/// The rope dict's type (`rope_type`, or the older `type`), `default` when unnamed.
fn rope_type_of(params: Option<&serde_json::Value>) -> &str {
    params
        .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
        .and_then(|t| t.as_str())
        .unwrap_or("default")
}

fn rope_config(raw: &RawConfig, arch: Architecture, attn: &AttentionConfig) -> Result<RopeConfig> {
    // transformers 5 writes `rope_parameters` (theta + scaling); released checkpoints use
    // top-level `rope_theta` and `rope_scaling`. Its `convert_rope_params_to_dict` decides
    // between them: `rope_parameters = rope_scaling or rope_parameters` (a legacy
    // `rope_scaling` wins, whole), then `rope_theta` from that dict, else the top-level
    // `rope_theta`, else the class default. A config edited to add `rope_scaling` beside a
    // v5 `rope_parameters` therefore runs the scaling in HF, and must here too.
    let scaling_dict = rope_dict(raw.rope_scaling.as_ref());
    let parameters_dict = rope_dict(raw.rope_parameters.as_ref());
    let params = scaling_dict.or(parameters_dict);
    let default_theta = if arch == Architecture::Mixtral {
        1e6
    } else {
        1e4
    };
    let theta = match params {
        Some(p) => f64_key(p, "rope_theta")?,
        None => None,
    }
    .or(raw.rope_theta)
    .unwrap_or(default_theta);
    if let (Some(s), Some(p)) = (scaling_dict, parameters_dict) {
        warn_on_rope_conflict(s, p, theta)?;
    }
    let rope_type = rope_type_of(params);
    let scaling = match (rope_type, params) {
        ("default", _) | (_, None) => RopeScaling::None,
        ("linear", Some(p)) => RopeScaling::Linear {
            factor: f64_key(p, "factor")?.unwrap_or(1.0),
        },
        ("yarn", Some(p)) => RopeScaling::Yarn {
            factor: f64_key(p, "factor")?
                .ok_or_else(|| ModelError::InvalidConfig("yarn rope without `factor`".into()))?,
            original_max_position_embeddings: f64_key(p, "original_max_position_embeddings")?
                .map(|v| v as usize)
                .or(raw.max_position_embeddings)
                .unwrap_or(4096),
            beta_fast: f64_key(p, "beta_fast")?.unwrap_or(32.0),
            beta_slow: f64_key(p, "beta_slow")?.unwrap_or(1.0),
            mscale: f64_key(p, "mscale")?,
            mscale_all_dim: f64_key(p, "mscale_all_dim")?,
            attention_factor: f64_key(p, "attention_factor")?,
            truncate: p.get("truncate").and_then(|t| t.as_bool()).unwrap_or(true),
        },
        (other, _) => return Err(unsupported("rope_scaling.rope_type", other)),
    };
    let (dim, interleaved) = match attn {
        AttentionConfig::Gqa { head_dim, .. } => (*head_dim, false),
        AttentionConfig::Mla {
            qk_rope_head_dim, ..
        } => (*qk_rope_head_dim, raw.rope_interleave.unwrap_or(true)),
    };
    if dim % 2 != 0 {
        return Err(ModelError::InvalidConfig(format!(
            "rotary width {dim} must be even"
        )));
    }
    Ok(RopeConfig {
        theta,
        dim,
        interleaved,
        scaling,
    })
}

/// Warns where `rope_scaling` (which transformers uses) and `rope_parameters` (which it then
/// ignores) both scale and disagree, or where the ignored dict's `rope_theta` differs from
/// the theta used: the config says two things and only one of them runs.
fn warn_on_rope_conflict(
    scaling: &serde_json::Value,
    parameters: &serde_json::Value,
    theta: f64,
) -> Result<()> {
    let without_theta = |v: &serde_json::Value| match v {
        serde_json::Value::Object(m) => {
            let mut m = m.clone();
            m.remove("rope_theta");
            // `type` is the older spelling of `rope_type`.
            if let Some(t) = m.remove("type") {
                m.entry("rope_type").or_insert(t);
            }
            serde_json::Value::Object(m)
        }
        other => other.clone(),
    };
    let both_scale =
        rope_type_of(Some(scaling)) != "default" && rope_type_of(Some(parameters)) != "default";
    if both_scale && without_theta(scaling) != without_theta(parameters) {
        tracing::warn!(
            rope_scaling = %scaling,
            rope_parameters = %parameters,
            "config.json: `rope_scaling` and `rope_parameters` give different RoPE scalings; \
             using `rope_scaling`, as transformers does"
        );
    }
    if let Some(ignored) = f64_key(parameters, "rope_theta")?.filter(|t| *t != theta) {
        tracing::warn!(
            rope_scaling = %scaling,
            rope_parameters = %parameters,
            ignored_theta = ignored,
            theta,
            "config.json: `rope_scaling` replaces `rope_parameters` whole, its `rope_theta` \
             included, as transformers does"
        );
    }
    Ok(())
}

fn layer_rules(
    raw: &RawConfig,
    doc: &serde_json::Value,
    arch: Architecture,
) -> Result<MoeLayerRules> {
    let mut rules = MoeLayerRules::all_sparse();
    match arch {
        Architecture::DeepseekV3 => {
            // 0 is valid (every layer MoE), so not `required`.
            rules.first_k_dense_replace = or_hf_default(
                doc,
                raw.first_k_dense_replace,
                "first_k_dense_replace",
                deepseek_v3_default::FIRST_K_DENSE_REPLACE,
            )?;
            rules.moe_layer_freq = raw.moe_layer_freq.unwrap_or(1).max(1);
        }
        Architecture::Qwen3Moe | Architecture::Qwen2Moe => {
            rules.decoder_sparse_step = raw.decoder_sparse_step.unwrap_or(1);
            rules.mlp_only_layers = raw.mlp_only_layers.clone().unwrap_or_default();
        }
        _ => {}
    }
    Ok(rules)
}
