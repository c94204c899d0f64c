//! Choosing a sequence's next token from its row of logits (penalties, the seeded sampler,
//! the raw log-prob) and the rule that ends a sequence: the one definition both engines
//! (the CPU engine and the device engine) sample with, so the same seed gives the same
//! tokens from the same logits.

use rand_chacha::ChaCha8Rng;

use super::penalty::adjust_logits;
use crate::kernels::ops::log_softmax_at;
use crate::request::FinishReason;
use crate::sampler::{sample, SampleScratch, SamplingParams};

/// Samples the token after `tokens` (`prompt_len` prompt tokens, then the output so far)
/// from `logits`; returns it with its log-prob under the raw model distribution (penalties
/// steer sampling, the reported log-prob stays the model's). `adjusted` is scratch.
pub fn sample_next(
    logits: &[f32],
    params: &SamplingParams,
    tokens: &[u32],
    prompt_len: usize,
    rng: &mut ChaCha8Rng,
    scratch: &mut SampleScratch,
    adjusted: &mut Vec<f32>,
) -> (u32, f32) {
    let generated = tokens.len() - prompt_len;
    if params.adjusts_logits(generated) {
        adjusted.clear();
        adjusted.extend_from_slice(logits);
        let (prompt, output) = tokens.split_at(prompt_len);
        adjust_logits(adjusted, params, prompt, output);
        let (tok, _) = sample(adjusted, params, rng, scratch);
        (tok, log_softmax_at(logits, tok as usize))
    } else {
        sample(logits, params, rng, scratch)
    }
}

/// Why a sequence ends after sampling `token` (now `generated` output tokens and
/// `total` tokens in all), or None while it goes on.
pub fn finish_after(
    params: &SamplingParams,
    token: u32,
    generated: usize,
    total: usize,
    max_positions: usize,
) -> Option<FinishReason> {
    if params.stop_token_ids.contains(&token) {
        Some(FinishReason::Stop { token })
    } else if generated >= params.max_new_tokens || total >= max_positions {
        Some(FinishReason::Length)
    } else {
        None
    }
}
