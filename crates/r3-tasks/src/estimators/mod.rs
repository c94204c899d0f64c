//! Estimators of evaluation results with their uncertainty: what a held-out evaluation with
//! `k` samples per prompt reports (`mean@k`, the unbiased `pass@k`, `maj@k`), standard errors
//! over prompts, 95% intervals (Wilson's for proportions, Student's t clipped to [0, 1]
//! otherwise), a seeded bootstrap, and paired differences between two models scored on the
//! same prompts (run-to-run spread added when several seeds per model are given).
//!
//! Everything here is a pure function of the per-sample outcomes; the trainer, `r3 eval` and
//! the reports all call these, so one convention holds everywhere. The standard error of a
//! mean over prompts is the sample standard deviation (n − 1) over √n, as
//! `statistics.stdev(x) / sqrt(n)` computes it.

pub mod bootstrap;
pub mod interval;
pub mod majority;
pub mod paired;
pub mod pass_at_k;
pub mod summary;

pub use bootstrap::{bootstrap_interval, BootstrapInterval};
pub use interval::{score_interval, t_interval_unit, wilson_interval, Interval, IntervalMethod};
pub use majority::{majority_correct, majority_index};
pub use paired::{paired_difference, paired_difference_seeds, t_quantile_975, PairedDifference};
pub use pass_at_k::pass_at_k;
pub use summary::{
    pass_ks, prompt_scores, summarise, MajorityEstimate, PassAt, PromptOutcome, SampleSummary,
    SummaryOptions,
};

use serde::{Deserialize, Serialize};

/// A value with its standard error.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// The point estimate.
    pub value: f64,
    /// Its standard error.
    pub stderr: f64,
}

/// The mean of `values` with its standard error (sample standard deviation over √n; 0 with
/// fewer than two values). `None` when `values` is empty.
pub fn mean_with_stderr(values: &[f64]) -> Option<Estimate> {
    let n = values.len();
    if n == 0 {
        return None;
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let stderr = if n < 2 {
        0.0
    } else {
        let ss: f64 = values.iter().map(|v| (v - mean) * (v - mean)).sum();
        (ss / (n - 1) as f64).sqrt() / (n as f64).sqrt()
    };
    Some(Estimate {
        value: mean,
        stderr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_stderr_by_hand() {
        // mean 2.5; deviations ±1.5, ±0.5: ss = 5, var = 5/3, se = sqrt(5/3)/2.
        let e = mean_with_stderr(&[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(e.value, 2.5);
        assert!((e.stderr - (5.0f64 / 3.0).sqrt() / 2.0).abs() < 1e-15);
        assert_eq!(mean_with_stderr(&[0.7]).unwrap().stderr, 0.0);
        assert!(mean_with_stderr(&[]).is_none());
    }
}
