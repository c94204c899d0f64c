//! [`TextTokenizer`]: an HF `tokenizer.json` with bos / eos / pad and stop ids resolved the way
//! transformers resolves them from `tokenizer_config.json`, `generation_config.json` and
//! `config.json`, and ids decoded as HF `tokenizers` decodes them.

use std::collections::HashSet;
use std::path::Path;

use tokenizers::{AddedToken, Tokenizer};

use crate::error::{Result, TextError};
use crate::model_files::{id_list, read_json_opt};
use crate::special::{flag, ConfigTokens, SpecialTokens};

/// A half-open byte range `[start, end)` of the encoded text.
pub type ByteSpan = (usize, usize);

/// The multiple a model's vocabulary may be padded to beyond its tokenizer's tokens (see
/// [`TextTokenizer::check_fits_model`]).
pub const VOCAB_PADDING: usize = 64;

/// Turn-final tokens SGLang stops at whenever the tokenizer has them as added tokens, although
/// checkpoints ship them without eos metadata (its `_ADDITIONAL_STOP_TOKEN_TEXTS`, looked up in
/// `get_added_vocab()`: Llama-3's tool-use `<|eom_id|>` and two others).
pub const ADDITIONAL_STOP_TOKEN_TEXTS: [&str; 3] = [
    "<|eom_id|>",
    "<|content_model_end_sampling|>",
    "<|ifm|im_end|>",
];

/// The ids that end a request unless it ignores eos, one rule for r3's server, trainer and
/// fleet (SGLang's `Req._check_token_based_finish`): `model_eos` (config.json's and
/// generation_config.json's `eos_token_id`), the tokenizer's eos and stop ids, and the
/// [`ADDITIONAL_STOP_TOKEN_TEXTS`] it has as added tokens. Without a tokenizer (SGLang's
/// `--skip-tokenizer-init`) `model_eos` alone. Each id once, in that order.
pub fn model_stop_ids(model_eos: &[u32], tokenizer: Option<&TextTokenizer>) -> Vec<u32> {
    let mut ids = Vec::new();
    push_unique(&mut ids, model_eos.iter().copied());
    if let Some(tok) = tokenizer {
        push_unique(&mut ids, tok.stop_token_ids().iter().copied());
        push_unique(&mut ids, tok.additional_stop_ids());
    }
    ids
}

/// A tokenizer with its special tokens resolved.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    special: SpecialTokens,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    pad_id: Option<u32>,
    stop_ids: Vec<u32>,
    /// The model's vocabulary once [`TextTokenizer::fit_model`] recorded it.
    model_vocab: Option<usize>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("pad_id", &self.pad_id)
            .field("model_vocab", &self.model_vocab)
            .finish_non_exhaustive()
    }
}

fn push_unique(ids: &mut Vec<u32>, more: impl IntoIterator<Item = u32>) {
    for id in more {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
}

/// The added tokens of `tokenizer_config.json`'s `added_tokens_decoder` (`id` -> AddedToken
/// dict), in id order.
fn config_added_tokens(value: &serde_json::Value, path: &Path) -> Result<Vec<(u32, AddedToken)>> {
    let bad = |reason: String| TextError::BadField {
        path: path.to_path_buf(),
        field: "added_tokens_decoder".into(),
        reason,
    };
    let serde_json::Value::Object(map) = value else {
        return Err(bad(format!(
            "expected a dict of id -> AddedToken, found {value}"
        )));
    };
    let mut tokens = Vec::with_capacity(map.len());
    for (id, token) in map {
        let id: u32 = id
            .parse()
            .map_err(|_| bad(format!("key {id:?} is not a token id")))?;
        let serde_json::Value::Object(dict) = token else {
            return Err(bad(format!(
                "entry {id} is not an AddedToken dict: {token}"
            )));
        };
        tokens.push((
            id,
            crate::special::added_token_of_dict(dict, "added_tokens_decoder", path)?,
        ));
    }
    tokens.sort_by_key(|(id, _)| *id);
    Ok(tokens)
}

/// The fields of `tokenizer_config.json` that change which tokens are added and special, as
/// transformers 5's `TokenizersBackend.__init__` applies them over `tokenizer.json`:
/// `split_special_tokens` (special tokens in text are split as plain text); every token of
/// `added_tokens_decoder` (else of `tokenizer.json`'s `added_tokens`) added again with its
/// flags, marked special when a special-token field of the config names it; and the named and
/// extra special tokens that are not added tokens yet, added as special. Unlike transformers,
/// a token the vocabulary lacks altogether is not given a new id (the model could not embed
/// it): `bos_token`, `eos_token`, `unk_token` and `pad_token` are then an error
/// ([`TextError::UnknownSpecialToken`], as before), the others are left out.
fn apply_config_tokens(inner: &mut Tokenizer, cfg: &serde_json::Value, path: &Path) -> Result<()> {
    if flag(cfg, "split_special_tokens", path)? == Some(true) {
        inner.set_encode_special_tokens(true);
    }
    let config = ConfigTokens::from_config(cfg, path)?;
    let mut to_add: Vec<AddedToken> = match cfg.get("added_tokens_decoder") {
        None | Some(serde_json::Value::Null) => {
            let mut json: Vec<(u32, AddedToken)> =
                inner.get_added_tokens_decoder().into_iter().collect();
            json.sort_by_key(|(id, _)| *id);
            json.into_iter().map(|(_, t)| t).collect()
        }
        Some(value) => config_added_tokens(value, path)?
            .into_iter()
            .map(|(_, t)| t)
            .collect(),
    };
    // Named and extra tokens that are not added tokens yet (nor already on the list).
    let mut added: HashSet<String> = inner
        .get_added_vocabulary()
        .get_vocab()
        .keys()
        .cloned()
        .chain(to_add.iter().map(|t| t.content.clone()))
        .collect();
    let named = config.named.iter().map(|(_, tok)| tok);
    for tok in named.chain(&config.extra) {
        // A bos / eos / unk / pad missing from the vocabulary is refused by name afterwards
        // (`special_id`); other missing ones are left out.
        if added.insert(tok.content.clone()) && inner.token_to_id(&tok.content).is_some() {
            to_add.push(tok.clone());
        }
    }
    let named_texts: HashSet<&str> = config
        .named
        .iter()
        .map(|(_, t)| t.content.as_str())
        .collect();
    for tok in &mut to_add {
        if !tok.special && named_texts.contains(tok.content.as_str()) {
            tok.special = true;
        }
    }
    // A token of added_tokens_decoder that tokenizer.json lacks would get a new id; leave it out.
    to_add.retain(|t| inner.token_to_id(&t.content).is_some());
    inner
        .add_tokens(to_add)
        .map_err(TextError::tk("adding tokenizer_config.json's tokens"))?;
    Ok(())
}

/// The id of a special token named in the config; a token missing from the vocabulary is an error.
fn special_id(inner: &Tokenizer, field: &'static str, token: Option<&str>) -> Result<Option<u32>> {
    token
        .map(|t| {
            inner
                .token_to_id(t)
                .ok_or_else(|| TextError::UnknownSpecialToken {
                    field,
                    token: t.to_string(),
                })
        })
        .transpose()
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json` and resolves its special tokens from the directory's
    /// `tokenizer_config.json`, `generation_config.json` and `config.json` (each optional).
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(TextError::MissingTokenizer {
                dir: dir.to_path_buf(),
            });
        }
        let mut inner = Tokenizer::from_file(&path)
            .map_err(|source| TextError::TokenizerFile { path, source })?;
        let tc_path = dir.join("tokenizer_config.json");
        let special = match read_json_opt(dir, "tokenizer_config.json")? {
            Some(cfg) => {
                apply_config_tokens(&mut inner, &cfg, &tc_path)?;
                SpecialTokens::from_config(&cfg, &tc_path)?
            }
            None => SpecialTokens::default(),
        };
        let mut tok = Self::from_tokenizer(inner, special)?;
        let gen_path = dir.join("generation_config.json");
        let gen = read_json_opt(dir, "generation_config.json")?;
        let cfg_path = dir.join("config.json");
        let cfg = read_json_opt(dir, "config.json")?;
        let field = |v: &Option<serde_json::Value>, p: &Path, name: &str| -> Result<Vec<u32>> {
            id_list(v.as_ref().and_then(|v| v.get(name)), p, name)
        };
        // transformers' tokenizer takes bos only from tokenizer_config.json (`bos_token`: null
        // or absent is no bos, as Qwen's; config.json's bos_token_id is the model's, not the
        // tokenizer's). A directory with no tokenizer_config.json at all (r3's own character
        // model) takes the model configs' bos_token_id. generation_config's eos list is what
        // generate() stops on.
        if tok.bos_id.is_none() && !tc_path.is_file() {
            tok.bos_id = field(&gen, &gen_path, "bos_token_id")?
                .first()
                .or(field(&cfg, &cfg_path, "bos_token_id")?.first())
                .copied();
        }
        if tok.pad_id.is_none() {
            tok.pad_id = field(&gen, &gen_path, "pad_token_id")?
                .first()
                .or(field(&cfg, &cfg_path, "pad_token_id")?.first())
                .copied();
        }
        let gen_eos = field(&gen, &gen_path, "eos_token_id")?;
        let cfg_eos = field(&cfg, &cfg_path, "eos_token_id")?;
        push_unique(&mut tok.eos_ids, gen_eos);
        push_unique(&mut tok.eos_ids, cfg_eos);
        let eos = tok.eos_ids.clone();
        push_unique(&mut tok.stop_ids, eos);
        Ok(tok)
    }

    /// Wraps an already built tokenizer whose special tokens are given as text.
    pub fn from_tokenizer(inner: Tokenizer, special: SpecialTokens) -> Result<Self> {
        let bos_id = special_id(&inner, "bos_token", special.bos.as_deref())?;
        let eos_id = special_id(&inner, "eos_token", special.eos.as_deref())?;
        let pad_id = special_id(&inner, "pad_token", special.pad.as_deref())?;
        special_id(&inner, "unk_token", special.unk.as_deref())?;
        let eos_ids: Vec<u32> = eos_id.into_iter().collect();
        Ok(Self {
            inner,
            special,
            bos_id,
            stop_ids: eos_ids.clone(),
            eos_ids,
            pad_id,
            model_vocab: None,
        })
    }

    /// Adds ids that end generation besides the eos ids (e.g. `<|im_end|>` of a chat model).
    pub fn add_stop_ids(&mut self, ids: impl IntoIterator<Item = u32>) {
        push_unique(&mut self.stop_ids, ids);
    }

    /// Token ids of `text`; with `add_special_tokens`, the special tokens `tokenizer.json`'s
    /// post-processor adds (none without one). transformers 5 does the same: with a
    /// `tokenizer.json` it drops `tokenizer_config.json`'s `add_bos_token` / `add_eos_token`
    /// (`PreTrainedTokenizerBase._from_pretrained`, 5.0 to 5.25 alike), so they add nothing.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self.encode_with_offsets(text, add_special_tokens)?.0)
    }

    /// As [`Self::encode`], with the byte span of `text` each token covers (`(0, 0)` for a
    /// token the post-processor added), so a caller can see what text no token covers
    /// without encoding twice.
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<u32>, Vec<ByteSpan>)> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(TextError::tk("encoding text"))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// Text of `ids`, special tokens skipped or kept. An id the tokenizer has no token for is
    /// skipped, as HF `tokenizers` (and so transformers) skips it: a model whose vocabulary
    /// is padded past the tokenizer (151,936 rows for Qwen3's 151,669 tokens) can sample such
    /// an id, which has no text. Once [`Self::fit_model`] has recorded the model's
    /// vocabulary, an id at or past it is an error, since no model could have produced it;
    /// without it every unknown id is skipped.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(size) = self.model_vocab {
            if let Some(&id) = ids.iter().find(|&&id| id as usize >= size) {
                return Err(TextError::UnknownTokenId { id, size });
            }
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(TextError::tk("decoding ids"))
    }

    /// Id of the bos token, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Eos ids: the tokenizer's eos token first, then those of `generation_config.json` and
    /// `config.json`.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Id of the padding token, if the model has one.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// Ids that end generation: the eos ids and any added with [`Self::add_stop_ids`].
    pub fn stop_token_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// The ids of the [`ADDITIONAL_STOP_TOKEN_TEXTS`] this tokenizer has as added tokens (a
    /// plain vocabulary entry of the same text does not count, as in SGLang).
    pub fn additional_stop_ids(&self) -> Vec<u32> {
        let added = self.inner.get_added_vocabulary().get_vocab();
        ADDITIONAL_STOP_TOKEN_TEXTS
            .iter()
            .filter_map(|text| added.get(*text).copied())
            .collect()
    }

    /// The vocabulary string of one id (`None` outside the vocabulary).
    pub fn token_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of one vocabulary string.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of tokens, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Checks that this tokenizer fits a model whose vocabulary is `model_vocab` ids: it may
    /// not produce an id the model cannot embed (more tokens than the model), and the model
    /// may not produce ids it cannot decode (fewer tokens), unless the model's vocabulary is
    /// padded to a multiple of [`VOCAB_PADDING`] as HF checkpoints pad theirs for matrix
    /// tiling (e.g. 151,936 rows for a 151,669-token tokenizer). The one check every command
    /// that reads a model directory with a tokenizer applies.
    pub fn check_fits_model(&self, model_vocab: usize) -> Result<()> {
        let tokens = self.vocab_size();
        let consequence = if tokens > model_vocab {
            format!(
                "the tokenizer makes ids up to {} that the model cannot embed",
                tokens - 1
            )
        } else if tokens < model_vocab && !model_vocab.is_multiple_of(VOCAB_PADDING) {
            format!(
                "the model can produce ids {tokens}..{} that the tokenizer cannot decode",
                model_vocab - 1
            )
        } else {
            return Ok(());
        };
        Err(TextError::VocabularyMismatch {
            tokenizer: tokens,
            model: model_vocab,
            consequence,
        })
    }

    /// [`Self::check_fits_model`], then records `model_vocab` so that [`Self::decode`] refuses
    /// ids at or past it (and still skips the padded ids the tokenizer has no token for).
    pub fn fit_model(&mut self, model_vocab: usize) -> Result<()> {
        self.check_fits_model(model_vocab)?;
        self.model_vocab = Some(model_vocab);
        Ok(())
    }

    /// The model vocabulary [`Self::fit_model`] recorded, if any.
    pub fn model_vocab(&self) -> Option<usize> {
        self.model_vocab
    }

    /// The special tokens as the config declares them.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }
}
