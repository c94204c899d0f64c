//! [`tiny_model`]: the smallest model the RL loop runs end to end, written as a model
//! directory the way `r3 pretrain` writes one (HF `config.json`, safetensors, the character
//! tokenizer's `tokenizer.json`); [`tiny_tied_model`] the same with the head tied to the
//! embedding.

use std::path::Path;

use candle_core::Device;
use r3_model::{Config, RandomInit, Weights};
use r3_tasks::{CharTokenizer, BOS_ID, EOS_ID, PAD_ID};

/// Writes a tiny random Qwen3-MoE model into `dir`: 2 MoE layers of 4 experts (top-2, width
/// 32), hidden 32, 2 query heads and 1 KV head of width 16, 64 positions, with r3's
/// character tokenizer; returns its config.
///
/// The router is weak (init std 0.02): small logits sit near ties, so f16 rollouts and the
/// f32 trainer disagree on some routes and replay has something to do.
///
/// # Panics
/// When the model cannot be built or written: a test cannot run without it.
pub fn tiny_model(dir: &Path, seed: u64) -> Config {
    write_tiny_model(dir, seed, false)
}

/// [`tiny_model`] with `tie_word_embeddings`: the head reads the embedding table, whose
/// gradient then has two parts (the head's and the lookup's).
///
/// # Panics
/// As [`tiny_model`].
pub fn tiny_tied_model(dir: &Path, seed: u64) -> Config {
    write_tiny_model(dir, seed, true)
}

fn write_tiny_model(dir: &Path, seed: u64, tied: bool) -> Config {
    let tokenizer = CharTokenizer::new().expect("tokenizer");
    let cfg = Config::from_value(serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": tokenizer.vocab_size(),
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": true,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32"
    }))
    .expect("tiny config");
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
