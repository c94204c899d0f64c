//! A policy scored at a rollout temperature `T` (`rollout.temperature`): its log-probs and
//! entropies are those of `softmax(logits / T)` (checked against an f64 log-softmax of the
//! temperature-1 logits divided by `T`), the same whether the head keeps its logits whole or
//! scores them in chunks (values and gradients), the chunked backward is the loss's
//! derivative (central differences), a run at `T` trains on that policy in its update
//! forward and in its separate old-log-prob pass, and the engines' log-probs at `T` match
//! it (no rollout/training mismatch beyond float noise).

mod common;

use candle_core::{Tensor, Var};
use common::{tiny_config, tiny_model, Scratch};
use r3_model::Routing;
use r3_train::config::RouterReplay;
use r3_train::policy::{score_with, ResponseBatch, ScoreOptions, Scored, TrainablePolicy};
use r3_train::rl::step::StepTrace;
use r3_train::Trainer;

/// Rows with prompts of 4, 6, 3 and 5 tokens and responses of 5, 2, 7 and 4.
fn batch() -> ResponseBatch {
    let lens = [(4, 5), (6, 2), (3, 7), (5, 4)];
    let sequences = lens
        .iter()
        .enumerate()
        .map(|(i, &(p, r))| {
            std::iter::once(1)
                .chain((1..p + r).map(|j| 4 + ((i * 5 + j * 7) % 18) as u32))
                .collect()
        })
        .collect();
    ResponseBatch::new(sequences, lens.iter().map(|&(p, _)| p).collect()).expect("batch")
}

/// A tiny HF-style MoE model written under a scratch folder (kept while the policy is used)
/// and loaded as a policy.
fn tiny_policy(tag: &str) -> (Scratch, TrainablePolicy) {
    let dir = Scratch::new(tag);
    tiny_model(&dir.path().join("model"), 3);
    let policy = TrainablePolicy::load(&dir.path().join("model")).expect("policy");
    (dir, policy)
}

/// Scoring options: the head whole (`chunk` 0) or `chunk` rows at a time, with or without a
/// recomputing forward, the entropy's gradient asked for, at `temperature`.
fn options(chunk: usize, recompute: bool, temperature: f32) -> ScoreOptions {
    ScoreOptions {
        recompute,
        head_chunk_tokens: chunk,
        entropy_grad: true,
        temperature,
        ..ScoreOptions::default()
    }
}

/// Each row's response log-probs and entropies, one after the other (the head's row order).
fn response_values(scored: &Scored, batch: &ResponseBatch) -> ResponseValues {
    let logp = batch.gather_responses(&scored.logp).expect("logp");
    let entropy = scored.entropy(false).expect("entropy");
    let entropy = batch.gather_responses(&entropy).expect("entropy");
    (logp.concat(), entropy.concat())
}

/// The tokens each head row predicts, in the head's row order.
fn targets(batch: &ResponseBatch) -> Vec<usize> {
    batch
        .sequences()
        .iter()
        .zip(batch.prompt_lens())
        .flat_map(|(s, &p)| s[p..].iter().map(|&t| t as usize))
        .collect()
}

/// `log_softmax(z / t)[target]` and the entropy of `softmax(z / t)`, in f64.
fn reference(z: &[f32], target: usize, t: f64) -> (f64, f64) {
    let z: Vec<f64> = z.iter().map(|&v| f64::from(v) / t).collect();
    let max = z.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
    let lse = max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    let entropy = z.iter().map(|v| -(v - lse).exp() * (v - lse)).sum();
    (z[target] - lse, entropy)
}

/// At T = 0.5 every response token's log-prob and entropy, the head whole or in chunks (with
/// a recomputing forward too), is the f64 log-softmax of the temperature-1 logits divided
/// by 0.5 (within 1e-5 relative); the temperature-1 values are not (so the comparison can
/// tell them apart).
#[test]
fn tempered_scores_are_the_log_softmax_of_the_scaled_logits() {
    let (_dir, policy) = tiny_policy("temperature-reference");
    let model = policy.frozen_model().expect("model");
    let batch = batch();
    let (raw, _) = score_with(&model, &batch, Routing::Native, options(0, false, 1.0))
        .expect("temperature-1 scoring");
    let logits = raw.logits.as_ref().expect("logits kept whole");
    let logits = logits.to_vec2::<f32>().expect("logits");
    let targets = targets(&batch);
    assert_eq!(logits.len(), targets.len());
    let want: Vec<(f64, f64)> = logits
        .iter()
        .zip(&targets)
        .map(|(z, &t)| reference(z, t, 0.5))
        .collect();
    let close = |a: f32, b: f64| (f64::from(a) - b).abs() <= 1e-5 * b.abs().max(1.0);

    let (raw_logp, raw_entropy) = response_values(&raw, &batch);
    let differing = want
        .iter()
        .zip(raw_logp.iter().zip(&raw_entropy))
        .filter(|((lp, h), (a, b))| !close(**a, *lp) || !close(**b, *h))
        .count();
    assert_eq!(differing, want.len(), "T = 1 scores the raw policy");

    for (chunk, recompute) in [(0, false), (0, true), (3, false), (5, true), (100, false)] {
        let (scored, _) = score_with(
            &model,
            &batch,
            Routing::Native,
            options(chunk, recompute, 0.5),
        )
        .expect("tempered scoring");
        let (logp, entropy) = response_values(&scored, &batch);
        for (k, ((lp, h), (a, b))) in want.iter().zip(logp.iter().zip(&entropy)).enumerate() {
            assert!(close(*a, *lp), "chunk {chunk}: logp {k}: {a} vs {lp}");
            assert!(close(*b, *h), "chunk {chunk}: entropy {k}: {b} vs {h}");
        }
    }
}

/// Each row's response log-probs and entropies, one after the other.
type ResponseValues = (Vec<f32>, Vec<f32>);

/// The weights' gradients of `Σ (logp + ½·entropy)` over the responses at `temperature`,
/// with the response values, by variable.
fn values_and_grads(
    policy: &TrainablePolicy,
    batch: &ResponseBatch,
    opts: ScoreOptions,
) -> (ResponseValues, Vec<Vec<f32>>) {
    let model = policy.model().expect("model");
    let vars: Vec<Var> = policy.vars().iter().map(|(_, v)| v.clone()).collect();
    let mask = batch.response_mask(None, &policy.device()).expect("mask");
    let (scored, layers) = score_with(&model, batch, Routing::Native, opts).expect("score");
    let values = response_values(&scored, batch);
    let bonus = scored
        .entropy(true)
        .and_then(|e| Ok(e.affine(0.5, 0.0)?))
        .expect("entropy");
    let loss = (&scored.logp + bonus)
        .and_then(|l| l * &mask)
        .and_then(|l| l.sum_all())
        .expect("loss");
    let store = match layers {
        Some(layers) => layers.backward(loss, &vars).expect("recomputed backward"),
        None => loss.backward().expect("backward"),
    };
    let grads = vars
        .iter()
        .map(|v| {
            store
                .get(v.as_tensor())
                .expect("gradient")
                .flatten_all()
                .and_then(|g| g.to_vec1::<f32>())
                .expect("values")
        })
        .collect();
    (values, grads)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// At T = 0.7 the chunked head (2 and 5 rows a chunk, with a recomputing forward, and one
/// chunk of every row) gives the log-probs and entropies of the whole logits (within 2e-6
/// relative) and the same gradients of an entropy bonus's loss in every weight (within 1e-5
/// of the largest); the head's gradient at 0.7 is another than at 1.
#[test]
fn chunked_scoring_at_a_temperature_has_the_whole_heads_values_and_gradients() {
    let (_dir, policy) = tiny_policy("temperature-chunks");
    let batch = batch();
    let ((logp, entropy), whole) = values_and_grads(&policy, &batch, options(0, false, 0.7));
    for (chunk, recompute) in [(2, false), (5, true), (100, false)] {
        let ((l, h), got) = values_and_grads(&policy, &batch, options(chunk, recompute, 0.7));
        for (got, want) in [(&l, &logp), (&h, &entropy)] {
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= 2e-6 * w.abs().max(1.0),
                    "chunk {chunk}: {g} vs {w}"
                );
            }
        }
        for (i, (want, got)) in whole.iter().zip(&got).enumerate() {
            let scale = max_abs(want).max(1e-6);
            let diff = max_diff(want, got);
            let name = &policy.vars()[i].0;
            assert!(
                diff <= 1e-5 * scale,
                "{name} chunk {chunk} recompute {recompute}: {diff} of {scale}"
            );
        }
    }
    let (_, at_one) = values_and_grads(&policy, &batch, options(0, false, 1.0));
    let head = policy
        .vars()
        .iter()
        .position(|(n, _)| n == "lm_head.weight")
        .expect("an untied head");
    let scale = max_abs(&whole[head]);
    assert!(
        max_diff(&whole[head], &at_one[head]) > 1e-2 * scale,
        "the head's gradient at T = 0.7 is its gradient at T = 1"
    );
}

/// `Σ logp` over the responses at T = 0.7, in f64 from the f32 values.
fn tempered_loss(policy: &TrainablePolicy, batch: &ResponseBatch, chunk: usize) -> f64 {
    let model = policy.frozen_model().expect("model");
    let opts = ScoreOptions {
        head_chunk_tokens: chunk,
        temperature: 0.7,
        ..ScoreOptions::default()
    };
    let (scored, _) = score_with(&model, batch, Routing::Native, opts).expect("score");
    let rows = batch.gather_responses(&scored.logp).expect("logp");
    rows.iter().flatten().map(|&v| f64::from(v)).sum()
}

/// The gradient of `Σ logp` at T = 0.7 in the head's and the final norm's weights, the head
/// scored in chunks of 3 rows (the op's own backward) and whole, against central
/// differences of the loss: the entries of largest gradient, each within 3% (+ 3e-3, the
/// f32 loss's rounding over the step). A backward that left out the factor 1 / T would be
/// 43% off.
#[test]
fn the_tempered_backward_is_the_losss_derivative() {
    let (_dir, policy) = tiny_policy("temperature-differences");
    let batch = batch();
    let mask = batch.response_mask(None, &policy.device()).expect("mask");
    for chunk in [3, 0] {
        let model = policy.model().expect("model");
        let opts = ScoreOptions {
            head_chunk_tokens: chunk,
            temperature: 0.7,
            ..ScoreOptions::default()
        };
        let (scored, _) = score_with(&model, &batch, Routing::Native, opts).expect("score");
        let store = (&scored.logp * &mask)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
            .expect("backward");
        for (name, picks) in [("lm_head.weight", 4), ("model.norm.weight", 2)] {
            let var = policy
                .vars()
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
                .expect("variable");
            let grad = store
                .get(var.as_tensor())
                .expect("gradient")
                .flatten_all()
                .and_then(|g| g.to_vec1::<f32>())
                .expect("gradient values");
            let mut order: Vec<usize> = (0..grad.len()).collect();
            order.sort_by(|&a, &b| grad[b].abs().total_cmp(&grad[a].abs()));
            let original = var.as_tensor().copy().expect("copy");
            let flat: Vec<f32> = original
                .flatten_all()
                .and_then(|t| t.to_vec1())
                .expect("weights");
            let eps = 5e-3f32;
            for &k in &order[..picks] {
                let at = |delta: f32| -> f64 {
                    let mut moved = flat.clone();
                    moved[k] += delta;
                    let t = Tensor::from_vec(moved, original.shape(), original.device())
                        .expect("moved");
                    var.set(&t).expect("set");
                    let loss = tempered_loss(&policy, &batch, chunk);
                    var.set(&original).expect("restore");
                    loss
                };
                let fd = (at(eps) - at(-eps)) / (2.0 * f64::from(eps));
                let g = f64::from(grad[k]);
                assert!(
                    (fd - g).abs() <= 3e-2 * g.abs() + 3e-3,
                    "{name}[{k}] chunk {chunk}: backward {g}, differences {fd}"
                );
            }
        }
    }
}

/// A run at `rollout.temperature = 0.7` (routes native, so the passes can be scored again
/// here) reports the entropy of the tempered policy at the step's starting weights over the
/// step's samples: from its update forward with one mini-batch, from its separate
/// old-log-prob pass with two (within 1e-5 relative; prefix sharing rounds otherwise). Not
/// the raw policy's.
#[test]
fn a_run_at_a_temperature_scores_the_tempered_policy() {
    for mini_batches in [1, 2] {
        let dir = Scratch::new(&format!("temperature-run-{mini_batches}"));
        let model_dir = dir.path().join("model");
        tiny_model(&model_dir, 5);
        let mut cfg = tiny_config(
            &model_dir,
            &dir.path().join("run"),
            RouterReplay::Disabled,
            mini_batches,
        );
        cfg.rollout.temperature = 0.7;
        cfg.eval.every = 0;
        cfg.validate().expect("a tempered config");
        let start = TrainablePolicy::load(&model_dir).expect("starting weights");
        let mut trainer = Trainer::new(cfg).expect("trainer");
        let mut trace = StepTrace::default();
        let metrics = trainer.rl_step_with(Some(&mut trace)).expect("step");
        let got = metrics.entropy.expect("entropy");

        let batch = ResponseBatch::new(trace.sequences.clone(), trace.prompt_lens.clone())
            .expect("the step's batch");
        let model = start.frozen_model().expect("model");
        let mask = batch.response_mask(None, &start.device()).expect("mask");
        let entropy_at = |temperature: f32| -> f64 {
            let opts = ScoreOptions {
                temperature,
                ..ScoreOptions::default()
            };
            let (scored, _) = score_with(&model, &batch, Routing::Native, opts).expect("score");
            f64::from(scored.mean_entropy(&mask).expect("mean entropy"))
        };
        let (tempered, raw) = (entropy_at(0.7), entropy_at(1.0));
        assert!(
            (got - tempered).abs() <= 1e-5 * tempered.abs(),
            "{mini_batches} mini-batches: entropy {got}, the tempered policy's {tempered}"
        );
        assert!(
            (raw - tempered).abs() > 1e-3 * tempered.abs(),
            "the raw policy's entropy {raw} is the tempered one's {tempered}"
        );
    }
}

/// With the engine in f32 and R3, a run at `rollout.temperature = 0.7` trains on rollout and
/// training log-probs of one distribution: the engines (the CPU engine and the device engine
/// on candle's CPU) report each token's log-prob under `softmax(logits / 0.7)`, as SGLang
/// does by default, and the trainer scores that policy, so the old-weights mismatch
/// (`mismatch.k3_kl`, separate old-log-prob pass) is float noise, below 1e-9 as at
/// temperature 1. The temperature-1 log-probs on either side would put it near 1e-2.
#[test]
fn a_run_at_a_temperature_has_no_rollout_training_mismatch() {
    for device in ["cpu", "cpu-candle"] {
        for temperature in [1.0, 0.7] {
            let dir = Scratch::new(&format!("temperature-mismatch-{device}-{temperature}"));
            let model_dir = dir.path().join("model");
            tiny_model(&model_dir, 5);
            let mut cfg = tiny_config(&model_dir, &dir.path().join("run"), RouterReplay::R3, 2);
            cfg.rollout.temperature = temperature;
            cfg.rollout.dtype = "f32".into();
            cfg.rollout.device = device.into();
            cfg.eval.every = 0;
            cfg.validate().expect("an f32 tempered config");
            let mut trainer = Trainer::new(cfg).expect("trainer");
            let metrics = trainer.rl_step().expect("step");
            let k3 = metrics.k3_kl.expect("mismatch");
            let delta = metrics.mean_abs_delta.expect("mean |Δ|");
            assert!(
                k3 < 1e-9 && delta < 1e-5,
                "{device} T = {temperature}: mismatch.k3_kl {k3}, mean |Δ| {delta}"
            );
        }
    }
}
