//! One dataset row and how it is read out of a JSON object (a JSONL line, or a Parquet row
//! turned into JSON), every schema violation naming the file, the row and the field.

use crate::error::{Result, TaskError};
use crate::reward::RewardKind;
use r3_text::json_kind;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::borrow::Cow;
use std::path::Path;

/// One chat message of a prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ... (passed to the chat template unchanged).
    pub role: String,
    /// The message text.
    pub content: String,
}

/// A prompt as a dataset gives it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// A list of chat messages (verl's usual form).
    Messages(Vec<ChatMessage>),
    /// Plain text, used as the prompt as is (or as one user message under a chat template).
    Text(String),
}

impl Prompt {
    /// The prompt as chat messages: a plain text becomes one `user` message.
    pub fn messages(&self) -> Vec<ChatMessage> {
        match self {
            Prompt::Messages(m) => m.clone(),
            Prompt::Text(t) => vec![ChatMessage {
                role: "user".into(),
                content: t.clone(),
            }],
        }
    }

    /// The prompt without a chat template: the text, or the messages' contents joined by
    /// newlines.
    pub fn plain_text(&self) -> String {
        match self {
            Prompt::Text(t) => t.clone(),
            Prompt::Messages(m) => m
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// One RL example.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DatasetRow {
    /// The prompt.
    pub prompt: Prompt,
    /// `reward_model.ground_truth` as the dataset holds it: any JSON value but `null` (a
    /// string or a number for the built-in rewards, see [`ground_truth_text`]; an object
    /// such as verl search-R1's `{"target": [...]}` for a `command` verifier).
    pub ground_truth: Value,
    /// `data_source` (empty when the column is absent).
    pub data_source: String,
    /// `extra_info`, kept as JSON (`null` when absent).
    pub extra_info: Value,
}

/// Where a row came from, for error messages.
#[derive(Debug, Clone, Copy)]
pub struct RowLocation<'a> {
    /// The file.
    pub path: &'a Path,
    /// 0-based row index within the file.
    pub row: usize,
}

impl RowLocation<'_> {
    /// A schema error at this row.
    pub fn error(&self, field: &str, reason: impl Into<String>) -> TaskError {
        TaskError::DatasetRow {
            path: self.path.to_path_buf(),
            row: self.row,
            field: field.to_string(),
            reason: reason.into(),
        }
    }
}

impl DatasetRow {
    /// Reads a row from its JSON object; the prompt is in column `prompt_key`.
    pub fn from_json(value: &Value, prompt_key: &str, at: RowLocation<'_>) -> Result<Self> {
        let Value::Object(obj) = value else {
            return Err(at.error("(row)", format!("is {}, not an object", json_kind(value))));
        };
        let prompt = match obj.get(prompt_key) {
            None | Some(Value::Null) => return Err(at.error(prompt_key, "missing")),
            Some(v) => parse_prompt(v, prompt_key, at)?,
        };
        let ground_truth = match obj.get("reward_model") {
            None | Some(Value::Null) => return Err(at.error("reward_model", "missing")),
            Some(Value::Object(rm)) => match rm.get("ground_truth") {
                None | Some(Value::Null) => {
                    return Err(at.error("reward_model.ground_truth", "missing"))
                }
                Some(value) => value.clone(),
            },
            Some(other) => {
                return Err(at.error(
                    "reward_model",
                    format!("is {}, expected an object", json_kind(other)),
                ))
            }
        };
        let data_source = match obj.get("data_source") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(at.error(
                    "data_source",
                    format!("is {}, expected a string", json_kind(other)),
                ))
            }
        };
        let extra_info = obj.get("extra_info").cloned().unwrap_or(Value::Null);
        Ok(Self {
            prompt,
            ground_truth,
            data_source,
            extra_info,
        })
    }

    /// Checks that the ground truth is what the built-in reward `reward` compares (a string
    /// or a number, see [`ground_truth_text`]), naming the row and field otherwise.
    pub fn check_text_ground_truth(&self, reward: RewardKind, at: RowLocation<'_>) -> Result<()> {
        match ground_truth_text(&self.ground_truth) {
            Some(_) => Ok(()),
            None => Err(at.error(
                "reward_model.ground_truth",
                format!(
                    "is {}, expected a string or a number: the `{reward}` reward compares it as \
                     text (a `command` verifier reads any JSON value)",
                    json_kind(&self.ground_truth)
                ),
            )),
        }
    }

    /// The row in verl's schema (the form JSONL files hold), prompt under `prompt_key`.
    pub fn to_json(&self, prompt_key: &str) -> Value {
        let prompt = match &self.prompt {
            Prompt::Text(t) => Value::String(t.clone()),
            Prompt::Messages(m) => serde_json::json!(m),
        };
        let mut obj = serde_json::Map::new();
        obj.insert(
            "data_source".into(),
            Value::String(self.data_source.clone()),
        );
        obj.insert(prompt_key.into(), prompt);
        obj.insert(
            "reward_model".into(),
            serde_json::json!({ "style": "rule", "ground_truth": self.ground_truth }),
        );
        obj.insert("extra_info".into(), self.extra_info.clone());
        Value::Object(obj)
    }
}

/// A ground truth as the built-in rewards compare it: a string as it is, a number as JSON
/// writes it (`4`, `1.5`); `None` for anything else (an object, a list, a boolean).
pub fn ground_truth_text(value: &Value) -> Option<Cow<'_, str>> {
    match value {
        Value::String(s) => Some(Cow::Borrowed(s)),
        Value::Number(n) => Some(Cow::Owned(n.to_string())),
        _ => None,
    }
}

fn parse_prompt(v: &Value, key: &str, at: RowLocation<'_>) -> Result<Prompt> {
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) => {
            if items.is_empty() {
                return Err(at.error(key, "is an empty list of messages"));
            }
            let mut messages = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let Value::Object(m) = item else {
                    return Err(at.error(
                        &format!("{key}[{i}]"),
                        format!(
                            "is {}, expected a {{role, content}} object",
                            json_kind(item)
                        ),
                    ));
                };
                let text = |name: &str| match m.get(name) {
                    Some(Value::String(s)) => Ok(s.clone()),
                    None | Some(Value::Null) => {
                        Err(at.error(&format!("{key}[{i}].{name}"), "missing"))
                    }
                    Some(other) => Err(at.error(
                        &format!("{key}[{i}].{name}"),
                        format!("is {}, expected a string", json_kind(other)),
                    )),
                };
                messages.push(ChatMessage {
                    role: text("role")?,
                    content: text("content")?,
                });
            }
            Ok(Prompt::Messages(messages))
        }
        other => Err(at.error(
            key,
            format!(
                "is {}, expected a string or a list of messages",
                json_kind(other)
            ),
        )),
    }
}
