//! The device engine (`DeviceEngine`, r3-model's layers on candle tensors with a KV cache of
//! device tensors) against independent truth, on the CPU device: greedy generation equal to
//! the HF oracle's and to the CPU engine's (every oracle fixture, the other families' in
//! r3-model's fixture folder too), routes equal to the CPU engine's (counted cell by
//! cell; a tie of two router logits within rounding would be reported), seeded sampling that
//! reproduces itself and the CPU engine's tokens, prompt log-probs equal to the CPU engine's,
//! a batch of prompts of different lengths equal to running them one at a time, an abort,
//! and bad requests refused by name.

//!
//! The device is a value: the CPU in a default build (CI), CUDA GPU 0 in a build with
//! `--features cuda` (`scripts/cuda/build.sh` builds this file as `r3-rollout-device_engine`
//! and `scripts/cuda/check.sh` runs it on the GPU machine, from the crate folder: fixtures
//! are found relative to the working directory, so the binary runs without the source tree).

mod common;
#[path = "../../r3-model/tests/common/mod.rs"]
mod model_common;

use std::path::PathBuf;

use candle_core::DType;
use common::{
    assert_same_extras, assert_same_routes, cpu_engine_over, differing_cells, family_fixtures, ids,
    max_abs_diff, mixed_sampling, oracle_of, DEVICE, FAMILY_MODELS, MODELS,
};
use model_common::{sequences, tiny_config, tiny_weights, FAMILIES};
use r3_model::Config;
use r3_rollout::device_engine::memory::{score_tiles, step_activation_bytes, StepShape};
use r3_rollout::{
    DeviceEngine, DeviceEngineConfig, Dtype, Engine, EngineConfig, GenerateRequest, GenerateResult,
    RoutingPlace, SamplingParams, TensorMap,
};

/// How far the device engine's log-probs may be from the CPU engine's (f32): composed
/// candle ops against the CPU engine's own kernels, and on a GPU cuBLAS and CUDA kernels.
const LOGPROB_TOL: f32 = if cfg!(feature = "cuda") { 1e-3 } else { 1e-4 };
/// How far a batched request's log-probs may be from the same request alone (padding keys
/// add exact zeros, but reductions may group differently).
const BATCH_TOL: f32 = if cfg!(feature = "cuda") { 1e-4 } else { 1e-5 };

/// A fixture directory, relative to the crate folder (the working directory of tests): the
/// other families' oracle checkpoints are r3-model's.
fn model_dir(name: &str) -> PathBuf {
    if FAMILY_MODELS.contains(&name) {
        family_fixtures().join(name)
    } else {
        PathBuf::from("tests/fixtures").join(name)
    }
}

/// The oracle subset of both fixture models.
fn oracle() -> serde_json::Value {
    let text = std::fs::read_to_string(model_dir("oracle_subset.json")).expect("oracle fixture");
    serde_json::from_str(&text).expect("oracle fixture is JSON")
}

/// The device engine without its prefix cache: these tests compare batching, admission and
/// aborts against runs alone, each computing every position (`device_prefix_cache.rs`
/// compares the cache on against off).
fn device_config() -> DeviceEngineConfig {
    DeviceEngineConfig {
        device: DEVICE,
        prefix_cache: false,
        ..DeviceEngineConfig::default()
    }
}

fn device_engine(name: &str) -> DeviceEngine {
    DeviceEngine::from_dir(&model_dir(name), device_config()).expect("loads")
}

/// The CPU engine over a fixture model, f32, no prefix cache.
fn cpu_engine(name: &str) -> Engine {
    Engine::from_dir(
        &model_dir(name),
        EngineConfig {
            dtype: Dtype::F32,
            prefix_cache: false,
            kv_cache_bytes: 64 << 20,
            ..EngineConfig::default()
        },
    )
    .expect("cpu engine")
}

/// Tokens, log-probs (within `tol`) and routes (cell for cell) of two results agree.
fn assert_same(what: &str, got: &GenerateResult, want: &GenerateResult, tol: f32) {
    assert_eq!(got.output_ids, want.output_ids, "{what}: tokens");
    assert_eq!(got.finish, want.finish, "{what}: finish");
    let d = max_abs_diff(&got.output_logprobs, &want.output_logprobs);
    assert!(d <= tol, "{what}: log-probs differ by {d}");
    assert_same_routes(what, &got.routes, &want.routes);
    println!("{what}: routes agree, log-probs within {d:.2e}");
}

#[test]
fn greedy_generation_equals_hf_and_the_cpu_engine() {
    for name in MODELS.into_iter().chain(FAMILY_MODELS) {
        let o = if MODELS.contains(&name) {
            oracle()
        } else {
            oracle_of(name)
        };
        let g = &o[name]["greedy"];
        let prompt = ids(&g["prompt"]);
        let want = ids(&g["output_ids"]);
        let new = want.len() - prompt.len();
        let req = GenerateRequest::new(prompt.clone(), SamplingParams::greedy(new));
        let got = device_engine(name)
            .generate(vec![req.clone()])
            .expect("device generate")
            .remove(0);
        assert_eq!(
            got.output_ids,
            want[prompt.len()..],
            "{name}: HF's greedy tokens"
        );
        // A dense model routes nothing (the CPU engine's result must agree below).
        if let Some(routes) = &got.routes {
            assert_eq!(
                routes.num_tokens(),
                want.len() - 1,
                "{name}: prompt + generated - 1 rows"
            );
        }
        let dense = o[name]["moe_layers"]
            .as_object()
            .expect("moe_layers")
            .is_empty();
        assert_eq!(got.routes.is_none(), dense, "{name}: routes iff MoE");
        let cpu = cpu_engine(name)
            .generate(vec![req])
            .expect("cpu generate")
            .remove(0);
        assert_same(name, &got, &cpu, LOGPROB_TOL);
    }
}

/// The host's waits for the device are counted where they happen, inside the generation's
/// wall time: every step copies its logits, and every MoE layer its router logits.
#[test]
fn the_hosts_waits_for_the_device_are_counted_within_the_wall_time() {
    let mut engine = device_engine(MODELS[0]);
    assert_eq!(engine.device_wait_seconds(), 0.0);
    let started = std::time::Instant::now();
    let reqs = (0..3u32)
        .map(|i| GenerateRequest::new(vec![3 + i, 5, 7], SamplingParams::greedy(6)))
        .collect();
    engine.generate(reqs).expect("generate");
    let wall = started.elapsed().as_secs_f64();
    let waited = engine.device_wait_seconds();
    assert!(
        waited > 0.0 && waited < wall,
        "waited {waited} s of {wall} s"
    );
}

/// A CPU engine and a device engine over the same tensors.
fn both(cfg: &Config, map: &TensorMap) -> (Engine, DeviceEngine) {
    let cpu = cpu_engine_over(cfg, map);
    let dev = DeviceEngine::new(cfg.clone(), map, device_config()).expect("device");
    (cpu, dev)
}

#[test]
fn every_family_generates_as_the_cpu_engine_greedy_and_seeded() {
    for family in FAMILIES {
        let cfg = tiny_config(family);
        let map = tiny_weights(&cfg, 7, DType::F32).into_map();
        let (mut cpu, mut dev) = both(&cfg, &map);
        let prompt = sequences(&[9], cfg.vocab_size, 4).remove(0);
        let greedy = GenerateRequest::new(prompt.clone(), SamplingParams::greedy(10));
        let sampled = GenerateRequest::new(
            prompt,
            SamplingParams {
                temperature: 1.0,
                top_p: 0.95,
                max_new_tokens: 10,
                seed: 1234,
                ..SamplingParams::default()
            },
        );
        let reqs = vec![greedy, sampled.clone()];
        let want = cpu.generate(reqs.clone()).expect("cpu");
        let got = dev.generate(reqs).expect("device");
        assert_same(&format!("{family} greedy"), &got[0], &want[0], LOGPROB_TOL);
        assert_same(&format!("{family} seeded"), &got[1], &want[1], LOGPROB_TOL);
        // Same seed, same tokens: the sampled request again, alone.
        let again = dev.generate(vec![sampled]).expect("again").remove(0);
        assert_eq!(
            again.output_ids, got[1].output_ids,
            "{family}: seed reproduces"
        );
    }
}

/// Every decode and prefill step routed on the device (`RoutingPlace::Device`: each MoE
/// layer's top-k, gates and gathered experts without the host, the step's routes copied
/// once) generates what routing on the host generates, for every family (DeepSeek-V3's
/// grouped selection with its score bias included), in f32 and bf16: a batch of greedy and
/// seeded requests of different prompt lengths, tokens and routes equal, log-probs within
/// the tolerance.
#[test]
fn routed_on_the_device_every_family_generates_as_routed_on_the_host() {
    let mut checked = 0;
    for family in FAMILIES {
        let cfg = tiny_config(family);
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let weights = if dtype == Dtype::Bf16 {
                DType::BF16
            } else {
                DType::F32
            };
            let map = tiny_weights(&cfg, 7, weights).into_map();
            let engine = |routing| {
                DeviceEngine::new(
                    cfg.clone(),
                    &map,
                    DeviceEngineConfig {
                        dtype,
                        routing,
                        ..device_config()
                    },
                )
            };
            let mut host = engine(RoutingPlace::Host).expect("host-routed engine");
            let mut dev = engine(RoutingPlace::Device).expect("device-routed engine");
            let prompts = sequences(&[5, 9, 3], cfg.vocab_size, 4);
            let mut reqs: Vec<GenerateRequest> = prompts
                .iter()
                .map(|p| GenerateRequest::new(p.clone(), SamplingParams::greedy(8)))
                .collect();
            reqs.push(GenerateRequest::new(
                prompts[1].clone(),
                SamplingParams {
                    temperature: 1.0,
                    max_new_tokens: 8,
                    seed: 99,
                    ..SamplingParams::default()
                },
            ));
            let want = host.generate(reqs.clone()).expect("routed on the host");
            let got = dev.generate(reqs).expect("routed on the device");
            let (on_device, steps) = dev.steps_routed_on_device();
            assert!(
                steps >= 8 && on_device == steps,
                "{family}: {on_device} of {steps}"
            );
            assert_eq!(host.steps_routed_on_device().0, 0, "{family}: host routing");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // Other GEMM shapes (one row a slot against one block an expert): the
                // device engine's tolerance against the CPU engine's sums.
                assert_same(&format!("{family} {dtype} request {i}"), g, w, LOGPROB_TOL);
            }
            checked += 1;
        }
    }
    assert_eq!(
        checked,
        2 * FAMILIES.len(),
        "family × dtype runs routed on the device"
    );
}

/// Greedy requests whose pick is reduced on the device (plain greedy, top-k 1) batched with
/// greedy requests that need their whole row on the host (a repetition penalty, a logit
/// bias, a minimum length that holds the end-of-sequence token back for the first steps,
/// top log-probs), and sampled requests drawn on the device (temperature 1 and 0.8 over the
/// whole vocabulary: the uniform from the request's stream, the column picked where the
/// logits live) beside sampled ones the host samples (top-p, a presence penalty, top
/// log-probs): every request's tokens, log-probs and routes equal the CPU engine's, whose
/// sampler reads every row (so each stream is where the host's sampling leaves it).
#[test]
fn picks_on_the_device_beside_rows_sampled_on_the_host_equal_the_cpu_engine() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 11, DType::F32).into_map();
    let (mut cpu, mut dev) = both(&cfg, &map);
    let prompts = sequences(&[5, 9, 3, 7, 6, 4], cfg.vocab_size, 21);
    let greedy = SamplingParams::greedy(8);
    let variants = [
        greedy.clone(),
        SamplingParams {
            temperature: 0.7,
            top_k: 1,
            ..greedy.clone()
        },
        SamplingParams {
            repetition_penalty: 1.3,
            ..greedy.clone()
        },
        SamplingParams {
            logit_bias: vec![(3, 2.5)],
            ..greedy.clone()
        },
        SamplingParams {
            min_new_tokens: 3,
            stop_token_ids: vec![prompts[4][0]],
            ..greedy.clone()
        },
        SamplingParams {
            top_logprobs: 2,
            ..greedy
        },
    ];
    let mut reqs: Vec<GenerateRequest> = prompts
        .iter()
        .zip(variants)
        .map(|(p, s)| GenerateRequest::new(p.clone(), s))
        .collect();
    // Sampled requests: drawn on the device (temperature 1 and 0.8 over the whole
    // vocabulary) beside ones the host samples (top-p, a presence penalty, top log-probs).
    let sampled = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 8,
        seed: 77,
        ..SamplingParams::default()
    };
    for (i, params) in [
        sampled.clone(),
        SamplingParams {
            temperature: 0.8,
            seed: 78,
            ..sampled.clone()
        },
        SamplingParams {
            top_p: 0.9,
            seed: 79,
            ..sampled.clone()
        },
        SamplingParams {
            presence_penalty: 0.5,
            seed: 80,
            ..sampled.clone()
        },
        SamplingParams {
            top_logprobs: 3,
            seed: 81,
            ..sampled
        },
    ]
    .into_iter()
    .enumerate()
    {
        reqs.push(GenerateRequest::new(prompts[i].clone(), params));
    }
    let want = cpu.generate(reqs.clone()).expect("cpu");
    let got = dev.generate(reqs).expect("device");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_same(&format!("request {i}"), g, w, LOGPROB_TOL);
        let tops = |r: &GenerateResult| -> Vec<u32> {
            r.output_top_logprobs
                .iter()
                .flatten()
                .map(|e| e.0)
                .collect()
        };
        assert_eq!(tops(g), tops(w), "request {i}: top log-prob ids");
        assert_eq!(
            g.output_top_logprobs.len(),
            if i == 5 || i == 10 {
                g.output_ids.len()
            } else {
                0
            },
            "request {i}: top log-probs per token"
        );
    }
}

#[test]
fn a_batch_of_different_lengths_equals_one_at_a_time() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 3, DType::F32).into_map();
    let (_, mut dev) = both(&cfg, &map);
    let prompts = sequences(&[3, 11, 6, 1], cfg.vocab_size, 9);
    let reqs: Vec<GenerateRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = GenerateRequest::new(
                p.clone(),
                SamplingParams {
                    temperature: 0.8,
                    max_new_tokens: 4 + 3 * i,
                    seed: 50 + i as u64,
                    top_logprobs: 2,
                    ..SamplingParams::default()
                },
            );
            r.routed_experts_start_len = i.min(p.len());
            r
        })
        .collect();
    let batched = dev.generate(reqs.clone()).expect("batch");
    for (i, req) in reqs.into_iter().enumerate() {
        let alone = dev.generate(vec![req]).expect("alone").remove(0);
        assert_same(&format!("request {i}"), &batched[i], &alone, BATCH_TOL);
        assert_eq!(batched[i].output_top_logprobs.len(), alone.output_ids.len());
    }
    // Requests finishing at different steps left the batch one by one.
    let lengths: Vec<usize> = batched.iter().map(|r| r.output_ids.len()).collect();
    assert_eq!(lengths, vec![4, 7, 10, 13]);
}

#[test]
fn an_aborted_request_leaves_the_others_running() {
    let cfg = tiny_config("mixtral");
    let map = tiny_weights(&cfg, 5, DType::F32).into_map();
    let (_, mut dev) = both(&cfg, &map);
    let prompts = sequences(&[4, 7, 5], cfg.vocab_size, 1);
    let reqs: Vec<GenerateRequest> = prompts
        .iter()
        .map(|p| GenerateRequest::new(p.clone(), SamplingParams::greedy(6)))
        .collect();
    let alone: Vec<GenerateResult> = reqs
        .iter()
        .map(|r| dev.generate(vec![r.clone()]).expect("alone").remove(0))
        .collect();
    let ids: Vec<u64> = reqs
        .into_iter()
        .map(|r| dev.submit(r).expect("submit"))
        .collect();
    assert!(dev.step().expect("prefill").is_empty());
    assert!(dev.step().expect("decode").is_empty());
    let partial = dev.abort(ids[1]).expect("abort").expect("running");
    assert_eq!(
        partial.output_ids,
        alone[1].output_ids[..2],
        "tokens so far"
    );
    let routes = partial.routes.expect("routes so far");
    assert_eq!(routes.num_tokens(), 7 + 2 - 1, "fed positions");
    assert!(dev.abort(ids[1]).expect("abort twice").is_none());
    let mut done = Vec::new();
    while dev.has_work() {
        done.extend(dev.step().expect("step"));
    }
    done.sort_by_key(|r| r.id);
    assert_eq!(done.len(), 2);
    assert_same("first", &done[0], &alone[0], BATCH_TOL);
    assert_same("third", &done[1], &alone[2], BATCH_TOL);
}

/// On a GPU, budgets past the memory the driver reports free with the model loaded refuse
/// the engine at its start, naming every budget and the free memory, where the first large
/// step would have run out of memory (the CPU reports no free memory, so there is nothing to
/// compare: a GPU test only).
#[cfg(feature = "cuda")]
#[test]
fn budgets_past_the_gpus_free_memory_refuse_the_engine_by_name() {
    let Err(err) = DeviceEngine::from_dir(
        &model_dir("qwen3_moe_tiny"),
        DeviceEngineConfig {
            kv_cache_bytes: 1 << 50,
            ..device_config()
        },
    ) else {
        panic!("a petabyte of KV cache was accepted");
    };
    let text = err.to_string();
    for part in [
        "KV cache",
        "activations",
        "exceed what",
        "free with the model loaded",
    ] {
        assert!(text.contains(part), "{part:?} in {text}");
    }
}

#[test]
fn bad_requests_are_refused_naming_what_is_wrong() {
    let mut dev = device_engine("qwen3_moe_tiny");
    let max_pos = dev.model_config().max_position_embeddings;
    let vocab = dev.model_config().vocab_size;
    let too_long = GenerateRequest::new(vec![1; max_pos], SamplingParams::greedy(1));
    let err = dev.submit(too_long).expect_err("prompt past the context");
    assert!(err.to_string().contains("max_position_embeddings"), "{err}");
    let bad_id = GenerateRequest::new(vec![vocab as u32], SamplingParams::greedy(1));
    let err = dev.submit(bad_id).expect_err("id past the vocabulary");
    assert!(err.to_string().contains("vocabulary"), "{err}");
    let mut small = DeviceEngine::from_dir(
        &model_dir("qwen3_moe_tiny"),
        DeviceEngineConfig {
            kv_cache_bytes: 1024,
            ..device_config()
        },
    )
    .expect("loads");
    let err = small
        .submit(GenerateRequest::new(vec![1; 8], SamplingParams::greedy(8)))
        .expect_err("past the KV budget");
    assert!(err.to_string().contains("KV cache"), "{err}");
    assert!(
        !dev.has_work() && !small.has_work(),
        "nothing refused was queued"
    );
}

#[test]
fn prompt_logprobs_equal_the_cpu_engines_in_a_batch() {
    let cfg = tiny_config("olmoe");
    let map = tiny_weights(&cfg, 8, DType::F32).into_map();
    let (mut cpu, mut dev) = both(&cfg, &map);
    let prompts = sequences(&[6, 2, 9], cfg.vocab_size, 5);
    let reqs: Vec<GenerateRequest> = prompts
        .iter()
        .zip([Some(0), Some(1), None])
        .map(|(p, from)| {
            let mut r = GenerateRequest::new(p.clone(), SamplingParams::greedy(3));
            r.sampling.prompt_logprobs_from = from;
            r.sampling.top_logprobs = 2;
            r
        })
        .collect();
    let want = cpu.generate(reqs.clone()).expect("cpu");
    let got = dev.generate(reqs).expect("device");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_same(&format!("request {i}"), g, w, LOGPROB_TOL);
        match (&g.prompt_logprobs, &w.prompt_logprobs) {
            (Some(a), Some(b)) => {
                assert_eq!(a.start, b.start, "request {i}: start");
                assert_eq!(
                    a.logprobs.len(),
                    prompts[i].len() - 1 - a.start,
                    "request {i}"
                );
                let d = max_abs_diff(&a.logprobs, &b.logprobs);
                assert!(
                    d <= LOGPROB_TOL,
                    "request {i}: prompt log-probs differ by {d}"
                );
                let ids = |t: &Vec<Vec<(u32, f32)>>| -> Vec<Vec<u32>> {
                    t.iter().map(|r| r.iter().map(|e| e.0).collect()).collect()
                };
                assert_eq!(ids(&a.top_logprobs), ids(&b.top_logprobs), "request {i}");
            }
            (None, None) => {}
            _ => panic!("request {i}: one engine reported prompt log-probs, the other not"),
        }
    }
}

/// The trainer's native routes (r3-model's `Record` forward over prompt + output on the same
/// device, in the engine's precision) against the routes the device engine captured while
/// generating.
#[test]
fn captured_routes_equal_the_trainers_native_routes_f32_and_bf16() {
    use r3_model::{Batch, Model, Precision, Routing, Weights};
    for family in ["qwen3_moe", "deepseek_v3"] {
        let cfg = tiny_config(family);
        let weights = tiny_weights(&cfg, 21, DType::F32);
        let map = weights.clone().into_map();
        for (dtype, precision) in [
            (Dtype::F32, Precision::F32),
            (Dtype::Bf16, Precision::Bf16 { router_f32: false }),
        ] {
            let mut dev = DeviceEngine::new(
                cfg.clone(),
                &map,
                DeviceEngineConfig {
                    dtype,
                    ..device_config()
                },
            )
            .expect("device engine");
            let prompt = sequences(&[7], cfg.vocab_size, 2).remove(0);
            let got = dev
                .generate(vec![GenerateRequest::new(
                    prompt.clone(),
                    SamplingParams::greedy(8),
                )])
                .expect("generate")
                .remove(0);
            let mut fed = prompt;
            fed.extend_from_slice(&got.output_ids);
            fed.pop();
            let device = DEVICE.open().expect("device");
            let on_device = map
                .iter()
                .map(|(k, t)| (k.clone(), t.to_device(&device).expect("to device")))
                .collect();
            let trainer = Model::with_precision(&cfg, &Weights::from_map(on_device), precision)
                .expect("trainer model");
            let batch = Batch::new(&[fed], 0, &device).expect("batch");
            let out = trainer.forward(&batch, Routing::Record).expect("forward");
            let want = &out.routes.expect("recorded")[0];
            let differ = differing_cells(got.routes.as_ref().expect("routes"), want);
            println!("{family} {dtype}: {differ} route cells differ from the trainer's");
            assert_eq!(differ, 0, "{family} {dtype}");
        }
    }
}

/// Each request run alone on `dev`.
fn each_alone(dev: &mut DeviceEngine, reqs: &[GenerateRequest]) -> Vec<GenerateResult> {
    reqs.iter()
        .map(|r| dev.generate(vec![r.clone()]).expect("alone").remove(0))
        .collect()
}

/// Submits `reqs[i]` before step `arrivals[i]` and steps until all finish, checking after
/// each step in `checks` that the queue lengths are as given; results in input order.
fn staggered(
    dev: &mut DeviceEngine,
    reqs: &[GenerateRequest],
    arrivals: &[usize],
    checks: &[(usize, (usize, usize))],
) -> Vec<GenerateResult> {
    let mut ids = vec![None; reqs.len()];
    let mut done = std::collections::HashMap::new();
    let mut step = 0;
    while done.len() < reqs.len() {
        for (i, _) in arrivals.iter().enumerate().filter(|(_, &at)| at == step) {
            ids[i] = Some(dev.submit(reqs[i].clone()).expect("submit"));
        }
        for r in dev.step().expect("step") {
            done.insert(r.id, r);
        }
        for (_, want) in checks.iter().filter(|(at, _)| *at == step) {
            assert_eq!(
                dev.queue_lengths(),
                *want,
                "(waiting, running) after step {step}"
            );
        }
        step += 1;
        assert!(step < 1000, "requests never finished");
    }
    ids.iter()
        .map(|id| done.remove(&id.expect("submitted")).expect("finished"))
        .collect()
}

#[test]
fn requests_admitted_mid_batch_equal_them_alone() {
    // GQA, a sliding window (5) shorter than the sequences, and MLA.
    for family in ["qwen3_moe", "mixtral", "deepseek_v3"] {
        let cfg = tiny_config(family);
        let map = tiny_weights(&cfg, 11, DType::F32).into_map();
        let (_, mut dev) = both(&cfg, &map);
        // Two requests from the start; at step 3 a prompt longer than the batch's slots
        // (the running rows get padded) and a shorter one (it gets padded); at step 6, after
        // the long one has left (its slots trimmed), one more.
        let prompts = sequences(&[3, 5, 12, 2, 4], cfg.vocab_size, 13);
        let new_tokens = [6, 12, 3, 10, 5];
        let reqs: Vec<GenerateRequest> = prompts
            .iter()
            .zip(new_tokens)
            .enumerate()
            .map(|(i, (p, n))| {
                let mut r = GenerateRequest::new(p.clone(), mixed_sampling(i, n, 70));
                r.routed_experts_start_len = i % 3;
                r.sampling.prompt_logprobs_from = (i == 2).then_some(1);
                r
            })
            .collect();
        let alone = each_alone(&mut dev, &reqs);
        let checks = [(2, (0, 2)), (3, (0, 4)), (5, (0, 2)), (6, (0, 3))];
        let got = staggered(&mut dev, &reqs, &[0, 0, 3, 3, 6], &checks);
        for (i, (g, a)) in got.iter().zip(&alone).enumerate() {
            let what = format!("{family} request {i}");
            assert_same(&what, g, a, BATCH_TOL);
            assert_eq!(g.output_ids.len(), new_tokens[i], "{what}: length");
            assert_same_extras(&what, g, a, BATCH_TOL);
        }
    }
}

#[test]
fn aborting_while_others_are_admitted_returns_the_partial_rollout() {
    let cfg = tiny_config("qwen2_moe");
    let map = tiny_weights(&cfg, 17, DType::F32).into_map();
    let (_, mut dev) = both(&cfg, &map);
    let prompts = sequences(&[4, 6, 9, 3], cfg.vocab_size, 2);
    let reqs: Vec<GenerateRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| GenerateRequest::new(p.clone(), mixed_sampling(i, 7, 70)))
        .collect();
    let alone = each_alone(&mut dev, &reqs);
    let first: Vec<u64> = reqs[..2]
        .iter()
        .map(|r| dev.submit(r.clone()).expect("submit"))
        .collect();
    assert!(dev.step().expect("prefill").is_empty());
    assert!(dev.step().expect("decode").is_empty());
    let later: Vec<u64> = reqs[2..]
        .iter()
        .map(|r| dev.submit(r.clone()).expect("submit"))
        .collect();
    assert!(dev.step().expect("decode and admit").is_empty());
    assert_eq!(dev.queue_lengths(), (0, 4), "both joined the batch");
    // A request that ran from the start (3 tokens) and one just admitted (1 token).
    for (id, i, n) in [(first[1], 1, 3), (later[0], 2, 1)] {
        let partial = dev.abort(id).expect("abort").expect("running");
        assert_eq!(partial.output_ids, alone[i].output_ids[..n], "request {i}");
        let d = max_abs_diff(&partial.output_logprobs, &alone[i].output_logprobs[..n]);
        assert!(d <= BATCH_TOL, "request {i}: log-probs differ by {d}");
        let routes = partial.routes.expect("routes so far");
        let want = alone[i].routes.as_ref().expect("routes");
        assert_eq!(routes.num_tokens(), reqs[i].input_ids.len() + n - 1);
        for t in 0..routes.num_tokens() {
            for c in 0..routes.num_columns() {
                assert_eq!(
                    routes.experts(t, c),
                    want.experts(t, c),
                    "request {i} ({t}, {c})"
                );
            }
        }
    }
    let mut done = Vec::new();
    while dev.has_work() {
        done.extend(dev.step().expect("step"));
    }
    done.sort_by_key(|r| r.id);
    assert_eq!(done.len(), 2);
    assert_same("ran from the start", &done[0], &alone[0], BATCH_TOL);
    assert_same("admitted", &done[1], &alone[3], BATCH_TOL);
}

/// KV bytes of one slot of one sequence, as documented for `kv_cache_bytes`: keys and values
/// of every layer in the cache's dtype, f32 for these f32 engines.
fn slot_bytes(cfg: &Config) -> usize {
    let r3_model::AttentionConfig::Gqa {
        num_kv_heads,
        head_dim,
        ..
    } = cfg.attention
    else {
        panic!("a GQA config");
    };
    cfg.num_hidden_layers * num_kv_heads * 2 * head_dim * 4
}

#[test]
fn admission_waits_for_room_and_refuses_what_never_fits() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 4, DType::F32).into_map();
    let prompts = sequences(&[5, 5, 5, 5], cfg.vocab_size, 8);
    let reqs: Vec<GenerateRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| GenerateRequest::new(p.clone(), mixed_sampling(i, 6, 70)))
        .collect();
    // Room for one request of 5 + 6 slots at a time (in a cache buffer with room for
    // `kv_capacity_for(11)`), not two.
    let budget = slot_bytes(&cfg) * r3_model::layers::attention::kv_capacity_for(11) * 3 / 2;
    let mut small = DeviceEngine::new(
        cfg.clone(),
        &map,
        DeviceEngineConfig {
            kv_cache_bytes: budget,
            ..device_config()
        },
    )
    .expect("device engine");
    let alone = each_alone(&mut small, &reqs[..2]);
    // The second waits until the first has left, then runs alone.
    let got = staggered(&mut small, &reqs[..2], &[0, 1], &[(1, (1, 1)), (5, (0, 1))]);
    assert_same("first", &got[0], &alone[0], BATCH_TOL);
    assert_same("second", &got[1], &alone[1], BATCH_TOL);
    // While a batch runs: past the budget alone, and past the context, refused by name.
    small.submit(reqs[0].clone()).expect("submit");
    small.step().expect("prefill");
    let huge = GenerateRequest::new(prompts[0].clone(), SamplingParams::greedy(100));
    let err = small.submit(huge).expect_err("past the KV budget");
    assert!(err.to_string().contains("KV cache"), "{err}");
    let max_pos = cfg.max_position_embeddings;
    let long = GenerateRequest::new(vec![1; max_pos], SamplingParams::greedy(1));
    let err = small.submit(long).expect_err("past the context");
    assert!(err.to_string().contains("max_position_embeddings"), "{err}");
    assert_eq!(small.queue_lengths(), (0, 1), "nothing refused was queued");
    while small.has_work() {
        small.step().expect("step");
    }

    // At most `max_running` sequences: the third waits for a free row.
    let mut two = DeviceEngine::new(
        cfg.clone(),
        &map,
        DeviceEngineConfig {
            max_running: 2,
            ..device_config()
        },
    )
    .expect("device engine");
    let alone = each_alone(&mut two, &reqs[..3]);
    let got = staggered(
        &mut two,
        &reqs[..3],
        &[0, 0, 1],
        &[(1, (1, 2)), (6, (0, 1))],
    );
    for i in 0..3 {
        assert_same(&format!("request {i}"), &got[i], &alone[i], BATCH_TOL);
    }
}

/// The activation estimate of a request run alone: its cold prefill and its last decode
/// step, their attention in the query tiles of an engine whose budget is `budget`
/// (`usize::MAX`: in one product).
fn alone_activations(cfg: &Config, prompt: usize, new: usize, budget: usize) -> usize {
    let prefill = StepShape {
        rows: 1,
        time: prompt,
        slots: prompt,
        logit_positions: 1,
    };
    let decode = StepShape {
        rows: 1,
        time: 1,
        slots: prompt + new,
        logit_positions: 1,
    };
    let tiles = score_tiles(budget);
    step_activation_bytes(cfg, prefill, tiles).max(step_activation_bytes(cfg, decode, tiles))
}

#[test]
fn admission_counts_the_steps_activations() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 4, DType::F32).into_map();
    let prompts = sequences(&[5, 5], cfg.vocab_size, 8);
    let reqs: Vec<GenerateRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| GenerateRequest::new(p.clone(), mixed_sampling(i, 6, 70)))
        .collect();
    // One request's prefill fits, two prefilled side by side (twice the estimate) do not.
    let budget = alone_activations(&cfg, 5, 6, usize::MAX) * 3 / 2;
    let mut small = DeviceEngine::new(
        cfg.clone(),
        &map,
        DeviceEngineConfig {
            activation_bytes: budget,
            ..device_config()
        },
    )
    .expect("device engine");
    let alone = each_alone(&mut small, &reqs);
    // Both arrive at once: the first is prefilled alone, the second waits a step (the KV
    // budget, 4 GiB, would have taken both).
    let got = staggered(&mut small, &reqs, &[0, 0], &[(0, (1, 1))]);
    assert_same("first", &got[0], &alone[0], BATCH_TOL);
    assert_same("second", &got[1], &alone[1], BATCH_TOL);

    // A prompt whose prefill alone is past the budget (its attention scores grow with the
    // prompt squared; prompt log-probs send every position through the head) is no longer
    // refused: it is fed in chunks (`device_chunked_prefill.rs`), and generates as on an
    // engine whose budget takes it at once.
    let long = sequences(&[60], cfg.vocab_size, 9).remove(0);
    let mut huge = GenerateRequest::new(long, SamplingParams::greedy(2));
    huge.sampling.prompt_logprobs_from = Some(0);
    assert!(alone_activations(&cfg, 60, 2, budget) > budget);
    let chunked = small.generate(vec![huge.clone()]).expect("fed in chunks");
    let mut big = DeviceEngine::new(cfg.clone(), &map, device_config()).expect("device engine");
    let at_once = big.generate(vec![huge]).expect("at once");
    assert_same("chunked", &chunked[0], &at_once[0], BATCH_TOL);
    assert_same_extras("chunked", &chunked[0], &at_once[0], BATCH_TOL);
}

#[test]
fn an_aborted_request_resumes_into_the_uninterrupted_one() {
    use r3_rollout::MergePolicy;
    for family in ["qwen3_moe", "deepseek_v3"] {
        let cfg = tiny_config(family);
        let map = tiny_weights(&cfg, 23, DType::F32).into_map();
        let (_, mut dev) = both(&cfg, &map);
        let prompts = sequences(&[6, 4], cfg.vocab_size, 3);
        let mut req = GenerateRequest::new(prompts[0].clone(), mixed_sampling(1, 12, 70));
        req.sampling.prompt_logprobs_from = Some(1);
        req.routed_experts_start_len = 2;
        let other = GenerateRequest::new(prompts[1].clone(), mixed_sampling(0, 9, 70));
        let want = each_alone(&mut dev, std::slice::from_ref(&req)).remove(0);
        for policy in [
            MergePolicy::KeepPerTokenOrigin,
            MergePolicy::ReplaceWithResumed,
        ] {
            let what = format!("{family} {policy:?}");
            let id = dev.submit(req.clone()).expect("submit");
            let other_id = dev.submit(other.clone()).expect("submit");
            for _ in 0..5 {
                assert!(dev.step().expect("step").is_empty());
            }
            let partial = dev.abort(id).expect("abort").expect("running");
            assert_eq!(partial.output_ids, want.output_ids[..5], "{what}");
            // Resumed while the other request is still running: it joins that batch.
            let rid = dev.resume(partial.clone(), policy).expect("resume");
            let mut done = Vec::new();
            while dev.has_work() {
                done.extend(dev.step().expect("step"));
            }
            assert!(
                done.iter().any(|r| r.id == other_id),
                "{what}: the other finished"
            );
            let got = done.into_iter().find(|r| r.id == rid).expect("resumed");
            // Same weights: both policies give the uninterrupted routes.
            assert_same(&what, &got, &want, BATCH_TOL);
            assert_eq!(got.prompt_tokens, prompts[0].len(), "{what}");
            let (a, b) = (
                got.prompt_logprobs.expect("prompt log-probs"),
                want.prompt_logprobs.as_ref().expect("prompt log-probs"),
            );
            assert_eq!(
                (a.start, a.logprobs.len()),
                (b.start, b.logprobs.len()),
                "{what}"
            );
            let d = max_abs_diff(&a.logprobs, &b.logprobs);
            assert!(d <= BATCH_TOL, "{what}: prompt log-probs differ by {d}");
            // A finished budget has nothing to resume.
            let mut spent = partial;
            spent.output_ids = want.output_ids.clone();
            let err = dev.resume(spent, policy).expect_err("nothing left");
            assert!(err.to_string().contains("nothing to resume"), "{err}");
        }
    }
}

/// Variables over `map`'s values times `scale`, on the engine's device, as a trainer holds
/// them, and the name → tensor map a trainer's sync hands over (their values, detached).
fn trainer_vars(map: &TensorMap, scale: f64) -> (Vec<(String, candle_core::Var)>, TensorMap) {
    let device = DEVICE.open().expect("device");
    let vars: Vec<(String, candle_core::Var)> = map
        .iter()
        .map(|(name, t)| {
            let t = (t.to_device(&device).expect("to device") * scale).expect("scale");
            let var = candle_core::Var::from_tensor(&t).expect("var");
            (name.clone(), var)
        })
        .collect();
    let trainer_map = vars
        .iter()
        .map(|(name, v)| (name.clone(), v.as_tensor().detach()))
        .collect();
    (vars, trainer_map)
}

/// The engine keeps its own copy of what it loads: a trainer's variables written in place
/// after a sync (as its optimiser does) leave the engine's weights, and so its generation
/// and log-probs, those of the version it loaded, until the next sync.
#[test]
fn weights_written_in_place_after_a_sync_do_not_reach_the_engine() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 5, DType::F32).into_map();
    // Variables over the map's values, on the engine's device, as a trainer holds them.
    let (vars, trainer_map) = trainer_vars(&map, 1.0);
    let mut dev = DeviceEngine::new(cfg.clone(), &map, device_config()).expect("device");
    dev.update_weights(&trainer_map).expect("sync");
    let prompt = sequences(&[8], cfg.vocab_size, 2).remove(0);
    let req = GenerateRequest::new(prompt, SamplingParams::greedy(6));
    let before = dev.generate(vec![req.clone()]).expect("before").remove(0);
    for (_, v) in &vars {
        let scaled = (v.as_tensor() * 3.0).expect("scale");
        v.set(&scaled).expect("write in place");
    }
    let after = dev.generate(vec![req.clone()]).expect("after").remove(0);
    assert_eq!(after.output_ids, before.output_ids);
    assert_eq!(after.output_logprobs, before.output_logprobs);
    // The next sync takes the new values.
    dev.update_weights(&trainer_map).expect("sync");
    let synced = dev.generate(vec![req]).expect("synced").remove(0);
    assert_ne!(synced.output_logprobs, before.output_logprobs);
}

/// Weights released for a trainer's update (`release_weights`) leave the engine refusing
/// to generate, by name, and an update then builds them again from the trainer's tensors:
/// the engine generates what one built from those tensors does, bit for bit, and keeps its
/// own copy (the trainer's later in-place writes do not reach it). Releasing with a request
/// queued is refused, and the refused generate leaves nothing queued (its request, left
/// behind, would have joined the next call's batch and moved its log-probs by 2e-6).
#[test]
fn released_weights_are_built_again_by_the_next_update() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 5, DType::F32).into_map();
    let (vars, trainer_map) = trainer_vars(&map, 1.5);
    let prompt = sequences(&[8], cfg.vocab_size, 2).remove(0);
    let req = GenerateRequest::new(prompt, SamplingParams::greedy(6));
    let mut fresh =
        DeviceEngine::new(cfg.clone(), &trainer_map, device_config()).expect("fresh engine");
    let want = fresh.generate(vec![req.clone()]).expect("fresh").remove(0);

    let mut dev = DeviceEngine::new(cfg.clone(), &map, device_config()).expect("device");
    dev.submit(req.clone()).expect("queued");
    let Err(e) = dev.release_weights() else {
        panic!("weights released with a request queued");
    };
    assert!(e.to_string().contains("1 waiting"), "{e}");
    while dev.queue_lengths() != (0, 0) {
        dev.step().expect("step");
    }
    let version = dev.weight_version();
    dev.release_weights().expect("release");
    assert!(dev.weights_released());
    let Err(e) = dev.generate(vec![req.clone()]) else {
        panic!("a released engine generated");
    };
    assert!(e.to_string().contains("released"), "{e}");
    assert_eq!(
        dev.queue_lengths(),
        (0, 0),
        "the refused call left requests queued"
    );
    assert_eq!(
        dev.update_weights(&trainer_map).expect("built again"),
        version + 1
    );
    assert!(!dev.weights_released());
    let got = dev.generate(vec![req.clone()]).expect("rebuilt").remove(0);
    assert_eq!(got.output_ids, want.output_ids);
    assert_eq!(got.output_logprobs, want.output_logprobs);
    for (_, v) in &vars {
        let scaled = (v.as_tensor() * 3.0).expect("scale");
        v.set(&scaled).expect("write in place");
    }
    let after = dev.generate(vec![req]).expect("after").remove(0);
    assert_eq!(after.output_logprobs, want.output_logprobs);
}
