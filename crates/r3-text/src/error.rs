//! The error type of r3-text: every way a model directory, a tokenizer or a template can be wrong.

use std::path::PathBuf;

/// Result with [`TextError`].
pub type Result<T, E = TextError> = std::result::Result<T, E>;

/// Everything that can go wrong while loading a tokenizer or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The model directory has no `tokenizer.json`.
    #[error("{dir} has no tokenizer.json")]
    MissingTokenizer {
        /// The model directory.
        dir: PathBuf,
    },
    /// `tokenizer.json` could not be parsed by the `tokenizers` crate.
    #[error("{path}: cannot load the tokenizer: {source}")]
    TokenizerFile {
        /// The file.
        path: PathBuf,
        /// The tokenizers error.
        source: tokenizers::Error,
    },
    /// The `tokenizers` crate failed on an operation.
    #[error("{action}: {source}")]
    Tokenizers {
        /// What was being done.
        action: &'static str,
        /// The tokenizers error.
        source: tokenizers::Error,
    },
    /// A field of a config file has the wrong shape.
    #[error("{path}: field `{field}`: {reason}")]
    BadField {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// A special token named in `tokenizer_config.json` is not in the vocabulary.
    #[error("{field} {token:?} is not in the tokenizer's vocabulary")]
    UnknownSpecialToken {
        /// `bos_token`, `eos_token`, ...
        field: &'static str,
        /// The token text.
        token: String,
    },
    /// A token id outside the model's vocabulary (see `TextTokenizer::fit_model`).
    #[error("token id {id} is outside the model's vocabulary of {size} ids")]
    UnknownTokenId {
        /// The id.
        id: u32,
        /// The model's vocabulary size.
        size: usize,
    },
    /// A chat template does not compile.
    #[error("chat template {name:?} does not compile: {source:#}")]
    TemplateSyntax {
        /// The template's name (`default` for a single template).
        name: String,
        /// The minijinja error.
        source: minijinja::Error,
    },
    /// A named chat template was asked for that the model does not have.
    #[error("no chat template named {name:?} (the model has: {available:?})")]
    UnknownTemplate {
        /// The name asked for.
        name: String,
        /// The names the model has.
        available: Vec<String>,
    },
    /// Rendering a chat template failed (including the template's own `raise_exception`).
    #[error("rendering the chat template failed: {source:#}")]
    Render {
        /// The minijinja error.
        source: minijinja::Error,
    },
    /// A tokenizer whose vocabulary does not fit the model it sits beside.
    #[error(
        "tokenizer.json has {tokenizer} tokens but the model's vocabulary (config.json \
             vocab_size) is {model}: {consequence}; use the model's own tokenizer, or start \
             without a tokenizer.json to work with token ids only"
    )]
    VocabularyMismatch {
        /// Tokens of the tokenizer, added tokens included.
        tokenizer: usize,
        /// The model's `vocab_size`.
        model: usize,
        /// What would go wrong.
        consequence: String,
    },
    /// Invalid arguments to a BPE training run.
    #[error("BPE training: {0}")]
    BpeSpec(String),
}

impl TextError {
    /// Maps an I/O error on `path`.
    pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |source| Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// Maps a tokenizers error of `action`.
    pub(crate) fn tk(action: &'static str) -> impl FnOnce(tokenizers::Error) -> Self {
        move |source| Self::Tokenizers { action, source }
    }
}
