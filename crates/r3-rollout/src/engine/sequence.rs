//! The state of one request inside the engine and how it becomes a result.

use r3_routing::{merge_resumed, LayerSpace, MergePolicy, RouteTable};
use rand_chacha::ChaCha8Rng;

use crate::error::RolloutError;
use crate::kv_pool::KvBlockRef;
use crate::request::{
    FinishReason, GenerateRequest, GenerateResult, PartialRollout, PromptLogprobs, RequestId,
};

/// What a resumed request carries over from the aborted call.
#[derive(Debug, Clone)]
pub struct ResumeState {
    /// The aborted call, as `abort` returned it.
    pub earlier: PartialRollout,
    /// How to combine its routes with this call's.
    pub policy: MergePolicy,
}

impl ResumeState {
    /// The request that continues `partial`: its prompt followed by what it generated, and
    /// the token budget and minimum length it has left; refused when nothing is left.
    pub fn continuation(partial: &PartialRollout) -> Result<GenerateRequest, RolloutError> {
        let done = partial.output_ids.len();
        let mut req = partial.request.clone();
        req.sampling.max_new_tokens = req
            .sampling
            .max_new_tokens
            .checked_sub(done)
            .filter(|&r| r > 0)
            .ok_or_else(|| {
                RolloutError::InvalidRequest(format!(
                    "nothing to resume: {done} of max_new_tokens {} already generated",
                    req.sampling.max_new_tokens
                ))
            })?;
        // The minimum counts the whole output, as the budget does (r3-fleet's continuation
        // subtracts both too).
        req.sampling.min_new_tokens = req.sampling.min_new_tokens.saturating_sub(done);
        req.input_ids.extend_from_slice(&partial.output_ids);
        Ok(req)
    }

    /// How both engines start a resume: the continuation request, the sampler stream that
    /// carries over, and the state that completes the result under `policy`. The partial's
    /// routes are checked first against the engine's geometry `geo` and against where the
    /// continuation's own routes will start and end, so routes no engine could have made, or
    /// that cannot merge, are refused here, naming why, rather than failing the result (and,
    /// on the device engine, the batch it finishes in).
    pub fn start(
        partial: PartialRollout,
        policy: MergePolicy,
        geo: &RouteGeometry,
    ) -> Result<(GenerateRequest, ChaCha8Rng, ResumeState), RolloutError> {
        if let Some(earlier) = &partial.routes {
            check_resumable(earlier, &partial, policy, geo)?;
        }
        let req = Self::continuation(&partial)?;
        let rng = partial.rng.clone();
        let state = ResumeState {
            earlier: partial,
            policy,
        };
        Ok((req, rng, state))
    }

    /// Completes the resumed call's `result` into the whole request's: the original prompt
    /// length, the aborted call's tokens, log-probs and alternatives in front of this call's,
    /// and the two calls' routes combined by the policy.
    pub fn complete(&self, result: &mut GenerateResult) -> Result<(), RolloutError> {
        let earlier = &self.earlier;
        result.prompt_tokens = earlier.request.input_ids.len();
        result
            .output_ids
            .splice(0..0, earlier.output_ids.iter().copied());
        result
            .output_logprobs
            .splice(0..0, earlier.output_logprobs.iter().copied());
        result
            .output_top_logprobs
            .splice(0..0, earlier.output_top_logprobs.iter().cloned());
        if let (Some(old), Some(new)) = (&earlier.routes, &result.routes) {
            result.routes = Some(merge_resumed(old, new, self.policy)?);
        }
        Ok(())
    }
}

/// Refuses the routes `earlier` of `partial` where no engine could have made them or the
/// continuation's routes could not merge with them under `policy`: routes for a model that
/// routes nothing, another model's shape, rows past the positions the aborted call fed, or
/// a continuation table (from the request's `routed_experts_start_len`, the prompt and
/// output at most) starting after the earlier table's start (replace) or end (keep per-token
/// origin, prefer resumed from its start): refused before any work, not at the merge.
fn check_resumable(
    earlier: &RouteTable,
    partial: &PartialRollout,
    policy: MergePolicy,
    geo: &RouteGeometry,
) -> Result<(), RolloutError> {
    if geo.row() == 0 {
        return Err(RolloutError::InvalidRequest(
            "the partial rollout carries routes, but this model routes nothing (no MoE layer)"
                .into(),
        ));
    }
    earlier.check_same_shape(&geo.table(&[], &[], 0)?)?;
    let fed = partial.request.input_ids.len() + partial.output_ids.len();
    let refuse = |why: String| {
        Err(RolloutError::InvalidRequest(format!(
            "the partial rollout's routes (positions {}..{}) {why}",
            earlier.start_pos(),
            earlier.end_pos()
        )))
    };
    if earlier.end_pos() > fed {
        return refuse(format!("reach past its {fed} prompt and output tokens"));
    }
    let start = partial.request.routed_experts_start_len.min(fed);
    match policy {
        MergePolicy::ReplaceWithResumed if start > earlier.start_pos() => refuse(format!(
            "start before the continuation's routes (from position {start}, \
             routed_experts_start_len): replacing them would lose rows"
        )),
        MergePolicy::KeepPerTokenOrigin | MergePolicy::PreferResumedFromItsStart
            if start > earlier.end_pos() =>
        {
            refuse(format!(
                "end before the continuation's routes start (position {start}, \
             routed_experts_start_len): a gap"
            ))
        }
        _ => Ok(()),
    }
}

/// Route geometry shared by all sequences of an engine.
#[derive(Debug, Clone)]
pub struct RouteGeometry {
    /// Global indices of the MoE layers (the table's columns).
    pub layers: Vec<usize>,
    /// Experts per token.
    pub top_k: usize,
    /// Logical experts per layer.
    pub num_experts: usize,
}

impl RouteGeometry {
    /// The geometry of a model config: its MoE layers, `top_k` and experts per layer.
    pub fn of(cfg: &r3_model::Config) -> Self {
        RouteGeometry {
            layers: cfg.layer_layout().moe_layers().to_vec(),
            top_k: cfg.top_k(),
            num_experts: cfg.num_experts(),
        }
    }

    /// Ids per route row.
    pub fn row(&self) -> usize {
        self.layers.len() * self.top_k
    }

    /// Route table of positions `[from, rows)` from captured rows (`row()` ids each,
    /// position-major) and the weight version of each row.
    pub fn table(
        &self,
        routes: &[u16],
        versions: &[u64],
        from: usize,
    ) -> Result<RouteTable, RolloutError> {
        let rows = if self.row() == 0 {
            0
        } else {
            routes.len() / self.row()
        };
        let from = from.min(rows);
        // Read in place (no widened copy of every id first).
        let mut t = RouteTable::from_flat_values(
            self.num_experts,
            self.top_k,
            LayerSpace::MoeOnly,
            self.layers.clone(),
            from,
            &routes[from * self.row()..],
        )?;
        t.set_versions(versions[from..rows].to_vec())?;
        Ok(t)
    }
}

/// One request being served.
#[derive(Debug)]
pub struct Sequence {
    /// Request id.
    pub id: RequestId,
    /// The request as this call sees it (for a resumed one: prompt = old prompt + old output).
    pub request: GenerateRequest,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    /// Length of this call's prompt.
    pub prompt_len: usize,
    /// Positions whose keys/values are in `blocks` (fed to the model).
    pub computed: usize,
    /// KV blocks covering positions `0..computed` (and room for the next ones).
    pub blocks: Vec<KvBlockRef>,
    /// Sampler RNG.
    pub rng: ChaCha8Rng,
    /// Log-prob of each generated token.
    pub logprobs: Vec<f32>,
    /// Most likely alternatives of each generated token (when `top_logprobs` > 0).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Log-probs of prompt tokens `prompt_start + 1 ..` computed so far.
    pub prompt_logprobs: Vec<f32>,
    /// Their most likely alternatives (when `top_logprobs` > 0).
    pub prompt_top_logprobs: Vec<Vec<(u32, f32)>>,
    /// End of the prompt whose log-probs are reported (a resumed call's prompt also holds
    /// the earlier output, which is not prompt to the client).
    pub prompt_logprobs_end: usize,
    /// Captured route rows of positions `0..route_rows()` (row = `RouteGeometry::row` ids;
    /// empty for a model that routes nothing).
    pub routes: Vec<u16>,
    /// Weight version of each captured row (kept for a dense model too: the prefix cache
    /// reads them).
    pub route_versions: Vec<u64>,
    /// Whether this sequence records a route row and its weight version per fed position.
    pub capture: bool,
    /// Prompt tokens served by the prefix cache.
    pub cached_tokens: usize,
    /// Whether the prefix cache was consulted for this admission.
    pub prefix_checked: bool,
    /// Carried over from an aborted call.
    pub resume: Option<ResumeState>,
    /// Why it finished, once it has.
    pub finish: Option<FinishReason>,
}

impl Sequence {
    /// Number of captured route rows (positions recorded, one weight version each).
    pub fn route_rows(&self) -> usize {
        self.route_versions.len()
    }

    /// Tokens generated in this call.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// First reported prompt position (its entry has no log-prob), when prompt log-probs
    /// were asked for.
    pub fn prompt_logprobs_start(&self) -> Option<usize> {
        self.request
            .sampling
            .prompt_logprobs_from
            .map(|s| s.min(self.prompt_logprobs_end.saturating_sub(1)))
    }

    /// Positions whose logits rows still have to be kept for prompt log-probs (the row at
    /// `p` scores token `p + 1`); empty when none are asked for or all are done.
    pub fn prompt_logit_positions(&self) -> std::ops::Range<usize> {
        match self.prompt_logprobs_start() {
            Some(s) => {
                let from = s + self.prompt_logprobs.len();
                from..self.prompt_logprobs_end.saturating_sub(1).max(from)
            }
            None => 0..0,
        }
    }

    /// Tokens not yet fed to the model.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Route table of positions `[from, route_rows)`.
    pub fn route_table(
        &self,
        geo: &RouteGeometry,
        from: usize,
    ) -> Result<RouteTable, RolloutError> {
        geo.table(&self.routes, &self.route_versions, from)
    }

    /// The result of a finished (or aborted) sequence.
    pub fn into_result(
        self,
        geo: &RouteGeometry,
        version: u64,
    ) -> Result<GenerateResult, RolloutError> {
        let start = self.request.routed_experts_start_len;
        let routes = if self.capture && self.request.return_routes && geo.row() > 0 {
            Some(self.route_table(geo, start)?)
        } else {
            None
        };
        let mut result = GenerateResult {
            id: self.id,
            prompt_tokens: self.prompt_len,
            output_ids: self.generated().to_vec(),
            output_logprobs: self.logprobs.clone(),
            output_top_logprobs: self.top_logprobs.clone(),
            prompt_logprobs: self.prompt_logprobs_start().map(|start| PromptLogprobs {
                start,
                logprobs: self.prompt_logprobs.clone(),
                top_logprobs: self.prompt_top_logprobs.clone(),
            }),
            finish: self.finish.unwrap_or(FinishReason::Abort),
            cached_tokens: self.cached_tokens,
            routes,
            weight_version: version,
        };
        if let Some(r) = &self.resume {
            r.complete(&mut result)?;
        }
        Ok(result)
    }
}
