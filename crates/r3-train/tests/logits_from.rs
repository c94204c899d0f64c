//! The policy's scoring runs the head from the first response prediction on (TRL's
//! `logits_to_keep`): its log-probs and entropies at every response position are, bit for
//! bit, the ones a forward over all positions gives, and nothing before that position is
//! read.

mod common;

use candle_core::{IndexOp, Tensor};
use common::{tiny_model, Scratch};
use r3_model::{Batch, Routing};
use r3_train::policy::{score, ResponseBatch, TrainablePolicy};
use r3_train::{entropy_from_logits, token_log_probs};

/// Rows with prompts of 4, 6, 3 and 5 tokens: the head starts at column 2 (the prediction
/// of the shortest prompt's first response token).
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

#[test]
fn response_log_probs_and_entropy_equal_the_whole_forwards() {
    let (_dir, policy) = tiny_policy("logits-from");
    let model = policy.frozen_model().expect("model");
    let batch = batch();
    let device = policy.device();
    for routing in [Routing::Native, Routing::Record] {
        let scored = score(&model, &batch, routing).expect("score");
        assert_eq!(
            scored.logits_from, 2,
            "the shortest prompt (3) predicts from column 2"
        );
        let width = batch.width();
        assert_eq!(scored.logp.dims(), [batch.len(), width]);
        assert_eq!(scored.logits.dims()[1], width - 2);

        // The whole forward, every position through the head.
        let padded = Batch::new(batch.sequences(), 0, &device).expect("padded");
        let whole = model.forward(&padded, Routing::Native).expect("forward");
        assert_eq!(whole.logits_from, 0);
        let logits = whole.logits.i((.., ..width, ..)).expect("narrow");
        let targets = padded.input_ids().narrow(1, 1, width).expect("targets");
        let want_logp = rows(&token_log_probs(&logits, &targets).expect("logp"));
        let want_ent = rows(&entropy_from_logits(&logits).expect("entropy"));

        let got_logp = rows(&scored.logp);
        let got_ent = rows(&scored.entropy(false).expect("entropy"));
        let mask = rows(&batch.response_mask(None, &device).expect("mask"));
        let mut compared = 0;
        for (i, m) in mask.iter().enumerate() {
            for (j, &inside) in m.iter().enumerate() {
                if j < 2 {
                    // Never computed: zeros, outside every response.
                    assert_eq!((got_logp[i][j], got_ent[i][j], inside), (0.0, 0.0, 0.0));
                }
                if inside == 0.0 {
                    continue;
                }
                // Each row is normed and projected alone, its products added in the same
                // order whatever the GEMM's height: the same bits.
                let (a, b) = (got_logp[i][j], want_logp[i][j]);
                assert!(a.to_bits() == b.to_bits(), "logp {i},{j}: {a} vs {b}");
                let (a, b) = (got_ent[i][j], want_ent[i][j]);
                assert!(a.to_bits() == b.to_bits(), "entropy {i},{j}: {a} vs {b}");
                compared += 1;
            }
        }
        let responses: usize = (0..batch.len()).map(|i| batch.response_len(i)).sum();
        assert_eq!(compared, responses, "every response token compared");
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
