//! Choosing a sequence's next token from its row of logits (penalties, the seeded sampler,
//! the reported log-prob) and the rule that ends a sequence: the one definition both engines
//! (the CPU engine and the device engine) sample with, so the same seed gives the same
//! tokens from the same logits.

use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::penalty::adjust_logits;
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
    /// Prompt tokens at the front of `tokens` in this call (the stop rules count the output
    /// past them).
    pub prompt_len: usize,
    /// Where the request's output begins in `tokens`: `prompt_len`, or, for a resumed
    /// request, the original prompt's end before it (the continuation's prompt holds the
    /// earlier call's output). The penalties count the output from here, so a resumed
    /// sequence is sampled as the uninterrupted one.
    pub output_start: usize,
    /// Prompt then output so far; the sampled token is appended.
    pub tokens: &'a mut Vec<u32>,
    /// The request's own seeded stream.
    pub rng: &'a mut ChaCha8Rng,
    /// Log-probs of the output so far (under the distribution the request's
    /// `logprob_scale` names); the new token's is appended.
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

/// A next token decided where the logits live, with the log-prob the sampler reports for
/// it: the argmax (the first index of the largest value) with its raw log-prob, or the draw
/// of [`crate::sampler::sample`]'s full-vocabulary branch with its log-prob under the
/// distribution the request's `logprob_scale` names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowPick {
    /// The chosen column of the row.
    pub token: u32,
    /// `log softmax(row)[token]` (greedy, or [`crate::sampler::LogprobScale::Raw`]) or
    /// `log softmax(row / T)[token]` ([`crate::sampler::LogprobScale::Sampling`]).
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
/// RL rollout's untruncated sampling), with no penalty, bias or minimum length adjusting
/// the logits this step and no top log-probs.
pub fn drawn_pick_suffices(params: &SamplingParams, generated: usize, vocab: usize) -> bool {
    samples_full_vocabulary(params, vocab)
        && !params.adjusts_logits(generated)
        && params.top_logprobs == 0
}

/// Samples every slot's next token, in parallel over the slots: each draws from its own
/// seeded stream, so the tokens do not depend on the number of threads or the order; a
/// slot whose request asks for no new token (`max_new_tokens` 0) finishes instead. The
/// host's share of a decode step at large batches is mostly this (a log-softmax over the
/// vocabulary per sequence).
pub fn sample_slots(slots: &mut [NextTokenSlot<'_>], max_positions: usize) {
    slots.par_iter_mut().for_each_init(
        || (SampleScratch::default(), Vec::new()),
        |(scratch, adjusted), slot| {
            // A request for no new token (SGLang's prompt-only request: prompt log-probs,
            // routes) ends at its prefill with nothing sampled. A device pick made for it
            // is dropped; its stream matters no more, as the request is done.
            if slot.params.max_new_tokens == 0 {
                *slot.finish = Some(FinishReason::Length);
                return;
            }
            let (tok, lp) = match slot.logits {
                NextTokenLogits::Row(logits) => {
                    let row = sampled_row(
                        logits,
                        slot.params,
                        slot.tokens,
                        (slot.output_start, slot.prompt_len),
                        adjusted,
                    );
                    let picked = sample(row, slot.params, slot.rng, scratch);
                    if slot.params.top_logprobs > 0 {
                        // From the distribution the token's own log-prob is taken under.
                        slot.top_logprobs.push(top_logprobs(
                            row,
                            slot.params.top_logprobs,
                            slot.params.logprob_inv_temperature(),
                        ));
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

/// The row the token after `tokens` is sampled from: `logits` as they are, or (where
/// penalties, biases or a minimum length adjust them this step) their copy in `adjusted`,
/// adjusted. `(output_start, prompt_len)`: where the request's output and this call's
/// begin in `tokens` ([`NextTokenSlot`]). The reported log-prob and top log-probs are taken
/// from it too, as SGLang takes them from the logits after its `apply_logits_bias`.
fn sampled_row<'r>(
    logits: &'r [f32],
    params: &SamplingParams,
    tokens: &[u32],
    (output_start, prompt_len): (usize, usize),
    adjusted: &'r mut Vec<f32>,
) -> &'r [f32] {
    let generated = tokens.len() - prompt_len;
    if !params.adjusts_logits(generated) {
        return logits;
    }
    adjusted.clear();
    adjusted.extend_from_slice(logits);
    let output = &tokens[output_start.min(prompt_len)..];
    adjust_logits(adjusted, params, output, generated);
    adjusted
}

/// Why a sequence ends after sampling `token` (now `generated` output tokens and
/// `total` tokens in all), or None while it goes on: a stop id unless the request ignores
/// them ([`SamplingParams::stops_at`]), then the token budget or the context.
pub fn finish_after(
    params: &SamplingParams,
    token: u32,
    generated: usize,
    total: usize,
    max_positions: usize,
) -> Option<FinishReason> {
    if params.stops_at(token) {
        Some(FinishReason::Stop { token })
    } else if generated >= params.max_new_tokens || total >= max_positions {
        Some(FinishReason::Length)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SGLang's `ignore_eos` returns from the token-based finish check before it looks at
    /// any stop id, the client's own included: stop id 7 ends the request without it and
    /// not with it, where the budget (4) still does.
    #[test]
    fn ignore_eos_ignores_every_stop_id() {
        let mut params = SamplingParams {
            stop_token_ids: vec![7],
            max_new_tokens: 4,
            ..Default::default()
        };
        assert_eq!(
            finish_after(&params, 7, 1, 3, 100),
            Some(FinishReason::Stop { token: 7 })
        );
        params.ignore_eos = true;
        assert_eq!(finish_after(&params, 7, 1, 3, 100), None);
        assert_eq!(
            finish_after(&params, 7, 4, 6, 100),
            Some(FinishReason::Length)
        );
        assert_eq!(
            finish_after(&params, 7, 2, 100, 100),
            Some(FinishReason::Length)
        );
    }

    /// The repetition penalty counts output tokens only, as SGLang's
    /// `BatchedRepetitionPenalizer` (it has no prompt hook). Logits [2, -1, 0.5, 3, 1],
    /// penalty 2: with prompt [1, 4] and no output yet the row is unchanged; after output
    /// [3], token 3 alone is scaled (3 / 2 = 1.5). A resumed call (prompt [1, 4] then the
    /// earlier call's output [0], `output_start` 2) penalises that output (2 / 2 = 1) and
    /// not the original prompt.
    #[test]
    fn repetition_penalty_skips_the_prompt() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let logits = [2.0f32, -1.0, 0.5, 3.0, 1.0];
        let mut adjusted = Vec::new();
        let row = sampled_row(&logits, &params, &[1, 4], (2, 2), &mut adjusted);
        assert_eq!(row, [2.0, -1.0, 0.5, 3.0, 1.0]);
        let row = sampled_row(&logits, &params, &[1, 4, 3], (2, 2), &mut adjusted);
        assert_eq!(row, [2.0, -1.0, 0.5, 1.5, 1.0]);
        let row = sampled_row(&logits, &params, &[1, 4, 0], (2, 3), &mut adjusted);
        assert_eq!(row, [1.0, -1.0, 0.5, 3.0, 1.0]);
    }
}
