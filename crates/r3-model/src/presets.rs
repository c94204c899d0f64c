//! Named configs used by benchmarks and examples.

use crate::config::Config;
use crate::error::Result;

/// The documented mid-size training benchmark model: Qwen3-MoE style, vocab 32000,
/// hidden 512, 8 layers, 8 query / 4 KV heads of width 64, 32 experts of width 512, top-4.
pub fn mid_size_bench_config() -> Result<Config> {
    Config::from_value(serde_json::json!({
        "model_type": "qwen3_moe",
        "vocab_size": 32000,
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 2048,
        "moe_intermediate_size": 512,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "norm_topk_prob": true,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": false,
        "hidden_act": "silu"
    }))
}

/// Qwen3-30B-A3B's layer shape with `layers` layers (its published config otherwise): vocab
/// 151,936, hidden 2048, 32 query / 4 KV heads of width 128, 128 experts of width 768, top-8.
/// At 8 layers, 5.6 B parameters: the GPU benchmark's large config (`r3 bench train
/// --config a3b-8l`).
pub fn qwen3_30b_a3b_layers_config(layers: usize) -> Result<Config> {
    Config::from_value(serde_json::json!({
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": true,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": false,
        "hidden_act": "silu"
    }))
}
