//! The training guard: config values that cannot train are refused naming their key, an
//! update that would make a weight or moment non-finite is skipped with the weights and
//! the optimiser state kept bit for bit, and a checkpoint is never written with NaN weights.

mod common;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use common::{tiny_config, tiny_model, Scratch};
use r3_model::Routing;
use r3_train::algo::optim::{decay_matrices_only, AdamW, AdamWParams, AdamWStep};
use r3_train::config::{RouterReplay, TrainConfig};
use r3_train::policy::{ResponseBatch, TrainablePolicy};
use r3_train::rl::minibatch::{update_minibatch, MiniBatch, UpdateSettings};
use r3_train::{SkipReason, TrainError, Trainer, UpdateOutcome};

fn refused_key(overrides: &[&str]) -> &'static str {
    let set: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    match TrainConfig::resolve_text("", &set) {
        Err(TrainError::InvalidConfig { field, .. }) => field,
        other => panic!("{overrides:?} was not refused by validation: {other:?}"),
    }
}

#[test]
fn validation_refuses_values_that_cannot_train_naming_the_key() {
    for (set, key) in [
        ("optim.lr=inf", "optim.lr"),
        ("optim.lr=nan", "optim.lr"),
        ("optim.lr=1e9", "optim.lr"),
        ("optim.lr=0.0", "optim.lr"),
        ("optim.adam_eps=0.0", "optim.adam_eps"),
        ("optim.adam_eps=inf", "optim.adam_eps"),
        ("optim.beta1=1.0", "optim.beta1"),
        ("optim.beta2=nan", "optim.beta2"),
        ("optim.weight_decay=-0.1", "optim.weight_decay"),
        ("optim.grad_clip=inf", "optim.grad_clip"),
        ("optim.grad_clip=-1.0", "optim.grad_clip"),
        ("rollout.temperature=inf", "rollout.temperature"),
        ("rollout.temperature=0.0", "rollout.temperature"),
        ("rollout.temperature=-0.5", "rollout.temperature"),
        ("rollout.temperature=nan", "rollout.temperature"),
        ("rollout.temperature=100.5", "rollout.temperature"),
        // 1 / T overflows f32, where the engines and the trainer scale the logits.
        ("rollout.temperature=1e-40", "rollout.temperature"),
        ("eval.temperature=inf", "eval.temperature"),
        ("algo.entropy_coef=nan", "algo.entropy_coef"),
        ("algo.is_threshold=inf", "algo.is_threshold"),
        ("algo.adv_eps=0.0", "algo.adv_eps"),
        ("task.format_reward=nan", "task.format_reward"),
        ("steps=0", "steps"),
        ("eval.size=0", "eval.size"),
    ] {
        assert_eq!(refused_key(&[set]), key, "{set}");
    }
    // The bounds themselves are accepted, and so is the default config.
    let ok = [
        "optim.lr=1.0",
        "algo.adv_eps=0.0",
        "algo.adv_norm_by_std=false",
    ];
    let set: Vec<String> = ok.iter().map(|s| s.to_string()).collect();
    TrainConfig::resolve_text("", &set[..1]).expect("lr at the bound");
    TrainConfig::resolve_text("", &set[1..]).expect("adv_eps 0 without std division");
    TrainConfig::default().validate().expect("defaults");
    // A rollout temperature other than 1 trains (the policy is scored at it), up to the
    // bound.
    for t in ["0.7", "2.5", "100.0"] {
        let set = [format!("rollout.temperature={t}")];
        let cfg = TrainConfig::resolve_text("", &set).expect("a rollout temperature");
        assert_eq!(
            cfg.rollout.temperature.to_string(),
            t.trim_end_matches(".0")
        );
    }
}

/// Every f32 of the weights and optimiser moments, by name, as bits.
fn state_bits(policy: &TrainablePolicy, opt: &AdamW) -> Vec<(String, Vec<u32>)> {
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("f32")
            .into_iter()
            .map(f32::to_bits)
            .collect()
    };
    let mut out: Vec<(String, Vec<u32>)> = policy
        .vars()
        .iter()
        .map(|(n, v)| (n.clone(), bits(v.as_tensor())))
        .collect();
    let mut moments: Vec<_> = opt.state_tensors().into_iter().collect();
    moments.sort_by(|a, b| a.0.cmp(&b.0));
    out.extend(moments.iter().map(|(n, t)| (n.clone(), bits(t))));
    out
}

/// The test hook: one NaN in the first variable's gradient, after the loss and the
/// gradient norm were found finite.
fn poison_first_gradient(opt: &AdamW, grads: &mut GradStore) -> r3_train::Result<()> {
    let (_, var) = opt.vars().next().expect("a variable");
    let g = grads.get(var.as_tensor()).expect("a gradient").clone();
    let mut values = g.flatten_all()?.to_vec1::<f32>()?;
    values[0] = f32::NAN;
    let poisoned = Tensor::from_vec(values, g.shape(), g.device())?;
    grads.insert(var.as_tensor(), poisoned);
    Ok(())
}

#[test]
fn an_injected_non_finite_gradient_is_skipped_with_state_restored_bit_for_bit() {
    let dir = Scratch::new("guard-hook");
    let model = dir.path().join("model");
    tiny_model(&model, 41);
    let policy = TrainablePolicy::load(&model).expect("policy");
    let mut opt = AdamW::new(
        policy.vars().to_vec(),
        AdamWParams::default(),
        decay_matrices_only,
    )
    .expect("opt");
    let batch = ResponseBatch::new(
        vec![vec![1, 4, 5, 16, 7, 2], vec![1, 6, 14, 3, 2]],
        vec![3, 3],
    )
    .expect("batch");
    let rollout =
        Tensor::zeros((2, batch.width()), candle_core::DType::F32, &Device::Cpu).expect("zeros");
    let mb = MiniBatch {
        batch: &batch,
        old_logp: None,
        rollout_logp: rollout,
        advantages: vec![-1.0, 1.0],
        row_weight: None,
        routing: Routing::Native,
    };
    let mut settings = UpdateSettings {
        loss: r3_train::PolicyLossKind::Ppo,
        clip: r3_train::ClipRange {
            low: 0.2,
            high: 0.27,
            dual_clip: None,
        },
        agg: r3_train::LossAgg::TokenMean,
        is: r3_train::IsConfig {
            mode: r3_train::IsMode::None,
            level: r3_train::IsLevel::Token,
            threshold: 2.0,
        },
        entropy_coef: 0.0,
        lr: 1e-2,
        grad_clip: 1.0,
        mode: RouterReplay::Disabled,
        grad_hook: None,
        max_tokens_per_micro_batch: 0,
        gradient_checkpointing: false,
        selective_recompute: false,
        share_prefixes: true,
        head_chunk_tokens: 0,
        narrow_gradients: false,
        bf16_gradient_sums: false,
        temperature: 1.0,
    };
    // One applied update first, so the moments are not all zero.
    let r = update_minibatch(&policy, &mut opt, &mb, &settings).expect("update");
    assert!(r.outcome.applied());
    let before = state_bits(&policy, &opt);
    settings.grad_hook = Some(poison_first_gradient);
    let r = update_minibatch(&policy, &mut opt, &mb, &settings).expect("update runs");
    assert!(
        matches!(
            r.outcome,
            UpdateOutcome::Skipped {
                reason: SkipReason::NonFiniteUpdate,
                ..
            }
        ),
        "{:?}",
        r.outcome
    );
    assert_eq!(
        opt.step_count(),
        1,
        "the skipped update is not counted as a step"
    );
    assert!(
        state_bits(&policy, &opt) == before,
        "weights and moments equal those before the skipped update, bit for bit"
    );
    // Without the hook the same update applies and moves the weights.
    settings.grad_hook = None;
    let r = update_minibatch(&policy, &mut opt, &mb, &settings).expect("update");
    assert!(r.outcome.applied());
    assert!(state_bits(&policy, &opt) != before);
}

#[test]
fn an_update_that_overflows_a_moment_changes_nothing() {
    let theta = Var::from_vec(vec![0.5f32, -0.25, 1.0], 3, &Device::Cpu).expect("var");
    let other = Var::from_vec(vec![2.0f32; 2], 2, &Device::Cpu).expect("var");
    let mut opt = AdamW::new(
        vec![("a".into(), other.clone()), ("b".into(), theta.clone())],
        AdamWParams::default(),
        decay_matrices_only,
    )
    .expect("opt");
    let grads = |ga: f32, gb: f32| {
        let loss = (other
            .as_tensor()
            .sum_all()
            .expect("s")
            .affine(ga as f64, 0.0))
        .and_then(|a| a.add(&theta.as_tensor().sum_all()?.affine(gb as f64, 0.0)?))
        .expect("loss");
        loss.backward().expect("backward")
    };
    assert_eq!(
        opt.step(&grads(1.0, 1.0), 0.1).expect("step"),
        AdamWStep::Applied
    );
    let before: Vec<Vec<f32>> = [&other, &theta]
        .iter()
        .map(|v| v.as_tensor().to_vec1::<f32>().expect("v"))
        .collect();
    // 1e30² overflows f32: the second moment of `b` would be infinite. Variable `a` comes
    // first and has a finite update, which must not be applied either.
    let outcome = opt.step(&grads(1.0, 1e30), 0.1).expect("step");
    assert_eq!(
        outcome,
        AdamWStep::NonFinite {
            variable: "b".into(),
            what: "second moment"
        }
    );
    let after: Vec<Vec<f32>> = [&other, &theta]
        .iter()
        .map(|v| v.as_tensor().to_vec1::<f32>().expect("v"))
        .collect();
    assert_eq!(after, before);
    assert_eq!(opt.step_count(), 1);
}

#[test]
fn a_checkpoint_with_non_finite_weights_is_refused_and_not_written() {
    let dir = Scratch::new("guard-checkpoint");
    let model = dir.path().join("model");
    tiny_model(&model, 42);
    let run_dir = dir.path().join("run");
    let cfg = tiny_config(&model, &run_dir, RouterReplay::R3, 1);
    let t = Trainer::new(cfg).expect("trainer");
    let (name, var) = t.policy.vars()[1].clone();
    let mut values = var
        .as_tensor()
        .flatten_all()
        .and_then(|v| v.to_vec1::<f32>())
        .expect("v");
    values[3] = f32::INFINITY;
    values[5] = f32::NAN;
    var.set(&Tensor::from_vec(values, var.shape(), &Device::Cpu).expect("t"))
        .expect("set");
    match t.save_checkpoint(&run_dir) {
        Err(TrainError::NonFiniteWeights {
            variable, count, ..
        }) => assert_eq!((variable, count), (name, 2)),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let root = run_dir.join("checkpoints");
    let leftovers: Vec<_> = std::fs::read_dir(&root)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(leftovers.is_empty(), "nothing written: {leftovers:?}");
}

/// A tiny model whose every embedding value is 65504, f16's largest finite value: an f16
/// engine still holds it, but an update that makes any of them larger would not be.
fn model_at_the_f16_limit(dir: &std::path::Path) {
    let cfg = tiny_model(dir, 43);
    let mut map = r3_model::Weights::load(dir, &cfg, &Device::Cpu)
        .expect("load")
        .into_map();
    let embed = map.get("model.embed_tokens.weight").expect("embeddings");
    let limit = Tensor::full(65504f32, embed.shape(), &Device::Cpu).expect("full");
    map.insert("model.embed_tokens.weight".into(), limit);
    r3_model::Weights::from_map(map)
        .save(dir, &cfg)
        .expect("save");
}

/// `update.skipped` of every line of a run's metrics.
fn skipped_per_step(run_dir: &std::path::Path) -> Vec<u64> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json line");
            v["update.skipped"].as_u64().expect("update.skipped")
        })
        .collect()
}

#[test]
fn an_update_past_the_rollout_precision_is_skipped_and_checkpoints_stay_servable() {
    let dir = Scratch::new("guard-precision");
    let model = dir.path().join("model");
    model_at_the_f16_limit(&model);
    let run = |dtype: &str| {
        let run_dir = dir.path().join(format!("run-{dtype}"));
        let mut cfg = tiny_config(&model, &run_dir, RouterReplay::R3, 1);
        cfg.rollout.dtype = dtype.into();
        // Adam's first steps move every weight with a gradient by about the learning rate:
        // the embeddings are normalised, so their gradients have both signs and some
        // values would grow past 65504.
        cfg.optim.lr = 1.0;
        cfg.optim.weight_decay = 0.0;
        cfg.validate().expect("valid");
        r3_train::Run::fresh(cfg)
            .expect("run")
            .execute(&mut r3_train::Quiet)
            .expect("the run goes on past skipped updates");
        run_dir
    };
    let f16_engine = r3_rollout::EngineConfig {
        dtype: r3_rollout::Dtype::F16,
        ..r3_rollout::EngineConfig::default()
    };
    // An f16 rollout: every update that would leave the f16 range is skipped and counted,
    // and every checkpoint loads in an f16 engine.
    let f16_run = run("f16");
    let skipped = skipped_per_step(&f16_run);
    assert_eq!(skipped.len(), 2, "two steps logged");
    assert!(
        skipped.iter().all(|&n| n >= 1),
        "update.skipped {skipped:?}"
    );
    for step in ["step_1", "step_2"] {
        let ckpt = f16_run.join("checkpoints").join(step);
        r3_rollout::Engine::from_dir(&ckpt, f16_engine.clone())
            .unwrap_or_else(|e| panic!("{step} does not load in an f16 engine: {e}"));
    }
    // The same run with an f32 rollout applies those updates: its checkpoint holds values
    // an f16 engine refuses, naming the tensor.
    let f32_run = run("f32");
    assert!(skipped_per_step(&f32_run).iter().all(|&n| n == 0));
    let ckpt = f32_run.join("checkpoints").join("step_1");
    let e = r3_rollout::Engine::from_dir(&ckpt, f16_engine).expect_err("past f16's range");
    let text = e.to_string();
    assert!(
        text.contains("model.embed_tokens.weight") && text.contains("f16"),
        "{text}"
    );
}
