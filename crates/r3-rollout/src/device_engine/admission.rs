//! Admission: requests in (submit, resume), checked against the engine's limits (sizes, KV
//! and activation budgets), queued, and taken into a prefill batch beside the running one
//! when they fit, each starting with its cached prefix if the prefix cache holds one.

use r3_model::layers::attention::kv_capacity_for;
use r3_model::model::decode::RowKv;
use r3_routing::MergePolicy;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::batch::Row;
use super::memory::{mib, prefill_steps, step_activation_bytes, StepShape};
use super::{prefix, step_failed, DeviceEngine, Running};
use crate::engine::sequence::ResumeState;
use crate::engine::validate_request;
use crate::error::RolloutError;
use crate::prefix_cache::shared_block_tokens;
use crate::request::{GenerateRequest, PartialRollout, RequestId};

/// A prefill running in chunks as admission counts it: what it will be when it joins the
/// running batch.
#[derive(Debug, Clone, Copy)]
struct PendingJoin {
    /// Its rows.
    rows: usize,
    /// Slots it holds then (all its tokens fed).
    slots: usize,
    /// The slots its rows may reach.
    reach: usize,
    /// Steps until it joins.
    delay: usize,
}

/// The slots the rows of two batches may reach once joined: one holding `a_slots` slots
/// whose rows reach `a_reach`, the other `b_slots` and `b_reach`; the one with fewer slots is
/// left-padded to the other's count, its rows' reach growing by as much.
fn joined_reach(a_slots: usize, a_reach: usize, b_slots: usize, b_reach: usize) -> usize {
    let slots = a_slots.max(b_slots);
    (a_reach + (slots - a_slots)).max(b_reach + (slots - b_slots))
}

impl DeviceEngine {
    /// Validates and queues a request; it joins the running batch at the next `step` that
    /// has room for it (count, KV and activation budgets).
    pub fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, RolloutError> {
        self.validate(&req)?;
        let rng = ChaCha8Rng::seed_from_u64(req.sampling.seed);
        Ok(self.enqueue(req, rng, None))
    }

    /// Continues an aborted request (possibly under new weights), as the CPU engine's
    /// [`crate::Engine::resume`] does: the prompt becomes the original prompt plus the
    /// tokens generated so far, the remaining token budget and the sampler stream carry
    /// over, and the final routes combine both calls by `policy`.
    pub fn resume(
        &mut self,
        partial: PartialRollout,
        policy: MergePolicy,
    ) -> Result<RequestId, RolloutError> {
        let (req, rng, resume) = ResumeState::start(partial, policy, &self.geo)?;
        self.validate(&req)?;
        Ok(self.enqueue(req, rng, Some(resume)))
    }

    /// Refuses a request that is invalid for the model or alone exceeds the KV budget or
    /// the activation budget.
    fn validate(&self, req: &GenerateRequest) -> Result<(), RolloutError> {
        validate_request(&self.model_cfg, req)?;
        self.check_activations(req)?;
        // The cache's buffers keep room past the slots they hold (`kv_capacity_for`).
        // Checked: a max_new_tokens near usize::MAX must not wrap to a need within budget
        // (None: more bytes than a usize counts).
        let slots = req
            .input_ids
            .len()
            .saturating_add(req.sampling.max_new_tokens);
        let need = (slots <= usize::MAX / 2)
            .then(|| kv_capacity_for(slots))
            .and_then(|capacity| capacity.checked_mul(self.slot_bytes()));
        if need.is_none_or(|need| need > self.cfg.kv_cache_bytes) {
            let need = need.map_or_else(|| "more than usize::MAX".into(), |n| n.to_string());
            return Err(RolloutError::InvalidRequest(format!(
                "a request of {} prompt + {} new tokens needs {need} bytes of KV cache on {}, \
                 the budget is {} bytes",
                req.input_ids.len(),
                req.sampling.max_new_tokens,
                self.cfg.device,
                self.cfg.kv_cache_bytes
            )));
        }
        Ok(())
    }

    /// Refuses a request whose last decode step, run alone, needs more than the activation
    /// budget. Its prefill is no bound: one whose step would exceed the budget is fed in
    /// chunks that fit ([`super::memory::prefill_chunk`]), the least of them one token over
    /// fewer slots than that decode step reads.
    fn check_activations(&self, req: &GenerateRequest) -> Result<(), RolloutError> {
        let len = req.input_ids.len();
        let new = req.sampling.max_new_tokens;
        // Saturating: a step that large is past any budget (`step_activation_bytes`
        // saturates too), not a small one.
        let decode = StepShape {
            rows: 1,
            time: 1,
            slots: len.saturating_add(new),
            logit_positions: 1,
        };
        let need = step_activation_bytes(&self.model_cfg, decode, self.score_tiles());
        if need <= self.cfg.activation_bytes {
            return Ok(());
        }
        Err(RolloutError::ActivationsTooLarge(format!(
            "a request of {len} prompt + {new} new tokens needs about {:.1} MiB of activations \
             in its last decode step on {} (over {} slots), the activation budget is {:.1} MiB",
            mib(need),
            self.cfg.device,
            decode.slots,
            mib(self.cfg.activation_bytes)
        )))
    }

    /// Queues a checked request under a new id, as the batch row it will be.
    fn enqueue(
        &mut self,
        request: GenerateRequest,
        rng: ChaCha8Rng,
        resume: Option<ResumeState>,
    ) -> RequestId {
        let id = self.next_id;
        self.next_id += 1;
        let row = self.new_row(id, request, rng, resume);
        self.waiting.push_back(row);
        id
    }

    /// Takes waiting requests (in arrival order) into a new batch to prefill, while the
    /// count and the KV budget allow them beside `running`, the batch they will join; each
    /// starts with its cached prefix, if the prefix cache holds one.
    ///
    /// A padded batch holds as many slots per row as its furthest-reaching row, so the
    /// budget is rows × the furthest slot any row can reach: a running row reaches its
    /// padding, prompt and max new tokens (its padding grows if a longer prompt joins), a
    /// newcomer the joined batch's slots and its max new tokens. The prefill itself holds
    /// the longest cached prefix and the longest uncached tail side by side. The prefill and
    /// the joined batch's decode each have to fit the activation budget, except the prefill
    /// of a request taken alone, which runs in chunks where it would not.
    ///
    /// A request whose first full blocks of tokens a row of this batch computes (beyond
    /// what that row found cached) waits for the next step ([`DeviceEngine::waits_for_sibling`]),
    /// keeping its place in the queue: the row offers its blocks to the prefix cache when
    /// its prefill ends, so the samples of a GRPO group prefill their prompt once.
    pub(super) fn admit(
        &mut self,
        running: Option<&Running>,
    ) -> Result<Option<Running>, RolloutError> {
        let mut held_back = Vec::new();
        let batch = self.take_batch(running, &mut held_back);
        for w in held_back.into_iter().rev() {
            self.waiting.push_front(w);
        }
        batch
    }

    /// Whether waiting request `w` should wait for a row of the batch being formed
    /// (`rows`) that computes full blocks of tokens `w` begins with, beyond what that row
    /// found cached.
    fn waits_for_sibling(&self, w: &Row, rows: &[Row]) -> bool {
        let Some(cache) = &self.cache else {
            return false;
        };
        let bs = cache.block_size();
        let tokens = &w.tokens;
        let end = w.prompt_logprobs_end();
        let probe = &tokens[..prefix::servable(tokens.len(), &w.request.sampling, end)];
        if probe.len() < bs {
            return false;
        }
        rows.iter()
            .any(|r| r.capture && shared_block_tokens(&r.tokens, probe, bs) > r.cached)
    }

    /// [`DeviceEngine::admit`]'s batch; requests held back go to `held_back` in queue order.
    fn take_batch(
        &mut self,
        running: Option<&Running>,
        held_back: &mut Vec<Row>,
    ) -> Result<Option<Running>, RolloutError> {
        let slot_bytes = self.slot_bytes();
        // The KV budget counts the rows the running buffers hold, retired rows' places
        // included (freed once they are half the buffer, or by the join).
        let (running_rows, running_held, running_slots, running_reach) = match running {
            Some(r) => (
                r.rows.len(),
                r.cache.buffer_rows().max(r.rows.len()),
                r.cache.slots(),
                r.rows.iter().map(Row::reach).max().unwrap_or(0),
            ),
            None => (0, 0, 0, 0),
        };
        // A prefill running in chunks joins later: its rows are counted as the joined batch
        // will hold them then.
        let pending = self.prefilling.as_ref().map(|p| self.pending_join(p));
        let pending_rows = pending.map_or(0, |p| p.rows);
        let (mut longest, mut new_tokens, mut most_cached, mut longest_tail) = (0, 0, 0, 0);
        let mut asks_prompt_logprobs = false;
        let mut rows: Vec<Row> = Vec::new();
        let mut hits: Vec<Option<RowKv>> = Vec::new();
        while running_rows + pending_rows + rows.len() < self.cfg.max_running {
            let Some(next) = self.waiting.front() else {
                break;
            };
            if self.waits_for_sibling(next, &rows) {
                held_back.extend(self.waiting.pop_front());
                continue;
            }
            // A retracted row feeds what it generated too, and has fewer tokens left.
            let len = next.tokens.len();
            let cached = self.peek_cached(next);
            let l = longest.max(len);
            let n = new_tokens.max(next.new_tokens_left());
            let (c, t) = (most_cached.max(cached), longest_tail.max(len - cached));
            // The first newcomer is fed in chunks where its prefill alone exceeds the
            // budget or the cap; one prefill runs in chunks at a time.
            let steps = if rows.is_empty() {
                prefill_steps(
                    &self.model_cfg,
                    self.prefill_limits(next),
                    cached,
                    len - cached,
                )
            } else {
                1
            };
            if steps > 1 && pending.is_some() {
                break;
            }
            // A prefill in chunks joins the running batch its steps − 1 steps later, after
            // as many of that batch's decode steps, each a slot more (its rows' reach
            // stays): the joined batch's slots are counted as they will be then.
            let delay = if running_rows > 0 { steps - 1 } else { 0 };
            let at_join = running_slots + delay;
            let slots = at_join.max(l).max(c + t);
            let mut reach = joined_reach(at_join, running_reach, slots, slots + n);
            if let Some(p) = pending {
                // The prefill in chunks joins `p.delay` steps on, over the slots this
                // batch holds by then.
                reach = joined_reach(slots + p.delay, reach, p.slots, p.reach);
            }
            let count = running_rows + pending_rows + rows.len() + 1;
            let held = running_held + pending_rows + rows.len() + 1;
            // The prefill feeds the newcomers' tails over the prefixes, then the joined
            // batch decodes over `reach` slots at most; the two steps run one after the
            // other, so each alone has to fit the activation budget.
            let logit_positions = if asks_prompt_logprobs || next.asks_prompt_logprobs() {
                t
            } else {
                1
            };
            let prefill = StepShape {
                rows: rows.len() + 1,
                time: t,
                slots: c + t,
                logit_positions,
            };
            let decode = StepShape {
                rows: count,
                time: 1,
                slots: reach,
                logit_positions: 1,
            };
            // The first newcomer's prefill is no bound: where its step would exceed the
            // budget, it is fed in chunks that fit (`prefill_chunk`), and stays alone in its
            // batch, as any prefill beside it would exceed the budget too.
            let mut activations =
                step_activation_bytes(&self.model_cfg, decode, self.score_tiles());
            if !rows.is_empty() {
                activations = activations.max(step_activation_bytes(
                    &self.model_cfg,
                    prefill,
                    self.score_tiles(),
                ));
            }
            // A second newcomer joins a prefill batch only within its token cap (the first,
            // alone, is fed in chunks of it).
            let past_cap = !rows.is_empty()
                && self
                    .cfg
                    .max_prefill_tokens
                    .is_some_and(|cap| (rows.len() + 1) * t > cap);
            // A request alone always fits (`submit` checked it).
            if count > 1
                && (held * kv_capacity_for(reach) * slot_bytes > self.cfg.kv_cache_bytes
                    || activations > self.cfg.activation_bytes
                    || past_cap)
            {
                break;
            }
            let Some(mut row) = self.waiting.pop_front() else {
                break;
            };
            (longest, new_tokens, most_cached, longest_tail) = (l, n, c, t);
            asks_prompt_logprobs = logit_positions > 1;
            let hit = self.attach_prefix(&mut row);
            rows.push(row);
            // The requests taken from the queue fail by name, not in silence.
            hits.push(hit.map_err(|e| step_failed(&rows, e))?);
        }
        if rows.is_empty() {
            return Ok(None);
        }
        let kv_dtype = self.kv_dtype();
        let model = self.model().map_err(|e| step_failed(&rows, e))?;
        let cache = if hits.iter().any(Option::is_some) {
            let prefixes: Vec<Option<&RowKv>> = hits.iter().map(Option::as_ref).collect();
            model
                .kv_cache_from(&prefixes, kv_dtype)
                .map_err(|e| step_failed(&rows, e.into()))?
        } else {
            model.kv_cache_holding(kv_dtype)
        };
        Ok(Some(Running {
            rows,
            cache,
            prefilled: false,
        }))
    }

    /// What the prefill running in chunks, `batch`, will be when it joins the running
    /// batch: its rows, slots and reach then, and the steps until then (its chunks left, each
    /// after a decode step of the running batch).
    fn pending_join(&self, batch: &Running) -> PendingJoin {
        let mut join = PendingJoin {
            rows: batch.rows.len(),
            slots: 0,
            reach: 0,
            delay: 0,
        };
        for row in &batch.rows {
            let len = row.tokens.len();
            let limits = self.prefill_limits(row);
            let steps = prefill_steps(&self.model_cfg, limits, row.held, len - row.held);
            join.slots = join.slots.max(len);
            join.reach = join.reach.max(len + row.new_tokens_left());
            join.delay = join.delay.max(steps);
        }
        join
    }

    /// Prompt positions of a waiting request the prefix cache holds now (0 without a
    /// cache; counts nothing, so admission can plan with it).
    fn peek_cached(&self, w: &Row) -> usize {
        let Some(cache) = &self.cache else {
            return 0;
        };
        let tokens = &w.tokens;
        let n = prefix::servable(tokens.len(), &w.request.sampling, w.prompt_logprobs_end());
        cache.peek_prefix(&tokens[..n], self.version)
    }

    /// Starts `row` with its cached prefix, if any: its route rows copied from the cache,
    /// its keys and values returned for the prefill batch's cache.
    fn attach_prefix(&mut self, row: &mut Row) -> Result<Option<RowKv>, RolloutError> {
        let Some(cache) = self.cache.as_mut() else {
            return Ok(None);
        };
        if !row.capture {
            return Ok(None);
        }
        let Some(hit) = prefix::lookup(cache, row, self.version)? else {
            return Ok(None);
        };
        row.cached = hit.tokens;
        row.held = hit.tokens;
        // Rows already captured (a retracted row's, some perhaps under older weights) keep
        // their origin, as on the CPU engine; the cache's serve the positions past them.
        let (have, width) = (row.route_versions.len(), self.geo.row());
        if hit.tokens > have {
            row.routes
                .extend_from_slice(&hit.routes[have * width..hit.tokens * width]);
            row.route_versions
                .extend(std::iter::repeat_n(self.version, hit.tokens - have));
        }
        Ok(Some(hit.kv))
    }

    /// A new request as the batch row it will be (its pad set by the batch it is
    /// prefilled in).
    fn new_row(
        &self,
        id: RequestId,
        request: GenerateRequest,
        rng: ChaCha8Rng,
        resume: Option<ResumeState>,
    ) -> Row {
        Row {
            id,
            rng,
            tokens: request.input_ids.clone(),
            prompt_len: request.input_ids.len(),
            pad: 0,
            cached: 0,
            held: 0,
            logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            routes: Vec::new(),
            route_versions: Vec::new(),
            // The prefix cache keeps route rows (empty for a dense model) and their weight
            // versions beside the keys and values, so with it every row captures them.
            capture: self.cache.is_some() || (request.return_routes && self.geo.row() > 0),
            prompt_logprobs: None,
            finish: None,
            request,
            resume,
        }
    }
}
