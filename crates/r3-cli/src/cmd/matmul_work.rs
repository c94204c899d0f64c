//! Matmul work of a generation workload (FLOPs of the projections, experts, attention and
//! head, counted from the config) and this machine's limits, measured on the spot: its f32
//! GEMM peak and its streaming memory bandwidth, the figures that say how far a throughput
//! target is from what the CPU can do (a phase's limit is the lower of compute and
//! bandwidth for its arithmetic intensity).

use std::time::Instant;

use rayon::prelude::*;

use r3_model::config::AttentionConfig;
use r3_model::layers::gemm::{matmul, MatRef};
use r3_model::Config;

/// Multiply-adds of one token through one GQA attention layer attending over `context`
/// positions: q, k, v and o projections, then scores and weighted values; `None` for MLA
/// attention (not counted).
pub fn attention_macs(cfg: &Config, context: usize) -> Option<f64> {
    let AttentionConfig::Gqa {
        num_kv_heads,
        head_dim,
        ..
    } = cfg.attention
    else {
        return None;
    };
    let h = cfg.hidden_size as f64;
    let q = (cfg.num_attention_heads * head_dim) as f64;
    let kv = (num_kv_heads * head_dim) as f64;
    Some(h * (2.0 * q + 2.0 * kv) + 2.0 * q * context as f64)
}

/// Multiply-adds of one token through a MoE layer's router.
pub fn router_macs(cfg: &Config) -> f64 {
    cfg.moe
        .as_ref()
        .map_or(0.0, |moe| (cfg.hidden_size * moe.num_experts) as f64)
}

/// Multiply-adds of one token through layer `layer`'s feed-forward: the router and `top_k`
/// SwiGLU experts in a MoE layer, the dense SwiGLU otherwise.
pub fn ffn_macs(cfg: &Config, layer: usize) -> f64 {
    let h = cfg.hidden_size as f64;
    match &cfg.moe {
        Some(moe) if cfg.is_moe_layer(layer) => {
            let i = moe.expert_intermediate_size as f64;
            moe.top_k as f64 * 3.0 * h * i + router_macs(cfg)
        }
        _ => 3.0 * h * cfg.intermediate_size as f64,
    }
}

/// Multiply-adds of one token through the vocabulary head.
pub fn head_macs(cfg: &Config) -> f64 {
    (cfg.hidden_size * cfg.vocab_size) as f64
}

/// Multiply-add FLOPs (2 per MAC) of one token through the model, attending over `context`
/// positions, with the vocabulary head when `head`; `None` for MLA attention (not counted).
pub fn flops_per_token(cfg: &Config, context: usize, head: bool) -> Option<f64> {
    let attention = attention_macs(cfg, context)?;
    let mut macs: f64 = (0..cfg.num_hidden_layers)
        .map(|layer| attention + ffn_macs(cfg, layer))
        .sum();
    if head {
        macs += head_macs(cfg);
    }
    Some(2.0 * macs)
}

/// FLOPs of `batch` requests that each prefill `prompt` tokens and generate `new_tokens`
/// (the first from the prefill's last position, the rest one decode step each).
pub fn generation_flops(
    cfg: &Config,
    batch: usize,
    prompt: usize,
    new_tokens: usize,
) -> Option<f64> {
    let mut total = 0.0;
    for t in 0..prompt {
        total += flops_per_token(cfg, t + 1, t + 1 == prompt)?;
    }
    for step in 1..new_tokens {
        total += flops_per_token(cfg, prompt + step, true)?;
    }
    Some(total * batch as f64)
}

/// Best f32 GEMM rate (GFLOP/s) of this machine over a few square products on `threads`
/// threads, through the same kernels the training engine uses.
pub fn f32_gemm_peak(threads: usize) -> f64 {
    let n = 1024;
    let a: Vec<f32> = (0..n * n).map(|i| ((i % 7) as f32 - 3.0) * 0.25).collect();
    let b: Vec<f32> = (0..n * n).map(|i| ((i % 5) as f32 - 2.0) * 0.5).collect();
    let mut c = vec![0f32; n * n];
    let mut best = f64::INFINITY;
    for _ in 0..6 {
        let t = Instant::now();
        matmul(
            n,
            n,
            n,
            &mut c,
            MatRef::row_major(&a, n),
            MatRef::row_major(&b, n),
            threads,
        );
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n * n * n) as f64 / best / 1e9
}

/// Best streaming memory bandwidth (GB/s, 1e9 bytes) of this machine on the rayon pool, by
/// STREAM's triad `a = b + s·c` over three 64 MiB f32 arrays, far past any cache: 12 bytes
/// counted per element (two read, one written), as STREAM counts them.
pub fn stream_bandwidth() -> f64 {
    let n = 16 << 20;
    let b = vec![1.0f32; n];
    let c = vec![2.0f32; n];
    let mut a = vec![0f32; n];
    let chunk = 1 << 16;
    let mut best = f64::INFINITY;
    for round in 0..6 {
        let s = 0.5 + round as f32;
        let t = Instant::now();
        a.par_chunks_mut(chunk)
            .zip(b.par_chunks(chunk).zip(c.par_chunks(chunk)))
            .for_each(|(a, (b, c))| {
                for ((a, b), c) in a.iter_mut().zip(b).zip(c) {
                    *a = b + s * c;
                }
            });
        best = best.min(t.elapsed().as_secs_f64());
    }
    // Keep the result alive so the triad cannot be dropped as dead work.
    std::hint::black_box(&a);
    12.0 * n as f64 / best / 1e9
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A one-layer Qwen3-MoE config small enough to count by hand (shared with
    /// `step_phases.rs`'s tests).
    pub(crate) fn tiny() -> Config {
        Config::from_value(serde_json::json!({
            "model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 4,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 2, "intermediate_size": 8, "moe_intermediate_size": 5,
            "num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": true,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
            "tie_word_embeddings": false
        }))
        .expect("config")
    }

    /// By hand: q 4, kv 2; projections 4·(8 + 4) = 48 MACs, attention 2·4·5 = 40 over 5
    /// positions, experts 2·3·4·5 = 120, router 4·6 = 24, head 4·10 = 40.
    #[test]
    fn counts_a_tiny_config_by_hand() {
        let cfg = tiny();
        assert_eq!(
            flops_per_token(&cfg, 5, false),
            Some(2.0 * (48.0 + 40.0 + 144.0))
        );
        assert_eq!(
            flops_per_token(&cfg, 5, true),
            Some(2.0 * (48.0 + 40.0 + 144.0 + 40.0))
        );
        // prompt of 2 (contexts 1, 2; head on the last) then one decode step (context 3)
        let per = |ctx: usize, head: bool| flops_per_token(&cfg, ctx, head).expect("gqa");
        let want = 3.0 * (per(1, false) + per(2, true) + per(3, true));
        assert_eq!(generation_flops(&cfg, 3, 2, 2), Some(want));
    }

    /// The probe reports a finite, positive rate (its absolute value is the machine's).
    #[test]
    fn stream_bandwidth_is_a_positive_rate() {
        let bw = stream_bandwidth();
        assert!(bw.is_finite() && bw > 0.0, "{bw}");
    }
}
