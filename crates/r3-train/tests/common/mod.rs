//! Shared fixtures of the RL-loop tests: the workspace's tiny random model and scratch
//! directory (r3-test-support), and a tiny run config around them.

#![allow(dead_code)]

use std::path::Path;

#[allow(unused_imports)]
pub use r3_test_support::{tiny_model, tiny_tied_model, Scratch};
use r3_train::config::{RouterReplay, TrainConfig};

/// A run config small enough for a test: 2 prompts × 2 samples, 6 new tokens.
pub fn tiny_config(
    model_dir: &Path,
    run_dir: &Path,
    mode: RouterReplay,
    mini_batches: usize,
) -> TrainConfig {
    let mut cfg = TrainConfig {
        model_dir: model_dir.to_path_buf(),
        run_dir: run_dir.to_path_buf(),
        steps: 2,
        seed: 7,
        ..TrainConfig::default()
    };
    cfg.task.difficulty = 1;
    cfg.rollout.prompts_per_step = 2;
    cfg.rollout.group_size = 2;
    cfg.rollout.max_new_tokens = 6;
    cfg.algo.router_replay = mode;
    cfg.algo.mini_batches = mini_batches;
    cfg.algo.dynamic_sampling = false;
    // A random model's rewards are mostly equal, so advantages are mostly zero; the
    // entropy bonus makes every update move the weights all the same.
    cfg.task.format_reward = 0.5;
    cfg.algo.entropy_coef = 0.05;
    cfg.optim.lr = 1e-2;
    cfg.optim.warmup_steps = 0;
    cfg.eval.every = 1;
    cfg.eval.size = 4;
    cfg.checkpoint.every = 1;
    cfg.checkpoint.keep_last = 0;
    cfg.validate().expect("valid tiny config");
    cfg
}
