//! A weight sync overwrites the engine's weights in place (no buffer is allocated): after it
//! the engine must hold exactly what a fresh load of the same tensors builds, bit for bit, in
//! every engine dtype and router dtype, for every family, with experts per expert or fused
//! and with tensors in f32 or bf16. A map the config does not fit is refused before anything
//! is written, and weights of another layout are built afresh.

mod common;
#[path = "../../r3-model/tests/common/mod.rs"]
mod model_common;

use candle_core::DType;
use common::full_forward;
use model_common::{sequences, tiny_json, tiny_weights, FAMILIES};
use r3_model::{Config, Weights};
use r3_rollout::model::weights::ModelWeights;
use r3_rollout::model::InferenceModel;
use r3_rollout::{Dtype, RouterDtype, TensorMap};

/// Every value of the weights: `Debug` prints each f32 in its shortest round-trip form (two
/// values print alike only when their bits are equal, -0.0 included) and each packed half
/// value as its bits, along with every shape.
fn bits(w: &ModelWeights) -> String {
    format!("{w:?}")
}

fn config(family: &str) -> Config {
    Config::from_value(tiny_json(family)).expect("tiny config")
}

fn map(cfg: &Config, w: &Weights, fused: bool) -> TensorMap {
    if fused {
        w.clone().fuse_experts(cfg).expect("fuse").into_map()
    } else {
        w.clone().into_map()
    }
}

const DTYPES: [(Dtype, RouterDtype); 5] = [
    (Dtype::F32, RouterDtype::Model),
    (Dtype::F16, RouterDtype::Model),
    (Dtype::Bf16, RouterDtype::Model),
    (Dtype::F16, RouterDtype::F32),
    (Dtype::Bf16, RouterDtype::F32),
];

#[test]
fn a_sync_leaves_what_a_fresh_load_builds_bit_for_bit() {
    for family in FAMILIES {
        let cfg = config(family);
        let old = tiny_weights(&cfg, 1, DType::F32);
        for (new_dtype, fused) in [(DType::F32, false), (DType::F32, true), (DType::BF16, true)] {
            let new = tiny_weights(&cfg, 2, new_dtype);
            let (old_map, new_map) = (map(&cfg, &old, fused), map(&cfg, &new, fused));
            for (dtype, router) in DTYPES {
                let case = format!("{family} {dtype} router {router} fused={fused} {new_dtype:?}");
                let build = |m: &TensorMap| {
                    ModelWeights::from_tensors_with_router(&cfg, m, dtype, router).expect(&case)
                };
                let mut synced = build(&old_map);
                let before = bits(&synced);
                synced.refill(&cfg, &new_map, dtype, router).expect(&case);
                let after = bits(&synced);
                assert_eq!(after, bits(&build(&new_map)), "{case}");
                assert_ne!(after, before, "{case}: the sync changed nothing");
            }
        }
    }
}

#[test]
fn a_synced_engine_model_computes_what_a_fresh_one_does() {
    for family in ["qwen3_moe", "deepseek_v3"] {
        let cfg = config(family);
        let old = map(&cfg, &tiny_weights(&cfg, 3, DType::F32), true);
        let new = map(&cfg, &tiny_weights(&cfg, 4, DType::F32), true);
        let tokens = &sequences(&[9], cfg.vocab_size, 5)[0];
        for dtype in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
            let mut synced = InferenceModel::new(cfg.clone(), &old, dtype).expect("old model");
            let before = full_forward(&mut synced, tokens);
            synced.load_weights(&new).expect("sync");
            let mut fresh = InferenceModel::new(cfg.clone(), &new, dtype).expect("new model");
            let (got, want) = (
                full_forward(&mut synced, tokens),
                full_forward(&mut fresh, tokens),
            );
            let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.0), bits(&want.0), "{family} {dtype}: logits");
            assert_eq!(got.1, want.1, "{family} {dtype}: routes");
            assert_ne!(
                bits(&got.0),
                bits(&before.0),
                "{family} {dtype}: nothing changed"
            );
        }
    }
}

#[test]
fn a_map_the_config_does_not_fit_is_refused_before_anything_is_written() {
    let cfg = config("qwen3_moe");
    let old = map(&cfg, &tiny_weights(&cfg, 1, DType::F32), true);
    let mut bad = map(&cfg, &tiny_weights(&cfg, 2, DType::F32), true);
    let missing = "model.layers.2.self_attn.o_proj.weight";
    assert!(
        bad.remove(missing).is_some(),
        "the test removes a real tensor"
    );
    for dtype in [Dtype::F32, Dtype::F16] {
        let mut w = ModelWeights::from_tensors(&cfg, &old, dtype).expect("build");
        let before = bits(&w);
        let err = w
            .refill(&cfg, &bad, dtype, RouterDtype::Model)
            .expect_err("a missing tensor");
        assert!(err.to_string().contains(missing), "{err}");
        assert_eq!(bits(&w), before, "{dtype}: a refused sync wrote weights");
    }
}

#[test]
fn weights_of_another_layout_are_built_afresh() {
    let cfg = config("qwen3_moe");
    let mut json = tiny_json("qwen3_moe");
    json["num_hidden_layers"] = serde_json::json!(2);
    let shallow = Config::from_value(json).expect("two-layer config");
    let shallow_map = map(&shallow, &tiny_weights(&shallow, 1, DType::F32), false);
    let new = map(&cfg, &tiny_weights(&cfg, 2, DType::F32), false);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let mut w = ModelWeights::from_tensors(&shallow, &shallow_map, dtype).expect("build");
        w.refill(&cfg, &new, dtype, RouterDtype::Model)
            .expect("built afresh");
        let fresh = ModelWeights::from_tensors(&cfg, &new, dtype).expect("fresh");
        assert_eq!(bits(&w), bits(&fresh), "{dtype}");
    }
}
