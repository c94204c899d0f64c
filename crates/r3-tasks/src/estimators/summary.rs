//! The summary of one data source's evaluation with `k` samples per prompt: `mean@k` (the
//! mean correctness, equal to pass@1), the unbiased `pass@k` at k = 1, 2, 4, … and k, and
//! `maj@k` (majority vote of extracted answers), each with its uncertainty over prompts: a
//! standard error and a 95% interval computed from the source's own prompts (Wilson's where
//! every per-prompt score is 0 or 1, else Student's t clipped to [0, 1]; `interval`).

use serde::{Deserialize, Serialize};

use crate::estimators::bootstrap::{bootstrap_interval, BootstrapInterval};
use crate::estimators::interval::{score_interval, Interval};
use crate::estimators::majority::majority_correct;
use crate::estimators::pass_at_k::pass_at_k;
use crate::estimators::{mean_with_stderr, Estimate};

/// The samples of one prompt: whether each was correct, and each one's extracted answer
/// (the vote key) when the reward extracts answers.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptOutcome {
    /// Correctness of each sample, in sample order.
    pub correct: Vec<bool>,
    /// Each sample's extracted answer (`None` inside: nothing extracted); `None` when the
    /// reward has no answer to vote on (an external verifier).
    pub answers: Option<Vec<Option<String>>>,
}

/// `pass@k` at one `k`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PassAt {
    /// Samples drawn.
    pub k: usize,
    /// Mean over prompts of the unbiased estimator, with its standard error over prompts.
    pub estimate: Estimate,
    /// Its 95% interval over this source's prompts (none under two prompts, and in lines
    /// written before intervals were recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<Interval>,
}

/// What to compute besides the means.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SummaryOptions {
    /// Bootstrap resamples over prompts for `maj@k`'s percentile bootstrap (0: none); kept
    /// beside its Wilson interval, which is the one reported.
    pub bootstrap_resamples: usize,
    /// Seed of the bootstrap.
    pub bootstrap_seed: u64,
}

/// One data source's evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleSummary {
    /// Prompts evaluated.
    pub prompts: usize,
    /// Samples per prompt (`k`; the smallest count when prompts differ).
    pub samples_per_prompt: usize,
    /// `mean@k`: the mean over prompts of each prompt's fraction correct, with its standard
    /// error over prompts.
    pub mean_at_k: Estimate,
    /// `mean@k`'s 95% interval over this source's prompts (Wilson's with one sample per
    /// prompt); none under two prompts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_interval: Option<Interval>,
    /// The unbiased `pass@k` at k = 1, 2, 4, … up to and including `samples_per_prompt`.
    pub pass_at_k: Vec<PassAt>,
    /// `maj@k`: the fraction of prompts whose majority answer is correct, with its standard
    /// error over prompts and its Wilson interval; absent when the reward extracts no answers.
    pub maj_at_k: Option<MajorityEstimate>,
}

/// `maj@k` with its spreads.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MajorityEstimate {
    /// Fraction of prompts whose majority answer is correct, standard error over prompts.
    pub estimate: Estimate,
    /// Wilson's 95% interval of that fraction (each prompt 0 or 1): the reported interval.
    /// None under two prompts, and in lines written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<Interval>,
    /// The seeded percentile bootstrap over prompts (absent with 0 resamples): kept for
    /// readers of older lines; it under-covers near 0 and 1 and at small n, so it is not the
    /// interval r3 reports.
    pub bootstrap: Option<BootstrapInterval>,
}

/// Each prompt's fraction of correct samples (its `mean@k` score): what paired comparisons
/// pair.
pub fn prompt_scores(outcomes: &[PromptOutcome]) -> Vec<f64> {
    outcomes
        .iter()
        .map(|o| {
            if o.correct.is_empty() {
                0.0
            } else {
                o.correct.iter().filter(|&&c| c).count() as f64 / o.correct.len() as f64
            }
        })
        .collect()
}

/// The k values pass@k is reported at: powers of two below `n`, and `n`.
pub fn pass_ks(n: usize) -> Vec<usize> {
    let mut ks: Vec<usize> = std::iter::successors(Some(1usize), |k| k.checked_mul(2))
        .take_while(|&k| k < n)
        .collect();
    if n > 0 {
        ks.push(n);
    }
    ks
}

/// Summarises the outcomes of one data source; `None` when there are no prompts or a prompt
/// has no samples.
pub fn summarise(outcomes: &[PromptOutcome], options: SummaryOptions) -> Option<SampleSummary> {
    let n = outcomes.iter().map(|o| o.correct.len()).min()?;
    if n == 0 {
        return None;
    }
    let scores = prompt_scores(outcomes);
    let mean_at_k = mean_with_stderr(&scores)?;
    let pass_at_k = pass_ks(n)
        .into_iter()
        .map(|k| {
            let per_prompt: Vec<f64> = outcomes
                .iter()
                .filter_map(|o| {
                    let c = o.correct.iter().filter(|&&c| c).count();
                    pass_at_k(o.correct.len(), c, k)
                })
                .collect();
            mean_with_stderr(&per_prompt).map(|estimate| PassAt {
                k,
                estimate,
                interval: score_interval(&per_prompt),
            })
        })
        .collect::<Option<Vec<_>>>()?;
    let maj_at_k = majority_scores(outcomes).and_then(|maj| {
        let estimate = mean_with_stderr(&maj)?;
        let bootstrap = bootstrap_interval(
            maj.len(),
            options.bootstrap_resamples,
            options.bootstrap_seed,
            |idx| idx.iter().map(|&i| maj[i]).sum::<f64>() / idx.len() as f64,
        );
        Some(MajorityEstimate {
            estimate,
            interval: score_interval(&maj),
            bootstrap,
        })
    });
    Some(SampleSummary {
        prompts: outcomes.len(),
        samples_per_prompt: n,
        mean_at_k,
        mean_interval: score_interval(&scores),
        pass_at_k,
        maj_at_k,
    })
}

/// 1 or 0 per prompt: whether its majority answer is correct; `None` when any prompt has no
/// answers to vote on.
fn majority_scores(outcomes: &[PromptOutcome]) -> Option<Vec<f64>> {
    outcomes
        .iter()
        .map(|o| {
            let answers = o.answers.as_ref()?;
            Some(f64::from(u8::from(majority_correct(answers, &o.correct))))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimators::interval::{wilson_interval, IntervalMethod};

    fn outcome(correct: &[u8], answers: &[&str]) -> PromptOutcome {
        PromptOutcome {
            correct: correct.iter().map(|&c| c == 1).collect(),
            answers: Some(
                answers
                    .iter()
                    .map(|a| (!a.is_empty()).then(|| a.to_string()))
                    .collect(),
            ),
        }
    }

    #[test]
    fn hand_computed_summary() {
        // Three prompts, 4 samples each (truths 5, 2, 9).
        let o = vec![
            outcome(&[1, 0, 1, 1], &["5", "4", "5", "5"]), // 3/4, maj 5 correct
            outcome(&[0, 0, 1, 0], &["3", "3", "2", ""]),  // 1/4, maj 3 wrong
            outcome(&[0, 0, 0, 0], &["1", "", "7", ""]),   // 0/4, "no answer" twice wins, wrong
        ];
        let opts = SummaryOptions {
            bootstrap_resamples: 200,
            bootstrap_seed: 0,
        };
        let s = summarise(&o, opts).unwrap();
        assert_eq!((s.prompts, s.samples_per_prompt), (3, 4));
        // mean@4 = (0.75 + 0.25 + 0) / 3 = 1/3
        assert!((s.mean_at_k.value - 1.0 / 3.0).abs() < 1e-15);
        let ks: Vec<usize> = s.pass_at_k.iter().map(|p| p.k).collect();
        assert_eq!(ks, vec![1, 2, 4]);
        // pass@1 = mean@k
        assert!((s.pass_at_k[0].estimate.value - s.mean_at_k.value).abs() < 1e-15);
        // pass@2: prompt 1: 1 - C(1,2)/C(4,2) = 1; prompt 2: 1 - C(3,2)/C(4,2) = 0.5; 0.
        assert!((s.pass_at_k[1].estimate.value - 0.5).abs() < 1e-15);
        // pass@4: any correct: 1, 1, 0.
        assert!((s.pass_at_k[2].estimate.value - 2.0 / 3.0).abs() < 1e-15);
        // maj@4: 1, 0, 0.
        let maj = s.maj_at_k.unwrap();
        assert!((maj.estimate.value - 1.0 / 3.0).abs() < 1e-15);
        let boot = maj.bootstrap.unwrap();
        assert!(boot.low >= 0.0 && boot.high <= 1.0 && boot.low <= boot.high);
        assert_eq!(boot.value, maj.estimate.value);
        // Intervals: maj@4 (1, 0, 0) and pass@4 (1, 1, 0) are proportions: Wilson's.
        assert_eq!(maj.interval, wilson_interval(1, 3));
        assert_eq!(s.pass_at_k[2].interval, wilson_interval(2, 3));
        // mean@4 (0.75, 0.25, 0): se 0.2205, t with 2 df 4.303: 1/3 ± 0.949, clipped to
        // [0, 1] at both ends.
        let m = s.mean_interval.unwrap();
        assert_eq!(m.method, IntervalMethod::StudentT);
        assert!((4.303 * s.mean_at_k.stderr - 0.9488).abs() < 1e-4);
        assert_eq!((m.low, m.high), (0.0, 1.0));
    }

    #[test]
    fn one_sample_per_prompt_gets_wilson_and_one_prompt_none() {
        let o: Vec<PromptOutcome> = [1u8, 0, 0, 0, 0]
            .iter()
            .map(|&c| outcome(&[c], &[""]))
            .collect();
        let opts = SummaryOptions {
            bootstrap_resamples: 0,
            bootstrap_seed: 0,
        };
        let s = summarise(&o, opts).unwrap();
        assert_eq!(s.mean_interval, wilson_interval(1, 5));
        assert_eq!(s.pass_at_k[0].interval, wilson_interval(1, 5));
        let one = summarise(&o[..1], opts).unwrap();
        assert_eq!(one.mean_interval, None);
        assert_eq!(one.pass_at_k[0].interval, None);
        assert_eq!(one.maj_at_k.unwrap().interval, None);
    }

    #[test]
    fn no_answers_no_majority() {
        let mut o = vec![outcome(&[1, 0], &["1", "2"])];
        o[0].answers = None;
        let s = summarise(
            &o,
            SummaryOptions {
                bootstrap_resamples: 0,
                bootstrap_seed: 0,
            },
        )
        .unwrap();
        assert!(s.maj_at_k.is_none());
        assert!(summarise(
            &[],
            SummaryOptions {
                bootstrap_resamples: 0,
                bootstrap_seed: 0
            }
        )
        .is_none());
    }

    #[test]
    fn pass_ks_are_powers_of_two_and_k() {
        assert_eq!(pass_ks(1), vec![1]);
        assert_eq!(pass_ks(8), vec![1, 2, 4, 8]);
        assert_eq!(pass_ks(6), vec![1, 2, 4, 6]);
    }
}
