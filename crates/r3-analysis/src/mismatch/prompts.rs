//! Prompts for the analysis: arithmetic problems from r3-tasks when the model directory has
//! r3's character tokenizer, otherwise random token prompts. Both are drawn from a seeded RNG.

use std::path::Path;

use r3_tasks::{CharTokenizer, Difficulty, Problem};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::AnalysisError;

/// Shortest random prompt, in tokens.
const RANDOM_MIN_LEN: usize = 8;
/// Longest random prompt, in tokens.
const RANDOM_MAX_LEN: usize = 24;

/// Where the prompts came from (recorded in summary.json).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PromptSource {
    /// Arithmetic problems from r3-tasks, encoded with the model's `tokenizer.json`.
    Arithmetic {
        /// Difficulty level (r3-tasks preset).
        level: u32,
    },
    /// Uniformly random token ids (the model directory has no r3 tokenizer).
    RandomTokens {
        /// Shortest prompt.
        min_len: usize,
        /// Longest prompt.
        max_len: usize,
        /// Ids are drawn from `0..vocab`.
        vocab: usize,
    },
}

/// Seeded prompts and their source.
#[derive(Debug, Clone)]
pub struct Prompts {
    /// Token ids of each prompt.
    pub ids: Vec<Vec<u32>>,
    /// How they were made.
    pub source: PromptSource,
}

/// Builds `n` prompts for the model in `model_dir` (vocabulary `vocab`) from `seed`.
pub fn build_prompts(
    model_dir: &Path,
    vocab: usize,
    n: usize,
    level: u32,
    seed: u64,
) -> Result<Prompts, AnalysisError> {
    if n == 0 {
        return Err(AnalysisError::Invalid(
            "--prompts must be at least 1".into(),
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let tokenizer_path = model_dir.join("tokenizer.json");
    let tokenizer = if tokenizer_path.is_file() {
        match CharTokenizer::from_file(&tokenizer_path) {
            Ok(t) if t.vocab_size() <= vocab => Some(t),
            Ok(t) => {
                tracing::warn!(
                    tokenizer = t.vocab_size(),
                    model = vocab,
                    "tokenizer.json is larger than the model's vocabulary; using random prompts"
                );
                None
            }
            Err(e) => {
                tracing::info!(reason = %e, "tokenizer.json is not r3's; using random prompts");
                None
            }
        }
    } else {
        None
    };
    match tokenizer {
        Some(tok) => {
            let difficulty = Difficulty::level(level)?;
            let ids = (0..n)
                .map(|_| {
                    let p = Problem::generate(&difficulty, &mut rng)?;
                    tok.encode_prompt(&p.prompt)
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Prompts {
                ids,
                source: PromptSource::Arithmetic { level },
            })
        }
        None => {
            if vocab == 0 {
                return Err(AnalysisError::Invalid(
                    "the model has an empty vocabulary".into(),
                ));
            }
            let hi = u32::try_from(vocab).map_err(|_| {
                AnalysisError::Invalid(format!("vocabulary of {vocab} does not fit token ids"))
            })?;
            let ids = (0..n)
                .map(|_| {
                    let len = rng.random_range(RANDOM_MIN_LEN..=RANDOM_MAX_LEN);
                    (0..len).map(|_| rng.random_range(0..hi)).collect()
                })
                .collect();
            Ok(Prompts {
                ids,
                source: PromptSource::RandomTokens {
                    min_len: RANDOM_MIN_LEN,
                    max_len: RANDOM_MAX_LEN,
                    vocab,
                },
            })
        }
    }
}
