//! Shared helpers of the rollout integration tests: fixture paths and oracle data.

#![allow(dead_code)]

use std::path::PathBuf;

use r3_rollout::kernels::attention::SeqSpan;
use r3_rollout::model::{BatchInput, InferenceModel};
use r3_rollout::{Dtype, Engine, EngineConfig, KvPool};

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

/// Logits `[t, vocab]` and captured routes `[t, cols, k]` of one full-sequence forward of
/// `tokens` through the engine's model (one sequence, fresh KV blocks, every row's logits).
pub fn full_forward(model: &mut InferenceModel, tokens: &[u32]) -> (Vec<f32>, Vec<u16>) {
    let t = tokens.len();
    let mut pool = KvPool::new(model.kv_layout(16), 8).expect("pool");
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
    (out.logits, out.routes.expect("routes captured"))
}
