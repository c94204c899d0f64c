//! The routing facts of an HF `config.json`: which layers are MoE layers, how many experts,
//! how many per token. Reads only the keys that decide routing, each with its neutral value
//! where a family lacks it, so a config of any MoE family (DeepSeek, Qwen2/3-MoE, Mixtral,
//! multimodal configs with a `text_config`) gives its layout without the model being
//! supported by r3-model. A key that is present with the wrong type is an error naming it.
//!
//! Llama-4 (`interleave_moe_layer_step`, `moe_layers`) is read as HF `Llama4TextConfig` reads
//! it: an explicit `moe_layers` list wins; otherwise layer i is MoE iff
//! `(i + 1) % interleave_moe_layer_step == 0` — the same rule as Qwen's
//! `decoder_sparse_step`, into which the step goes. An explicit list goes into the rules as
//! `mlp_only_layers` = every other layer.

use serde_json::Value;

use crate::{LayerLayout, LayoutRules, RouteError};

/// Keys that carry the routed-expert count, in the order they are looked up.
const EXPERT_COUNT_KEYS: [&str; 3] = ["n_routed_experts", "num_experts", "num_local_experts"];

/// HF `DeepseekV3Config`'s defaults (transformers v5) for the routing keys a DeepSeek-V3
/// config.json may leave out: transformers builds the model from them, and r3-model's
/// parser takes the same, so a route table and the model agree on which layers route.
pub mod deepseek_v3_default {
    /// `num_hidden_layers`.
    pub const NUM_HIDDEN_LAYERS: usize = 61;
    /// `n_routed_experts`.
    pub const N_ROUTED_EXPERTS: usize = 256;
    /// `num_experts_per_tok`.
    pub const NUM_EXPERTS_PER_TOK: usize = 8;
    /// `first_k_dense_replace`.
    pub const FIRST_K_DENSE_REPLACE: usize = 3;
}

/// `key`'s HF default where config.json (of `model_type`) leaves it out, if its family has
/// one that decides routing.
fn family_default(model_type: Option<&str>, key: &str) -> Option<usize> {
    use deepseek_v3_default as ds;
    match (model_type?, key) {
        ("deepseek_v3", "num_hidden_layers") => Some(ds::NUM_HIDDEN_LAYERS),
        ("deepseek_v3", "n_routed_experts") => Some(ds::N_ROUTED_EXPERTS),
        ("deepseek_v3", "num_experts_per_tok") => Some(ds::NUM_EXPERTS_PER_TOK),
        ("deepseek_v3", "first_k_dense_replace") => Some(ds::FIRST_K_DENSE_REPLACE),
        _ => None,
    }
}

/// What a route table needs to know about a model: its layout rules and `top_k`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingConfig {
    /// The HF rules deciding which layers are MoE layers (with `num_experts`).
    pub rules: LayoutRules,
    /// Experts chosen per token per MoE layer (`num_experts_per_tok`).
    pub top_k: usize,
}

impl RoutingConfig {
    /// Reads the routing keys of a parsed `config.json` (or of its `text_config` when the
    /// top level has no `num_hidden_layers`, as multimodal checkpoints nest it).
    pub fn from_hf_config(config: &Value) -> Result<Self, RouteError> {
        if !config.is_object() {
            return Err(RouteError::Layout(
                "config.json must be a JSON object".to_string(),
            ));
        }
        let cfg = match config.get("text_config") {
            Some(text) if config.get("num_hidden_layers").is_none() && text.is_object() => text,
            _ => config,
        };
        let model_type = cfg.get("model_type").and_then(Value::as_str);
        // A key left out takes its family's HF default. A null is not left out: HF keeps the
        // None and cannot build the model, so where the family has a default (the key is
        // one it needs) a null is an error naming it, as r3-model's parser says.
        let count_or_default = |key: &'static str| -> Result<Option<usize>, RouteError> {
            match (cfg.get(key), family_default(model_type, key)) {
                (None, default) => Ok(default),
                (Some(Value::Null), Some(_)) => Err(null_key(key)),
                (Some(_), _) => count(cfg, key),
            }
        };
        let num_hidden_layers = count_or_default("num_hidden_layers")?.ok_or_else(|| {
            RouteError::Layout("config.json has no `num_hidden_layers`".to_string())
        })?;
        let mut num_experts = None;
        for key in EXPERT_COUNT_KEYS {
            if let Some(n) = count(cfg, key)? {
                num_experts = Some(n);
                break;
            }
        }
        if num_experts.is_none() {
            num_experts = count_or_default("n_routed_experts")?;
        }
        let num_experts = num_experts.filter(|&n| n > 0).ok_or_else(|| {
            RouteError::Layout(format!(
                "config.json names no routed experts (none of {} is a positive integer): \
                 a dense model has no routes",
                EXPERT_COUNT_KEYS.join(", ")
            ))
        })?;
        let top_k = count_or_default("num_experts_per_tok")?.ok_or_else(|| {
            RouteError::Layout("config.json has no `num_experts_per_tok` (top_k)".to_string())
        })?;
        let mlp_only_layers = layer_list(cfg, "mlp_only_layers")?.unwrap_or_default();
        let mut rules = LayoutRules {
            num_hidden_layers,
            num_experts,
            first_k_dense_replace: count_or_default("first_k_dense_replace")?.unwrap_or(0),
            decoder_sparse_step: sparse_step(cfg)?,
            mlp_only_layers,
            moe_layer_freq: count(cfg, "moe_layer_freq")?.unwrap_or(1),
        };
        if let Some(moe) = layer_list(cfg, "moe_layers")? {
            if let Some(&bad) = moe.iter().find(|&&l| l >= num_hidden_layers) {
                return Err(RouteError::LayerOutOfRange {
                    what: "moe_layers entry",
                    layer: bad,
                    num_layers: num_hidden_layers,
                });
            }
            // HF Llama-4 ignores the step when the list is given.
            rules.decoder_sparse_step = 1;
            for layer in (0..num_hidden_layers).filter(|l| !moe.contains(l)) {
                if !rules.mlp_only_layers.contains(&layer) {
                    rules.mlp_only_layers.push(layer);
                }
            }
            rules.mlp_only_layers.sort_unstable();
        }
        Ok(RoutingConfig { rules, top_k })
    }

    /// Parses `config.json` text, then [`RoutingConfig::from_hf_config`].
    pub fn from_hf_config_str(text: &str) -> Result<Self, RouteError> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| RouteError::Layout(format!("config.json is not valid JSON: {e}")))?;
        Self::from_hf_config(&v)
    }

    /// The layer layout these rules give; an error when no layer is a MoE layer.
    pub fn layout(&self) -> Result<LayerLayout, RouteError> {
        let layout = LayerLayout::from_rules(&self.rules)?;
        if layout.num_moe_layers() == 0 {
            return Err(RouteError::Layout(format!(
                "no MoE layer among {} layers under these rules",
                self.rules.num_hidden_layers
            )));
        }
        Ok(layout)
    }
}

/// A null where the model's family needs the key.
fn null_key(key: &'static str) -> RouteError {
    RouteError::Layout(format!(
        "config.json's `{key}` is null; leave it out for transformers' default"
    ))
}

/// A non-negative integer key; `None` when absent or null.
fn count(cfg: &Value, key: &'static str) -> Result<Option<usize>, RouteError> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| wrong_type(key, v, "a non-negative integer")),
    }
}

/// A list of layer indices; `None` when absent or null.
fn layer_list(cfg: &Value, key: &'static str) -> Result<Option<Vec<usize>>, RouteError> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| wrong_type(key, v, "a list of layer indices"))
            })
            .collect::<Result<_, _>>()
            .map(Some),
        Some(other) => Err(wrong_type(key, other, "a list of layer indices")),
    }
}

/// The step of "every step-th layer is MoE": Qwen's `decoder_sparse_step` or Llama-4's
/// `interleave_moe_layer_step` (both: layer i is MoE iff `(i + 1) % step == 0`); 1 when
/// neither is given, an error when both are given and disagree.
fn sparse_step(cfg: &Value) -> Result<usize, RouteError> {
    let qwen = count(cfg, "decoder_sparse_step")?;
    let llama4 = count(cfg, "interleave_moe_layer_step")?;
    match (qwen, llama4) {
        (Some(a), Some(b)) if a != b => Err(RouteError::Layout(format!(
            "config.json has decoder_sparse_step {a} and interleave_moe_layer_step {b}: \
             the two name the same rule and must agree"
        ))),
        (Some(step), _) | (None, Some(step)) => {
            if step == 0 {
                let key = if qwen.is_some() {
                    "decoder_sparse_step"
                } else {
                    "interleave_moe_layer_step"
                };
                return Err(RouteError::Layout(format!(
                    "config.json `{key}` must be > 0"
                )));
            }
            Ok(step)
        }
        (None, None) => Ok(1),
    }
}

fn wrong_type(key: &str, value: &Value, expected: &str) -> RouteError {
    RouteError::Layout(format!(
        "config.json `{key}` is {value}, expected {expected}"
    ))
}
