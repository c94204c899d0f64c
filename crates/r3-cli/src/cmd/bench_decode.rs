//! `r3 bench decode`: generation throughput of one rollout engine, the device engine by
//! default (`--device cuda` on a GPU, `cpu-candle` here) or the CPU engine (`--device cpu`),
//! at batch 1 / 64 / 256 with `r3 bench rollout`'s configs and seeded random weights: greedy
//! (or sampled, `--temperature`), 32-token prompts, 128 new tokens (the HF
//! `generate` setting), routes captured.
//! One line per config and batch: generated tokens/s (prefill included, as HF's `generate`
//! figures are), the share of the time spent on route capture and, for the device engine,
//! the share the host spent waiting for the device (the rest is the host's own work and
//! kernel launches: near 100% the step is bound by the device's kernels). Nothing is
//! asserted.

use std::time::Instant;

use clap::Args;
use r3_model::weights::{RandomInit, Weights};
use r3_rollout::{
    DeviceEngine, DeviceEngineConfig, Dtype, Engine, EngineConfig, GenerateRequest, KvCacheDtype,
    RolloutDevice, RolloutEngine, RoutingPlace, SamplingParams,
};

use super::bench_rollout::{bench_config, prompt};

/// Options of `r3 bench decode`.
#[derive(Debug, Args)]
pub struct BenchDecodeArgs {
    /// Which engine, and where: `cuda` / `cuda:N`, `cpu-candle` (the device engine) or `cpu`
    /// (the CPU engine).
    #[arg(long, default_value = "cpu-candle")]
    pub device: RolloutDevice,
    /// Batch sizes (concurrent requests).
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    pub batches: Vec<usize>,
    /// Configs to run: `tiny`, `mid`, `a3b-8l` (Qwen3-30B-A3B's layer shape, 8 layers; its
    /// 5.6 B random weights are drawn on the engine's device).
    #[arg(long, value_delimiter = ',', default_value = "tiny")]
    pub configs: Vec<String>,
    /// Prompt length.
    #[arg(long, default_value_t = 32)]
    pub prompt_len: usize,
    /// Generated tokens per request.
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    /// Fewest generated tokens of a request: with it, the requests' lengths are spread over
    /// `--min-new-tokens ..= --new-tokens` (request `i` at `(i · 2654435769) mod` the range's
    /// width past the minimum), so rows leave the batch one after another as RL rollouts
    /// that stop at their end-of-sequence tokens do; without it every request generates
    /// `--new-tokens`.
    #[arg(long)]
    pub min_new_tokens: Option<usize>,
    /// Precision: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: Dtype,
    /// What the KV cache holds keys and values in (`r3 serve --kv-cache-dtype`): `auto` (the
    /// engine's dtype), that dtype named, or `f32` on the device engine; any of `f32`, `f16`,
    /// `bf16` on the CPU engine.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: KvCacheDtype,
    /// Timed runs per batch size (the best is reported; one untimed warm-up run first).
    #[arg(long, default_value_t = 1)]
    pub repeats: usize,
    /// Seed of weights and prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sampling temperature: 0 (the default) decodes greedily, as HF's `generate` figures
    /// do; above 0 each request samples from the whole distribution with its own seed (an
    /// RL rollout's setting: its rows of logits go to the host's sampler every step).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Where the device engine's MoE layers choose their experts: `auto` (on the device for
    /// a GPU's decode steps of a few rows), `host` or `device`.
    #[arg(long, default_value = "auto")]
    pub routing: RoutingPlace,
    /// Most prompt positions one prefill step feeds (`r3 serve --chunked-prefill-size`): a
    /// longer prompt is fed in chunks of it, one per step; absent: no cap but the activation
    /// budget.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub chunked_prefill_size: Option<usize>,
}

/// Runs `r3 bench decode`.
pub fn run(a: BenchDecodeArgs) -> anyhow::Result<()> {
    a.device
        .check_kv_cache_dtype(a.kv_cache_dtype, a.dtype)
        .map_err(|e| anyhow::anyhow!("--kv-cache-dtype {}: {e}", a.kv_cache_dtype))?;
    for name in &a.configs {
        let cfg = bench_config(name)?;
        // Billions of weights are drawn where the engine runs (the host's f32 draw of the
        // 30B-A3B shape takes minutes); the engine copies what it keeps in its own dtype.
        let draw_on = match a.device.candle() {
            Some(spec) if name == "a3b-8l" => spec.open()?,
            _ => candle_core::Device::Cpu,
        };
        let tensors =
            Weights::random_on_device(&cfg, &RandomInit::new(a.seed), &draw_on)?.into_map();
        let max_running = a.batches.iter().copied().max().unwrap_or(1).max(1);
        let defaults = EngineConfig::default();
        let engine_cfg = EngineConfig {
            dtype: a.dtype,
            kv_cache_dtype: a.kv_cache_dtype,
            prefix_cache: false,
            max_running,
            kv_cache_bytes: 16 << 30,
            // As `r3 serve` takes the cap: the CPU engine's step holds the chunk beside one
            // token of each decoding row.
            max_batch_tokens: a
                .chunked_prefill_size
                .map_or(defaults.max_batch_tokens, |n| n.saturating_add(max_running)),
            max_prefill_tokens: a.chunked_prefill_size,
            ..defaults
        };
        let mut engine = match a.device.candle() {
            None => RolloutEngine::Cpu(Engine::new(cfg.clone(), &tensors, engine_cfg)?),
            Some(spec) => {
                let device_cfg = DeviceEngineConfig {
                    routing: a.routing,
                    ..DeviceEngineConfig::from_engine_config(spec, &engine_cfg)
                };
                // Drawn on the engine's GPU: the engine takes that handle, so its copy in
                // its own dtype stays on one handle (a second handle's copied every tensor
                // across first).
                RolloutEngine::Device(DeviceEngine::new_beside(
                    cfg.clone(),
                    &tensors,
                    device_cfg,
                    &draw_on,
                )?)
            }
        };
        // The engine holds its own copy: the drawn weights (20 GB in f32 for the 30B-A3B
        // shape on a GPU) would shrink the free memory the decode runs in.
        drop(tensors);
        let least = a.min_new_tokens.unwrap_or(a.new_tokens);
        if least == 0 || least > a.new_tokens {
            anyhow::bail!(
                "--min-new-tokens {least} must be between 1 and --new-tokens {}",
                a.new_tokens
            );
        }
        let new_tokens =
            |i: usize| least + i.wrapping_mul(2_654_435_769) % (a.new_tokens - least + 1);
        let sampling = |i: usize| -> SamplingParams {
            if a.temperature > 0.0 {
                SamplingParams {
                    temperature: a.temperature,
                    max_new_tokens: new_tokens(i),
                    seed: a.seed.wrapping_add(i as u64),
                    ..SamplingParams::default()
                }
            } else {
                SamplingParams::greedy(new_tokens(i))
            }
        };
        let requests = |batch: usize| -> Vec<GenerateRequest> {
            (0..batch)
                .map(|i| {
                    GenerateRequest::new(
                        prompt(a.seed, i, a.prompt_len, cfg.vocab_size),
                        sampling(i),
                    )
                })
                .collect()
        };
        let how = if a.temperature > 0.0 {
            format!("sampled at temperature {}", a.temperature)
        } else {
            "greedy".to_string()
        };
        // Warm-up: the first launches compile kernels (CUDA) and fault pages in.
        engine.generate(requests(1))?;
        for &batch in &a.batches {
            let (mut best, mut capture_share) = (0f64, 0f64);
            let mut wait_share = None;
            let routed0 = engine.steps_routed_on_device();
            for _ in 0..a.repeats.max(1) {
                let capture0 = engine.capture_seconds();
                let wait0 = engine.device_wait_seconds();
                let t0 = Instant::now();
                let out = engine.generate(requests(batch))?;
                let secs = t0.elapsed().as_secs_f64();
                let tokens = out.iter().map(|r| r.output_ids.len()).sum::<usize>() as f64;
                if tokens / secs > best {
                    best = tokens / secs;
                    capture_share = (engine.capture_seconds() - capture0) / secs;
                    wait_share = engine
                        .device_wait_seconds()
                        .zip(wait0)
                        .map(|(now, before)| (now - before) / secs);
                }
            }
            let waiting = wait_share.map_or(String::new(), |w| {
                format!(", the host waiting for the device {:.1}% of it", w * 100.0)
            });
            let lengths = if least < a.new_tokens {
                format!("{least}–{}", a.new_tokens)
            } else {
                a.new_tokens.to_string()
            };
            // The share of this batch's steps auto (or the flag) routed on the device.
            let routing = match (engine.steps_routed_on_device(), routed0) {
                (Some((d1, n1)), Some((d0, n0))) if n1 > n0 => format!(
                    " routing {} ({:.0}% of steps on the device)",
                    a.routing,
                    (d1 - d0) as f64 * 100.0 / (n1 - n0) as f64
                ),
                _ => String::new(),
            };
            let chunks = a
                .chunked_prefill_size
                .map_or(String::new(), |n| format!(", prefill in chunks of {n}"));
            let kv = match a.kv_cache_dtype {
                KvCacheDtype::Auto => String::new(),
                fixed => format!(", KV cache {fixed}"),
            };
            println!(
                "decode {name} {} {}{routing} batch {batch}: {best:.1} tokens/s ({} prompt + \
                 {lengths} new tokens, {how}{chunks}{kv}), route capture {:.2}% of the time\
                 {waiting}",
                a.device,
                a.dtype,
                a.prompt_len,
                capture_share * 100.0
            );
        }
    }
    Ok(())
}
