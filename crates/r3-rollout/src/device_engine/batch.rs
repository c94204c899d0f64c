//! The device engine's padded batch: sequences left-padded to a common length so that every
//! step writes the same KV slot for all of them (one append per layer), each sequence at its
//! own RoPE positions, with the additive masks and the route rows that layout implies.

use rand_chacha::ChaCha8Rng;

use crate::engine::sequence::{ResumeState, RouteGeometry};
use crate::request::{FinishReason, GenerateRequest, RequestId};

/// One request in the running batch.
#[derive(Debug)]
pub struct Row {
    /// Request id.
    pub id: RequestId,
    /// The request.
    pub request: GenerateRequest,
    /// Sampler RNG (seeded from the request).
    pub rng: ChaCha8Rng,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    /// Prompt length.
    pub prompt_len: usize,
    /// Padding slots in front of this sequence (its position `p` sits in slot `pad + p`).
    pub pad: usize,
    /// Log-prob of each generated token (raw distribution).
    pub logprobs: Vec<f32>,
    /// Most likely alternatives of each generated token (when asked for).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Captured route rows of positions `0..` (`RouteGeometry::row` ids each).
    pub routes: Vec<u16>,
    /// Weight version of each captured row.
    pub route_versions: Vec<u64>,
    /// Whether routes are captured.
    pub capture: bool,
    /// Prompt log-probs, once the prefill computed them (when asked for).
    pub prompt_logprobs: Option<crate::request::PromptLogprobs>,
    /// Why it finished, once it has.
    pub finish: Option<FinishReason>,
    /// The aborted call this row continues (its prompt holds that call's output too).
    pub resume: Option<ResumeState>,
}

impl Row {
    /// Tokens generated so far.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// End of the prompt whose log-probs are reported: the original prompt of a resumed
    /// request (its prompt's tail is the earlier call's output).
    pub fn prompt_logprobs_end(&self) -> usize {
        self.resume
            .as_ref()
            .map_or(self.prompt_len, |r| r.earlier.request.input_ids.len())
    }

    /// The slots a padded batch holds for this row at most: its padding, prompt and every
    /// token it may generate.
    pub fn reach(&self) -> usize {
        self.pad + self.prompt_len + self.request.sampling.max_new_tokens
    }
}

/// What a step feeds, laid out for [`r3_model::model::decode::Step`].
#[derive(Debug, Default)]
pub struct StepLayout {
    /// `[batch, time]` token ids.
    pub tokens: Vec<u32>,
    /// `[batch, time]` positions.
    pub positions: Vec<u32>,
    /// `[batch, time, slots + time]` additive mask.
    pub mask: Vec<f32>,
    /// Slots fed per sequence.
    pub time: usize,
}

/// Whether the query in slot `query` of a sequence starting at slot `pad` sees the key in
/// slot `key`: causal, never padding, within the sliding window if any. A padding query
/// sees itself only, so no mask row is empty (its output is never used).
fn visible(query: usize, key: usize, pad: usize, window: Option<usize>) -> bool {
    if query < pad {
        return key == query;
    }
    key >= pad && key <= query && window.is_none_or(|w| query - key < w)
}

/// The prefill of `rows` (prompts left-padded to the longest, padding slots fed token 0 at
/// position 0).
pub fn prefill_layout(rows: &[Row], window: Option<usize>) -> StepLayout {
    let time = rows.iter().map(|r| r.tokens.len()).max().unwrap_or(0);
    let mut out = StepLayout {
        time,
        ..StepLayout::default()
    };
    for row in rows {
        for slot in 0..time {
            match slot.checked_sub(row.pad) {
                Some(p) => {
                    out.tokens.push(row.tokens[p]);
                    out.positions.push(p as u32);
                }
                None => {
                    out.tokens.push(0);
                    out.positions.push(0);
                }
            }
            for key in 0..time {
                out.mask
                    .push(mask_value(visible(slot, key, row.pad, window)));
            }
        }
    }
    out
}

/// One decode step: each row's last token into slot `slots` (the slots already cached).
pub fn decode_layout(rows: &[Row], slots: usize, window: Option<usize>) -> StepLayout {
    let mut out = StepLayout {
        time: 1,
        ..StepLayout::default()
    };
    for row in rows {
        out.tokens.push(row.tokens[row.tokens.len() - 1]);
        out.positions.push((slots - row.pad) as u32);
        for key in 0..=slots {
            out.mask
                .push(mask_value(visible(slots, key, row.pad, window)));
        }
    }
    out
}

fn mask_value(visible: bool) -> f32 {
    if visible {
        0.0
    } else {
        f32::NEG_INFINITY
    }
}

/// Appends to each capturing row the route rows of its real slots among the `time` slots a
/// step fed from slot `first`: `routes` holds per MoE layer `[batch · time · top_k]` ids.
pub fn capture_routes(
    rows: &mut [Row],
    routes: &[Vec<u32>],
    geo: &RouteGeometry,
    first: usize,
    time: usize,
    version: u64,
) {
    let k = geo.top_k;
    for (b, row) in rows.iter_mut().enumerate() {
        if !row.capture {
            continue;
        }
        for slot in first.max(row.pad)..first + time {
            let at = (b * time + slot - first) * k;
            for column in routes {
                row.routes
                    .extend(column[at..at + k].iter().map(|&e| e as u16));
            }
            row.route_versions.push(version);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_is_invisible_and_padding_queries_see_themselves() {
        // pad 2: slots 0, 1 are padding.
        assert!(visible(0, 0, 2, None) && !visible(0, 1, 2, None));
        assert!(visible(1, 1, 2, None) && !visible(1, 0, 2, None));
        assert!(!visible(3, 1, 2, None) && visible(3, 2, 2, None) && visible(3, 3, 2, None));
        assert!(!visible(3, 4, 2, None), "causal");
        // window 2 from slot 5: keys 4 and 5 only.
        assert!(!visible(5, 3, 0, Some(2)) && visible(5, 4, 0, Some(2)));
    }
}
