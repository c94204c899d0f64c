//! The device engine's prefix cache against independent truth, on the CPU device (CUDA in a
//! `--features cuda` build): every request run with the cache on gives the tokens, finish,
//! route tables (cell for cell, first routed position included) and log-probs (within
//! `TOL`) of the same request with the cache off, over multi-turn rounds whose prompts
//! extend earlier ones, in batches that mix hits of different lengths with misses (the gap
//! between a cached prefix and a shorter tail closed after the prefill) and with a prompt
//! log-prob request; hits actually happen (each result's `cached_tokens`, the stats'
//! `hit_blocks`) and match the CPU engine's prefix cache block for block, with the same
//! tokens and routes as that engine; a weight update empties the cache and no stale route
//! or key comes back (a row that lived through the update offers nothing); a budget of a
//! few blocks evicts and stays correct; an aborted request's fed positions serve its
//! resume.
//!
//! `TOL`: with the cache on, a hit position's keys and values are the ones computed when
//! it was first fed, in another batch and another prefill split, and the later positions
//! attend over them; with it off they are recomputed. The same position's values then
//! differ by float reassociation only (the attention sums over a different number of
//! slots, padding adding exact zeros in other places), the same bound the engine's
//! batched-against-alone tests use (`BATCH_TOL` of `device_engine.rs`).

mod common;
#[path = "../../r3-model/tests/common/mod.rs"]
mod model_common;

use candle_core::DType;
use common::{assert_same_routes, differing_cells, max_abs_diff, mixed_sampling, DEVICE};
use model_common::{sequences, tiny_config, tiny_weights};
use r3_model::Config;
use r3_rollout::{
    DeviceEngine, DeviceEngineConfig, Dtype, Engine, EngineConfig, GenerateRequest, GenerateResult,
    MergePolicy, RoutingPlace, SamplingParams, TensorMap,
};
use r3_routing::RouteTable;

/// How far a request's log-probs with the cache on may be from the same request's with it
/// off (module docs).
const TOL: f32 = if cfg!(feature = "cuda") { 1e-4 } else { 1e-5 };
/// How far the device engine's log-probs may be from the CPU engine's (f32).
const CPU_TOL: f32 = if cfg!(feature = "cuda") { 1e-3 } else { 1e-4 };
/// Positions per cache block: small, so the tiny prompts span several.
const BLOCK: usize = 4;

fn config(prefix_cache: bool, prefix_cache_bytes: usize) -> DeviceEngineConfig {
    DeviceEngineConfig {
        device: DEVICE,
        block_size: BLOCK,
        prefix_cache,
        prefix_cache_bytes,
        ..DeviceEngineConfig::default()
    }
}

/// The device engine with the cache on (budget `bytes`) and off, over the same tensors.
fn on_and_off(cfg: &Config, map: &TensorMap, bytes: usize) -> (DeviceEngine, DeviceEngine) {
    let on = DeviceEngine::new(cfg.clone(), map, config(true, bytes)).expect("cache on");
    let off = DeviceEngine::new(cfg.clone(), map, config(false, 0)).expect("cache off");
    (on, off)
}

/// Tokens, finish, routes (cell for cell, weight versions too) and log-probs (within `tol`)
/// of two results agree; returns the log-prob difference.
fn assert_same(what: &str, got: &GenerateResult, want: &GenerateResult, tol: f32) -> f32 {
    assert_eq!(got.output_ids, want.output_ids, "{what}: tokens");
    assert_eq!(got.finish, want.finish, "{what}: finish");
    let d = max_abs_diff(&got.output_logprobs, &want.output_logprobs);
    assert!(d <= tol, "{what}: log-probs differ by {d}");
    // A dense model routes nothing (its callers check which they expect).
    if let Some((a, b)) = assert_same_routes(what, &got.routes, &want.routes) {
        assert_eq!(a.versions(), b.versions(), "{what}: route weight versions");
    }
    d
}

/// [`assert_same`] over every request of two rounds, request `i` labelled `what request i`
/// (counted across both rounds); returns the largest log-prob difference.
fn assert_rounds_same(
    what: &str,
    got: [&[GenerateResult]; 2],
    want: [&[GenerateResult]; 2],
    tol: f32,
) -> f32 {
    let (got, want) = (got.concat(), want.concat());
    assert_eq!(got.len(), want.len(), "{what}: requests");
    got.iter()
        .zip(&want)
        .enumerate()
        .map(|(i, (g, w))| assert_same(&format!("{what} request {i}"), g, w, tol))
        .fold(0f32, f32::max)
}

/// The next turn of a conversation: its prompt, what the model answered and `more` new
/// tokens (the user's next message).
fn next_turn(req: &GenerateRequest, answer: &GenerateResult, more: &[u32]) -> Vec<u32> {
    let mut p = req.input_ids.clone();
    p.extend_from_slice(&answer.output_ids);
    p.extend_from_slice(more);
    p
}

/// Two rounds of requests: the first sets the cache up, the second extends its prompts
/// (a long and a short hit, so the shorter tail leaves a gap), adds a miss and a prompt
/// log-prob request over a cached prompt (served only before its first reported position).
fn rounds(vocab: usize, first: &[GenerateResult]) -> Vec<GenerateRequest> {
    let p = sequences(&[20, 9, 7, 3], vocab, 3);
    match first {
        [] => vec![
            GenerateRequest::new(p[0].clone(), mixed_sampling(0, 8, 90)),
            GenerateRequest::new(p[1].clone(), mixed_sampling(1, 6, 90)),
        ],
        [a, b] => {
            let r0 = rounds(vocab, &[]);
            let mut logprobs = GenerateRequest::new(p[0].clone(), mixed_sampling(2, 4, 90));
            logprobs.sampling.prompt_logprobs_from = Some(9);
            let mut extended =
                GenerateRequest::new(next_turn(&r0[1], b, &p[3]), mixed_sampling(3, 5, 90));
            extended.routed_experts_start_len = 2;
            vec![
                GenerateRequest::new(next_turn(&r0[0], a, &p[3][..2]), mixed_sampling(0, 6, 90)),
                extended,
                GenerateRequest::new(p[2].clone(), mixed_sampling(5, 4, 90)),
                logprobs,
            ]
        }
        _ => unreachable!("two results in the first round"),
    }
}

#[test]
fn cache_on_equals_cache_off_and_the_cpu_engines_cache() {
    // GQA, a sliding window (5) shorter than the prompts, MLA, and a dense model (whose
    // rows record no routes, only the weight version of each fed position).
    for family in ["qwen3_moe", "mixtral", "deepseek_v3", "qwen3"] {
        let cfg = tiny_config(family);
        let map = tiny_weights(&cfg, 31, DType::F32).into_map();
        let (mut on, mut off) = on_and_off(&cfg, &map, 64 << 20);
        let mut cpu = Engine::new(
            cfg.clone(),
            &map,
            EngineConfig {
                dtype: Dtype::F32,
                block_size: BLOCK,
                prefix_cache: true,
                kv_cache_bytes: 64 << 20,
                prefix_cache_bytes: 64 << 20,
                ..EngineConfig::default()
            },
        )
        .expect("cpu engine");
        let first = rounds(cfg.vocab_size, &[]);
        let got1 = on.generate(first.clone()).expect("on");
        let want1 = off.generate(first.clone()).expect("off");
        let cpu1 = cpu.generate(first).expect("cpu");
        let second = rounds(cfg.vocab_size, &want1);
        let got2 = on.generate(second.clone()).expect("on");
        let want2 = off.generate(second.clone()).expect("off");
        let cpu2 = cpu.generate(second.clone()).expect("cpu");
        let mut worst = 0f32;
        worst = worst.max(assert_rounds_same(
            family,
            [&got1, &got2],
            [&want1, &want2],
            TOL,
        ));
        let routed = family != "qwen3";
        assert!(
            [&got1, &got2, &want1, &want2, &cpu1, &cpu2]
                .iter()
                .all(|round| round.iter().all(|r| r.routes.is_some() == routed)),
            "{family}: routes returned where the model routes"
        );
        // Cached: 24 of the first conversation's 27 fed positions, 12 of the second's 13,
        // nothing of the new prompt, and of the prompt log-prob request only the 8 before
        // its first reported position.
        let cached: Vec<usize> = got2.iter().map(|r| r.cached_tokens).collect();
        assert_eq!(
            cached,
            vec![24, 12, 0, 8],
            "{family}: cached prompt positions"
        );
        assert!(got1.iter().all(|r| r.cached_tokens == 0));
        let stats = on.prefix_cache_stats().expect("cache on");
        assert_eq!(
            stats.hit_blocks as usize * BLOCK,
            cached.iter().sum::<usize>(),
            "{family}: the stats count the served positions"
        );
        assert!(stats.inserted_blocks > 0 && stats.evicted_blocks == 0);
        let (lp_on, lp_off) = (
            got2[3].prompt_logprobs.as_ref().expect("prompt log-probs"),
            want2[3].prompt_logprobs.as_ref().expect("prompt log-probs"),
        );
        assert_eq!(lp_on.start, lp_off.start, "{family}");
        assert!(max_abs_diff(&lp_on.logprobs, &lp_off.logprobs) <= TOL);
        // The CPU engine's cache serves the same blocks (it skips prompt log-prob requests
        // altogether), with the same tokens and routes.
        for (i, (g, c)) in got2.iter().zip(&cpu2).enumerate().take(3) {
            assert_eq!(
                g.cached_tokens, c.cached_tokens,
                "{family} request {i}: as the CPU"
            );
        }
        assert_rounds_same(
            &format!("{family} (CPU)"),
            [&got1, &got2],
            [&cpu1, &cpu2],
            CPU_TOL,
        );
        println!("{family}: cache on vs off, log-probs within {worst:.2e}; {stats:?}");
    }
}

/// Routed on the device (each step's top-k, gates and experts without the host), the cache's
/// hits, the gaps their tails leave and prompt log-probs give what routing on the host with
/// the cache off computes: tokens, routes (cached rows and fed rows alike), log-probs within
/// the device engine's tolerance.
#[test]
fn routed_on_the_device_the_cache_serves_what_host_routing_computes() {
    for family in ["qwen3_moe", "mixtral"] {
        let cfg = tiny_config(family);
        let map = tiny_weights(&cfg, 31, DType::F32).into_map();
        let engine = |cache: bool, routing: RoutingPlace| {
            let settings = DeviceEngineConfig {
                routing,
                ..config(cache, if cache { 64 << 20 } else { 0 })
            };
            DeviceEngine::new(cfg.clone(), &map, settings).expect("engine")
        };
        let (mut on, mut off) = (
            engine(true, RoutingPlace::Device),
            engine(false, RoutingPlace::Host),
        );
        let first = rounds(cfg.vocab_size, &[]);
        let got1 = on.generate(first.clone()).expect("on");
        let want1 = off.generate(first).expect("off");
        let second = rounds(cfg.vocab_size, &want1);
        let got2 = on.generate(second.clone()).expect("on");
        let want2 = off.generate(second).expect("off");
        assert_rounds_same(family, [&got1, &got2], [&want1, &want2], CPU_TOL);
        let cached: Vec<usize> = got2.iter().map(|r| r.cached_tokens).collect();
        assert_eq!(
            cached,
            vec![24, 12, 0, 8],
            "{family}: cached prompt positions"
        );
        let (routed, steps) = on.steps_routed_on_device();
        assert!(
            steps > 0 && routed == steps,
            "{family}: {routed} of {steps} on the device"
        );
    }
}

/// The samples of a group, submitted together, prefill their shared prompt once: the first
/// computes it while the others wait a step, then they read its full blocks from the cache
/// (`cached_tokens`), and every sample's tokens, routes and log-probs are what the engine
/// with the cache off computes; a request whose prompt only begins the same is not held
/// back past the blocks it shares.
#[test]
fn a_groups_samples_share_the_prompts_prefill() {
    let cfg = tiny_config("qwen3_moe");
    let map = tiny_weights(&cfg, 31, DType::F32).into_map();
    let (mut on, mut off) = on_and_off(&cfg, &map, 64 << 20);
    let p = sequences(&[13, 5], cfg.vocab_size, 7);
    let mut other = p[0][..8].to_vec();
    other.extend_from_slice(&p[1]);
    let mut reqs: Vec<GenerateRequest> = (0..4)
        .map(|j| GenerateRequest::new(p[0].clone(), mixed_sampling(j, 5, 70)))
        .collect();
    reqs.push(GenerateRequest::new(other, mixed_sampling(5, 5, 70)));
    let got = on.generate(reqs.clone()).expect("on");
    let want = off.generate(reqs).expect("off");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_same(&format!("sample {i}"), g, w, TOL);
    }
    // 12 of the 13-token prompt's 12 servable positions (3 blocks of 4); the other prompt
    // shares its first 2 blocks.
    let cached: Vec<usize> = got.iter().map(|r| r.cached_tokens).collect();
    assert_eq!(cached, vec![0, 12, 12, 12, 8], "cached prompt positions");
}

#[test]
fn a_weight_update_empties_the_cache_and_no_stale_route_comes_back() {
    let cfg = tiny_config("qwen3_moe");
    let old = tiny_weights(&cfg, 41, DType::F32).into_map();
    let new = tiny_weights(&cfg, 42, DType::F32).into_map();
    let (mut on, _) = on_and_off(&cfg, &old, 64 << 20);
    let first = rounds(cfg.vocab_size, &[]);
    let got1 = on.generate(first).expect("first round");
    assert!(on.prefix_cache_stats().expect("on").cached_blocks > 0);
    assert_eq!(on.update_weights(&new).expect("update"), 1);
    let stats = on.prefix_cache_stats().expect("on");
    assert_eq!((stats.cached_blocks, stats.used_bytes), (0, 0), "emptied");
    assert_eq!(stats.invalidations, 1);
    // The next turn under the new weights: nothing of the old weights served, and what a
    // fresh engine on them gives. Request 3 begins with the first 2 blocks of request 0's
    // prompt: it waits a step for request 0 to compute them, under the new weights.
    let (_, mut fresh) = on_and_off(&cfg, &new, 0);
    let second = rounds(cfg.vocab_size, &got1);
    let got2 = on.generate(second.clone()).expect("on");
    let want2 = fresh.generate(second.clone()).expect("fresh");
    for (i, (g, w)) in got2.iter().zip(&want2).enumerate() {
        assert_eq!(
            g.cached_tokens,
            if i == 3 { 8 } else { 0 },
            "request {i}: nothing of the old weights served"
        );
        let (a, b) = (g.routes.as_ref().expect("r"), w.routes.as_ref().expect("r"));
        let versions = a.versions().expect("versions");
        assert!(versions.iter().all(|&v| v == 1), "request {i}: versions");
        assert_eq!(differing_cells(a, b), 0, "request {i}: routes");
        assert_eq!(g.output_ids, w.output_ids, "request {i}: tokens");
    }

    // A request that lives through an update holds keys of both weights: it offers none.
    on.flush_prefix_cache();
    let long = second[0].clone();
    let id = on.submit(long.clone()).expect("submit");
    on.step().expect("prefill");
    on.step().expect("decode");
    on.update_weights(&old).expect("update back");
    let mut done = Vec::new();
    while on.has_work() {
        done.extend(on.step().expect("step"));
    }
    let spanned = done.into_iter().find(|r| r.id == id).expect("finished");
    let versions = spanned
        .routes
        .as_ref()
        .and_then(RouteTable::versions)
        .expect("versions")
        .to_vec();
    assert!(
        versions.contains(&1) && versions.contains(&2),
        "{versions:?}"
    );
    assert_eq!(on.prefix_cache_stats().expect("on").cached_blocks, 0);
    let again = on.generate(vec![long.clone()]).expect("again").remove(0);
    assert_eq!(again.cached_tokens, 0, "nothing offered across the update");
    let (_, mut fresh_old) = on_and_off(&cfg, &old, 0);
    let want = fresh_old.generate(vec![long]).expect("fresh").remove(0);
    // The same weights as a fresh engine's version 0, under version 2 here.
    assert_eq!(
        again.output_ids, want.output_ids,
        "tokens after the update back"
    );
    assert!(max_abs_diff(&again.output_logprobs, &want.output_logprobs) <= TOL);
    let (a, b) = (
        again.routes.as_ref().expect("r"),
        want.routes.as_ref().expect("r"),
    );
    assert_eq!(differing_cells(a, b), 0, "routes after the update back");
}

#[test]
fn a_small_budget_evicts_and_stays_correct() {
    let cfg = tiny_config("deepseek_v3");
    let map = tiny_weights(&cfg, 51, DType::F32).into_map();
    // Measure one block's bytes, then allow three.
    let (mut probe, _) = on_and_off(&cfg, &map, 64 << 20);
    probe
        .generate(vec![GenerateRequest::new(
            sequences(&[5], cfg.vocab_size, 1).remove(0),
            SamplingParams::greedy(1),
        )])
        .expect("probe");
    let stats = probe.prefix_cache_stats().expect("on");
    assert_eq!(stats.cached_blocks, 1);
    let budget = stats.used_bytes * 3;
    let (mut on, mut off) = on_and_off(&cfg, &map, budget);
    let mut results = Vec::new();
    for seed in 0..3 {
        let first: Vec<GenerateRequest> = rounds(cfg.vocab_size, &[])
            .into_iter()
            .map(|mut r| {
                r.input_ids[0] = (r.input_ids[0] + seed) % cfg.vocab_size as u32;
                r
            })
            .collect();
        let got1 = on.generate(first.clone()).expect("on");
        let want1 = off.generate(first).expect("off");
        let second = rounds(cfg.vocab_size, &want1)
            .into_iter()
            .map(|mut r| {
                r.input_ids[0] = (r.input_ids[0] + seed) % cfg.vocab_size as u32;
                r
            })
            .collect::<Vec<_>>();
        let got2 = on.generate(second.clone()).expect("on");
        let want2 = off.generate(second).expect("off");
        assert_rounds_same(
            &format!("seed {seed}"),
            [&got1, &got2],
            [&want1, &want2],
            TOL,
        );
        results.extend(got2);
        let s = on.prefix_cache_stats().expect("on");
        assert!(
            s.used_bytes <= budget,
            "{} bytes kept, budget {budget}",
            s.used_bytes
        );
    }
    let s = on.prefix_cache_stats().expect("on");
    assert!(s.evicted_blocks > 0, "{s:?}");
    assert!(
        results.iter().any(|r| r.cached_tokens > 0),
        "some hit survived: {s:?}"
    );
}

#[test]
fn an_aborted_request_resumes_from_its_cached_positions() {
    for family in ["qwen3_moe", "deepseek_v3"] {
        let cfg = tiny_config(family);
        let map = tiny_weights(&cfg, 61, DType::F32).into_map();
        let (mut on, mut off) = on_and_off(&cfg, &map, 64 << 20);
        let prompts = sequences(&[10, 5], cfg.vocab_size, 7);
        let mut req = GenerateRequest::new(prompts[0].clone(), mixed_sampling(1, 12, 90));
        req.routed_experts_start_len = 3;
        let other = GenerateRequest::new(prompts[1].clone(), mixed_sampling(0, 9, 90));
        let want = off
            .generate(vec![req.clone()])
            .expect("uninterrupted")
            .remove(0);
        for policy in [
            MergePolicy::KeepPerTokenOrigin,
            MergePolicy::ReplaceWithResumed,
        ] {
            on.flush_prefix_cache();
            let what = format!("{family} {policy:?}");
            let id = on.submit(req.clone()).expect("submit");
            let other_id = on.submit(other.clone()).expect("submit");
            for _ in 0..6 {
                assert!(on.step().expect("step").is_empty());
            }
            let partial = on.abort(id).expect("abort").expect("running");
            // 10 prompt + 6 generated − 1 fed positions: three blocks offered; and the other
            // request's first block, offered when its prefill ended.
            assert_eq!(on.prefix_cache_stats().expect("on").cached_blocks, 4);
            let rid = on.resume(partial, policy).expect("resume");
            let mut done = Vec::new();
            while on.has_work() {
                done.extend(on.step().expect("step"));
            }
            assert!(done.iter().any(|r| r.id == other_id), "{what}: other done");
            let got = done.into_iter().find(|r| r.id == rid).expect("resumed");
            assert_eq!(
                got.cached_tokens, 12,
                "{what}: the resume's cached positions"
            );
            assert_same(&what, &got, &want, TOL);
        }
    }
}
