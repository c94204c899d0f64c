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
pub mod config_limits;
pub mod error;
pub mod grad_clip;
pub mod logprob;
pub mod loss;
pub mod optim;
pub mod overrides;
pub mod precision;
pub mod rollout_is;
pub mod schedule;
pub mod update;

// The RL loop and pretraining (trainer helper).
pub mod checkpoint;
pub mod collapse;
pub mod diagnostics;
pub mod evaluation;
pub mod expert_balance;
pub mod fleet_sync;
pub mod manifest;
pub mod metrics_log;
pub mod minibatch;
pub mod model_text;
pub mod policy;
pub mod pretrain;
pub mod pretrain_config;
pub mod pretrain_corpus;
pub mod pretrain_deepseek;
pub mod prompt_source;
pub mod rl_loop;
pub mod rollout;
pub mod rollout_ahead;
pub mod step;
pub mod trainer;

pub use advantage::{
    filter_uniform_groups, grpo_advantages, AdvantageMetrics, GroupFilter, GrpoOptions,
};
pub use agg::{aggregate, LossAgg};
pub use config::{RouterReplay, TrainConfig};
pub use error::{Result, TrainError};
pub use grad_clip::{clip_grad_norm, global_grad_norm, GradNorm};
pub use logprob::{entropy_from_logits, masked_mean, token_log_probs};
pub use loss::{
    gspo_loss, policy_loss, ppo_clip_loss, ClipRange, PolicyLossInput, PolicyLossKind,
    PolicyLossMetrics,
};
pub use metrics_log::StepMetrics;
pub use model_text::ModelText;
pub use optim::{decay_matrices_only, AdamW, AdamWParams, AdamWStep};
pub use policy::{ResponseBatch, TrainablePolicy};
pub use pretrain::{pretrain, PretrainEvent, PretrainReport};
pub use pretrain_config::PretrainConfig;
pub use rl_loop::{Observer, Quiet, Run, RunSummary};
pub use rollout_is::{rollout_is_weights, IsConfig, IsLevel, IsMetrics, IsMode, IsWeights};
pub use schedule::{LrDecay, LrSchedule};
pub use trainer::Trainer;
pub use update::{
    backward_and_step, backward_and_step_with, guarded_step, guarded_step_with, GradHook,
    SkipReason, UpdateOutcome,
};
