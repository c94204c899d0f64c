//! Helpers the workspace's integration tests share, used only as a dev-dependency and never
//! published: [`Scratch`], a temporary directory removed on drop, [`exact_logprob`], the f64
//! log-prob engines' log-probs are held against, (feature `tensors`) `bits`,
//! a tensor's values as bit patterns for bit-for-bit comparisons, and (feature `model`)
//! `tiny_model`, the tiny random Qwen3-MoE model the RL-loop tests train (`tiny_tied_model`
//! with its head tied to the embedding).

mod exact_logprob;
mod scratch;
#[cfg(feature = "tensors")]
mod tensor_bits;
#[cfg(feature = "model")]
mod tiny_model;

pub use exact_logprob::exact_logprob;
pub use scratch::Scratch;
#[cfg(feature = "tensors")]
pub use tensor_bits::bits;
#[cfg(feature = "model")]
pub use tiny_model::{tiny_model, tiny_tied_model};
