//! The model's text side in a run: its HF tokenizer with the special tokens r3-text resolves
//! (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`, `config.json`), its
//! chat template when it has one, and the tokenizer files themselves, which every checkpoint
//! carries unchanged so a resumed run or a rollout worker reads exactly the same text side.
//!
//! The one place the trainer turns prompt text into ids and response ids into text.

use std::path::Path;

use r3_text::{ChatMessage, ChatTemplate, RenderOptions, TextTokenizer};

use crate::error::{Result, TrainError};

/// Files of a model directory that describe its tokenizer and chat template (copied into
/// checkpoints when present; `config.json` is written with the weights).
pub const TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
];

/// A model's tokenizer, chat template and the files they were read from.
#[derive(Debug, Clone)]
pub struct ModelText {
    tokenizer: TextTokenizer,
    template: Option<ChatTemplate>,
    files: Vec<(&'static str, Vec<u8>)>,
}

impl ModelText {
    /// Reads the tokenizer and chat template of model directory `dir`.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let text_err = |source| TrainError::ModelText {
            dir: dir.to_path_buf(),
            source,
        };
        let tokenizer = TextTokenizer::from_model_dir(dir).map_err(text_err)?;
        let template = ChatTemplate::from_model_dir(dir).map_err(text_err)?;
        let mut files = Vec::new();
        for name in TOKENIZER_FILES {
            let path = dir.join(name);
            if path.is_file() {
                files.push((name, std::fs::read(&path).map_err(TrainError::io(&path))?));
            }
        }
        Ok(Self {
            tokenizer,
            template,
            files,
        })
    }

    /// A tokenizer and template built in memory (no files to copy: whoever built them
    /// writes them, as `r3 pretrain` does).
    pub fn from_parts(tokenizer: TextTokenizer, template: Option<ChatTemplate>) -> Self {
        Self {
            tokenizer,
            template,
            files: Vec::new(),
        }
    }

    /// The tokenizer with its resolved special tokens.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// Checks the tokenizer fits a model of `model_vocab` ids and records it, so that
    /// decoding refuses ids past the model's vocabulary (see [`TextTokenizer::fit_model`]).
    pub fn fit_model(&mut self, model_vocab: usize) -> Result<()> {
        Ok(self.tokenizer.fit_model(model_vocab)?)
    }

    /// The chat template, if the model has one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Number of tokens of the tokenizer, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.vocab_size()
    }

    /// Renders chat messages with the model's template and an assistant-turn header (the
    /// prompt of a rollout); `system_prompt` is put first when the messages have no system turn.
    pub fn render_chat(&self, messages: &[ChatMessage], system_prompt: &str) -> Result<String> {
        let template = self.template.as_ref().ok_or(TrainError::InvalidConfig {
            field: "data.apply_chat_template",
            reason: "the model has no chat template (no `chat_template` in \
                     tokenizer_config.json, no chat_template.jinja); set \
                     data.apply_chat_template = false"
                .into(),
        })?;
        let opts = RenderOptions {
            add_generation_prompt: true,
            system_prompt: (!system_prompt.is_empty()).then(|| system_prompt.to_string()),
            ..RenderOptions::default()
        };
        template.render(messages, &opts).map_err(TrainError::Text)
    }

    /// Ids of a plain (untemplated) prompt: the tokenizer's own special tokens, with `<bos>`
    /// first whenever the model has one (a base model's generation starts from it).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let ids = self.encode_checked(text, true)?;
        Ok(match self.tokenizer.bos_id() {
            Some(bos) if ids.first() != Some(&bos) => std::iter::once(bos).chain(ids).collect(),
            _ => ids,
        })
    }

    /// Ids of a prompt rendered by the chat template: encoded without adding special tokens,
    /// as transformers does (the template writes any `<bos>` itself).
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_checked(text, false)
    }

    /// Encodes `text`, refusing text the tokenizer would silently drop: a character no token
    /// covers (a vocabulary without `<unk>` loses it) is an error naming it.
    fn encode_checked(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let (ids, offsets) = self
            .tokenizer
            .encode_with_offsets(text, add_special_tokens)?;
        let mut covered = vec![false; text.len()];
        for &(start, end) in &offsets {
            for c in covered.iter_mut().take(end.min(text.len())).skip(start) {
                *c = true;
            }
        }
        if let Some(gap) = text
            .char_indices()
            .find(|&(i, c)| !c.is_whitespace() && !covered[i])
        {
            // Offsets after a dropped character can be shifted: name the first character that
            // encodes to nothing on its own, else the first gap.
            let lost = text.char_indices().find(|&(_, c)| {
                !c.is_whitespace()
                    && self
                        .tokenizer
                        .inner()
                        .encode(c.to_string(), false)
                        .is_ok_and(|e| e.get_ids().is_empty())
            });
            let (index, ch) = lost.unwrap_or(gap);
            return Err(TrainError::UnspellableText {
                ch,
                index,
                text: text.to_string(),
            });
        }
        Ok(ids)
    }

    /// The tokenizer's own eos / stop ids. A rollout stops at more: the model's eos ids and
    /// SGLang's extra turn-final tokens too ([`crate::rl::sampling::stop_ids`]).
    pub fn stop_ids(&self) -> &[u32] {
        self.tokenizer.stop_token_ids()
    }

    /// Text of a generated response: the ids before the first of `stop` (the ids its request
    /// stopped at, [`crate::rl::sampling::stop_ids`], so the reward reads the text the engine
    /// ended on), special tokens skipped.
    pub fn decode_completion(&self, ids: &[u32], stop: &[u32]) -> Result<String> {
        let end = ids
            .iter()
            .position(|id| stop.contains(id))
            .unwrap_or(ids.len());
        Ok(self.tokenizer.decode(&ids[..end], true)?)
    }

    /// Writes the tokenizer files read at load into `dir`, byte for byte.
    pub fn save(&self, dir: &Path) -> Result<()> {
        for (name, bytes) in &self.files {
            let path = dir.join(name);
            std::fs::write(&path, bytes).map_err(TrainError::io(&path))?;
        }
        Ok(())
    }
}
