//! Held-out evaluation with `k` samples per prompt: the requests (seeded per prompt and
//! sample, routes not captured), and the summary of the scored samples per data source —
//! `mean@k`, the unbiased `pass@k`, `maj@k` with their standard errors (r3-tasks'
//! `estimators`) — plus each prompt's fraction correct, which paired comparisons between
//! runs and checkpoints pair.
//!
//! Sample `j` of prompt `i` is seeded `mix_seed([seed, i])` for `j = 0` (the one-sample
//! evaluation's seed, so `k = 1` gives the numbers it always gave) and `mix_seed([seed, i,
//! j])` after.

use std::collections::BTreeMap;

use r3_rollout::{GenerateRequest, SamplingParams};
use r3_tasks::estimators::{
    mean_with_stderr, prompt_scores, summarise, PromptOutcome, SampleSummary, SummaryOptions,
};
use r3_tasks::RewardScore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::rl::prompt_source::PromptItem;
use crate::rl::seed::mix_seed;

/// How a held-out evaluation samples and summarises.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalSpec {
    /// Most generated tokens per sample.
    pub max_new_tokens: usize,
    /// Sampling temperature (0 = greedy).
    pub temperature: f32,
    /// Seed of the samples (and of the `maj@k` bootstrap).
    pub seed: u64,
    /// Samples per prompt (`k`).
    pub samples_per_prompt: usize,
    /// Bootstrap resamples for `maj@k`'s interval (0: none).
    pub bootstrap_resamples: usize,
}

impl EvalSpec {
    /// One sample per prompt, no bootstrap: the classic accuracy evaluation.
    pub fn single(max_new_tokens: usize, temperature: f32, seed: u64) -> Self {
        Self {
            max_new_tokens,
            temperature,
            seed,
            samples_per_prompt: 1,
            bootstrap_resamples: 0,
        }
    }
}

impl TrainConfig {
    /// The held-out evaluation of `[eval]` (`rollout.max_new_tokens` per sample).
    pub fn eval_spec(&self) -> EvalSpec {
        EvalSpec {
            max_new_tokens: self.rollout.max_new_tokens,
            temperature: self.eval.temperature as f32,
            seed: self.eval.seed,
            samples_per_prompt: self.eval.samples_per_prompt,
            bootstrap_resamples: self.eval.bootstrap_resamples,
        }
    }
}

/// One data source's part of an evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceEval {
    /// The rows' `data_source`.
    pub data_source: String,
    /// Its estimates.
    #[serde(flatten)]
    pub summary: SampleSummary,
}

/// Result of a held-out evaluation.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EvalResult {
    /// Fraction of samples answered correctly (`mean@k` over all prompts; with one sample
    /// per prompt, the accuracy).
    pub accuracy: f64,
    /// Standard error of `accuracy` over prompts.
    pub accuracy_stderr: f64,
    /// Problems evaluated.
    pub n: usize,
    /// Samples per prompt.
    pub samples_per_prompt: usize,
    /// Sampling temperature of the samples (0 = greedy): paired comparisons refuse to pair
    /// evaluations sampled at different temperatures.
    pub temperature: f64,
    /// Mean response length in tokens.
    pub response_len_mean: f64,
    /// Estimates per data source, in order of first appearance.
    pub sources: Vec<SourceEval>,
    /// Each prompt's fraction of correct samples, in eval-set order.
    pub prompt_scores: Vec<f64>,
    /// sha256 of the eval prompts and their answers: two evaluations pair only when equal.
    pub prompts_digest: String,
}

/// The `spec.samples_per_prompt` requests of every prompt (prompt-major), stopping at
/// `stop`, seeded as the module doc says; routes are not captured.
pub fn eval_requests(items: &[PromptItem], spec: &EvalSpec, stop: &[u32]) -> Vec<GenerateRequest> {
    let k = spec.samples_per_prompt;
    let mut requests = Vec::with_capacity(items.len() * k);
    for (i, item) in items.iter().enumerate() {
        for j in 0..k {
            let seed = if j == 0 {
                mix_seed(&[spec.seed, i as u64])
            } else {
                mix_seed(&[spec.seed, i as u64, j as u64])
            };
            let sampling = SamplingParams {
                temperature: spec.temperature,
                max_new_tokens: spec.max_new_tokens,
                stop_token_ids: stop.to_vec(),
                seed,
                ..SamplingParams::default()
            };
            let mut req = GenerateRequest::new(item.ids.clone(), sampling);
            req.return_routes = false;
            requests.push(req);
        }
    }
    requests
}

/// The f32 sampling temperature as the f64 it was written as (`0.7`, not the widened
/// `0.699999988079071`): the shortest decimal that reads back as the same f32.
fn temperature_f64(t: f32) -> f64 {
    t.to_string().parse().unwrap_or(f64::from(t))
}

/// sha256 (hex) of the eval prompts' texts and ground truths, in order. A ground truth
/// counts as its text (a string as it is, anything else as JSON writes it), so a dataset of
/// string or number truths keeps the digest it had when r3 held truths as text.
pub fn prompts_digest(items: &[PromptItem]) -> String {
    let mut h = Sha256::new();
    for item in items {
        let truth = match &item.ground_truth {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        for part in [&item.text, &truth] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Summarises the scored samples of an evaluation: `scores[n]` and `votes[n]` (the answer
/// sample `n` votes for; `None`: the reward extracts none) belong to sample `n %
/// samples_per_prompt` of prompt `n / samples_per_prompt`; `tokens` is the total generated.
pub fn summarise_eval(
    items: &[PromptItem],
    scores: &[RewardScore],
    votes: Option<Vec<Option<String>>>,
    tokens: usize,
    spec: &EvalSpec,
) -> Result<EvalResult> {
    let k = spec.samples_per_prompt;
    if items.is_empty() || k == 0 {
        return Err(TrainError::EmptyEvalSet);
    }
    if scores.len() != items.len() * k {
        return Err(TrainError::EngineResults {
            got: scores.len(),
            expected: items.len() * k,
        });
    }
    let mut votes = votes.map(|v| v.into_iter());
    let outcomes: Vec<PromptOutcome> = scores
        .chunks(k)
        .map(|chunk| PromptOutcome {
            correct: chunk.iter().map(|s| s.correct).collect(),
            answers: votes.as_mut().map(|v| v.by_ref().take(k).collect()),
        })
        .collect();
    let options = SummaryOptions {
        bootstrap_resamples: spec.bootstrap_resamples,
        bootstrap_seed: spec.seed,
    };
    // Data sources in order of first appearance, each with its prompts' outcomes.
    let mut order: Vec<&str> = Vec::new();
    let mut by_source: BTreeMap<&str, Vec<PromptOutcome>> = BTreeMap::new();
    for (item, outcome) in items.iter().zip(&outcomes) {
        let source = item.data_source.as_str();
        if !by_source.contains_key(source) {
            order.push(source);
        }
        by_source.entry(source).or_default().push(outcome.clone());
    }
    let sources = order
        .into_iter()
        .filter_map(|source| {
            let summary = summarise(&by_source[source], options)?;
            Some(SourceEval {
                data_source: source.to_string(),
                summary,
            })
        })
        .collect();
    let per_prompt = prompt_scores(&outcomes);
    let overall = mean_with_stderr(&per_prompt).ok_or(TrainError::EmptyEvalSet)?;
    Ok(EvalResult {
        accuracy: overall.value,
        accuracy_stderr: overall.stderr,
        n: items.len(),
        samples_per_prompt: k,
        temperature: temperature_f64(spec.temperature),
        response_len_mean: tokens as f64 / (items.len() * k) as f64,
        sources,
        prompt_scores: per_prompt,
        prompts_digest: prompts_digest(items),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn item(text: &str, source: &str) -> PromptItem {
        PromptItem {
            text: text.into(),
            ids: vec![1, 2],
            ground_truth: Value::String("1".into()),
            data_source: source.into(),
            extra_info: Value::Null,
        }
    }

    fn score(correct: bool) -> RewardScore {
        RewardScore {
            reward: f32::from(u8::from(correct)),
            correct,
        }
    }

    #[test]
    fn requests_are_prompt_major_and_k1_keeps_the_old_seeds() {
        let items = [item("a", "x"), item("b", "x")];
        let spec = EvalSpec {
            samples_per_prompt: 3,
            ..EvalSpec::single(5, 1.0, 9)
        };
        let r = eval_requests(&items, &spec, &[0]);
        assert_eq!(r.len(), 6);
        assert_eq!(r[0].sampling.seed, mix_seed(&[9, 0]));
        assert_eq!(r[3].sampling.seed, mix_seed(&[9, 1]));
        assert_eq!(r[4].sampling.seed, mix_seed(&[9, 1, 1]));
        let mut seeds: Vec<u64> = r.iter().map(|q| q.sampling.seed).collect();
        seeds.sort_unstable();
        seeds.dedup();
        assert_eq!(seeds.len(), 6, "every sample has its own seed");
        assert!(r.iter().all(|q| !q.return_routes));
    }

    #[test]
    fn summary_splits_sources_and_keeps_prompt_scores() {
        let items = [item("a", "x"), item("b", "y"), item("c", "x")];
        let spec = EvalSpec {
            samples_per_prompt: 2,
            ..EvalSpec::single(5, 1.0, 0)
        };
        let s: Vec<RewardScore> = [true, true, false, true, false, false]
            .into_iter()
            .map(score)
            .collect();
        let votes: Vec<Option<String>> = ["1", "1", "2", "1", "3", ""]
            .iter()
            .map(|v| (!v.is_empty()).then(|| v.to_string()))
            .collect();
        let r = summarise_eval(&items, &s, Some(votes), 60, &spec).unwrap();
        assert_eq!(r.prompt_scores, vec![1.0, 0.5, 0.0]);
        assert_eq!(r.temperature, 1.0);
        assert_eq!(temperature_f64(0.7), 0.7);
        assert!((r.accuracy - 0.5).abs() < 1e-15);
        assert_eq!(r.response_len_mean, 10.0);
        let names: Vec<&str> = r.sources.iter().map(|s| s.data_source.as_str()).collect();
        assert_eq!(names, vec!["x", "y"]);
        let x = &r.sources[0].summary;
        assert_eq!(x.prompts, 2);
        assert!((x.mean_at_k.value - 0.5).abs() < 1e-15);
        // y: votes 2 (wrong) and 1 (right) tie; the first seen (2) wins: maj wrong.
        let y = r.sources[1].summary.maj_at_k.unwrap();
        assert_eq!(y.estimate.value, 0.0);
        assert_ne!(prompts_digest(&items), prompts_digest(&items[..2]));
        assert!(summarise_eval(&items, &s[..5], None, 0, &spec).is_err());
    }

    /// A ground truth hashes as its text: a string truth (and a number, as JSON writes it)
    /// gives the digest r3 wrote when it held truths as text. Expected values from python3:
    /// `hashlib.sha256(struct.pack('<Q', 1) + b'a' + struct.pack('<Q', len(t)) + t)`.
    #[test]
    fn a_ground_truth_hashes_as_its_text() {
        let mut one = item("a", "x");
        let want = "9fe2af4305790bd0709766d7e53ab693ea9925630833d3c465e6b5d7f517c36f";
        assert_eq!(prompts_digest(std::slice::from_ref(&one)), want);
        one.ground_truth = serde_json::json!(1);
        assert_eq!(prompts_digest(std::slice::from_ref(&one)), want);
        one.ground_truth = serde_json::json!({"target": ["a"]});
        assert_eq!(
            prompts_digest(&[one]),
            "98a8735d6ca50eb50bc58f6ab54839526ab2c17c1ab49ad80950ebb50bce9425"
        );
    }
}
