//! The `r3 pretrain` configuration (TOML, every field defaulted): the run, the corpus and
//! its tokenizer, and the model's shape (`shape`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::limits::{in_range, refuse_greedy_band, MAX_TEMPERATURE};
use crate::config::overrides::{apply_overrides, merge_known};
use crate::error::{Result, TrainError};
use crate::pretrain::deepseek::PretrainArchitecture;
use crate::pretrain::shape::ModelShape;

/// The whole pretraining run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PretrainConfig {
    /// Seed of the init and of the problem streams. Default 0.
    pub seed: u64,
    /// Where the checkpoint is written (HF layout). Default `models/arith-moe`.
    pub out_dir: PathBuf,
    /// Optimiser steps. Default 450.
    pub steps: u64,
    /// Sequences per step. Default 64.
    pub batch_size: usize,
    /// Peak learning rate. Default 3e-3.
    pub lr: f64,
    /// Linear warm-up steps. Default 100.
    pub warmup_steps: u64,
    /// Final LR of the cosine decay as a fraction of the peak. Default 0.1.
    pub min_lr_ratio: f64,
    /// AdamW decoupled weight decay on matrices. Default 0.01.
    pub weight_decay: f64,
    /// Global gradient-norm clip. Default 1.0.
    pub grad_clip: f64,
    /// Difficulty levels of the training mixture (one level per batch, in turn). Default [1, 2].
    pub difficulties: Vec<u32>,
    /// Difficulty of the held-out evaluation (the RL difficulty). Default 2.
    pub eval_difficulty: u32,
    /// Evaluate every N steps (and at the end); 0 = only at the end. Default 150.
    pub eval_every: u64,
    /// Held-out problems (same set as `r3 train`'s eval with equal size and seed). Default 200.
    pub eval_size: usize,
    /// Seed of the held-out set. Default 1234.
    pub eval_seed: u64,
    /// Tokens generated per eval answer at most. Default 40.
    pub max_new_tokens: usize,
    /// Log the loss every N steps. Default 50.
    pub log_every: u64,
    /// The model to train.
    pub model: ModelShape,
    /// What the model learns from. Default `arithmetic`.
    pub corpus: Corpus,
    /// The tokenizer written with the model (`[tokenizer]`).
    pub tokenizer: TokenizerSpec,
    /// The word-problem corpus (`[word_problems]`; used when `corpus = "word_problems"`).
    pub word_problems: WordProblemCorpus,
}

/// The pretraining corpus.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Corpus {
    /// Worked arithmetic solutions of the built-in task (character tokenizer).
    #[default]
    Arithmetic,
    /// GSM8K-format word problems of r3-tasks: the question rendered with the chat template
    /// as the RL prompt will be, then the worked answer and `<|im_end|>`.
    WordProblems,
}

/// Which tokenizer the model gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    /// r3's 23-token character tokenizer (arithmetic only).
    #[default]
    Char,
    /// A byte-level BPE trained on the corpus, with a ChatML chat template.
    Bpe,
}

/// The `[tokenizer]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizerSpec {
    /// `char` or `bpe`. Default `char`.
    pub kind: TokenizerKind,
    /// BPE vocabulary size (256 bytes + special tokens + merges). Default 512.
    pub vocab_size: usize,
    /// A pair must occur this often to be merged. Default 2.
    pub min_frequency: u64,
    /// Corpus texts the BPE is trained on. Default 4000.
    pub train_texts: usize,
}

/// The `[word_problems]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WordProblemCorpus {
    /// Datasets (verl schema) whose questions never enter the corpus: the RL validation
    /// files, so the held-out accuracy measures problems the model never saw. Default empty.
    pub exclude_files: Vec<PathBuf>,
    /// Held-out prompts evaluated during pretraining (verl schema, `math` reward). Default
    /// empty (no evaluation).
    pub eval_files: Vec<PathBuf>,
    /// Sampling temperature of those evaluations (0 = greedy, else in [1e-6, 100], as
    /// `eval.temperature`). Default 1.0.
    pub eval_temperature: f64,
    /// System prompt of the chat template (as `data.system_prompt` of the RL run). Default "".
    pub system_prompt: String,
}

impl Default for TokenizerSpec {
    fn default() -> Self {
        Self {
            kind: TokenizerKind::Char,
            vocab_size: 512,
            min_frequency: 2,
            train_texts: 4000,
        }
    }
}

impl Default for WordProblemCorpus {
    fn default() -> Self {
        Self {
            exclude_files: Vec::new(),
            eval_files: Vec::new(),
            eval_temperature: 1.0,
            system_prompt: String::new(),
        }
    }
}

impl Default for PretrainConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            out_dir: PathBuf::from("models/arith-moe"),
            steps: 450,
            batch_size: 64,
            lr: 3e-3,
            warmup_steps: 100,
            min_lr_ratio: 0.1,
            weight_decay: 0.01,
            grad_clip: 1.0,
            difficulties: vec![1, 2],
            eval_difficulty: 2,
            eval_every: 150,
            eval_size: 200,
            eval_seed: 1234,
            // configs/pretrain.toml's value: `r3 pretrain` without `--config` runs its recipe.
            max_new_tokens: 40,
            log_every: 50,
            model: ModelShape::default(),
            corpus: Corpus::Arithmetic,
            tokenizer: TokenizerSpec::default(),
            word_problems: WordProblemCorpus::default(),
        }
    }
}

impl PretrainConfig {
    /// Defaults ← TOML file (optional) ← `key=value` overrides, then validation.
    pub fn resolve(file: Option<&Path>, overrides: &[String]) -> Result<Self> {
        let mut value =
            toml::Value::try_from(Self::default()).map_err(TrainError::config_serialize)?;
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(TrainError::io(path))?;
            let incoming: toml::Value = toml::from_str(&text)
                .map_err(TrainError::config_parse(path.display().to_string()))?;
            merge_known(&mut value, incoming, "")?;
        }
        apply_overrides(&mut value, overrides)?;
        let cfg: Self = value
            .try_into()
            .map_err(TrainError::config_parse("pretrain values"))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks values that are well-typed but meaningless.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| {
            Err(TrainError::InvalidConfig {
                field: "pretrain",
                reason,
            })
        };
        let m = &self.model;
        if self.steps == 0 || self.batch_size == 0 {
            return bad("steps and batch_size must be >= 1".into());
        }
        if self.difficulties.is_empty() {
            return bad("difficulties is empty".into());
        }
        if self.lr.is_nan() || self.lr <= 0.0 {
            return bad(format!("lr {} must be > 0", self.lr));
        }
        if m.num_attention_heads == 0
            || m.num_key_value_heads == 0
            || !m.num_attention_heads.is_multiple_of(m.num_key_value_heads)
        {
            return bad(
                "num_attention_heads must be a positive multiple of num_key_value_heads".into(),
            );
        }
        if m.num_experts_per_tok == 0 || m.num_experts_per_tok > m.num_experts {
            return bad(format!(
                "num_experts_per_tok {} must be in 1..={}",
                m.num_experts_per_tok, m.num_experts
            ));
        }
        if m.architecture == PretrainArchitecture::DeepseekV3 {
            m.deepseek
                .validate(m.num_experts, m.num_experts_per_tok, m.num_hidden_layers)
                .or_else(bad)?;
        }
        self.validate_corpus()
    }

    /// Checks that the corpus and the tokenizer go together, and the word problems'
    /// evaluation temperature.
    fn validate_corpus(&self) -> Result<()> {
        let bad =
            |field: &'static str, reason: String| Err(TrainError::InvalidConfig { field, reason });
        match (self.corpus, self.tokenizer.kind) {
            (Corpus::WordProblems, TokenizerKind::Char) => bad(
                "tokenizer.kind",
                "the character tokenizer cannot spell word problems; set kind = \"bpe\"".into(),
            ),
            (Corpus::Arithmetic, TokenizerKind::Bpe) => bad(
                "tokenizer.kind",
                "the arithmetic corpus uses the character tokenizer; set kind = \"char\"".into(),
            ),
            (Corpus::WordProblems, TokenizerKind::Bpe) if self.tokenizer.train_texts == 0 => {
                bad("tokenizer.train_texts", "must be >= 1".into())
            }
            _ => Ok(()),
        }?;
        // Checked as the RL run's `eval.temperature` is: finite in [0, MAX_TEMPERATURE], and
        // not in (0, 1e-6), where the engines sample greedily (SGLang's rule) while the
        // value says otherwise. Checked here, not at the first evaluation after training.
        let t = self.word_problems.eval_temperature;
        in_range(
            "word_problems.eval_temperature",
            t,
            0.0,
            false,
            MAX_TEMPERATURE,
        )?;
        refuse_greedy_band("word_problems.eval_temperature", t)
    }

    /// The HF `config.json` of the model for a vocabulary of `vocab_size` tokens.
    pub fn hf_config(&self, vocab_size: usize) -> serde_json::Value {
        self.model.hf_config(vocab_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `r3 pretrain` without `--config` runs "the documented values of
    /// configs/pretrain.toml": the defaults are that file resolved, field by field (paths
    /// masked), so a value changed in one and not the other fails here.
    #[test]
    fn defaults_are_the_shipped_pretrain_toml() {
        let toml = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/pretrain.toml");
        let mut shipped = PretrainConfig::resolve(Some(&toml), &[]).expect("configs/pretrain.toml");
        let mut defaults = PretrainConfig::default();
        for cfg in [&mut shipped, &mut defaults] {
            cfg.out_dir = PathBuf::new();
        }
        let as_toml = |c: &PretrainConfig| toml::to_string(c).expect("serialize");
        assert_eq!(as_toml(&defaults), as_toml(&shipped));
        assert_eq!(defaults, shipped);
    }

    /// `word_problems.eval_temperature` is checked as `eval.temperature`: 0 (greedy) and
    /// [1e-6, 100] pass; 5e-7 (greedy in the engines, SGLang's rule, without saying so), a
    /// negative, NaN or infinite value and 101 are refused naming the field at resolve time
    /// (before, nothing looked at it until the first evaluation, after training steps).
    #[test]
    fn the_word_problems_eval_temperature_is_checked() {
        let at = |t: &str| {
            PretrainConfig::resolve(None, &[format!("word_problems.eval_temperature={t}")])
        };
        for ok in ["0.0", "1e-6", "0.7", "100.0"] {
            assert!(at(ok).is_ok(), "{ok}");
        }
        for bad in ["5e-7", "-0.5", "nan", "inf", "101.0"] {
            match at(bad) {
                Err(TrainError::InvalidConfig { field, .. }) => {
                    assert_eq!(field, "word_problems.eval_temperature", "{bad}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }
}
