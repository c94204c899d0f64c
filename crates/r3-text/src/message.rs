//! One chat message as chat templates see it: `role`, `content` and any extra fields
//! (`reasoning_content`, `tool_calls`, `name`, ...) passed through to the template.

use serde::{Deserialize, Serialize};

/// One chat message (`{"role": ..., "content": ...}` plus optional extra fields).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text; `None` (JSON null or absent, e.g. an assistant turn that only calls
    /// tools) leaves `content` out of the message the template sees, as transformers ≥ 5.24
    /// drops every null-valued key (`message.content` is then undefined: `is defined` false,
    /// `is none` false, prints as nothing). A server that wants SGLang's `""` sets it itself.
    #[serde(default)]
    pub content: Option<String>,
    /// Further fields the template may read (e.g. `reasoning_content`), passed as they are,
    /// except that a null value leaves its key out (as for `content`).
    #[serde(flatten, default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with only a role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(content.into()),
            extra: serde_json::Map::new(),
        }
    }
}
