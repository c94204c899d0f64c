//! The direction of a policy-gradient update, checked on the model itself: after one
//! small update, a response with positive advantage is more likely and one with negative
//! advantage less likely, under every router replay mode of the update forward.

mod common;

use common::{tiny_model, Scratch};
use r3_model::{ReplayRoutes, Routing};
use r3_train::algo::loss::{ClipRange, PolicyLossKind};
use r3_train::config::RouterReplay;
use r3_train::policy::{score, ResponseBatch, TrainablePolicy};
use r3_train::rl::minibatch::{update_minibatch, MiniBatch, UpdateSettings};
use r3_train::{decay_matrices_only, AdamW, AdamWParams, IsConfig, IsLevel, IsMode, LossAgg};

/// Sum of the response log-probs of each sequence.
fn response_logp(policy: &TrainablePolicy, batch: &ResponseBatch) -> Vec<f32> {
    let model = policy.frozen_model().expect("model");
    let scored = score(&model, batch, Routing::Native).expect("score");
    batch
        .gather_responses(&scored.logp)
        .expect("gather")
        .iter()
        .map(|r| r.iter().sum())
        .collect()
}

fn check(kind: PolicyLossKind, replay: bool) {
    let dir = Scratch::new(&format!("direction-{kind:?}-{replay}"));
    tiny_model(dir.path(), 5);
    let policy = TrainablePolicy::load(dir.path()).expect("policy");
    let batch = ResponseBatch::new(
        vec![
            vec![1, 10, 11, 12, 5, 6, 7],
            vec![1, 10, 11, 12, 15, 16, 17],
        ],
        vec![4, 4],
    )
    .expect("batch");
    let before = response_logp(&policy, &batch);
    let recorded = {
        let model = policy.frozen_model().expect("model");
        score(&model, &batch, Routing::Record)
            .expect("record")
            .routes
            .expect("routes")
    };
    let recorded = ReplayRoutes::new(recorded, &policy.config().layout)
        .expect("recorded routes cover every cell");
    let mut opt = AdamW::new(
        policy.vars().to_vec(),
        AdamWParams::default(),
        decay_matrices_only,
    )
    .expect("optimizer");
    let rollout_logp = {
        let model = policy.frozen_model().expect("model");
        score(&model, &batch, Routing::Native).expect("score").logp
    };
    let mb = MiniBatch {
        batch: &batch,
        old_logp: None,
        rollout_logp,
        advantages: vec![1.0, -1.0],
        row_weight: None,
        routing: match replay {
            true => Routing::Replay(&recorded),
            false => Routing::Native,
        },
    };
    let settings = UpdateSettings {
        loss: kind,
        clip: ClipRange {
            low: 0.2,
            high: 0.28,
            dual_clip: None,
        },
        agg: LossAgg::TokenMean,
        is: IsConfig {
            mode: IsMode::None,
            level: IsLevel::Token,
            threshold: 2.0,
        },
        entropy_coef: 0.0,
        lr: 1e-3,
        grad_clip: 1.0,
        mode: RouterReplay::R3,
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
    let r = update_minibatch(&policy, &mut opt, &mb, &settings).expect("update");
    assert!(r.outcome.applied());
    let after = response_logp(&policy, &batch);
    assert!(
        after[0] > before[0],
        "{kind:?}: the positive-advantage response became less likely: {} -> {}",
        before[0],
        after[0]
    );
    assert!(
        after[1] < before[1],
        "{kind:?}: the negative-advantage response became more likely: {} -> {}",
        before[1],
        after[1]
    );
}

#[test]
fn ppo_update_raises_positive_and_lowers_negative_advantage_responses() {
    check(PolicyLossKind::Ppo, false);
}

#[test]
fn ppo_update_with_replayed_routes_moves_the_same_way() {
    check(PolicyLossKind::Ppo, true);
}

#[test]
fn gspo_update_raises_positive_and_lowers_negative_advantage_responses() {
    check(PolicyLossKind::Gspo, false);
}
