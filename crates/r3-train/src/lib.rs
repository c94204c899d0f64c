//! r3's training engine: the RL algorithm that learns from rollouts with router replay
//! (R3, R2 or none), the loop that drives it against a rollout engine or fleet, and the
//! supervised pretraining that makes the base models.
//!
//! The folders are the spine, each standing on the ones before it:
//! - [`error`]: the crate's error type.
//! - [`algo`]: the algorithm as pure tensor math (log-probs, GRPO advantages, PPO/GSPO
//!   losses with rollout importance sampling, AdamW, clipping, LR schedule, the guarded
//!   update), f32 candle tensors with composed (autograd-safe) ops.
//! - [`policy`]: the model being trained, its precision and its tokenizer.
//! - [`config`]: the `r3 train` configuration (TOML, `--set` overrides, checks).
//! - [`rl`]: the RL loop: sample a step's rollouts, score them, update the policy, sync
//!   the weights to the rollout side, log metrics, checkpoint and resume.
//! - [`pretrain`](mod@pretrain): `r3 pretrain`, supervised next-token training of the base models.

pub mod algo;
pub mod config;
pub mod error;
pub mod policy;
pub mod pretrain;
pub mod rl;

pub use algo::advantage::{
    filter_uniform_groups, grpo_advantages, AdvantageMetrics, GroupFilter, GrpoOptions,
};
pub use algo::agg::{aggregate, LossAgg};
pub use algo::grad_clip::{
    clip_grad_norm, global_grad_norm, global_grad_norm_composed, measure_grad_norm, scale_grads,
    GradNorm,
};
pub use algo::logprob::{entropy_from_logits, masked_mean, token_log_probs};
pub use algo::loss::{
    gspo_loss, policy_loss, ppo_clip_loss, ClipRange, PolicyLossInput, PolicyLossKind,
    PolicyLossMetrics,
};
pub use algo::optim::{
    adamw_constants, decay_matrices_only, AdamW, AdamWKernel, AdamWParams, AdamWStep, UpdateAt,
    UpdateStaging,
};
pub use algo::rollout_is::{rollout_is_weights, IsConfig, IsLevel, IsMetrics, IsMode, IsWeights};
pub use algo::schedule::{LrDecay, LrSchedule};
pub use algo::update::{
    backward_and_step, backward_and_step_timed, backward_and_step_with, guarded_step,
    guarded_step_timed, guarded_step_with, GradHook, SkipReason, UpdateOutcome, UpdateTimes,
};
pub use config::{RouterReplay, TrainConfig};
pub use error::{Result, StepPhase, TrainError};
pub use policy::model_text::ModelText;
pub use policy::{ResponseBatch, TrainablePolicy};
pub use pretrain::config::PretrainConfig;
pub use pretrain::run::{pretrain, PretrainEvent, PretrainReport};
pub use rl::metrics_log::StepMetrics;
pub use rl::run::{Observer, Quiet, Run, RunSummary};
pub use rl::trainer::Trainer;
