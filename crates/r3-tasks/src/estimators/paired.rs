//! Paired differences between two models scored on the same prompts: the per-prompt
//! difference, its mean, standard error and 95% interval (Student's t over prompts), and with
//! several seeds per model a t interval whose variance adds the seed-to-seed spread of each
//! side's per-seed means to the prompt-level spread (Welch–Satterthwaite degrees of freedom).
//! A difference is inside the noise when its interval contains 0.

use serde::{Deserialize, Serialize};

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
    /// Degrees of freedom of the t quantile behind `low` / `high`: prompts − 1 with one run
    /// a side, Welch–Satterthwaite's with several seeds (0: no interval, it is infinite).
    #[serde(default)]
    pub df: f64,
}

impl PairedDifference {
    /// Whether the 95% interval contains 0: the data cannot tell the two apart.
    pub fn inside_noise(&self) -> bool {
        self.low <= 0.0 && 0.0 <= self.high
    }

    /// Degrees of freedom the seed-to-seed spread is estimated from: `(S_a − 1) + (S_b − 1)`
    /// (0 with one run a side, where that spread is not measured at all).
    pub fn seed_df(&self) -> usize {
        self.seeds.0.saturating_sub(1) + self.seeds.1.saturating_sub(1)
    }

    /// Whether several seeds were given but too few to measure their spread: under two
    /// degrees of freedom (1 vs 2 seeds) the spread rests on one difference of two runs, so
    /// the interval is very wide and its coverage only approximate.
    pub fn too_few_seeds(&self) -> bool {
        self.seeds != (1, 1) && self.seed_df() < 2
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
        let caveat = if self.too_few_seeds() {
            format!(
                "; too few seeds ({} vs {}) to measure run-to-run spread: the interval rests on \
                 {} degree of freedom, add seeds",
                self.seeds.0,
                self.seeds.1,
                self.seed_df()
            )
        } else {
            String::new()
        };
        format!(
            "{:+.1} ± {:.1} points (95% CI {:+.1} … {:+.1}, {} prompts): {verdict}{caveat}",
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
        df: (diff.len() - 1) as f64,
    })
}

/// The difference of two models each run under several seeds, `a[s][p]` being seed `s`'s
/// score on prompt `p` (every seed of both models scored on the same prompts). The value is
/// the mean over prompts of (mean over `a`'s seeds − mean over `b`'s seeds). Its variance is
/// the sum of
/// - the prompt part: the variance of those per-prompt differences over √prompts (prompts
///   are paired, so what both sides share cancels; `prompts − 1` degrees of freedom), and
/// - the seed part of each side: the sample variance of its per-seed means (each a mean over
///   all prompts) over its seed count (`S − 1` degrees of freedom). A side with one seed has
///   no spread of its own: it is taken to share the other side's (`s² (1/S_a + 1/S_b)`).
///
/// The 95% interval is Student's t with the Welch–Satterthwaite degrees of freedom of that
/// sum, rounded down. Seeds are not paired across sides: `r3 eval` compares one evaluation
/// with any number of baseline files and a report's sides may hold different seed sets, and
/// runs of two variants under one seed drift apart, so pairing would claim a correlation
/// nobody measured. The per-seed mean also holds the prompt × seed noise the prompt part
/// holds, so that noise is counted twice: the interval errs wide when seeds agree (about
/// 0.99 coverage), and keeps its 95% when run-to-run spread dominates, where a bootstrap of
/// `S` seeds out of `S` covers 73–82% at 2–3 seeds. One seed per side is
/// [`paired_difference`]. `None` when a side has no seeds or the prompt counts differ.
pub fn paired_difference_seeds(a: &[Vec<f64>], b: &[Vec<f64>]) -> Option<PairedDifference> {
    let prompts = a.first()?.len();
    if b.is_empty() || prompts == 0 || a.iter().chain(b).any(|s| s.len() != prompts) {
        return None;
    }
    if a.len() == 1 && b.len() == 1 {
        return paired_difference(&a[0], &b[0]);
    }
    let seed_mean = |x: &[Vec<f64>], p: usize| x.iter().map(|s| s[p]).sum::<f64>() / x.len() as f64;
    let diff: Vec<f64> = (0..prompts)
        .map(|p| seed_mean(a, p) - seed_mean(b, p))
        .collect();
    let d = mean_with_stderr(&diff)?;
    let seeds = (a.len(), b.len());
    let (sa, sb) = (a.len() as f64, b.len() as f64);
    // (variance, degrees of freedom) of each part of the difference's variance.
    let mut parts: Vec<(f64, f64)> = match (seed_spread(a), seed_spread(b)) {
        (Some((va, na)), Some((vb, nb))) => vec![(va / sa, na), (vb / sb, nb)],
        (Some((v, n)), None) | (None, Some((v, n))) => vec![(v * (1.0 / sa + 1.0 / sb), n)],
        (None, None) => Vec::new(),
    };
    if prompts < 2 {
        // One prompt: the prompt part cannot be estimated, as in `paired_difference`.
        return Some(PairedDifference {
            mean: d.value,
            stderr: parts.iter().map(|(v, _)| v).sum::<f64>().sqrt(),
            low: f64::NEG_INFINITY,
            high: f64::INFINITY,
            prompts,
            seeds,
            df: 0.0,
        });
    }
    parts.push((d.stderr * d.stderr, (prompts - 1) as f64));
    let var: f64 = parts.iter().map(|(v, _)| v).sum();
    let df = if var > 0.0 {
        let denom: f64 = parts.iter().map(|(v, n)| v * v / n).sum();
        // Satterthwaite's df lies between the smallest part's and their sum; never below 1.
        (var * var / denom).max(1.0)
    } else {
        (prompts - 1) as f64
    };
    let half = t_quantile_975(df.floor() as usize) * var.sqrt();
    Some(PairedDifference {
        mean: d.value,
        stderr: var.sqrt(),
        low: d.value - half,
        high: d.value + half,
        prompts,
        seeds,
        df,
    })
}

/// The sample variance of one side's per-seed means (each the mean over all prompts) and
/// its degrees of freedom; `None` with fewer than two seeds.
fn seed_spread(side: &[Vec<f64>]) -> Option<(f64, f64)> {
    if side.len() < 2 {
        return None;
    }
    let means: Vec<f64> = side
        .iter()
        .map(|s| s.iter().sum::<f64>() / s.len() as f64)
        .collect();
    let n = means.len() as f64;
    let mean = means.iter().sum::<f64>() / n;
    let ss: f64 = means.iter().map(|m| (m - mean) * (m - mean)).sum();
    Some((ss / (n - 1.0), n - 1.0))
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
    fn seeds_as_a_second_level_by_hand() {
        // Two seeds per side, four prompts.
        let a = vec![vec![1.0, 0.0, 1.0, 1.0], vec![0.0, 0.0, 1.0, 1.0]];
        let b = vec![vec![0.0, 0.0, 1.0, 0.0], vec![0.0, 1.0, 1.0, 0.0]];
        // Seed-averaged per prompt: a .5 0 1 1, b 0 .5 1 0 -> diffs .5 -.5 0 1, mean 0.25;
        // deviations .25 -.75 -.25 .75: ss 1.25, prompt part 1.25/3/4 = 5/48, 3 df.
        // Per-seed means: a .75 .5, b .25 .5: each variance 1/32, part 1/64, 1 df.
        // V = 5/48 + 2/64 = 13/96; df = V² / ((5/48)²/3 + 2 (1/64)²) = 1014/227 = 4.47 -> 4.
        let d = paired_difference_seeds(&a, &b).unwrap();
        assert!((d.mean - 0.25).abs() < 1e-15);
        assert_eq!(d.seeds, (2, 2));
        let v = 13.0f64 / 96.0;
        assert!((d.stderr - v.sqrt()).abs() < 1e-15, "{}", d.stderr);
        assert!((d.df - 1014.0 / 227.0).abs() < 1e-12, "{}", d.df);
        assert!((d.high - (0.25 + 2.776 * v.sqrt())).abs() < 1e-12);
        assert!((d.low - (0.25 - 2.776 * v.sqrt())).abs() < 1e-12);
        assert!(!d.too_few_seeds());
        // One seed on a side: it shares the other side's spread, with that side's df.
        // a (2 seeds) vs b's first seed: diffs .5 0 0 1, mean 3/8, deviations
        // 1/8 -3/8 -3/8 5/8: ss 11/16, part 11/16/3/4 = 11/192; seed part 1/32 (1/2 + 1) =
        // 3/64, 1 df. V = 11/192 + 9/192 = 20/192; df = V² / ((11/192)²/3 + (9/192)²)
        // = 400 / (121/3 + 81) = 1200/364 = 3.30 -> 3.
        let one_b = vec![b[0].clone()];
        let d = paired_difference_seeds(&a, &one_b).unwrap();
        assert!((d.mean - 0.375).abs() < 1e-15);
        let v = 20.0f64 / 192.0;
        assert!((d.stderr - v.sqrt()).abs() < 1e-15, "{}", d.stderr);
        assert!((d.df - 1200.0 / 364.0).abs() < 1e-12, "{}", d.df);
        assert!((d.high - (0.375 + 3.182 * v.sqrt())).abs() < 1e-12);
        assert!(d.too_few_seeds() && d.seed_df() == 1);
        assert!(
            d.describe_points().contains("too few seeds (2 vs 1)"),
            "{}",
            d.describe_points()
        );
        // One seed per side falls back to the t interval over prompts.
        let one_a = vec![vec![0.5, 0.0, 1.0, 1.0]];
        let one_b = vec![vec![0.0, 0.5, 1.0, 0.0]];
        let flat = paired_difference(&one_a[0], &one_b[0]).unwrap();
        assert_eq!(paired_difference_seeds(&one_a, &one_b).unwrap(), flat);
        assert_eq!(flat.df, 3.0);
        assert!(!flat.too_few_seeds());
        assert!(paired_difference_seeds(&a, &[vec![0.0; 3]]).is_none());
        // One prompt: no interval, not a panic.
        let d = paired_difference_seeds(&[vec![1.0], vec![0.0]], &[vec![0.0], vec![0.0]]).unwrap();
        assert!(d.inside_noise() && d.low.is_infinite());
    }

    #[test]
    fn identical_seeds_give_a_zero_width_interval_not_nan() {
        let a = vec![vec![0.5, 0.25]; 3];
        let d = paired_difference_seeds(&a, &a).unwrap();
        assert_eq!((d.mean, d.stderr, d.low, d.high), (0.0, 0.0, 0.0, 0.0));
    }
}
