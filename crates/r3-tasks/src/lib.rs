//! Verifiable tasks for r3: a seeded arithmetic problem generator with worked solutions,
//! answer extraction and exact-match reward, a held-out eval set, the character-level
//! tokenizer (HF `tokenizer.json`), supervised batches for pretraining, and user datasets
//! (verl's RL schema, JSONL / Parquet) with their rewards (math, exact, arith, an external
//! command, weighted sums), and the estimators that summarise an evaluation (`mean@k`,
//! `pass@k`, `maj@k`, paired differences, with their uncertainty).
//!
//! Text format (see [`problem`]): prompt `12+7*3=`, target `7*3=21;12+21=33#33`; a model
//! sees `<bos>` + prompt and should write the target then `<eos>`.

pub mod dataset;
pub mod difficulty;
pub mod error;
pub mod estimators;
pub mod math_answer;
pub mod problem;
pub mod reward;
pub mod supervised;
pub mod task;
pub mod tokenizer;
pub mod word_problems;

pub use dataset::{
    ground_truth_text, load_dataset, load_dataset_for, ChatMessage, DatasetCursor, DatasetPosition,
    DatasetRow, GroundTruthUse, Prompt,
};
pub use difficulty::{Difficulty, Op, MAX_LEVEL};
pub use error::{Result, TaskError};
pub use math_answer::{extract_math_answer, math_equal, parse_number, AnswerSource, Rational};
pub use problem::{Expression, Problem, Step};
pub use reward::{
    extract_answer, judge, CommandReward, Reward, RewardConfig, RewardFuncSpec, RewardInput,
    RewardKind, RewardScore, RewardSpec, Verdict,
};
pub use supervised::{LossOn, SupervisedBatch, SupervisedBatches};
pub use task::{ArithmeticTask, TrainStream};
pub use tokenizer::{CharTokenizer, ALPHABET, BOS_ID, EOS_ID, PAD_ID};
pub use word_problems::{gsm8k_style_splits, WordProblem};
