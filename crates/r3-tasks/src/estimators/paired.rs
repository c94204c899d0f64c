//! Paired differences between two models scored on the same prompts: the per-prompt
//! difference, its mean, standard error and 95% interval (Student's t over prompts), and with
//! several seeds per model a two-level bootstrap (prompts paired, seeds resampled within
//! each model). A difference is inside the noise when its interval contains 0.

use serde::{Deserialize, Serialize};

use crate::estimators::bootstrap::{summarise_draws, Resampler};
use crate::estimators::mean_with_stderr;

/// The paired difference `a − b` over prompts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PairedDifference {
    /// Mean per-prompt difference.
    pub mean: f64,
    /// Its standard error.
    pub stderr: f64,
    /// Lower end of the 95% interval.
    pub low: f64,
    /// Upper end of the 95% interval.
    pub high: f64,
    /// Prompts paired.
    pub prompts: usize,
    /// Seeds per side (1 when one run each).
    pub seeds: (usize, usize),
}

impl PairedDifference {
    /// Whether the 95% interval contains 0: the data cannot tell the two apart.
    pub fn inside_noise(&self) -> bool {
        self.low <= 0.0 && 0.0 <= self.high
    }

    /// One line a person reads, in points (×100): `+2.8 ± 1.7 points (95% CI +0.1 … +5.5):
    /// a real difference` or `… inside the noise`.
    pub fn describe_points(&self) -> String {
        let verdict = if self.inside_noise() {
            "inside the noise (the interval contains 0)"
        } else if self.mean > 0.0 {
            "a real gain (the interval excludes 0)"
        } else {
            "a real loss (the interval excludes 0)"
        };
        format!(
            "{:+.1} ± {:.1} points (95% CI {:+.1} … {:+.1}, {} prompts): {verdict}",
            100.0 * self.mean,
            100.0 * self.stderr,
            100.0 * self.low,
            100.0 * self.high,
            self.prompts
        )
    }
}

/// Two-sided 95% quantile of Student's t with `df` degrees of freedom: the table for
/// `df ≤ 30`, then `1.96 + 2.46 / df` (within 0.002 of the exact value for every `df > 30`).
pub fn t_quantile_975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::INFINITY,
        d if d <= 30 => TABLE[d - 1],
        d => 1.96 + 2.46 / d as f64,
    }
}

/// The paired difference `a[p] − b[p]` over prompts `p` with a t interval; `None` when the
/// two do not score the same number of prompts or score none.
pub fn paired_difference(a: &[f64], b: &[f64]) -> Option<PairedDifference> {
    if a.len() != b.len() {
        return None;
    }
    let diff: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    let e = mean_with_stderr(&diff)?;
    let half = if diff.len() < 2 {
        f64::INFINITY
    } else {
        t_quantile_975(diff.len() - 1) * e.stderr
    };
    Some(PairedDifference {
        mean: e.value,
        stderr: e.stderr,
        low: e.value - half,
        high: e.value + half,
        prompts: diff.len(),
        seeds: (1, 1),
    })
}

/// The difference of two models each run under several seeds, `a[s][p]` being seed `s`'s
/// score on prompt `p` (every seed of both models scored on the same prompts). The value is
/// the mean over prompts of (mean over `a`'s seeds − mean over `b`'s seeds); its spread comes
/// from a two-level bootstrap: each resample draws prompts with replacement (one draw shared
/// by both sides: the prompts are paired) and, independently for each side, seeds with
/// replacement. `None` when a side has no seeds or the prompt counts differ.
pub fn paired_difference_seeds(
    a: &[Vec<f64>],
    b: &[Vec<f64>],
    resamples: usize,
    seed: u64,
) -> Option<PairedDifference> {
    let prompts = a.first()?.len();
    if b.is_empty()
        || prompts == 0
        || resamples == 0
        || a.iter().chain(b).any(|s| s.len() != prompts)
    {
        return None;
    }
    if a.len() == 1 && b.len() == 1 {
        return paired_difference(&a[0], &b[0]);
    }
    let all_a: Vec<usize> = (0..a.len()).collect();
    let all_b: Vec<usize> = (0..b.len()).collect();
    let all_p: Vec<usize> = (0..prompts).collect();
    let value = seed_level_difference(a, b, &all_a, &all_b, &all_p);
    let mut r = Resampler::new(seed);
    let draws: Vec<f64> = (0..resamples)
        .map(|_| {
            let p = r.draw(prompts);
            let sa = r.draw(a.len());
            let sb = r.draw(b.len());
            seed_level_difference(a, b, &sa, &sb, &p)
        })
        .collect();
    let s = summarise_draws(value, draws)?;
    Some(PairedDifference {
        mean: value,
        stderr: s.stderr,
        low: s.low,
        high: s.high,
        prompts,
        seeds: (a.len(), b.len()),
    })
}

fn seed_level_difference(
    a: &[Vec<f64>],
    b: &[Vec<f64>],
    seeds_a: &[usize],
    seeds_b: &[usize],
    prompts: &[usize],
) -> f64 {
    let side = |x: &[Vec<f64>], seeds: &[usize], p: usize| {
        seeds.iter().map(|&s| x[s][p]).sum::<f64>() / seeds.len() as f64
    };
    prompts
        .iter()
        .map(|&p| side(a, seeds_a, p) - side(b, seeds_b, p))
        .sum::<f64>()
        / prompts.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_paired_difference() {
        // diffs: 0.5, 0, 0.25, -0.25 -> mean 0.125; deviations .375, -.125, .125, -.375:
        // ss = 0.3125, var = 0.3125/3, se = sqrt(var)/2.
        let a = [1.0, 0.5, 0.75, 0.25];
        let b = [0.5, 0.5, 0.5, 0.5];
        let d = paired_difference(&a, &b).unwrap();
        assert!((d.mean - 0.125).abs() < 1e-15);
        let se = (0.3125f64 / 3.0).sqrt() / 2.0;
        assert!((d.stderr - se).abs() < 1e-15);
        assert!((d.high - (0.125 + 3.182 * se)).abs() < 1e-12);
        assert!(d.inside_noise());
        assert!(paired_difference(&a, &b[..3]).is_none());
    }

    #[test]
    fn a_clear_gain_is_outside_the_noise() {
        let a: Vec<f64> = (0..100)
            .map(|i| if i % 4 == 0 { 1.0 } else { 0.75 })
            .collect();
        let b = vec![0.5; 100];
        let d = paired_difference(&a, &b).unwrap();
        assert!(!d.inside_noise());
        assert!(
            d.describe_points().contains("real gain"),
            "{}",
            d.describe_points()
        );
    }

    #[test]
    fn t_quantiles_near_exact_values() {
        // scipy.stats.t.ppf(0.975, df) for df = 40, 60, 120, 199: 2.021, 2.000, 1.980, 1.972.
        for (df, t) in [(40, 2.021), (60, 2.000), (120, 1.980), (199, 1.972)] {
            assert!((t_quantile_975(df) - t).abs() < 0.002, "df {df}");
        }
    }

    #[test]
    fn seeds_as_a_second_level() {
        // Two seeds per side. Point value: mean over prompts of seed-averaged differences.
        let a = vec![vec![1.0, 0.0, 1.0, 1.0], vec![0.0, 0.0, 1.0, 1.0]];
        let b = vec![vec![0.0, 0.0, 1.0, 0.0], vec![0.0, 1.0, 1.0, 0.0]];
        // seed means a: .5 0 1 1; b: 0 .5 1 0 -> diffs .5 -.5 0 1 -> mean 0.25
        let d = paired_difference_seeds(&a, &b, 2000, 3).unwrap();
        assert!((d.mean - 0.25).abs() < 1e-15);
        assert_eq!(d.seeds, (2, 2));
        assert!(d.low <= d.mean && d.mean <= d.high);
        assert_eq!(d, paired_difference_seeds(&a, &b, 2000, 3).unwrap());
        // The same seed-averaged scores as one run each: the same point value.
        let one_a = vec![vec![0.5, 0.0, 1.0, 1.0]];
        let one_b = vec![vec![0.0, 0.5, 1.0, 0.0]];
        let flat = paired_difference(&one_a[0], &one_b[0]).unwrap();
        assert!((flat.mean - d.mean).abs() < 1e-15);
        // One seed per side falls back to the t interval over prompts.
        assert_eq!(
            paired_difference_seeds(&one_a, &one_b, 10, 0).unwrap(),
            flat
        );
        assert!(paired_difference_seeds(&a, &[vec![0.0; 3]], 10, 0).is_none());
    }
}
