//! The device engine's KV cache dtype (`kv_cache_dtype`): `auto` holds a bf16 / f16
//! forward's keys and values in that 16-bit float, `f32` in f32. The forward rounds keys after
//! RoPE and values after their projection, so both caches hold the same values and every
//! request must give the same bits either way: tokens, log-probs bit for bit, route tables
//! cell for cell — over every family (GQA and MLA), greedy and seeded, a batch of different
//! prompt lengths, prefix-cache hits (16-bit blocks joined into a prefill batch), a request
//! admitted into a running batch, and a prompt fed in chunks. And the 16-bit cache takes half
//! the bytes: a request whose slots fit a KV budget only at two bytes a value is admitted
//! with `auto` and refused with `f32`.

mod common;
#[path = "../../r3-model/tests/common/mod.rs"]
mod model_common;

use candle_core::DType;
use common::{assert_same_routes, mixed_sampling, DEVICE};
use model_common::{sequences, tiny_config, tiny_weights, FAMILIES};
use r3_model::Config;
use r3_rollout::{
    DeviceEngine, DeviceEngineConfig, Dtype, GenerateRequest, GenerateResult, KvCacheDtype,
    SamplingParams, TensorMap,
};

/// The device engine in `dtype` holding its cache in `kv`, prefix cache on (blocks of 4).
fn engine(cfg: &Config, map: &TensorMap, dtype: Dtype, kv: KvCacheDtype) -> DeviceEngine {
    let config = DeviceEngineConfig {
        device: DEVICE,
        dtype,
        kv_cache_dtype: kv,
        block_size: 4,
        ..DeviceEngineConfig::default()
    };
    DeviceEngine::new(cfg.clone(), map, config).expect("engine")
}

/// Tokens, finish, log-probs (bit for bit) and routes (cell for cell, where the model
/// routes) agree.
fn assert_bits(what: &str, got: &GenerateResult, want: &GenerateResult) {
    assert_eq!(got.output_ids, want.output_ids, "{what}: tokens");
    assert_eq!(got.finish, want.finish, "{what}: finish");
    let bits = |r: &GenerateResult| -> Vec<u32> {
        r.output_logprobs.iter().map(|x| x.to_bits()).collect()
    };
    assert_eq!(bits(got), bits(want), "{what}: log-probs");
    assert_same_routes(what, &got.routes, &want.routes);
}

/// Rounds of requests: a batch of four prompts (greedy and seeded), then prompts that
/// extend two of them (prefix-cache hits beside a miss), then a long request with a short
/// one admitted while it decodes.
fn rounds(vocab: usize) -> Vec<Vec<GenerateRequest>> {
    let prompts = sequences(&[5, 9, 3, 12], vocab, 11);
    let first = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| GenerateRequest::new(p.clone(), mixed_sampling(i, 6, 40)))
        .collect();
    let extended = |p: &Vec<u32>, more: &[u32]| [p.as_slice(), more].concat();
    let tails = sequences(&[4, 6, 7], vocab, 12);
    let second = vec![
        GenerateRequest::new(extended(&prompts[1], &tails[0]), mixed_sampling(0, 5, 50)),
        GenerateRequest::new(extended(&prompts[3], &tails[1]), mixed_sampling(1, 5, 50)),
        GenerateRequest::new(tails[2].clone(), mixed_sampling(2, 5, 50)),
    ];
    let long = sequences(&[6, 2], vocab, 13);
    let third = vec![
        GenerateRequest::new(long[0].clone(), SamplingParams::greedy(12)),
        GenerateRequest::new(long[1].clone(), mixed_sampling(1, 4, 60)),
    ];
    vec![first, second, third]
}

#[test]
fn a_sixteen_bit_cache_gives_the_f32_caches_bits() {
    for family in FAMILIES {
        let cfg = tiny_config(family);
        let map = tiny_weights(&cfg, 3, DType::F32).into_map();
        for dtype in [Dtype::Bf16, Dtype::F16] {
            let mut narrow = engine(&cfg, &map, dtype, KvCacheDtype::Auto);
            let mut wide = engine(&cfg, &map, dtype, KvCacheDtype::Fixed(Dtype::F32));
            for (round, reqs) in rounds(cfg.vocab_size).into_iter().enumerate() {
                let got = narrow.generate(reqs.clone()).expect("16-bit cache");
                let want = wide.generate(reqs).expect("f32 cache");
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_bits(&format!("{family} {dtype} round {round} #{i}"), g, w);
                }
            }
            let hits = |e: &DeviceEngine| e.prefix_cache_stats().map_or(0, |s| s.hit_blocks);
            assert!(hits(&narrow) > 0, "{family} {dtype}: prefix hits happened");
            assert_eq!(
                hits(&narrow),
                hits(&wide),
                "{family} {dtype}: the same hits"
            );
        }
    }
}

/// A prompt too long for one step of the activation budget is fed in chunks over a
/// 16-bit cache (each chunk attending over the earlier chunks' 16-bit keys) with the f32
/// cache's bits.
#[test]
fn a_prompt_fed_in_chunks_over_a_sixteen_bit_cache_gives_the_f32_caches_bits() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 5, DType::F32).into_map();
    let prompt = sequences(&[40], cfg.vocab_size, 21).remove(0);
    let chunked = |kv| {
        let config = DeviceEngineConfig {
            device: DEVICE,
            dtype: Dtype::Bf16,
            kv_cache_dtype: kv,
            max_prefill_tokens: Some(8),
            prefix_cache: false,
            ..DeviceEngineConfig::default()
        };
        let mut engine = DeviceEngine::new(cfg.clone(), &map, config).expect("engine");
        let req = GenerateRequest::new(prompt.clone(), mixed_sampling(1, 6, 70));
        engine.generate(vec![req]).expect("generates").remove(0)
    };
    let (got, want) = (
        chunked(KvCacheDtype::Auto),
        chunked(KvCacheDtype::Fixed(Dtype::F32)),
    );
    assert_bits("chunked prefill", &got, &want);
}

/// KV bytes of one slot of one sequence in `bytes`-byte values (every layer's keys and
/// values).
fn slot_bytes(cfg: &Config, bytes: usize) -> usize {
    let r3_model::AttentionConfig::Gqa {
        num_kv_heads,
        head_dim,
        ..
    } = cfg.attention
    else {
        panic!("a GQA config");
    };
    cfg.num_hidden_layers * num_kv_heads * 2 * head_dim * bytes
}

/// A bf16 cache is budgeted at two bytes a value: a request whose slots (with the room its
/// buffers keep) fit a budget at two bytes but not at four runs with `auto` and is refused
/// with `f32`, naming the KV budget.
#[test]
fn a_sixteen_bit_cache_fits_twice_the_slots_in_a_budget() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 5, DType::F32).into_map();
    let (prompt, new) = (20, 12);
    let slots = r3_model::layers::attention::kv_capacity_for(prompt + new);
    let budget = slots * slot_bytes(&cfg, 2);
    assert!(budget < slots * slot_bytes(&cfg, 4));
    let run = |kv| {
        let config = DeviceEngineConfig {
            device: DEVICE,
            dtype: Dtype::Bf16,
            kv_cache_dtype: kv,
            kv_cache_bytes: budget,
            prefix_cache: false,
            ..DeviceEngineConfig::default()
        };
        let mut engine = DeviceEngine::new(cfg.clone(), &map, config).expect("engine");
        let prompt = sequences(&[prompt], cfg.vocab_size, 31).remove(0);
        engine.generate(vec![GenerateRequest::new(
            prompt,
            SamplingParams::greedy(new),
        )])
    };
    let done = run(KvCacheDtype::Auto).expect("fits at two bytes a value");
    assert_eq!(done[0].output_ids.len(), new);
    let err = run(KvCacheDtype::Fixed(Dtype::F32)).expect_err("past the budget at four bytes");
    assert!(err.to_string().contains("KV"), "{err}");
}

/// OLMoE's `clip_qkv` clamps values after their projection's rounding: with a bound that is
/// no bf16 value (0.1) a clamped value is not one either, so `auto` keeps an f32 cache and
/// gives the f32 cache's bits (a bf16 cache would round the clamped values); with a bf16
/// bound (the fixture's 6.0) the cache is bf16, as the other tests check.
#[test]
fn values_clamped_to_a_bound_off_the_float_keep_an_f32_cache() {
    let mut cfg = tiny_config("olmoe");
    let r3_model::AttentionConfig::Gqa { clip_qkv, .. } = &mut cfg.attention else {
        panic!("OLMoE is GQA");
    };
    *clip_qkv = Some(0.1);
    let map = tiny_weights(&cfg, 3, DType::F32).into_map();
    let mut narrow = engine(&cfg, &map, Dtype::Bf16, KvCacheDtype::Auto);
    let mut wide = engine(&cfg, &map, Dtype::Bf16, KvCacheDtype::Fixed(Dtype::F32));
    for (round, reqs) in rounds(cfg.vocab_size).into_iter().enumerate() {
        let got = narrow.generate(reqs.clone()).expect("auto");
        let want = wide.generate(reqs).expect("f32 cache");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_bits(&format!("clip 0.1 round {round} #{i}"), g, w);
        }
    }
}

/// A fixed 16-bit KV cache dtype other than the engine's is refused by the device engine's
/// own constructor, naming it (it would round the forward's keys), whatever front end built
/// the config; the engine's own dtype, named, is `auto`'s cache.
#[test]
fn the_device_engine_refuses_a_rounding_kv_cache_dtype() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 3, DType::F32).into_map();
    let config = |engine, kv| DeviceEngineConfig {
        device: DEVICE,
        dtype: engine,
        kv_cache_dtype: KvCacheDtype::Fixed(kv),
        ..DeviceEngineConfig::default()
    };
    for (engine, kv) in [
        (Dtype::Bf16, Dtype::F16),
        (Dtype::F16, Dtype::Bf16),
        (Dtype::F32, Dtype::Bf16),
    ] {
        let Err(err) = DeviceEngine::new(cfg.clone(), &map, config(engine, kv)) else {
            panic!("a {kv} cache refused for a {engine} engine");
        };
        let err = err.to_string();
        assert!(err.contains(&format!("KV cache dtype `{kv}`")), "{err}");
    }
    let named = DeviceEngine::new(cfg.clone(), &map, config(Dtype::Bf16, Dtype::Bf16));
    let mut named = named.unwrap_or_else(|e| panic!("the engine's own dtype: {e}"));
    let mut auto = engine(&cfg, &map, Dtype::Bf16, KvCacheDtype::Auto);
    let reqs = rounds(cfg.vocab_size).remove(0);
    let got = named.generate(reqs.clone()).expect("named");
    let want = auto.generate(reqs).expect("auto");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_bits(&format!("bf16 named #{i}"), g, w);
    }
}
