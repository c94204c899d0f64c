//! The character-level tokenizer: one token per character of a fixed alphabet plus
//! `<pad>`, `<bos>`, `<eos>`, built with the `tokenizers` crate and stored as an HF
//! `tokenizer.json`.
//!
//! The model is a BPE with no merges and no pre-tokenizer, so every character is its own
//! token; a `Fuse` decoder joins tokens back without spaces. Special tokens are never added
//! by `encode`: callers place `<bos>`/`<eos>` explicitly.
//!
//! Saved, it is an HF `tokenizer.json` plus a `tokenizer_config.json` declaring its special
//! tokens, and it is loaded back through r3-text like any other HF tokenizer.

use crate::error::{Result, TaskError};
use r3_text::{SpecialTokens, TextError, TextTokenizer};
use std::collections::HashMap;
use std::path::Path;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::{AddedToken, Tokenizer};

/// Characters the tokenizer knows, in id order after the special tokens.
pub const ALPHABET: &str = "0123456789+-*()=;# \n";
/// Special tokens, in id order starting at 0.
pub const SPECIAL_TOKENS: [&str; 3] = ["<pad>", "<bos>", "<eos>"];
/// Id of `<pad>`.
pub const PAD_ID: u32 = 0;
/// Id of `<bos>`.
pub const BOS_ID: u32 = 1;
/// Id of `<eos>`.
pub const EOS_ID: u32 = 2;

/// The token ↔ id table of the r3 character tokenizer.
pub fn expected_vocab() -> HashMap<String, u32> {
    SPECIAL_TOKENS
        .iter()
        .map(|s| s.to_string())
        .chain(ALPHABET.chars().map(|c| c.to_string()))
        .zip(0u32..)
        .collect()
}

/// Character-level tokenizer over [`ALPHABET`].
#[derive(Clone)]
pub struct CharTokenizer {
    inner: Tokenizer,
}

impl std::fmt::Debug for CharTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CharTokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

fn tk_err(action: &'static str) -> impl FnOnce(tokenizers::Error) -> TaskError {
    move |source| TaskError::Tokenizers { action, source }
}

impl CharTokenizer {
    /// Builds the tokenizer from the fixed alphabet.
    pub fn new() -> Result<Self> {
        let bpe = BPE::builder()
            .vocab_and_merges(expected_vocab().into_iter().collect::<Vocab>(), Vec::new())
            .build()
            .map_err(tk_err("building the BPE model"))?;
        let mut inner = Tokenizer::new(bpe);
        inner.with_decoder(Some(Fuse::new()));
        let specials: Vec<AddedToken> = SPECIAL_TOKENS
            .iter()
            .map(|s| AddedToken::from(*s, true))
            .collect();
        inner
            .add_special_tokens(specials)
            .map_err(tk_err("adding the special tokens"))?;
        Ok(Self { inner })
    }

    /// The special tokens as `tokenizer_config.json` declares them (bos is placed by callers,
    /// never added by `encode`).
    pub fn special_tokens() -> SpecialTokens {
        SpecialTokens {
            bos: Some(SPECIAL_TOKENS[BOS_ID as usize].to_string()),
            eos: Some(SPECIAL_TOKENS[EOS_ID as usize].to_string()),
            pad: Some(SPECIAL_TOKENS[PAD_ID as usize].to_string()),
            unk: None,
            add_bos_token: Some(false),
            add_eos_token: Some(false),
        }
    }

    /// Loads a `tokenizer.json` through r3-text (with the `tokenizer_config.json` beside it,
    /// when there is one) and checks that it is this tokenizer: same vocabulary and ids, and
    /// special tokens, if declared, at `<bos>`/`<eos>`/`<pad>`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let mismatch = |reason: String| TaskError::TokenizerMismatch {
            path: path.to_path_buf(),
            reason,
        };
        let text = match path.parent() {
            Some(dir) if path.file_name().is_some_and(|n| n == "tokenizer.json") => {
                TextTokenizer::from_model_dir(dir)
            }
            _ => Tokenizer::from_file(path)
                .map_err(|source| TextError::TokenizerFile {
                    path: path.to_path_buf(),
                    source,
                })
                .and_then(|t| TextTokenizer::from_tokenizer(t, SpecialTokens::default())),
        }
        .map_err(|e| match e {
            TextError::TokenizerFile { source, .. } => TaskError::TokenizerRead {
                path: path.to_path_buf(),
                source,
            },
            other => mismatch(other.to_string()),
        })?;
        let declared = [
            ("bos", text.bos_id(), BOS_ID),
            ("eos", text.eos_ids().first().copied(), EOS_ID),
            ("pad", text.pad_id(), PAD_ID),
        ];
        for (name, got, want) in declared {
            if got.is_some_and(|id| id != want) {
                return Err(mismatch(format!(
                    "the {name} token has id {got:?}, expected {want}"
                )));
            }
        }
        let inner = text.inner().clone();
        let got = inner.get_vocab(true);
        let want = expected_vocab();
        let mut want_sorted: Vec<_> = want.iter().collect();
        want_sorted.sort_by_key(|(_, id)| **id);
        for (tok, id) in want_sorted {
            if got.get(tok) != Some(id) {
                return Err(TaskError::TokenizerMismatch {
                    path: path.to_path_buf(),
                    reason: format!(
                        "token {tok:?} should have id {id}, found {:?}",
                        got.get(tok)
                    ),
                });
            }
        }
        if got.len() != want.len() {
            return Err(TaskError::TokenizerMismatch {
                path: path.to_path_buf(),
                reason: format!(
                    "vocabulary has {} tokens, expected {}",
                    got.len(),
                    want.len()
                ),
            });
        }
        Ok(Self { inner })
    }

    /// Writes the HF `tokenizer.json` at `path` and the `tokenizer_config.json` beside it
    /// (each via a temporary file and a rename, so each is atomic).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = std::path::PathBuf::from(tmp);
        self.inner
            .save(&tmp, true)
            .map_err(tk_err("writing tokenizer.json"))?;
        std::fs::rename(&tmp, path).map_err(|source| TaskError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        r3_text::write_tokenizer_config(dir, &Self::special_tokens(), None).map_err(|e| {
            TaskError::TokenizerMismatch {
                path: dir.join("tokenizer_config.json"),
                reason: format!("cannot write it: {e}"),
            }
        })
    }

    /// Number of tokens, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// Encodes text (no special tokens added); a character outside [`ALPHABET`] is an error.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        if let Some((index, ch)) = text
            .chars()
            .enumerate()
            .find(|(_, c)| !ALPHABET.contains(*c))
        {
            return Err(TaskError::UnknownChar {
                ch,
                index,
                text: text.to_string(),
                alphabet: ALPHABET,
            });
        }
        if text.is_empty() {
            return Ok(Vec::new());
        }
        let enc = self
            .inner
            .encode(text, false)
            .map_err(tk_err("encoding text"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, dropping special tokens; an id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let size = self.vocab_size();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= size) {
            return Err(TaskError::UnknownTokenId { id, size });
        }
        self.inner.decode(ids, true).map_err(tk_err("decoding ids"))
    }

    /// Decodes a generated completion: everything before the first `<eos>`.
    pub fn decode_completion(&self, ids: &[u32]) -> Result<String> {
        let end = ids.iter().position(|&id| id == EOS_ID).unwrap_or(ids.len());
        self.decode(&ids[..end])
    }

    /// `<bos>` + prompt: the token ids a rollout starts from.
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>> {
        let mut ids = vec![BOS_ID];
        ids.extend(self.encode(prompt)?);
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("r3-char-tok-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    #[test]
    fn saved_tokenizer_loads_through_r3_text_with_its_special_tokens() {
        let dir = scratch("r3text");
        let tok = CharTokenizer::new().expect("build");
        tok.save(&dir.join("tokenizer.json")).expect("save");
        let text = TextTokenizer::from_model_dir(&dir).expect("r3-text loads it");
        assert_eq!(text.bos_id(), Some(BOS_ID));
        assert_eq!(text.eos_ids(), &[EOS_ID]);
        assert_eq!(text.pad_id(), Some(PAD_ID));
        let s = "12+(3*4)=24;# \n";
        assert_eq!(
            text.encode(s, true).expect("encode"),
            tok.encode(s).expect("encode")
        );
        assert_eq!(text.vocab_size(), tok.vocab_size());
        let back = CharTokenizer::from_file(&dir.join("tokenizer.json")).expect("reload");
        assert_eq!(
            back.encode(s).expect("encode"),
            tok.encode(s).expect("encode")
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_config_that_moves_a_special_token_is_refused() {
        let dir = scratch("moved");
        CharTokenizer::new()
            .expect("build")
            .save(&dir.join("tokenizer.json"))
            .expect("save");
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"eos_token": "<pad>"}"#,
        )
        .expect("write");
        match CharTokenizer::from_file(&dir.join("tokenizer.json")) {
            Err(TaskError::TokenizerMismatch { reason, .. }) => {
                assert!(reason.contains("eos"), "{reason}")
            }
            other => panic!("expected TokenizerMismatch, got {other:?}"),
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
