//! Training–inference mismatch metrics from per-token log-probs on plain slices, with
//! `Δ = logp_train − logp_rollout` over unmasked tokens:
//! k3 estimate of KL(π_rollout ‖ π_train) = mean(exp(Δ) − 1 − Δ) (the tokens are sampled
//! from the rollout and `exp(Δ)` is π_train / π_rollout: the R3 paper's eq. 2, which it
//! labels D_KL(π_train ‖ π_infer)); F(τ) = fraction with
//! |Δ| > ln τ; mean |Δ|; mean Δ²; the differences of probabilities p = exp(logp)
//! (|p_train − p_rollout| max / mean / std) and the Pearson correlation of the probabilities.

use serde::Serialize;

use crate::RouteError;

/// Mismatch metrics over the unmasked tokens.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MismatchMetrics {
    /// Tokens that entered the statistics.
    pub num_tokens: usize,
    /// k3 estimate of KL(π_rollout ‖ π_train): mean(exp(Δ) − 1 − Δ).
    pub k3_kl: f64,
    /// Mean Δ (log importance ratio train/rollout).
    pub mean_log_ratio: f64,
    /// Mean |Δ|.
    pub mean_abs_log_diff: f64,
    /// Mean Δ².
    pub mean_sq_log_diff: f64,
    /// F(2): fraction of tokens with |Δ| > ln 2.
    pub extreme_frac_tau2: f64,
    /// F(5): fraction of tokens with |Δ| > ln 5.
    pub extreme_frac_tau5: f64,
    /// max |p_train − p_rollout|.
    pub prob_diff_max: f64,
    /// mean |p_train − p_rollout|.
    pub prob_diff_mean: f64,
    /// Population std of |p_train − p_rollout|.
    pub prob_diff_std: f64,
    /// Pearson correlation of p_train and p_rollout; None when either has zero variance.
    pub prob_pearson: Option<f64>,
}

impl MismatchMetrics {
    /// The metrics under the keys a run's `metrics.jsonl` logs them with, plus
    /// `mismatch.num_tokens` and `mismatch.mean_log_ratio`.
    pub fn log_fields(&self) -> Vec<(&'static str, Option<f64>)> {
        vec![
            ("mismatch.num_tokens", Some(self.num_tokens as f64)),
            ("mismatch.k3_kl", Some(self.k3_kl)),
            ("mismatch.f_tau2", Some(self.extreme_frac_tau2)),
            ("mismatch.f_tau5", Some(self.extreme_frac_tau5)),
            ("mismatch.mean_abs_delta", Some(self.mean_abs_log_diff)),
            ("mismatch.mean_sq_delta", Some(self.mean_sq_log_diff)),
            ("mismatch.mean_log_ratio", Some(self.mean_log_ratio)),
            ("mismatch.prob_diff_max", Some(self.prob_diff_max)),
            ("mismatch.prob_diff_mean", Some(self.prob_diff_mean)),
            ("mismatch.prob_diff_std", Some(self.prob_diff_std)),
            ("mismatch.pearson", self.prob_pearson),
        ]
    }
}

/// The Δ values of unmasked tokens, after checking lengths and finiteness.
fn deltas(
    logp_train: &[f32],
    logp_rollout: &[f32],
    mask: Option<&[bool]>,
) -> Result<Vec<(f64, f64)>, RouteError> {
    if logp_train.len() != logp_rollout.len() {
        return Err(RouteError::length(
            "rollout log-probs (one per training log-prob)",
            logp_train.len(),
            logp_rollout.len(),
        ));
    }
    if let Some(m) = mask {
        if m.len() != logp_train.len() {
            return Err(RouteError::length(
                "mask entries",
                logp_train.len(),
                m.len(),
            ));
        }
    }
    let mut out = Vec::with_capacity(logp_train.len());
    for (i, (&t, &r)) in logp_train.iter().zip(logp_rollout).enumerate() {
        if mask.is_some_and(|m| !m[i]) {
            continue;
        }
        if !t.is_finite() || !r.is_finite() {
            return Err(RouteError::Argument(format!(
                "token {i}: log-probs must be finite (train {t}, rollout {r})"
            )));
        }
        out.push((f64::from(t), f64::from(r)));
    }
    if out.is_empty() {
        return Err(RouteError::Argument(
            "no unmasked tokens to compare".to_string(),
        ));
    }
    Ok(out)
}

/// Computes all mismatch metrics. Errors on length mismatch, non-finite log-probs or an
/// empty selection.
pub fn mismatch_metrics(
    logp_train: &[f32],
    logp_rollout: &[f32],
    mask: Option<&[bool]>,
) -> Result<MismatchMetrics, RouteError> {
    let pairs = deltas(logp_train, logp_rollout, mask)?;
    let n = pairs.len() as f64;
    let mean = |f: &dyn Fn(f64, f64) -> f64| pairs.iter().map(|&(t, r)| f(t, r)).sum::<f64>() / n;
    let (ln2, ln5) = (2f64.ln(), 5f64.ln());
    let k3_kl = mean(&|t, r| {
        let d = t - r;
        d.exp_m1() - d
    });
    let prob_diffs: Vec<f64> = pairs
        .iter()
        .map(|&(t, r)| (t.exp() - r.exp()).abs())
        .collect();
    let pd_mean = prob_diffs.iter().sum::<f64>() / n;
    let pd_var = prob_diffs
        .iter()
        .map(|d| (d - pd_mean).powi(2))
        .sum::<f64>()
        / n;
    let train_p: Vec<f64> = pairs.iter().map(|&(t, _)| t.exp()).collect();
    let roll_p: Vec<f64> = pairs.iter().map(|&(_, r)| r.exp()).collect();
    Ok(MismatchMetrics {
        num_tokens: pairs.len(),
        k3_kl,
        mean_log_ratio: mean(&|t, r| t - r),
        mean_abs_log_diff: mean(&|t, r| (t - r).abs()),
        mean_sq_log_diff: mean(&|t, r| (t - r).powi(2)),
        extreme_frac_tau2: mean(&|t, r| f64::from(u8::from((t - r).abs() > ln2))),
        extreme_frac_tau5: mean(&|t, r| f64::from(u8::from((t - r).abs() > ln5))),
        prob_diff_max: prob_diffs.iter().copied().fold(0.0, f64::max),
        prob_diff_mean: pd_mean,
        prob_diff_std: pd_var.sqrt(),
        prob_pearson: pearson(&train_p, &roll_p),
    })
}

/// F(τ) = fraction of unmasked tokens with |Δ| > ln τ, for each τ (each must be > 1).
pub fn extreme_fraction_curve(
    logp_train: &[f32],
    logp_rollout: &[f32],
    mask: Option<&[bool]>,
    taus: &[f64],
) -> Result<Vec<(f64, f64)>, RouteError> {
    if let Some(&bad) = taus.iter().find(|&&t| !(t > 1.0 && t.is_finite())) {
        return Err(RouteError::Argument(format!(
            "tau {bad} must be a finite number > 1"
        )));
    }
    let pairs = deltas(logp_train, logp_rollout, mask)?;
    let n = pairs.len() as f64;
    Ok(taus
        .iter()
        .map(|&tau| {
            let thr = tau.ln();
            let hits = pairs.iter().filter(|&&(t, r)| (t - r).abs() > thr).count();
            (tau, hits as f64 / n)
        })
        .collect())
}

/// Default τ grid for an F(τ) curve: 1.1 … 100, log-spaced.
pub fn default_taus() -> Vec<f64> {
    (0..=20)
        .map(|i| 1.1f64 * (100.0f64 / 1.1).powf(i as f64 / 20.0))
        .collect()
}

/// Pearson correlation; None when the inputs are shorter than 2 or either has zero variance.
pub fn pearson(x: &[f64], y: &[f64]) -> Option<f64> {
    if x.len() != y.len() || x.len() < 2 {
        return None;
    }
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (&a, &b) in x.iter().zip(y) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx).powi(2);
        syy += (b - my).powi(2);
    }
    if sxx <= 0.0 || syy <= 0.0 {
        return None;
    }
    Some(sxy / (sxx * syy).sqrt())
}
