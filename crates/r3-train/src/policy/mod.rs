//! The model being trained: its f32 variables with scoring under a routing mode
//! (`trainable`), its training precision (`precision`), and its tokenizer and chat
//! template (`model_text`).

pub mod model_text;
pub mod precision;
pub mod trainable;

pub use trainable::{score, score_with, ResponseBatch, ScoreOptions, Scored, TrainablePolicy};
