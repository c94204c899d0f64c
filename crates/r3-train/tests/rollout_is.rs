//! TIS and MIS weights at token and sequence level, against hand-computed values.

use candle_core::{Device, Tensor, Var};
use r3_train::{rollout_is_weights, IsConfig, IsLevel, IsMode, TrainError};

fn t2(rows: &[Vec<f32>]) -> Tensor {
    Tensor::new(rows.to_vec(), &Device::Cpu).expect("tensor")
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .expect("flat")
        .to_vec1::<f32>()
        .expect("vec")
}

fn assert_close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
    }
}

fn cfg(mode: IsMode, level: IsLevel) -> IsConfig {
    IsConfig {
        mode,
        level,
        threshold: 2.0,
    }
}

/// Rows of π_old / π_rollout ratios as log-prob pairs (rollout = 0, old = ln ratio).
fn ratios(r: &[Vec<f32>]) -> (Tensor, Tensor) {
    let old: Vec<Vec<f32>> = r
        .iter()
        .map(|row| row.iter().map(|x| x.ln()).collect())
        .collect();
    let rollout = vec![vec![0.0f32; r[0].len()]; r.len()];
    (t2(&old), t2(&rollout))
}

#[test]
fn token_level_tis_truncates_and_mis_drops() {
    // Ratios [0.5, 1.5, 3, 2.5] with C = 2; last row's last token masked out.
    let (old, rollout) = ratios(&[vec![0.5, 1.5, 3.0, 2.5], vec![1.0, 1.0, 1.0, 9.0]]);
    let mask = t2(&[vec![1.0; 4], vec![1.0, 1.0, 1.0, 0.0]]);
    let tis = rollout_is_weights(&old, &rollout, &mask, &cfg(IsMode::Tis, IsLevel::Token))
        .expect("tis")
        .expect("some");
    assert_close(
        &vals(&tis.weights),
        &[0.5, 1.5, 2.0, 2.0, 1.0, 1.0, 1.0, 0.0],
    );
    // Over threshold: 2 of the 7 response tokens.
    let metrics = tis.sums.finish(7.0);
    assert!((metrics.over_threshold_frac - 2.0 / 7.0).abs() < 1e-6);
    // Mean weight (0.5 + 1.5 + 2 + 2 + 3) / 7.
    assert!((metrics.weight_mean - 9.0 / 7.0).abs() < 1e-5);
    let mis = rollout_is_weights(&old, &rollout, &mask, &cfg(IsMode::Mis, IsLevel::Token))
        .expect("mis")
        .expect("some");
    assert_close(
        &vals(&mis.weights),
        &[0.5, 1.5, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0],
    );
}

#[test]
fn sequence_level_uses_the_product_of_token_ratios() {
    // Row 0: 2 · 1.5 = 3 > C → TIS 2 on every token, MIS drops the row.
    // Row 1: 0.5 · 1.2 = 0.6 (masked third token ignored) → 0.6 on its tokens.
    let (old, rollout) = ratios(&[vec![2.0, 1.5, 1.0], vec![0.5, 1.2, 100.0]]);
    let mask = t2(&[vec![1.0; 3], vec![1.0, 1.0, 0.0]]);
    let tis = rollout_is_weights(&old, &rollout, &mask, &cfg(IsMode::Tis, IsLevel::Sequence))
        .expect("tis")
        .expect("some");
    assert_close(&vals(&tis.weights), &[2.0, 2.0, 2.0, 0.6, 0.6, 0.0]);
    assert!((tis.sums.finish(5.0).over_threshold_frac - 3.0 / 5.0).abs() < 1e-6);
    let mis = rollout_is_weights(&old, &rollout, &mask, &cfg(IsMode::Mis, IsLevel::Sequence))
        .expect("mis")
        .expect("some");
    assert_close(&vals(&mis.weights), &[0.0, 0.0, 0.0, 0.6, 0.6, 0.0]);
}

#[test]
fn the_statistics_of_micro_batches_add_up_to_the_batch_values() {
    // The rows of `token_level_tis_truncates_and_mis_drops` one at a time, as two
    // micro-batches of one mini-batch of 7 response tokens.
    let rows = [vec![0.5f32, 1.5, 3.0, 2.5], vec![1.0, 1.0, 1.0, 9.0]];
    let masks = [vec![1.0f32; 4], vec![1.0, 1.0, 1.0, 0.0]];
    for (mode, weight_sum) in [
        // TIS: 0.5 + 1.5 + 2 + 2 + 3 · 1; MIS drops the two tokens over C = 2.
        (IsMode::Tis, 9.0f32),
        (IsMode::Mis, 5.0),
    ] {
        let mut sums = r3_train::algo::rollout_is::IsSums::default();
        for (r, m) in rows.iter().zip(&masks) {
            let (old, rollout) = ratios(std::slice::from_ref(r));
            let w = rollout_is_weights(
                &old,
                &rollout,
                &t2(std::slice::from_ref(m)),
                &cfg(mode, IsLevel::Token),
            )
            .expect("weights")
            .expect("some");
            sums.add(&w.sums);
        }
        let m = sums.finish(7.0);
        assert!(
            (m.weight_mean - weight_sum / 7.0).abs() < 1e-6,
            "{mode:?} {m:?}"
        );
        assert!(
            (m.over_threshold_frac - 2.0 / 7.0).abs() < 1e-6,
            "{mode:?} {m:?}"
        );
        // ln(0.5 · 1.5 · 3 · 2.5 · 1 · 1 · 1) / 7 = ln 5.625 / 7 (the masked 9 left out).
        let log_mean = 5.625f32.ln() / 7.0;
        assert!((m.log_ratio_mean - log_mean).abs() < 1e-6, "{mode:?} {m:?}");
    }
}

#[test]
fn huge_ratios_do_not_overflow_and_weights_carry_no_gradient() {
    let old = Var::new(&[[500.0f32, 600.0]], &Device::Cpu).expect("var");
    let rollout = t2(&[vec![0.0, 0.0]]);
    let mask = t2(&[vec![1.0, 1.0]]);
    for mode in [IsMode::Tis, IsMode::Mis] {
        let w = rollout_is_weights(
            old.as_tensor(),
            &rollout,
            &mask,
            &cfg(mode, IsLevel::Sequence),
        )
        .expect("w")
        .expect("some");
        let v = vals(&w.weights);
        assert!(v.iter().all(|x| x.is_finite()), "{v:?}");
        let grads = w
            .weights
            .sum_all()
            .expect("sum")
            .backward()
            .expect("backward");
        assert!(
            grads.get(old.as_tensor()).is_none(),
            "weights must be detached"
        );
    }
}

#[test]
fn none_gives_none_and_bad_threshold_is_an_error() {
    let (old, rollout) = ratios(&[vec![1.0, 1.0]]);
    let mask = t2(&[vec![1.0, 1.0]]);
    assert!(
        rollout_is_weights(&old, &rollout, &mask, &cfg(IsMode::None, IsLevel::Token))
            .expect("ok")
            .is_none()
    );
    let bad = IsConfig {
        threshold: 0.0,
        ..cfg(IsMode::Tis, IsLevel::Token)
    };
    assert!(matches!(
        rollout_is_weights(&old, &rollout, &mask, &bad),
        Err(TrainError::OutOfRange { .. })
    ));
    let short = t2(&[vec![1.0]]);
    assert!(matches!(
        rollout_is_weights(&old, &short, &mask, &cfg(IsMode::Tis, IsLevel::Token)),
        Err(TrainError::Shape { .. })
    ));
}
