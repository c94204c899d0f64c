//! The training forward against HF transformers (fixtures written by
//! `scripts/oracle/make_oracle.py` into tests/fixtures): logits, per-layer top-k
//! sets, hidden states, and forced-routing (replay) logits, for Qwen3-MoE and DeepSeek-V3
//! (`reference_outputs.json`) and for Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 with YaRN, and
//! the dense Qwen3, Qwen2 and Llama (`reference_outputs_families.json`).

mod common;

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use common::sorted_experts;
use r3_model::{Batch, Config, ForwardOutput, Model, ReplayRoutes, Routing, Weights};
use r3_routing::{LayerSpace, RouteTable};
use serde_json::Value;

const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The MoE fixtures of the other families (`reference_outputs_families.json`).
const FAMILY_MOE: [&str; 4] = [
    "qwen2_moe_tiny",
    "mixtral_tiny",
    "olmoe_tiny",
    "deepseek_v3_yarn_tiny",
];
/// The dense fixtures (`reference_outputs_families.json`): no router, so no routes.
const FAMILY_DENSE: [&str; 3] = ["qwen3_tiny", "qwen2_tiny", "llama_tiny"];

/// The file holding `name`'s references: the first two fixtures have their own.
fn reference_file(name: &str) -> &'static str {
    match name {
        "qwen3_moe_tiny" | "deepseek_v3_tiny" => "reference_outputs.json",
        _ => "reference_outputs_families.json",
    }
}

fn reference(name: &str) -> (Value, Vec<u32>) {
    let text =
        std::fs::read_to_string(fixtures().join(reference_file(name))).expect("read reference");
    let all: Value = serde_json::from_str(&text).expect("parse reference");
    let ids = all["input_ids"][0]
        .as_array()
        .expect("input_ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect();
    (all[name].clone(), ids)
}

fn load(name: &str) -> (Config, Model) {
    let dir = fixtures().join(name);
    let cfg = Config::from_file(&dir.join("config.json")).expect("config");
    let weights = Weights::load(&dir, &cfg, &Device::Cpu).expect("weights");
    let model = Model::new(&cfg, &weights).expect("model");
    (cfg, model)
}

fn matrix(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .expect("matrix")
        .iter()
        .map(|row| {
            row.as_array()
                .expect("row")
                .iter()
                .map(|x| x.as_f64().expect("num") as f32)
                .collect()
        })
        .collect()
}

fn max_abs_diff(got: &Tensor, want: &[Vec<f32>], rows: usize) -> f32 {
    let got = got.to_vec2::<f32>().expect("to_vec2");
    let mut worst = 0f32;
    for (g, w) in got.iter().zip(want).take(rows) {
        assert_eq!(g.len(), w.len());
        for (a, b) in g.iter().zip(w) {
            worst = worst.max((a - b).abs());
        }
    }
    worst
}

fn run(model: &Model, ids: &[u32], routing: Routing<'_>) -> ForwardOutput {
    let batch = Batch::new(&[ids.to_vec()], 0, &Device::Cpu).expect("batch");
    model.forward_with(&batch, routing, true).expect("forward")
}

fn check_native(name: &str) {
    let (reference, ids) = reference(name);
    let (cfg, model) = load(name);
    // A dense model has nothing to record.
    let routing = match cfg.moe {
        Some(_) => Routing::Record,
        None => Routing::Native,
    };
    let out = run(&model, &ids, routing);
    let logits = out.logits.squeeze(0).expect("squeeze");
    let diff = max_abs_diff(&logits, &matrix(&reference["logits"]), ids.len());
    println!("{name}: f32 max |logit - HF| = {diff:.2e}");
    assert!(diff < TOL, "{name}: max |Δlogit| = {diff}");

    let hidden = out.hidden_states.expect("hidden states");
    let want = reference["hidden_states"].as_array().expect("hidden");
    assert_eq!(hidden.len(), want.len(), "{name}: number of hidden states");
    for (i, (h, w)) in hidden.iter().zip(want).enumerate() {
        let diff = max_abs_diff(&h.squeeze(0).expect("squeeze"), &matrix(w), ids.len());
        assert!(diff < TOL, "{name}: hidden state {i} max |Δ| = {diff}");
    }

    let layers = reference["moe_layers"].as_object().expect("moe_layers");
    assert_eq!(layers.len(), cfg.layout.moe_layers().len());
    if layers.is_empty() {
        // A dense model routes nothing.
        assert!(
            cfg.moe.is_none(),
            "{name}: no MoE layer in HF, a MoE config in r3"
        );
        return;
    }
    let routes = out.routes.expect("recorded routes");
    assert_eq!(routes.len(), 1);
    let table = &routes[0];
    assert_eq!(table.num_tokens(), ids.len());
    assert_eq!(table.layers(), cfg.layout.moe_layers());
    for (column, &layer) in cfg.layout.moe_layers().iter().enumerate() {
        let want = &layers[&layer.to_string()]["topk_idx_sorted"];
        for t in 0..ids.len() {
            let got = sorted_experts(table, t, column);
            let want: Vec<u64> = want[t]
                .as_array()
                .expect("row")
                .iter()
                .map(|v| v.as_u64().expect("id"))
                .collect();
            assert_eq!(got, want, "{name}: layer {layer}, token {t}");
        }
    }
}

/// The oracle's forced routing as a MoE-only table covering `rows` tokens.
fn forced_table(cfg: &Config, reference: &Value, rows: usize) -> RouteTable {
    let forced = &reference["routing_replay"]["forced_topk_idx"];
    let columns: Vec<Vec<u32>> = cfg
        .layout
        .moe_layers()
        .iter()
        .map(|layer| {
            forced[layer.to_string()]
                .as_array()
                .expect("layer")
                .iter()
                .take(rows)
                .flat_map(|row| {
                    row.as_array()
                        .expect("row")
                        .iter()
                        .map(|v| v.as_u64().expect("id") as u32)
                })
                .collect()
        })
        .collect();
    RouteTable::from_columns(
        cfg.num_experts(),
        cfg.top_k(),
        LayerSpace::MoeOnly,
        cfg.layout.moe_layers().to_vec(),
        0,
        &columns,
    )
    .expect("forced table")
}

fn check_replay(name: &str) {
    let (reference, ids) = reference(name);
    let (cfg, model) = load(name);
    let want = matrix(&reference["routing_replay"]["logits"]);
    let n = ids.len();

    let full =
        ReplayRoutes::new(vec![forced_table(&cfg, &reference, n)], &cfg.layout).expect("covered");
    let out = run(&model, &ids, Routing::Replay(&full));
    let diff = max_abs_diff(&out.logits.squeeze(0).expect("squeeze"), &want, n);
    println!("{name}: replayed f32 max |logit - HF| = {diff:.2e}");
    assert!(diff < TOL, "{name}: replayed max |Δlogit| = {diff}");
    let proof = out.replay.expect("proof");
    assert_eq!(proof.replayed_cells, vec![n; cfg.layout.moe_layers().len()]);
    assert_eq!(proof.native_final_position, vec![false]);
    let want_differing = common::tokens_differing_from_native(
        &reference["routing_replay"],
        cfg.layout.moe_layers(),
        n,
    );
    assert_eq!(proof.differs_from_native, want_differing, "{name}");

    // Rollout convention: tokens − 1 rows; the final position is routed natively and said so.
    let short = ReplayRoutes::new(vec![forced_table(&cfg, &reference, n - 1)], &cfg.layout)
        .expect("covered");
    let out = run(&model, &ids, Routing::Replay(&short));
    let diff = max_abs_diff(&out.logits.squeeze(0).expect("squeeze"), &want, n - 1);
    assert!(
        diff < TOL,
        "{name}: replayed (tokens−1 rows) max |Δlogit| = {diff}"
    );
    let proof = out.replay.expect("proof");
    assert_eq!(proof.native_final_position, vec![true]);
    assert_eq!(
        proof.replayed_cells,
        vec![n - 1; cfg.layout.moe_layers().len()]
    );
    assert_eq!(proof.native_cells, vec![1; cfg.layout.moe_layers().len()]);
}

#[test]
fn qwen3_moe_matches_hf() {
    check_native("qwen3_moe_tiny");
}

#[test]
fn deepseek_v3_matches_hf() {
    check_native("deepseek_v3_tiny");
}

#[test]
fn qwen3_moe_replay_matches_hf() {
    check_replay("qwen3_moe_tiny");
}

#[test]
fn deepseek_v3_replay_matches_hf() {
    check_replay("deepseek_v3_tiny");
}

#[test]
fn other_moe_families_match_hf() {
    for name in FAMILY_MOE {
        check_native(name);
    }
}

#[test]
fn other_moe_families_replay_matches_hf() {
    for name in FAMILY_MOE {
        check_replay(name);
    }
}

#[test]
fn dense_families_match_hf() {
    for name in FAMILY_DENSE {
        check_native(name);
    }
}
