//! Matmul work of a generation workload (FLOPs of the projections, experts, attention and
//! head, counted from the config) and this machine's limits, measured on the spot: its f32
//! GEMM peak and its streaming memory bandwidth, the figures that say how far a throughput
//! target is from what the CPU can do (a phase's limit is the lower of compute and
//! bandwidth for its arithmetic intensity).

use std::time::Instant;

use rayon::prelude::*;

use r3_model::config::{AttentionConfig, SharedExpert};
use r3_model::layers::gemm::{matmul, MatRef};
use r3_model::Config;

/// Multiply-adds of one token through one attention layer's projections (the elements of
/// its weight matrices): GQA's q, k, v and o; MLA's query (low-rank or plain), the
/// compressed key and value with the shared rotary key, their decompression into every
/// head's keys and values, and o.
pub fn attention_projection_macs(cfg: &Config) -> f64 {
    let h = cfg.hidden_size as f64;
    let heads = cfg.num_attention_heads as f64;
    match cfg.attention {
        AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            ..
        } => {
            let q = heads * head_dim as f64;
            let kv = (num_kv_heads * head_dim) as f64;
            h * (2.0 * q + 2.0 * kv)
        }
        AttentionConfig::Mla {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        } => {
            let qk = heads * (qk_nope_head_dim + qk_rope_head_dim) as f64;
            let query = match q_lora_rank {
                Some(rank) => rank as f64 * (h + qk),
                None => h * qk,
            };
            let (latent, rope) = (kv_lora_rank as f64, qk_rope_head_dim as f64);
            let decompress = latent * heads * (qk_nope_head_dim + v_head_dim) as f64;
            let output = heads * v_head_dim as f64 * h;
            query + h * (latent + rope) + decompress + output
        }
    }
}

/// Multiply-adds of one query against one cached position in one attention layer: its
/// scores over every head's key width and its weighted values over every head's value
/// width (MLA's keys and values decompressed, as r3's engines cache them).
fn attention_context_macs(cfg: &Config) -> f64 {
    let heads = cfg.num_attention_heads as f64;
    match cfg.attention {
        AttentionConfig::Gqa { head_dim, .. } => 2.0 * heads * head_dim as f64,
        AttentionConfig::Mla {
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            ..
        } => heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim) as f64,
    }
}

/// Multiply-adds of one token through one attention layer attending over `context`
/// positions: the projections, then scores and weighted values.
pub fn attention_macs(cfg: &Config, context: usize) -> f64 {
    attention_projection_macs(cfg) + attention_context_macs(cfg) * context as f64
}

/// Multiply-adds of one token through a MoE layer's router.
pub fn router_macs(cfg: &Config) -> f64 {
    cfg.moe
        .as_ref()
        .map_or(0.0, |moe| (cfg.hidden_size * moe.num_experts) as f64)
}

/// Multiply-adds of one token through a MoE layer's always-on expert: DeepSeek's shared
/// experts, or Qwen2-MoE's shared expert and its gate.
pub fn shared_expert_macs(cfg: &Config) -> f64 {
    let h = cfg.hidden_size as f64;
    match cfg.moe.as_ref().map(|moe| &moe.shared) {
        Some(SharedExpert::Plain { intermediate_size }) => 3.0 * h * *intermediate_size as f64,
        Some(SharedExpert::Gated { intermediate_size }) => 3.0 * h * *intermediate_size as f64 + h,
        Some(SharedExpert::None) | None => 0.0,
    }
}

/// Multiply-adds of one token through layer `layer`'s feed-forward: the router, `top_k`
/// SwiGLU experts and any always-on expert in a MoE layer, the dense SwiGLU otherwise.
pub fn ffn_macs(cfg: &Config, layer: usize) -> f64 {
    let h = cfg.hidden_size as f64;
    match &cfg.moe {
        Some(moe) if cfg.is_moe_layer(layer) => {
            let i = moe.expert_intermediate_size as f64;
            moe.top_k as f64 * 3.0 * h * i + router_macs(cfg) + shared_expert_macs(cfg)
        }
        _ => 3.0 * h * cfg.intermediate_size as f64,
    }
}

/// Multiply-adds of one token through the vocabulary head.
pub fn head_macs(cfg: &Config) -> f64 {
    (cfg.hidden_size * cfg.vocab_size) as f64
}

/// Multiply-add FLOPs (2 per MAC) of one token through the model, attending over `context`
/// positions, with the vocabulary head when `head`.
pub fn flops_per_token(cfg: &Config, context: usize, head: bool) -> f64 {
    let attention = attention_macs(cfg, context);
    let mut macs: f64 = (0..cfg.num_hidden_layers)
        .map(|layer| attention + ffn_macs(cfg, layer))
        .sum();
    if head {
        macs += head_macs(cfg);
    }
    2.0 * macs
}

/// FLOPs of `batch` requests that each prefill `prompt` tokens and generate `new_tokens`
/// (the first from the prefill's last position, the rest one decode step each).
pub fn generation_flops(cfg: &Config, batch: usize, prompt: usize, new_tokens: usize) -> f64 {
    generation_flops_after(cfg, 0, prompt, new_tokens) * batch as f64
}

/// [`generation_flops`] of one sequence whose first `cached` prompt positions came from a
/// prefix cache: the prefill computes positions `cached..prompt` (each attending to every
/// position before it, the cached ones included), then the decode steps.
pub fn generation_flops_after(
    cfg: &Config,
    cached: usize,
    prompt: usize,
    new_tokens: usize,
) -> f64 {
    let prefill: f64 = (cached.min(prompt)..prompt)
        .map(|t| flops_per_token(cfg, t + 1, t + 1 == prompt))
        .sum();
    let decode: f64 = (1..new_tokens)
        .map(|step| flops_per_token(cfg, prompt + step, true))
        .sum();
    prefill + decode
}

/// What a phase can reach on a machine: its GEMM peak and its streaming bandwidth, both
/// measured on the spot (the CPU's f32 peak and STREAM triad, [`MachineLimits::measure`];
/// a GPU's peak in the phase's dtype and its copy rate, [`MachineLimits::measure_on`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MachineLimits {
    /// GEMM rate, GFLOP/s.
    pub peak_gflops: f64,
    /// Streaming memory bandwidth, GB/s.
    pub bandwidth_gbs: f64,
}

impl MachineLimits {
    /// Both limits measured now on `threads` threads ([`f32_gemm_peak`], [`stream_bandwidth`]).
    pub fn measure(threads: usize) -> Self {
        MachineLimits {
            peak_gflops: f32_gemm_peak(threads),
            bandwidth_gbs: stream_bandwidth(),
        }
    }

    /// Both limits of `device` measured now: on the CPU [`MachineLimits::measure`] on
    /// `threads` threads (the CPU's 16-bit kernels compute in f32, so `dtype` does not
    /// change its peak); on a GPU [`gpu_gemm_peak`] in `dtype` and [`device_bandwidth`].
    pub fn measure_on(
        device: &candle_core::Device,
        dtype: candle_core::DType,
        threads: usize,
    ) -> anyhow::Result<Self> {
        if device.is_cpu() {
            return Ok(Self::measure(threads));
        }
        Ok(MachineLimits {
            peak_gflops: gpu_gemm_peak(device, dtype)?,
            bandwidth_gbs: device_bandwidth(device)?,
        })
    }

    /// The higher reading of each limit: a run held to the best the machine showed at any
    /// point of it, so a reading taken while something else loaded the machine cannot
    /// flatter the run's share of it.
    pub fn highest(self, other: MachineLimits) -> Self {
        MachineLimits {
            peak_gflops: self.peak_gflops.max(other.peak_gflops),
            bandwidth_gbs: self.bandwidth_gbs.max(other.bandwidth_gbs),
        }
    }

    /// Roofline seconds of one step: its FLOPs at the peak or its bytes at the bandwidth,
    /// whichever takes longer.
    pub fn step_seconds(&self, flops: f64, bytes: f64) -> f64 {
        (flops / (self.peak_gflops * 1e9)).max(bytes / (self.bandwidth_gbs * 1e9))
    }
}

/// How the rollout engine stores what a generation step reads.
#[derive(Debug, Clone, Copy)]
pub struct StorageBytes {
    /// Bytes per weight (f16/bf16 panels: 2, f32: 4).
    pub weight: f64,
    /// Bytes per cached key or value element (the CPU engine's KV pool holds the engine's
    /// dtype: 2 for f16/bf16, 4 for f32).
    pub kv: f64,
}

/// Weights a step of `tokens` tokens reads in layer `layer` (elements): the attention
/// projections, and in a MoE layer the router plus the experts those tokens are expected to
/// reach under uniform routing, `E · (1 − (1 − k/E)^tokens)` (a step touches each expert it
/// routes to once, however many of its tokens go there) and any always-on expert, or the
/// dense MLP.
pub fn layer_weights_read(cfg: &Config, layer: usize, tokens: usize) -> f64 {
    let projections = attention_projection_macs(cfg);
    let h = cfg.hidden_size as f64;
    let ffn = match &cfg.moe {
        Some(moe) if cfg.is_moe_layer(layer) => {
            let (e, k) = (moe.num_experts as f64, moe.top_k as f64);
            let reached = e * (1.0 - (1.0 - k / e).powi(tokens.min(i32::MAX as usize) as i32));
            reached * 3.0 * h * moe.expert_intermediate_size as f64
                + router_macs(cfg)
                + shared_expert_macs(cfg)
        }
        _ => 3.0 * h * cfg.intermediate_size as f64,
    };
    projections + ffn
}

/// Cached key and value elements of one position in one layer: GQA's key/value heads, or
/// MLA's every head's decompressed key and value (what r3's engines cache).
fn kv_elements_per_position(cfg: &Config) -> f64 {
    let heads = cfg.num_attention_heads;
    match cfg.attention {
        AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            ..
        } => 2.0 * (num_kv_heads * head_dim) as f64,
        AttentionConfig::Mla {
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            ..
        } => (heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)) as f64,
    }
}

/// Roofline seconds of [`generation_flops`]'s workload: one prefill step of all prompts,
/// then `new_tokens − 1` decode steps of `batch` tokens, each step at
/// [`MachineLimits::step_seconds`] of its FLOPs and of the bytes it must read (the weights
/// it touches, [`layer_weights_read`], and the head; every cached key and value its tokens
/// attend to; the prefill also writes its keys and values). The time no engine can beat on
/// this machine: decode at small batch is bound by bandwidth, prefill by compute.
pub fn generation_roofline(
    cfg: &Config,
    batch: usize,
    prompt: usize,
    new_tokens: usize,
    bytes: StorageBytes,
    limits: MachineLimits,
) -> f64 {
    let layers = cfg.num_hidden_layers;
    let kv_per_position = kv_elements_per_position(cfg) * layers as f64;
    let weights = weights_read(cfg, batch, bytes);
    let mut total = prefill_roofline(cfg, batch, prompt, bytes, limits);
    for step in 1..new_tokens {
        let context = prompt + step;
        let flops = flops_per_token(cfg, context, true) * batch as f64;
        let kv = (batch * context) as f64 * kv_per_position * bytes.kv;
        total += limits.step_seconds(flops, weights + kv);
    }
    total
}

/// [`generation_roofline`] with each decode step split into the phases every engine runs one
/// after another (a layer's attention projections, its attention over the cache, its
/// feed-forward, then the head after the last layer), each at the slower of its own FLOPs at
/// the peak and its own bytes at the bandwidth. Never faster than the whole-step figure (a
/// sum of maxima is at least the maximum of the sums): the step's bytes are not spread over
/// its FLOPs but come in phases — the routed experts' weights all at once, bound by bandwidth,
/// the head's GEMM bound by compute — so this is the time an engine that overlaps no phase
/// with another can reach. The prefill is counted as there.
pub fn generation_phase_roofline(
    cfg: &Config,
    batch: usize,
    prompt: usize,
    new_tokens: usize,
    bytes: StorageBytes,
    limits: MachineLimits,
) -> f64 {
    let b = batch as f64;
    let projections = attention_projection_macs(cfg);
    let kv_per_position = kv_elements_per_position(cfg);
    // The phases whose work does not grow with the context.
    let head = head_macs(cfg);
    let mut fixed = limits.step_seconds(2.0 * b * head, head * bytes.weight);
    for layer in 0..cfg.num_hidden_layers {
        let ffn_weights = layer_weights_read(cfg, layer, batch) - projections;
        fixed += limits.step_seconds(2.0 * b * projections, projections * bytes.weight)
            + limits.step_seconds(2.0 * b * ffn_macs(cfg, layer), ffn_weights * bytes.weight);
    }
    let mut total = prefill_roofline(cfg, batch, prompt, bytes, limits);
    for step in 1..new_tokens {
        let context = prompt + step;
        let attention = 2.0 * b * (attention_macs(cfg, context) - projections);
        let kv = b * context as f64 * kv_per_position * bytes.kv;
        total += fixed + cfg.num_hidden_layers as f64 * limits.step_seconds(attention, kv);
    }
    total
}

/// Bytes of weights a step of `tokens` tokens reads: every layer's ([`layer_weights_read`])
/// and the head.
fn weights_read(cfg: &Config, tokens: usize, bytes: StorageBytes) -> f64 {
    let mut w = head_macs(cfg);
    for layer in 0..cfg.num_hidden_layers {
        w += layer_weights_read(cfg, layer, tokens);
    }
    w * bytes.weight
}

/// Roofline seconds of the prefill step of `batch` prompts of `prompt` tokens: its FLOPs,
/// and the weights it touches plus the keys and values it writes and reads back.
fn prefill_roofline(
    cfg: &Config,
    batch: usize,
    prompt: usize,
    bytes: StorageBytes,
    limits: MachineLimits,
) -> f64 {
    let kv_per_position = kv_elements_per_position(cfg) * cfg.num_hidden_layers as f64;
    // Keys and values written once and read by the later prompt positions (from cache).
    let prefill_kv = (batch * prompt) as f64 * kv_per_position * bytes.kv * 2.0;
    limits.step_seconds(
        // One new token: the prefill alone (the head on the prompt's last position only).
        generation_flops_after(cfg, 0, prompt, 1) * batch as f64,
        weights_read(cfg, batch * prompt, bytes) + prefill_kv,
    )
}

/// Threads of the rayon pool the command runs in (one per logical CPU unless
/// `RAYON_NUM_THREADS` says otherwise): the thread count the limits are measured with, so
/// that a step and the peak it is held to run on the same threads.
pub fn machine_threads() -> usize {
    rayon::current_num_threads()
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

/// Best GEMM rate (GFLOP/s) of `device` in `dtype` over `reps` square `n × n × n` products
/// through candle's matmul (cuBLAS on a GPU: tensor cores in bf16 / f16), each timed to the
/// device's end: the peak a GPU step's matrix work is held to, measured in the same run. The
/// operands are deterministic values of order 1, built on the device; `n` fits a u32.
pub fn device_gemm_peak(
    device: &candle_core::Device,
    dtype: candle_core::DType,
    n: usize,
    reps: usize,
) -> anyhow::Result<f64> {
    use candle_core::{DType, Tensor};
    anyhow::ensure!(
        matches!(dtype, DType::F32 | DType::BF16 | DType::F16),
        "a GEMM peak is measured in f32, bf16 or f16, not {dtype:?}"
    );
    anyhow::ensure!(
        n > 0 && reps > 0 && u32::try_from(n).is_ok(),
        "a GEMM peak needs 1 ≤ n < 2³² and reps ≥ 1 (got n = {n}, reps = {reps})"
    );
    // sin(0.37 i + 0.11 j + shift): values of order 1 from small exact f32 coordinates
    let operand = |shift: f64| -> candle_core::Result<Tensor> {
        let coordinate = |scale: f64| -> candle_core::Result<Tensor> {
            Tensor::arange(0u32, n as u32, device)?
                .to_dtype(DType::F32)?
                .affine(scale, 0.0)
        };
        let rows = coordinate(0.37)?.reshape((n, 1))?;
        let cols = coordinate(0.11)?.affine(1.0, shift)?.reshape((1, n))?;
        rows.broadcast_add(&cols)?.sin()?.to_dtype(dtype)
    };
    let (a, b) = (operand(0.0)?, operand(0.5)?);
    // One untimed product first (a GPU loads its kernels and sizes its workspace).
    let _ = a.matmul(&b)?;
    device.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        let c = a.matmul(&b)?;
        device.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
        drop(c);
    }
    Ok(2.0 * (n as f64).powi(3) / best / 1e9)
}

/// Square size and count of the products a GPU's GEMM peak is the best of
/// ([`gpu_gemm_peak`]): large enough for cuBLAS's best kernels, a few ms each in bf16.
pub const GPU_PEAK_PRODUCTS: (usize, usize) = (8192, 5);

/// [`device_gemm_peak`] with the benches' sizes ([`GPU_PEAK_PRODUCTS`]): the peak every GPU
/// bench line is held to.
pub fn gpu_gemm_peak(
    device: &candle_core::Device,
    dtype: candle_core::DType,
) -> anyhow::Result<f64> {
    let (size, reps) = GPU_PEAK_PRODUCTS;
    device_gemm_peak(device, dtype, size, reps)
}

/// A GPU's streaming rate in GB/s: the best of five passes of `y = x · 1 + 0` over 256 Mi
/// f32 values (1 GiB read, 1 GiB written), each synchronised; the CPU's STREAM triad off a
/// GPU.
pub fn device_bandwidth(device: &candle_core::Device) -> anyhow::Result<f64> {
    if device.is_cpu() {
        return Ok(stream_bandwidth());
    }
    let x = candle_core::Tensor::ones(256 << 20, candle_core::DType::F32, device)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        device.synchronize()?;
        let t0 = Instant::now();
        let y = x.affine(1.0, 0.0)?;
        device.synchronize()?;
        best = best.min(t0.elapsed().as_secs_f64());
        drop(y);
    }
    Ok(2.0 * (x.elem_count() * 4) as f64 / best / 1e9)
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
        assert_eq!(flops_per_token(&cfg, 5, false), 2.0 * (48.0 + 40.0 + 144.0));
        assert_eq!(
            flops_per_token(&cfg, 5, true),
            2.0 * (48.0 + 40.0 + 144.0 + 40.0)
        );
        // prompt of 2 (contexts 1, 2; head on the last) then one decode step (context 3)
        let per = |ctx: usize, head: bool| flops_per_token(&cfg, ctx, head);
        let want = 3.0 * (per(1, false) + per(2, true) + per(3, true));
        assert_eq!(generation_flops(&cfg, 3, 2, 2), want);
    }

    /// Configs of the three attention and expert forms: a Qwen2-MoE layer with a gated
    /// shared expert, DeepSeek-V3 (MLA with a low-rank query, a dense first layer, shared
    /// experts) and Moonlight (MLA with a plain query).
    fn families() -> Vec<(&'static str, Config)> {
        let base = serde_json::json!({
            "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 12,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": false
        });
        let extra = [
            (
                "qwen2_moe",
                serde_json::json!({"model_type": "qwen2_moe", "num_experts": 4,
                "num_experts_per_tok": 2, "moe_intermediate_size": 3, "norm_topk_prob": false,
                "shared_expert_intermediate_size": 5, "decoder_sparse_step": 1}),
            ),
            (
                "deepseek_v3",
                serde_json::json!({"model_type": "deepseek_v3",
                "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 3,
                "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                "n_shared_experts": 2, "routed_scaling_factor": 1.0, "norm_topk_prob": true,
                "q_lora_rank": 5, "kv_lora_rank": 4, "qk_nope_head_dim": 3,
                "qk_rope_head_dim": 2, "v_head_dim": 6}),
            ),
            (
                "moonlight",
                serde_json::json!({"model_type": "deepseek_v3",
                "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 3,
                "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                "n_shared_experts": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": true,
                "q_lora_rank": null, "kv_lora_rank": 4, "qk_nope_head_dim": 3,
                "qk_rope_head_dim": 2, "v_head_dim": 6}),
            ),
        ];
        extra
            .into_iter()
            .map(|(name, extra)| {
                let mut json = base.clone();
                for (k, v) in extra.as_object().expect("object") {
                    json[k] = v.clone();
                }
                (name, Config::from_value(json).expect("config"))
            })
            .collect()
    }

    /// A token's projection and expert multiply-adds are the elements of the matrices it
    /// goes through: counted against the model's own weights (`Weights::random`, every
    /// tensor the HF checkpoint has), layer 1 of each family: its attention's matrices, its
    /// always-on expert (with Qwen2-MoE's gate), and `top_k` of its routed experts plus the
    /// router. A query against one cached position: by hand, each head's key width (MLA:
    /// 3 + 2) plus its value width (MLA: 6), GQA's heads 2 × (4 + 4).
    #[test]
    fn counts_match_the_weights_of_every_attention_and_expert_form() {
        use r3_model::weights::{RandomInit, Weights};
        for (name, cfg) in families() {
            let weights = Weights::random(&cfg, &RandomInit::new(0), &candle_core::Device::Cpu)
                .expect("weights")
                .unfuse_experts(&cfg)
                .expect("unfused");
            let elements = |keep: &dyn Fn(&str) -> bool| -> f64 {
                weights
                    .tensors()
                    .iter()
                    .filter(|(k, t)| k.starts_with("model.layers.1.") && t.rank() == 2 && keep(k))
                    .map(|(_, t)| t.elem_count() as f64)
                    .sum()
            };
            let attention = elements(&|k| k.contains(".self_attn."));
            assert_eq!(
                attention_projection_macs(&cfg),
                attention,
                "{name}: attention"
            );
            let shared = elements(&|k| k.contains(".shared_expert"));
            assert!(shared > 0.0, "{name}: a shared expert");
            assert_eq!(shared_expert_macs(&cfg), shared, "{name}: shared expert");
            let expert0 = elements(&|k| k.contains(".experts.0."));
            let router = elements(&|k| k.ends_with(".mlp.gate.weight"));
            let moe = cfg.moe.as_ref().expect("moe");
            assert_eq!(
                ffn_macs(&cfg, 1),
                moe.top_k as f64 * expert0 + router + shared,
                "{name}: feed-forward"
            );
            let per_position = match name {
                "qwen2_moe" => 2.0 * (4.0 + 4.0),
                _ => 2.0 * (3.0 + 2.0 + 6.0),
            };
            assert_eq!(
                attention_macs(&cfg, 7) - attention_macs(&cfg, 0),
                7.0 * per_position,
                "{name}: attention over the context"
            );
            // MLA's cache holds every head's decompressed key and value.
            assert_eq!(
                kv_elements_per_position(&cfg),
                per_position,
                "{name}: cache"
            );
        }
    }

    /// By hand on [`tiny`]: at one token a step reads the projections (48), the router (24),
    /// the 2 experts it routes to (2 · 3 · 4 · 5 = 120) and the head (40); with many tokens
    /// all 6 experts (360). A decode step reads the cached keys and values of every position
    /// (1 layer · 2 · 1 head · 2 wide = 4 elements each).
    #[test]
    fn roofline_counts_a_tiny_config_by_hand() {
        let cfg = tiny();
        let one = layer_weights_read(&cfg, 0, 1);
        assert!((one - (48.0 + 24.0 + 120.0)).abs() < 1e-9, "{one}");
        let many = layer_weights_read(&cfg, 0, 1_000);
        assert!((many - (48.0 + 24.0 + 360.0)).abs() < 1e-9, "{many}");
        // Two tokens reach 6 · (1 − (2/3)²) = 10/3 experts on average.
        let two = layer_weights_read(&cfg, 0, 2);
        assert!((two - (72.0 + 10.0 / 3.0 * 60.0)).abs() < 1e-9, "{two}");

        // Bandwidth-bound limits (1 FLOP/s is never the binding side here at 1e12).
        let limits = MachineLimits {
            peak_gflops: 1e3,
            bandwidth_gbs: 1e-9,
        };
        let bytes = StorageBytes {
            weight: 2.0,
            kv: 4.0,
        };
        // batch 1, prompt 2, 2 new tokens: prefill reads the weights at 2 tokens and writes
        // 2 positions' KV (read back: × 2); the decode step at context 3 reads 3 positions.
        let prefill = (two + 40.0) * 2.0 + 2.0 * 4.0 * 4.0 * 2.0;
        let decode = (48.0 + 24.0 + 120.0 + 40.0) * 2.0 + 3.0 * 4.0 * 4.0;
        let got = generation_roofline(&cfg, 1, 2, 2, bytes, limits);
        assert!((got - (prefill + decode)).abs() < 1e-6, "{got}");
        // Compute-bound: the FLOPs at the peak.
        let fast_memory = MachineLimits {
            peak_gflops: 1e-9,
            bandwidth_gbs: 1e3,
        };
        let got = generation_roofline(&cfg, 3, 2, 2, bytes, fast_memory);
        let want = generation_flops(&cfg, 3, 2, 2);
        assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
        // Held to the higher reading of each limit, whichever measurement showed it.
        let best = limits.highest(fast_memory);
        assert_eq!((best.peak_gflops, best.bandwidth_gbs), (1e3, 1e3));
        assert_eq!(
            fast_memory.highest(limits).step_seconds(1e3, 1e3),
            best.step_seconds(1e3, 1e3)
        );
    }

    /// By hand on [`tiny`], batch 4 at 2 FLOP/s and 1 B/s (2-byte weights, 4-byte KV): the
    /// decode step at context 3 is projections max(4·96 / 2, 96) = 192 (compute), attention
    /// max(4·48 / 2, 4·3·4·4) = 192 (bandwidth), feed-forward max(4·288 / 2, (e·60 + 24)·2)
    /// with e = 6·(1 − (2/3)⁴) experts reached (bandwidth), head max(4·80 / 2, 80) = 160
    /// (compute); the whole-step roofline, which spreads the bytes over the FLOPs, is faster.
    #[test]
    fn phase_roofline_counts_a_tiny_config_by_hand() {
        let cfg = tiny();
        let limits = MachineLimits {
            peak_gflops: 2e-9,
            bandwidth_gbs: 1e-9,
        };
        let bytes = StorageBytes {
            weight: 2.0,
            kv: 4.0,
        };
        let phases = |new| generation_phase_roofline(&cfg, 4, 2, new, bytes, limits);
        let whole = |new| generation_roofline(&cfg, 4, 2, new, bytes, limits);
        let (prefill, one_step) = (phases(1), phases(2));
        assert_eq!(prefill, whole(1), "the prefill is counted alike");
        let reached = 6.0 * (1.0 - (2.0f64 / 3.0).powi(4));
        let want =
            192.0 + 192.0 + (4.0 * 288.0 / 2.0f64).max((reached * 60.0 + 24.0) * 2.0) + 160.0;
        let got = one_step - prefill;
        assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
        let whole_step = whole(2) - prefill;
        assert!(whole_step < got, "{whole_step} vs {got}");
        // Where every phase is bound by the same side, the two agree.
        for side in [
            MachineLimits {
                peak_gflops: 1e-9,
                bandwidth_gbs: 1e3,
            },
            MachineLimits {
                peak_gflops: 1e3,
                bandwidth_gbs: 1e-9,
            },
        ] {
            let split = generation_phase_roofline(&cfg, 4, 2, 3, bytes, side);
            let joint = generation_roofline(&cfg, 4, 2, 3, bytes, side);
            assert!((split - joint).abs() < 1e-9 * joint, "{split} vs {joint}");
        }
    }

    /// The probe reports a finite, positive rate (its absolute value is the machine's).
    #[test]
    fn stream_bandwidth_is_a_positive_rate() {
        let bw = stream_bandwidth();
        assert!(bw.is_finite() && bw > 0.0, "{bw}");
    }

    /// The device GEMM peak runs on the CPU device too (a positive, finite rate), and
    /// refuses an integer dtype and an empty product, naming what is wrong.
    #[test]
    fn the_device_gemm_peak_measures_float_products_only() {
        use candle_core::{DType, Device};
        let rate = device_gemm_peak(&Device::Cpu, DType::BF16, 48, 1).expect("bf16 peak");
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
        let err = device_gemm_peak(&Device::Cpu, DType::U32, 48, 1).expect_err("u32");
        assert!(err.to_string().contains("not U32"), "{err}");
        let err = device_gemm_peak(&Device::Cpu, DType::F32, 0, 1).expect_err("empty");
        assert!(err.to_string().contains("n = 0"), "{err}");
    }
}
