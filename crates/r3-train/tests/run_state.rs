//! Run-level behaviour: the same seed gives the same steps, a resumed run continues
//! exactly like an uninterrupted one, checkpoints are written atomically, and a NaN/inf
//! loss skips the update leaving weights and optimiser untouched.

mod common;

use candle_core::{Device, Tensor};
use common::{tiny_config, tiny_model, Scratch};
use r3_model::Routing;
use r3_train::algo::optim::{decay_matrices_only, AdamW, AdamWParams};
use r3_train::config::RouterReplay;
use r3_train::policy::{ResponseBatch, TrainablePolicy};
use r3_train::rl::checkpoint::{latest_checkpoint, list_checkpoints, read_state};
use r3_train::rl::metrics_log::is_measurement;
use r3_train::rl::minibatch::{update_minibatch, MiniBatch, UpdateSettings};
use r3_train::{Quiet, Run, Trainer, UpdateOutcome};

fn metrics_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .expect("metrics file")
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).expect("json line");
            let map = v.as_object_mut().expect("object");
            map.retain(|k, _| !is_measurement(k));
            v
        })
        .collect()
}

#[test]
fn the_same_seed_gives_the_same_first_steps() {
    let dir = Scratch::new("determinism");
    let model = dir.path().join("model");
    tiny_model(&model, 21);
    let cfg = tiny_config(&model, &dir.path().join("run"), RouterReplay::R3, 2);
    let mut a = Trainer::new(cfg.clone()).expect("trainer a");
    let mut b = Trainer::new(cfg.clone()).expect("trainer b");
    for _ in 0..2 {
        let ma = a.rl_step().expect("step a").without_timing().expect("json");
        let mb = b.rl_step().expect("step b").without_timing().expect("json");
        assert_eq!(ma, mb);
    }
    // A different seed samples other problems and tokens.
    let mut other = cfg;
    other.seed += 1;
    let mut c = Trainer::new(other).expect("trainer c");
    let mut fresh = Trainer::new(tiny_config(
        &model,
        &dir.path().join("run"),
        RouterReplay::R3,
        2,
    ))
    .expect("trainer d");
    let mc = c.rl_step().expect("step c").without_timing().expect("json");
    let md = fresh
        .rl_step()
        .expect("step d")
        .without_timing()
        .expect("json");
    assert_ne!(mc, md);
}

/// A trainer built from the model in memory (`Trainer::with_model`: config, weights and
/// tokenizer handed over) runs the steps a trainer reading the same model's directory runs.
#[test]
fn a_model_handed_over_in_memory_trains_as_its_directory_does() {
    let dir = Scratch::new("with-model");
    let model = dir.path().join("model");
    let model_cfg = tiny_model(&model, 23);
    let cfg = tiny_config(&model, &dir.path().join("run"), RouterReplay::R3, 2);
    let weights = r3_model::Weights::load(&model, &model_cfg, &Device::Cpu).expect("weights");
    let tokenizer = r3_train::ModelText::from_model_dir(&model).expect("tokenizer");
    let mut from_dir = Trainer::new(cfg.clone()).expect("trainer from the directory");
    let mut in_memory =
        Trainer::with_model(cfg, model_cfg, weights, tokenizer).expect("trainer from memory");
    for _ in 0..2 {
        let a = from_dir
            .rl_step()
            .expect("step")
            .without_timing()
            .expect("json");
        let b = in_memory
            .rl_step()
            .expect("step")
            .without_timing()
            .expect("json");
        assert_eq!(a, b);
    }
}

#[test]
fn a_resumed_run_continues_like_an_uninterrupted_one() {
    let dir = Scratch::new("resume");
    let model = dir.path().join("model");
    tiny_model(&model, 22);
    let run_dir = dir.path().join("run");
    let mut cfg = tiny_config(&model, &run_dir, RouterReplay::R3, 2);
    cfg.steps = 3;
    let mut run = Run::fresh(cfg).expect("fresh run");
    run.execute(&mut Quiet).expect("uninterrupted run");
    let full = metrics_lines(&run_dir.join("metrics.jsonl"));
    assert_eq!(full.len(), 3);
    assert_eq!(list_checkpoints(&run_dir).expect("list").len(), 3);

    // Simulate a kill after step 3 was logged but before checkpoints 2 and 3 existed.
    for step in [2, 3] {
        std::fs::remove_dir_all(run_dir.join(format!("checkpoints/step_{step}"))).expect("rm");
    }
    let mut resumed = Run::resume(&run_dir).expect("resume");
    assert_eq!(resumed.trainer.step, 1);
    let summary = resumed.execute(&mut Quiet).expect("resumed run");
    assert_eq!(summary.steps_run, 2);
    let again = metrics_lines(&run_dir.join("metrics.jsonl"));
    assert_eq!(
        again, full,
        "steps 2 and 3 after resume equal the uninterrupted run"
    );
    let evals = std::fs::read_to_string(run_dir.join("eval.jsonl")).expect("eval log");
    assert_eq!(
        evals.lines().count(),
        4,
        "eval at steps 0..=3, none duplicated"
    );
}

#[test]
fn checkpoints_are_written_atomically_and_restore_the_state() {
    let dir = Scratch::new("checkpoint");
    let model = dir.path().join("model");
    tiny_model(&model, 23);
    let run_dir = dir.path().join("run");
    let cfg = tiny_config(&model, &run_dir, RouterReplay::R3, 2);
    let mut t = Trainer::new(cfg.clone()).expect("trainer");
    t.rl_step().expect("step");
    // A crash mid-write leaves only a temporary directory: it never counts as a checkpoint.
    let torn = run_dir.join("checkpoints/.tmp-step_9");
    std::fs::create_dir_all(&torn).expect("torn dir");
    std::fs::write(torn.join("config.json"), "{").expect("torn file");
    let saved = t.save_checkpoint(&run_dir).expect("save");
    assert_eq!(saved, run_dir.join("checkpoints/step_1"));
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(saved.join(f).is_file(), "{f} in the checkpoint");
    }
    let (latest, state) = latest_checkpoint(&run_dir).expect("latest").expect("some");
    assert_eq!(latest, saved);
    assert_eq!(state.step, 1);
    assert_eq!(state.optimizer_steps, t.optimizer.step_count());
    assert_eq!(read_state(&saved).expect("state"), state);

    let restored = Trainer::from_checkpoint(cfg, &saved).expect("restore");
    assert_eq!(restored.step, 1);
    assert_eq!(restored.prompts.stream_pos(), t.prompts.stream_pos());
    for ((name, a), (_, b)) in t.policy.vars().iter().zip(restored.policy.vars()) {
        let d =
            (a.as_tensor() - b.as_tensor()).and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>());
        assert_eq!(d.expect("diff"), 0.0, "{name} restored exactly");
    }
}

fn values(p: &TrainablePolicy) -> Vec<Vec<f32>> {
    p.vars()
        .iter()
        .map(|(_, v)| {
            v.as_tensor()
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("values")
        })
        .collect()
}

#[test]
fn a_nan_or_inf_loss_skips_the_update_and_leaves_weights_untouched() {
    let dir = Scratch::new("nan");
    let model = dir.path().join("model");
    tiny_model(&model, 24);
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
    let settings = UpdateSettings {
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
    let before = values(&policy);
    for bad in [f32::NAN, f32::INFINITY] {
        let mb = MiniBatch {
            batch: &batch,
            old_logp: None,
            rollout_logp: rollout.clone(),
            advantages: vec![bad, 1.0],
            row_weight: None,
            routing: Routing::Native,
        };
        let r = update_minibatch(&policy, &mut opt, &mb, &settings).expect("update runs");
        assert!(
            matches!(r.outcome, UpdateOutcome::Skipped { .. }),
            "{bad}: {:?}",
            r.outcome
        );
        assert_eq!(
            values(&policy),
            before,
            "weights untouched after a {bad} loss"
        );
        assert_eq!(opt.step_count(), 0, "optimiser state untouched");
    }
    // Control: finite advantages do move the weights.
    let mb = MiniBatch {
        batch: &batch,
        old_logp: None,
        rollout_logp: rollout,
        advantages: vec![-1.0, 1.0],
        row_weight: None,
        routing: Routing::Native,
    };
    let r = update_minibatch(&policy, &mut opt, &mb, &settings).expect("update");
    assert!(r.outcome.applied());
    let after = values(&policy);
    assert_ne!(after, before);
    // Every row weighted 0 (dynamic sampling dropped every group): no step, though AdamW's
    // momentum from the step above would still move the weights on zero gradients.
    let mb = MiniBatch {
        row_weight: Some(vec![0.0, 0.0]),
        ..mb
    };
    let r = update_minibatch(&policy, &mut opt, &mb, &settings).expect("update");
    assert!(
        matches!(
            r.outcome,
            UpdateOutcome::Skipped {
                reason: r3_train::SkipReason::NoLossTokens,
                ..
            }
        ),
        "{:?}",
        r.outcome
    );
    assert_eq!(
        values(&policy),
        after,
        "weights untouched with no loss token"
    );
    assert_eq!(opt.step_count(), 1, "optimiser state untouched");
    assert_eq!(r.logp.dims(), [2, batch.width()], "the forward's log-probs");
}
