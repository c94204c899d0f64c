//! A seeded nonparametric bootstrap: resample units (prompts, seeds) with replacement,
//! recompute a statistic, and report the spread of the recomputed values as a standard
//! error and a 95% percentile interval. Same seed, same interval, on any thread count.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// The bootstrap distribution of a statistic, summarised.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BootstrapInterval {
    /// The statistic on the data as observed.
    pub value: f64,
    /// Standard deviation of the statistic over the resamples.
    pub stderr: f64,
    /// 2.5th percentile of the resampled statistic.
    pub low: f64,
    /// 97.5th percentile of the resampled statistic.
    pub high: f64,
    /// Resamples drawn.
    pub resamples: usize,
}

/// Draws index vectors with replacement from a ChaCha8 stream seeded by `seed`.
#[derive(Debug, Clone)]
pub struct Resampler {
    rng: ChaCha8Rng,
}

impl Resampler {
    /// A resampler whose draws depend only on `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// `n` indices drawn uniformly with replacement from `0..n`.
    pub fn draw(&mut self, n: usize) -> Vec<usize> {
        (0..n).map(|_| self.rng.random_range(0..n)).collect()
    }
}

/// Bootstraps `statistic` over `units` units: `statistic(&indices)` is evaluated on the
/// identity indices for the point value and on `resamples` seeded draws with replacement for
/// the spread. `None` when `units` or `resamples` is 0.
pub fn bootstrap_interval(
    units: usize,
    resamples: usize,
    seed: u64,
    mut statistic: impl FnMut(&[usize]) -> f64,
) -> Option<BootstrapInterval> {
    if units == 0 || resamples == 0 {
        return None;
    }
    let identity: Vec<usize> = (0..units).collect();
    let value = statistic(&identity);
    let mut resampler = Resampler::new(seed);
    let stats: Vec<f64> = (0..resamples)
        .map(|_| statistic(&resampler.draw(units)))
        .collect();
    summarise_draws(value, stats)
}

/// Summarises bootstrap draws of a statistic whose observed value is `value`; `None` when
/// there are no draws.
pub fn summarise_draws(value: f64, mut stats: Vec<f64>) -> Option<BootstrapInterval> {
    let n = stats.len();
    if n == 0 {
        return None;
    }
    let mean = stats.iter().sum::<f64>() / n as f64;
    let var = if n > 1 {
        stats.iter().map(|s| (s - mean) * (s - mean)).sum::<f64>() / (n - 1) as f64
    } else {
        0.0
    };
    stats.sort_by(f64::total_cmp);
    Some(BootstrapInterval {
        value,
        stderr: var.sqrt(),
        low: percentile(&stats, 0.025)?,
        high: percentile(&stats, 0.975)?,
        resamples: n,
    })
}

/// The `q` quantile of sorted values, linearly interpolated between order statistics (numpy's
/// default); `None` when `sorted` is empty or `q` is not in `[0, 1]`.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    if !(0.0..=1.0).contains(&q) {
        return None;
    }
    let pos = q * last as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimators::mean_with_stderr;

    #[test]
    fn percentile_interpolates_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(percentile(&v, 0.5), Some(3.0));
        // numpy.percentile([1..5], 2.5) = 1.1; 97.5 -> 4.9
        assert!((percentile(&v, 0.025).unwrap() - 1.1).abs() < 1e-12);
        assert!((percentile(&v, 0.975).unwrap() - 4.9).abs() < 1e-12);
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 1.0), Some(5.0));
    }

    #[test]
    fn no_draws_or_a_quantile_outside_0_1_is_none_not_a_panic() {
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[1.0], 1.5), None);
        assert_eq!(percentile(&[1.0], f64::NAN), None);
        assert_eq!(percentile(&[2.0], 0.3), Some(2.0));
        assert_eq!(summarise_draws(0.5, Vec::new()), None);
        let one = summarise_draws(0.5, vec![0.25]).unwrap();
        assert_eq!(
            (one.low, one.high, one.stderr, one.resamples),
            (0.25, 0.25, 0.0, 1)
        );
    }

    #[test]
    fn seeded_and_reproducible() {
        let x: Vec<f64> = (0..50).map(|i| ((i * 37) % 11) as f64).collect();
        let mean = |idx: &[usize]| idx.iter().map(|&i| x[i]).sum::<f64>() / idx.len() as f64;
        let a = bootstrap_interval(x.len(), 500, 7, mean).unwrap();
        let b = bootstrap_interval(x.len(), 500, 7, mean).unwrap();
        let c = bootstrap_interval(x.len(), 500, 8, mean).unwrap();
        assert_eq!(a, b);
        assert_ne!(a.stderr, c.stderr);
        assert!(a.low < a.value && a.value < a.high);
    }

    #[test]
    fn bootstrap_of_a_mean_matches_its_analytic_stderr() {
        // The bootstrap SE of a mean is sqrt((n-1)/n) times the analytic one, up to
        // resampling noise (~1/sqrt(2B) relative).
        let x: Vec<f64> = (0..200).map(|i| ((i * 7919) % 8) as f64 / 8.0).collect();
        let mean = |idx: &[usize]| idx.iter().map(|&i| x[i]).sum::<f64>() / idx.len() as f64;
        let b = bootstrap_interval(x.len(), 4000, 1, mean).unwrap();
        let analytic = mean_with_stderr(&x).unwrap();
        let expected = analytic.stderr * (199.0f64 / 200.0).sqrt();
        assert!(
            (b.stderr / expected - 1.0).abs() < 0.05,
            "{} vs {}",
            b.stderr,
            expected
        );
        assert_eq!(b.value, analytic.value);
    }
}
