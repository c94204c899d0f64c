//! Held 16-bit weight copies (`Weights::hold_narrow_copies`): the layers read them (a copy
//! made different changes the output); they hold the cast's values and follow their
//! variables; a copy of the wrong kind is refused. That a model reading them computes the
//! same bits as one casting its weights per use, on every family and device, is
//! `tests/devices.rs`'s `held_copies_give_the_same_bits`, on the CPU and on a GPU.

mod common;

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};
use common::{covering_tables, probe, sequences, tiny_config, tiny_weights};
use r3_model::{Batch, Config, Model, Precision, ReplayRoutes, Routing, Weights};
use r3_test_support::bits;

/// Logits and every variable's gradient of a probe loss, in `precision`, routes replayed
/// from covering tables (so every expert gets rows).
fn logits_and_grads(
    cfg: &Config,
    weights: &Weights,
    vars: &[(String, Var)],
    precision: Precision,
) -> (Vec<u32>, Vec<(String, Vec<u32>)>) {
    let model = Model::with_precision(cfg, weights, precision).expect("model");
    let lengths = [6, 4];
    let batch =
        Batch::new(&sequences(&lengths, cfg.vocab_size, 3), 0, &Device::Cpu).expect("batch");
    let tables;
    let routing = if cfg.moe.is_some() {
        tables = ReplayRoutes::new(covering_tables(cfg, &lengths), &cfg.layout).expect("covered");
        Routing::Replay(&tables)
    } else {
        Routing::Native
    };
    let logits = model.forward(&batch, routing).expect("forward").logits;
    let grads = (&logits * probe(&lengths, cfg.vocab_size, &Device::Cpu))
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    let grads = vars
        .iter()
        .map(|(name, var)| {
            let g = grads.get(var.as_tensor()).expect("gradient");
            (name.clone(), bits(g))
        })
        .collect();
    (bits(&logits), grads)
}

fn trainable(cfg: &Config) -> (Vec<(String, Var)>, Weights) {
    let (varmap, weights) = tiny_weights(cfg, 5, DType::F32)
        .into_trainable(cfg)
        .expect("trainable");
    let mut vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .expect("lock")
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    (vars, weights)
}

/// A copy that differs from the cast of its weight changes the logits and the input
/// gradients: the layers read the copies (a test that could not fail otherwise), for a
/// projection and for the head.
#[test]
fn the_layers_read_the_copies() {
    let cfg = tiny_config("qwen3_moe");
    let bf16 = Precision::Bf16 { router_f32: false };
    let (vars, weights) = trainable(&cfg);
    let want = logits_and_grads(&cfg, &weights, &vars, bf16);
    for name in ["lm_head.weight", "model.layers.0.self_attn.q_proj.weight"] {
        let mut held = weights.clone();
        let copies = held.hold_narrow_copies(&cfg, DType::BF16).expect("copies");
        let (_, var) = copies
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("a copy of {name}"));
        var.set(
            &(var.as_tensor().to_dtype(DType::F32).expect("f32") * 1.5)
                .and_then(|t| t.to_dtype(DType::BF16))
                .expect("changed"),
        )
        .expect("set");
        let got = logits_and_grads(&cfg, &held, &vars, bf16);
        assert!(want.0 != got.0, "{name}: the forward read the copy");
    }
}

/// Copies hold the cast's values, follow a rewrite of their variable, exist for the matrices
/// only (not the embedding, router or norms), and are refused in a wrong dtype or shape.
#[test]
fn copies_hold_the_cast_and_follow_their_variables() {
    let cfg = tiny_config("qwen3_moe");
    let (_, mut weights) = trainable(&cfg);
    let vars = weights
        .hold_narrow_copies(&cfg, DType::BF16)
        .expect("copies");
    let names: Vec<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.iter().all(|n| !n.contains("embed_tokens")
        && !n.ends_with("mlp.gate.weight")
        && !n.contains("norm")));
    assert!(names.iter().any(|n| n.contains("experts")), "{names:?}");
    assert!(names.iter().any(|n| n.contains("q_proj")), "{names:?}");
    assert!(names.contains(&"lm_head.weight"), "{names:?}");
    for (name, var) in &vars {
        let master = weights.get(name).expect("master").clone();
        let held = weights.narrow_copy(name).expect("held");
        assert!(
            bits(held) == bits(&master.to_dtype(DType::BF16).expect("cast")),
            "{name}"
        );
        let doubled = (&master * 2.0).expect("doubled");
        var.set(&doubled.to_dtype(DType::BF16).expect("new"))
            .expect("set");
        assert!(
            bits(weights.narrow_copy(name).expect("held"))
                == bits(&doubled.to_dtype(DType::BF16).expect("c")),
            "{name}: the held view sees the rewrite"
        );
    }
    let (name, _) = &vars[0];
    let w = weights.get(name).expect("w").clone();
    let rebuilt = |copy: Tensor| {
        Weights::from_map(weights.tensors().clone())
            .with_narrow_copies(BTreeMap::from([(name.clone(), copy)]))
    };
    let wrong_shape = Tensor::zeros((1, 1), DType::F16, &Device::Cpu).expect("t");
    assert!(rebuilt(wrong_shape).is_err());
    assert!(rebuilt(w.clone()).is_err(), "an f32 copy is refused");
    assert!(rebuilt(w.to_dtype(DType::F16).expect("f16")).is_ok());
    assert!(weights.hold_narrow_copies(&cfg, DType::F32).is_err());
}
