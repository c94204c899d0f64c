//! Held 16-bit weight copies (`train.narrow_weight_copies`): a bf16 / f16 run that reads
//! them is bit for bit the run that rounds its f32 weights at every use (metrics and
//! checkpoints), because the optimiser rewrites each copy after every update; copies left
//! unrefreshed would change the result (the control that shows the comparison can fail).

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use common::{tiny_config, tiny_model, Scratch};
use r3_model::{Batch, Precision, Routing};
use r3_train::config::RouterReplay;
use r3_train::policy::TrainablePolicy;
use r3_train::rl::metrics_log::is_measurement;
use r3_train::{decay_matrices_only, AdamW, AdamWParams, Quiet, Run};

/// Every metrics line of a run without its machine measurements.
fn metrics(run_dir: &Path) -> Vec<BTreeMap<String, serde_json::Value>> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| {
            let v: BTreeMap<String, serde_json::Value> = serde_json::from_str(l).expect("json");
            v.into_iter().filter(|(k, _)| !is_measurement(k)).collect()
        })
        .collect()
}

/// The bytes of every safetensors file of the run's checkpoint of `step`.
fn checkpoint_weights(run_dir: &Path, step: u64) -> BTreeMap<String, Vec<u8>> {
    let dir = run_dir.join(format!("checkpoints/step_{step}"));
    std::fs::read_dir(&dir)
        .expect("checkpoint")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .map(|p| {
            let name = p.file_name().expect("name").to_string_lossy().into_owned();
            (name, std::fs::read(&p).expect("read"))
        })
        .collect()
}

#[test]
fn a_run_reading_held_copies_is_the_run_without_them() {
    let dir = Scratch::new("narrow-copies-run");
    let model = dir.path().join("model");
    tiny_model(&model, 61);
    for dtype in ["bf16", "f16"] {
        let run = |copies: &str| {
            let run_dir = dir.path().join(format!("{dtype}-{copies}"));
            // Two mini-batches: an old-log-prob pass on the frozen policy, then two updates
            // per step, each reading the copies the previous one rewrote.
            let mut cfg = tiny_config(&model, &run_dir, RouterReplay::R3, 2);
            cfg.steps = 3;
            cfg.train.dtype = dtype.into();
            cfg.train.narrow_weight_copies = copies.into();
            Run::fresh(cfg)
                .expect("run")
                .execute(&mut Quiet)
                .expect("execute");
            run_dir
        };
        let (off, on) = (run("off"), run("on"));
        let (m_off, m_on) = (metrics(&off), metrics(&on));
        assert_eq!(m_off.len(), 3, "{dtype}");
        assert_eq!(m_off, m_on, "{dtype}: metrics");
        let applied = m_on
            .iter()
            .filter(|m| m.get("update.skipped").and_then(|v| v.as_u64()) == Some(0))
            .count();
        assert!(applied > 0, "{dtype}: some update was applied: {m_on:?}");
        let (w_off, w_on) = (checkpoint_weights(&off, 3), checkpoint_weights(&on, 3));
        assert!(!w_off.is_empty());
        assert!(w_off == w_on, "{dtype}: the step-3 checkpoints differ");
    }
}

/// Logits of a frozen model of `policy` on a fixed batch, as bits.
fn frozen_logits(policy: &TrainablePolicy) -> Vec<u32> {
    let model = policy.frozen_model().expect("model");
    let batch = Batch::new(&[vec![1, 5, 9, 4, 7, 3]], 0, &Device::Cpu).expect("batch");
    model
        .forward(&batch, Routing::Native)
        .expect("forward")
        .logits
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("logits")
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// One AdamW step on a loss of the policy's logits.
fn one_update(policy: &TrainablePolicy, opt: &mut AdamW) {
    let model = policy.model().expect("model");
    let batch = Batch::new(&[vec![1, 4, 8, 2, 6]], 0, &Device::Cpu).expect("batch");
    let logits = model
        .forward(&batch, Routing::Native)
        .expect("forward")
        .logits;
    let probe = Tensor::from_vec(
        (0..logits.elem_count())
            .map(|i| ((i * 29 % 97) as f32 / 97.0) - 0.5)
            .collect::<Vec<f32>>(),
        logits.dims(),
        &Device::Cpu,
    )
    .expect("probe");
    let grads = (&logits * &probe)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    opt.step(&grads, 1e-2).expect("step");
}

#[test]
fn the_optimiser_keeps_the_copies_current_and_stale_ones_would_show() {
    let dir = Scratch::new("narrow-copies-optim");
    let model = dir.path().join("model");
    tiny_model(&model, 62);
    let bf16 = Precision::Bf16 { router_f32: false };
    let policy = || {
        let mut p = TrainablePolicy::load(&model).expect("policy");
        p.set_precision(bf16);
        p
    };
    let optimiser = |p: &TrainablePolicy| {
        AdamW::new(
            p.vars().to_vec(),
            AdamWParams::default(),
            decay_matrices_only,
        )
        .expect("optimiser")
    };
    // Without copies: the reference.
    let plain = policy();
    let mut plain_opt = optimiser(&plain);
    // Copies refreshed by the optimiser.
    let mut held = policy();
    let mut held_opt = optimiser(&held);
    held_opt
        .hold_narrow_copies(held.hold_narrow_copies().expect("copies"))
        .expect("held");
    assert!(held_opt.narrow_copies_held() > 0 && held.holds_narrow_copies());
    assert!(
        held.hold_narrow_copies().is_err(),
        "a second set of copies is refused"
    );
    // Copies the optimiser does not know of: they go stale.
    let mut stale = policy();
    let _unrefreshed = stale.hold_narrow_copies().expect("copies");
    let mut stale_opt = optimiser(&stale);
    assert_eq!(frozen_logits(&plain), frozen_logits(&held));
    for step in 1..=2 {
        one_update(&plain, &mut plain_opt);
        one_update(&held, &mut held_opt);
        one_update(&stale, &mut stale_opt);
        let want = frozen_logits(&plain);
        assert!(
            want == frozen_logits(&held),
            "step {step}: held copies are current"
        );
        assert!(
            want != frozen_logits(&stale),
            "step {step}: stale copies would show"
        );
    }
    // A copy that names no variable, or is f32, is refused.
    let mut f32_policy = TrainablePolicy::load(&model).expect("policy");
    assert!(
        f32_policy.hold_narrow_copies().is_err(),
        "f32 has nothing to copy"
    );
    let mut other = policy();
    let mut copies = other.hold_narrow_copies().expect("copies");
    copies[0].0 = "no.such.weight".into();
    assert!(optimiser(&other).hold_narrow_copies(copies).is_err());
}

/// Replacing a buffer (DeepSeek's selection bias, which aux-loss-free balancing updates)
/// keeps the held copies: models handed out afterwards still read them.
#[test]
fn a_buffer_update_keeps_the_copies() {
    let deep = Path::new("../../models/deep-moe");
    let mut policy = TrainablePolicy::load(deep).expect("deep-moe");
    policy.set_precision(Precision::Bf16 { router_f32: false });
    let _copies = policy.hold_narrow_copies().expect("copies");
    let name = policy
        .detached()
        .tensors()
        .keys()
        .find(|k| k.ends_with("e_score_correction_bias"))
        .cloned()
        .expect("a selection bias buffer");
    let values = policy.buffer(&name).expect("buffer");
    policy
        .set_buffer(&name, values.iter().map(|v| v + 0.01).collect())
        .expect("set");
    assert!(
        policy.holds_narrow_copies(),
        "the copies survive a buffer update"
    );
}
