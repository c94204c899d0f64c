//! Exponential-moving-average smoothing of a noisy per-step curve, as TensorBoard and wandb
//! draw it: `s_t = w · s_{t−1} + (1 − w) · x_t` from `s_0 = 0`, divided by `1 − w^t` (the
//! debiasing that keeps the first points from being pulled towards 0). `w` is the smoothing
//! weight in `[0, 1)`: 0 draws the raw curve, 0.9 averages over roughly the last 10 points,
//! 0.99 over the last 100. Points that are not finite are skipped (the average carries over
//! them), so a missing metric does not break the smoothed line.

/// The EMA of `points` (in order) with weight `weight`; one output point per finite input
/// point. `weight` outside `[0, 1)` is clamped into it.
pub fn ema(points: &[(f64, f64)], weight: f64) -> Vec<(f64, f64)> {
    let w = if weight.is_finite() {
        weight.clamp(0.0, 0.999_999)
    } else {
        0.0
    };
    let mut acc = 0.0;
    let mut decay = 1.0;
    let mut out = Vec::with_capacity(points.len());
    for &(x, y) in points {
        if !y.is_finite() || !x.is_finite() {
            continue;
        }
        acc = w * acc + (1.0 - w) * y;
        decay *= w;
        out.push((x, acc / (1.0 - decay)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_debiased_ema() {
        // w = 0.5: acc 0.5·1 = 0.5 / (1 − 0.5) = 1; acc 0.25 + 1.5 = 1.75 / 0.75 = 7/3;
        // acc 0.875 + 0 = 0.875 / 0.875 = 1.
        let s = ema(&[(0.0, 1.0), (1.0, 3.0), (2.0, f64::NAN), (3.0, 0.0)], 0.5);
        assert_eq!(s.len(), 3);
        assert!((s[0].1 - 1.0).abs() < 1e-15);
        assert!((s[1].1 - 7.0 / 3.0).abs() < 1e-15);
        assert_eq!(s[2].0, 3.0);
        assert!((s[2].1 - 1.0).abs() < 1e-15);
    }

    #[test]
    fn weight_zero_is_the_raw_curve_and_constants_stay_constant() {
        let raw = [(0.0, 0.3), (1.0, 0.6), (2.0, 0.4)];
        assert_eq!(ema(&raw, 0.0), raw.to_vec());
        let flat: Vec<(f64, f64)> = (0..50).map(|i| (f64::from(i), 0.42)).collect();
        for (_, y) in ema(&flat, 0.95) {
            assert!((y - 0.42).abs() < 1e-12);
        }
    }

    #[test]
    fn smoothing_shrinks_step_to_step_swings() {
        // Alternating 0.3 / 0.6, as the default run's reward does.
        let noisy: Vec<(f64, f64)> = (0..100)
            .map(|i| (f64::from(i), if i % 2 == 0 { 0.3 } else { 0.6 }))
            .collect();
        let s = ema(&noisy, 0.9);
        let swing = (s[99].1 - s[98].1).abs();
        assert!(swing < 0.05, "{swing}");
        assert!((s[99].1 - 0.45).abs() < 0.05);
    }
}
