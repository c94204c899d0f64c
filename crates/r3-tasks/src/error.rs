//! The error type of r3-tasks: every way a task, tokenizer or batch request can be wrong.

use std::path::PathBuf;

/// Everything that can go wrong while generating problems, tokenizing or batching.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// A difficulty preset number outside the known range.
    #[error("difficulty level {level} does not exist (levels are 1..={max})")]
    UnknownLevel {
        /// The level asked for.
        level: u32,
        /// The highest level that exists.
        max: u32,
    },
    /// A hand-written difficulty whose fields contradict each other.
    #[error("invalid difficulty: {0}")]
    InvalidDifficulty(String),
    /// The problem space is too small to draw the requested number of distinct eval problems.
    #[error(
        "drew only {got} distinct eval problems of the {wanted} asked for in {attempts} draws; \
         lower eval_size or raise the difficulty"
    )]
    EvalSetTooLarge {
        /// Eval problems asked for.
        wanted: usize,
        /// Distinct eval problems found.
        got: usize,
        /// Draws made before giving up.
        attempts: usize,
    },
    /// Every recent training draw landed in the held-out eval set.
    #[error("{attempts} training draws in a row were all eval problems; the eval set covers the problem space")]
    TrainSpaceExhausted {
        /// Consecutive draws rejected.
        attempts: usize,
    },
    /// Text holds a character outside the tokenizer's alphabet.
    #[error("character {ch:?} at char index {index} of {text:?} is not in the tokenizer alphabet {alphabet:?}")]
    UnknownChar {
        /// The offending character.
        ch: char,
        /// Its char index in the text.
        index: usize,
        /// The text being encoded.
        text: String,
        /// The characters that are allowed.
        alphabet: &'static str,
    },
    /// A token id the vocabulary does not have.
    #[error("token id {id} is outside the vocabulary (size {size})")]
    UnknownTokenId {
        /// The id.
        id: u32,
        /// Vocabulary size.
        size: usize,
    },
    /// A tokenizer.json that cannot be read or parsed.
    #[error("tokenizer {path}: {source}")]
    TokenizerRead {
        /// File that was read.
        path: PathBuf,
        /// Why the `tokenizers` crate refused it.
        #[source]
        source: tokenizers::Error,
    },
    /// A loaded tokenizer.json that is not the r3 character tokenizer.
    #[error("tokenizer {path}: {reason}")]
    TokenizerMismatch {
        /// File that was loaded.
        path: PathBuf,
        /// What differs from the expected vocabulary.
        reason: String,
    },
    /// An error reported by the `tokenizers` crate while building or saving the tokenizer.
    #[error("tokenizers: {action}: {source}")]
    Tokenizers {
        /// What was being done (`building the BPE model`, `saving tokenizer.json`, ...).
        action: &'static str,
        /// The crate's error.
        #[source]
        source: tokenizers::Error,
    },
    /// A file operation that failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A training sequence longer than the fixed batch length.
    #[error("sequence of {len} tokens does not fit seq_len {seq_len} (problem {prompt:?})")]
    SequenceTooLong {
        /// Tokens in the sequence (inputs, i.e. full sequence minus one).
        len: usize,
        /// The fixed length asked for.
        seq_len: usize,
        /// The prompt of the offending problem.
        prompt: String,
    },
    /// A batch request with zero rows.
    #[error("batch_size must be at least 1")]
    EmptyBatch,
}

/// Result alias for r3-tasks.
pub type Result<T> = std::result::Result<T, TaskError>;
