//! The special tokens of `tokenizer_config.json`: `bos_token`, `eos_token`, `pad_token`,
//! `unk_token` (each a string, an `AddedToken` dict with `content`, or null) and the
//! `add_bos_token` / `add_eos_token` flags; and every token transformers 5 reads from it
//! besides ([`ConfigTokens`]: `sep_token`, `cls_token`, `mask_token`, model-specific
//! `*_token` keys, `extra_special_tokens` / `additional_special_tokens`).

use std::path::Path;

use tokenizers::AddedToken;

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
    /// `add_bos_token`, when the config sets it. Written by [`crate::write_tokenizer_config`]
    /// but never used to encode: transformers 5 drops it when a `tokenizer.json` exists (its
    /// post-processor alone adds special tokens), and r3 always has one.
    pub add_bos_token: Option<bool>,
    /// `add_eos_token`, when the config sets it (like `add_bos_token`, not used to encode).
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

/// A `true` / `false` field of the config (`None` when absent or null).
pub(crate) fn flag(cfg: &serde_json::Value, field: &str, path: &Path) -> Result<Option<bool>> {
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

/// transformers' named special tokens (`SPECIAL_TOKENS_ATTRIBUTES`), in its order.
const NAMED_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Every special token of a `tokenizer_config.json` as transformers 5 reads it
/// (`PreTrainedTokenizerBase.__init__` and `_from_pretrained`): the named ones, the
/// model-specific `*_token` keys (a string or an `{"__type": "AddedToken", ...}` dict, e.g.
/// `image_token`, and the entries of an `extra_special_tokens` dict), which together are its
/// `special_tokens_map`, and the list of `extra_special_tokens` (or, when that is unset,
/// `additional_special_tokens`).
#[derive(Debug, Clone, Default)]
pub(crate) struct ConfigTokens {
    /// `(field, token)` of the named and model-specific tokens, in transformers' order.
    pub named: Vec<(String, AddedToken)>,
    /// The extra special tokens of a list.
    pub extra: Vec<AddedToken>,
}

/// An `AddedToken` dict as Python's `AddedToken(**dict)` builds it: `normalized` defaults to
/// `not special`, the other flags to false.
pub(crate) fn added_token_of_dict(
    map: &serde_json::Map<String, serde_json::Value>,
    field: &str,
    path: &Path,
) -> Result<AddedToken> {
    let bad = |reason: String| TextError::BadField {
        path: path.to_path_buf(),
        field: field.to_string(),
        reason,
    };
    let content = match map.get("content") {
        Some(serde_json::Value::String(s)) => s.clone(),
        _ => return Err(bad("an AddedToken dict needs a string `content`".into())),
    };
    let flag = |name: &str| -> Result<Option<bool>> {
        match map.get(name) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(bad(format!(
                "`{name}` must be true or false, found {other}"
            ))),
        }
    };
    let special = flag("special")?.unwrap_or(false);
    Ok(AddedToken {
        content,
        single_word: flag("single_word")?.unwrap_or(false),
        lstrip: flag("lstrip")?.unwrap_or(false),
        rstrip: flag("rstrip")?.unwrap_or(false),
        normalized: flag("normalized")?.unwrap_or(!special),
        special,
    })
}

/// A special-token value: a string is a special token (Python's `AddedToken(s, special=True)`),
/// a dict an `AddedToken` with its own flags.
fn config_token(value: &serde_json::Value, field: &str, path: &Path) -> Result<AddedToken> {
    match value {
        serde_json::Value::String(s) => Ok(AddedToken::from(s.clone(), true)),
        serde_json::Value::Object(map) => added_token_of_dict(map, field, path),
        other => Err(TextError::BadField {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason: format!("expected a string or an AddedToken dict, found {other}"),
        }),
    }
}

/// Whether transformers takes `value` of a key that is not a named token as a model-specific
/// token: a string, or a dict marked `"__type": "AddedToken"` (the only dicts its
/// `convert_added_tokens` turns into `AddedToken`s).
fn is_model_specific(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(_) => true,
        serde_json::Value::Object(map) => {
            map.get("__type").and_then(|t| t.as_str()) == Some("AddedToken")
        }
        _ => false,
    }
}

impl ConfigTokens {
    /// Reads the tokens of a parsed `tokenizer_config.json` (`path` names it in errors).
    pub fn from_config(cfg: &serde_json::Value, path: &Path) -> Result<Self> {
        let mut tokens = Self::default();
        let Some(map) = cfg.as_object() else {
            return Ok(tokens);
        };
        let push = |named: &mut Vec<(String, AddedToken)>, name: &str, tok: AddedToken| match named
            .iter_mut()
            .find(|(n, _)| n == name)
        {
            Some(slot) => slot.1 = tok,
            None => named.push((name.to_string(), tok)),
        };
        for name in NAMED_TOKENS {
            match map.get(name) {
                None | Some(serde_json::Value::Null) => {}
                Some(v) => push(&mut tokens.named, name, config_token(v, name, path)?),
            }
        }
        for (key, value) in map {
            if key.ends_with("_token")
                && !NAMED_TOKENS.contains(&key.as_str())
                && is_model_specific(value)
            {
                push(&mut tokens.named, key, config_token(value, key, path)?);
            }
        }
        // `additional_special_tokens` is the older name, used only when
        // `extra_special_tokens` is unset or empty (transformers' `not init_kwargs.get(...)`).
        let truthy = |v: &serde_json::Value| match v {
            serde_json::Value::Null => false,
            serde_json::Value::Array(a) => !a.is_empty(),
            serde_json::Value::Object(o) => !o.is_empty(),
            serde_json::Value::String(s) => !s.is_empty(),
            serde_json::Value::Bool(b) => *b,
            serde_json::Value::Number(_) => true,
        };
        let (field, extra) = match map.get("extra_special_tokens") {
            Some(v) if truthy(v) => ("extra_special_tokens", Some(v)),
            _ => (
                "additional_special_tokens",
                map.get("additional_special_tokens")
                    .or(map.get("extra_special_tokens")),
            ),
        };
        match extra {
            None | Some(serde_json::Value::Null) => {}
            // A dict names model-specific tokens.
            Some(serde_json::Value::Object(entries)) => {
                for (key, value) in entries {
                    push(&mut tokens.named, key, config_token(value, field, path)?);
                }
            }
            Some(serde_json::Value::Array(items)) => {
                for item in items {
                    tokens.extra.push(config_token(item, field, path)?);
                }
            }
            Some(other) => {
                return Err(TextError::BadField {
                    path: path.to_path_buf(),
                    field: field.to_string(),
                    reason: format!(
                        "expected a list of tokens or a dict of named tokens, found {other}"
                    ),
                })
            }
        }
        Ok(tokens)
    }

    /// The named tokens built from [`SpecialTokens`] alone (a template without a config).
    pub fn of_special(special: &SpecialTokens) -> Self {
        let named = [
            ("bos_token", &special.bos),
            ("eos_token", &special.eos),
            ("unk_token", &special.unk),
            ("pad_token", &special.pad),
        ]
        .into_iter()
        .filter_map(|(name, tok)| {
            tok.as_ref()
                .map(|t| (name.to_string(), AddedToken::from(t.clone(), true)))
        })
        .collect();
        Self {
            named,
            extra: Vec::new(),
        }
    }

    /// `(name, text)` of transformers' `special_tokens_map`: the variables a chat template sees.
    pub fn template_vars(&self) -> Vec<(String, String)> {
        self.named
            .iter()
            .map(|(name, tok)| (name.clone(), tok.content.clone()))
            .collect()
    }
}
