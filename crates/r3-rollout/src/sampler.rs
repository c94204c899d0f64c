//! Token sampling: temperature, top-k, top-p, min-p with a seeded per-request RNG, and the
//! log-prob the engine reports for the sampled token. Penalties and logit biases that depend on
//! the sequence are applied before sampling by `engine::penalty`, before the temperature, as
//! SGLang applies them (`SamplingBatchInfo::apply_logits_bias` runs before its sampler divides
//! by the temperature).
//!
//! The reported log-prob is SGLang's (python/sglang/srt/layers/sampler.py): with `l` the row
//! the sampler reads (the logits after penalties and bias), a sampled request's is
//! `log softmax(l / T)[token]` — the distribution the token was drawn from, before
//! top-k / top-p / min-p truncation ([`LogprobScale::Sampling`], the default) — or
//! `log softmax(l)[token]` at any temperature ([`LogprobScale::Raw`], SGLang's
//! `SGLANG_RETURN_ORIGINAL_LOGPROB`); a greedy request's ([`samples_greedily`]) is
//! `log softmax(l)[token]` in both.
//! Top log-probs come from the same distribution. A trainer comparing with the rollout
//! divides its logits by the rollout temperature under Sampling, or asks for Raw.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::RolloutError;
pub use r3_model::sample_rows::LogprobScale;
use r3_model::sample_rows::{sample_row, SampleRowScratch};

use crate::kernels::ops::{fast_exp, lane_sum, log_softmax_at, row_max};

/// How to pick the next token of one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; below [`GREEDY_TEMPERATURE`] (0 included) means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables it.
    pub top_k: usize,
    /// Maximum number of generated tokens.
    pub max_new_tokens: usize,
    /// Generation stops after producing one of these ids (the id is part of the output),
    /// unless `ignore_eos`.
    pub stop_token_ids: Vec<u32>,
    /// No stop id ends generation, the client's own included: SGLang's `ignore_eos`, under
    /// which its token-based finish check (`Req._check_token_based_finish`) returns at once.
    /// `min_new_tokens` still masks `stop_token_ids`, as SGLang's min-new-tokens penalizer
    /// masks them whatever the flag says. (Stop strings are the server's, and still end a
    /// request, as in SGLang.)
    pub ignore_eos: bool,
    /// Seed of this request's RNG (ChaCha8): same seed and logits give the same tokens.
    pub seed: u64,
    /// Drop tokens whose probability is below `min_p` times the top token's; 0 disables it.
    pub min_p: f32,
    /// Subtracted from a logit once per earlier occurrence of the token in the output.
    pub frequency_penalty: f32,
    /// Subtracted from the logit of every token that occurs in the output.
    pub presence_penalty: f32,
    /// Divides positive (multiplies negative) logits of tokens in the output (not the prompt,
    /// as SGLang's repetition penalizer); 1 = off.
    pub repetition_penalty: f32,
    /// Stop ids cannot be sampled before this many tokens were generated.
    pub min_new_tokens: usize,
    /// `(token, bias)` pairs added to the logits before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// Most likely alternatives (token, log-prob) to report per generated token (and per
    /// prompt position when `prompt_logprobs_from` is set); 0 = none.
    pub top_logprobs: usize,
    /// First prompt position of the prompt log-probs to return (SGLang `logprob_start_len`);
    /// None = none. Costs one logits row per prompt position, so only asked-for requests pay.
    /// Prompt log-probs are always the raw distribution's, whatever `logprob_scale` says.
    pub prompt_logprobs_from: Option<usize>,
    /// Which distribution the output log-probs (the sampled token's and its top
    /// alternatives') are taken under: at the sampling temperature (SGLang's default) or at
    /// temperature 1. A greedy request's are at temperature 1 either way.
    pub logprob_scale: LogprobScale,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            seed: 0,
            min_p: 0.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            min_new_tokens: 0,
            logit_bias: Vec::new(),
            top_logprobs: 0,
            prompt_logprobs_from: None,
            logprob_scale: LogprobScale::Sampling,
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
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(RolloutError::InvalidRequest(format!(
                "min_p must be in [0, 1], got {}",
                self.min_p
            )));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(RolloutError::InvalidRequest(format!(
                    "{name} must be in [-2, 2], got {v}"
                )));
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 2.0) {
            return Err(RolloutError::InvalidRequest(format!(
                "repetition_penalty must be in (0, 2] (1 = off), got {}",
                self.repetition_penalty
            )));
        }
        if self.min_new_tokens > self.max_new_tokens {
            return Err(RolloutError::InvalidRequest(format!(
                "min_new_tokens {} exceeds max_new_tokens {}",
                self.min_new_tokens, self.max_new_tokens
            )));
        }
        if let Some((t, b)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return Err(RolloutError::InvalidRequest(format!(
                "logit_bias of token {t} must be finite, got {b}"
            )));
        }
        Ok(())
    }

    /// `1 / T'` where `T'` is the temperature of the distribution the output log-probs are
    /// reported under: `1 / temperature` for a sampled request under
    /// [`LogprobScale::Sampling`], 1 for a greedy one ([`samples_greedily`]) or under
    /// [`LogprobScale::Raw`].
    pub fn logprob_inv_temperature(&self) -> f32 {
        match self.logprob_scale {
            LogprobScale::Sampling if !samples_greedily(self) => 1.0 / self.temperature,
            _ => 1.0,
        }
    }

    /// Whether sampling `token` ends the request: it is one of `stop_token_ids` and the
    /// request does not ignore them (`ignore_eos`).
    pub fn stops_at(&self, token: u32) -> bool {
        !self.ignore_eos && self.stop_token_ids.contains(&token)
    }

    /// Whether logits must be adjusted (penalties, biases, min_new_tokens) before sampling
    /// the token after `generated` tokens.
    pub fn adjusts_logits(&self, generated: usize) -> bool {
        self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
            || generated < self.min_new_tokens
    }
}

/// Reusable buffers of [`sample`] (one per sampling thread).
#[derive(Debug, Default)]
pub struct SampleScratch {
    /// (scaled logit, token) pairs of the truncating (top-k / top-p) path.
    pairs: Vec<(f32, u32)>,
    /// The full-vocabulary path's exponentials and block sums.
    row: SampleRowScratch,
}

/// Samples a token from one row of logits; returns it with its log-prob under the
/// distribution `params.logprob_scale` names ([`SamplingParams::logprob_inv_temperature`]):
/// `log softmax(logits / T)[token]` or `log softmax(logits)[token]`.
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut ChaCha8Rng,
    scratch: &mut SampleScratch,
) -> (u32, f32) {
    let truncating = truncates(params, logits.len());
    if samples_greedily(params) {
        let token = argmax(logits);
        (token as u32, log_softmax_at(logits, token))
    } else if truncating {
        let token = sample_truncated(logits, params, rng, &mut scratch.pairs);
        let logprob = scaled_log_softmax_at(logits, params.logprob_inv_temperature(), token);
        (token as u32, logprob)
    } else {
        sample_full(logits, params, rng, scratch)
    }
}

/// `log softmax(row · inv_t)[index]`: the log-sum-exp of the scaled row summed as
/// [`log_softmax_at`] sums it (at `inv_t` = 1, its bits).
fn scaled_log_softmax_at(row: &[f32], inv_t: f32, index: usize) -> f32 {
    if inv_t == 1.0 {
        return log_softmax_at(row, index);
    }
    let max = row_max(row);
    let sum = lane_sum(row, |z| ((z - max) * inv_t).exp());
    (row[index] - max) * inv_t - sum.ln() as f32
}

/// Samples from `softmax(logits / T)` over the whole vocabulary with one uniform from
/// `rng`: r3-model's [`sample_row`] (an exp pass that also yields block sums, then an
/// inverse-CDF search over the blocks and inside one block), which the device engine runs
/// where the logits live with the same draw.
fn sample_full(
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut ChaCha8Rng,
    scratch: &mut SampleScratch,
) -> (u32, f32) {
    let (pick, logprob) = sample_row(
        logits,
        1.0 / params.temperature,
        full_vocabulary_draw(rng),
        params.logprob_scale,
        &mut scratch.row,
    );
    (pick as u32, logprob)
}

/// The one uniform the full-vocabulary branch of [`sample`] takes from a request's stream
/// (in [0, 1)): what a device draw must take in its place to leave the stream where the
/// host's sampling would.
pub fn full_vocabulary_draw(rng: &mut ChaCha8Rng) -> f64 {
    rng.random::<f64>()
}

/// Whether [`sample`] takes its full-vocabulary branch for `params` over `vocab` columns
/// (not greedy, no top-k below the vocabulary, top-p or min-p): the branch a
/// device can run as [`sample_row`] with [`full_vocabulary_draw`]'s uniform.
pub fn samples_full_vocabulary(params: &SamplingParams, vocab: usize) -> bool {
    !samples_greedily(params) && !truncates(params, vocab)
}

/// Temperatures below this sample greedily: SGLang's `_SAMPLING_EPS`
/// (python/sglang/srt/sampling/sampling_params.py), under which its `__post_init__` turns a
/// request into temperature 1 with top-k 1.
pub const GREEDY_TEMPERATURE: f32 = 1e-6;

/// Whether [`sample`] takes its argmax branch: a temperature below [`GREEDY_TEMPERATURE`]
/// (0 included) or top-k 1, as SGLang decides. Such a request's log-probs are the raw ones
/// (SGLang's are at the temperature 1 it substitutes), and it takes no draw from its stream.
/// Below the threshold `1 / T` could also overflow f32 once multiplied by a logit, making
/// the scaled row's largest value infinite and its exponentials NaN.
pub fn samples_greedily(params: &SamplingParams) -> bool {
    params.temperature < GREEDY_TEMPERATURE || params.top_k == 1
}

/// Whether sampling keeps only part of the vocabulary (top-k below it, top-p, min-p).
fn truncates(params: &SamplingParams, vocab: usize) -> bool {
    (params.top_k > 0 && params.top_k < vocab) || params.top_p < 1.0 || params.min_p > 0.0
}

/// The `n` most likely tokens of `log softmax(logits · inv_t)`, most likely first (ties by
/// id): `inv_t` is 1 for the raw distribution, `1 / T` for the one sampled at `T`
/// ([`SamplingParams::logprob_inv_temperature`]).
pub fn top_logprobs(logits: &[f32], n: usize, inv_t: f32) -> Vec<(u32, f32)> {
    if n == 0 || logits.is_empty() {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    // Scaling by a positive `inv_t` keeps the order of the logits.
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let n = n.min(idx.len());
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by_logit);
        idx.truncate(n);
    }
    idx.sort_unstable_by(by_logit);
    let max = row_max(logits);
    let log_total = |scale: f32| {
        logits
            .iter()
            .map(|&v| (((v - max) * scale) as f64).exp())
            .sum::<f64>()
            .ln() as f32
    };
    if inv_t == 1.0 {
        // The raw distribution's values as they always were: `z − (max + ln Σ)`.
        let lse = max + log_total(1.0);
        return idx
            .into_iter()
            .map(|t| (t, logits[t as usize] - lse))
            .collect();
    }
    let log_total = log_total(inv_t);
    idx.into_iter()
        .map(|t| (t, (logits[t as usize] - max) * inv_t - log_total))
        .collect()
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

/// Samples from the part of `softmax(logits / T)` top-k, top-p and min-p keep, with one
/// uniform from `rng`. Without min-p, top-k and top-p cut jointly, as SGLang's default
/// sampler does (flashinfer's `top_k_top_p_sampling_from_probs` with
/// `filter_apply_order="joint"`, and its pytorch backend): a token is kept when fewer than
/// `top_k` tokens rank above it and the mass of the whole distribution above it is below
/// `top_p`. With min-p they cut one after the other, as SGLang's flashinfer min-p path
/// (`top_k_renorm_prob`, then `top_p_renorm_prob` on what top-k kept, then min-p): top-p's
/// mass is then the top-k renormalised one. SGLang picks that path when any request of its
/// batch has a min-p; r3 decides per request.
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
    // The top token survives every cut, so the whole row's largest value is the kept ones'.
    let max = scratch
        .iter()
        .map(|p| p.0)
        .fold(f32::NEG_INFINITY, f32::max);
    let joint_top_p = params.top_p < 1.0 && params.min_p == 0.0;
    // The whole distribution's normaliser, which joint top-p measures its mass against;
    // summed before the top-k cut drops the tail.
    let row_total = if joint_top_p && k < scratch.len() {
        Some(
            scratch
                .iter()
                .map(|p| fast_exp(p.0 - max) as f64)
                .sum::<f64>(),
        )
    } else {
        None
    };
    // Descending by scaled logit; ties by id for determinism.
    let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    if k < scratch.len() {
        scratch.select_nth_unstable_by(k - 1, by_logit);
        scratch.truncate(k);
    }
    scratch.sort_unstable_by(by_logit);
    let mut total = 0f64;
    for p in scratch.iter_mut() {
        p.0 = fast_exp(p.0 - max);
        total += p.0 as f64;
    }
    if params.top_p < 1.0 {
        // Keep the smallest prefix whose mass reaches top_p (at least one token): a token
        // stays while the mass ranked above it is below top_p, flashinfer's rule. The mass is
        // of the whole row (joint) or of what top-k kept (with min-p).
        let top_p_total = row_total.unwrap_or(total);
        let mut acc = 0f64;
        let mut keep = scratch.len();
        for (i, p) in scratch.iter().enumerate() {
            acc += p.0 as f64 / top_p_total;
            if acc >= params.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        scratch.truncate(keep);
        total = scratch.iter().map(|p| p.0 as f64).sum();
    }
    if params.min_p > 0.0 {
        // Entries hold exp(l - max): the top token's is 1, so the threshold is min_p itself.
        let keep = scratch
            .iter()
            .take_while(|p| p.0 >= params.min_p)
            .count()
            .max(1);
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
        let (t, lp) = sample(
            &logits,
            &params(0.0, 1.0, 0),
            &mut rng,
            &mut SampleScratch::default(),
        );
        assert_eq!(t, 1);
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        assert!((lp - (2.0f32.exp() / z).ln()).abs() < 1e-6);
    }

    /// A temperature so small that `1 / T` overflows f32 samples greedily (its limit): the
    /// largest logit, with and without truncation, and no draw from the stream. Before,
    /// `(z − max) / T` was a NaN at the largest logit and the last column was picked.
    #[test]
    fn a_vanishing_temperature_picks_the_argmax() {
        let logits = [0.5, 2.0, 1.0, -3.0];
        let mut s = SampleScratch::default();
        for top_p in [1.0, 0.9] {
            let mut rng = ChaCha8Rng::seed_from_u64(3);
            let p = params(1e-39, top_p, 0);
            assert!(samples_greedily(&p));
            let (t, lp) = sample(&logits, &p, &mut rng, &mut s);
            assert_eq!(t, 1, "top_p {top_p}");
            assert_eq!(lp, log_softmax_at(&logits, 1));
            assert_eq!(
                rng.random::<u64>(),
                ChaCha8Rng::seed_from_u64(3).random::<u64>(),
                "the stream was drawn from"
            );
        }
    }

    /// The probabilities of the joint top-k/top-p cases below.
    const REVIEW_CASE: [f32; 5] = [0.30, 0.25, 0.20, 0.15, 0.10];

    /// SGLang's default joint top-k/top-p (the review's case): p = [0.30, 0.25, 0.20, 0.15,
    /// 0.10], top-k 2, top-p 0.5. Token 1 has 0.30 of the whole row above it, below 0.5, so
    /// both top tokens stay, drawn 0.30 : 0.25 (token 1 at 0.25 / 0.55 = 0.4545). Before,
    /// top-p measured the top-k renormalised mass (token 0 alone 0.545 >= 0.5) and always
    /// returned token 0.
    #[test]
    fn top_k_and_top_p_cut_jointly_on_the_whole_distribution() {
        let logits = REVIEW_CASE.map(f32::ln);
        let p = SamplingParams {
            top_k: 2,
            top_p: 0.5,
            ..Default::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let mut s = SampleScratch::default();
        let n = 4000;
        let mut seen = [0usize; 5];
        for _ in 0..n {
            seen[sample(&logits, &p, &mut rng, &mut s).0 as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3] + seen[4], 0, "{seen:?}");
        let f1 = seen[1] as f64 / n as f64;
        assert!(
            (f1 - 0.25 / 0.55).abs() < 0.025,
            "token 1 at {f1}: {seen:?}"
        );
        // Qwen3's recommended top-k 20, top-p 0.95 on a row whose top 20 hold 0.9 of the
        // mass (0.045 each) and 80 more share the rest: every one of the 20 has at most
        // 19 × 0.045 = 0.855 above it, below 0.95, so all 20 stay. Renormalised over the
        // top 20 (each 0.05), top-p would have stopped at 19 tokens.
        let mut logits = vec![(0.1f32 / 80.0).ln(); 100];
        logits[..20].fill(0.045f32.ln());
        let p = SamplingParams {
            top_k: 20,
            top_p: 0.95,
            ..Default::default()
        };
        let mut seen = [0usize; 100];
        for _ in 0..20_000 {
            seen[sample(&logits, &p, &mut rng, &mut s).0 as usize] += 1;
        }
        assert!(seen[..20].iter().all(|&c| c > 0), "{:?}", &seen[..20]);
        assert_eq!(seen[20..].iter().sum::<usize>(), 0);
    }

    /// With a min-p, top-p is measured on the top-k renormalised mass, SGLang's flashinfer
    /// min-p path (`top_k_renorm_prob`, `top_p_renorm_prob`, then min-p): the case above at
    /// min-p 0.01 renormalises to [0.545, 0.455], where token 0 alone reaches 0.5.
    #[test]
    fn with_min_p_top_p_cuts_what_top_k_kept() {
        let logits = REVIEW_CASE.map(f32::ln);
        let p = SamplingParams {
            top_k: 2,
            top_p: 0.5,
            min_p: 0.01,
            ..Default::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let mut s = SampleScratch::default();
        for _ in 0..500 {
            assert_eq!(sample(&logits, &p, &mut rng, &mut s).0, 0);
        }
    }

    /// SGLang makes a temperature below 1e-6 greedy (temperature 1, top-k 1): T = 1e-7 on
    /// [2.0, 1.5, 0.0] gives token 0 with the raw log-prob 2 − ln(e² + e^1.5 + 1) =
    /// −0.554957 (before: 0.0, the row at T = 1e-7), raw top log-probs (token 1's
    /// −1.054957), and no draw from the stream. At T = 1e-37 with top-k 3 on
    /// [40, 39, 38, 0] the scaled logits overflowed to +inf and the truncating branch
    /// returned its last kept token, 2; it is the argmax now. T = 2e-6 still samples.
    #[test]
    fn temperatures_below_sglangs_epsilon_are_greedy() {
        let logits = [2.0f32, 1.5, 0.0];
        let p = params(1e-7, 1.0, 0);
        assert!(samples_greedily(&p));
        assert_eq!(p.logprob_inv_temperature(), 1.0);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut s = SampleScratch::default();
        let (tok, lp) = sample(&logits, &p, &mut rng, &mut s);
        assert_eq!(tok, 0);
        assert!((f64::from(lp) - (-0.5549569196419908)).abs() < 1e-6, "{lp}");
        let top = top_logprobs(&logits, 2, p.logprob_inv_temperature());
        assert_eq!(top[1].0, 1);
        assert!((f64::from(top[1].1) - (-1.0549569196419908)).abs() < 1e-6);
        assert_eq!(
            rng.random::<u64>(),
            ChaCha8Rng::seed_from_u64(5).random::<u64>(),
            "the stream was drawn from"
        );
        let p = params(1e-37, 1.0, 3);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (tok, _) = sample(&[40.0, 39.0, 38.0, 0.0], &p, &mut rng, &mut s);
        assert_eq!(tok, 0);
        assert!(!samples_greedily(&params(2e-6, 1.0, 0)));
    }

    #[test]
    fn top_k_and_top_p_never_leave_the_allowed_set() {
        let logits = [0.0, 3.0, 2.9, 1.0, -1.0];
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut s = SampleScratch::default();
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
                .filter(|_| {
                    sample(
                        &logits,
                        &params(t, 1.0, 0),
                        &mut rng,
                        &mut SampleScratch::default(),
                    )
                    .0 == 1
                })
                .count();
            let e = (1.0 / t as f64).exp();
            let p1 = e / (1.0 + e);
            let f = ones as f64 / n as f64;
            assert!((f - p1).abs() < 0.015, "T={t}: freq {f} vs {p1}");
        }
    }

    #[test]
    fn full_vocabulary_sampling_spans_blocks_and_reports_raw_logprob() {
        // Mass in three blocks (first, middle, last partial one) of a 600-token vocabulary.
        let mut logits = vec![-4.0f32; 600];
        logits[10] = 2.0;
        logits[300] = 2.5;
        logits[599] = 1.5;
        let lse = {
            let m = 2.5f64;
            m + logits
                .iter()
                .map(|&v| (v as f64 - m).exp())
                .sum::<f64>()
                .ln()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut s = SampleScratch::default();
        let n = 20000;
        let mut counts = std::collections::HashMap::new();
        for _ in 0..n {
            let (t, lp) = sample(&logits, &params(1.0, 1.0, 0), &mut rng, &mut s);
            let want = logits[t as usize] as f64 - lse;
            assert!((lp as f64 - want).abs() < 1e-5, "token {t}: {lp} vs {want}");
            *counts.entry(t).or_insert(0usize) += 1;
        }
        for t in [10u32, 300, 599] {
            let p = (logits[t as usize] as f64 - lse).exp();
            let f = counts.get(&t).copied().unwrap_or(0) as f64 / n as f64;
            assert!((f - p).abs() < 0.015, "token {t}: freq {f} vs {p}");
        }
        // The rest (597 tokens at -4) share the remaining mass.
        let rest: usize = counts
            .iter()
            .filter(|(t, _)| ![10, 300, 599].contains(*t))
            .map(|(_, c)| c)
            .sum();
        let p_rest = 597.0 * (-4.0 - lse).exp();
        assert!((rest as f64 / n as f64 - p_rest).abs() < 0.015);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..20)
                .map(|_| {
                    sample(
                        &logits,
                        &params(0.8, 0.9, 10),
                        &mut rng,
                        &mut SampleScratch::default(),
                    )
                    .0
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn min_p_keeps_tokens_within_the_ratio_of_the_top_one() {
        // p ∝ e^[2, 1.5, 0, -1]: relative to the top, [1, 0.61, 0.14, 0.05]; min_p 0.5 keeps 0, 1.
        let logits = [2.0f32, 1.5, 0.0, -1.0];
        let p = SamplingParams {
            min_p: 0.5,
            ..Default::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut s = SampleScratch::default();
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[sample(&logits, &p, &mut rng, &mut s).0 as usize] += 1;
        }
        assert_eq!((seen[2], seen[3]), (0, 0), "{seen:?}");
        // Both kept tokens appear, in the renormalised ratio 1 : e^-0.5.
        let f1 = seen[1] as f64 / 2000.0;
        let want = (-0.5f64).exp() / (1.0 + (-0.5f64).exp());
        assert!((f1 - want).abs() < 0.04, "{f1} vs {want}");
    }

    #[test]
    fn top_logprobs_are_the_largest_log_softmax_entries() {
        let logits = [0.5f32, 3.0, -1.0, 3.0, 2.0];
        let z: f64 = logits.iter().map(|&v| (v as f64).exp()).sum();
        let top = top_logprobs(&logits, 3, 1.0);
        let ids: Vec<u32> = top.iter().map(|p| p.0).collect();
        assert_eq!(ids, vec![1, 3, 4]);
        for (t, lp) in top {
            let want = (logits[t as usize] as f64).exp() / z;
            assert!((lp as f64 - want.ln()).abs() < 1e-5);
        }
        assert!(top_logprobs(&logits, 0, 1.0).is_empty());
        assert_eq!(top_logprobs(&logits, 9, 1.0).len(), 5);
    }

    /// `log softmax(z · inv_t)[token]` in f64, by hand.
    fn exact_logprob(z: &[f32], inv_t: f64, token: usize) -> f64 {
        let total: f64 = z.iter().map(|&v| (f64::from(v) * inv_t).exp()).sum();
        f64::from(z[token]) * inv_t - total.ln()
    }

    /// At T = 0.7 the reported log-prob is the hand-computed `log softmax(z / T)[token]`
    /// (SGLang's default) on both sampling branches, the full-vocabulary one and the
    /// truncating one (before truncation: top-k 3 keeps a renormalised share, the log-prob
    /// is still of the whole tempered row); under [`LogprobScale::Raw`] it is
    /// `log softmax(z)[token]`; a greedy request's is `log softmax(z)` under both; and the
    /// tokens do not depend on the scale.
    #[test]
    fn reported_logprobs_follow_the_scale() {
        let z = [0.3f32, 2.0, -1.0, 1.2, 0.7, -0.4];
        let mut s = SampleScratch::default();
        let mut seen_scaled_apart = 0;
        for top_k in [0usize, 3] {
            for seed in 0..40u64 {
                let at = |scale: LogprobScale, temperature: f32| {
                    let p = SamplingParams {
                        temperature,
                        top_k,
                        logprob_scale: scale,
                        ..Default::default()
                    };
                    let mut rng = ChaCha8Rng::seed_from_u64(seed);
                    let mut s = SampleScratch::default();
                    sample(&z, &p, &mut rng, &mut s)
                };
                let (tok, scaled) = at(LogprobScale::Sampling, 0.7);
                let (raw_tok, raw) = at(LogprobScale::Raw, 0.7);
                assert_eq!(tok, raw_tok, "the scale moved the token");
                let want_scaled = exact_logprob(&z, 1.0 / 0.7, tok as usize);
                let want_raw = exact_logprob(&z, 1.0, tok as usize);
                assert!(
                    (f64::from(scaled) - want_scaled).abs() < 1e-5,
                    "top-k {top_k}, token {tok}: {scaled} vs {want_scaled}"
                );
                assert!(
                    (f64::from(raw) - want_raw).abs() < 1e-5,
                    "top-k {top_k}, token {tok}: {raw} vs {want_raw}"
                );
                seen_scaled_apart += usize::from((want_scaled - want_raw).abs() > 1e-2);
            }
        }
        assert!(
            seen_scaled_apart > 40,
            "only {seen_scaled_apart} draws tell them apart"
        );
        for scale in [LogprobScale::Sampling, LogprobScale::Raw] {
            let p = SamplingParams {
                logprob_scale: scale,
                ..SamplingParams::greedy(1)
            };
            let mut rng = ChaCha8Rng::seed_from_u64(0);
            let (tok, lp) = sample(&z, &p, &mut rng, &mut s);
            assert_eq!(tok, 1);
            assert!(
                (f64::from(lp) - exact_logprob(&z, 1.0, 1)).abs() < 1e-6,
                "{scale:?}"
            );
            assert_eq!(p.logprob_inv_temperature(), 1.0);
        }
    }

    /// Top log-probs at `1 / T` are the hand-computed `log softmax(z / T)` of the most likely
    /// tokens (the order of the raw ones), and at 1 the raw ones.
    #[test]
    fn top_logprobs_at_a_temperature_are_the_tempered_distributions() {
        let z = [0.5f32, 3.0, -1.0, 2.5, 2.0];
        for t in [0.7f64, 1.0, 1.5] {
            let top = top_logprobs(&z, 3, (1.0 / t) as f32);
            let ids: Vec<u32> = top.iter().map(|p| p.0).collect();
            assert_eq!(ids, vec![1, 3, 4], "T {t}");
            for (tok, lp) in top {
                let want = exact_logprob(&z, (1.0 / t) as f32 as f64, tok as usize);
                assert!(
                    (f64::from(lp) - want).abs() < 1e-5,
                    "T {t}, {tok}: {lp} vs {want}"
                );
            }
        }
        let p = SamplingParams {
            temperature: 0.7,
            ..Default::default()
        };
        assert_eq!(p.logprob_scale, LogprobScale::Sampling, "SGLang's default");
        assert_eq!(p.logprob_inv_temperature(), 1.0 / 0.7);
        let raw = SamplingParams {
            logprob_scale: LogprobScale::Raw,
            ..p
        };
        assert_eq!(raw.logprob_inv_temperature(), 1.0);
    }

    #[test]
    fn bad_params_are_rejected() {
        assert!(params(-1.0, 1.0, 0).validate().is_err());
        assert!(params(1.0, 0.0, 0).validate().is_err());
        assert!(params(f32::NAN, 1.0, 0).validate().is_err());
        assert!(params(0.7, 0.9, 5).validate().is_ok());
        for bad in [
            SamplingParams {
                min_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                frequency_penalty: 2.5,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            SamplingParams {
                min_new_tokens: 17,
                ..Default::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
