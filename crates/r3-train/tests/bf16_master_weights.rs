//! Weight matrices held in bf16 without f32 master copies (`train.master_weights = "bf16"`).
//!
//! The update of a bf16 variable is the f32 rule's, rounded stochastically: every new weight
//! is one of the two bf16 values around the f32 master's new value, the moments are the f32
//! master's bit for bit, and over many weights the mean follows the f32 update even where
//! each step is far below half a bf16 step (where round-to-nearest would never move). The
//! fused pass equals the composed ops bit for bit, draws depend on the seed, and a run with
//! bf16 masters holds its matrices in bf16, checkpoints them so, and resumes to the same
//! metrics as the uninterrupted run.

mod common;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use common::{tiny_config, tiny_model, Scratch};
use half::bf16;
use r3_model::Precision;
use r3_train::config::RouterReplay;
use r3_train::policy::precision::{MasterWeights, TrainPrecisionConfig};
use r3_train::{
    AdamW, AdamWKernel, AdamWParams, AdamWStep, Quiet, Run, TrainConfig, TrainablePolicy,
};

/// Seeded values in [-scale, scale) of `shape`.
fn seeded(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let x = (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 7919)) % 10_007;
            scale * (x as f32 / 5_003.5 - 1.0)
        })
        .collect()
}

fn f32_values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("values")
}

/// One variable of `n` values in `dtype` (the seeded values rounded to bf16 first, so the
/// f32 and bf16 variables start equal).
fn var(n: usize, seed: u64, dtype: DType) -> Var {
    let t = Tensor::from_vec(seeded(n, seed, 1.0), n, &Device::Cpu)
        .and_then(|t| t.to_dtype(DType::BF16))
        .and_then(|t| t.to_dtype(dtype))
        .expect("tensor");
    Var::from_tensor(&t).expect("var")
}

/// The gradient store holding `g` (f32) for `v`.
fn grads_for(v: &Var, g: &[f32]) -> GradStore {
    let mut grads = GradStore::default();
    let t = Tensor::from_vec(g.to_vec(), g.len(), &Device::Cpu).expect("grad");
    grads.insert(v.as_tensor(), t);
    grads
}

fn optimiser(v: &Var, kernel: AdamWKernel, seed: u64) -> AdamW {
    let params = AdamWParams {
        weight_decay: 0.1,
        ..AdamWParams::default()
    };
    let mut opt = AdamW::new(vec![("w".into(), v.clone())], params, |_, _| true).expect("adamw");
    opt.set_kernel(kernel);
    opt.set_rounding_seed(seed);
    opt
}

/// Each of `got` (bf16 values, widened) is one of the two bf16 values around its f32 value
/// in `want` (the value itself where bf16 holds it), and both are taken, each for between a
/// tenth and nine tenths of the values.
fn assert_bf16_neighbours(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let mut ups = 0usize;
    for (i, (&b, &w)) in got.iter().zip(want).enumerate() {
        let lo = f32::from_bits(w.to_bits() & 0xffff_0000);
        let hi = f32::from_bits((w.to_bits() & 0xffff_0000).wrapping_add(0x1_0000));
        let exact = w.to_bits() & 0xffff == 0;
        assert!(
            b == lo || (!exact && b == hi),
            "{what}, value {i}: {b} is not a bf16 neighbour of the f32 value {w}"
        );
        ups += usize::from(!exact && b == hi);
    }
    let n = got.len();
    assert!(ups > n / 10 && ups < n * 9 / 10, "{what}: {ups} of {n} up");
}

/// Every step of a bf16 variable lands on one of the two bf16 values around the f32 master's
/// new value computed from the same (bf16) weights, its moments are the f32 master's bit for
/// bit, and the fused pass equals the composed ops bit for bit.
#[test]
fn a_bf16_update_is_the_f32_rule_rounded_to_a_neighbour() {
    let n = 70_001; // several parallel chunks and a tail
    for step in 1..=3u64 {
        let bf = var(n, 1, DType::BF16);
        let composed = var(n, 1, DType::BF16);
        let master = var(n, 1, DType::F32);
        let mut opts = [
            optimiser(&bf, AdamWKernel::Fused, 5),
            optimiser(&composed, AdamWKernel::Composed, 5),
            optimiser(&master, AdamWKernel::Fused, 5),
        ];
        // Earlier steps on all three from the same weights (the master re-rounded each time,
        // so that it starts every step from the bf16 variable's values).
        for earlier in 1..=step {
            let ge = seeded(n, 100 + earlier, 0.3);
            let before = f32_values(bf.as_tensor());
            master
                .set(&Tensor::from_vec(before, n, &Device::Cpu).expect("t"))
                .expect("set");
            for (opt, v) in opts.iter_mut().zip([&bf, &composed, &master]) {
                let outcome = opt.step_scaled(&grads_for(v, &ge), 1e-2, Some(0.5));
                assert_eq!(outcome.expect("step"), AdamWStep::Applied);
            }
        }
        let (got, want) = (f32_values(bf.as_tensor()), f32_values(master.as_tensor()));
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            f32_values(composed.as_tensor())
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>(),
            "step {step}: fused and composed bf16 updates differ"
        );
        assert_bf16_neighbours(&got, &want, &format!("step {step} weights"));
        let (mb, mm) = (opts[0].state_tensors(), opts[2].state_tensors());
        for key in ["adamw.m.w", "adamw.v.w"] {
            assert_eq!(mb[key].dtype(), DType::F32, "{key} is f32");
            assert_eq!(
                f32_values(&mb[key]),
                f32_values(&mm[key]),
                "step {step}: {key} equals the f32 master's"
            );
        }
    }
}

/// Updates far below half a bf16 step move bf16 weights in expectation: after 20 steps the
/// mean change over 100,000 weights equals the f32 master's within a few standard errors,
/// where a nearest rounding of each step would not have moved a single weight.
#[test]
fn small_updates_move_bf16_weights_in_expectation() {
    let n = 100_000;
    let ones = Tensor::ones(n, DType::F32, &Device::Cpu).expect("ones");
    let bf = Var::from_tensor(&ones.to_dtype(DType::BF16).expect("bf16")).expect("var");
    let master = Var::from_tensor(&ones).expect("var");
    let params = AdamWParams::default();
    let mut ob = AdamW::new(vec![("w".into(), bf.clone())], params, |_, _| false).expect("adamw");
    let mut om = AdamW::new(vec![("w".into(), master.clone())], params, |_, _| false).expect("a");
    ob.set_rounding_seed(11);
    let g = vec![1.0f32; n];
    let lr = 2e-4; // AdamW moves each weight by ≈ lr a step; half a bf16 step at 1 is 2⁻⁸
    assert!(lr < 2f64.powi(-8) / 10.0);
    for _ in 0..20 {
        ob.step(&grads_for(&bf, &g), lr).expect("bf16 step");
        om.step(&grads_for(&master, &g), lr).expect("f32 step");
    }
    let moved_f32 = 1.0 - f64::from(f32_values(master.as_tensor())[0]);
    let values = f32_values(bf.as_tensor());
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
    let moved = 1.0 - mean;
    // Each weight sits on one of two bf16 values around its f32 path (below 1 the step is
    // 2⁻⁸); the spread of the mean is at most half a step over √n.
    let se = 2f64.powi(-8) * 0.5 / (n as f64).sqrt();
    assert!(
        (moved - moved_f32).abs() < 5.0 * se,
        "bf16 weights moved {moved} on average, the f32 master {moved_f32} (se {se})"
    );
    assert!(moved_f32 > 15.0 * lr, "the f32 master moved {moved_f32}");
    // A nearest rounding of one step's result (1 − ≈lr) gives 1 back: it would never move.
    assert_eq!(bf16::from_f32(1.0 - lr as f32), bf16::ONE);
    // The seed is the draws': another seed gives other weights, the same seed the same.
    let rerun = |seed: u64| {
        let v = Var::from_tensor(&ones.to_dtype(DType::BF16).expect("bf16")).expect("var");
        let mut o = AdamW::new(vec![("w".into(), v.clone())], params, |_, _| false).expect("o");
        o.set_rounding_seed(seed);
        for _ in 0..3 {
            o.step(&grads_for(&v, &g), lr).expect("step");
        }
        f32_values(v.as_tensor())
    };
    assert_eq!(rerun(11), rerun(11));
    assert_ne!(rerun(11), rerun(12));
}

/// An f16 variable is refused by name (only f32 and bf16 weights are updated).
#[test]
fn an_f16_variable_is_refused() {
    let v = var(4, 1, DType::F16);
    let err = AdamW::new(vec![("w.f16".into(), v)], AdamWParams::default(), |_, _| {
        true
    })
    .expect_err("f16 variable");
    assert!(err.to_string().contains("w.f16"), "{err}");
}

/// The setting is checked: `bf16` needs a bf16 forward, unknown values are refused, and
/// held 16-bit copies cannot be asked beside matrices that are bf16 already.
#[test]
fn the_setting_is_checked_naming_the_field() {
    let with = |dtype: &str, masters: &str, copies: &str| TrainPrecisionConfig {
        dtype: dtype.into(),
        master_weights: masters.into(),
        narrow_weight_copies: copies.into(),
        ..TrainPrecisionConfig::default()
    };
    assert_eq!(
        with("bf16", "bf16", "auto").master_weights().ok(),
        Some(MasterWeights::Bf16)
    );
    assert_eq!(
        with("f32", "f32", "auto").master_weights().ok(),
        Some(MasterWeights::F32)
    );
    for (dtype, masters) in [("f32", "bf16"), ("f16", "bf16"), ("bf16", "fp8")] {
        let err = with(dtype, masters, "auto")
            .master_weights()
            .expect_err("refused");
        assert!(err.to_string().contains("train.master_weights"), "{err}");
    }
    let err = with("bf16", "bf16", "on")
        .holds_narrow_copies(&Device::Cpu)
        .expect_err("copies of bf16 matrices");
    assert!(
        err.to_string().contains("train.narrow_weight_copies"),
        "{err}"
    );
    assert_eq!(
        with("bf16", "bf16", "auto")
            .holds_narrow_copies(&Device::Cpu)
            .ok(),
        Some(false)
    );
    let mut cfg = TrainConfig::default();
    cfg.train.master_weights = "bf16".into();
    let err = cfg
        .validate()
        .expect_err("bf16 masters with an f32 forward");
    assert!(err.to_string().contains("train.master_weights"), "{err}");
}

/// The policy holds the embedding and the matrices the bf16 forward rounds in bf16 (the
/// router too unless it runs in f32), norm scales and biases in f32; its logits are the
/// f32-master policy's bit for bit where that policy holds the same (bf16) values.
#[test]
fn the_policy_holds_its_matrices_in_bf16() {
    let dir = Scratch::new("bf16-masters-policy");
    let model = dir.path().join("model");
    tiny_model(&model, 71);
    for router_f32 in [false, true] {
        let precision = Precision::Bf16 { router_f32 };
        let policy = TrainablePolicy::load_for_training(
            &model,
            &Device::Cpu,
            precision,
            MasterWeights::Bf16,
        )
        .expect("policy");
        let mut matrices = 0;
        for (name, v) in policy.vars() {
            let want = if name.contains("norm") || name.ends_with("bias") {
                DType::F32
            } else if name.ends_with("mlp.gate.weight") {
                if router_f32 {
                    DType::F32
                } else {
                    DType::BF16
                }
            } else {
                DType::BF16
            };
            assert_eq!(v.dtype(), want, "{name} (router f32: {router_f32})");
            matrices += usize::from(want == DType::BF16);
        }
        assert!(matrices > 0);
        // The f32 policy at the same values: its matrices rounded to bf16 and widened.
        let mut wide = TrainablePolicy::load(&model).expect("f32 policy");
        for ((name, w), (_, b)) in wide.vars().iter().zip(policy.vars()) {
            let values = b.as_tensor().to_dtype(DType::F32).expect("widen");
            w.set(&values).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        wide.set_precision(precision);
        let batch =
            r3_model::Batch::new(&[vec![1, 5, 9, 4, 7, 3]], 0, &Device::Cpu).expect("batch");
        let logits = |p: &TrainablePolicy| {
            f32_values(
                &p.model()
                    .expect("model")
                    .forward(&batch, r3_model::Routing::Native)
                    .expect("forward")
                    .logits,
            )
        };
        assert_eq!(logits(&policy), logits(&wide), "router f32: {router_f32}");
    }
    let err = TrainablePolicy::load_for_training(
        &model,
        &Device::Cpu,
        Precision::F16 { router_f32: true },
        MasterWeights::Bf16,
    )
    .expect_err("bf16 masters under an f16 forward");
    assert!(err.to_string().contains("train.master_weights"), "{err}");
}

/// A bf16-master run (moments in bf16 too) writes its matrices into checkpoints in bf16
/// (half the bytes of the f32 run's), applies its updates, and a run resumed from step 1's
/// checkpoint continues exactly as the uninterrupted run (weights, moments and the
/// rounding's draws restored).
#[test]
fn a_bf16_master_run_checkpoints_in_bf16_and_resumes_exactly() {
    let dir = Scratch::new("bf16-masters-run");
    let model = dir.path().join("model");
    tiny_model(&model, 72);
    let run = |masters: &str| {
        let run_dir = dir.path().join(masters);
        let mut cfg = tiny_config(&model, &run_dir, RouterReplay::R3, 2);
        cfg.steps = 3;
        cfg.train.dtype = "bf16".into();
        cfg.train.master_weights = masters.into();
        // The bf16-master run keeps its moments in bf16 too (checkpointed so).
        if masters == "bf16" {
            cfg.optim.moments_dtype = "bf16".into();
        }
        Run::fresh(cfg)
            .expect("run")
            .execute(&mut Quiet)
            .expect("execute");
        run_dir
    };
    let (wide, narrow) = (run("f32"), run("bf16"));
    let weights = |run_dir: &std::path::Path| run_dir.join("checkpoints/step_3/model.safetensors");
    let (wide_bytes, narrow_bytes) = (
        std::fs::metadata(weights(&wide))
            .expect("f32 checkpoint")
            .len(),
        std::fs::metadata(weights(&narrow))
            .expect("bf16 checkpoint")
            .len(),
    );
    assert!(
        narrow_bytes * 10 < wide_bytes * 7,
        "bf16 checkpoint {narrow_bytes} bytes, f32 {wide_bytes}"
    );
    let held = candle_core::safetensors::load(weights(&narrow), &Device::Cpu).expect("load");
    let bf16_tensors = held.values().filter(|t| t.dtype() == DType::BF16).count();
    assert!(bf16_tensors > 0, "no bf16 tensor in the checkpoint");
    let metrics = |run_dir: &std::path::Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(run_dir.join("metrics.jsonl"))
            .expect("metrics")
            .lines()
            .map(|l| {
                let mut v: serde_json::Value = serde_json::from_str(l).expect("json");
                if let Some(o) = v.as_object_mut() {
                    o.retain(|k, _| !r3_train::rl::metrics_log::is_measurement(k));
                }
                v
            })
            .collect()
    };
    let full = metrics(&narrow);
    assert_eq!(full.len(), 3);
    assert!(
        full.iter()
            .any(|m| m.get("update.skipped").and_then(|v| v.as_u64()) == Some(0)),
        "some update was applied: {full:?}"
    );
    for step in [2, 3] {
        std::fs::remove_dir_all(narrow.join(format!("checkpoints/step_{step}"))).expect("rm");
    }
    let mut resumed = Run::resume(&narrow).expect("resume");
    assert_eq!(resumed.trainer.step, 1);
    resumed.execute(&mut Quiet).expect("resumed run");
    assert_eq!(metrics(&narrow), full, "steps 2 and 3 after resume");
}

/// The memory options run beside bf16 masters (activation checkpointing, 16-bit gradients,
/// the head scored in chunks, the update staged tensor by tensor, two mini-batches): every
/// step applies its update with replay verified, as the run without them does.
#[test]
fn the_memory_options_run_with_bf16_masters() {
    let dir = Scratch::new("bf16-masters-options");
    let model = dir.path().join("model");
    tiny_model(&model, 73);
    let run_dir = dir.path().join("run");
    let mut cfg = tiny_config(&model, &run_dir, RouterReplay::R3, 2);
    cfg.train.dtype = "bf16".into();
    cfg.train.master_weights = "bf16".into();
    cfg.train.narrow_gradients = true;
    cfg.algo.gradient_checkpointing = true;
    cfg.algo.head_chunk_tokens = 3;
    cfg.optim.update_staging = r3_train::UpdateStaging::TensorByTensor;
    cfg.optim.moments_dtype = "bf16".into();
    Run::fresh(cfg)
        .expect("run")
        .execute(&mut Quiet)
        .expect("execute");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    assert_eq!(lines.len(), 2);
    for m in &lines {
        assert_eq!(m["update.skipped"].as_u64(), Some(0), "{m}");
        assert_eq!(m["replay.verified_frac"].as_f64(), Some(1.0), "{m}");
    }
}

/// Moments kept in bf16 (`optim.moments_dtype = "bf16"`): from the same state, each new m and
/// v is one of the two bf16 values around the f32 moments' new value, θ' is the f32 rule's
/// from those rounded moments (the same bits for an f32 variable as an optimiser whose f32
/// moments hold the rounded values), and the fused pass equals the composed ops bit for bit,
/// for f32 and bf16 variables.
#[test]
fn bf16_moments_are_the_f32_moments_rounded_to_a_neighbour() {
    let n = 40_001;
    for param in [DType::F32, DType::BF16] {
        let (fused, composed) = (var(n, 2, param), var(n, 2, param));
        let mut opts = [
            optimiser(&fused, AdamWKernel::Fused, 9),
            optimiser(&composed, AdamWKernel::Composed, 9),
        ];
        for o in &mut opts {
            o.set_moment_dtype(DType::BF16).expect("bf16 moments");
        }
        for step in 1..=3u64 {
            let g = seeded(n, 200 + step, 0.3);
            let before = opts[0].state_tensors();
            // The f32-moment reference from the same state: the same weights, its moments the
            // bf16 ones widened (exact), at the same step.
            let reference = var(n, 2, param);
            reference
                .set(&fused.as_tensor().copy().expect("copy"))
                .expect("same weights");
            let mut f32_opt = optimiser(&reference, AdamWKernel::Fused, 9);
            let wide: std::collections::HashMap<String, Tensor> = before
                .iter()
                .map(|(k, t)| (k.clone(), t.to_dtype(DType::F32).expect("widen")))
                .collect();
            f32_opt.load_state(&wide, step - 1).expect("state");
            for (o, v) in opts.iter_mut().zip([&fused, &composed]) {
                let outcome = o.step_scaled(&grads_for(v, &g), 1e-2, Some(0.5));
                assert_eq!(outcome.expect("step"), AdamWStep::Applied);
            }
            f32_opt
                .step_scaled(&grads_for(&reference, &g), 1e-2, Some(0.5))
                .expect("f32 step");
            let (sf, sc, sr) = (
                opts[0].state_tensors(),
                opts[1].state_tensors(),
                f32_opt.state_tensors(),
            );
            for key in ["adamw.m.w", "adamw.v.w"] {
                assert_eq!(sf[key].dtype(), DType::BF16, "{key}");
                let (got, other) = (f32_values(&sf[key]), f32_values(&sc[key]));
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    other.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{param:?} step {step} {key}: fused and composed differ"
                );
                let want = f32_values(&sr[key]);
                assert_bf16_neighbours(&got, &want, &format!("{param:?} step {step} {key}"));
            }
            assert_eq!(
                f32_values(fused.as_tensor())
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                f32_values(composed.as_tensor())
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                "{param:?} step {step}: weights"
            );
        }
    }
    // Another dtype is refused, naming the setting.
    let v = var(4, 1, DType::F32);
    let err = optimiser(&v, AdamWKernel::Fused, 1)
        .set_moment_dtype(DType::F16)
        .expect_err("f16 moments");
    assert!(err.to_string().contains("optim.moments_dtype"), "{err}");
}

/// The second moment's steps far below half a bf16 step survive in expectation: v at 1.0 and
/// g² = 1.0201 move v by 2e-5 a step (β2 = 0.999), 1/200 of half a bf16 step, which rounding
/// to nearest would drop every time; over 100,000 values and 20 steps the bf16 mean follows
/// the f32 moments within a few standard errors.
#[test]
fn the_second_moment_keeps_its_small_steps_in_expectation() {
    let n = 100_000;
    let run = |moments: DType| {
        let v = var(n, 3, DType::F32);
        let mut o = AdamW::new(
            vec![("w".into(), v.clone())],
            AdamWParams::default(),
            |_, _| false,
        )
        .expect("adamw");
        o.set_moment_dtype(moments).expect("moments");
        o.set_rounding_seed(5);
        let ones = Tensor::ones(n, DType::F32, &Device::Cpu).expect("ones");
        let state: std::collections::HashMap<String, Tensor> = [
            ("adamw.m.w".to_string(), ones.zeros_like().expect("zeros")),
            ("adamw.v.w".to_string(), ones.clone()),
        ]
        .into_iter()
        .collect();
        o.load_state(&state, 10_000).expect("state");
        let g = vec![1.01f32; n];
        for _ in 0..20 {
            o.step(&grads_for(&v, &g), 1e-6).expect("step");
        }
        let values = f32_values(&o.state_tensors()["adamw.v.w"]);
        values.iter().map(|&x| f64::from(x)).sum::<f64>() / n as f64
    };
    let (wide, narrow) = (run(DType::F32), run(DType::BF16));
    assert!(
        wide - 1.0 > 3e-4,
        "the f32 second moment moved {}",
        wide - 1.0
    );
    // One bf16 step above 1 is 2⁻⁷; each value sits on one of two around its path.
    let se = 2f64.powi(-7) * 0.5 / (n as f64).sqrt();
    assert!(
        (narrow - wide).abs() < 5.0 * se,
        "bf16 second moment mean {narrow}, f32 {wide} (se {se})"
    );
}
