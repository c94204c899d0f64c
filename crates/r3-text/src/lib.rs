//! Text for r3: any Hugging Face `tokenizer.json` with its special tokens resolved the way
//! transformers resolves them, and chat templates rendered the way transformers'
//! `apply_chat_template` renders them (minijinja with the Python-compatible extras).
//!
//! A model directory is read as transformers 5 reads it: `tokenizer.json`,
//! `tokenizer_config.json` (special tokens, `added_tokens_decoder`, `split_special_tokens`,
//! `chat_template`; not `add_bos_token`, which transformers 5 ignores beside a tokenizer.json),
//! `chat_template.jinja`, `generation_config.json` (eos ids, and the sampling values a server
//! takes as defaults: [`GenerationConfig`]) and `config.json` (eos ids).

mod bpe;
mod error;
mod generation_config;
mod jinja;
mod json_kind;
mod message;
mod model_files;
mod special;
mod template;
mod tokenizer;

pub use bpe::{train_bpe, write_tokenizer_config, BpeTrainSpec, CHATML_TEMPLATE};
pub use error::{Result, TextError};
pub use generation_config::GenerationConfig;
pub use json_kind::json_kind;
pub use message::ChatMessage;
pub use special::SpecialTokens;
pub use template::{ChatTemplate, RenderOptions};
pub use tokenizer::{model_stop_ids, TextTokenizer, ADDITIONAL_STOP_TOKEN_TEXTS, VOCAB_PADDING};
