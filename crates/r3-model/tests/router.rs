//! Router math on hand-computed cases: softmax top-k, DeepSeek grouped top-k with the
//! correction bias, gate formulas, and agreement of the tensor and plain-slice halves.

mod common;

use candle_core::{Device, Tensor};
use common::{softmax_router, tied_logits};
use r3_model::layers::moe::route_rows::route_softmax_rows;
use r3_model::{ModelError, Router, RouterKind};

fn grouped() -> Router {
    Router {
        kind: RouterKind::GroupedSigmoid {
            n_group: 4,
            topk_group: 2,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
        },
        num_experts: 8,
        top_k: 2,
    }
}

#[test]
fn grouped_select_keeps_the_best_groups() {
    // sigmoid(0) = 0.5, so scores are 0.5 + bias:
    // groups (0.9, 0.5) (0.6, 0.6) (0.8, 0.75) (-0.1, 1.0) → sums 1.4 1.2 1.55 0.9.
    // Groups 2 and 0 survive; expert 7 (best score, 1.0) is in a dropped group.
    let bias = [0.4, 0.0, 0.1, 0.1, 0.3, 0.25, -0.6, 0.5];
    let mut ids = [0u32; 2];
    grouped()
        .select_row(0, &[0.0; 8], Some(&bias), &mut ids)
        .expect("select");
    assert_eq!(ids, [0, 4]);
    // The bias only selects: both gates are sigmoid(0) normalised, × 2.5.
    let mut gates = [0f32; 2];
    grouped()
        .weigh_row(&[0.0; 8], &ids, &mut gates)
        .expect("weigh");
    assert_eq!(gates, [1.25, 1.25]);
}

#[test]
fn softmax_select_and_gates() {
    let logits = [1.0f32, 3.0, 2.0, 3.0];
    let norm = Router {
        kind: RouterKind::Softmax {
            norm_topk_prob: true,
        },
        num_experts: 4,
        top_k: 2,
    };
    let mut ids = [0u32; 2];
    norm.select_row(0, &logits, None, &mut ids).expect("select");
    assert_eq!(ids, [1, 3], "ties go to the lower id");
    let mut gates = [0f32; 2];
    norm.weigh_row(&logits, &ids, &mut gates).expect("weigh");
    assert_eq!(gates, [0.5, 0.5]);
    let raw = Router {
        kind: RouterKind::Softmax {
            norm_topk_prob: false,
        },
        ..norm
    };
    raw.weigh_row(&logits, &[2, 0], &mut gates).expect("weigh");
    let z: f32 = logits.iter().map(|x| x.exp()).sum();
    assert!((gates[0] - 2f32.exp() / z).abs() < 1e-7 && (gates[1] - 1f32.exp() / z).abs() < 1e-7);
}

#[test]
fn tensor_and_slice_weigh_agree() {
    let rows = 5;
    let logits: Vec<f32> = (0..rows * 8)
        .map(|i| ((i * 37 % 17) as f32 - 8.0) / 3.0)
        .collect();
    let bias: Vec<f32> = (0..8).map(|i| i as f32 * 0.01).collect();
    let norm_softmax = Router {
        kind: RouterKind::Softmax {
            norm_topk_prob: true,
        },
        num_experts: 8,
        top_k: 3,
    };
    for router in [grouped(), norm_softmax] {
        let ids = router.select_rows(&logits, Some(&bias)).expect("select");
        let lt = Tensor::from_vec(logits.clone(), (rows, 8), &Device::Cpu).expect("t");
        let it = Tensor::from_vec(ids.clone(), (rows, router.top_k), &Device::Cpu).expect("t");
        // The batched form is the per-row form applied to every row.
        for r in 0..rows {
            let mut row_ids = vec![0u32; router.top_k];
            router
                .select_row(r, &logits[r * 8..(r + 1) * 8], Some(&bias), &mut row_ids)
                .expect("select_row");
            assert_eq!(row_ids, ids[r * router.top_k..(r + 1) * router.top_k]);
        }
        let gates = router
            .weigh(&lt, &it)
            .expect("weigh")
            .flatten_all()
            .expect("f")
            .to_vec1::<f32>()
            .expect("v");
        for r in 0..rows {
            let mut row = vec![0f32; router.top_k];
            router
                .weigh_row(
                    &logits[r * 8..(r + 1) * 8],
                    &ids[r * router.top_k..(r + 1) * router.top_k],
                    &mut row,
                )
                .expect("weigh_row");
            for (a, b) in row.iter().zip(&gates[r * router.top_k..]) {
                assert!((a - b).abs() < 1e-6, "row {r}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn non_finite_scores_are_errors() {
    let mut ids = [0u32; 2];
    let mut logits = [0.0f32; 8];
    logits[5] = f32::NAN;
    match grouped().select_row(3, &logits, None, &mut ids) {
        Err(ModelError::NonFiniteScore {
            row: 3, expert: 5, ..
        }) => {}
        other => panic!("expected NonFiniteScore, got {other:?}"),
    }
}

/// The selection on the device (the engine's step routed without the host) chooses exactly
/// what the host selection chooses, in its order: ties to the lower index, −0 below +0,
/// rows wider than a GPU block's threads. On the CPU device here; `tests/devices.rs` runs the
/// same on a GPU.
#[test]
fn the_selection_on_the_device_is_the_host_selection() {
    for (experts, top_k) in [(8usize, 2usize), (128, 8), (3000, 6)] {
        let router = softmax_router(experts, top_k, true);
        assert!(router.selects_on_device());
        let rows = 37;
        let logits = tied_logits(rows, experts);
        let want = router.select_rows(&logits, None).expect("host");
        let t = Tensor::from_vec(logits, (rows, experts), &Device::Cpu).expect("logits");
        let got = route_softmax_rows(&router, &t)
            .and_then(|choice| Ok(choice.ids.flatten_all()?.to_vec1::<u32>()?))
            .expect("device");
        assert_eq!(got, want, "{experts} experts, top-{top_k}");
    }
    let grouped = grouped();
    assert!(!grouped.selects_on_device());
    let t = Tensor::zeros((1, 8), candle_core::DType::F32, &Device::Cpu).expect("logits");
    let err = route_softmax_rows(&grouped, &t).expect_err("on the host only");
    assert!(err.to_string().contains("on the host"), "{err}");
}
