//! The training engine's state on another device: the policy loaded there (variables,
//! gradients, AdamW moments all on it), weights crossing to the CPU rollout engine, and the
//! guarded AdamW update equal to the CPU's.
//!
//! With `--features cuda` (`scripts/cuda/check.sh` on the GPU machine) the comparisons run
//! CUDA against the CPU; without it (CI) the same comparisons run against a second CPU copy
//! and must give the same bits. Paths are relative to the working directory (the crate
//! folder, under `cargo test` and under check.sh).

use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use r3_model::{Batch, Routing};
use r3_train::{
    backward_and_step, token_log_probs, AdamW, AdamWParams, TrainablePolicy, UpdateOutcome,
};

/// The shipped base model (repository root `models/arith-moe`).
fn base_model() -> &'static Path {
    Path::new("../../models/arith-moe")
}

/// Seeded values in [-1, 1) of `shape`, on the CPU.
fn seeded(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n as u64)
        .map(|i| {
            let x = (i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % 10007;
            x as f32 / 5003.5 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).expect("seeded")
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("values")
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Three guarded AdamW updates (weight decay, clipping) of two variables on `device` with
/// gradients given exactly (the loss `Σ θ ⊙ C_t`, so `∇ = C_t` on every device), then one
/// update whose `C` holds an infinity, so its loss is not finite (skipped: nothing may
/// change). Returns the variables' final values.
fn adamw_run(device: &Device) -> Vec<Vec<f32>> {
    let shapes: [&[usize]; 2] = [&[8, 16], &[16]];
    let vars: Vec<(String, Var)> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let t = seeded(s, i as u64).to_device(device).expect("to device");
            (format!("w{i}"), Var::from_tensor(&t).expect("var"))
        })
        .collect();
    let params = AdamWParams {
        weight_decay: 0.1,
        ..AdamWParams::default()
    };
    let mut opt = AdamW::new(vars.clone(), params, |name, _| name == "w0").expect("adamw");
    let loss_with = |step: u64, poison: bool| -> Tensor {
        let mut loss = Tensor::zeros((), DType::F32, device).expect("zero");
        for (i, (_, v)) in vars.iter().enumerate() {
            let mut c = seeded(v.dims(), 10 + step * 7 + i as u64);
            if poison && i == 1 {
                let mut raw = values(&c);
                raw[3] = f32::INFINITY;
                c = Tensor::from_vec(raw, v.dims(), &Device::Cpu).expect("poisoned");
            }
            let c = c.to_device(device).expect("to device");
            let term = (v.as_tensor() * c).and_then(|t| t.sum_all()).expect("term");
            loss = (loss + term).expect("sum");
        }
        loss
    };
    for step in 0..3 {
        // Clip at 5: the gradients' global norm is ≈ 7, so clipping is exercised.
        let outcome =
            backward_and_step(&mut opt, &loss_with(step, false), 1e-2, 5.0).expect("step");
        assert!(
            matches!(outcome, UpdateOutcome::Applied { .. }),
            "{outcome:?}"
        );
        for (name, v) in &vars {
            assert!(v.device().same_device(device), "{name} left {device:?}");
        }
    }
    let before: Vec<Vec<f32>> = vars.iter().map(|(_, v)| values(v.as_tensor())).collect();
    let outcome = backward_and_step(&mut opt, &loss_with(3, true), 1e-2, 5.0).expect("step");
    assert!(
        matches!(outcome, UpdateOutcome::Skipped { .. }),
        "a non-finite gradient must skip the update on {device:?}: {outcome:?}"
    );
    let after: Vec<Vec<f32>> = vars.iter().map(|(_, v)| values(v.as_tensor())).collect();
    assert_eq!(before, after, "a skipped update changed a variable");
    assert_eq!(opt.step_count(), 3);
    after
}

/// The optimiser alone on `device`: three AdamW steps of three variables (one large enough
/// for many blocks of a GPU kernel; weight decay on two; a fixed gradient-clip factor on the
/// last step) on gradients that are exact on every device (`∇ Σ θ ⊙ C = C`), no global norm
/// (whose sum order differs by device); with `narrow` each gradient handed to the optimiser
/// in that 16-bit float, as a backward keeping them narrow does (`train.narrow_gradients`).
/// The variables are held in `param` (f32, or bf16 as `train.master_weights = "bf16"` holds
/// them: updates rounded stochastically, seeded), the moments in `moments` (f32 or bf16,
/// `optim.moments_dtype`). Returns every variable and moment (widened) after the steps.
fn adamw_alone(
    device: &Device,
    narrow: Option<DType>,
    param: DType,
    moments: DType,
) -> Vec<Vec<f32>> {
    let shapes: [&[usize]; 3] = [&[300, 701], &[16], &[33, 5]];
    let vars: Vec<(String, Var)> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let t = seeded(s, 40 + i as u64)
                .to_dtype(param)
                .and_then(|t| t.to_device(device))
                .expect("to device");
            (format!("w{i}"), Var::from_tensor(&t).expect("var"))
        })
        .collect();
    let params = AdamWParams {
        weight_decay: 0.05,
        ..AdamWParams::default()
    };
    let mut opt = AdamW::new(vars.clone(), params, |name, _| name != "w1").expect("adamw");
    opt.set_rounding_seed(7);
    opt.set_moment_dtype(moments).expect("moments");
    for step in 0..3u64 {
        let mut loss = Tensor::zeros((), DType::F32, device).expect("zero");
        for (i, (_, v)) in vars.iter().enumerate() {
            let c = seeded(v.dims(), 50 + step * 5 + i as u64)
                .to_dtype(param)
                .and_then(|t| t.to_device(device))
                .expect("to device");
            let term = (v.as_tensor() * c)
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.sum_all())
                .expect("term");
            loss = (loss + term).expect("sum");
        }
        let mut grads = loss.backward().expect("backward");
        // In `narrow`, or f32 (a bf16 variable's gradient comes out in bf16; summed over
        // micro-batches it is f32).
        for (_, v) in &vars {
            let g = grads.remove(v.as_tensor()).expect("gradient");
            let dtype = narrow.unwrap_or(DType::F32);
            grads.insert(v.as_tensor(), g.to_dtype(dtype).expect("gradient dtype"));
        }
        let scale = (step == 2).then_some(0.37f32);
        let outcome = opt.step_scaled(&grads, 3e-2, scale).expect("step");
        assert_eq!(outcome, r3_train::AdamWStep::Applied, "step {step}");
    }
    let mut state: Vec<(String, Tensor)> = opt.state_tensors().into_iter().collect();
    state.sort_by(|a, b| a.0.cmp(&b.0));
    vars.iter()
        .map(|(_, v)| values(v.as_tensor()))
        .chain(state.iter().map(|(_, t)| values(t)))
        .collect()
}

/// The optimiser's cases: (gradients kept in, variables in, moments in) — every kernel the
/// GPU has (`ADAMW_KERNEL` in kernels.cu).
const ADAMW_CASES: [(Option<DType>, DType, DType); 10] = [
    (None, DType::F32, DType::F32),
    (Some(DType::BF16), DType::F32, DType::F32),
    (Some(DType::F16), DType::F32, DType::F32),
    (None, DType::BF16, DType::F32),
    (Some(DType::BF16), DType::BF16, DType::F32),
    (None, DType::F32, DType::BF16),
    (Some(DType::BF16), DType::F32, DType::BF16),
    (Some(DType::F16), DType::F32, DType::BF16),
    (None, DType::BF16, DType::BF16),
    (Some(DType::BF16), DType::BF16, DType::BF16),
];

#[test]
fn the_optimiser_alone_gives_the_same_bits_on_a_second_cpu_copy() {
    for (narrow, param, moments) in ADAMW_CASES {
        assert_eq!(
            adamw_alone(&Device::Cpu, narrow, param, moments),
            adamw_alone(&Device::Cpu, narrow, param, moments)
        );
    }
    // 16-bit gradients are other values than the f32 ones: the narrow run is not the wide one.
    assert_ne!(
        adamw_alone(&Device::Cpu, None, DType::F32, DType::F32),
        adamw_alone(&Device::Cpu, Some(DType::BF16), DType::F32, DType::F32)
    );
}

/// The policy loaded on `device` stays there; the rollout engine's copy is on the CPU and
/// equals the loaded weights; a forward + backward + update runs there. Returns the update's
/// new values of every variable and the loss.
/// The mean next-token negative log-likelihood of `batch` under `model`.
fn mean_nll(model: &r3_model::Model, batch: &Batch, routing: Routing<'_>) -> Tensor {
    let out = model.forward(batch, routing).expect("forward");
    let t = batch.seq_len();
    let logp = token_log_probs(
        &out.logits.narrow(1, 0, t - 1).expect("logits"),
        &batch.input_ids().narrow(1, 1, t - 1).expect("targets"),
    )
    .expect("log-probs");
    logp.mean_all().and_then(|l| l.neg()).expect("loss")
}

fn policy_update(device: &Device) -> (f32, Vec<(String, Vec<f32>)>) {
    let policy = TrainablePolicy::load_on(base_model(), device).expect("policy");
    assert!(policy.device().same_device(device));
    let on_cpu = TrainablePolicy::load(base_model()).expect("cpu policy");
    for (name, t) in policy.tensor_map().expect("tensor map") {
        assert!(
            t.device().is_cpu(),
            "{name}: the rollout engine's copy is on the CPU"
        );
        let want = on_cpu.tensor_map().expect("cpu map")[&name].clone();
        assert_eq!(
            values(&t.to_dtype(DType::F32).expect("f32")),
            values(&want.to_dtype(DType::F32).expect("f32")),
            "{name}"
        );
    }
    let model = policy.model().expect("model");
    assert!(model.device().same_device(device));
    let seqs: Vec<Vec<u32>> = (0..3u32)
        .map(|b| (0..12u32).map(|i| 3 + (i * 5 + b * 7) % 20).collect())
        .collect();
    let batch = Batch::new(&seqs, 0, device).expect("batch");
    let loss = mean_nll(&model, &batch, Routing::Record);
    let loss_value = loss.to_scalar::<f32>().expect("loss value");
    let mut opt =
        AdamW::new(policy.vars().to_vec(), AdamWParams::default(), |_, _| true).expect("adamw");
    let outcome = backward_and_step(&mut opt, &loss, 1e-3, 1.0).expect("update");
    assert!(
        matches!(outcome, UpdateOutcome::Applied { .. }),
        "{outcome:?}"
    );
    let vars = policy
        .vars()
        .iter()
        .map(|(n, v)| (n.clone(), values(v.as_tensor())))
        .collect();
    (loss_value, vars)
}

/// Compares `device`'s results with the CPU's: AdamW to `adam_tol` absolute (values near 1),
/// the policy update's loss to `loss_tol` relative and every updated weight to `lr`-sized
/// steps (one AdamW step moves a weight by at most ≈ lr, so a sign flip of a gradient that
/// is zero to rounding moves it by at most 2·lr).
fn compare(device: &Device, adam_tol: f32, loss_tol: f32, weight_tol: f32) {
    for (a, b) in adamw_run(&Device::Cpu).iter().zip(adamw_run(device).iter()) {
        let d = max_diff(a, b);
        assert!(d <= adam_tol, "AdamW values differ by {d}");
    }
    let (cpu_loss, cpu_vars) = policy_update(&Device::Cpu);
    let (loss, vars) = policy_update(device);
    assert!(
        (cpu_loss - loss).abs() <= loss_tol * cpu_loss.abs(),
        "loss {loss} vs CPU {cpu_loss}"
    );
    for ((name, a), (_, b)) in cpu_vars.iter().zip(&vars) {
        let d = max_diff(a, b);
        assert!(d <= weight_tol, "{name}: updated weights differ by {d}");
    }
}

/// Two guarded bf16 updates on `device` by a policy holding bf16 copies of its weights and by
/// one that casts them per use: after each, every copy holds its variable cast to bf16 (the
/// optimiser's in-place rewrite: on a GPU r3's cast kernel writing into the copy), and the
/// two policies' weights and frozen-model logits are the same bits.
fn held_copies_follow_the_updates(device: &Device) {
    use r3_model::cast16::cast16;
    use r3_model::Precision;
    let bits = |t: &Tensor| -> Vec<u32> {
        values(&t.to_dtype(DType::F32).expect("f32"))
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    let load = || {
        let mut p = TrainablePolicy::load_on(base_model(), device).expect("policy");
        p.set_precision(Precision::Bf16 { router_f32: false });
        p
    };
    let optimiser =
        |p: &TrainablePolicy| AdamW::new(p.vars().to_vec(), AdamWParams::default(), |_, _| true);
    let plain = load();
    let mut held = load();
    let mut plain_opt = optimiser(&plain).expect("adamw");
    let mut held_opt = optimiser(&held).expect("adamw");
    held_opt
        .hold_narrow_copies(held.hold_narrow_copies().expect("copies"))
        .expect("held");
    let seqs: Vec<Vec<u32>> = (0..3u32)
        .map(|b| (0..12u32).map(|i| 3 + (i * 5 + b * 7) % 20).collect())
        .collect();
    let batch = Batch::new(&seqs, 0, device).expect("batch");
    let logits = |p: &TrainablePolicy| {
        let out = p
            .frozen_model()
            .expect("model")
            .forward(&batch, Routing::Native);
        bits(&out.expect("forward").logits)
    };
    for step in 1..=2 {
        for (policy, opt) in [(&plain, &mut plain_opt), (&held, &mut held_opt)] {
            let loss = mean_nll(&policy.model().expect("model"), &batch, Routing::Native);
            let outcome = backward_and_step(opt, &loss, 1e-3, 1.0).expect("update");
            assert!(
                matches!(outcome, UpdateOutcome::Applied { .. }),
                "{outcome:?}"
            );
        }
        let weights = held.detached();
        let copies = weights.narrow_copies();
        assert!(!copies.is_empty());
        for (name, copy) in copies {
            let master = weights.get(name).expect("master");
            let want = cast16(master, DType::BF16).expect("cast");
            assert!(bits(copy) == bits(&want), "step {step}: the copy of {name}");
        }
        for ((name, a), (_, b)) in plain.vars().iter().zip(held.vars()) {
            assert!(
                bits(a.as_tensor()) == bits(b.as_tensor()),
                "step {step}: {name}"
            );
        }
        assert!(logits(&plain) == logits(&held), "step {step}: logits");
    }
}

#[test]
fn held_weight_copies_follow_the_updates_on_the_cpu() {
    held_copies_follow_the_updates(&Device::Cpu);
}

#[cfg(feature = "cuda")]
#[test]
fn held_weight_copies_follow_the_updates_on_cuda() {
    let gpu = r3_model::DeviceSpec::Cuda { ordinal: 0 }
        .open()
        .expect("a CUDA GPU (this test runs on the GPU machine)");
    held_copies_follow_the_updates(&gpu);
}

#[test]
fn a_second_cpu_copy_trains_to_the_same_bits() {
    compare(&Device::Cpu, 0.0, 0.0, 0.0);
}

/// The GPU's fused AdamW pass (`r3_adamw_f32`) is the CPU pass's arithmetic operation for
/// operation: the same variables and moments, bit for bit; so are its twins reading bf16 and
/// f16 gradients as they are (the CPU widens them first), those updating bf16 variables
/// (`r3_adamw_bf16*`: the stochastic rounding's draws are the CPU's) and those keeping the
/// moments in bf16 (`*_mbf16`).
#[cfg(feature = "cuda")]
#[test]
fn cuda_adamw_pass_equals_the_cpu_bit_for_bit() {
    let gpu = r3_model::DeviceSpec::Cuda { ordinal: 0 }
        .open()
        .expect("a CUDA GPU (this test runs on the GPU machine)");
    for (narrow, param, moments) in ADAMW_CASES {
        let (cpu, on_gpu) = (
            adamw_alone(&Device::Cpu, narrow, param, moments),
            adamw_alone(&gpu, narrow, param, moments),
        );
        assert_same_bits(&cpu, &on_gpu, narrow);
    }
}

/// Every value of every tensor equal bit for bit.
#[cfg(feature = "cuda")]
fn assert_same_bits(cpu: &[Vec<f32>], on_gpu: &[Vec<f32>], narrow: Option<DType>) {
    for (i, (a, b)) in cpu.iter().zip(on_gpu).enumerate() {
        let differ = a
            .iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{narrow:?} gradients, tensor {i}: {differ} of {} values differ (largest by {})",
            a.len(),
            max_diff(a, b)
        );
    }
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_training_state_matches_the_cpu() {
    let gpu = r3_model::DeviceSpec::Cuda { ordinal: 0 }
        .open()
        .expect("a CUDA GPU (this test runs on the GPU machine)");
    compare(&gpu, 1e-5, 1e-5, 2e-3 + 1e-5);
}

/// The policy's scoring on `device` (the head over the response predictions only; sharing
/// the prompt of a group; the head whole or in chunks without its logits kept, with an
/// entropy bonus; at temperature 1 and 0.7): per option set, the masked response log-probs,
/// entropies and every weight's gradient of `Σ (logp + ½·entropy)` over the responses, on
/// the CPU. In f32, or in bf16 with the weights held in bf16 (`bf16_masters`:
/// `train.master_weights = "bf16"`).
fn scoring(device: &Device, bf16_masters: bool) -> Vec<(String, Vec<f32>)> {
    use r3_model::Precision;
    use r3_train::policy::precision::MasterWeights;
    use r3_train::policy::{score_with, ResponseBatch, ScoreOptions};
    let (precision, masters) = match bf16_masters {
        true => (Precision::Bf16 { router_f32: false }, MasterWeights::Bf16),
        false => (Precision::F32, MasterWeights::F32),
    };
    let policy = TrainablePolicy::load_for_training(base_model(), device, precision, masters)
        .expect("policy");
    let model = policy.model().expect("model");
    // Two samples of one prompt and one of another, responses of 4, 6 and 3 tokens.
    let prompt = [3u32, 9, 14, 5, 7];
    let sequences = vec![
        prompt.iter().chain(&[11, 4, 8, 6]).copied().collect(),
        prompt
            .iter()
            .chain(&[12, 4, 8, 6, 15, 9])
            .copied()
            .collect(),
        vec![3, 8, 8, 10, 13, 4, 6],
    ];
    let batch = ResponseBatch::new(sequences, vec![5, 5, 4]).expect("batch");
    let mask = batch.response_mask(None, device).expect("mask");
    let vars: Vec<Var> = policy.vars().iter().map(|(_, v)| v.clone()).collect();
    let mut out = Vec::new();
    // At a rollout temperature of 0.7 too, the logits scaled by candle's affine op on the
    // device, whole and in chunks.
    for (share, chunk, recompute, temperature) in [
        (false, 0, false, 1.0),
        (true, 0, false, 1.0),
        (true, 4, true, 1.0),
        (false, 0, false, 0.7),
        (true, 4, true, 0.7),
    ] {
        let options = ScoreOptions {
            recompute,
            share_prefixes: share,
            head_chunk_tokens: chunk,
            entropy_grad: true,
            temperature,
        };
        let case = format!("share {share} chunk {chunk} recompute {recompute} T {temperature}");
        let (scored, layers) = score_with(&model, &batch, Routing::Native, options).expect("score");
        let logp = (&scored.logp * &mask).expect("masked log-probs");
        let entropy = (scored.entropy(true).expect("entropy") * &mask).expect("masked");
        let loss =
            (logp.sum_all().expect("sum") + (entropy.sum_all().expect("sum") * 0.5)).expect("loss");
        let grads = match layers {
            Some(layers) => layers
                .backward(loss.clone(), &vars)
                .expect("recomputed backward"),
            None => loss.backward().expect("backward"),
        };
        out.push((format!("{case} logp"), values(&logp)));
        out.push((format!("{case} entropy"), values(&entropy)));
        for (name, var) in policy.vars() {
            let g = grads.get(var.as_tensor()).expect("gradient");
            out.push((
                format!("{case} {name}"),
                values(&g.to_dtype(DType::F32).expect("f32")),
            ));
        }
    }
    out
}

/// [`scoring`] on `device` against the CPU's: every value within `tol` of the largest of
/// its tensor (at least 1).
fn compare_scoring(device: &Device, tol: f32, bf16_masters: bool) {
    let (cpu, other) = (
        scoring(&Device::Cpu, bf16_masters),
        scoring(device, bf16_masters),
    );
    assert_eq!(cpu.len(), other.len());
    for ((name, a), (_, b)) in cpu.iter().zip(&other) {
        let scale = a.iter().fold(1f32, |m, x| m.max(x.abs()));
        let d = max_diff(a, b);
        assert!(d <= tol * scale, "{name}: differs by {d} (scale {scale})");
    }
}

#[test]
fn scoring_gives_the_same_bits_on_a_second_cpu_copy() {
    compare_scoring(&Device::Cpu, 0.0, false);
    compare_scoring(&Device::Cpu, 0.0, true);
}

#[cfg(feature = "cuda")]
#[test]
fn scoring_on_cuda_matches_the_cpu() {
    let gpu = r3_model::DeviceSpec::Cuda { ordinal: 0 }
        .open()
        .expect("a CUDA GPU (this test runs on the GPU machine)");
    compare_scoring(&gpu, 1e-4, false);
}

/// The same with the weights held in bf16 (`train.master_weights = "bf16"`: the embedding
/// looked up from a bf16 table, the GEMMs reading bf16 weights in place, the head in chunks
/// rounding its weights' gradient to bf16): a GPU's 16-bit GEMMs sum in another order than
/// the CPU's f32 GEMMs before rounding to bf16, so within a few bf16 steps (2⁻⁸ relative).
#[cfg(feature = "cuda")]
#[test]
fn bf16_master_scoring_on_cuda_matches_the_cpu() {
    let gpu = r3_model::DeviceSpec::Cuda { ordinal: 0 }
        .open()
        .expect("a CUDA GPU (this test runs on the GPU machine)");
    compare_scoring(&gpu, 3e-2, true);
}

/// Gradients of every dtype a trainer hands the norm (f32; bf16 and f16 as a backward keeps
/// them; bf16 and f32 for variables held in bf16), one of 5 M values (past the GPU kernel's
/// 1,024 blocks), on `device`; with the norm computed in f64 on the host from the same values.
fn norm_case(device: &Device, poison: bool) -> (Vec<Var>, candle_core::backprop::GradStore, f64) {
    let cases = [
        (DType::F32, DType::F32, 1usize),
        (DType::F32, DType::BF16, 31),
        (DType::F32, DType::F16, 4_097),
        (DType::BF16, DType::BF16, 75_301),
        (DType::BF16, DType::F32, 1_000),
        (DType::F32, DType::BF16, 5_000_000),
    ];
    let mut store = candle_core::backprop::GradStore::default();
    let mut vars = Vec::new();
    let mut exact = 0f64;
    for (i, &(var_dtype, grad_dtype, n)) in cases.iter().enumerate() {
        let var = Var::zeros(n, var_dtype, device).expect("var");
        let mut g = seeded(&[n], i as u64 + 3)
            .affine(4.0, 0.0)
            .and_then(|g| g.to_dtype(grad_dtype))
            .expect("gradient");
        if poison && i == 3 {
            let mut v = values(&g);
            v[17] = f32::NAN;
            g = Tensor::from_vec(v, n, &Device::Cpu)
                .and_then(|g| g.to_dtype(grad_dtype))
                .expect("poisoned");
        }
        exact += values(&g)
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>();
        store.insert(var.as_tensor(), g.to_device(device).expect("to device"));
        vars.push(var);
    }
    (vars, store, exact.sqrt())
}

/// The global gradient norm over gradients of every dtype: within `tol` (relative) of the
/// exact norm, the same bits on a second run, and not finite where one value is a NaN (the
/// update's guard skips it).
fn check_grad_norm(device: &Device, tol: f64) -> f32 {
    let (vars, store, exact) = norm_case(device, false);
    let norm = r3_train::global_grad_norm(vars.iter(), &store).expect("norm");
    let again = r3_train::global_grad_norm(vars.iter(), &store).expect("norm again");
    assert_eq!(
        norm.to_bits(),
        again.to_bits(),
        "{device:?}: {norm} then {again}"
    );
    let rel = (f64::from(norm) - exact).abs() / exact;
    assert!(
        rel < tol,
        "{device:?}: norm {norm} vs exact {exact} (relative {rel:e})"
    );
    let (vars, store, _) = norm_case(device, true);
    let poisoned = r3_train::global_grad_norm(vars.iter(), &store).expect("poisoned norm");
    assert!(
        !poisoned.is_finite(),
        "{device:?}: a NaN gradient gave the norm {poisoned}"
    );
    norm
}

/// The CPU's fused pass sums in candle's f32 order (32 lanes, here 156 k values added to
/// each in turn): 5.6e-5 off the exact norm on these 5 M values.
#[test]
fn the_gradient_norm_is_the_exact_one_to_f32_rounding_on_the_cpu() {
    check_grad_norm(&Device::Cpu, 2e-4);
}

/// On a GPU the norm is r3's kernel (one read of each gradient, no temporaries; the squares
/// added in f64 within a tensor): within 1e-6 of the exact norm, deterministic, and within
/// the CPU's own error of the CPU's.
#[cfg(feature = "cuda")]
#[test]
fn the_gradient_norm_on_cuda_matches_the_cpu() {
    let gpu = r3_model::DeviceSpec::Cuda { ordinal: 0 }
        .open()
        .expect("a CUDA GPU (this test runs on the GPU machine)");
    let (cpu, on_gpu) = (
        check_grad_norm(&Device::Cpu, 2e-4),
        check_grad_norm(&gpu, 1e-6),
    );
    let rel = (f64::from(cpu) - f64::from(on_gpu)).abs() / f64::from(cpu);
    assert!(rel < 2e-4, "cpu {cpu} vs cuda {on_gpu} (relative {rel:e})");
}

/// Both engines on one GPU: the RL backend builds the device rollout engine on the policy's
/// own handle (candle tells two handles of one GPU apart, and a second handle's weight sync
/// would copy every tensor into a buffer of its own first), and a sync to it (the f32
/// weights narrowed to the engine's f16 in place by r3's cast kernel) leaves the engine
/// generating what an engine freshly built from the same weights generates, bit for bit.
#[cfg(feature = "cuda")]
#[test]
fn a_gpu_rollout_engine_shares_the_gpu_policys_handle() {
    use r3_model::{Precision, WeightPrecision};
    use r3_train::policy::model_text::ModelText;
    use r3_train::policy::precision::MasterWeights;
    use r3_train::rl::backend::Backend;
    let gpu = r3_model::DeviceSpec::Cuda { ordinal: 0 }
        .open()
        .expect("a CUDA GPU (this test runs on the GPU machine)");
    let policy =
        TrainablePolicy::load_for_training(base_model(), &gpu, Precision::F32, MasterWeights::F32)
            .expect("policy");
    let tokenizer = ModelText::from_model_dir(base_model()).expect("tokenizer");
    let mut cfg = r3_train::TrainConfig::default();
    cfg.rollout.device = "cuda".into();
    let mut backend = Backend::connect(&cfg, &policy, &tokenizer, 0).expect("connect");
    let Backend::Device(engine) = &backend else {
        panic!("rollout.device = cuda builds the device engine");
    };
    assert!(
        engine.device().same_device(&policy.device()),
        "the engine runs on the policy's handle"
    );
    backend
        .sync(&policy, &tokenizer, 1, WeightPrecision::F16)
        .expect("sync");
    let Backend::Device(engine) = &mut backend else {
        unreachable!("checked above")
    };
    assert_eq!(engine.weight_version(), 1);
    let mut fresh = r3_rollout::DeviceEngine::new_on(
        policy.config().clone(),
        &policy.device_tensor_map(),
        engine.engine_config().clone(),
        policy.device(),
    )
    .expect("a fresh engine");
    let generate = |e: &mut r3_rollout::DeviceEngine| {
        let request = r3_rollout::GenerateRequest::new(
            vec![3, 9, 14, 5],
            r3_rollout::SamplingParams::greedy(8),
        );
        let got = e.generate(vec![request]).expect("generate").remove(0);
        let bits: Vec<u32> = got.output_logprobs.iter().map(|v| v.to_bits()).collect();
        (got.output_ids, bits)
    };
    assert_eq!(generate(engine), generate(&mut fresh), "synced = fresh");
}
