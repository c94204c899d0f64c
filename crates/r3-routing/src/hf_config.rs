//! The routing facts of an HF `config.json`: which layers are MoE layers, how many experts,
//! how many per token. Reads only the keys that decide routing, each with its neutral value
//! where a family lacks it, so a config of any MoE family (DeepSeek, Qwen2/3-MoE, Mixtral,
//! multimodal configs with a `text_config`) gives its layout without the model being
//! supported by r3-model. A key that is present with the wrong type is an error naming it.

use serde_json::Value;

use crate::{LayerLayout, LayoutRules, RouteError};

/// Keys that carry the routed-expert count, in the order they are looked up.
const EXPERT_COUNT_KEYS: [&str; 3] = ["n_routed_experts", "num_experts", "num_local_experts"];

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
        let num_hidden_layers = count(cfg, "num_hidden_layers")?.ok_or_else(|| {
            RouteError::Layout("config.json has no `num_hidden_layers`".to_string())
        })?;
        let mut num_experts = None;
        for key in EXPERT_COUNT_KEYS {
            if let Some(n) = count(cfg, key)? {
                num_experts = Some(n);
                break;
            }
        }
        let num_experts = num_experts.filter(|&n| n > 0).ok_or_else(|| {
            RouteError::Layout(format!(
                "config.json names no routed experts (none of {} is a positive integer): \
                 a dense model has no routes",
                EXPERT_COUNT_KEYS.join(", ")
            ))
        })?;
        let top_k = count(cfg, "num_experts_per_tok")?.ok_or_else(|| {
            RouteError::Layout("config.json has no `num_experts_per_tok` (top_k)".to_string())
        })?;
        let mlp_only_layers = match cfg.get("mlp_only_layers") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(|| wrong_type("mlp_only_layers", v, "a list of layer indices"))
                })
                .collect::<Result<_, _>>()?,
            Some(other) => {
                return Err(wrong_type(
                    "mlp_only_layers",
                    other,
                    "a list of layer indices",
                ))
            }
        };
        let rules = LayoutRules {
            num_hidden_layers,
            num_experts,
            first_k_dense_replace: count(cfg, "first_k_dense_replace")?.unwrap_or(0),
            decoder_sparse_step: count(cfg, "decoder_sparse_step")?.unwrap_or(1),
            mlp_only_layers,
            moe_layer_freq: count(cfg, "moe_layer_freq")?.unwrap_or(1),
        };
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

fn wrong_type(key: &str, value: &Value, expected: &str) -> RouteError {
    RouteError::Layout(format!(
        "config.json `{key}` is {value}, expected {expected}"
    ))
}
