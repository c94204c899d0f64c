//! The RL algorithm as tensor math, each piece a pure function of its arguments: token
//! log-probs and entropy, GRPO advantages and dynamic sampling, the policy losses (PPO
//! clip-higher, GSPO) with rollout importance sampling and loss aggregation, AdamW with
//! gradient clipping and an LR schedule, and the NaN-guarded update that applies them.

pub mod advantage;
pub mod agg;
pub(crate) mod fused_optim;
pub mod grad_clip;
pub mod logprob;
pub mod loss;
pub mod optim;
pub mod rollout_is;
pub mod schedule;
pub mod update;
