//! The router replay modes, checked through the routes each pass actually used:
//! R3 replays the rollout engine's routes in the old-log-prob pass and in every update;
//! R2 records the old pass's routes and replays those in the updates; disabled routes
//! natively. Independent truth: the route tables themselves (row counts tell rollout
//! tables, `len − 1` rows, from recorded ones, `len` rows) and a separate native forward.

mod common;

use common::{tiny_config, tiny_model, Scratch};
use r3_model::{Model, Routing};
use r3_routing::divergence;
use r3_train::config::RouterReplay;
use r3_train::policy::{score, ResponseBatch};
use r3_train::rl::step::StepTrace;
use r3_train::Trainer;

/// Rows each update forward must have replayed per MoE layer, from the sequences.
/// Positions a training forward feeds for sequences `picked`: each but its last token.
fn rows(seqs: &[Vec<u32>], picked: &[usize]) -> usize {
    picked.iter().map(|&r| seqs[r].len() - 1).sum()
}

#[test]
fn r3_replays_the_rollout_routes_in_the_old_pass_and_every_update() {
    let dir = Scratch::new("r3-modes");
    let model = dir.path().join("model");
    let cfg = tiny_model(&model, 11);
    let run = tiny_config(&model, &dir.path().join("run"), RouterReplay::R3, 2);
    let mut trainer = Trainer::new(run).expect("trainer");
    // Make the rollout engine's routers disagree with the trainer's: negated router
    // weights pick other experts for most tokens (an extreme training–inference gap).
    let mut skewed = trainer.policy.tensor_map().expect("tensor map");
    for (name, t) in skewed.iter_mut() {
        if name.ends_with("mlp.gate.weight") {
            *t = t.neg().expect("negate");
        }
    }
    trainer
        .backend
        .engine_mut()
        .expect("the engine backend has an engine")
        .update_weights(&skewed)
        .expect("skew engine");
    // A copy of the old weights (the step updates the variables in place), for an
    // independent native pass at the old weights.
    let old_weights = trainer.policy.detached().snapshot().expect("snapshot");
    let before = Model::new(&cfg, &old_weights).expect("model");
    let mut trace = StepTrace::default();
    let metrics = trainer.rl_step_with(Some(&mut trace)).expect("step");

    let tables = trace.rollout_tables.as_ref().expect("rollout routes");
    let seqs = &trace.sequences;
    for (t, s) in tables.iter().zip(seqs) {
        assert_eq!(t.start_pos(), 0);
        assert_eq!(
            t.num_tokens(),
            s.len() - 1,
            "rollout routes have tokens-1 rows"
        );
    }
    let layers = cfg.layer_layout().moe_layers().len();
    let all: Vec<usize> = (0..seqs.len()).collect();

    let old = trace.old_proof.as_ref().expect("R3 old pass replays");
    assert_eq!(old.replayed_cells, vec![rows(seqs, &all); layers]);
    // The forward feeds the rollout's positions (every token but the last): every one is
    // replayed, none left to the router.
    assert!(
        old.native_final_position.iter().all(|&b| !b),
        "no final position fed"
    );
    assert_eq!(old.native_cells, vec![0; layers]);

    // Where the replayed (rollout) experts differ from the training router's own choice,
    // the independent native pass must disagree with the rollout by the same count.
    let batch = ResponseBatch::new(seqs.clone(), vec![1; seqs.len()]).expect("batch");
    let native = score(&before, &batch, Routing::Record).expect("record pass");
    let recorded = native.routes.expect("recorded routes");
    let differing: usize = tables
        .iter()
        .zip(&recorded)
        .map(|(r, n)| {
            let n = n.slice_rows(0, r.num_tokens()).expect("slice");
            divergence(r, &n).expect("divergence").differing_routers
        })
        .sum();
    assert!(differing > 0, "the skewed engine routes differently");
    assert_eq!(old.differs_from_native.iter().sum::<usize>(), differing);

    assert_eq!(trace.updates.len(), 2, "two mini-batches");
    let mut covered: Vec<usize> = Vec::new();
    for (picked, proof) in &trace.updates {
        let proof = proof.as_ref().expect("R3 update replays");
        assert_eq!(proof.replayed_cells, vec![rows(seqs, picked); layers]);
        assert!(proof.native_final_position.iter().all(|&b| !b));
        assert_eq!(proof.native_cells, vec![0; layers]);
        covered.extend(picked);
    }
    covered.sort_unstable();
    assert_eq!(covered, all, "every trajectory is updated exactly once");
    assert_eq!(metrics.verified_frac, Some(1.0));
    assert_eq!(metrics.replay_mode, "R3");
}

#[test]
fn r2_replays_the_old_pass_routes_in_the_updates() {
    let dir = Scratch::new("r2-modes");
    let model = dir.path().join("model");
    let cfg = tiny_model(&model, 12);
    let run = tiny_config(&model, &dir.path().join("run"), RouterReplay::R2, 2);
    let mut trainer = Trainer::new(run).expect("trainer");
    let mut trace = StepTrace::default();
    let metrics = trainer.rl_step_with(Some(&mut trace)).expect("step");

    assert!(trace.old_proof.is_none(), "R2's old pass routes natively");
    let recorded = trace
        .old_recorded
        .as_ref()
        .expect("R2 records in the old pass");
    let seqs = &trace.sequences;
    for (t, s) in recorded.iter().zip(seqs) {
        assert_eq!(
            t.num_tokens(),
            s.len() - 1,
            "recorded routes cover every position fed (all but the last token)"
        );
    }
    let layers = cfg.layer_layout().moe_layers().len();
    for (picked, proof) in &trace.updates {
        let proof = proof.as_ref().expect("R2 update replays");
        // Every fed row replayed from the old pass's tables, none left to native routing.
        assert_eq!(proof.replayed_cells, vec![rows(seqs, picked); layers]);
        assert!(proof.native_final_position.iter().all(|&b| !b));
    }
    assert_eq!(metrics.verified_frac, Some(1.0));
    assert!(metrics.router_frac.is_some() && metrics.token_frac.is_some());
}

#[test]
fn disabled_routes_natively_in_every_pass() {
    let dir = Scratch::new("disabled-modes");
    let model = dir.path().join("model");
    tiny_model(&model, 13);
    let run = tiny_config(&model, &dir.path().join("run"), RouterReplay::Disabled, 2);
    let mut trainer = Trainer::new(run).expect("trainer");
    let mut trace = StepTrace::default();
    let metrics = trainer.rl_step_with(Some(&mut trace)).expect("step");
    assert!(trace.old_proof.is_none());
    assert!(
        trace.updates.iter().all(|(_, p)| p.is_none()),
        "no update replays"
    );
    assert_eq!(metrics.verified_frac, None);
    // Divergence is still measured: rollout routes vs the old pass's native routes.
    assert!(metrics.router_frac.is_some() && metrics.token_frac.is_some());
    assert!(metrics.k3_kl.is_some_and(|k| k.is_finite() && k >= 0.0));
}

#[test]
fn single_mini_step_r3_replays_rollout_routes_in_the_one_update() {
    let dir = Scratch::new("r3-single");
    let model = dir.path().join("model");
    let cfg = tiny_model(&model, 14);
    let run = tiny_config(&model, &dir.path().join("run"), RouterReplay::R3, 1);
    let mut trainer = Trainer::new(run).expect("trainer");
    let mut trace = StepTrace::default();
    let metrics = trainer.rl_step_with(Some(&mut trace)).expect("step");
    assert!(
        trace.old_proof.is_none(),
        "single mini-step: no separate old pass"
    );
    assert_eq!(trace.updates.len(), 1);
    let (picked, proof) = &trace.updates[0];
    let proof = proof.as_ref().expect("replayed");
    let layers = cfg.layer_layout().moe_layers().len();
    assert_eq!(
        proof.replayed_cells,
        vec![rows(&trace.sequences, picked); layers]
    );
    assert_eq!(metrics.verified_frac, Some(1.0));
}

/// With the device engine generating (`rollout.device = "cpu-candle"`), each step lets the
/// engine's weights go for the update and the sync builds them again from the policy: after
/// every step the engine holds the policy's new weights (it generates, bit for bit, what an
/// engine built from the policy's tensors then does), at the next version, and R3 replays its
/// routes in every pass.
#[test]
fn the_device_engines_weights_are_built_again_after_each_update() {
    use r3_rollout::{DeviceEngine, DeviceEngineConfig, GenerateRequest, SamplingParams};
    use r3_train::rl::backend::Backend;
    let dir = Scratch::new("r3-device-rollouts");
    let model = dir.path().join("model");
    tiny_model(&model, 13);
    let mut run = tiny_config(&model, &dir.path().join("run"), RouterReplay::R3, 2);
    run.rollout.device = "cpu-candle".into();
    run.eval.every = 0;
    let mut trainer = Trainer::new(run).expect("trainer");
    let prompt = vec![3u32, 5, 7, 9, 11];
    let request = GenerateRequest::new(prompt, SamplingParams::greedy(6));
    for step in 1..=2u64 {
        let metrics = trainer.rl_step().expect("step");
        assert_eq!(metrics.verified_frac, Some(1.0), "step {step}");
        let Backend::Device(engine) = &mut trainer.backend else {
            panic!("not the device engine");
        };
        assert!(!engine.weights_released(), "step {step}");
        assert_eq!(engine.weight_version(), step, "step {step}");
        let config: DeviceEngineConfig = engine.engine_config().clone();
        let got = engine.generate(vec![request.clone()]).expect("generate");
        let mut fresh = DeviceEngine::new(
            trainer.policy.config().clone(),
            &trainer.policy.tensor_map().expect("policy tensors"),
            config,
        )
        .expect("fresh engine");
        let want = fresh.generate(vec![request.clone()]).expect("fresh");
        assert_eq!(got[0].output_ids, want[0].output_ids, "step {step}");
        assert_eq!(
            got[0].output_logprobs, want[0].output_logprobs,
            "step {step}"
        );
    }
}
