//! The fused CPU optimiser against the composed candle ops it replaces: AdamW's parameters
//! and moments bit for bit over several steps (with and without weight decay, with the clip
//! factor folded in), the same guard verdicts, results independent of the thread count, and
//! the fused gradient norm bit for bit candle's `sqr().sum_all()`.

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use r3_model::WeightPrecision;
use r3_test_support::bits;
use r3_train::{
    decay_matrices_only, global_grad_norm, global_grad_norm_composed, AdamW, AdamWKernel,
    AdamWParams, AdamWStep,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Shapes that cover a scalar-like vector, a tail past the 32-lane body, and a matrix big
/// enough to be split into several parallel chunks.
const SHAPES: [&[usize]; 5] = [&[1], &[33], &[7, 5], &[300, 251], &[2, 3, 4]];

/// Random values with exact zeros and negative zeros mixed in (the `+ 0.0` of candle's
/// `affine` turns −0 into +0: the fused pass must do the same).
fn random(rng: &mut ChaCha8Rng, shape: &[usize], scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| match rng.random_range(0..20) {
            0 => 0.0,
            1 => -0.0,
            _ => scale * (rng.random::<f32>() * 2.0 - 1.0),
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).expect("tensor")
}

/// A set of variables with equal initial values for each kernel.
fn vars(seed: u64) -> Vec<(String, Var)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let v = Var::from_tensor(&random(&mut rng, s, 1.0)).expect("var");
            (format!("w{i}"), v)
        })
        .collect()
}

fn optimiser(vars: &[(String, Var)], wd: f64, kernel: AdamWKernel) -> AdamW {
    let params = AdamWParams {
        weight_decay: wd,
        ..AdamWParams::default()
    };
    let mut opt = AdamW::new(vars.to_vec(), params, decay_matrices_only).expect("adamw");
    opt.set_kernel(kernel);
    opt
}

/// Gradients for every variable but the last on odd steps (a variable without a gradient).
fn grads(vars: &[(String, Var)], rng: &mut ChaCha8Rng, step: usize) -> GradStore {
    let mut store = GradStore::default();
    for (i, (_, v)) in vars.iter().enumerate() {
        if step % 2 == 1 && i == vars.len() - 1 {
            continue;
        }
        store.insert(v.as_tensor(), random(rng, v.dims(), 0.1));
    }
    store
}

fn assert_same_state(a: &AdamW, b: &AdamW, what: &str) {
    for ((name, va), (_, vb)) in a.vars().zip(b.vars()) {
        assert_eq!(bits(va.as_tensor()), bits(vb.as_tensor()), "{what}: {name}");
    }
    let (sa, sb) = (a.state_tensors(), b.state_tensors());
    for (k, t) in &sa {
        assert_eq!(bits(t), bits(&sb[k]), "{what}: {k}");
    }
}

#[test]
fn fused_adamw_is_bit_identical_to_the_composed_ops() {
    for wd in [0.0, 0.1] {
        for scale in [None, Some(0.37f32)] {
            let (va, vb) = (vars(1), vars(1));
            let mut fused = optimiser(&va, wd, AdamWKernel::Fused);
            let mut composed = optimiser(&vb, wd, AdamWKernel::Composed);
            let (mut ra, mut rb) = (ChaCha8Rng::seed_from_u64(9), ChaCha8Rng::seed_from_u64(9));
            for step in 0..5 {
                let lr = 1e-2 * (step + 1) as f64;
                let out_a = fused
                    .step_scaled(&grads(&va, &mut ra, step), lr, scale)
                    .expect("fused");
                let out_b = composed
                    .step_scaled(&grads(&vb, &mut rb, step), lr, scale)
                    .expect("composed");
                assert_eq!(out_a, AdamWStep::Applied);
                assert_eq!(out_b, AdamWStep::Applied);
                assert_same_state(
                    &fused,
                    &composed,
                    &format!("wd {wd}, scale {scale:?}, step {step}"),
                );
            }
            // the steps moved the weights: the comparison was not of two untouched states
            let start = vars(1);
            let moved = va
                .iter()
                .zip(&start)
                .all(|((_, a), (_, b))| bits(a.as_tensor()) != bits(b.as_tensor()));
            assert!(moved, "every variable changed");
        }
    }
}

#[test]
fn folded_clip_factor_equals_scaling_the_gradients_first() {
    let (va, vb) = (vars(2), vars(2));
    let mut folded = optimiser(&va, 0.1, AdamWKernel::Fused);
    let mut scaled_first = optimiser(&vb, 0.1, AdamWKernel::Composed);
    let (mut ra, mut rb) = (ChaCha8Rng::seed_from_u64(3), ChaCha8Rng::seed_from_u64(3));
    let scale = 0.21f32;
    folded
        .step_scaled(&grads(&va, &mut ra, 0), 1e-2, Some(scale))
        .expect("folded");
    let mut g = grads(&vb, &mut rb, 0);
    let plain: Vec<Var> = vb.iter().map(|(_, v)| v.clone()).collect();
    r3_train::scale_grads(plain.iter(), &mut g, scale).expect("scale");
    scaled_first.step(&g, 1e-2).expect("step");
    assert_same_state(&folded, &scaled_first, "folded clip");
}

#[test]
fn fused_results_do_not_depend_on_the_thread_count() {
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool");
        pool.install(|| {
            let v = vars(4);
            let mut opt = optimiser(&v, 0.1, AdamWKernel::Fused);
            let mut rng = ChaCha8Rng::seed_from_u64(5);
            let mut norms = Vec::new();
            for step in 0..3 {
                let g = grads(&v, &mut rng, step);
                let plain: Vec<Var> = v.iter().map(|(_, v)| v.clone()).collect();
                norms.push(global_grad_norm(plain.iter(), &g).expect("norm").to_bits());
                opt.step(&g, 1e-2).expect("step");
            }
            let weights: Vec<Vec<u32>> = v.iter().map(|(_, v)| bits(v.as_tensor())).collect();
            (weights, norms)
        })
    };
    assert_eq!(run(1), run(4));
}

/// An infinite gradient in w2 (after w0 and w1, whose updates pass their checks): its new θ
/// (inf / inf), first and second moments go non-finite, the parameter is reported first, and
/// nothing is committed, w0 and w1 included.
fn assert_an_infinite_gradient_is_refused(kernel: AdamWKernel, staging: r3_train::UpdateStaging) {
    let v = vars(6);
    let before: Vec<Vec<u32>> = v.iter().map(|(_, v)| bits(v.as_tensor())).collect();
    let mut opt = optimiser(&v, 0.0, kernel);
    opt.set_staging(staging);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut g = grads(&v, &mut rng, 0);
    let w2 = v[2].1.as_tensor();
    let inf = w2.ones_like().expect("ones").affine(f64::INFINITY, 0.0);
    g.insert(w2, inf.expect("inf"));
    let out = opt.step(&g, 1e-2).expect("step");
    assert_eq!(
        out,
        AdamWStep::NonFinite {
            variable: "w2".into(),
            what: "parameter"
        },
        "{kernel:?} {staging:?}"
    );
    let after: Vec<Vec<u32>> = v.iter().map(|(_, v)| bits(v.as_tensor())).collect();
    assert!(before == after, "{kernel:?} {staging:?}: nothing committed");
    assert_eq!(opt.step_count(), 0);
}

#[test]
fn guard_verdicts_match_the_composed_path() {
    let mut range_verdicts = Vec::new();
    for kernel in [AdamWKernel::Fused, AdamWKernel::Composed] {
        assert_an_infinite_gradient_is_refused(kernel, r3_train::UpdateStaging::WholeStep);

        // a weight pushed past f16's range by a large step: refused, with the same value
        let big = Var::new(&[60_000f32, 1.0], &Device::Cpu).expect("var");
        let mut opt = optimiser(&[("big".into(), big.clone())], 0.0, kernel);
        opt.set_weight_precision(WeightPrecision::F16);
        let mut g = GradStore::default();
        g.insert(
            big.as_tensor(),
            Tensor::new(&[-1f32, 1.0], &Device::Cpu).expect("g"),
        );
        let verdict = opt.step(&g, 10_000.0).expect("step");
        match &verdict {
            // the first Adam step moves by about lr: 60 000 + 10 000
            AdamWStep::OutOfRange {
                variable, value, ..
            } => assert!(
                variable == "big" && (value - 70_000.0).abs() < 1.0,
                "{value}"
            ),
            other => panic!("{kernel:?}: expected OutOfRange, got {other:?}"),
        }
        let untouched = Tensor::new(&[60_000f32, 1.0], &Device::Cpu).expect("t");
        assert_eq!(bits(big.as_tensor()), bits(&untouched));
        range_verdicts.push(verdict);
    }
    assert_eq!(
        range_verdicts[0], range_verdicts[1],
        "same variable, same value"
    );
}

#[test]
fn fused_grad_norm_is_candles_sum_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let sizes = [1usize, 31, 32, 33, 64, 1000, 75_301];
    let vars: Vec<Var> = sizes
        .iter()
        .map(|&n| Var::zeros(n, candle_core::DType::F32, &Device::Cpu).expect("var"))
        .collect();
    let mut store = GradStore::default();
    for v in &vars {
        store.insert(v.as_tensor(), random(&mut rng, v.dims(), 3.0));
    }
    // the composed reference: candle's per-tensor `sqr().sum_all()` added in order
    let reference = global_grad_norm_composed(vars.iter(), &store).expect("composed");
    let fused = global_grad_norm(vars.iter(), &store).expect("norm");
    assert_eq!(
        fused.to_bits(),
        reference.to_bits(),
        "{fused} vs {reference}"
    );
    // and a plain f64 sum agrees to f32 rounding: the order matters only in the last bits
    let exact: f64 = vars
        .iter()
        .flat_map(|v| {
            store
                .get(v.as_tensor())
                .expect("g")
                .to_vec1::<f32>()
                .expect("v")
        })
        .map(|x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    assert!(
        (f64::from(fused) - exact).abs() < 1e-5 * exact,
        "{fused} vs {exact}"
    );
    // bf16 and f16 gradients (as `train.narrow_gradients` keeps them), read as they are and
    // widened value by value: the composed path's norm of the widened gradients, bit for bit
    for narrow in [candle_core::DType::BF16, candle_core::DType::F16] {
        let mut narrowed = GradStore::default();
        for v in &vars {
            let g = store.get(v.as_tensor()).expect("g");
            narrowed.insert(v.as_tensor(), g.to_dtype(narrow).expect("narrow"));
        }
        let reference = global_grad_norm_composed(vars.iter(), &narrowed).expect("composed");
        let fused = global_grad_norm(vars.iter(), &narrowed).expect("norm");
        assert_eq!(
            fused.to_bits(),
            reference.to_bits(),
            "{narrow:?}: {fused} vs {reference}"
        );
    }
    // variables held in bf16 (`train.master_weights = "bf16"`): their gradients come in bf16
    // from one micro-batch and in f32 summed over several; both are read widened, the
    // composed path's norm bit for bit
    let held: Vec<Var> = sizes
        .iter()
        .map(|&n| Var::zeros(n, candle_core::DType::BF16, &Device::Cpu).expect("var"))
        .collect();
    for grad_dtype in [candle_core::DType::BF16, candle_core::DType::F32] {
        let mut held_grads = GradStore::default();
        for (v, w) in held.iter().zip(&vars) {
            let g = store.get(w.as_tensor()).expect("g");
            let g = g
                .to_dtype(candle_core::DType::BF16)
                .and_then(|g| g.to_dtype(grad_dtype))
                .expect("grad");
            held_grads.insert(v.as_tensor(), g);
        }
        let reference = global_grad_norm_composed(held.iter(), &held_grads).expect("composed");
        let fused = global_grad_norm(held.iter(), &held_grads).expect("norm");
        assert_eq!(
            fused.to_bits(),
            reference.to_bits(),
            "bf16 variables, {grad_dtype:?} gradients: {fused} vs {reference}"
        );
    }
}

#[test]
fn the_fused_check_is_per_element_where_the_composed_sum_overflows() {
    // Two finite weights whose sum overflows f32: the composed check (the sum is finite)
    // refuses the update, a false skip; the fused pass checks each element and applies it.
    let verdict = |kernel| {
        let w = Var::new(&[3e38f32, 3e38], &Device::Cpu).expect("var");
        let mut opt = optimiser(&[("w".into(), w.clone())], 0.0, kernel);
        let mut g = GradStore::default();
        g.insert(
            w.as_tensor(),
            Tensor::new(&[1f32, 1.0], &Device::Cpu).expect("g"),
        );
        opt.step(&g, 1e-3).expect("step")
    };
    assert_eq!(verdict(AdamWKernel::Fused), AdamWStep::Applied);
    assert_eq!(
        verdict(AdamWKernel::Composed),
        AdamWStep::NonFinite {
            variable: "w".into(),
            what: "parameter"
        }
    );
}

/// Staging tensor by tensor (every update checked and let go, then each computed again and
/// committed) gives the whole step's parameters and moments bit for bit, with either kernel,
/// and its guard commits nothing when a later tensor fails: the tensors checked before it
/// stay untouched. Gradients a backward kept in bf16 give the same step as those values in
/// f32.
#[test]
fn tensor_by_tensor_staging_equals_the_whole_step_and_guards_it() {
    use r3_train::UpdateStaging;
    let staged = |v: &[(String, Var)], kernel, staging| {
        let mut opt = optimiser(v, 0.1, kernel);
        opt.set_staging(staging);
        opt
    };
    for kernel in [AdamWKernel::Fused, AdamWKernel::Composed] {
        let (va, vb) = (vars(12), vars(12));
        let mut whole = staged(&va, kernel, UpdateStaging::WholeStep);
        let mut lean = staged(&vb, kernel, UpdateStaging::TensorByTensor);
        let (mut ra, mut rb) = (ChaCha8Rng::seed_from_u64(13), ChaCha8Rng::seed_from_u64(13));
        for step in 0..4 {
            let scale = (step % 2 == 0).then_some(0.5f32);
            let lr = 1e-2 * (step + 1) as f64;
            let a = whole.step_scaled(&grads(&va, &mut ra, step), lr, scale);
            let b = lean.step_scaled(&grads(&vb, &mut rb, step), lr, scale);
            assert_eq!(a.expect("whole"), AdamWStep::Applied);
            assert_eq!(b.expect("lean"), AdamWStep::Applied);
            assert_same_state(&whole, &lean, &format!("{kernel:?} step {step}"));
        }

        assert_an_infinite_gradient_is_refused(kernel, UpdateStaging::TensorByTensor);
    }

    // bf16 gradients (as `train.narrow_gradients` keeps them) against their values in f32.
    for staging in [UpdateStaging::WholeStep, UpdateStaging::TensorByTensor] {
        let (va, vb) = (vars(16), vars(16));
        let mut wide = staged(&va, AdamWKernel::Fused, staging);
        let mut narrow = staged(&vb, AdamWKernel::Fused, staging);
        let mut rng = ChaCha8Rng::seed_from_u64(17);
        let g = grads(&va, &mut rng, 0);
        let (mut g_wide, mut g_narrow) = (GradStore::default(), GradStore::default());
        for ((_, a), (_, b)) in va.iter().zip(&vb) {
            let n = g
                .get(a.as_tensor())
                .expect("g")
                .to_dtype(candle_core::DType::BF16)
                .expect("bf16");
            g_wide.insert(
                a.as_tensor(),
                n.to_dtype(candle_core::DType::F32).expect("f32"),
            );
            g_narrow.insert(b.as_tensor(), n);
        }
        assert_eq!(wide.step(&g_wide, 1e-2).expect("wide"), AdamWStep::Applied);
        assert_eq!(
            narrow.step(&g_narrow, 1e-2).expect("narrow"),
            AdamWStep::Applied
        );
        assert_same_state(&wide, &narrow, &format!("{staging:?}: bf16 gradients"));
    }
}
