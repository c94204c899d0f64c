//! Optional text support: when the model directory has a `tokenizer.json`, prompts may be
//! given as text and responses carry decoded text.

use std::path::Path;

use tokenizers::Tokenizer;

use super::error::ApiError;

/// Text <-> token ids for the served model.
pub struct TextCodec {
    tokenizer: Tokenizer,
}

impl std::fmt::Debug for TextCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextCodec").finish_non_exhaustive()
    }
}

impl TextCodec {
    /// Loads `dir/tokenizer.json` if it exists (None if it does not; an error if it is bad).
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, String> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let tokenizer =
            Tokenizer::from_file(&path).map_err(|e| format!("loading {}: {e}", path.display()))?;
        Ok(Some(TextCodec { tokenizer }))
    }

    /// Token ids of `text` (no special tokens added: the text is taken as it is).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| ApiError::bad_request(format!("cannot tokenize the text: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens skipped or kept.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ApiError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| ApiError::internal(format!("cannot decode output ids: {e}")))
    }

    /// Builds a codec from an already loaded tokenizer.
    pub fn from_tokenizer(tokenizer: Tokenizer) -> Self {
        TextCodec { tokenizer }
    }

    /// The string of one token id (for OpenAI `logprobs.tokens`).
    pub fn token_str(&self, id: u32) -> String {
        self.tokenizer
            .id_to_token(id)
            .unwrap_or_else(|| format!("token_id:{id}"))
    }
}
