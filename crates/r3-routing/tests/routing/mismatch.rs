//! Mismatch metrics against hand-computed values.

use r3_routing::mismatch::{default_taus, pearson};
use r3_routing::{extreme_fraction_curve, mismatch_metrics};

fn ln(x: f64) -> f32 {
    x.ln() as f32
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() < tol
}

#[test]
fn hand_computed_metrics() {
    // p_train = [.9, .2, .1], p_rollout = [.3, .2, .8] → Δ = [ln 3, 0, -ln 8].
    let train = [ln(0.9), ln(0.2), ln(0.1)];
    let roll = [ln(0.3), ln(0.2), ln(0.8)];
    let m = mismatch_metrics(&train, &roll, None).unwrap();
    let (l3, l8) = (3f64.ln(), 8f64.ln());
    let k3 = ((3.0 - 1.0 - l3) + 0.0 + (1.0 / 8.0 - 1.0 + l8)) / 3.0;
    let tol = 1e-5;
    assert_eq!(m.num_tokens, 3);
    assert!(close(m.k3_kl, k3, tol), "{} vs {k3}", m.k3_kl);
    assert!(close(m.mean_log_ratio, (l3 - l8) / 3.0, tol));
    assert!(close(m.mean_abs_log_diff, (l3 + l8) / 3.0, tol));
    assert!(close(m.mean_sq_log_diff, (l3 * l3 + l8 * l8) / 3.0, tol));
    assert!(close(m.extreme_frac_tau2, 2.0 / 3.0, 1e-12));
    assert!(close(m.extreme_frac_tau5, 1.0 / 3.0, 1e-12));
    assert!(close(m.prob_diff_max, 0.7, tol));
    assert!(close(m.prob_diff_mean, 1.3 / 3.0, tol));
    let std = ((0.36 + 0.49) / 3.0 - (1.3f64 / 3.0).powi(2)).sqrt();
    assert!(close(m.prob_diff_std, std, tol));
    // Pearson of [.9,.2,.1] and [.3,.2,.8], worked by hand: -0.13 / sqrt(0.38 * 0.206667).
    assert!(close(m.prob_pearson.unwrap(), -0.46389, 1e-4));
}

#[test]
fn identical_log_probs_give_zero_mismatch() {
    let lp = [ln(0.5), ln(0.25), ln(0.125)];
    let m = mismatch_metrics(&lp, &lp, None).unwrap();
    assert_eq!(
        (
            m.k3_kl,
            m.mean_abs_log_diff,
            m.extreme_frac_tau2,
            m.prob_diff_max
        ),
        (0.0, 0.0, 0.0, 0.0)
    );
    assert!(close(m.prob_pearson.unwrap(), 1.0, 1e-9));
}

#[test]
fn mask_selects_tokens() {
    let train = [ln(0.9), f32::NAN, ln(0.5)];
    let roll = [ln(0.3), 0.0, ln(0.5)];
    let m = mismatch_metrics(&train, &roll, Some(&[true, false, true])).unwrap();
    assert_eq!(m.num_tokens, 2);
    assert!(close(m.extreme_frac_tau2, 0.5, 1e-12));
    // Unmasked NaN is an error naming the token; all-masked is an error; lengths must match.
    let err = mismatch_metrics(&train, &roll, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("token 1"), "{err}");
    assert!(mismatch_metrics(&train, &roll, Some(&[false; 3])).is_err());
    assert!(mismatch_metrics(&train, &roll[..2], None).is_err());
    assert!(mismatch_metrics(&train, &roll, Some(&[true])).is_err());
}

#[test]
fn extreme_fraction_curve_is_monotone_and_matches_points() {
    let train = [ln(0.9), ln(0.2), ln(0.1)];
    let roll = [ln(0.3), ln(0.2), ln(0.8)];
    let curve = extreme_fraction_curve(&train, &roll, None, &[2.0, 5.0, 10.0]).unwrap();
    assert_eq!(curve, vec![(2.0, 2.0 / 3.0), (5.0, 1.0 / 3.0), (10.0, 0.0)]);
    let full = extreme_fraction_curve(&train, &roll, None, &default_taus()).unwrap();
    assert!(full.windows(2).all(|w| w[0].1 >= w[1].1));
    assert!(extreme_fraction_curve(&train, &roll, None, &[1.0]).is_err());
}

#[test]
fn pearson_edge_cases() {
    assert_eq!(pearson(&[1.0], &[2.0]), None);
    assert_eq!(pearson(&[1.0, 1.0], &[2.0, 3.0]), None);
    assert!(close(
        pearson(&[1.0, 2.0, 3.0], &[2.0, 4.0, 6.0]).unwrap(),
        1.0,
        1e-12
    ));
    assert!(close(
        pearson(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]).unwrap(),
        -1.0,
        1e-12
    ));
}
