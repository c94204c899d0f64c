//! The engine against r3-model's training forward on every family with random weights (the
//! trainer is the independent truth here; it matches the HF oracle in r3-model's tests):
//! equal f32 logits and routed expert sets whether the experts arrive per expert (a
//! checkpoint) or fused `[E, 2I, H]` (a weight sync), YaRN RoPE included; and a broken
//! config or weight map is refused with an error, never run with a silent fallback.

mod common;
#[path = "../../r3-model/tests/common/mod.rs"]
mod model_common;

use candle_core::{DType, Device};
use common::full_forward;
use model_common::{sequences, tiny_json, tiny_weights, FAMILIES};
use r3_model::{Batch, Config, Model, Routing, Weights};
use r3_rollout::model::InferenceModel;
use r3_rollout::{Dtype, RolloutError, TensorMap};

/// `family`'s tiny config, with YaRN scaling when `yarn` (DeepSeek-style mscale keys for
/// MLA, so both the attention factor and MLA's softmax multiplier differ from 1).
fn config(family: &str, yarn: bool) -> Config {
    let mut json = tiny_json(family);
    if yarn {
        json["rope_scaling"] = serde_json::json!({
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0
        });
    }
    Config::from_value(json).expect("tiny config")
}

/// Engine logits `[t, vocab]` and captured routes `[t, cols, k]` of one full-sequence forward.
fn engine_forward(cfg: &Config, tensors: &TensorMap, tokens: &[u32]) -> (Vec<f32>, Vec<u16>) {
    let mut model = InferenceModel::new(cfg.clone(), tensors, Dtype::F32).expect("engine model");
    full_forward(&mut model, tokens)
}

/// Trainer logits `[t, vocab]` and sorted expert sets per (token, column).
fn trainer_forward(cfg: &Config, weights: &Weights, tokens: &[u32]) -> (Vec<f32>, Vec<Vec<u16>>) {
    let model = Model::new(cfg, weights).expect("model");
    let batch = Batch::new(&[tokens.to_vec()], 0, &Device::Cpu).expect("batch");
    let out = model.forward(&batch, Routing::Record).expect("forward");
    let logits = out
        .logits
        .flatten_all()
        .and_then(|l| l.to_vec1::<f32>())
        .expect("logits");
    let table = &out.routes.expect("routes")[0];
    let mut sets = Vec::new();
    for tok in 0..table.num_tokens() {
        for col in 0..table.num_columns() {
            let mut set = table.experts(tok, col).expect("cell");
            set.sort();
            sets.push(set);
        }
    }
    (logits, sets)
}

fn check_family(family: &str, yarn: bool) {
    let cfg = config(family, yarn);
    let weights = tiny_weights(&cfg, 5, DType::F32);
    let tokens = sequences(&[24], cfg.vocab_size, 3).remove(0);
    let (want, want_sets) = trainer_forward(&cfg, &weights, &tokens);
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let per_expert = weights.clone().into_map();
    let fused = weights.fuse_experts(&cfg).expect("fuse").into_map();
    assert!(
        per_expert.keys().any(|k| k.contains(".experts.0."))
            && fused.keys().any(|k| k.ends_with("gate_up_proj")),
        "{family}: both expert layouts are exercised"
    );
    let k = cfg.top_k();
    for (layout, map) in [("per-expert", &per_expert), ("fused", &fused)] {
        let (logits, routes) = engine_forward(&cfg, map, &tokens);
        assert_eq!(logits.len(), want.len(), "{family} {layout}");
        let diff = logits
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            diff <= 1e-5 * scale,
            "{family} {layout} yarn={yarn}: logits differ by {diff} (scale {scale})"
        );
        let got_sets: Vec<Vec<u16>> = routes
            .chunks_exact(k)
            .map(|c| {
                let mut s = c.to_vec();
                s.sort();
                s
            })
            .collect();
        assert_eq!(got_sets, want_sets, "{family} {layout} yarn={yarn}: routes");
    }
}

#[test]
fn every_family_matches_the_trainer_from_per_expert_and_fused_experts() {
    // Every MoE family of the tiny test configs (DeepSeek-V3: MLA, grouped sigmoid routing,
    // shared experts and a dense first layer; Qwen2-MoE: gated shared expert).
    for family in FAMILIES {
        if config(family, false).moe.is_some() {
            check_family(family, false);
        }
    }
}

#[test]
fn yarn_rope_matches_the_trainer() {
    for family in ["qwen3_moe", "deepseek_v3"] {
        check_family(family, true);
    }
}

#[test]
fn a_moe_layer_without_moe_settings_is_refused() {
    let cfg = config("qwen3_moe", false);
    let map = tiny_weights(&cfg, 1, DType::F32).into_map();
    let mut broken = cfg.clone();
    // The layout still routes layers 0 and 2; the trainer refuses this config too.
    broken.moe = None;
    assert!(Model::new(&broken, &Weights::from_map(map.clone())).is_err());
    match InferenceModel::new(broken, &map, Dtype::F32) {
        Err(RolloutError::InconsistentMoeLayer { layer, .. }) => assert_eq!(layer, 0),
        other => panic!("expected InconsistentMoeLayer, got {other:?}"),
    }
}

#[test]
fn a_missing_router_or_misshaped_expert_is_named() {
    let cfg = config("deepseek_v3", false);
    let weights = tiny_weights(&cfg, 2, DType::F32);
    let mut map = weights.clone().fuse_experts(&cfg).expect("fuse").into_map();
    map.remove("model.layers.1.mlp.gate.weight");
    let err = InferenceModel::new(cfg.clone(), &map, Dtype::F32).expect_err("no router");
    assert!(
        err.to_string().contains("model.layers.1.mlp.gate.weight"),
        "{err}"
    );
    let mut map = weights.into_map();
    let name = "model.layers.2.mlp.experts.3.up_proj.weight";
    let short = map[name].narrow(0, 0, 2).expect("narrow");
    map.insert(name.to_string(), short);
    let err = InferenceModel::new(cfg, &map, Dtype::F32).expect_err("bad shape");
    assert!(err.to_string().contains(name), "{err}");
}
