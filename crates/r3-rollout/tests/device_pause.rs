//! The device engine paused for a trainer: running requests retracted (their keys and
//! values dropped, re-prefilled when admitted again) and weights offloaded to the host and
//! brought back. Checked against independent truth: the same requests run without a pause,
//! the CPU engine's own retract under the same weight update, and a fresh engine built from
//! the weights an offloaded engine was updated to.
//!
//! The device is the CPU in a default build (CI), CUDA GPU 0 with `--features cuda`
//! (`scripts/cuda/build.sh` builds this file as `r3-rollout-device_pause`, which
//! `scripts/cuda/check.sh` step 4 runs on the GPU machine).

mod common;
#[path = "../../r3-model/tests/common/mod.rs"]
mod model_common;

use candle_core::DType;
use common::{assert_same_result, cpu_engine_over, prefill_chunks_under, step_bytes, DEVICE};
use model_common::{sequences, tiny_config, tiny_weights};
use r3_model::Config;
use r3_rollout::{
    DeviceEngine, DeviceEngineConfig, Dtype, FinishReason, GenerateRequest, GenerateResult,
    MergePolicy, SamplingParams, TensorMap,
};

/// How far a re-prefilled request's log-probs may be from the same request decoded without
/// a pause (a prefill groups the attention's sums differently from decode steps).
const REFILL_TOL: f32 = if cfg!(feature = "cuda") { 1e-4 } else { 1e-5 };
/// How far the device engine's log-probs may be from the CPU engine's.
const CPU_TOL: f32 = if cfg!(feature = "cuda") { 1e-3 } else { 1e-4 };

/// A device engine over `map`, with or without its prefix cache (blocks of 4 positions, so
/// the tiny prompts and outputs fill some), at `dtype`.
fn device(cfg: &Config, map: &TensorMap, prefix_cache: bool, dtype: Dtype) -> DeviceEngine {
    let engine_cfg = DeviceEngineConfig {
        device: DEVICE,
        dtype,
        prefix_cache,
        block_size: 4,
        ..DeviceEngineConfig::default()
    };
    DeviceEngine::new(cfg.clone(), map, engine_cfg).expect("device engine")
}

/// Requests that exercise what a retracted row must keep: greedy with top log-probs and
/// prompt log-probs; seeded sampling; seeded sampling with penalties, stop ids and a minimum
/// length (which read the tokens generated so far); all returning routes.
fn requests(cfg: &Config) -> Vec<GenerateRequest> {
    let prompts = sequences(&[7, 5, 9], cfg.vocab_size, 11);
    let samplings = [
        SamplingParams {
            top_logprobs: 2,
            prompt_logprobs_from: Some(2),
            ..SamplingParams::greedy(10)
        },
        SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed: 5,
            ..SamplingParams::greedy(12)
        },
        SamplingParams {
            temperature: 1.0,
            frequency_penalty: 0.7,
            repetition_penalty: 1.3,
            // A third of the vocabulary stops it, but not before its sixth token: a row
            // retracted earlier must still count what it generated.
            stop_token_ids: (0..cfg.vocab_size as u32).step_by(3).collect(),
            min_new_tokens: 6,
            seed: 8,
            ..SamplingParams::greedy(11)
        },
    ];
    prompts
        .into_iter()
        .zip(samplings)
        .map(|(p, s)| {
            let mut req = GenerateRequest::new(p, s);
            req.return_routes = true;
            req.routed_experts_start_len = 1;
            req
        })
        .collect()
}

/// Submits `reqs`, runs `steps` steps, calls `pause` on the engine, then steps until all
/// finish; results in input order.
fn run_paused(
    dev: &mut DeviceEngine,
    reqs: &[GenerateRequest],
    steps: usize,
    pause: impl FnOnce(&mut DeviceEngine),
) -> Vec<GenerateResult> {
    let ids: Vec<u64> = reqs
        .iter()
        .map(|r| dev.submit(r.clone()).expect("submit"))
        .collect();
    let mut done = std::collections::HashMap::new();
    for _ in 0..steps {
        for r in dev.step().expect("step") {
            done.insert(r.id, r);
        }
    }
    pause(dev);
    while dev.has_work() {
        for r in dev.step().expect("step") {
            done.insert(r.id, r);
        }
    }
    ids.iter()
        .map(|id| done.remove(id).expect("finished"))
        .collect()
}

/// Requests retracted mid-generation are re-prefilled when admitted again and finish as
/// without the retract, with
/// the prefix cache off and on (where the re-prefill reads the retracted rows' own blocks),
/// on a GQA and an MLA family.
#[test]
fn retracted_requests_finish_as_without_the_retract() {
    for family in ["qwen3_moe", "deepseek_v3"] {
        let cfg = tiny_config(family);
        let map = tiny_weights(&cfg, 31, DType::F32).into_map();
        let reqs = requests(&cfg);
        for prefix_cache in [false, true] {
            let what = format!("{family}, prefix cache {prefix_cache}");
            let want = run_paused(
                &mut device(&cfg, &map, prefix_cache, Dtype::F32),
                &reqs,
                0,
                |_| {},
            );
            // The third request stops on a stop id once its minimum length allows.
            let third = &want[2];
            assert!(
                matches!(third.finish, FinishReason::Stop { .. }) && third.output_ids.len() >= 6,
                "{what}: {:?} after {} tokens",
                third.finish,
                third.output_ids.len()
            );
            for steps in [1, 4] {
                let mut dev = device(&cfg, &map, prefix_cache, Dtype::F32);
                let got = run_paused(&mut dev, &reqs, steps, |dev| {
                    let running = dev.queue_lengths().1;
                    assert!(running > 0, "{what}: nothing running at step {steps}");
                    assert_eq!(dev.retract_all(), running, "{what}");
                    assert_eq!(dev.queue_lengths(), (reqs.len(), 0), "{what}");
                });
                // With the cache on, the retracted rows' prefill read back every full block
                // of the positions they had fed (offered when retracted, generated tokens
                // included), keeping the route rows they hold: all but the last position,
                // or up to the first prompt log-prob asked for.
                let fed_blocks: u64 = reqs
                    .iter()
                    .map(|r| {
                        let fed = r.input_ids.len() + steps - 1;
                        let servable = r.sampling.prompt_logprobs_from.map_or(fed, |f| f.min(fed));
                        (servable / 4) as u64
                    })
                    .sum();
                let hits = dev.prefix_cache_stats().map_or(0, |s| s.hit_blocks);
                let want_hits = if prefix_cache { fed_blocks } else { 0 };
                assert_eq!(hits, want_hits, "{what}, step {steps}: blocks hit");
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_same_result(
                        &format!("{what}, step {steps}, request {i}"),
                        g,
                        w,
                        REFILL_TOL,
                    );
                }
            }
        }
    }
}

/// Retracted, then the weights updated, then continued: the device engine gives what the
/// CPU engine gives under the same retract and update — the tokens before the update the
/// old weights', after it the new ones', and each route row the version that produced it.
#[test]
fn a_retract_across_a_weight_update_matches_the_cpu_engine() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 31, DType::F32).into_map();
    let new_map = tiny_weights(&cfg, 32, DType::F32).into_map();
    let reqs = requests(&cfg);
    let mut cpu = cpu_engine_over(&cfg, &map);
    let ids: Vec<u64> = reqs
        .iter()
        .map(|r| cpu.submit(r.clone()).expect("submit"))
        .collect();
    let mut done = std::collections::HashMap::new();
    for _ in 0..3 {
        done.extend(cpu.step().expect("step").into_iter().map(|r| (r.id, r)));
    }
    assert_eq!(cpu.retract_all(), reqs.len());
    cpu.update_weights(&new_map).expect("cpu update");
    while cpu.has_work() {
        done.extend(cpu.step().expect("step").into_iter().map(|r| (r.id, r)));
    }
    let want: Vec<GenerateResult> = ids
        .iter()
        .map(|id| done.remove(id).expect("done"))
        .collect();

    let mut dev = device(&cfg, &map, false, Dtype::F32);
    let got = run_paused(&mut dev, &reqs, 3, |dev| {
        assert_eq!(dev.retract_all(), reqs.len());
        dev.update_weights(&new_map).expect("device update");
    });
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let versions = g
            .routes
            .as_ref()
            .and_then(|r| r.versions())
            .expect("versions");
        assert!(
            versions.contains(&0) && versions.contains(&1),
            "request {i}: rows of both versions"
        );
        assert_same_result(&format!("request {i}"), g, w, CPU_TOL);
    }
}

/// A retracted request aborted while it waits returns everything it made — its tokens and
/// its route rows up to the last fed position — and resumes into the uninterrupted
/// request; the others finish as without the retract.
#[test]
fn a_retracted_request_aborted_while_waiting_resumes_into_the_whole_one() {
    let cfg = tiny_config("deepseek_v3");
    let map = tiny_weights(&cfg, 31, DType::F32).into_map();
    let reqs = requests(&cfg);
    let want = run_paused(&mut device(&cfg, &map, false, Dtype::F32), &reqs, 0, |_| {});
    let mut dev = device(&cfg, &map, false, Dtype::F32);
    let ids: Vec<u64> = reqs
        .iter()
        .map(|r| dev.submit(r.clone()).expect("submit"))
        .collect();
    for _ in 0..4 {
        assert!(dev.step().expect("step").is_empty());
    }
    assert_eq!(dev.retract_all(), reqs.len());
    let partial = dev.abort(ids[1]).expect("abort").expect("waiting");
    assert_eq!(partial.output_ids, want[1].output_ids[..4]);
    let routes = partial.routes.as_ref().expect("routes");
    // Positions 0..prompt + 3 were fed (the 4th token is not yet).
    assert_eq!(routes.end_pos(), reqs[1].input_ids.len() + 3);
    let resumed = dev
        .resume(partial, MergePolicy::KeepPerTokenOrigin)
        .expect("resume");
    let mut done = std::collections::HashMap::new();
    while dev.has_work() {
        done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
    }
    for (i, id) in [(0, ids[0]), (1, resumed), (2, ids[2])] {
        let got = done.remove(&id).expect("finished");
        assert_same_result(&format!("request {i}"), &got, &want[i], REFILL_TOL);
    }
}

/// Offloaded weights: generation refused by name while they are on the host; a request
/// running refuses the offload; queued (retracted) requests wait through it and finish as
/// without the pause; an update while offloaded writes the host copy, and the weights
/// brought back are then exactly those of an engine built from the update (f32 and bf16).
#[test]
fn offloaded_weights_come_back_as_they_were_or_as_updated() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 31, DType::F32).into_map();
    let new_map = tiny_weights(&cfg, 33, DType::F32).into_map();
    let reqs = requests(&cfg);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let what = format!("{dtype}");
        let want = run_paused(&mut device(&cfg, &map, true, dtype), &reqs, 0, |_| {});
        let mut dev = device(&cfg, &map, true, dtype);
        let got = run_paused(&mut dev, &reqs, 2, |dev| {
            let Err(e) = dev.offload_weights() else {
                panic!("{what}: weights offloaded under running requests");
            };
            assert!(e.to_string().contains("requests run"), "{what}: {e}");
            dev.retract_all();
            dev.offload_weights().expect("offload");
            assert!(dev.weights_offloaded(), "{what}");
            let Err(e) = dev.step() else {
                panic!("{what}: a step ran on offloaded weights");
            };
            assert!(e.to_string().contains("offloaded"), "{what}: {e}");
            assert_eq!(dev.queue_lengths(), (reqs.len(), 0), "{what}: queue kept");
            dev.onload_weights().expect("onload");
            assert!(!dev.weights_offloaded(), "{what}");
        });
        // A bf16 prefill and decode steps may round the GEMMs' sums apart on a GPU.
        let tol = if dtype == Dtype::F32 {
            REFILL_TOL
        } else {
            CPU_TOL
        };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_same_result(&format!("{what}, request {i}"), g, w, tol);
        }

        // Updated while on the host: the version moves, and what comes back is the update.
        let version = dev.weight_version();
        dev.offload_weights().expect("offload");
        assert_eq!(dev.update_weights(&new_map).expect("update"), version + 1);
        assert!(
            dev.weights_offloaded(),
            "{what}: the update stayed on the host"
        );
        dev.onload_weights().expect("onload");
        assert_eq!(dev.weight_version(), version + 1, "{what}");
        let fresh = run_paused(&mut device(&cfg, &new_map, true, dtype), &reqs, 0, |_| {});
        let got = run_paused(&mut dev, &reqs, 0, |_| {});
        for (i, (g, w)) in got.iter().zip(&fresh).enumerate() {
            assert_eq!(g.output_ids, w.output_ids, "{what}, updated request {i}");
            assert_eq!(
                g.output_logprobs, w.output_logprobs,
                "{what}, updated request {i}: bits"
            );
        }
    }
}

/// Weights released without a copy (a trainer's `release_weights`) do not come back by an
/// onload, naming why; an update brings them back as before.
#[test]
fn released_weights_are_not_brought_back_by_an_onload() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 31, DType::F32).into_map();
    let mut dev = device(&cfg, &map, false, Dtype::F32);
    dev.offload_weights().expect("offload");
    dev.release_weights().expect("release the host copy too");
    assert!(dev.weights_released() && !dev.weights_offloaded());
    let Err(e) = dev.onload_weights() else {
        panic!("released weights came back without an update");
    };
    assert!(e.to_string().contains("weight update"), "{e}");
    dev.update_weights(&map).expect("update");
    let reqs = requests(&cfg);
    assert_eq!(
        dev.generate(reqs.clone()).expect("generates").len(),
        reqs.len()
    );
}

/// A row whose prefill over all its tokens would alone exceed the activation budget is
/// retracted like the others and fed again in chunks, as many as the budget cuts (each the
/// longest step within it), while the row queued behind it is admitted beside the chunks;
/// both finish as without the retract, routes and their versions included.
#[test]
fn a_row_too_long_to_prefill_again_at_once_is_fed_again_in_chunks() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 31, DType::F32).into_map();
    let bytes = |rows, time, slots| step_bytes(&cfg, (rows, time, slots), false, usize::MAX);
    // Room for two rows decoding over 80 slots and a prefill of 8 tokens at least, not of 32.
    let budget = bytes(2, 1, 80).max(bytes(1, 8, 8));
    assert!(step_bytes(&cfg, (1, 32, 32), false, budget) > budget);
    let engine = |cfg: &Config| {
        let engine_cfg = DeviceEngineConfig {
            device: DEVICE,
            prefix_cache: false,
            activation_bytes: budget,
            ..DeviceEngineConfig::default()
        };
        DeviceEngine::new(cfg.clone(), &map, engine_cfg).expect("device engine")
    };
    let prompts = sequences(&[4, 4], cfg.vocab_size, 12);
    let [long, short] = [(0, 40), (1, 20)].map(|(i, new)| {
        let mut r = GenerateRequest::new(prompts[i].clone(), SamplingParams::greedy(new));
        r.return_routes = true;
        r.routed_experts_start_len = 1;
        r
    });
    let mut alone = engine(&cfg);
    let want: Vec<GenerateResult> = [&long, &short]
        .iter()
        .map(|r| alone.generate(vec![(*r).clone()]).expect("alone").remove(0))
        .collect();

    let mut dev = engine(&cfg);
    let ids = [dev.submit(long).expect("submit"), 0];
    let mut done = std::collections::HashMap::new();
    for _ in 0..28 {
        done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
    }
    let ids = [ids[0], dev.submit(short).expect("submit")];
    for _ in 0..2 {
        done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
    }
    assert_eq!(dev.queue_lengths(), (0, 2));
    assert_eq!(dev.retract_all(), 2, "both rows");
    assert_eq!(dev.queue_lengths(), (2, 0));
    assert_eq!(dev.generated_tokens(ids[0]), None, "waiting");
    // 4 + 30 tokens to feed again, each chunk the longest step over the slots fed before it
    // that the budget takes: nothing sampled until the last.
    let want_chunks = prefill_chunks_under(&cfg, budget, 0, 34, false);
    let mut chunks = 0;
    while dev.generated_tokens(ids[0]).map_or(0, <[u32]>::len) <= 30 {
        done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
        chunks += 1;
    }
    assert!(want_chunks > 1);
    assert_eq!(chunks, want_chunks);
    // The short row, admitted at the second chunk's step, decoded at each one after.
    let beside = dev.generated_tokens(ids[1]).map(<[u32]>::len);
    assert_eq!(
        beside,
        Some(2 + chunks - 1),
        "its 2 tokens before the retract, then 1 a step"
    );
    while dev.has_work() {
        done.extend(dev.step().expect("step").into_iter().map(|r| (r.id, r)));
    }
    for (id, w) in ids.iter().zip(&want) {
        let got = done.remove(id).expect("finished");
        assert_same_result(&format!("request {id}"), &got, w, REFILL_TOL);
    }
}
