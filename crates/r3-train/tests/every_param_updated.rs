//! No parameter misses its update silently: after one guarded step on the tiny MoE model
//! every trainable variable has a gradient (the routed experts are fused, one variable per
//! layer, so even an expert no token reached sits in a variable that has one) and every
//! element with a nonzero gradient moved; exactly the experts some scored position was routed
//! to have a nonzero gradient slice, the others an all-zero one.

mod common;

use candle_core::{IndexOp, Tensor};
use common::{tiny_model, Scratch};
use r3_model::Routing;
use r3_train::policy::{score, ResponseBatch, TrainablePolicy};
use r3_train::{decay_matrices_only, guarded_step, AdamW, AdamWParams};
use std::collections::BTreeSet;

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .expect("flat")
        .to_vec1::<f32>()
        .expect("vec")
}

#[test]
fn every_trainable_variable_gets_a_gradient_and_moves() {
    let dir = Scratch::new("every-param-updated");
    let cfg = tiny_model(dir.path(), 3);
    let policy = TrainablePolicy::load(dir.path()).expect("policy");
    // one short sequence: few tokens, so some experts see none
    let batch = ResponseBatch::new(vec![vec![1, 10, 11, 12]], vec![2]).expect("batch");
    let model = policy.model().expect("model");
    let scored = score(&model, &batch, Routing::Record).expect("score");
    let loss = scored.logp.sum_all().expect("loss");
    let grads = loss.backward().expect("backward");

    let missing: Vec<&str> = policy
        .vars()
        .iter()
        .filter(|(_, v)| grads.get(v.as_tensor()).is_none())
        .map(|(n, _)| n.as_str())
        .collect();
    assert!(
        missing.is_empty(),
        "variables without a gradient: {missing:?}"
    );

    // The experts the forward routed a scored position to, per layer.
    let routes = scored.routes.expect("recorded routes");
    let mut used = vec![BTreeSet::new(); cfg.num_hidden_layers];
    for table in &routes {
        // the last position predicts nothing (causal attention: nothing else reads it), so
        // the experts it alone chose get no gradient either
        for token in 0..table.num_tokens() - 1 {
            for (column, &layer) in table.layers().iter().enumerate() {
                let experts = table.experts(token, column).unwrap_or_default();
                used[layer].extend(experts.into_iter().map(usize::from));
            }
        }
    }
    let mut unrouted = 0;
    for (name, var) in policy.vars() {
        if !name.contains(".experts.") {
            continue;
        }
        let layer: usize = name
            .split('.')
            .nth(2)
            .and_then(|s| s.parse().ok())
            .expect("layer index in the name");
        let g = grads.get(var.as_tensor()).expect("gradient");
        for e in 0..cfg.num_experts() {
            let slice = values(&g.i(e).expect("expert slice"));
            let nonzero = slice.iter().any(|&x| x != 0.0);
            if used[layer].contains(&e) {
                assert!(nonzero, "{name}: routed expert {e} has a zero gradient");
            } else {
                assert!(
                    !nonzero,
                    "{name}: expert {e}, routed no scored token, has a gradient"
                );
                unrouted += 1;
            }
        }
    }
    assert!(
        unrouted > 0,
        "the sequence is short enough to leave an expert unrouted"
    );

    let before: Vec<Vec<f32>> = policy
        .vars()
        .iter()
        .map(|(_, v)| values(v.as_tensor()))
        .collect();
    let gradients: Vec<Vec<f32>> = policy
        .vars()
        .iter()
        .map(|(_, v)| values(grads.get(v.as_tensor()).expect("gradient")))
        .collect();
    let mut opt = AdamW::new(
        policy.vars().to_vec(),
        AdamWParams::default(),
        decay_matrices_only,
    )
    .expect("optimiser");
    let value = r3_train::algo::logprob::scalar_f32(&loss).expect("loss value");
    let out = guarded_step(&mut opt, value, grads, 1e-3, 1.0).expect("step");
    assert!(out.applied(), "{out:?}");
    for (((name, var), old), g) in policy.vars().iter().zip(&before).zip(&gradients) {
        let new = values(var.as_tensor());
        let mut moved = 0;
        for ((&a, &b), &g) in old.iter().zip(&new).zip(g) {
            // below ~1e-19 g² underflows and the step falls under the weight's last bit
            if g.abs() > 1e-10 {
                assert_ne!(a, b, "{name}: an element with gradient {g} did not move");
                moved += 1;
            } else if g == 0.0 {
                // a zero gradient on the first step: m = v = 0, no decay at wd 0
                assert_eq!(a, b, "{name}: an element without gradient moved");
            }
        }
        assert!(moved > 0, "{name}: nothing moved");
    }
}
