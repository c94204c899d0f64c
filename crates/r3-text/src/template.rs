//! [`ChatTemplate`]: a model's chat template(s) — `chat_template.jinja`, or
//! `tokenizer_config.json`'s `chat_template` as a string or a list of named templates —
//! rendered with the variables transformers' `apply_chat_template` passes: `messages`,
//! `tools`, `documents`, `add_generation_prompt`, the special tokens and any extra kwargs.

use std::path::Path;

use minijinja::{Environment, Value};

use crate::error::{Result, TextError};
use crate::message::ChatMessage;
use crate::model_files::read_json_opt;
use crate::special::{ConfigTokens, SpecialTokens};

/// Name transformers uses for the template chosen when no name is given.
const DEFAULT_NAME: &str = "default";

/// How to render a conversation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RenderOptions {
    /// End with the header of an assistant turn, so the model's reply follows.
    pub add_generation_prompt: bool,
    /// A system message put first when the conversation has none.
    pub system_prompt: Option<String>,
    /// Extra template variables (e.g. `enable_thinking`), as transformers' `**kwargs`.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
    /// Which named template to use (`default` when unset).
    pub template_name: Option<String>,
}

/// A model's compiled chat template(s) with the special tokens they may print.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    names: Vec<String>,
    special: SpecialTokens,
    /// `(name, text)` of every special token the templates see (transformers'
    /// `special_tokens_map`: `bos_token` ... `mask_token` and model-specific `*_token`s).
    token_vars: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("names", &self.names)
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

/// The templates of a `chat_template` field: a string, or a list of `{name, template}`.
fn templates_of_field(value: &serde_json::Value, path: &Path) -> Result<Vec<(String, String)>> {
    let bad = |reason: &str| TextError::BadField {
        path: path.to_path_buf(),
        field: "chat_template".into(),
        reason: reason.into(),
    };
    match value {
        serde_json::Value::String(s) => Ok(vec![(DEFAULT_NAME.to_string(), s.clone())]),
        serde_json::Value::Array(items) => items
            .iter()
            .map(|item| {
                let name = item.get("name").and_then(|v| v.as_str());
                let source = item.get("template").and_then(|v| v.as_str());
                match (name, source) {
                    (Some(n), Some(s)) => Ok((n.to_string(), s.to_string())),
                    _ => Err(bad(
                        "each entry of the list needs string `name` and `template`",
                    )),
                }
            })
            .collect(),
        _ => Err(bad("expected a string or a list of {name, template}")),
    }
}

impl ChatTemplate {
    /// The chat template of a model directory, `None` when it has none. `chat_template.jinja`
    /// wins over `tokenizer_config.json`'s `chat_template`, as in transformers.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>> {
        let tc_path = dir.join("tokenizer_config.json");
        let config = read_json_opt(dir, "tokenizer_config.json")?;
        let (special, tokens) = match &config {
            Some(cfg) => (
                SpecialTokens::from_config(cfg, &tc_path)?,
                ConfigTokens::from_config(cfg, &tc_path)?,
            ),
            None => (SpecialTokens::default(), ConfigTokens::default()),
        };
        let jinja_path = dir.join("chat_template.jinja");
        let templates = if jinja_path.is_file() {
            let source =
                std::fs::read_to_string(&jinja_path).map_err(TextError::io(&jinja_path))?;
            vec![(DEFAULT_NAME.to_string(), source)]
        } else {
            match config.as_ref().and_then(|c| c.get("chat_template")) {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(field) => templates_of_field(field, &tc_path)?,
            }
        };
        let mut template = Self::named(templates, special)?;
        template.token_vars = tokens.template_vars();
        Ok(Some(template))
    }

    /// One template, named `default`, seeing the special tokens of `special` (bos, eos, unk,
    /// pad; [`Self::from_model_dir`] passes every one its config names).
    pub fn new(source: impl Into<String>, special: SpecialTokens) -> Result<Self> {
        Self::named(vec![(DEFAULT_NAME.to_string(), source.into())], special)
    }

    /// Several named templates; each must compile. transformers' `{% generation %}` ...
    /// `{% endgeneration %}` (the assistant-mask tag) renders its body, as there.
    pub fn named(templates: Vec<(String, String)>, special: SpecialTokens) -> Result<Self> {
        let mut env = crate::jinja::environment().map_err(|source| TextError::TemplateSyntax {
            name: DEFAULT_NAME.into(),
            source,
        })?;
        let mut names = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            env.add_template_owned(name.clone(), crate::jinja::generation_blocks(&source))
                .map_err(|source| TextError::TemplateSyntax {
                    name: name.clone(),
                    source,
                })?;
            names.push(name);
        }
        let token_vars = ConfigTokens::of_special(&special).template_vars();
        Ok(Self {
            env,
            names,
            special,
            token_vars,
        })
    }

    /// Names of the templates (`["default"]` for a single one).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The special tokens the template sees as `bos_token`, `eos_token`, ...
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// `(name, text)` of every special token the templates see as a variable: transformers'
    /// `special_tokens_map` (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`,
    /// `cls_token`, `mask_token` and the config's model-specific `*_token`s, those set).
    pub fn token_vars(&self) -> &[(String, String)] {
        &self.token_vars
    }

    /// Renders a conversation to the prompt text (to be tokenized without adding special
    /// tokens, as transformers does). Each message reaches the template as transformers
    /// 5.25's `apply_chat_template` passes it: keys whose value is null dropped (null
    /// `content` included: the key is then undefined, not `none`; transformers ≥ 5.24), and
    /// a reasoning field copied under its other names (≥ 5.21: `reasoning_content`, `thinking`,
    /// `reasoning`).
    pub fn render(&self, messages: &[ChatMessage], opts: &RenderOptions) -> Result<String> {
        let name = match &opts.template_name {
            Some(n) => n.as_str(),
            // A single template is the one to use whatever its name.
            None if self.names.len() == 1 => self.names[0].as_str(),
            None => DEFAULT_NAME,
        };
        let template = self
            .env
            .get_template(name)
            .map_err(|_| TextError::UnknownTemplate {
                name: name.to_string(),
                available: self.names.clone(),
            })?;
        let mut conversation = Vec::with_capacity(messages.len() + 1);
        if let Some(system) = &opts.system_prompt {
            if messages.first().is_none_or(|m| m.role != "system") {
                conversation.push(ChatMessage::new("system", system.clone()));
            }
        }
        conversation.extend_from_slice(messages);
        let conversation: Vec<serde_json::Map<String, serde_json::Value>> = conversation
            .iter()
            .map(|m| alias_reasoning(without_nulls(m)))
            .collect();
        let mut vars: Vec<(String, Value)> = vec![
            (
                "messages".into(),
                Value::from(minijinja::value::Serde(&conversation)),
            ),
            ("tools".into(), Value::from(())),
            ("documents".into(), Value::from(())),
            (
                "add_generation_prompt".into(),
                Value::from(opts.add_generation_prompt),
            ),
        ];
        for (name, token) in &self.token_vars {
            vars.push((name.clone(), Value::from(token.as_str())));
        }
        for (key, value) in &opts.kwargs {
            vars.retain(|(k, _)| k != key);
            vars.push((key.clone(), Value::from(minijinja::value::Serde(value))));
        }
        let ctx = Value::from_pairs(vars);
        template
            .render(ctx)
            .map_err(|source| TextError::Render { source })
    }
}

/// A message as a JSON object without its null-valued keys (transformers ≥ 5.24's
/// `_normalize_chat_messages`: `{key: value for key, value in message.items() if value is not
/// None}`): `role`, then `content` unless it is `None`, then the extra fields in their order.
fn without_nulls(message: &ChatMessage) -> serde_json::Map<String, serde_json::Value> {
    let mut map = serde_json::Map::with_capacity(2 + message.extra.len());
    map.insert("role".into(), message.role.clone().into());
    if let Some(content) = &message.content {
        map.insert("content".into(), content.clone().into());
    }
    for (key, value) in &message.extra {
        if !value.is_null() {
            map.insert(key.clone(), value.clone());
        }
    }
    map
}

/// The names a message's reasoning goes by, the one templates read first (transformers'
/// `_REASONING_FIELDS`).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// transformers ≥ 5.21's `_alias_reasoning_fields` for one message: the first of
/// [`REASONING_FIELDS`] that is set is the reasoning, and the message becomes
/// `{"thinking": reasoning, **message, "reasoning_content": reasoning}` (a Python dict
/// literal: `thinking` stays the first key, keeping the message's own value when it has one,
/// and `reasoning_content` keeps its place when the message has it).
fn alias_reasoning(
    message: serde_json::Map<String, serde_json::Value>,
) -> serde_json::Map<String, serde_json::Value> {
    let Some(reasoning) = REASONING_FIELDS
        .iter()
        .find_map(|key| message.get(*key).filter(|v| !v.is_null()).cloned())
    else {
        return message;
    };
    let mut aliased = serde_json::Map::with_capacity(message.len() + 2);
    aliased.insert("thinking".into(), reasoning.clone());
    for (key, value) in message {
        aliased.insert(key, value);
    }
    aliased.insert("reasoning_content".into(), reasoning);
    aliased
}
