//! The policy's scoring feeds every token but each sequence's last and runs the vocabulary
//! head over each row's response predictions only (no prompt position, no padding): its
//! log-probs and entropies there are, bit for bit, the ones a forward over all those
//! positions gives (and to float rounding those of whole sequences), every other column is
//! 0, and the weights' gradients of a loss of them are the whole forward's (to float
//! rounding: the head's weight gradient sums fewer rows, in another grouping).

mod common;

use candle_core::{IndexOp, Tensor};
use common::{tiny_model, Scratch};
use r3_model::{Batch, Routing};
use r3_train::policy::{score, score_with, ResponseBatch, ScoreOptions, TrainablePolicy};
use r3_train::{entropy_from_logits, token_log_probs};

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

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2::<f32>().expect("rows")
}

/// Scoring options: activation checkpointing, prefix sharing, head chunk (0: whole) and the
/// entropy's gradient.
fn options(recompute: bool, share: bool, chunk: usize, entropy_grad: bool) -> ScoreOptions {
    ScoreOptions {
        recompute,
        share_prefixes: share,
        head_chunk_tokens: chunk,
        entropy_grad,
        temperature: 1.0,
    }
}

#[test]
fn response_log_probs_and_entropy_equal_the_whole_forwards() {
    let (_dir, policy) = tiny_policy("response-head");
    let model = policy.frozen_model().expect("model");
    let batch = batch();
    let device = policy.device();
    for routing in [Routing::Native, Routing::Record] {
        let scored = score(&model, &batch, routing).expect("score");
        assert_eq!(scored.spans, [3..8, 5..7, 2..9, 4..8]);
        let width = batch.width();
        assert_eq!(scored.logp.dims(), [batch.len(), width]);
        let logits = scored.logits.as_ref().expect("logits kept whole");
        assert_eq!(
            logits.dims()[0],
            5 + 2 + 7 + 4,
            "one head row per response token"
        );

        // The whole forward over the positions the scoring feeds (every token but each
        // sequence's last, which predicts nothing), every position through the head.
        let fed: Vec<Vec<u32>> = batch
            .sequences()
            .iter()
            .map(|s| s[..s.len() - 1].to_vec())
            .collect();
        let padded = Batch::new(&fed, 0, &device).expect("padded");
        let whole = model.forward(&padded, Routing::Native).expect("forward");
        let logits = &whole.logits;
        let full = Batch::new(batch.sequences(), 0, &device).expect("full");
        let targets = full.input_ids().narrow(1, 1, width).expect("targets");
        let want_logp = rows(&token_log_probs(logits, &targets).expect("logp"));
        let want_ent = rows(&entropy_from_logits(logits).expect("entropy"));
        // And over the whole sequences, last tokens included: causal attention keeps a
        // position from reading any after it, so the same values, to float rounding (the
        // attention's sums run over one more padded key).
        let everything = model.forward(&full, Routing::Native).expect("forward");
        let every_logits = everything.logits.i((.., ..width, ..)).expect("narrow");
        let every_logp = rows(&token_log_probs(&every_logits, &targets).expect("logp"));

        let got_logp = rows(&scored.logp);
        let got_ent = rows(&scored.entropy(false).expect("entropy"));
        let mask = rows(&batch.response_mask(None, &device).expect("mask"));
        let mut compared = 0;
        for (i, m) in mask.iter().enumerate() {
            for (j, &inside) in m.iter().enumerate() {
                if inside == 0.0 {
                    // Never computed: zeros, outside every response.
                    assert_eq!((got_logp[i][j], got_ent[i][j]), (0.0, 0.0), "{i},{j}");
                    continue;
                }
                // Each row is normed and projected alone, its products added in the same
                // order whatever the GEMM's height: the same bits.
                let (a, b) = (got_logp[i][j], want_logp[i][j]);
                assert!(a.to_bits() == b.to_bits(), "logp {i},{j}: {a} vs {b}");
                let (a, b) = (got_ent[i][j], want_ent[i][j]);
                assert!(a.to_bits() == b.to_bits(), "entropy {i},{j}: {a} vs {b}");
                let (a, b) = (got_logp[i][j], every_logp[i][j]);
                assert!(
                    (a - b).abs() <= 2e-6 * b.abs().max(1.0),
                    "logp {i},{j}: {a} vs {b}"
                );
                compared += 1;
            }
        }
        let responses: usize = (0..batch.len()).map(|i| batch.response_len(i)).sum();
        assert_eq!(compared, responses, "every response token compared");

        // Sharing prefixes (these rows share none: every row still runs alone) and with a
        // recomputing forward: the same bits. Scoring the head a few rows at a time without
        // keeping the logits: the same values to float rounding (the CPU's GEMM sums a
        // product in another order for another height), the same bits in one chunk.
        for (recompute, share, chunk) in [
            (false, true, 0),
            (true, false, 0),
            (true, true, 0),
            (false, false, 1),
            (false, false, 4),
            (true, true, 5),
            (false, false, 100),
        ] {
            let opts = options(recompute, share, chunk, false);
            let (again, _) = score_with(&model, &batch, routing, opts).expect("score again");
            let case = format!("recompute {recompute} share {share} chunk {chunk}");
            assert_eq!(again.spans, scored.spans);
            assert_eq!(again.logits.is_none(), chunk > 0, "{case}");
            let ent = again.entropy(false).expect("entropy");
            let pairs = [(rows(&again.logp), &got_logp), (rows(&ent), &got_ent)];
            for (got, want) in pairs {
                if chunk == 0 || chunk >= responses {
                    assert_eq!(&got, want, "{case}");
                    continue;
                }
                for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                    assert!(
                        (g - w).abs() <= 2e-6 * w.abs().max(1.0),
                        "{case}: {g} vs {w}"
                    );
                }
            }
        }
    }
}

/// Two samples of one prompt, scored sharing it: each response's log-probs are the unshared
/// scoring's (to float rounding).
#[test]
fn a_shared_prompt_scores_as_the_unshared_one() {
    let (_dir, policy) = tiny_policy("response-head-shared");
    let model = policy.frozen_model().expect("model");
    let prompt = [1u32, 5, 9, 13];
    let sequences: Vec<Vec<u32>> = [[4u32, 6, 8], [7, 11, 4]]
        .iter()
        .map(|r| prompt.iter().chain(r).copied().collect())
        .collect();
    let batch = ResponseBatch::new(sequences, vec![4, 4]).expect("batch");
    let scored = |share: bool| {
        let opts = options(false, share, 0, false);
        score_with(&model, &batch, Routing::Native, opts)
            .expect("score")
            .0
    };
    let (plain, shared) = (scored(false), scored(true));
    let lens: Vec<(usize, usize)> = shared
        .shared_lens
        .iter()
        .map(|s| (s.positions, s.head))
        .collect();
    // One sample's prompt computed for the other; one of the six head rows (the prompt's
    // last) repeats, under the quarter: the head runs per position.
    assert_eq!(lens.iter().map(|l| l.0).sum::<usize>(), 4, "{lens:?}");
    assert!(lens.iter().all(|l| l.1 == 0), "{lens:?}");
    let (a, b) = (rows(&plain.logp), rows(&shared.logp));
    for (ra, rb) in a.iter().zip(&b) {
        for (x, y) in ra.iter().zip(rb) {
            assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{x} vs {y}");
        }
    }
    let logits = shared.logits.as_ref().expect("logits kept whole");
    assert_eq!(logits.dims()[0], 6, "one head row per response token");
}

/// The weights' gradients of a masked sum of the response log-probs, with and without
/// prefix sharing, the head's logits kept whole or scored a few rows at a time, against the
/// same loss over a forward whose head ran at every position.
#[test]
fn the_gradients_are_the_whole_forwards() {
    let (_dir, policy) = tiny_policy("response-head-grads");
    let model = policy.model().expect("model");
    let batch = batch();
    let device = policy.device();
    let mask = batch.response_mask(None, &device).expect("mask");
    let width = batch.width();
    let padded = Batch::new(batch.sequences(), 0, &device).expect("padded");
    let whole = model.forward(&padded, Routing::Native).expect("forward");
    let logits = whole.logits.i((.., ..width, ..)).expect("narrow");
    let targets = padded.input_ids().narrow(1, 1, width).expect("targets");
    let want = (token_log_probs(&logits, &targets).expect("logp") * &mask)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("whole forward's gradients");
    for (share, chunk) in [(false, 0), (true, 0), (false, 3), (true, 7)] {
        let opts = options(false, share, chunk, false);
        let (scored, _) = score_with(&model, &batch, Routing::Native, opts).expect("score");
        let got = (&scored.logp * &mask)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
            .expect("gradients");
        for (name, var) in policy.vars() {
            let w = want.get(var.as_tensor()).expect("whole gradient");
            let g = got.get(var.as_tensor()).expect("gradient");
            let diff = w
                .sub(g)
                .and_then(|d| d.abs())
                .and_then(|d| d.max_all())
                .and_then(|d| d.to_scalar::<f32>())
                .expect("difference");
            let scale = w
                .abs()
                .and_then(|d| d.max_all())
                .and_then(|d| d.to_scalar::<f32>())
                .expect("scale");
            assert!(
                diff <= 1e-5 * scale.max(1e-6),
                "{name} (share {share}, chunk {chunk}): {diff} of {scale}"
            );
        }
    }
}

#[test]
fn the_forward_refuses_logits_past_its_positions() {
    let (_dir, policy) = tiny_policy("logits-from-range");
    let model = policy.frozen_model().expect("model");
    let padded = Batch::new(batch().sequences(), 0, &policy.device()).expect("padded");
    let t = padded.seq_len();
    let err = model
        .forward_logits_from(&padded, Routing::Native, t)
        .expect_err("no positions left");
    assert!(
        err.to_string()
            .contains(&format!("logits from position {t}")),
        "{err}"
    );
    let last = model
        .forward_logits_from(&padded, Routing::Native, t - 1)
        .expect("the last position");
    assert_eq!(last.logits.dims()[1], 1);
}

/// An entropy bonus through a chunked scoring: the gradients of the log-probs' and the
/// entropies' masked sums equal those of the whole logits' (within 1e-5 relative), with and
/// without a recomputing forward; a differentiable entropy of a chunked scoring that was
/// not asked for its gradient is refused, naming the setting.
#[test]
fn a_chunked_entropy_bonus_has_the_whole_heads_gradients() {
    let (_dir, policy) = tiny_policy("response-head-entropy");
    let model = policy.model().expect("model");
    let batch = batch();
    let vars: Vec<_> = policy.vars().iter().map(|(_, v)| v.clone()).collect();
    let mask = batch.response_mask(None, &policy.device()).expect("mask");
    let grads_of = |chunk: usize, recompute: bool| -> Vec<Vec<f32>> {
        let opts = options(recompute, false, chunk, true);
        let (scored, layers) = score_with(&model, &batch, Routing::Native, opts).expect("score");
        let bonus = scored
            .entropy(true)
            .and_then(|e| Ok(e.affine(0.5, 0.0)?))
            .expect("entropy");
        let loss = (&scored.logp + bonus)
            .and_then(|l| l * &mask)
            .and_then(|l| l.sum_all())
            .expect("loss");
        let store = match layers {
            Some(layers) => layers
                .backward(loss.clone(), &vars)
                .expect("recomputed backward"),
            None => loss.backward().expect("backward"),
        };
        vars.iter()
            .map(|v| {
                store
                    .get(v.as_tensor())
                    .expect("gradient")
                    .flatten_all()
                    .and_then(|g| g.to_dtype(candle_core::DType::F32))
                    .and_then(|g| g.to_vec1::<f32>())
                    .expect("values")
            })
            .collect()
    };
    let whole = grads_of(0, false);
    for (chunk, recompute) in [(2, false), (6, true), (0, true)] {
        let got = grads_of(chunk, recompute);
        for (i, (want, got)) in whole.iter().zip(&got).enumerate() {
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
            let diff = want
                .iter()
                .zip(got)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let name = &policy.vars()[i].0;
            assert!(
                diff <= 1e-5 * scale,
                "{name} chunk {chunk} recompute {recompute}: {diff} of {scale}"
            );
        }
    }
    let opts = options(false, false, 3, false);
    let (scored, _) = score_with(&model, &batch, Routing::Native, opts).expect("score");
    let err = scored
        .entropy(true)
        .expect_err("no entropy gradient asked for");
    assert!(err.to_string().contains("algo.head_chunk_tokens"), "{err}");
    assert!(scored.entropy(false).is_ok());
}
