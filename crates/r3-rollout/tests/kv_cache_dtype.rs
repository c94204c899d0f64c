//! The KV cache's dtype (`EngineConfig::kv_cache_dtype`) against independent truth: a bf16
//! engine rounds keys and values to bf16 before it caches them, so its bf16 cache (`auto`)
//! must give bit for bit what an f32 cache gives; an f16 engine's f16 cache rounds its keys
//! after RoPE, a new rounding point whose effect on the prompt log-probs is measured here
//! against the f32 cache and the training forward's f32 log-probs.

mod common;

use common::{model_dir, MODELS};
use r3_rollout::{
    Dtype, Engine, EngineConfig, GenerateRequest, GenerateResult, KvCacheDtype, SamplingParams,
};

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 53 + 11) % 250 + 3).collect()
}

/// One request with prompt log-probs, sampled tokens and routes, through an engine of
/// `dtype` whose cache holds `kv`.
fn run(name: &str, dtype: Dtype, kv: KvCacheDtype) -> GenerateResult {
    let cfg = EngineConfig {
        dtype,
        kv_cache_dtype: kv,
        kv_cache_bytes: 64 << 20,
        prefix_cache: false,
        ..EngineConfig::default()
    };
    let mut engine = Engine::from_dir(&model_dir(name), cfg).expect("engine loads fixture");
    let sampling = SamplingParams {
        temperature: 0.9,
        seed: 3,
        max_new_tokens: 12,
        prompt_logprobs_from: Some(0),
        ..Default::default()
    };
    let mut req = GenerateRequest::new(prompt(29), sampling);
    req.return_routes = true;
    engine.generate(vec![req]).expect("generate").remove(0)
}

fn prompt_logprobs(r: &GenerateResult) -> Vec<f32> {
    r.prompt_logprobs
        .as_ref()
        .expect("prompt log-probs asked for")
        .logprobs
        .clone()
}

#[test]
fn a_bf16_engine_attends_over_its_bf16_cache_as_over_an_f32_one() {
    for name in MODELS {
        let half = run(name, Dtype::Bf16, KvCacheDtype::Auto);
        let wide = run(name, Dtype::Bf16, KvCacheDtype::Fixed(Dtype::F32));
        assert_eq!(half.output_ids, wide.output_ids, "{name}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&half.output_logprobs),
            bits(&wide.output_logprobs),
            "{name}"
        );
        assert_eq!(
            bits(&prompt_logprobs(&half)),
            bits(&prompt_logprobs(&wide)),
            "{name}"
        );
        assert_eq!(half.routes, wide.routes, "{name}");
    }
}

#[test]
fn an_f16_cache_rounds_an_f16_engines_keys_within_f16_tolerance() {
    for name in MODELS {
        let half = prompt_logprobs(&run(name, Dtype::F16, KvCacheDtype::Auto));
        let wide = prompt_logprobs(&run(name, Dtype::F16, KvCacheDtype::Fixed(Dtype::F32)));
        let exact = prompt_logprobs(&run(name, Dtype::F32, KvCacheDtype::Auto));
        assert_eq!(half.len(), wide.len(), "{name}");
        let worst = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        let (cache_effect, half_err, wide_err) = (
            worst(&half, &wide),
            worst(&half, &exact),
            worst(&wide, &exact),
        );
        println!(
            "{name}: f16 vs f32 cache {cache_effect:.2e}; against the f32 engine: f16 cache \
             {half_err:.2e}, f32 cache {wide_err:.2e}"
        );
        // The keys are rounded: the two caches differ, by an f16 rounding's worth (measured
        // 1.0e-3 / 2.1e-3), well inside what the f16 engine's other rounding points cost
        // against the f32 engine (1.5e-3 / 2.1e-1: a route near a tie flips on the DeepSeek
        // fixture whichever the cache).
        assert!(cache_effect > 0.0, "{name}: the f16 cache rounded nothing");
        assert!(cache_effect < 1e-2, "{name}: {cache_effect}");
        assert!(
            cache_effect <= wide_err.max(1e-3),
            "{name}: {cache_effect} vs {wide_err}"
        );
    }
}
