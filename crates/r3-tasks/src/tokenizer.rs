//! The character-level tokenizer: one token per character of a fixed alphabet plus
//! `<pad>`, `<bos>`, `<eos>`, built with the `tokenizers` crate and stored as an HF
//! `tokenizer.json`.
//!
//! The model is a BPE with no merges and no pre-tokenizer, so every character is its own
//! token; a `Fuse` decoder joins tokens back without spaces. Special tokens are never added
//! by `encode`: callers place `<bos>`/`<eos>` explicitly.

use crate::error::{Result, TaskError};
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

    /// Loads a `tokenizer.json` and checks that it is this tokenizer (same vocabulary and ids).
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = Tokenizer::from_file(path).map_err(|source| TaskError::TokenizerRead {
            path: path.to_path_buf(),
            source,
        })?;
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

    /// Writes the HF `tokenizer.json` (via a temporary file and a rename, so it is atomic).
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
