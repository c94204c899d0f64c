//! The unbiased pass@k estimator of the Codex paper: with `n` samples of which `c` are
//! correct, the probability that at least one of `k` samples drawn without replacement is
//! correct, `1 − C(n−c, k) / C(n, k)`.

/// `1 − C(n−c, k) / C(n, k)`, computed as `1 − Π_{i=n−c+1}^{n} (1 − k / i)` so no binomial
/// coefficient is ever formed (they overflow long before `n = 100`). `None` when `k` is 0 or
/// larger than `n`, or `c > n`.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> Option<f64> {
    if k == 0 || k > n || c > n {
        return None;
    }
    // Fewer than k wrong samples: every k-subset holds a correct one.
    if n - c < k {
        return Some(1.0);
    }
    let miss: f64 = (n - c + 1..=n).map(|i| 1.0 - k as f64 / i as f64).product();
    Some(1.0 - miss)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binom(n: u64, k: u64) -> f64 {
        if k > n {
            return 0.0;
        }
        (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (i + 1) as f64)
    }

    #[test]
    fn hand_computed_cases() {
        // n = 4, c = 1, k = 2: C(3,2)/C(4,2) = 3/6, pass = 0.5.
        assert!((pass_at_k(4, 1, 2).unwrap() - 0.5).abs() < 1e-15);
        // n = 5, c = 2, k = 2: 1 − C(3,2)/C(5,2) = 1 − 3/10.
        assert!((pass_at_k(5, 2, 2).unwrap() - 0.7).abs() < 1e-15);
        // k = 1 is the fraction correct.
        assert!((pass_at_k(8, 3, 1).unwrap() - 3.0 / 8.0).abs() < 1e-15);
        // k = n: any correct.
        assert_eq!(pass_at_k(8, 1, 8), Some(1.0));
        assert_eq!(pass_at_k(8, 0, 8), Some(0.0));
        assert_eq!(pass_at_k(8, 0, 3), Some(0.0));
        // n − c < k.
        assert_eq!(pass_at_k(8, 6, 3), Some(1.0));
        assert_eq!(pass_at_k(8, 3, 0), None);
        assert_eq!(pass_at_k(8, 3, 9), None);
        assert_eq!(pass_at_k(8, 9, 1), None);
    }

    #[test]
    fn agrees_with_binomial_coefficients() {
        for n in 1..=20u64 {
            for c in 0..=n {
                for k in 1..=n {
                    let direct = 1.0 - binom(n - c, k) / binom(n, k);
                    let stable = pass_at_k(n as usize, c as usize, k as usize).unwrap();
                    assert!((direct - stable).abs() < 1e-12, "n={n} c={c} k={k}");
                }
            }
        }
        // Large n stays finite and in [0, 1] where C(n, k) overflows f64.
        let p = pass_at_k(2000, 3, 500).unwrap();
        assert!(p.is_finite() && (0.0..=1.0).contains(&p));
    }
}
