//! Helpers the workspace's integration tests share, used only as a dev-dependency and never
//! published: [`Scratch`], a temporary directory removed on drop, and (feature `model`)
//! `tiny_model`, the tiny random Qwen3-MoE model the RL-loop tests train.

mod scratch;
#[cfg(feature = "model")]
mod tiny_model;

pub use scratch::Scratch;
#[cfg(feature = "model")]
pub use tiny_model::tiny_model;
