//! The device engine's chunked prefill: a request whose prefill in one step would exceed the
//! activation budget is fed in chunks that fit, one per step beside the running batch's
//! decode, instead of being refused. Checked against independent truth: the same requests
//! run alone on an engine whose budget takes the whole prefill at once (tokens, log-probs,
//! prompt log-probs and routes), the chunk count the budget allows (from the documented
//! estimate), and an abort or a retract in the middle of the chunks, which must resume into
//! the uninterrupted request.
//!
//! The device is the CPU in a default build (CI), CUDA GPU 0 with `--features cuda`
//! (`scripts/cuda/build.sh` builds this file as `r3-rollout-device_chunked_prefill`, which
//! `scripts/cuda/check.sh` step 4 runs on the GPU machine).

mod common;
#[path = "../../r3-model/tests/common/mod.rs"]
mod model_common;

use candle_core::DType;
use common::{assert_same_result, mixed_sampling, prefill_chunks_under, step_bytes, DEVICE};
use model_common::{sequences, tiny_config, tiny_weights};
use r3_model::Config;
use r3_rollout::{
    DeviceEngine, DeviceEngineConfig, Dtype, Engine, EngineConfig, GenerateRequest, GenerateResult,
    MergePolicy, SamplingParams, TensorMap,
};

/// How far a request's log-probs may be from the same request prefilled at once (a chunk's
/// attention sums over fewer keys, grouped otherwise).
const CHUNK_TOL: f32 = if cfg!(feature = "cuda") { 1e-4 } else { 1e-5 };
/// How far the device engine's log-probs may be from the CPU engine's.
const CPU_TOL: f32 = if cfg!(feature = "cuda") { 1e-3 } else { 1e-4 };

/// The long prompt's length: the tiny configs hold 64 positions.
const LONG: usize = 50;

/// A budget that takes three rows decoding over 70 slots (the requests' reach and the
/// padding in front of the shorter ones, once joined), but not the long prompt's prefill in
/// one step.
fn small_budget(cfg: &Config) -> usize {
    let budget = step_bytes(cfg, (3, 1, 70), false, usize::MAX);
    assert!(
        step_bytes(cfg, (1, LONG, LONG), false, budget) > budget,
        "the prefill must not fit"
    );
    budget
}

/// A device engine over `map` with `activation_bytes`, the prefix cache on (blocks of 4) or
/// off.
fn engine(cfg: &Config, map: &TensorMap, activation_bytes: usize, cache: bool) -> DeviceEngine {
    let engine_cfg = DeviceEngineConfig {
        device: DEVICE,
        activation_bytes,
        prefix_cache: cache,
        block_size: 4,
        ..DeviceEngineConfig::default()
    };
    DeviceEngine::new(cfg.clone(), map, engine_cfg).expect("device engine")
}

/// A short request with seeded sampling, and the long one: greedy with top log-probs,
/// prompt log-probs from position 3 (every chunk sends its positions through the head) when
/// `prompt_logprobs`; both returning routes.
fn requests(cfg: &Config, prompt_logprobs: bool) -> [GenerateRequest; 2] {
    let prompts = sequences(&[6, LONG], cfg.vocab_size, 4);
    let mut short = GenerateRequest::new(prompts[0].clone(), mixed_sampling(1, 20, 70));
    let mut long = GenerateRequest::new(
        prompts[1].clone(),
        SamplingParams {
            top_logprobs: 2,
            prompt_logprobs_from: prompt_logprobs.then_some(3),
            ..SamplingParams::greedy(8)
        },
    );
    for r in [&mut short, &mut long] {
        r.return_routes = true;
        r.routed_experts_start_len = 1;
    }
    [short, long]
}

/// Tokens, finish, routes (cell for cell, their range and versions) equal; log-probs, top
/// log-probs and prompt log-probs within `CHUNK_TOL`.
fn assert_same(what: &str, got: &GenerateResult, want: &GenerateResult) {
    assert_same_result(what, got, want, CHUNK_TOL);
}

/// Each request alone on an engine with the default budget (the whole prefill in one step).
fn alone(cfg: &Config, map: &TensorMap, reqs: &[GenerateRequest]) -> Vec<GenerateResult> {
    let mut big = engine(
        cfg,
        map,
        DeviceEngineConfig::default().activation_bytes,
        false,
    );
    reqs.iter()
        .map(|r| big.generate(vec![r.clone()]).expect("alone").remove(0))
        .collect()
}

/// Steps `dev` until it has no work, results by id into `done`.
fn finish(dev: &mut DeviceEngine, done: &mut std::collections::HashMap<u64, GenerateResult>) {
    while dev.has_work() {
        done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
    }
}

/// A long prompt past the budget arrives while a short request decodes: it is fed in as
/// many chunks as the budget cuts, one per step, while the short one goes on decoding a
/// token each step and a third request arriving meanwhile is admitted beside the chunks;
/// then the long one joins and all finish as each alone with the whole prefill at once — on
/// a GQA family, one with a sliding window shorter than a chunk and an MLA one.
#[test]
fn a_prompt_past_the_activation_budget_is_fed_in_chunks_beside_the_decode() {
    for family in ["qwen3_moe", "mixtral", "deepseek_v3"] {
        let cfg = tiny_config(family);
        let map = tiny_weights(&cfg, 17, DType::F32).into_map();
        let mut reqs = requests(&cfg, true).to_vec();
        let mut third =
            GenerateRequest::new(reqs[0].input_ids[1..].to_vec(), mixed_sampling(0, 6, 3));
        third.return_routes = true;
        reqs.push(third);
        let want = alone(&cfg, &map, &reqs);
        let budget = small_budget(&cfg);
        let want_chunks = prefill_chunks_under(&cfg, budget, 0, LONG, true);
        assert!(want_chunks > 2, "{family}: {want_chunks} chunks");
        let mut dev = engine(&cfg, &map, budget, false);
        let short = dev.submit(reqs[0].clone()).expect("submit");
        let mut done = std::collections::HashMap::new();
        for _ in 0..2 {
            done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
        }
        let long = dev
            .submit(reqs[1].clone())
            .expect("the prefill is no bound");
        let mut ids = vec![short, long];
        let mut chunks = 0;
        loop {
            let before = dev.generated_tokens(short).map_or(0, <[u32]>::len);
            done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
            let after = dev.generated_tokens(short).map_or(0, <[u32]>::len);
            assert_eq!(
                after,
                before + 1,
                "{family}: the short request decodes each step"
            );
            chunks += 1;
            let held = dev.queue_lengths();
            match dev.generated_tokens(long) {
                Some([]) if chunks == 1 => {
                    assert_eq!(held, (0, 2), "{family}: both held");
                    // Arriving between chunks, it is admitted at the next step.
                    ids.push(dev.submit(reqs[2].clone()).expect("submit"));
                }
                Some([]) => {
                    assert_eq!(
                        held,
                        (0, 3),
                        "{family}: the third admitted beside the chunks"
                    );
                    assert!(dev.generated_tokens(ids[2]).is_some_and(|t| !t.is_empty()));
                }
                Some(_) => break,
                None => panic!("{family}: the long request left the engine"),
            }
        }
        println!("{family}: {LONG} prompt tokens in {chunks} chunks");
        assert_eq!(chunks, want_chunks, "{family}: chunks");
        finish(&mut dev, &mut done);
        for (id, (w, what)) in ids.iter().zip(want.iter().zip(["short", "long", "third"])) {
            let got = done.remove(id).expect("finished");
            assert_same(&format!("{family} {what}"), &got, w);
        }
    }
}

/// A request aborted between two chunks hands back nothing generated, its chunks' full
/// blocks offered to the prefix cache; resumed, it reads them from the cache and finishes
/// as the uninterrupted request.
#[test]
fn a_request_aborted_between_chunks_resumes_into_the_uninterrupted_one() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 19, DType::F32).into_map();
    let reqs = requests(&cfg, false);
    let want = alone(&cfg, &map, &reqs[1..]).remove(0);
    let mut dev = engine(&cfg, &map, small_budget(&cfg), true);
    let id = dev.submit(reqs[1].clone()).expect("submit");
    for _ in 0..2 {
        assert!(dev.step().expect("step").is_empty());
    }
    assert_eq!(dev.generated_tokens(id), Some(&[][..]), "between chunks");
    let partial = dev.abort(id).expect("abort").expect("held");
    assert!(partial.output_ids.is_empty() && partial.routes.is_none());
    assert!(!dev.has_work());
    let cached = dev.prefix_cache_stats().expect("on").cached_blocks;
    assert!(cached >= 2, "two chunks' full blocks offered: {cached}");
    let rid = dev
        .resume(partial, MergePolicy::KeepPerTokenOrigin)
        .expect("resume");
    let mut done = std::collections::HashMap::new();
    finish(&mut dev, &mut done);
    let got = done.remove(&rid).expect("finished");
    assert!(got.cached_tokens >= 8, "read back: {}", got.cached_tokens);
    assert_same("resumed", &got, &want);
}

/// A retract between two chunks sends the long request back to the queue behind the short
/// one; admitted again, it reads the full blocks its chunks offered from the prefix cache,
/// is fed the rest, and both finish as alone.
#[test]
fn a_retract_between_chunks_queues_the_request_again() {
    let cfg = tiny_config("deepseek_v3");
    let map = tiny_weights(&cfg, 21, DType::F32).into_map();
    let reqs = requests(&cfg, false);
    let want = alone(&cfg, &map, &reqs);
    let mut dev = engine(&cfg, &map, small_budget(&cfg), true);
    let ids: Vec<u64> = reqs
        .iter()
        .map(|r| dev.submit(r.clone()).expect("submit"))
        .collect();
    // The short one is admitted first; the long one's chunks follow a step later.
    let mut done = std::collections::HashMap::new();
    while dev.generated_tokens(ids[1]).is_none() {
        done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
    }
    assert_eq!(
        dev.generated_tokens(ids[1]),
        Some(&[][..]),
        "between chunks"
    );
    assert_eq!(dev.retract_all(), 2);
    assert_eq!(dev.queue_lengths(), (2, 0));
    finish(&mut dev, &mut done);
    for (id, (w, what)) in ids.iter().zip(want.iter().zip(["short", "long"])) {
        let got = done.remove(id).expect("finished");
        assert_same(what, &got, w);
        if what == "long" {
            assert!(
                got.cached_tokens >= 4,
                "its first chunk's blocks: {}",
                got.cached_tokens
            );
        }
    }
}

/// A prompt that starts with a cached prefix and asks prompt log-probs past it: the cache
/// serves the blocks before the first asked-for position, the rest is fed in chunks over
/// them, and the request finishes as on an engine without a cache that prefills at once.
#[test]
fn a_cached_prefix_then_chunks_equal_one_cold_prefill() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 27, DType::F32).into_map();
    let long = requests(&cfg, false)[1].clone();
    let mut head = GenerateRequest::new(long.input_ids[..24].to_vec(), SamplingParams::greedy(2));
    head.return_routes = true;
    let mut asks = long;
    asks.sampling.prompt_logprobs_from = Some(20);
    let want = alone(&cfg, &map, std::slice::from_ref(&asks)).remove(0);
    let budget = small_budget(&cfg);
    let mut dev = engine(&cfg, &map, budget, true);
    dev.generate(vec![head]).expect("the head, cached");
    let id = dev.submit(asks).expect("submit");
    let mut done = std::collections::HashMap::new();
    let mut steps = 0;
    while !done.contains_key(&id) && dev.generated_tokens(id).is_none_or(<[u32]>::is_empty) {
        done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
        steps += 1;
    }
    // 20 positions served (5 blocks of 4, up to the first asked-for one), 30 fed in chunks
    // over them.
    let want_steps = prefill_chunks_under(&cfg, budget, 20, LONG, true);
    assert!(want_steps > 1);
    assert_eq!(steps, want_steps);
    finish(&mut dev, &mut done);
    let got = done.remove(&id).expect("finished");
    assert_eq!(got.cached_tokens, 20);
    assert_same("cached, then chunks", &got, &want);
}

/// A weight update between two chunks: the prefill goes on under the new weights, as the
/// CPU engine's prefill in chunks of the same size does, so both give the same tokens,
/// log-probs, prompt log-probs and routes — the first chunk's route rows at version 0, the
/// rest at 1.
#[test]
fn a_weight_update_between_chunks_goes_on_as_on_the_cpu_engine() {
    let cfg = tiny_config("qwen3_moe");
    let old = tiny_weights(&cfg, 33, DType::F32).into_map();
    let new = tiny_weights(&cfg, 34, DType::F32).into_map();
    let long = requests(&cfg, true)[1].clone();
    let cpu_cfg = EngineConfig {
        dtype: Dtype::F32,
        prefix_cache: false,
        kv_cache_bytes: 64 << 20,
        max_batch_tokens: 16,
        ..EngineConfig::default()
    };
    let mut cpu = Engine::new(cfg.clone(), &old, cpu_cfg).expect("cpu engine");
    let dev_cfg = DeviceEngineConfig {
        device: DEVICE,
        max_prefill_tokens: Some(16),
        prefix_cache: false,
        ..DeviceEngineConfig::default()
    };
    let mut dev = DeviceEngine::new(cfg.clone(), &old, dev_cfg).expect("device engine");
    let (cpu_id, dev_id) = (
        cpu.submit(long.clone()).expect("submit"),
        dev.submit(long).expect("submit"),
    );
    assert!(cpu.step().expect("step").is_empty());
    assert!(dev.step().expect("step").is_empty());
    assert_eq!(
        dev.generated_tokens(dev_id),
        Some(&[][..]),
        "between chunks"
    );
    assert_eq!(cpu.update_weights(&new).expect("update"), 1);
    assert_eq!(dev.update_weights(&new).expect("update"), 1);
    let mut done = std::collections::HashMap::new();
    finish(&mut dev, &mut done);
    let got = done.remove(&dev_id).expect("finished");
    let mut want = None;
    while cpu.has_work() {
        want = want.or(cpu
            .step()
            .expect("step")
            .into_iter()
            .find(|r| r.id == cpu_id));
    }
    let want = want.expect("the CPU engine's");
    assert_eq!(got.weight_version, 1);
    assert_same_result("across the update", &got, &want, CPU_TOL);
    let versions = got
        .routes
        .as_ref()
        .and_then(|r| r.versions())
        .expect("versions");
    // The table starts at position 1 (`routed_experts_start_len`): the first chunk's
    // positions 1..16 at version 0.
    let first_chunk = versions.iter().take_while(|&&v| v == 0).count();
    assert_eq!(first_chunk, 15, "{versions:?}");
    assert!(versions[15..].iter().all(|&v| v == 1), "{versions:?}");
}

/// A cap on a prefill step's positions (`max_prefill_tokens`, `r3 serve
/// --chunked-prefill-size`), with a budget that would take anything: a 50-token prompt is fed
/// in chunks of 16, 16, 16 and 2 (its first token after the fourth step), and four 6-token
/// prompts arriving together are prefilled two at a time (2 × 6 ≤ 16 < 3 × 6); each
/// finishes as alone.
#[test]
fn a_token_cap_chunks_long_prompts_and_splits_prefill_batches() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 29, DType::F32).into_map();
    let engine_cfg = DeviceEngineConfig {
        device: DEVICE,
        max_prefill_tokens: Some(16),
        prefix_cache: false,
        ..DeviceEngineConfig::default()
    };
    let mut dev = DeviceEngine::new(cfg.clone(), &map, engine_cfg).expect("device engine");
    let long = requests(&cfg, true)[1].clone();
    let want = alone(&cfg, &map, std::slice::from_ref(&long)).remove(0);
    let id = dev.submit(long).expect("submit");
    let mut done = std::collections::HashMap::new();
    for step in 1..=4 {
        done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
        let sampled = dev.generated_tokens(id).map_or(0, <[u32]>::len);
        assert_eq!(sampled, usize::from(step == 4), "after step {step}");
    }
    finish(&mut dev, &mut done);
    assert_same("capped", &done.remove(&id).expect("finished"), &want);

    let shorts: Vec<GenerateRequest> = sequences(&[6, 6, 6, 6], cfg.vocab_size, 6)
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = GenerateRequest::new(p, mixed_sampling(i, 10, 40));
            r.return_routes = true;
            r
        })
        .collect();
    let want = alone(&cfg, &map, &shorts);
    let ids: Vec<u64> = shorts
        .iter()
        .map(|r| dev.submit(r.clone()).expect("submit"))
        .collect();
    done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
    assert_eq!(dev.queue_lengths(), (2, 2), "two prefilled, two waiting");
    done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
    assert_eq!(dev.queue_lengths(), (0, 4));
    finish(&mut dev, &mut done);
    for (i, (id, w)) in ids.iter().zip(&want).enumerate() {
        let got = done.remove(id).expect("finished");
        assert_same(&format!("short {i}"), &got, w);
    }
}

/// A request whose last decode step alone exceeds the budget can never run, chunks or not:
/// refused at once, naming the numbers, and nothing is queued.
#[test]
fn a_request_whose_decode_exceeds_the_budget_is_refused() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 23, DType::F32).into_map();
    let mut dev = engine(
        &cfg,
        &map,
        step_bytes(&cfg, (1, 1, 30), false, usize::MAX),
        false,
    );
    let req = GenerateRequest::new(vec![3; 5], SamplingParams::greedy(40));
    let err = dev.submit(req).expect_err("past the budget");
    let text = err.to_string();
    assert!(err.is_client_error(), "{text}");
    assert!(
        text.contains("5 prompt + 40 new") && text.contains("decode") && text.contains("45 slots"),
        "{text}"
    );
    assert!(!dev.has_work());
    let fits = GenerateRequest::new(vec![3; 5], SamplingParams::greedy(20));
    assert_eq!(dev.generate(vec![fits]).expect("fits").len(), 1);
}
