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
    /// A dataset row that does not fit verl's schema.
    #[error("{}: row {row}: field `{field}`: {reason}", path.display())]
    DatasetRow {
        /// The dataset file.
        path: PathBuf,
        /// 0-based row index in the file.
        row: usize,
        /// The field (dotted path, e.g. `reward_model.ground_truth`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A dataset line or record that cannot be decoded at all.
    #[error("{}: row {row} (line {line}): {reason}", path.display())]
    DatasetLine {
        /// The dataset file.
        path: PathBuf,
        /// 0-based row index in the file.
        row: usize,
        /// 1-based line (JSONL) or record (Parquet) number.
        line: usize,
        /// The decoder's complaint.
        reason: String,
    },
    /// A dataset file that cannot be read as a whole.
    #[error("dataset {}: {reason}", path.display())]
    DatasetRead {
        /// The dataset file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A reward that could not score a row (bad ground truth, a verifier's bad answer).
    #[error("reward: batch row {row}: {reason}")]
    RewardRow {
        /// 0-based row of the scored batch.
        row: usize,
        /// What went wrong.
        reason: String,
    },
    /// An external verifier that failed as a whole (cannot start, crashed, timed out).
    #[error("reward command `{command}`: {reason}")]
    RewardCommand {
        /// The command line.
        command: String,
        /// What went wrong.
        reason: String,
    },
    /// A batch request with zero rows.
    #[error("batch_size must be at least 1")]
    EmptyBatch,
}

/// Result alias for r3-tasks.
pub type Result<T> = std::result::Result<T, TaskError>;
