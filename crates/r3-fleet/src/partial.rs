//! Partial rollout over HTTP: a request that a worker aborted (finish reason `abort`, with
//! the tokens, log-probs and routes it had so far, e.g. at a weight update) is continued by
//! a new `/generate` whose prompt is the original prompt plus the tokens so far, and the
//! pieces are merged into one result.
//!
//! The continuation asks for the remaining token budget and, with
//! [`MergePolicy::KeepPerTokenOrigin`], for routes from `routed_experts_start_len` = the
//! end of the rows already held (so each row keeps the weights that produced it); with
//! [`MergePolicy::ReplaceWithResumed`] it asks from the original start and its full table
//! replaces the earlier one. Its seed is [`resume_seed`]: the random stream of the aborted
//! call cannot travel over HTTP, so the continuation draws from a new stream that depends
//! only on the original seed and the tokens already generated (a rerun aborted at the
//! same point samples the same tokens). Log-probs are concatenated; the routes' rows keep
//! the weight version of the piece they came from, and [`Pieces::versions`] lists each
//! piece's version, so a result that spans weight versions says so. A piece aborted before
//! its first token leaves nothing behind: the original request, seed and all, is sent again.

use r3_rollout::{FinishReason, GenerateRequest, GenerateResult};
use r3_routing::{merge_resumed, MergePolicy, RouteTable};

/// The seed of the piece that continues a request with seed `seed` after `done` tokens:
/// SplitMix64 of `seed + done + 1`, so it differs from the original stream and from the
/// continuation at any other point.
pub fn resume_seed(seed: u64, done: usize) -> u64 {
    let mut z = seed
        .wrapping_add(done as u64)
        .wrapping_add(1)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The pieces of one request gathered so far.
#[derive(Debug, Clone)]
pub struct Pieces {
    original: GenerateRequest,
    output_ids: Vec<u32>,
    logprobs: Vec<f32>,
    routes: Option<RouteTable>,
    versions: Vec<u64>,
    cached_tokens: usize,
    finish: Option<FinishReason>,
}

impl Pieces {
    /// Nothing received yet for `original`.
    pub fn new(original: GenerateRequest) -> Self {
        Pieces {
            original,
            output_ids: Vec::new(),
            logprobs: Vec::new(),
            routes: None,
            versions: Vec::new(),
            cached_tokens: 0,
            finish: None,
        }
    }

    /// Whether an aborted piece brought output tokens, so the next request is a
    /// continuation. Nothing sampled (no token, whatever prompt rows came back) means the
    /// next request is the original one, with its own seed and route start.
    pub fn started(&self) -> bool {
        !self.output_ids.is_empty()
    }

    /// Weight version of each piece that brought tokens or route rows, in order.
    pub fn versions(&self) -> &[u64] {
        &self.versions
    }

    /// Whether every piece came from the same weight version.
    pub fn spans_versions(&self) -> bool {
        self.versions.windows(2).any(|w| w[0] != w[1])
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.output_ids.len()
    }

    /// Whether the request is complete (its last piece finished, or the pieces reached a
    /// stop id or the token budget).
    pub fn is_complete(&self) -> bool {
        self.finish.is_some()
    }

    /// The `/generate` request of the next piece: the original one first, then the
    /// continuation (prompt + tokens so far, the remaining budget, [`resume_seed`], routes
    /// from where `policy` needs them).
    pub fn next_request(&self, policy: MergePolicy) -> GenerateRequest {
        if !self.started() {
            return self.original.clone();
        }
        let done = self.output_ids.len();
        let mut req = self.original.clone();
        req.input_ids.extend_from_slice(&self.output_ids);
        let s = &mut req.sampling;
        s.max_new_tokens = s.max_new_tokens.saturating_sub(done);
        s.min_new_tokens = s.min_new_tokens.saturating_sub(done);
        s.seed = resume_seed(s.seed, done);
        req.routed_experts_start_len = match (policy, &self.routes) {
            (MergePolicy::KeepPerTokenOrigin, Some(t)) => t.end_pos(),
            _ => self.original.routed_experts_start_len,
        };
        req
    }

    /// Adds the checked reply to [`Pieces::next_request`] from weight `version`. Returns
    /// whether the request is now complete; an error when the routes cannot be merged or
    /// a complete request lacks routes for some position.
    pub fn add(
        &mut self,
        piece: GenerateResult,
        version: u64,
        policy: MergePolicy,
    ) -> Result<bool, String> {
        if self.is_complete() {
            return Err("a piece arrived for a request that is already complete".into());
        }
        if piece.finish == FinishReason::Abort && piece.output_ids.is_empty() && !self.started() {
            // Aborted before it sampled anything: it leaves no trace, and the original
            // request is sent again (its prompt rows, if any came back, come again with it).
            return Ok(false);
        }
        self.output_ids.extend_from_slice(&piece.output_ids);
        self.logprobs.extend_from_slice(&piece.output_logprobs);
        self.cached_tokens += piece.cached_tokens;
        // A piece aborted before it produced anything leaves no trace in the result.
        if !piece.output_ids.is_empty() || piece.routes.as_ref().is_some_and(|t| t.num_tokens() > 0)
        {
            self.versions.push(version);
        }
        if let Some(resumed) = piece.routes {
            self.routes = Some(match self.routes.take() {
                None => resumed,
                Some(earlier) => merge_resumed(&earlier, &resumed, policy)
                    .map_err(|e| format!("merging the routes of a resumed request: {e}"))?,
            });
        }
        let s = &self.original.sampling;
        self.finish = match piece.finish {
            FinishReason::Abort => match self.output_ids.last() {
                // Aborted after its last token: nothing is left to generate (a stop id
                // ends nothing under `ignore_eos`).
                Some(&t) if s.stops_at(t) => Some(FinishReason::Stop { token: t }),
                Some(_) if self.output_ids.len() >= s.max_new_tokens => Some(FinishReason::Length),
                _ => None,
            },
            other => Some(other),
        };
        if self.finish.is_some() && self.original.return_routes {
            let total = self.original.input_ids.len() + self.output_ids.len();
            let covered = self.routes.as_ref().map_or(0, RouteTable::end_pos);
            if covered + 1 != total {
                return Err(format!(
                    "the pieces' routes end at position {covered}, the sequence feeds {}",
                    total - 1
                ));
            }
        }
        Ok(self.finish.is_some())
    }

    /// The merged result (its `weight_version` is the last piece's); `None` while incomplete.
    pub fn finish(self) -> Option<GenerateResult> {
        let finish = self.finish?;
        Some(GenerateResult {
            id: 0,
            prompt_tokens: self.original.input_ids.len(),
            output_ids: self.output_ids,
            output_logprobs: self.logprobs,
            output_top_logprobs: Vec::new(),
            finish,
            cached_tokens: self.cached_tokens,
            routes: self.routes,
            weight_version: self.versions.last().copied().unwrap_or(0),
            prompt_logprobs: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use r3_rollout::SamplingParams;
    use r3_routing::LayerSpace;

    /// 1 MoE layer, top-1, 4 experts; row `p` routes to expert `p % 4`.
    fn table(from: usize, to: usize, version: u64) -> RouteTable {
        let ids: Vec<i64> = (from..to).map(|p| (p % 4) as i64).collect();
        let mut t =
            RouteTable::from_flat(4, 1, LayerSpace::MoeOnly, vec![0], from, &ids).expect("table");
        t.set_version_all(version);
        t
    }

    fn piece(out: Vec<u32>, routes: RouteTable, finish: FinishReason) -> GenerateResult {
        GenerateResult {
            id: 0,
            prompt_tokens: 0,
            output_logprobs: out.iter().map(|&t| -(t as f32)).collect(),
            output_ids: out,
            output_top_logprobs: Vec::new(),
            finish,
            cached_tokens: 0,
            routes: Some(routes),
            weight_version: 0,
            prompt_logprobs: None,
        }
    }

    fn original() -> GenerateRequest {
        let sampling = SamplingParams {
            max_new_tokens: 6,
            stop_token_ids: vec![2],
            seed: 7,
            ..SamplingParams::default()
        };
        GenerateRequest::new(vec![1, 10, 11], sampling)
    }

    #[test]
    fn the_continuation_asks_for_the_rest_from_the_end_of_the_rows_held() {
        let policy = MergePolicy::KeepPerTokenOrigin;
        let mut p = Pieces::new(original());
        assert_eq!(p.next_request(policy), original());
        // 3 prompt + 2 output tokens: positions 0..4 were fed.
        let done = p
            .add(
                piece(vec![20, 21], table(0, 4, 1), FinishReason::Abort),
                1,
                policy,
            )
            .expect("add");
        assert!(!done);
        let next = p.next_request(policy);
        assert_eq!(next.input_ids, vec![1, 10, 11, 20, 21]);
        assert_eq!(next.sampling.max_new_tokens, 4);
        assert_eq!(next.routed_experts_start_len, 4);
        assert_eq!(next.sampling.seed, resume_seed(7, 2));
        assert_ne!(next.sampling.seed, 7);
        // The continuation feeds 4..8 and stops at its 3rd token.
        let done = p
            .add(
                piece(
                    vec![22, 23, 2],
                    table(4, 7, 2),
                    FinishReason::Stop { token: 2 },
                ),
                2,
                policy,
            )
            .expect("add");
        assert!(done);
        assert!(p.spans_versions());
        let r = p.finish().expect("complete");
        assert_eq!(r.output_ids, vec![20, 21, 22, 23, 2]);
        assert_eq!(r.output_logprobs, vec![-20.0, -21.0, -22.0, -23.0, -2.0]);
        let routes = r.routes.expect("routes");
        assert_eq!(routes, {
            let mut t = table(0, 7, 1);
            t.set_versions(vec![1, 1, 1, 1, 2, 2, 2]).expect("versions");
            t
        });
    }

    #[test]
    fn replace_asks_for_the_whole_table_again_and_keeps_only_the_newest() {
        let policy = MergePolicy::ReplaceWithResumed;
        let mut p = Pieces::new(original());
        p.add(
            piece(vec![20], table(0, 3, 1), FinishReason::Abort),
            1,
            policy,
        )
        .expect("add");
        assert_eq!(p.next_request(policy).routed_experts_start_len, 0);
        p.add(
            piece(vec![21], table(0, 4, 2), FinishReason::Length),
            2,
            policy,
        )
        .expect("add");
        let r = p.finish().expect("complete");
        assert_eq!(r.routes.expect("routes"), table(0, 4, 2));
    }

    #[test]
    fn an_abort_after_the_stop_token_or_the_budget_is_complete() {
        let policy = MergePolicy::KeepPerTokenOrigin;
        let mut p = Pieces::new(original());
        let done = p
            .add(
                piece(vec![20, 2], table(0, 4, 1), FinishReason::Abort),
                1,
                policy,
            )
            .expect("add");
        assert!(done);
        assert_eq!(
            p.finish().expect("done").finish,
            FinishReason::Stop { token: 2 }
        );
        let mut p = Pieces::new(original());
        let err = p
            .add(
                piece(vec![20, 2], table(0, 3, 1), FinishReason::Abort),
                1,
                policy,
            )
            .expect_err("a row short");
        assert!(err.contains("routes end"), "{err}");
    }

    /// Under `ignore_eos` a piece aborted right after a stop id is not complete (the id ends
    /// nothing there, as on the worker): the continuation asks for the rest of the budget.
    #[test]
    fn an_abort_after_a_stop_id_under_ignore_eos_goes_on() {
        let policy = MergePolicy::KeepPerTokenOrigin;
        let mut ignoring = original();
        ignoring.sampling.ignore_eos = true;
        let mut p = Pieces::new(ignoring);
        let done = p
            .add(
                piece(vec![20, 2], table(0, 4, 1), FinishReason::Abort),
                1,
                policy,
            )
            .expect("add");
        assert!(!done);
        let next = p.next_request(policy);
        assert_eq!(next.input_ids, vec![1, 10, 11, 20, 2]);
        assert_eq!(next.sampling.max_new_tokens, 4);
        assert!(next.sampling.ignore_eos);
    }

    #[test]
    fn an_abort_before_any_token_keeps_the_original_request_and_seed() {
        let policy = MergePolicy::KeepPerTokenOrigin;
        let mut p = Pieces::new(original());
        // No token and a table of no rows, then no token and the prompt's rows.
        for rows in [table(0, 0, 1), table(0, 2, 1)] {
            let done = p
                .add(piece(Vec::new(), rows, FinishReason::Abort), 1, policy)
                .expect("add");
            assert!(!done);
            assert!(!p.started());
            let next = p.next_request(policy);
            assert_eq!(next, original(), "the original request, seed 7 included");
        }
        assert!(p.versions().is_empty());
        // The original request's full reply then stands alone.
        let done = p
            .add(
                piece(vec![20, 2], table(0, 4, 2), FinishReason::Stop { token: 2 }),
                2,
                policy,
            )
            .expect("add");
        assert!(done);
        assert_eq!(p.versions(), &[2]);
        assert_eq!(p.finish().expect("complete").routes, Some(table(0, 4, 2)));
    }

    #[test]
    fn a_gap_between_the_pieces_is_refused() {
        let policy = MergePolicy::KeepPerTokenOrigin;
        let mut p = Pieces::new(original());
        p.add(
            piece(vec![20], table(0, 3, 1), FinishReason::Abort),
            1,
            policy,
        )
        .expect("add");
        let err = p
            .add(
                piece(vec![21], table(4, 5, 2), FinishReason::Length),
                2,
                policy,
            )
            .expect_err("gap");
        assert!(err.contains("merging"), "{err}");
    }
}
