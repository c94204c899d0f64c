//! AdamW, gradient clipping, the LR schedule and the NaN-guarded update.

use candle_core::{DType, Device, Tensor, Var};
use r3_train::{
    backward_and_step, clip_grad_norm, decay_matrices_only, AdamW, AdamWParams, LrDecay,
    LrSchedule, SkipReason, UpdateOutcome,
};

fn scalar_var(x: f32) -> Var {
    Var::new(&[x], &Device::Cpu).expect("var")
}

fn get(v: &Var) -> f32 {
    v.as_tensor().to_vec1::<f32>().expect("vec")[0]
}

fn adam(vars: Vec<(&str, &Var)>, wd: f64) -> AdamW {
    let vars = vars
        .into_iter()
        .map(|(n, v)| (n.to_string(), v.clone()))
        .collect();
    let params = AdamWParams {
        weight_decay: wd,
        ..AdamWParams::default()
    };
    AdamW::new(vars, params, |_, _| true).expect("adamw")
}

/// d/dθ of c·θ is c: builds that loss's gradients.
fn grads_of(pairs: &[(&Var, f32)]) -> candle_core::backprop::GradStore {
    let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).expect("zero");
    for (v, c) in pairs {
        let term = v.as_tensor().affine(f64::from(*c), 0.0).expect("mul");
        loss = loss.add(&term.sum_all().expect("sum")).expect("add");
    }
    loss.backward().expect("backward")
}

#[test]
fn adamw_steps_by_hand() {
    // θ=1, g=0.5, lr=0.1, β=(0.9,0.999): m=0.05, v=0.00025; m̂=0.5, v̂=0.25 → step 0.5/0.5 = 1
    // → θ = 1 - 0.1 = 0.9. Step 2, g=-1: m = 0.045 - 0.1 = -0.055, m̂ = -0.055/0.19 = -0.289474;
    // v = 0.00024975 + 0.001 = 0.00124975, v̂ = /0.001999 = 0.625188, sqrt 0.790688
    // → θ = 0.9 + 0.1·0.289474/0.790688 = 0.936610.
    let theta = scalar_var(1.0);
    let mut opt = adam(vec![("w", &theta)], 0.0);
    opt.step(&grads_of(&[(&theta, 0.5)]), 0.1).expect("step");
    assert!((get(&theta) - 0.9).abs() < 1e-6);
    opt.step(&grads_of(&[(&theta, -1.0)]), 0.1).expect("step");
    assert!((get(&theta) - 0.936610).abs() < 1e-5, "{}", get(&theta));
    assert_eq!(opt.step_count(), 2);
}

#[test]
fn weight_decay_is_decoupled_and_follows_the_rule() {
    // θ = 1·(1 - lr·wd) - lr·1 = 1·(1 - 0.01) - 0.1 = 0.89 for a decayed matrix;
    // 0.9 for a vector the rule exempts.
    let dev = Device::Cpu;
    let mat = Var::new(&[[1.0f32]], &dev).expect("mat");
    let vec = scalar_var(1.0);
    let params = AdamWParams {
        weight_decay: 0.1,
        ..AdamWParams::default()
    };
    let vars = vec![
        ("mat".to_string(), mat.clone()),
        ("vec".to_string(), vec.clone()),
    ];
    let mut opt = AdamW::new(vars, params, decay_matrices_only).expect("adamw");
    opt.step(&grads_of(&[(&mat, 0.5), (&vec, 0.5)]), 0.1)
        .expect("step");
    let m = mat.as_tensor().to_vec2::<f32>().expect("v")[0][0];
    assert!((m - 0.89).abs() < 1e-6, "{m}");
    assert!((get(&vec) - 0.9).abs() < 1e-6);
}

#[test]
fn variables_without_gradients_are_untouched() {
    let used = scalar_var(1.0);
    let unused = scalar_var(3.0);
    let mut opt = adam(vec![("a", &used), ("b", &unused)], 0.5);
    opt.step(&grads_of(&[(&used, 1.0)]), 0.1).expect("step");
    assert_eq!(get(&unused), 3.0, "no decay without a gradient");
    let state = opt.state_tensors();
    let v = |k: &str| state[k].to_vec1::<f32>().expect("v")[0];
    assert_eq!((v("adamw.m.b"), v("adamw.v.b")), (0.0, 0.0));
    assert!(v("adamw.m.a") != 0.0);
}

#[test]
fn state_round_trip_continues_identically() {
    let a = scalar_var(1.0);
    let b = scalar_var(1.0);
    let mut opt_a = adam(vec![("w", &a)], 0.01);
    for g in [0.3, -0.7] {
        opt_a.step(&grads_of(&[(&a, g)]), 0.05).expect("step");
    }
    // A fresh optimiser restored from A's state, on B set to A's weights.
    b.set(a.as_tensor()).expect("set");
    let mut opt_b = adam(vec![("w", &b)], 0.01);
    opt_b
        .load_state(&opt_a.state_tensors(), opt_a.step_count())
        .expect("load");
    opt_a.step(&grads_of(&[(&a, 0.2)]), 0.05).expect("step");
    opt_b.step(&grads_of(&[(&b, 0.2)]), 0.05).expect("step");
    assert_eq!(get(&a), get(&b));
    let mut wrong = std::collections::HashMap::new();
    wrong.insert(
        "adamw.m.w".to_string(),
        Tensor::zeros(2, DType::F32, &Device::Cpu).expect("z"),
    );
    assert!(
        opt_b.load_state(&wrong, 1).is_err(),
        "missing v and wrong shape"
    );
}

#[test]
fn grad_clipping_scales_to_max_norm() {
    // Gradients 3 and 4: global norm 5.
    let x = scalar_var(0.0);
    let y = scalar_var(0.0);
    let vars = [x.clone(), y.clone()];
    let mut grads = grads_of(&[(&x, 3.0), (&y, 4.0)]);
    let n = clip_grad_norm(vars.iter(), &mut grads, 10.0).expect("clip");
    assert_eq!((n.norm, n.scale), (5.0, 1.0));
    let n = clip_grad_norm(vars.iter(), &mut grads, 1.0).expect("clip");
    assert!((n.scale - 0.2).abs() < 1e-6);
    let g = |v: &Var| {
        grads
            .get(v.as_tensor())
            .expect("g")
            .to_vec1::<f32>()
            .expect("v")[0]
    };
    assert!((g(&x) - 0.6).abs() < 1e-6 && (g(&y) - 0.8).abs() < 1e-6);
    // Measured again after clipping: norm 1.
    let n = clip_grad_norm(vars.iter(), &mut grads, 0.0).expect("measure");
    assert!((n.norm - 1.0).abs() < 1e-5);
}

#[test]
fn nan_loss_or_grad_skips_and_leaves_everything_untouched() {
    let w = scalar_var(0.0);
    let mut opt = adam(vec![("w", &w)], 0.1);
    // NaN loss: skipped before backward.
    let nan_loss = w
        .as_tensor()
        .affine(1.0, f64::NAN)
        .expect("nan")
        .sum_all()
        .expect("s");
    let out = backward_and_step(&mut opt, &nan_loss, 0.1, 1.0).expect("guarded");
    assert!(matches!(
        out,
        UpdateOutcome::Skipped {
            reason: SkipReason::NonFiniteLoss,
            ..
        }
    ));
    // Finite loss sqrt(0) = 0 with an infinite gradient 1/(2·sqrt(0)).
    let inf_grad = w.as_tensor().sqrt().expect("sqrt").sum_all().expect("s");
    let out = backward_and_step(&mut opt, &inf_grad, 0.1, 1.0).expect("guarded");
    assert!(matches!(
        out,
        UpdateOutcome::Skipped {
            reason: SkipReason::NonFiniteGradNorm,
            ..
        }
    ));
    assert!(!out.applied());
    assert_eq!(get(&w), 0.0);
    assert_eq!(opt.step_count(), 0);
    let state = opt.state_tensors();
    assert_eq!(state["adamw.m.w"].to_vec1::<f32>().expect("m"), vec![0.0]);
    // A good loss then applies, with the gradient clipped to norm 1.
    let good = w
        .as_tensor()
        .affine(5.0, 0.0)
        .expect("l")
        .sum_all()
        .expect("s");
    match backward_and_step(&mut opt, &good, 0.1, 1.0).expect("guarded") {
        UpdateOutcome::Applied { grad_norm, .. } => {
            assert_eq!(grad_norm.norm, 5.0);
            assert!((grad_norm.scale - 0.2).abs() < 1e-6);
        }
        other => panic!("expected Applied, got {other:?}"),
    }
    assert!((get(&w) + 0.1).abs() < 1e-6, "first Adam step moves by lr");
}

#[test]
fn lr_schedule_warmup_then_constant_or_cosine() {
    let s = LrSchedule {
        peak_lr: 1.0,
        warmup_steps: 4,
        total_steps: 14,
        decay: LrDecay::Constant,
        min_lr_ratio: 0.1,
    };
    let lrs: Vec<f64> = (0..6).map(|i| s.lr_at(i)).collect();
    assert_eq!(lrs, vec![0.25, 0.5, 0.75, 1.0, 1.0, 1.0]);
    let c = LrSchedule {
        decay: LrDecay::Cosine,
        ..s
    };
    // After warm-up: 10 steps (4..=13) go from peak to min; halfway (4 + 4.5) = 0.55.
    assert!((c.lr_at(4) - 1.0).abs() < 1e-12);
    assert!((c.lr_at(13) - 0.1).abs() < 1e-12);
    assert!(
        (c.lr_at(50) - 0.1).abs() < 1e-12,
        "stays at min after the end"
    );
    let mid = 0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * 4.0 / 9.0).cos());
    assert!((c.lr_at(8) - mid).abs() < 1e-12);
}
