//! Output log-probs under `SamplingParams::logprob_scale` against hand-computed truth: the
//! logits of the generated sequence through the engine's own model (one full forward), taken
//! in f64 as `log softmax(l / T)[token]` (`LogprobScale::Sampling`, SGLang's default for a
//! sampled request) or `log softmax(l)[token]` (`LogprobScale::Raw`, SGLang's
//! `SGLANG_RETURN_ORIGINAL_LOGPROB`; and every greedy request), `l` the logits after the
//! request's logit bias (SGLang adds it before dividing by the temperature). The CPU engine
//! and the device engine (candle's CPU in a default build) both, at temperature 0.7 over the
//! whole vocabulary (the device draws those rows itself) and truncated by top-p, with top
//! log-probs, and against each other.

mod common;

use common::{engine, full_forward, max_abs_diff, model_dir, DEVICE, MODELS};
use r3_model::Config;
use r3_rollout::model::InferenceModel;
use r3_rollout::{
    load_dir, DeviceEngine, DeviceEngineConfig, Dtype, GenerateRequest, GenerateResult,
    LogprobScale, SamplingParams,
};
use r3_test_support::exact_logprob;

/// The sampling temperature of these tests.
const T: f32 = 0.7;

/// How far an engine's reported log-prob may be from the f64 truth of the same model's full
/// forward (f32 throughout: batched decode against one full sequence).
const TRUTH_TOL: f64 = if cfg!(feature = "cuda") { 2e-3 } else { 2e-4 };

/// The prompt of request `i`.
fn prompt(i: u32) -> Vec<u32> {
    (0..11u32)
        .map(|p| (p * 37 + i * 53 + 5) % 240 + 3)
        .collect()
}

/// The token the biased requests favour.
const BIASED: u32 = 17;

/// The requests every test runs under `scale`: temperature 0.7 over the whole vocabulary,
/// the same with top log-probs, truncated by top-p, with a logit bias, and greedy.
fn requests(scale: LogprobScale) -> Vec<GenerateRequest> {
    let sampled = |i: u32| SamplingParams {
        temperature: T,
        max_new_tokens: 6,
        seed: 100 + u64::from(i),
        logprob_scale: scale,
        ..SamplingParams::default()
    };
    let variants = [
        sampled(0),
        SamplingParams {
            top_logprobs: 4,
            ..sampled(1)
        },
        SamplingParams {
            top_p: 0.9,
            ..sampled(2)
        },
        SamplingParams {
            logit_bias: vec![(BIASED, 1.5)],
            top_logprobs: 2,
            ..sampled(3)
        },
        SamplingParams {
            top_logprobs: 3,
            logprob_scale: scale,
            ..SamplingParams::greedy(6)
        },
    ];
    variants
        .into_iter()
        .enumerate()
        .map(|(i, s)| GenerateRequest::new(prompt(i as u32), s))
        .collect()
}

/// Per output token of `r`, the logit row that scored it (the engine's own model, one full
/// forward of prompt and output), with the request's logit bias added.
fn scoring_rows(name: &str, req: &GenerateRequest, r: &GenerateResult) -> Vec<Vec<f32>> {
    let dir = model_dir(name);
    let cfg = Config::from_file(&dir.join("config.json")).expect("config");
    let vocab = cfg.vocab_size;
    let tensors = load_dir(&dir, &cfg).expect("tensors");
    let mut model = InferenceModel::new(cfg, &tensors, Dtype::F32).expect("model");
    let mut seq = req.input_ids.clone();
    seq.extend(&r.output_ids);
    let (logits, _) = full_forward(&mut model, &seq[..seq.len() - 1]);
    let first = req.input_ids.len() - 1;
    (0..r.output_ids.len())
        .map(|i| {
            let mut row = logits[(first + i) * vocab..(first + i + 1) * vocab].to_vec();
            for &(t, b) in &req.sampling.logit_bias {
                row[t as usize] += b;
            }
            row
        })
        .collect()
}

/// `log softmax(row · inv_t)[token]` in f64.
fn exact(row: &[f32], inv_t: f64, token: u32) -> f64 {
    exact_logprob(row, inv_t, token as usize)
}

/// The `1 / T'` the request's log-probs must be at: `1 / T` for a sampled request under
/// `Sampling`, 1 under `Raw` or when greedy.
fn expected_inv_t(req: &GenerateRequest) -> f64 {
    let s = &req.sampling;
    if s.temperature > 0.0 && s.logprob_scale == LogprobScale::Sampling {
        f64::from(1.0 / s.temperature)
    } else {
        1.0
    }
}

/// Checks every output log-prob and top log-prob of `results` against the truth; returns how
/// many sampled positions' tempered and raw truths are more than 0.01 apart (so that the
/// check tells the two distributions apart).
fn check_against_truth(
    what: &str,
    name: &str,
    reqs: &[GenerateRequest],
    results: &[GenerateResult],
) -> usize {
    let mut apart = 0;
    for (i, (req, r)) in reqs.iter().zip(results).enumerate() {
        let inv_t = expected_inv_t(req);
        let rows = scoring_rows(name, req, r);
        assert_eq!(r.output_logprobs.len(), r.output_ids.len(), "{what} {i}");
        for (p, ((&tok, &lp), row)) in r
            .output_ids
            .iter()
            .zip(&r.output_logprobs)
            .zip(&rows)
            .enumerate()
        {
            let want = exact(row, inv_t, tok);
            assert!(
                (f64::from(lp) - want).abs() <= TRUTH_TOL,
                "{what}, {name} request {i} position {p}: log-prob {lp} against {want} \
                 (1/T' = {inv_t})"
            );
            if req.sampling.temperature > 0.0 {
                let (scaled, raw) = (
                    exact(row, f64::from(1.0 / req.sampling.temperature), tok),
                    exact(row, 1.0, tok),
                );
                apart += usize::from((scaled - raw).abs() > 0.01);
            }
        }
        if req.sampling.top_logprobs > 0 {
            assert_eq!(
                r.output_top_logprobs.len(),
                r.output_ids.len(),
                "{what} {i}"
            );
            for (p, (top, row)) in r.output_top_logprobs.iter().zip(&rows).enumerate() {
                assert_eq!(top.len(), req.sampling.top_logprobs, "{what} {i}");
                let mut order: Vec<usize> = (0..row.len()).collect();
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                for (k, &(id, v)) in top.iter().enumerate() {
                    assert_eq!(id as usize, order[k], "{what} {i} position {p} rank {k}");
                    let want = exact(row, inv_t, id);
                    assert!(
                        (f64::from(v) - want).abs() <= TRUTH_TOL,
                        "{what}, {name} request {i} position {p}: top log-prob {v} of {id} \
                         against {want}"
                    );
                }
            }
        } else {
            assert!(r.output_top_logprobs.is_empty(), "{what} {i}");
        }
    }
    apart
}

/// The CPU engine reports `log softmax(l / T)` by default and `log softmax(l)` under `Raw`
/// (greedy requests at temperature 1 under both), tokens the same under both scales.
#[test]
fn cpu_engine_reports_the_distribution_the_scale_names() {
    for name in MODELS {
        let mut by_scale = Vec::new();
        for scale in [LogprobScale::Sampling, LogprobScale::Raw] {
            let reqs = requests(scale);
            let results = engine(name, Dtype::F32, false)
                .generate(reqs.clone())
                .expect("generate");
            let apart = check_against_truth(&format!("cpu {scale:?}"), name, &reqs, &results);
            assert!(
                apart >= 8,
                "{name}: only {apart} positions tell T apart from 1"
            );
            by_scale.push(results);
        }
        for (i, (a, b)) in by_scale[0].iter().zip(&by_scale[1]).enumerate() {
            assert_eq!(
                a.output_ids, b.output_ids,
                "{name} request {i}: tokens moved"
            );
        }
        // Greedy (request 4) is the same distribution under both scales.
        assert_eq!(
            by_scale[0][4].output_logprobs,
            by_scale[1][4].output_logprobs
        );
    }
}

/// The device engine (candle's CPU here) reports the same log-probs as the CPU engine under
/// both scales (rows drawn on the device and rows the host samples alike), and the truth.
#[test]
fn device_engine_agrees_with_the_cpu_engine_under_both_scales() {
    let tol = if cfg!(feature = "cuda") { 1e-3 } else { 1e-4 };
    for name in MODELS {
        for scale in [LogprobScale::Sampling, LogprobScale::Raw] {
            let reqs = requests(scale);
            let want = engine(name, Dtype::F32, false)
                .generate(reqs.clone())
                .expect("cpu generate");
            let config = DeviceEngineConfig {
                device: DEVICE,
                prefix_cache: false,
                ..DeviceEngineConfig::default()
            };
            let got = DeviceEngine::from_dir(&model_dir(name), config)
                .expect("device engine")
                .generate(reqs.clone())
                .expect("device generate");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let what = format!("{name} {scale:?} request {i}");
                assert_eq!(g.output_ids, w.output_ids, "{what}: tokens");
                let d = max_abs_diff(&g.output_logprobs, &w.output_logprobs);
                assert!(d <= tol, "{what}: log-probs differ by {d}");
                for (a, b) in g.output_top_logprobs.iter().zip(&w.output_top_logprobs) {
                    let ids = |t: &[(u32, f32)]| t.iter().map(|p| p.0).collect::<Vec<_>>();
                    assert_eq!(ids(a), ids(b), "{what}: top ids");
                    for (x, y) in a.iter().zip(b) {
                        assert!((x.1 - y.1).abs() <= tol, "{what}: top {} vs {}", x.1, y.1);
                    }
                }
            }
            check_against_truth(&format!("device {scale:?}"), name, &reqs, &got);
        }
    }
}
