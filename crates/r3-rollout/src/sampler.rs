//! Token sampling: temperature, top-k, top-p with a seeded per-request RNG, and the log-prob
//! the engine reports for the sampled token.
//!
//! The reported log-prob is always `log softmax(logits)[token]` — the raw model distribution
//! at temperature 1, before top-k/top-p truncation — as verl and SGLang report it. This is the
//! `rollout_logp` the trainer compares with its own `log softmax(logits_train)[token]`.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::RolloutError;
use crate::kernels::ops::{fast_exp, log_softmax_at};

/// How to pick the next token of one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables it.
    pub top_k: usize,
    /// Maximum number of generated tokens.
    pub max_new_tokens: usize,
    /// Generation stops after producing one of these ids (the id is part of the output).
    pub stop_token_ids: Vec<u32>,
    /// Seed of this request's RNG (ChaCha8): same seed and logits give the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 16,
            stop_token_ids: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize) -> Self {
        SamplingParams {
            temperature: 0.0,
            max_new_tokens,
            ..Default::default()
        }
    }

    /// Checks every field; the error names the bad one.
    pub fn validate(&self) -> Result<(), RolloutError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(RolloutError::InvalidRequest(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(RolloutError::InvalidRequest(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// Samples a token from one row of logits; returns `(token, log softmax(logits)[token])`.
/// `scratch` is reused between calls to avoid allocation.
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut ChaCha8Rng,
    scratch: &mut Vec<(f32, u32)>,
) -> (u32, f32) {
    let token = if params.temperature == 0.0 || params.top_k == 1 {
        argmax(logits)
    } else if params.temperature == 1.0 && params.top_k == 0 && params.top_p >= 1.0 {
        // Plain sampling from softmax(logits): inverse CDF without building pairs.
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total: f64 = logits.iter().map(|&v| fast_exp(v - max) as f64).sum();
        let mut u = rng.random::<f64>() * total;
        let mut pick = logits.len() - 1;
        for (i, &v) in logits.iter().enumerate() {
            u -= fast_exp(v - max) as f64;
            if u < 0.0 {
                pick = i;
                break;
            }
        }
        pick
    } else {
        sample_truncated(logits, params, rng, scratch)
    };
    (token as u32, log_softmax_at(logits, token))
}

/// Index of the largest logit (the first one on ties, as torch.argmax).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best
}

fn sample_truncated(
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut ChaCha8Rng,
    scratch: &mut Vec<(f32, u32)>,
) -> usize {
    let inv_t = 1.0 / params.temperature;
    scratch.clear();
    scratch.extend(
        logits
            .iter()
            .enumerate()
            .map(|(i, v)| (v * inv_t, i as u32)),
    );
    let k = if params.top_k == 0 {
        scratch.len()
    } else {
        params.top_k.min(scratch.len())
    };
    let truncating = k < scratch.len() || params.top_p < 1.0;
    if truncating {
        // Descending by scaled logit; ties by id for determinism.
        let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if k < scratch.len() {
            scratch.select_nth_unstable_by(k - 1, by_logit);
            scratch.truncate(k);
        }
        scratch.sort_unstable_by(by_logit);
    }
    let max = scratch
        .iter()
        .map(|p| p.0)
        .fold(f32::NEG_INFINITY, f32::max);
    let mut total = 0f64;
    for p in scratch.iter_mut() {
        p.0 = fast_exp(p.0 - max);
        total += p.0 as f64;
    }
    if params.top_p < 1.0 {
        // Keep the smallest prefix whose mass reaches top_p (at least one token).
        let mut acc = 0f64;
        let mut keep = scratch.len();
        for (i, p) in scratch.iter().enumerate() {
            acc += p.0 as f64 / total;
            if acc >= params.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        scratch.truncate(keep);
        total = scratch.iter().map(|p| p.0 as f64).sum();
    }
    let mut u = rng.random::<f64>() * total;
    for p in scratch.iter() {
        u -= p.0 as f64;
        if u < 0.0 {
            return p.1 as usize;
        }
    }
    scratch.last().map_or(0, |p| p.1 as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn params(t: f32, top_p: f32, top_k: usize) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_p,
            top_k,
            ..Default::default()
        }
    }

    #[test]
    fn greedy_picks_argmax_and_reports_raw_logprob() {
        let logits = [0.0, 2.0, 1.0];
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let (t, lp) = sample(&logits, &params(0.0, 1.0, 0), &mut rng, &mut Vec::new());
        assert_eq!(t, 1);
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        assert!((lp - (2.0f32.exp() / z).ln()).abs() < 1e-6);
    }

    #[test]
    fn top_k_and_top_p_never_leave_the_allowed_set() {
        let logits = [0.0, 3.0, 2.9, 1.0, -1.0];
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut s = Vec::new();
        for _ in 0..200 {
            let (t, _) = sample(&logits, &params(1.0, 1.0, 2), &mut rng, &mut s);
            assert!(t == 1 || t == 2);
            // p(1) ≈ 0.46, p(2) ≈ 0.42 at T=1: top_p 0.5 keeps tokens 1 and 2.
            let (t, _) = sample(&logits, &params(1.0, 0.5, 0), &mut rng, &mut s);
            assert!(t == 1 || t == 2);
            let (t, _) = sample(&logits, &params(1.0, 0.1, 0), &mut rng, &mut s);
            assert_eq!(t, 1);
        }
    }

    #[test]
    fn frequencies_follow_the_tempered_distribution() {
        let logits = [0.0f32, 1.0];
        for t in [1.0f32, 2.0] {
            let mut rng = ChaCha8Rng::seed_from_u64(3);
            let n = 20000;
            let ones = (0..n)
                .filter(|_| sample(&logits, &params(t, 1.0, 0), &mut rng, &mut Vec::new()).0 == 1)
                .count();
            let e = (1.0 / t as f64).exp();
            let p1 = e / (1.0 + e);
            let f = ones as f64 / n as f64;
            assert!((f - p1).abs() < 0.015, "T={t}: freq {f} vs {p1}");
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..20)
                .map(|_| sample(&logits, &params(0.8, 0.9, 10), &mut rng, &mut Vec::new()).0)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn bad_params_are_rejected() {
        assert!(params(-1.0, 1.0, 0).validate().is_err());
        assert!(params(1.0, 0.0, 0).validate().is_err());
        assert!(params(f32::NAN, 1.0, 0).validate().is_err());
        assert!(params(0.7, 0.9, 5).validate().is_ok());
    }
}
