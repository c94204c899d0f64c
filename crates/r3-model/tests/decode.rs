//! Incremental decoding over a KV cache (`Model::forward_step`) against the full forward of
//! the same model: a prefill of part of a sequence then one token per step must give, at
//! every step, the full forward's logits of that position and the experts its `Record`
//! routing chose, on every family's tiny config (GQA with q/k norms, MLA, dense, shared
//! experts, grouped sigmoid routers). A broken step is refused, naming what is wrong.

mod common;

use candle_core::Device;
use common::{sequences, sorted_experts, tiny_model, FAMILIES};
use r3_model::model::decode::{KvCache, Step};
use r3_model::{AttentionConfig, Batch, Model, Routing};

/// Causal additive mask (within the sliding window, if any) of one sequence fed at slots
/// `first..first + time`.
fn causal(first: usize, time: usize, window: Option<usize>) -> Vec<f32> {
    let s = first + time;
    (0..time)
        .flat_map(|i| {
            let q = first + i;
            (0..s).map(move |j| {
                if j <= q && window.is_none_or(|w| q - j < w) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect()
}

/// Feeds `tokens[first..first + time]` of one sequence; its logits rows (every slot's with
/// `all_logits`, else the last) and routes.
fn feed(
    model: &Model,
    cache: &mut KvCache,
    tokens: &[u32],
    (first, time): (usize, usize),
    all_logits: bool,
) -> (Vec<f32>, Vec<Vec<u32>>) {
    let positions: Vec<u32> = (first..first + time).map(|p| p as u32).collect();
    let window = match model.config().attention {
        AttentionConfig::Gqa { sliding_window, .. } => sliding_window,
        AttentionConfig::Mla { .. } => None,
    };
    let mask = causal(first, time, window);
    let step = Step {
        tokens: &tokens[first..first + time],
        positions: &positions,
        mask: &mask,
        batch: 1,
        time,
        all_logits,
    };
    let out = model.forward_step(&step, cache).expect("step");
    let logits = out
        .logits
        .flatten_all()
        .and_then(|l| l.to_vec1::<f32>())
        .expect("logits");
    (logits, out.routes)
}

#[test]
fn prefill_then_decode_equals_the_full_forward() {
    for family in FAMILIES {
        let (cfg, model) = tiny_model(family, 11);
        let tokens = sequences(&[12], cfg.vocab_size, 2).remove(0);
        let full = model
            .forward(
                &Batch::new(std::slice::from_ref(&tokens), 0, &Device::Cpu).expect("batch"),
                match cfg.moe {
                    Some(_) => Routing::Record,
                    None => Routing::Native,
                },
            )
            .expect("forward");
        let want = full.logits.to_vec3::<f32>().expect("logits").remove(0);
        let table = full.routes.as_ref().map(|t| &t[0]);
        let k = cfg.top_k();
        let mut cache = model.kv_cache();
        let prefill = 5;
        let mut worst = 0f32;
        let mut check =
            |pos: usize, logits: &[f32], routes: &[Vec<u32>], time: usize, row: usize| {
                let diff = logits
                    .iter()
                    .zip(&want[pos])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                worst = worst.max(diff);
                assert!(
                    diff < 1e-4,
                    "{family}: position {pos} logits differ by {diff}"
                );
                if let Some(table) = table {
                    assert_eq!(routes.len(), table.num_columns(), "{family}");
                    for (c, ids) in routes.iter().enumerate() {
                        assert_eq!(ids.len(), time * k, "{family}: column {c}");
                        let mut got: Vec<u64> = ids[row * k..(row + 1) * k]
                            .iter()
                            .map(|&e| e as u64)
                            .collect();
                        got.sort_unstable();
                        assert_eq!(
                            got,
                            sorted_experts(table, pos, c),
                            "{family} pos {pos} col {c}"
                        );
                    }
                } else {
                    assert!(routes.is_empty(), "{family}: a dense model routes nothing");
                }
            };
        // The prefill returns every slot's logits; each must be the full forward's row.
        let (logits, routes) = feed(&model, &mut cache, &tokens, (0, prefill), true);
        let vocab = cfg.vocab_size;
        assert_eq!(logits.len(), prefill * vocab, "{family}: all prefill rows");
        for row in 0..prefill {
            check(
                row,
                &logits[row * vocab..(row + 1) * vocab],
                &routes,
                prefill,
                row,
            );
        }
        for pos in prefill..tokens.len() {
            let (logits, routes) = feed(&model, &mut cache, &tokens, (pos, 1), false);
            check(pos, &logits, &routes, 1, 0);
        }
        assert_eq!(cache.slots(), tokens.len());
        println!("{family}: max |step logits − full forward| = {worst:.2e}");
    }
}

#[test]
fn a_malformed_step_is_refused_naming_it() {
    let (cfg, model) = tiny_model("qwen3_moe", 1);
    let mut cache = model.kv_cache();
    let bad_token = [cfg.vocab_size as u32];
    let err = model
        .forward_step(
            &Step {
                tokens: &bad_token,
                positions: &[0],
                mask: &[0.0],
                batch: 1,
                time: 1,
                all_logits: false,
            },
            &mut cache,
        )
        .expect_err("token outside the vocabulary");
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    let err = model
        .forward_step(
            &Step {
                tokens: &[1, 2],
                positions: &[0, 1],
                mask: &[0.0],
                batch: 1,
                time: 2,
                all_logits: false,
            },
            &mut cache,
        )
        .expect_err("short mask");
    assert!(err.to_string().contains("mask values"), "{err}");
    assert_eq!(cache.slots(), 0, "a refused step caches nothing");
}
