//! What an update computes beside the policy loss, against independent truth: the entropy
//! bonus aggregated with `algo.loss_agg` (verl's actor does so; checked on two rows of unequal
//! length under every mode, from a separate scoring of the entropies), the TIS/MIS statistics
//! of an update (hand-computed ratios) and of a step's metrics line, and a step with
//! `rollout.group_size = 1` under dynamic sampling (singletons are kept, as verl's DAPO
//! filter keeps them).

mod common;

use common::{tiny_config, tiny_model, Scratch};
use r3_model::Routing;
use r3_train::algo::loss::{ClipRange, PolicyLossKind};
use r3_train::config::RouterReplay;
use r3_train::policy::{score, ResponseBatch, TrainablePolicy};
use r3_train::rl::minibatch::{update_minibatch, MiniBatch, MiniBatchResult, UpdateSettings};
use r3_train::{
    decay_matrices_only, AdamW, AdamWParams, IsConfig, IsLevel, IsMode, LossAgg, Trainer,
    UpdateOutcome,
};

/// Rows of the given `(prompt, response)` lengths, every row beginning with token 1.
fn batch(lens: &[(usize, usize)]) -> ResponseBatch {
    let sequences = lens
        .iter()
        .enumerate()
        .map(|(i, &(p, r))| {
            std::iter::once(1)
                .chain((1..p + r).map(|j| 4 + ((i * 7 + j * 5) % 18) as u32))
                .collect()
        })
        .collect();
    ResponseBatch::new(sequences, lens.iter().map(|&(p, _)| p).collect()).expect("batch")
}

fn settings(agg: LossAgg, is: IsConfig, entropy_coef: f64, budget: usize) -> UpdateSettings {
    UpdateSettings {
        loss: PolicyLossKind::Ppo,
        clip: ClipRange {
            low: 0.2,
            high: 0.27,
            dual_clip: None,
        },
        agg,
        is,
        entropy_coef,
        lr: 1e-4,
        grad_clip: 0.0,
        mode: RouterReplay::Disabled,
        grad_hook: None,
        max_tokens_per_micro_batch: budget,
        gradient_checkpointing: false,
        selective_recompute: false,
        share_prefixes: false,
        head_chunk_tokens: 0,
        narrow_gradients: false,
        bf16_gradient_sums: false,
        temperature: 1.0,
    }
}

const NO_IS: IsConfig = IsConfig {
    mode: IsMode::None,
    level: IsLevel::Token,
    threshold: 2.0,
};

/// One update of a fresh copy of the model in `dir` on `mb`.
fn update(dir: &Scratch, mb: &MiniBatch<'_>, s: &UpdateSettings) -> MiniBatchResult {
    let policy = TrainablePolicy::load(&dir.path().join("model")).expect("policy");
    let mut opt = AdamW::new(
        policy.vars().to_vec(),
        AdamWParams::default(),
        decay_matrices_only,
    )
    .expect("optimizer");
    update_minibatch(&policy, &mut opt, mb, s).expect("update")
}

#[test]
fn the_entropy_bonus_is_aggregated_with_the_loss_aggregation() {
    let dir = Scratch::new("terms-entropy");
    tiny_model(&dir.path().join("model"), 21);
    // Two rows: one response token, and three.
    let batch = batch(&[(3, 1), (2, 3)]);
    let device = candle_core::Device::Cpu;
    // The per-token entropies from a separate scoring of the same weights.
    let h: Vec<Vec<f64>> = {
        let policy = TrainablePolicy::load(&dir.path().join("model")).expect("policy");
        let model = policy.frozen_model().expect("model");
        let scored = score(&model, &batch, Routing::Native).expect("score");
        let entropy = scored.entropy(false).expect("entropy");
        batch
            .gather_responses(&entropy)
            .expect("gather")
            .into_iter()
            .map(|row| row.into_iter().map(f64::from).collect())
            .collect()
    };
    assert_eq!((h[0].len(), h[1].len()), (1, 3));
    let row_sum = |r: &[f64]| r.iter().sum::<f64>();
    // The three aggregations by hand: over the 4 tokens, over the 2 rows of their means,
    // over the 2 rows of their sums.
    let by_hand = [
        (LossAgg::TokenMean, (row_sum(&h[0]) + row_sum(&h[1])) / 4.0),
        (
            LossAgg::SeqMeanTokenMean,
            (h[0][0] + row_sum(&h[1]) / 3.0) / 2.0,
        ),
        (LossAgg::SeqMeanTokenSum, (h[0][0] + row_sum(&h[1])) / 2.0),
    ];
    assert!(
        (by_hand[0].1 - by_hand[1].1).abs() > 1e-3 && (by_hand[0].1 - by_hand[2].1).abs() > 1e-3,
        "the modes must differ on this batch to tell them apart: {by_hand:?}"
    );
    let coef = 0.1;
    for (agg, entropy) in by_hand {
        // Zero advantages: the policy loss is 0, the update's loss is the bonus alone.
        let mb = MiniBatch {
            batch: &batch,
            old_logp: None,
            rollout_logp: batch
                .align(&[vec![0.0], vec![0.0; 3]], &device)
                .expect("rollout"),
            advantages: vec![0.0, 0.0],
            row_weight: None,
            routing: Routing::Native,
        };
        let result = update(&dir, &mb, &settings(agg, NO_IS, coef, 0));
        let UpdateOutcome::Applied { loss, .. } = result.outcome else {
            panic!("{agg:?}: {:?}", result.outcome)
        };
        let want = -coef * entropy;
        assert!(
            (f64::from(loss) - want).abs() <= 1e-5 * want.abs(),
            "{agg:?}: loss {loss} vs −coef · entropy {want}"
        );
    }
}

#[test]
fn an_update_reports_its_is_statistics_over_the_weighted_response_tokens() {
    let dir = Scratch::new("terms-is");
    tiny_model(&dir.path().join("model"), 22);
    // Rows of 1, 3 and 2 response tokens; the third row has loss weight 0 (a dropped group).
    let batch = batch(&[(3, 1), (2, 3), (2, 2)]);
    let device = candle_core::Device::Cpu;
    let old = [vec![-1.0f32], vec![-0.5, -2.0, -1.5], vec![-1.0, -1.0]];
    // log(π_old / π_rollout) per token: ratios 3 | 1, 3, 0.5 | 5, 5.
    let log_ratio = [
        vec![3f32.ln()],
        vec![0.0, 3f32.ln(), 0.5f32.ln()],
        vec![5f32.ln(), 5f32.ln()],
    ];
    let rollout: Vec<Vec<f32>> = old
        .iter()
        .zip(&log_ratio)
        .map(|(o, d)| o.iter().zip(d).map(|(o, d)| o - d).collect())
        .collect();
    // Counted: the 4 tokens of rows 0 and 1, ratios 3, 1, 3, 0.5, threshold 2.
    //   TIS weights 2, 1, 2, 0.5 → mean 5.5 / 4; MIS 0, 1, 0, 0.5 → 1.5 / 4;
    //   over the threshold 2 of 4; mean log-ratio (2 ln 3 − ln 2) / 4.
    let log_mean = (2.0 * 3f32.ln() - 2f32.ln()) / 4.0;
    for (mode, weight_mean) in [(IsMode::Tis, 5.5f32 / 4.0), (IsMode::Mis, 1.5 / 4.0)] {
        // One forward, and one micro-batch a row (a budget of 1 token): the same numbers.
        for budget in [0, 1] {
            let mb = MiniBatch {
                batch: &batch,
                old_logp: Some(batch.align(&old, &device).expect("old")),
                rollout_logp: batch.align(&rollout, &device).expect("rollout"),
                advantages: vec![1.0, -0.5, 1.0],
                row_weight: Some(vec![1.0, 1.0, 0.0]),
                routing: Routing::Native,
            };
            let is = IsConfig {
                mode,
                level: IsLevel::Token,
                threshold: 2.0,
            };
            let result = update(&dir, &mb, &settings(LossAgg::TokenMean, is, 0.0, budget));
            let m = result.is_metrics.expect("IS statistics with TIS/MIS");
            let case = format!("{mode:?}, budget {budget}: {m:?}");
            assert!((m.weight_mean - weight_mean).abs() < 1e-6, "{case}");
            assert!((m.over_threshold_frac - 0.5).abs() < 1e-7, "{case}");
            assert!((m.log_ratio_mean - log_mean).abs() < 1e-6, "{case}");
        }
    }
    let mb = MiniBatch {
        batch: &batch,
        old_logp: Some(batch.align(&old, &device).expect("old")),
        rollout_logp: batch.align(&rollout, &device).expect("rollout"),
        advantages: vec![1.0, -0.5, 1.0],
        row_weight: None,
        routing: Routing::Native,
    };
    let result = update(&dir, &mb, &settings(LossAgg::TokenMean, NO_IS, 0.0, 0));
    assert!(result.is_metrics.is_none(), "no statistics without IS");
}

/// The metrics line of one step of a tiny run of `group_size` samples per prompt.
fn one_step(
    name: &str,
    group_size: usize,
    mini_batches: usize,
    dynamic_sampling: bool,
    is: IsMode,
) -> serde_json::Value {
    let dir = Scratch::new(name);
    let model = dir.path().join("model");
    tiny_model(&model, 23);
    let mut cfg = tiny_config(&model, &dir.path().join("run"), RouterReplay::R3, 1);
    cfg.rollout.group_size = group_size;
    cfg.algo.mini_batches = mini_batches;
    cfg.algo.dynamic_sampling = dynamic_sampling;
    cfg.algo.is_mode = is;
    cfg.validate().expect("valid config");
    let mut trainer = Trainer::new(cfg).expect("trainer");
    let metrics = trainer.rl_step().expect("step");
    serde_json::to_value(&metrics).expect("json")
}

#[test]
fn group_size_one_trains_under_dynamic_sampling() {
    for mini_batches in [1, 2] {
        let m = one_step(
            &format!("terms-g1-{mini_batches}"),
            1,
            mini_batches,
            true,
            IsMode::None,
        );
        // Both prompts' single samples are kept and every update has loss tokens (before,
        // every singleton was "uniform": dropped, and each update skipped for no loss token).
        assert_eq!(m["groups_kept"], 2, "{m}");
        assert_eq!(m["groups_dropped"], 0, "{m}");
        assert_eq!(m["update.applied"], mini_batches, "{m}");
        assert_eq!(m["update.skipped"], 0, "{m}");
    }
}

#[test]
fn a_step_with_tis_writes_the_is_statistics_and_a_default_step_does_not() {
    let keys = [
        "is.weight_mean",
        "is.over_threshold_frac",
        "is.log_ratio_mean",
    ];
    // Without dynamic sampling: the random model's groups are mostly uniform, and a step
    // whose update has no loss token reports no statistics.
    let tis = one_step("terms-tis", 2, 1, false, IsMode::Tis);
    let value = |k: &str| tis[k].as_f64().unwrap_or_else(|| panic!("{k} in {tis}"));
    // TIS weights are min(ratio, 2) > 0; the fraction is one.
    let weight = value("is.weight_mean");
    assert!(weight > 0.0 && weight <= 2.0, "{tis}");
    let over = value("is.over_threshold_frac");
    assert!((0.0..=1.0).contains(&over), "{tis}");
    assert!(value("is.log_ratio_mean").is_finite(), "{tis}");
    let plain = one_step("terms-plain", 2, 1, false, IsMode::None);
    for k in keys {
        assert!(plain.get(k).is_none(), "{k} absent without IS: {plain}");
    }
}
