//! The device engine's padded batch: sequences left-padded to a common length so that every
//! step writes the same KV slot for all of them (one append per layer), each sequence at its
//! own RoPE positions, with the slots each query sees and the route rows that layout
//! implies.

use std::ops::Range;

use r3_model::model::decode::SeenSlots;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

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
    /// Padding slots in front of this sequence (its position `p` sits in slot `pad + p`;
    /// set by the prefill, which lays a row out its own way, `prefill_layout`).
    pub pad: usize,
    /// Leading prompt positions served by the prefix cache: their keys and values were in
    /// the batch's cache before its prefill, their route rows copied from the cache.
    pub cached: usize,
    /// Leading positions whose keys and values the batch's cache holds ahead of the next
    /// step of its prefill: the cached prefix, then the chunks fed so far where the prefill
    /// runs in chunks (`prefill_layout`). Read only until the prefill ends.
    pub held: usize,
    /// Log-prob of each generated token (raw distribution).
    pub logprobs: Vec<f32>,
    /// Most likely alternatives of each generated token (when asked for).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Captured route rows of positions `0..` (`RouteGeometry::row` ids each; empty for a
    /// model that routes nothing).
    pub routes: Vec<u16>,
    /// Weight version of each captured row (kept for a dense model too: the prefix cache
    /// reads them).
    pub route_versions: Vec<u64>,
    /// Whether a route row and its weight version are recorded per fed position.
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
        // Saturating: admission's checks bound it, but a wrapped reach would pass a budget.
        (self.pad + self.prompt_len).saturating_add(self.request.sampling.max_new_tokens)
    }

    /// Tokens it may still generate.
    pub fn new_tokens_left(&self) -> usize {
        self.request
            .sampling
            .max_new_tokens
            .saturating_sub(self.generated().len())
    }

    /// The prompt positions whose log-probs it reports (None: not asked for): each from the
    /// logits at that position, scoring the token after it, so they end one before the
    /// prompt does; empty for a request asking from the prompt's last token (SGLang's
    /// default).
    pub fn prompt_logprob_positions(&self) -> Option<Range<usize>> {
        let from = self.request.sampling.prompt_logprobs_from?;
        let end = self.prompt_logprobs_end().saturating_sub(1);
        Some(from.min(end)..end)
    }

    /// Whether its prefill has prompt log-probs to compute: asked for, and not all computed
    /// by its earlier steps (the chunks fed before, or a retracted row's first prefill).
    pub fn asks_prompt_logprobs(&self) -> bool {
        let Some(positions) = self.prompt_logprob_positions() else {
            return false;
        };
        let next = self
            .prompt_logprobs
            .as_ref()
            .map_or(positions.start, |p| p.start + p.logprobs.len());
        next < positions.end
    }

    /// Positions before which its prefill sends every position it feeds through the LM head:
    /// the end of the prompt log-probs it still has to compute, 0 when none.
    pub fn prompt_logits_until(&self) -> usize {
        match self.prompt_logprob_positions() {
            Some(positions) if self.asks_prompt_logprobs() => positions.end,
            _ => 0,
        }
    }

    /// Whether it ran before: a row sent back to the queue by a retract, holding what it
    /// generated (every prefill samples a first token).
    pub fn was_fed(&self) -> bool {
        self.tokens.len() > self.prompt_len
    }
}

/// What a step feeds, laid out for [`r3_model::model::decode::Step`].
#[derive(Debug, Default)]
pub struct StepLayout {
    /// `[batch, time]` token ids.
    pub tokens: Vec<u32>,
    /// `[batch, time]` positions.
    pub positions: Vec<u32>,
    /// `[batch · time]` query rows' seen slots (of the `slots + time` the step reads).
    pub seen: Vec<SeenSlots>,
    /// Slots fed per sequence.
    pub time: usize,
    /// Fed slots of each row that are padding before its first fed position (its route
    /// rows start after them).
    pub skip: Vec<usize>,
    /// Each row's position after the last one fed: the row's positions `end − (time −
    /// skip)..end` are its fed slots past the skip.
    pub ends: Vec<usize>,
}

/// The prefill step of `rows` over a cache of `first` slots that holds each row's first
/// `held` positions right-aligned (slots `first − held..first`, zeros in front; `first` = 0
/// when no row holds any): each row feeds its next positions, up to `chunk` of them (all it
/// has left, where `chunk` is larger), left-padded to the most any row feeds, in slots
/// `first..first + time`. A row holding positions and feeding fewer than the most thus has
/// a gap of padding slots between the two, which [`gap_order`] closes after the step.
/// Padding slots are fed token 0 at position 0 and see only themselves; a real slot sees
/// the real slots of its row up to its own position (within the sliding window, if any):
/// the run it holds and the run it feeds.
pub fn prefill_layout(
    rows: &[Row],
    first: usize,
    window: Option<usize>,
    chunk: usize,
) -> StepLayout {
    let end = |r: &Row| r.tokens.len().min(r.held.saturating_add(chunk));
    let time = rows.iter().map(|r| end(r) - r.held).max().unwrap_or(0);
    let mut out = StepLayout {
        time,
        ..StepLayout::default()
    };
    for row in rows {
        let (held, end) = (row.held, end(row));
        let gap = time - (end - held);
        // The position a slot of this row holds (None: padding).
        let position = |slot: usize| {
            if slot < first {
                slot.checked_sub(first - held)
            } else {
                (slot - first).checked_sub(gap).map(|j| held + j)
            }
        };
        for j in 0..time {
            let query = position(first + j);
            match query {
                Some(p) => {
                    out.tokens.push(row.tokens[p]);
                    out.positions.push(p as u32);
                }
                None => {
                    out.tokens.push(0);
                    out.positions.push(0);
                }
            }
            out.seen.push(match query {
                None => SeenSlots::run(first + j..first + j + 1),
                Some(q) => {
                    // Positions `lo..=q`: those held in slots `first − held + p`, those fed
                    // (from `held` on) in `first + gap + p − held`.
                    let lo = window.map_or(0, |w| (q + 1).saturating_sub(w));
                    let at_held = first - held;
                    let at_fed = first + gap;
                    SeenSlots::runs(
                        at_held + lo.min(held)..at_held + (q + 1).min(held),
                        at_fed + lo.max(held) - held..at_fed + q + 1 - held,
                    )
                }
            });
        }
        out.skip.push(gap);
        out.ends.push(end);
    }
    out
}

/// After [`prefill_layout`]'s step `layout`: the slot order (for `KvCache::permute_slots`)
/// that moves each row's gap in front of the positions it held, so every row's position
/// `p` sits in slot `first + time − end + p` (the layout decoding and the next chunk
/// assume); None when no row has a gap (none held positions, or each fed the most).
pub fn gap_order(rows: &[Row], first: usize, layout: &StepLayout) -> Option<Vec<u32>> {
    let gapped = |(r, &gap): (&Row, &usize)| r.held > 0 && gap > 0;
    if !rows.iter().zip(&layout.skip).any(gapped) {
        return None;
    }
    let slots = first + layout.time;
    let mut order = Vec::with_capacity(rows.len() * slots);
    for (row, &gap) in rows.iter().zip(&layout.skip) {
        if gapped((row, &gap)) {
            let pad = first - row.held;
            order.extend((0..pad).chain(first..first + gap));
            order.extend((pad..first).chain(first + gap..slots));
        } else {
            order.extend(0..slots);
        }
    }
    Some(order.into_iter().map(|s| s as u32).collect())
}

/// One decode step: each row's last token into slot `slots` (the slots already cached),
/// seeing its real slots up to it (within the sliding window, if any).
pub fn decode_layout(rows: &[Row], slots: usize, window: Option<usize>) -> StepLayout {
    let mut out = StepLayout {
        time: 1,
        skip: vec![0; rows.len()],
        ends: rows.iter().map(|r| r.tokens.len()).collect(),
        ..StepLayout::default()
    };
    for row in rows {
        out.tokens.push(row.tokens[row.tokens.len() - 1]);
        out.positions.push((slots - row.pad) as u32);
        // Its real slots up to the new one, within the sliding window if any.
        let from = row
            .pad
            .max(window.map_or(0, |w| (slots + 1).saturating_sub(w)))
            .min(slots);
        out.seen.push(SeenSlots::run(from..slots + 1));
    }
    out
}

/// Rows a task of the route capture takes: a decode step gives a row one route row (a few
/// dozen ids), so a task must take many rows to outweigh its own cost, and a small batch is
/// captured on the calling thread alone.
const CAPTURE_ROWS_PER_TASK: usize = 32;

/// Appends to each capturing row the route rows of its real slots among the slots a step
/// fed (`layout`: row `b`'s after its first `skip[b]`, its positions up to `ends[b]`):
/// `routes` holds per MoE layer `[batch · time · top_k]` ids. Rows side by side in tasks of
/// 32 (`CAPTURE_ROWS_PER_TASK`): at batch 256 the capture was about 1% of a GPU's decode
/// time, on one thread.
pub fn capture_routes(
    rows: &mut [Row],
    routes: &[Vec<u32>],
    geo: &RouteGeometry,
    layout: &StepLayout,
    version: u64,
) {
    let (k, time) = (geo.top_k, layout.time);
    let capture = |(b, (row, (&skip, &end))): (usize, (&mut Row, (&usize, &usize)))| {
        if !row.capture {
            return;
        }
        // A retracted row feeds again positions whose rows it captured when it first fed
        // them: those rows stay.
        let start = end.saturating_sub(time - skip);
        let held = row.route_versions.len().saturating_sub(start);
        for j in (skip + held).min(time)..time {
            let at = (b * time + j) * k;
            for column in routes {
                row.routes
                    .extend(column[at..at + k].iter().map(|&e| e as u16));
            }
            row.route_versions.push(version);
        }
    };
    let fed = layout.skip.iter().zip(&layout.ends);
    if rows.len() < 2 * CAPTURE_ROWS_PER_TASK {
        rows.iter_mut().zip(fed).enumerate().for_each(capture);
    } else {
        rows.par_iter_mut()
            .zip(layout.skip.par_iter().zip(layout.ends.par_iter()))
            .enumerate()
            .with_min_len(CAPTURE_ROWS_PER_TASK)
            .for_each(capture);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slots a query sees, key by key, as the layouts were first written (a mask value
    /// a key): the position each slot holds for a row holding `held` positions right-aligned
    /// before slot `first` and feeding `end − held` after `gap` padding slots; a query at a
    /// position sees the positions up to it (within the window), a padding query itself.
    fn seen_by_rule(
        (first, time, slots): (usize, usize, usize),
        (held, end, gap): (usize, usize, usize),
        window: Option<usize>,
        j: usize,
    ) -> Vec<usize> {
        debug_assert!(end - held + gap == time);
        let position = |slot: usize| match slot < first {
            true => slot.checked_sub(first - held),
            false => (slot - first).checked_sub(gap).map(|i| held + i),
        };
        (0..slots)
            .filter(|&key| match position(first + j) {
                None => key == first + j,
                Some(q) => {
                    position(key).is_some_and(|k| k <= q && window.is_none_or(|w| q - k < w))
                }
            })
            .collect()
    }

    /// Each prefill and decode layout's seen slots are the slots the key-by-key rule sees:
    /// rows holding none, some or all but one of their positions, gaps, chunks shorter than
    /// a row's rest, sliding windows shorter and longer than the step, and decoding rows with
    /// and without padding in front.
    #[test]
    fn seen_slots_are_the_rules_key_by_key() {
        let mut checked = 0;
        for window in [None, Some(1), Some(3), Some(40)] {
            for first in [0usize, 2, 7] {
                for chunk in [1usize, 3, usize::MAX] {
                    // (tokens, held) per row; a row holds at most `first` positions.
                    let shapes = [(9usize, 2usize), (3, 0), (4, 3), (7, 7.min(first)), (1, 0)];
                    let mut rows: Vec<Row> =
                        (0..shapes.len() as u64).map(|b| row(b, true)).collect();
                    for (r, &(len, held)) in rows.iter_mut().zip(&shapes) {
                        r.tokens = (0..len as u32).collect();
                        r.held = held.min(first).min(len.saturating_sub(1));
                    }
                    let layout = prefill_layout(&rows, first, window, chunk);
                    let (time, slots) = (layout.time, first + layout.time);
                    for (b, r) in rows.iter().enumerate() {
                        let rule = (r.held, layout.ends[b], layout.skip[b]);
                        for j in 0..time {
                            let seen = layout.seen[b * time + j];
                            let got: Vec<usize> = (0..slots).filter(|&k| seen.sees(k)).collect();
                            let want = seen_by_rule((first, time, slots), rule, window, j);
                            assert_eq!(
                                got, want,
                                "{window:?} first {first} chunk {chunk} row {b} query {j}"
                            );
                            checked += 1;
                        }
                    }
                }
            }
            // Decoding over 6 slots: rows padded by 0, 2 and 5 in front.
            let mut rows: Vec<Row> = (0..3).map(|b| row(b, true)).collect();
            for (r, pad) in rows.iter_mut().zip([0, 2, 5]) {
                r.pad = pad;
            }
            let layout = decode_layout(&rows, 6, window);
            for (b, r) in rows.iter().enumerate() {
                let got: Vec<usize> = (0..7).filter(|&k| layout.seen[b].sees(k)).collect();
                // Positions 0..=6 − pad in slots pad..=6.
                let len = 7 - r.pad;
                let want = seen_by_rule((r.pad, len, 7), (0, len, 0), window, len - 1);
                assert_eq!(got, want, "{window:?} decode row {b}");
            }
        }
        assert!(checked > 500, "{checked}");
    }

    /// A row capturing (or not) with `routes` already held.
    fn row(id: u64, capture: bool) -> Row {
        use rand::SeedableRng;
        let request = GenerateRequest::new(vec![1, 2, 3], crate::SamplingParams::default());
        Row {
            id,
            rng: ChaCha8Rng::seed_from_u64(id),
            tokens: request.input_ids.clone(),
            prompt_len: 3,
            pad: 0,
            cached: 0,
            held: 0,
            logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            routes: vec![7; 2 * 3],
            route_versions: vec![0; 2],
            capture,
            prompt_logprobs: None,
            finish: None,
            request,
            resume: None,
        }
    }

    /// A step's layout as far as the capture reads it.
    fn fed(time: usize, skip: Vec<usize>, ends: Vec<usize>) -> StepLayout {
        StepLayout {
            time,
            skip,
            ends,
            ..StepLayout::default()
        }
    }

    /// A chunk of 4 over a cache of 2 slots: a row holding 2 of 9 positions feeds 2..6 (not
    /// to its end), one holding none of 3 feeds all 3 after a slot of padding, one holding 2
    /// of 3 feeds its last after 3; the gap of the last moves in front of what it held, the
    /// others' positions already end at the step's last slot.
    #[test]
    fn a_chunk_feeds_each_row_its_next_positions() {
        let mut rows: Vec<Row> = (0..3).map(|b| row(b, true)).collect();
        for (r, (len, held)) in rows.iter_mut().zip([(9, 2), (3, 0), (3, 2)]) {
            r.tokens = (0..len as u32).map(|t| 100 * r.id as u32 + t).collect();
            r.held = held;
        }
        let layout = prefill_layout(&rows, 2, None, 4);
        assert_eq!(
            (layout.time, &layout.skip, &layout.ends),
            (4, &vec![0, 1, 3], &vec![6, 3, 3])
        );
        assert_eq!(
            layout.tokens,
            [vec![2, 3, 4, 5], vec![0, 100, 101, 102], vec![0, 0, 0, 202]].concat()
        );
        assert_eq!(
            layout.positions,
            [vec![2, 3, 4, 5], vec![0, 0, 1, 2], vec![0, 0, 0, 2]].concat()
        );
        // Row 0's position 3 (slot 3) sees slots 0..=3; row 2's position 2 (slot 5) sees
        // its held slots 0 and 1 and itself, not the padding between.
        let seen = |b: usize, j: usize| -> Vec<usize> {
            (0..6).filter(|&k| layout.seen[b * 4 + j].sees(k)).collect()
        };
        assert_eq!(seen(0, 1), vec![0, 1, 2, 3]);
        assert_eq!(seen(2, 3), vec![0, 1, 5]);
        assert_eq!(seen(1, 0), vec![2], "padding sees itself");
        let order = gap_order(&rows, 2, &layout).expect("row 2 has a gap");
        let expected: Vec<u32> = [
            vec![0, 1, 2, 3, 4, 5],
            (0..6).collect(),
            vec![2, 3, 4, 0, 1, 5],
        ]
        .concat();
        assert_eq!(order, expected);
        // Fed to its end, a chunk larger than every row's rest is the whole prefill.
        let whole = prefill_layout(&rows, 2, None, usize::MAX);
        assert_eq!((whole.time, whole.ends), (7, vec![9, 3, 3]));
    }

    /// Each capturing row gets, after what it held, the route rows of its fed slots past its
    /// skip (every layer's `top_k` ids in layer order, then the version), whether the batch
    /// is small (one thread) or large (rows side by side); a row not capturing gets nothing.
    #[test]
    fn captured_route_rows_land_in_their_rows_at_any_batch() {
        let geo = RouteGeometry {
            layers: vec![0, 2],
            top_k: 3,
            num_experts: 50,
        };
        let (k, time) = (geo.top_k, 2);
        for batch in [5, 2 * CAPTURE_ROWS_PER_TASK + 7] {
            let mut rows: Vec<Row> = (0..batch as u64).map(|b| row(b, b % 5 != 3)).collect();
            let skip: Vec<usize> = (0..batch).map(|b| b % 3).collect();
            // Each row's fed positions follow the two it holds the rows of.
            for (row, &skip) in rows.iter_mut().zip(&skip) {
                row.tokens = vec![1; 2 + time - skip];
            }
            // Layer l's id for row b, slot j, choice c.
            let id = |l: usize, b: usize, j: usize, c: usize| {
                (l * 1000 + b * 10 + j * 3 + c) as u32 % 50
            };
            let routes: Vec<Vec<u32>> = (0..2)
                .map(|l| {
                    (0..batch * time * k)
                        .map(|i| id(l, i / (time * k), (i / k) % time, i % k))
                        .collect()
                })
                .collect();
            let ends = rows.iter().map(|r| r.tokens.len()).collect();
            capture_routes(&mut rows, &routes, &geo, &fed(time, skip.clone(), ends), 9);
            for (b, row) in rows.iter().enumerate() {
                let mut want = vec![7u16; 6];
                let mut versions = vec![0u64; 2];
                if b % 5 != 3 {
                    for j in skip[b]..time {
                        for l in 0..2 {
                            want.extend((0..k).map(|c| id(l, b, j, c) as u16));
                        }
                        versions.push(9);
                    }
                }
                assert_eq!(row.routes, want, "batch {batch} row {b}");
                assert_eq!(row.route_versions, versions, "batch {batch} row {b}");
            }
        }
    }

    /// A retracted row fed again from its first position (its prefill) keeps the route rows
    /// it holds, under their versions, and gets only the rows of positions past them; with
    /// a cached prefix the same; a row fed past what it holds gets every fed row.
    #[test]
    fn a_row_fed_again_keeps_the_route_rows_it_holds() {
        let geo = RouteGeometry {
            layers: vec![0],
            top_k: 2,
            num_experts: 50,
        };
        let time = 6;
        // Slot j of row b routes to experts (b * 10 + j, 40 + j).
        let routes: Vec<Vec<u32>> = vec![(0..3 * time)
            .flat_map(|i| [(i / time * 10 + i % time) as u32, (40 + i % time) as u32])
            .collect()];
        // Row 0: 5 tokens, the rows of positions 0..4 held (retracted), fed from slot 1 (a
        // pad of 1): positions 0..5. Row 1: the same with 2 cached (fed 2..5 from slot 3).
        // Row 2: 4 tokens, holding nothing, fed 0..4 from slot 2.
        let mut rows: Vec<Row> = (0..3).map(|b| row(b, true)).collect();
        for (b, r) in rows.iter_mut().enumerate() {
            r.tokens = vec![5; if b == 2 { 4 } else { 5 }];
            let held = if b == 2 { 0 } else { 4 };
            r.routes = vec![1; held * 2];
            r.route_versions = vec![3; held];
        }
        let layout = fed(time, vec![1, 3, 2], vec![5, 5, 4]);
        capture_routes(&mut rows, &routes, &geo, &layout, 8);
        assert_eq!(rows[0].routes, [vec![1; 8], vec![5, 45]].concat());
        assert_eq!(rows[0].route_versions, vec![3, 3, 3, 3, 8]);
        assert_eq!(rows[1].routes, [vec![1; 8], vec![15, 45]].concat());
        assert_eq!(rows[1].route_versions, vec![3, 3, 3, 3, 8]);
        assert_eq!(rows[2].routes, vec![22, 42, 23, 43, 24, 44, 25, 45]);
        assert_eq!(rows[2].route_versions, vec![8; 4]);
    }
}
