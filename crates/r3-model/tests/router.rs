//! Router math on hand-computed cases: softmax top-k, DeepSeek grouped top-k with the
//! correction bias, gate formulas, and agreement of the tensor and plain-slice halves.

mod common;

use candle_core::{Device, Tensor};
use common::{grouped_router, softmax_router, tied_logits};
use r3_model::layers::moe::route_rows::{read_choice, route_rows};
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
        let got = route_rows(&router, &t, None)
            .and_then(|choice| Ok(choice.ids.flatten_all()?.to_vec1::<u32>()?))
            .expect("device");
        assert_eq!(got, want, "{experts} experts, top-{top_k}");
        // A native training layer's read: the same ids on the host and on the device.
        let choice = read_choice(&router, &t, None, false).expect("read");
        let (host, on_device) = (choice.ids, choice.on_device);
        assert_eq!(host, want, "{experts} experts, top-{top_k} read");
        assert_eq!(on_device.dims(), &[rows, top_k]);
        let on_device = on_device
            .flatten_all()
            .and_then(|t| t.to_vec1::<u32>())
            .expect("device ids");
        assert_eq!(
            on_device, want,
            "{experts} experts, top-{top_k} on the device"
        );
    }
    // A grouped router whose groups hold one expert each has no two best: the host's.
    let single = Router {
        num_experts: 4,
        kind: RouterKind::GroupedSigmoid {
            n_group: 4,
            topk_group: 2,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0,
        },
        top_k: 2,
    };
    assert!(!single.selects_on_device());
    let t = Tensor::zeros((1, 4), candle_core::DType::F32, &Device::Cpu).expect("logits");
    let err = route_rows(&single, &t, None).expect_err("on the host only");
    assert!(err.to_string().contains("on the host"), "{err}");
    assert!(read_choice(&single, &t, None, false).is_err());
    // A softmax router takes no bias.
    let router = softmax_router(8, 2, true);
    let t = Tensor::zeros((1, 8), candle_core::DType::F32, &Device::Cpu).expect("logits");
    let bias = Tensor::zeros(8, candle_core::DType::F32, &Device::Cpu).expect("bias");
    assert!(route_rows(&router, &t, Some(&bias)).is_err());
    // No rows: nothing launched, nothing chosen.
    let router = softmax_router(8, 2, true);
    let none = Tensor::zeros((0, 8), candle_core::DType::F32, &Device::Cpu).expect("no rows");
    let choice = read_choice(&router, &none, None, true).expect("no rows");
    let (host, on_device) = (choice.ids, choice.on_device);
    assert_eq!(choice.gates.map(|g| g.dims().to_vec()), Some(vec![0, 2]));
    assert!(host.is_empty());
    assert_eq!(on_device.dims(), &[0, 2]);
    // Logits of another width than the router's experts.
    let wide = Tensor::zeros((2, 9), candle_core::DType::F32, &Device::Cpu).expect("wide");
    assert!(read_choice(&router, &wide, None, false).is_err());
}

/// DeepSeek-V3's grouped selection where the logits are chooses what the host chooses with
/// the same bias, in its order, and weighs as the host weighs, bit for bit: groups tied in
/// score (ties to the lower group), experts tied (to the lower index), a bias that makes the
/// zeros of dropped groups outrank kept negative scores, no bias, rows renormalised or not.
/// On the CPU device here; `tests/devices.rs` runs the same on a GPU.
#[test]
fn the_grouped_selection_on_the_device_is_the_host_selection() {
    for (experts, n_group, topk_group, top_k, norm) in [
        (8usize, 4usize, 2usize, 2usize, true),
        (64, 8, 3, 6, false),
        (256, 8, 4, 8, true),
        (96, 32, 5, 4, true),
    ] {
        let router = grouped_router(experts, n_group, topk_group, top_k, norm);
        assert!(router.selects_on_device());
        let rows = 29;
        let logits = tied_logits(rows, experts);
        // Repeating, partly negative biases: tied group scores, and kept scores below 0.
        let bias: Vec<f32> = (0..experts)
            .map(|e| ((e % 5) as f32 - 3.0) * 0.25)
            .collect();
        // Every score below 0: the dropped groups' zeros outrank the kept ones (HF's rule).
        let below = vec![-1.5f32; experts];
        let t = Tensor::from_vec(logits.clone(), (rows, experts), &Device::Cpu).expect("logits");
        for bias in [Some(bias.clone()), None, Some(below)] {
            let b = bias
                .as_ref()
                .map(|b| Tensor::from_vec(b.clone(), experts, &Device::Cpu).expect("bias"));
            let with_bias = bias.is_some();
            let want = router.select_rows(&logits, bias.as_deref()).expect("host");
            let choice = route_rows(&router, &t, b.as_ref()).expect("device");
            let ids = choice
                .ids
                .flatten_all()
                .and_then(|t| t.to_vec1::<u32>())
                .expect("ids");
            assert_eq!(ids, want, "{experts} experts, bias {with_bias}");
            let gates = choice
                .gates
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("gates");
            for r in 0..rows {
                let mut row = vec![0f32; top_k];
                router
                    .weigh_row(
                        &logits[r * experts..(r + 1) * experts],
                        &want[r * top_k..(r + 1) * top_k],
                        &mut row,
                    )
                    .expect("weigh");
                assert_eq!(
                    &gates[r * top_k..(r + 1) * top_k],
                    row.as_slice(),
                    "row {r}"
                );
            }
            let read = read_choice(&router, &t, b.as_ref(), true).expect("read");
            let read_gates = read
                .gates
                .map(|g| g.flatten_all().and_then(|g| g.to_vec1::<f32>()))
                .transpose()
                .expect("read gates");
            assert_eq!(
                read_gates.as_deref(),
                Some(gates.as_slice()),
                "{experts} experts read gates"
            );
            let host = read.ids;
            assert_eq!(host, want, "{experts} experts, bias {with_bias} read");
        }
        // A bias of another length is refused.
        let short =
            Tensor::zeros(experts - 1, candle_core::DType::F32, &Device::Cpu).expect("short bias");
        assert!(route_rows(&router, &t, Some(&short)).is_err());
    }
}

/// A row with a non-finite logit is, read from the device's choice, the host selection's
/// error exactly: the first such row, and its first such expert (NaN, +∞ and −∞ alike).
#[test]
fn a_non_finite_row_read_from_the_device_is_the_hosts_error() {
    let router = softmax_router(8, 2, true);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut logits = tied_logits(6, 8);
        logits[4 * 8 + 5] = bad;
        logits[4 * 8 + 6] = f32::NAN;
        logits[5 * 8 + 1] = f32::NAN;
        let want = router.select_rows(&logits, None).expect_err("host");
        let t = Tensor::from_vec(logits, (6, 8), &Device::Cpu).expect("logits");
        let got = read_choice(&router, &t, None, false).expect_err("device");
        assert!(
            matches!(
                got,
                ModelError::NonFiniteScore {
                    row: 4,
                    expert: 5,
                    ..
                }
            ),
            "{got}"
        );
        assert_eq!(got.to_string(), want.to_string());
    }
}

/// A DeepSeek-V3 model whose router score bias holds a NaN or an infinity is refused when it
/// is built, naming the tensor: the selection's order would be undefined (and differ between
/// the host and a GPU), whatever the load allowed.
#[test]
fn a_non_finite_score_bias_is_refused_naming_the_tensor() {
    let cfg = common::tiny_config("deepseek_v3");
    let weights = common::tiny_weights(&cfg, 3, candle_core::DType::F32);
    assert!(r3_model::Model::new(&cfg, &weights).is_ok());
    let mut map = weights.into_map();
    let name = map
        .keys()
        .find(|n| n.ends_with("gate.e_score_correction_bias"))
        .cloned()
        .expect("a score bias");
    for bad in [f32::NAN, f32::NEG_INFINITY] {
        let mut values = map[&name].to_vec1::<f32>().expect("bias");
        values[2] = bad;
        let n = values.len();
        map.insert(
            name.clone(),
            Tensor::from_vec(values, n, &Device::Cpu).expect("bad bias"),
        );
        let err = r3_model::Model::new(&cfg, &r3_model::Weights::from_map(map.clone()))
            .expect_err("refused");
        let text = err.to_string();
        assert!(text.contains(&name) && text.contains("index 2"), "{text}");
    }
}
