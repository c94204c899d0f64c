//! Log-probs, entropy and masked means against hand-computed values and autograd.

use candle_core::{Device, Tensor, Var};
use r3_train::{entropy_from_logits, masked_mean, token_log_probs, TrainError};

fn vals(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .expect("flat")
        .to_vec1::<f32>()
        .expect("vec")
}

#[test]
fn log_probs_and_entropy_by_hand() {
    let dev = Device::Cpu;
    let (l2, l3) = (2f32.ln(), 3f32.ln());
    // Row 0 pos 0: logits [0, ln2, ln3] → probs [1/6, 2/6, 3/6].
    // Row 0 pos 1: logits [5, 5, 5] → uniform 1/3.
    let logits = Tensor::new(&[[[0.0, l2, l3], [5.0, 5.0, 5.0]]], &dev).expect("logits");
    let targets = Tensor::new(&[[2u32, 0]], &dev).expect("targets");
    let lp = token_log_probs(&logits, &targets).expect("logp");
    assert_eq!(lp.dims(), [1, 2]);
    let lp = vals(&lp);
    assert!((lp[0] - 0.5f32.ln()).abs() < 1e-6);
    assert!((lp[1] - (1.0f32 / 3.0).ln()).abs() < 1e-6);
    // H = -(1/6 ln 1/6 + 1/3 ln 1/3 + 1/2 ln 1/2) = 1.011404; uniform: ln 3 = 1.098612.
    let h = vals(&entropy_from_logits(&logits).expect("entropy"));
    assert!((h[0] - 1.011404).abs() < 1e-5, "{h:?}");
    assert!((h[1] - 3f32.ln()).abs() < 1e-5, "{h:?}");
}

#[test]
fn log_prob_gradient_is_onehot_minus_softmax() {
    let dev = Device::Cpu;
    let raw = [[[0.3f32, -1.2, 2.0, 0.5], [1.0, 1.0, -3.0, 0.0]]];
    let logits = Var::new(&raw, &dev).expect("var");
    let targets = Tensor::new(&[[1u32, 3]], &dev).expect("targets");
    let lp = token_log_probs(logits.as_tensor(), &targets).expect("logp");
    let grads = lp.sum_all().expect("sum").backward().expect("backward");
    let g = vals(grads.get(logits.as_tensor()).expect("grad"));
    for (pos, target) in [(0usize, 1usize), (1, 3)] {
        let row = raw[0][pos];
        let z: f32 = row.iter().map(|x| x.exp()).sum();
        for v in 0..4 {
            let want = f32::from(v == target) - row[v].exp() / z;
            assert!((g[pos * 4 + v] - want).abs() < 1e-5, "pos {pos} v {v}");
        }
    }
}

#[test]
fn masked_mean_by_hand_and_shape_errors() {
    let dev = Device::Cpu;
    let x = Tensor::new(&[[1f32, 2.0, 3.0], [4.0, 5.0, 6.0]], &dev).expect("x");
    let m = Tensor::new(&[[1f32, 1.0, 0.0], [0.0, 1.0, 0.0]], &dev).expect("m");
    // (1 + 2 + 5) / 3
    let v = masked_mean(&x, &m)
        .expect("mean")
        .to_scalar::<f32>()
        .expect("scalar");
    assert!((v - 8.0 / 3.0).abs() < 1e-6);
    let empty = m.zeros_like().expect("zeros");
    assert_eq!(
        masked_mean(&x, &empty)
            .expect("mean")
            .to_scalar::<f32>()
            .expect("s"),
        0.0
    );
    let targets = Tensor::new(&[[0u32, 1]], &dev).expect("t");
    let logits = Tensor::zeros((1, 3, 4), candle_core::DType::F32, &dev).expect("l");
    assert!(matches!(
        token_log_probs(&logits, &targets),
        Err(TrainError::Shape { .. })
    ));
    let f16 = logits.to_dtype(candle_core::DType::F16).expect("f16");
    assert!(matches!(
        entropy_from_logits(&f16),
        Err(TrainError::Dtype { .. })
    ));
}
