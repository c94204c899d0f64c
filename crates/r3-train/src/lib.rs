//! The r3 training engine's pure pieces: token log-probs and entropy from logits, GRPO
//! advantages and dynamic sampling, policy losses (PPO clip-higher, GSPO) with TIS/MIS
//! correction and loss aggregation, AdamW with gradient clipping and an LR schedule, a
//! NaN-guarded update, and the `r3 train` configuration.
//!
//! Everything here works on f32 candle tensors with composed (autograd-safe) ops and
//! takes what it needs as arguments; the RL loop composes these with the model and the
//! rollout engine.

pub mod advantage;
pub mod agg;
pub mod config;
pub mod error;
pub mod grad_clip;
pub mod logprob;
pub mod loss;
pub mod optim;
pub mod overrides;
pub mod rollout_is;
pub mod schedule;
pub mod update;

pub use advantage::{
    filter_uniform_groups, grpo_advantages, AdvantageMetrics, GroupFilter, GrpoOptions,
};
pub use agg::{aggregate, LossAgg};
pub use config::{RouterReplay, TrainConfig};
pub use error::{Result, TrainError};
pub use grad_clip::{clip_grad_norm, global_grad_norm, GradNorm};
pub use logprob::{entropy_from_logits, log_softmax_last, masked_mean, token_log_probs};
pub use loss::{
    gspo_loss, policy_loss, ppo_clip_loss, ClipRange, PolicyLossInput, PolicyLossKind,
    PolicyLossMetrics,
};
pub use optim::{decay_matrices_only, AdamW, AdamWParams};
pub use rollout_is::{rollout_is_weights, IsConfig, IsLevel, IsMetrics, IsMode, IsWeights};
pub use schedule::{LrDecay, LrSchedule};
pub use update::{backward_and_step, guarded_step, SkipReason, UpdateOutcome};
