//! Optional text support: when the model directory has a `tokenizer.json`, prompts may be
//! given as text, responses carry decoded text, and chat messages are rendered through the
//! model's chat template (all through r3-text, as transformers would).

use std::path::Path;

use r3_text::{ChatMessage, ChatTemplate, RenderOptions, SpecialTokens, TextTokenizer};
use tokenizers::Tokenizer;

use super::error::ApiError;

/// Text <-> token ids and chat rendering for the served model.
pub struct TextCodec {
    tokenizer: TextTokenizer,
    template: Option<ChatTemplate>,
}

impl std::fmt::Debug for TextCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextCodec")
            .field("tokenizer", &self.tokenizer)
            .field("chat_template", &self.template.is_some())
            .finish()
    }
}

impl TextCodec {
    /// Loads the directory's tokenizer and chat template if it has a `tokenizer.json` (None
    /// if it does not; an error if a file is bad).
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, String> {
        if !dir.join("tokenizer.json").exists() {
            return Ok(None);
        }
        let tokenizer = TextTokenizer::from_model_dir(dir).map_err(|e| e.to_string())?;
        let template = ChatTemplate::from_model_dir(dir).map_err(|e| e.to_string())?;
        Ok(Some(TextCodec {
            tokenizer,
            template,
        }))
    }

    /// Builds a codec from an already loaded tokenizer (no special tokens, no template).
    pub fn from_tokenizer(tokenizer: Tokenizer) -> Result<Self, String> {
        let tokenizer = TextTokenizer::from_tokenizer(tokenizer, SpecialTokens::default())
            .map_err(|e| e.to_string())?;
        Ok(TextCodec {
            tokenizer,
            template: None,
        })
    }

    /// Token ids of `text` with no special tokens added: a rendered chat template, whose
    /// text holds its own (transformers' `apply_chat_template` tokenizes so).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.tokenizer
            .encode(text, false)
            .map_err(|e| ApiError::bad_request(format!("cannot tokenize the text: {e}")))
    }

    /// Token ids of a text prompt (`/generate`'s `text`, a completions `prompt`) with the
    /// special tokens the tokenizer's post-processor adds (transformers 5.x, which SGLang
    /// 0.5.23 pins, ignores `add_bos_token` beside a tokenizer.json): SGLang's tokenizer
    /// manager calls the HF tokenizer with its default `add_special_tokens=True`, so a
    /// DeepSeek-V3 or Llama-3 prompt starts with the bos its post-processor adds there and
    /// must here too (Qwen's adds none).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.tokenizer
            .encode(text, true)
            .map_err(|e| ApiError::bad_request(format!("cannot tokenize the text: {e}")))
    }

    /// Text of `ids`, special tokens skipped or kept.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ApiError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| ApiError::internal(format!("cannot decode output ids: {e}")))
    }

    /// The string of one token id (for OpenAI `logprobs.tokens`).
    pub fn token_str(&self, id: u32) -> String {
        self.tokenizer
            .token_str(id)
            .unwrap_or_else(|| format!("token_id:{id}"))
    }

    /// The tokenizer with its special tokens.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// Checks the tokenizer fits a model of `model_vocab` ids and records it, so that
    /// decoding refuses ids past the model's vocabulary (see [`TextTokenizer::fit_model`]).
    pub fn fit_model(&mut self, model_vocab: usize) -> Result<(), r3_text::TextError> {
        self.tokenizer.fit_model(model_vocab)
    }

    /// The model's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Renders chat messages through the model's template: a 400 when the model has no
    /// template or the template refuses the conversation.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        opts: &RenderOptions,
    ) -> Result<String, ApiError> {
        let template = self.template.as_ref().ok_or_else(|| {
            ApiError::bad_request(
                "the model has no chat template (no chat_template in tokenizer_config.json and no chat_template.jinja); send a templated prompt to /v1/completions or /generate",
            )
        })?;
        template
            .render(messages, opts)
            .map_err(|e| ApiError::bad_request(e.to_string()))
    }
}
