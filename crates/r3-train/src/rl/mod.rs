//! The RL loop around the algorithm, from the run down:
//! - the run (`run`): steps, evaluations, metrics lines (`metrics_log`), the collapse
//!   watch (`collapse`), checkpoints with their manifest and resume (`checkpoint`,
//!   `manifest`);
//! - the trainer and one step (`trainer`): the step's batch and context (`step`), its
//!   updates under the replay mode (`updates`, `minibatch` in token-budgeted
//!   `micro_batches`, `diagnostics`), its metrics
//!   line (`step_metrics`) with the memory high-water mark (`memory`);
//! - the rollout side: the seeds of its draws (`seed`), the prompts (`prompt_source`),
//!   sampling and scoring them (`sampling`), held-out evaluation with k samples per prompt
//!   (`evaluation`), the backend that generates them (`backend`): the in-process engine or
//!   a fleet with its weight sync (`fleet`) and one-step-ahead generation (`ahead`), and
//!   the groups dropped for a fleet request that failed for its own fault
//!   (`failed_groups`).

pub mod ahead;
pub mod backend;
pub mod checkpoint;
pub mod collapse;
pub mod diagnostics;
pub mod evaluation;
pub mod failed_groups;
pub mod fleet;
pub mod manifest;
pub mod memory;
pub mod metrics_log;
pub mod micro_batches;
pub mod minibatch;
pub mod prompt_source;
pub mod refill;
pub mod run;
pub mod sampling;
pub mod seed;
pub mod step;
pub mod step_metrics;
pub mod trainer;
pub mod updates;
