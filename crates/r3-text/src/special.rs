//! The special tokens of `tokenizer_config.json`: `bos_token`, `eos_token`, `pad_token`,
//! `unk_token` (each a string, an `AddedToken` dict with `content`, or null) and the
//! `add_bos_token` / `add_eos_token` flags.

use std::path::Path;

use crate::error::{Result, TextError};

/// Special-token strings and flags as `tokenizer_config.json` declares them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning-of-sequence token text.
    pub bos: Option<String>,
    /// End-of-sequence token text.
    pub eos: Option<String>,
    /// Padding token text.
    pub pad: Option<String>,
    /// Unknown token text.
    pub unk: Option<String>,
    /// `add_bos_token`, when the config sets it.
    pub add_bos_token: Option<bool>,
    /// `add_eos_token`, when the config sets it.
    pub add_eos_token: Option<bool>,
}

/// The token text of a special-token field: a string or a dict with `content`.
fn token_text(cfg: &serde_json::Value, field: &'static str, path: &Path) -> Result<Option<String>> {
    match cfg.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Object(map)) => match map.get("content") {
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(TextError::BadField {
                path: path.to_path_buf(),
                field: field.to_string(),
                reason: "an AddedToken dict needs a string `content`".into(),
            }),
        },
        Some(other) => Err(TextError::BadField {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason: format!("expected a string or an AddedToken dict, found {other}"),
        }),
    }
}

fn flag(cfg: &serde_json::Value, field: &str, path: &Path) -> Result<Option<bool>> {
    match cfg.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(TextError::BadField {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason: format!("expected true or false, found {other}"),
        }),
    }
}

impl SpecialTokens {
    /// Reads the special tokens of a parsed `tokenizer_config.json` (`path` names it in errors).
    pub fn from_config(cfg: &serde_json::Value, path: &Path) -> Result<Self> {
        Ok(Self {
            bos: token_text(cfg, "bos_token", path)?,
            eos: token_text(cfg, "eos_token", path)?,
            pad: token_text(cfg, "pad_token", path)?,
            unk: token_text(cfg, "unk_token", path)?,
            add_bos_token: flag(cfg, "add_bos_token", path)?,
            add_eos_token: flag(cfg, "add_eos_token", path)?,
        })
    }

    /// `(name, text)` of every token that is set, as transformers' `special_tokens_map`
    /// passes them to chat templates.
    pub fn template_vars(&self) -> Vec<(&'static str, &str)> {
        [
            ("bos_token", &self.bos),
            ("eos_token", &self.eos),
            ("unk_token", &self.unk),
            ("pad_token", &self.pad),
        ]
        .into_iter()
        .filter_map(|(name, tok)| tok.as_deref().map(|t| (name, t)))
        .collect()
    }
}
