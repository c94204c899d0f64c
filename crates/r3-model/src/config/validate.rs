//! Value checks on a parsed [`Config`]: every number the math divides by, takes a root or
//! a log of, or indexes with must be in range, and the model's total size must stay under
//! [`ConfigLimits`]. Each refusal names the config.json key. The bounds follow what HF
//! transformers computes with (a factor ≤ 0 or a non-finite epsilon has no meaning there
//! either); values HF only warns about but can run (a yarn `factor` below 1) are accepted.

use super::{AttentionConfig, Config, ConfigLimits, RopeScaling, RouterKind};
use crate::error::{ModelError, Result};
use crate::spec::tensor_specs;

fn invalid(key: &str, value: impl std::fmt::Display, rule: &str) -> ModelError {
    ModelError::InvalidValue {
        key: key.to_string(),
        value: value.to_string(),
        rule: rule.to_string(),
    }
}

/// `value` must be finite and > 0.
fn positive(key: &str, value: f64) -> Result<()> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(invalid(key, value, "must be finite and > 0"))
    }
}

/// `value`, when given, must be finite and ≥ 0.
fn non_negative(key: &str, value: Option<f64>) -> Result<()> {
    match value {
        Some(v) if !(v.is_finite() && v >= 0.0) => Err(invalid(key, v, "must be finite and >= 0")),
        _ => Ok(()),
    }
}

/// Every check of this module, in key order of a config.json.
pub(super) fn validate(cfg: &Config) -> Result<()> {
    if cfg.max_position_embeddings == 0 {
        return Err(invalid("max_position_embeddings", 0, "must be > 0"));
    }
    positive("rms_norm_eps", cfg.rms_norm_eps)?;
    check_token_ids(cfg)?;
    check_attention(cfg)?;
    check_rope(cfg)?;
    check_router(cfg)?;
    check_total_size(cfg)
}

/// `eos_token_id` (an id or a list of ids) must be a token of the vocabulary.
fn check_token_ids(cfg: &Config) -> Result<()> {
    let ids: Vec<&serde_json::Value> = match cfg.raw.get("eos_token_id") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(items)) => items.iter().collect(),
        Some(one) => vec![one],
    };
    for id in ids {
        match id.as_u64() {
            Some(v) if v < cfg.vocab_size as u64 => {}
            _ => {
                return Err(invalid(
                    "eos_token_id",
                    id,
                    &format!("must be a token id below vocab_size {}", cfg.vocab_size),
                ))
            }
        }
    }
    Ok(())
}

fn check_attention(cfg: &Config) -> Result<()> {
    match &cfg.attention {
        AttentionConfig::Gqa {
            head_dim,
            clip_qkv,
            sliding_window,
            ..
        } => {
            if *head_dim == 0 {
                return Err(invalid("head_dim", 0, "must be > 0"));
            }
            if let Some(c) = clip_qkv {
                positive("clip_qkv", *c)?;
            }
            if *sliding_window == Some(0) {
                return Err(invalid("sliding_window", 0, "must be > 0 (or null)"));
            }
        }
        // MLA widths are required to be > 0 by the parser.
        AttentionConfig::Mla { .. } => {}
    }
    Ok(())
}

fn check_rope(cfg: &Config) -> Result<()> {
    positive("rope_theta", cfg.rope.theta)?;
    match &cfg.rope.scaling {
        RopeScaling::None => Ok(()),
        RopeScaling::Linear { factor } => positive("rope_scaling.factor", *factor),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            attention_factor,
            ..
        } => {
            positive("rope_scaling.factor", *factor)?;
            if *original_max_position_embeddings == 0 {
                return Err(invalid(
                    "rope_scaling.original_max_position_embeddings",
                    0,
                    "must be > 0",
                ));
            }
            ConfigLimits::check(
                "rope_scaling.original_max_position_embeddings",
                *original_max_position_embeddings,
                ConfigLimits::MAX_POSITIONS,
            )?;
            positive("rope_scaling.beta_fast", *beta_fast)?;
            positive("rope_scaling.beta_slow", *beta_slow)?;
            non_negative("rope_scaling.mscale", *mscale)?;
            non_negative("rope_scaling.mscale_all_dim", *mscale_all_dim)?;
            non_negative("rope_scaling.attention_factor", *attention_factor)
        }
    }
}

fn check_router(cfg: &Config) -> Result<()> {
    let Some(moe) = &cfg.moe else { return Ok(()) };
    if let RouterKind::GroupedSigmoid {
        routed_scaling_factor,
        ..
    } = moe.router
    {
        positive("routed_scaling_factor", routed_scaling_factor)?;
    }
    Ok(())
}

/// Bounds the number of expert blocks (before listing tensors) and then the parameter count,
/// with checked arithmetic for every product and sum.
fn check_total_size(cfg: &Config) -> Result<()> {
    let blocks = cfg
        .layout
        .num_moe_layers()
        .saturating_mul(cfg.num_experts());
    ConfigLimits::check(
        "num_experts (times MoE layers)",
        blocks,
        ConfigLimits::MAX_EXPERT_BLOCKS,
    )?;
    let mut total: usize = 0;
    for spec in tensor_specs(cfg) {
        let n = spec
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .unwrap_or(usize::MAX);
        total = total.saturating_add(n);
    }
    ConfigLimits::check(
        "parameters (all tensors)",
        total,
        ConfigLimits::MAX_PARAMETERS,
    )
}
