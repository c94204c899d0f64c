//! Choosing a sequence's next token from its row of logits (penalties, the seeded sampler,
//! the raw log-prob) and the rule that ends a sequence: the one definition both engines
//! (the CPU engine and the device engine) sample with, so the same seed gives the same
//! tokens from the same logits.

use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::penalty::adjust_logits;
use crate::kernels::ops::log_softmax_at;
use crate::request::FinishReason;
use crate::sampler::{
    sample, samples_full_vocabulary, samples_greedily, top_logprobs, SampleScratch, SamplingParams,
};

/// One running sequence's sampling state for a step, borrowed from either engine's own
/// bookkeeping: what [`sample_slots`] reads and appends to.
pub struct NextTokenSlot<'a> {
    /// The sequence's row of logits for this step, or its greedy pick made where they live.
    pub logits: NextTokenLogits<'a>,
    /// The request's sampling parameters.
    pub params: &'a SamplingParams,
    /// Prompt tokens at the front of `tokens`.
    pub prompt_len: usize,
    /// Prompt then output so far; the sampled token is appended.
    pub tokens: &'a mut Vec<u32>,
    /// The request's own seeded stream.
    pub rng: &'a mut ChaCha8Rng,
    /// Raw log-probs of the output so far; the new token's is appended.
    pub logprobs: &'a mut Vec<f32>,
    /// Top log-probs per output token, appended when the request asks for them.
    pub top_logprobs: &'a mut Vec<Vec<(u32, f32)>>,
    /// Set when the sequence ends with this token.
    pub finish: &'a mut Option<FinishReason>,
}

/// What a slot's next token is chosen from.
#[derive(Debug, Clone, Copy)]
pub enum NextTokenLogits<'a> {
    /// The sequence's whole row of logits.
    Row(&'a [f32]),
    /// The token chosen where the row's logits live: its greedy pick (for a slot
    /// [`greedy_pick_suffices`] holds for), or its draw from the whole distribution (for a
    /// slot [`drawn_pick_suffices`] holds for) with the one uniform its sampling takes from
    /// the slot's stream, already taken.
    Picked(RowPick),
}

/// A next token decided where the logits live, with its log-prob under the raw
/// distribution: the argmax (the first index of the largest value), or the draw of
/// [`crate::sampler::sample`]'s full-vocabulary branch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowPick {
    /// The chosen column of the row.
    pub token: u32,
    /// `log softmax(row)[token]`.
    pub logprob: f32,
}

/// Whether a sequence with `generated` output tokens so far needs only its row's greedy
/// pick: greedy sampling ([`sample`]'s argmax branch, [`samples_greedily`]), no
/// penalty, bias or minimum length adjusting the logits this step, no top log-probs.
pub fn greedy_pick_suffices(params: &SamplingParams, generated: usize) -> bool {
    samples_greedily(params) && !params.adjusts_logits(generated) && params.top_logprobs == 0
}

/// Whether a sequence with `generated` output tokens so far over a `vocab`-column row needs
/// only a draw from the row's whole distribution ([`sample`]'s full-vocabulary branch: an
/// RL rollout's temperature-1 sampling), with no penalty, bias or minimum length adjusting
/// the logits this step and no top log-probs.
pub fn drawn_pick_suffices(params: &SamplingParams, generated: usize, vocab: usize) -> bool {
    samples_full_vocabulary(params, vocab)
        && !params.adjusts_logits(generated)
        && params.top_logprobs == 0
}

/// Samples every slot's next token, in parallel over the slots: each draws from its own
/// seeded stream, so the tokens do not depend on the number of threads or the order. The
/// host's share of a decode step at large batches is mostly this (a log-softmax over the
/// vocabulary per sequence).
pub fn sample_slots(slots: &mut [NextTokenSlot<'_>], max_positions: usize) {
    slots.par_iter_mut().for_each_init(
        || (SampleScratch::default(), Vec::new()),
        |(scratch, adjusted), slot| {
            let (tok, lp) = match slot.logits {
                NextTokenLogits::Row(logits) => {
                    let picked = sample_next(
                        logits,
                        slot.params,
                        slot.tokens,
                        slot.prompt_len,
                        slot.rng,
                        scratch,
                        adjusted,
                    );
                    if slot.params.top_logprobs > 0 {
                        slot.top_logprobs
                            .push(top_logprobs(logits, slot.params.top_logprobs));
                    }
                    picked
                }
                // The argmax branch draws nothing from the stream and the full-vocabulary
                // branch one uniform, taken when the pick was made: the stream is where
                // sampling the row here would have left it.
                NextTokenLogits::Picked(pick) => (pick.token, pick.logprob),
            };
            slot.tokens.push(tok);
            slot.logprobs.push(lp);
            *slot.finish = finish_after(
                slot.params,
                tok,
                slot.tokens.len() - slot.prompt_len,
                slot.tokens.len(),
                max_positions,
            );
        },
    );
}

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
