//! Shared fixtures of the RL-loop tests: a tiny random Qwen3-MoE-style model written to
//! a scratch directory in HF layout, and a tiny run config around it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use candle_core::Device;
use r3_model::{Config, RandomInit, Weights};
use r3_tasks::CharTokenizer;
use r3_train::config::{RouterReplay, TrainConfig};
use r3_train::pretrain::config::PretrainConfig;
use r3_train::pretrain::shape::ModelShape;

/// A scratch directory removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("r3-train-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Scratch(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes a tiny random model (2 MoE layers, 4 experts, top-2) into `dir`.
pub fn tiny_model(dir: &Path, seed: u64) -> Config {
    let shape = ModelShape {
        hidden_size: 32,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 16,
        num_experts: 4,
        num_experts_per_tok: 2,
        moe_intermediate_size: 32,
        max_position_embeddings: 64,
        rope_theta: 10000.0,
        init_std: 0.1,
        router_init_std: 0.3,
        ..ModelShape::default()
    };
    let pcfg = PretrainConfig {
        model: shape,
        ..PretrainConfig::default()
    };
    let tokenizer = CharTokenizer::new().expect("tokenizer");
    let cfg = Config::from_value(pcfg.hf_config(tokenizer.vocab_size())).expect("config");
    // A weak router (small logits) sits near ties, so f16 rollouts and the f32 trainer
    // disagree on some routes: replay then has something to do.
    let init = RandomInit {
        router_std: 0.02,
        ..RandomInit::new(seed)
    };
    let weights = Weights::random(&cfg, &init, &Device::Cpu).expect("weights");
    weights.save(dir, &cfg).expect("save model");
    tokenizer
        .save(&dir.join("tokenizer.json"))
        .expect("save tokenizer");
    cfg
}

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
