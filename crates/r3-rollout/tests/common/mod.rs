//! Shared helpers of the rollout integration tests: fixture paths and oracle data.

#![allow(dead_code)]

use std::path::PathBuf;

use r3_rollout::{Dtype, Engine, EngineConfig};

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
