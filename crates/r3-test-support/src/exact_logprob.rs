//! The f64 log-prob tests hold the engines' f32 log-probs against.

/// `log softmax(row · inv_t)[column]` in f64: the exact value an engine's f32 log-prob of
/// `column` at temperature `1 / inv_t` must come within rounding of.
pub fn exact_logprob(row: &[f32], inv_t: f64, column: usize) -> f64 {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
    let sum: f64 = row
        .iter()
        .map(|&v| ((f64::from(v) - max) * inv_t).exp())
        .sum();
    (f64::from(row[column]) - max) * inv_t - sum.ln()
}

#[cfg(test)]
mod tests {
    use super::exact_logprob;

    #[test]
    fn matches_a_hand_computed_softmax() {
        // softmax([0, ln 3] · 1) = [1/4, 3/4]; at inv_t = 2: [1/10, 9/10].
        let row = [0.0_f32, 3.0_f32.ln()];
        assert!((exact_logprob(&row, 1.0, 1) - 0.75_f64.ln()).abs() < 1e-7);
        assert!((exact_logprob(&row, 2.0, 0) - 0.1_f64.ln()).abs() < 1e-6);
    }
}
