//! Shared helpers of the rollout integration tests: fixture paths, oracle data and the
//! comparisons of two engines' results.

#![allow(dead_code)]

use std::path::PathBuf;

use r3_model::DeviceSpec;
use r3_rollout::kernels::attention::SeqSpan;
use r3_rollout::model::{BatchInput, InferenceModel};
use r3_rollout::{Dtype, Engine, EngineConfig, KvPool, SamplingParams};
use r3_routing::RouteTable;

/// Where the device engine runs in this build: candle's CPU, or the first GPU in a `cuda`
/// build.
#[cfg(not(feature = "cuda"))]
pub const DEVICE: DeviceSpec = DeviceSpec::Cpu;
/// Where the device engine runs in this build: candle's CPU, or the first GPU in a `cuda`
/// build.
#[cfg(feature = "cuda")]
pub const DEVICE: DeviceSpec = DeviceSpec::Cuda { ordinal: 0 };

/// Directory of a copied HF oracle checkpoint.
pub fn model_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The oracle subset (logits, top-k sets, greedy generation) of both tiny models.
pub fn oracle() -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/oracle_subset.json");
    let text = std::fs::read_to_string(&p).expect("oracle fixture present");
    serde_json::from_str(&text).expect("oracle fixture is JSON")
}

/// JSON array of numbers → Vec<u32>.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// An engine over a fixture model.
pub fn engine(name: &str, dtype: Dtype, prefix_cache: bool) -> Engine {
    let cfg = EngineConfig {
        dtype,
        prefix_cache,
        kv_cache_bytes: 64 << 20,
        prefix_cache_bytes: 16 << 20,
        ..EngineConfig::default()
    };
    Engine::from_dir(&model_dir(name), cfg).expect("engine loads fixture")
}

/// Both fixture models.
pub const MODELS: [&str; 2] = ["qwen3_moe_tiny", "deepseek_v3_tiny"];

/// The HF oracle fixtures of the other families, kept once in r3-model's fixture folder
/// ([`oracle_model_dir`]): four MoE models, then the dense ones, which route nothing.
pub const FAMILY_MODELS: [&str; 7] = [
    "qwen2_moe_tiny",
    "mixtral_tiny",
    "olmoe_tiny",
    "deepseek_v3_yarn_tiny",
    "qwen3_tiny",
    "qwen2_tiny",
    "llama_tiny",
];

/// r3-model's fixture folder, where [`FAMILY_MODELS`] and their references live; relative to
/// the crate folder (the working directory of tests, also of the CUDA test binaries, which
/// run without `CARGO_MANIFEST_DIR`'s source tree at hand but in a checkout).
pub fn family_fixtures() -> PathBuf {
    PathBuf::from("../r3-model/tests/fixtures")
}

/// Directory of any HF oracle checkpoint: [`MODELS`] here, [`FAMILY_MODELS`] in r3-model.
pub fn oracle_model_dir(name: &str) -> PathBuf {
    if MODELS.contains(&name) {
        model_dir(name)
    } else {
        family_fixtures().join(name)
    }
}

/// The references of any HF oracle fixture (the whole file holding `name`'s, with the
/// `input_ids` shared by all): `oracle_subset.json` for [`MODELS`],
/// `reference_outputs_families.json` for [`FAMILY_MODELS`].
pub fn oracle_of(name: &str) -> serde_json::Value {
    if MODELS.contains(&name) {
        return oracle();
    }
    let p = family_fixtures().join("reference_outputs_families.json");
    let text = std::fs::read_to_string(&p).expect("family oracle fixture present");
    serde_json::from_str(&text).expect("family oracle fixture is JSON")
}

/// Logits `[t, vocab]` and captured routes `[t, cols, k]` of one full-sequence forward of
/// `tokens` through the engine's model (one sequence, fresh KV blocks, every row's logits).
pub fn full_forward(model: &mut InferenceModel, tokens: &[u32]) -> (Vec<f32>, Vec<u16>) {
    let (logits, routes) = full_forward_any(model, tokens);
    (logits, routes.expect("routes captured"))
}

/// [`full_forward`] for any model, dense ones included: the routes as the model returns them
/// with capture on.
pub fn full_forward_any(
    model: &mut InferenceModel,
    tokens: &[u32],
) -> (Vec<f32>, Option<Vec<u16>>) {
    let t = tokens.len();
    let mut pool = KvPool::new(model.kv_layout(16), 8, model.dtype()).expect("pool");
    let blocks: Vec<_> = (0..t.div_ceil(16))
        .map(|_| pool.allocate().expect("block"))
        .collect();
    let span = SeqSpan {
        first_token: 0,
        num_tokens: t,
        start_pos: 0,
        blocks: blocks.iter().map(|b| b.id()).collect(),
    };
    let rows: Vec<usize> = (0..t).collect();
    let input = BatchInput {
        tokens,
        spans: &[span],
        logit_rows: &rows,
    };
    let out = model.forward(&mut pool, &input, true).expect("forward");
    (out.logits, out.routes)
}

/// Two results' routes agree: both absent (a model that routes nothing), or both present
/// with the same expert set in every cell and the same first routed position. Returns the
/// two tables where present, for the callers' further checks.
pub fn assert_same_routes<'a>(
    what: &str,
    got: &'a Option<RouteTable>,
    want: &'a Option<RouteTable>,
) -> Option<(&'a RouteTable, &'a RouteTable)> {
    match (got, want) {
        (Some(a), Some(b)) => {
            assert_eq!(differing_cells(a, b), 0, "{what}: route cells differ");
            assert_eq!(
                a.start_pos(),
                b.start_pos(),
                "{what}: first routed position"
            );
            Some((a, b))
        }
        (None, None) => None,
        _ => panic!("{what}: one returned routes, the other not"),
    }
}

/// Cells (token, column) whose expert sets differ between two tables of the same shape.
pub fn differing_cells(a: &RouteTable, b: &RouteTable) -> usize {
    assert_eq!(a.num_tokens(), b.num_tokens(), "route rows");
    assert_eq!(a.num_columns(), b.num_columns(), "route columns");
    let mut differ = 0;
    for t in 0..a.num_tokens() {
        for c in 0..a.num_columns() {
            let mut x = a.experts(t, c).expect("cell");
            let mut y = b.experts(t, c).expect("cell");
            x.sort_unstable();
            y.sort_unstable();
            differ += usize::from(x != y);
        }
    }
    differ
}

/// Largest absolute difference of two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// Greedy (even `i`, with top log-probs) or seeded sampling (odd `i`, seed `seed_base + i`)
/// of `new` tokens.
pub fn mixed_sampling(i: usize, new: usize, seed_base: u64) -> SamplingParams {
    if i.is_multiple_of(2) {
        SamplingParams {
            top_logprobs: 2,
            ..SamplingParams::greedy(new)
        }
    } else {
        SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            max_new_tokens: new,
            seed: seed_base + i as u64,
            ..SamplingParams::default()
        }
    }
}

/// The ids of each output token's top log-prob alternatives agree, and the prompt log-probs
/// (present on both sides or neither) start at the same position and agree within `tol`.
pub fn assert_same_extras(
    what: &str,
    got: &r3_rollout::GenerateResult,
    want: &r3_rollout::GenerateResult,
    tol: f32,
) {
    let tops = |r: &r3_rollout::GenerateResult| -> Vec<Vec<u32>> {
        let ids = |row: &Vec<(u32, f32)>| row.iter().map(|e| e.0).collect();
        r.output_top_logprobs.iter().map(ids).collect()
    };
    assert_eq!(tops(got), tops(want), "{what}: top log-prob ids");
    match (&got.prompt_logprobs, &want.prompt_logprobs) {
        (Some(x), Some(y)) => {
            assert_eq!(x.start, y.start, "{what}: prompt log-probs' start");
            let d = max_abs_diff(&x.logprobs, &y.logprobs);
            assert!(d <= tol, "{what}: prompt log-probs differ by {d}");
        }
        (None, None) => {}
        _ => panic!("{what}: prompt log-probs only on one side"),
    }
}

/// Two results of one request agree whole: tokens, finish, top log-probs' tokens and routes
/// (range, cells and the weight version of each row) equal; log-probs and prompt log-probs
/// within `tol`.
pub fn assert_same_result(
    what: &str,
    got: &r3_rollout::GenerateResult,
    want: &r3_rollout::GenerateResult,
    tol: f32,
) {
    assert_eq!(got.output_ids, want.output_ids, "{what}: tokens");
    assert_eq!(got.finish, want.finish, "{what}: finish");
    let d = max_abs_diff(&got.output_logprobs, &want.output_logprobs);
    assert!(d <= tol, "{what}: log-probs differ by {d}");
    assert_same_extras(what, got, want, tol);
    let (a, b) = (
        got.routes.as_ref().expect("routes"),
        want.routes.as_ref().expect("routes"),
    );
    assert_eq!(
        (a.start_pos(), a.end_pos()),
        (b.start_pos(), b.end_pos()),
        "{what}: routed positions"
    );
    assert_eq!(differing_cells(a, b), 0, "{what}: route cells");
    assert_eq!(a.versions(), b.versions(), "{what}: route rows' versions");
}

/// Bytes of activations the device engine's estimate gives a step of `rows` rows feeding
/// `time` tokens over `slots` slots (every fed position through the head with `all_logits`),
/// its attention in the query tiles an engine with an activation budget of `budget` runs
/// (`usize::MAX`: in one product, the most the step can need).
pub fn step_bytes(
    cfg: &r3_model::Config,
    (rows, time, slots): (usize, usize, usize),
    all_logits: bool,
    budget: usize,
) -> usize {
    use r3_rollout::device_engine::memory::{score_tiles, step_activation_bytes, StepShape};
    let shape = StepShape {
        rows,
        time,
        slots,
        logit_positions: if all_logits { time } else { 1 },
    };
    step_activation_bytes(cfg, shape, score_tiles(budget))
}

/// The chunks `budget` cuts a lone prefill of positions `first..len` into (every position
/// through the head with `all_logits`): each the longest step over the slots fed before it
/// that the budget takes, found by trying one length after another — the engine's binary
/// search (`memory::prefill_chunk`) re-derived.
pub fn prefill_chunks_under(
    cfg: &r3_model::Config,
    budget: usize,
    first: usize,
    len: usize,
    all_logits: bool,
) -> usize {
    let (mut fed, mut chunks) = (first, 0);
    while fed < len {
        fed += (1..=len - fed)
            .take_while(|&t| step_bytes(cfg, (1, t, fed + t), all_logits, budget) <= budget)
            .last()
            .expect("a chunk of one token fits");
        chunks += 1;
    }
    chunks
}

/// The CPU engine over `map` in f32, without its prefix cache: the reference the device
/// engine's tests compare with.
pub fn cpu_engine_over(cfg: &r3_model::Config, map: &r3_rollout::TensorMap) -> Engine {
    let engine_cfg = EngineConfig {
        dtype: Dtype::F32,
        prefix_cache: false,
        kv_cache_bytes: 64 << 20,
        ..EngineConfig::default()
    };
    Engine::new(cfg.clone(), map, engine_cfg).expect("cpu engine")
}
