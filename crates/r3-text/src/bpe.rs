//! Training a byte-level BPE tokenizer on a corpus (the `tokenizers` crate's `BpeTrainer`)
//! and writing the `tokenizer_config.json` that goes with it, chat template included.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::{ModelWrapper, TrainerWrapper};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer, TokenizerImpl,
};

use crate::error::{Result, TextError};
use crate::special::SpecialTokens;

/// A small Qwen-style ChatML template: `<|im_start|>role\ncontent<|im_end|>\n` per message.
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}\n\
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n\
{%- endfor %}\n\
{%- if add_generation_prompt %}\n\
{{- '<|im_start|>assistant\\n' }}\n\
{%- endif %}\n";

/// What to train.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BpeTrainSpec {
    /// Vocabulary size, special tokens and the 256 byte tokens included.
    pub vocab_size: usize,
    /// A pair must occur this often to be merged.
    pub min_frequency: u64,
    /// Special tokens, given ids 0.. in this order.
    pub special_tokens: Vec<String>,
}

/// Trains a byte-level BPE (GPT-2 style pre-tokenizer and decoder) on `corpus`.
pub fn train_bpe(corpus: &[String], spec: &BpeTrainSpec) -> Result<Tokenizer> {
    let floor = 256 + spec.special_tokens.len();
    if spec.vocab_size < floor {
        return Err(TextError::BpeSpec(format!(
            "vocab_size {} is below the 256 byte tokens + {} special tokens",
            spec.vocab_size,
            spec.special_tokens.len()
        )));
    }
    let specials: Vec<AddedToken> = spec
        .special_tokens
        .iter()
        .map(|s| AddedToken::from(s.clone(), true))
        .collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(spec.vocab_size)
        .min_frequency(spec.min_frequency)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .show_progress(false)
        .build()
        .into();
    let mut tk: TokenizerImpl<
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerImpl::new(ModelWrapper::BPE(BPE::default()));
    tk.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tk.with_decoder(Some(ByteLevelDecoder::default()));
    tk.train(&mut trainer, corpus.iter())
        .map_err(TextError::tk("training the BPE"))?;
    Ok(Tokenizer::from(tk))
}

/// Writes `dir/tokenizer_config.json` with the special tokens (no bos added by `encode`)
/// and `chat_template`, via a temporary file and a rename.
pub fn write_tokenizer_config(
    dir: &Path,
    special: &SpecialTokens,
    chat_template: Option<&str>,
) -> Result<()> {
    let mut cfg = serde_json::Map::new();
    cfg.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
    cfg.insert(
        "add_bos_token".into(),
        special.add_bos_token.unwrap_or(false).into(),
    );
    cfg.insert(
        "add_eos_token".into(),
        special.add_eos_token.unwrap_or(false).into(),
    );
    for (name, token) in special.template_vars() {
        cfg.insert(name.into(), token.into());
    }
    cfg.insert("clean_up_tokenization_spaces".into(), false.into());
    if let Some(t) = chat_template {
        cfg.insert("chat_template".into(), t.into());
    }
    let path = dir.join("tokenizer_config.json");
    let tmp = dir.join("tokenizer_config.json.tmp");
    let text = serde_json::to_string_pretty(&serde_json::Value::Object(cfg)).map_err(|source| {
        TextError::Json {
            path: path.clone(),
            source,
        }
    })?;
    std::fs::write(&tmp, text + "\n").map_err(TextError::io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(TextError::io(&path))
}
