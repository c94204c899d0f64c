//! Prompt log-probs (`SamplingParams::prompt_logprobs_from`, SGLang `input_token_logprobs`)
//! against independent truth: the training forward (r3-model, f32) of the same sequence, the
//! output log-probs of a teacher-forced sequence, chunked prefill, a prefix cache that would
//! hit, and `Engine::retract_all` (re-prefill) leaving generation unchanged.

mod common;

use candle_core::Device;
use common::{engine, model_dir, MODELS};
use r3_model::{Batch, Config, Model, Routing, Weights};
use r3_rollout::{Dtype, Engine, EngineConfig, GenerateRequest, GenerateResult, SamplingParams};

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 41 + seed * 97 + 7) % 250 + 3)
        .collect()
}

fn asking(input: Vec<u32>, from: usize, top: usize, max_new: usize) -> GenerateRequest {
    let sampling = SamplingParams {
        temperature: 0.8,
        seed: 5,
        max_new_tokens: max_new,
        top_logprobs: top,
        prompt_logprobs_from: Some(from),
        ..Default::default()
    };
    GenerateRequest::new(input, sampling)
}

fn run(e: &mut Engine, req: GenerateRequest) -> GenerateResult {
    e.generate(vec![req]).expect("engine generates").remove(0)
}

/// `log softmax(logits[p])` of every position of `tokens` by the training forward, in f64.
fn training_log_softmax(name: &str, tokens: &[u32]) -> Vec<Vec<f64>> {
    let dir = model_dir(name);
    let cfg = Config::from_file(&dir.join("config.json")).expect("config");
    let weights = Weights::load(&dir, &cfg, &Device::Cpu).expect("weights");
    let model = Model::new(&cfg, &weights).expect("model");
    let batch = Batch::new(&[tokens.to_vec()], 0, &Device::Cpu).expect("batch");
    let out = model.forward(&batch, Routing::Native).expect("forward");
    let logits: Vec<Vec<Vec<f32>>> = out.logits.to_vec3().expect("logits to host");
    logits[0][..tokens.len()]
        .iter()
        .map(|row| {
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            row.iter().map(|&v| v as f64 - lse).collect()
        })
        .collect()
}

/// Largest |engine − training| over the reported prompt positions, after checking the
/// shape and the top alternatives.
fn max_diff_to_training(name: &str, dtype: Dtype, from: usize) -> f64 {
    let input = prompt(2, 23);
    let truth = training_log_softmax(name, &input);
    let mut e = engine(name, dtype, false);
    let r = run(&mut e, asking(input.clone(), from, 3, 4));
    let p = r.prompt_logprobs.expect("prompt log-probs returned");
    assert_eq!(p.start, from, "{name}");
    assert_eq!(p.logprobs.len(), input.len() - from - 1, "{name}");
    assert_eq!(p.top_logprobs.len(), p.logprobs.len(), "{name}");
    let mut worst = 0f64;
    for (i, &lp) in p.logprobs.iter().enumerate() {
        let pos = from + i; // the row at `pos` scores token `pos + 1`
        let want = truth[pos][input[pos + 1] as usize];
        worst = worst.max((lp as f64 - want).abs());
        // The alternatives are the largest entries of the same distribution, best first.
        let top = &p.top_logprobs[i];
        assert_eq!(top.len(), 3, "{name}");
        let mut sorted: Vec<f64> = truth[pos].clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        for (k, &(id, v)) in top.iter().enumerate() {
            assert!((v as f64 - truth[pos][id as usize]).abs() < 0.05, "{name}");
            assert!((v as f64 - sorted[k]).abs() < 0.05, "{name}: rank {k}");
        }
    }
    worst
}

#[test]
fn prompt_logprobs_equal_the_training_forward() {
    for name in MODELS {
        for from in [0, 7] {
            let f32_diff = max_diff_to_training(name, Dtype::F32, from);
            let f16_diff = max_diff_to_training(name, Dtype::F16, from);
            println!("{name} from {from}: max |lp − train| f32 {f32_diff:.2e}, f16 {f16_diff:.2e}");
            assert!(f32_diff < 1e-3, "{name}: f32 {f32_diff}");
            // f16 matmuls: the same tolerance class as the f16 output log-probs.
            assert!(f16_diff < 5e-2, "{name}: f16 {f16_diff}");
        }
    }
}

#[test]
fn prompt_logprobs_equal_output_logprobs_of_the_teacher_forced_sequence() {
    for name in MODELS {
        let mut e = engine(name, Dtype::F32, false);
        let input = prompt(4, 13);
        let sampling = SamplingParams {
            temperature: 1.0,
            seed: 11,
            max_new_tokens: 9,
            ..Default::default()
        };
        let gen = run(&mut e, GenerateRequest::new(input.clone(), sampling));
        let mut forced = input.clone();
        forced.extend(&gen.output_ids);
        let r = run(&mut e, asking(forced, input.len() - 1, 0, 1));
        let p = r.prompt_logprobs.expect("prompt log-probs");
        assert_eq!(p.start, input.len() - 1);
        assert!(p.top_logprobs.is_empty(), "no alternatives asked for");
        assert_eq!(p.logprobs.len(), gen.output_logprobs.len(), "{name}");
        for (x, y) in p.logprobs.iter().zip(&gen.output_logprobs) {
            assert!((x - y).abs() < 1e-4, "{name}: prompt {x} vs output {y}");
        }
    }
}

#[test]
fn chunked_prefill_and_batching_give_the_same_prompt_logprobs() {
    let name = MODELS[0];
    let input = prompt(6, 37);
    let mut whole = engine(name, Dtype::F32, false);
    let want = run(&mut whole, asking(input.clone(), 3, 2, 3));
    let cfg = EngineConfig {
        dtype: Dtype::F32,
        prefix_cache: false,
        kv_cache_bytes: 64 << 20,
        max_batch_tokens: 8,
        ..EngineConfig::default()
    };
    let mut chunked = Engine::from_dir(&model_dir(name), cfg).expect("engine");
    // A request without prompt log-probs in the same batch.
    let other = GenerateRequest::new(prompt(1, 19), SamplingParams::greedy(4));
    let got = chunked
        .generate(vec![other, asking(input, 3, 2, 3)])
        .expect("generate")
        .remove(1);
    assert!(got.prompt_logprobs.is_some());
    let (a, b) = (
        want.prompt_logprobs.expect("whole"),
        got.prompt_logprobs.expect("chunked"),
    );
    assert_eq!(a.logprobs.len(), b.logprobs.len());
    for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
        assert!((x - y).abs() < 1e-4, "{x} vs {y}");
    }
    for (x, y) in a.top_logprobs.iter().zip(&b.top_logprobs) {
        assert_eq!(
            x.iter().map(|t| t.0).collect::<Vec<_>>(),
            y.iter().map(|t| t.0).collect::<Vec<_>>()
        );
    }
    assert_eq!(want.output_ids, got.output_ids);
}

#[test]
fn a_prefix_cache_hit_still_returns_every_prompt_logprob() {
    for name in MODELS {
        let input = prompt(8, 40);
        let mut warm = engine(name, Dtype::F32, true);
        // Fills the cache with the first 32 positions of `input`.
        let first = run(
            &mut warm,
            GenerateRequest::new(input.clone(), SamplingParams::greedy(2)),
        );
        assert_eq!(first.cached_tokens, 0);
        let r = run(&mut warm, asking(input.clone(), 0, 0, 2));
        assert_eq!(
            r.cached_tokens, 0,
            "{name}: prompt log-probs recompute the prompt"
        );
        let mut cold = engine(name, Dtype::F32, false);
        let want = run(&mut cold, asking(input.clone(), 0, 0, 2));
        let (a, b) = (
            r.prompt_logprobs.expect("warm"),
            want.prompt_logprobs.expect("cold"),
        );
        assert_eq!(a.logprobs.len(), input.len() - 1);
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-4, "{name}");
        }
        // The same prompt without prompt log-probs does hit the cache.
        let hit = run(
            &mut warm,
            GenerateRequest::new(input, SamplingParams::greedy(2)),
        );
        assert!(
            hit.cached_tokens > 0,
            "{name}: the cache would have served it"
        );
    }
}

#[test]
fn retracted_requests_are_re_prefilled_and_finish_unchanged() {
    for name in MODELS {
        let reqs: Vec<GenerateRequest> = (0..3u32)
            .map(|i| {
                let sampling = SamplingParams {
                    temperature: 1.0,
                    seed: u64::from(i) + 20,
                    max_new_tokens: 12,
                    ..Default::default()
                };
                GenerateRequest::new(prompt(i + 10, 9 + 4 * i as usize), sampling)
            })
            .collect();
        let mut plain = engine(name, Dtype::F32, false);
        let want = plain.generate(reqs.clone()).expect("plain");
        let mut e = engine(name, Dtype::F32, false);
        let ids: Vec<_> = reqs
            .into_iter()
            .map(|r| e.submit(r).expect("submit"))
            .collect();
        for _ in 0..4 {
            assert!(e.step().expect("step").is_empty());
        }
        assert_eq!(e.queue_lengths(), (0, 3));
        let made: Vec<usize> = ids
            .iter()
            .map(|&id| e.generated_tokens(id).expect("in flight").len())
            .collect();
        assert_eq!(e.retract_all(), 3, "{name}");
        assert_eq!(e.queue_lengths(), (3, 0), "{name}: all back in the queue");
        // Their tokens so far survive the retraction.
        for (&id, &n) in ids.iter().zip(&made) {
            assert_eq!(e.generated_tokens(id).expect("queued").len(), n);
        }
        let mut done = Vec::new();
        while e.has_work() {
            done.extend(e.step().expect("step"));
        }
        done.sort_by_key(|r| r.id);
        for (got, want) in done.iter().zip(&want) {
            assert_eq!(got.output_ids, want.output_ids, "{name}");
            for (x, y) in got.output_logprobs.iter().zip(&want.output_logprobs) {
                assert!((x - y).abs() < 1e-4, "{name}");
            }
            assert_eq!(got.routes, want.routes, "{name}");
        }
    }
}
