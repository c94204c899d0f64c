//! One scheduler step: admit waiting requests, make room in the KV pool (evict cached
//! prefixes, then preempt the newest sequence), run one batched forward over a decode token
//! of every decoding sequence plus prefill chunks, then sample, record routes and retire
//! finished sequences.

use std::sync::Arc;

use rayon::prelude::*;

use super::next_token::{sample_slots, NextTokenLogits, NextTokenSlot};
use super::prefix::{attach_cached_prefix, insert_sequence};
use super::sequence::Sequence;
use super::Engine;
use crate::error::RolloutError;
use crate::kernels::attention::SeqSpan;
use crate::kernels::ops::log_softmax_at;
use crate::model::BatchInput;
use crate::prefix_cache::{shared_block_tokens, PrefixLease};
use crate::request::GenerateResult;
use crate::sampler::top_logprobs;

impl Engine {
    /// KV blocks `seq` still needs to hold `upto` positions.
    fn blocks_short(&self, seq: &Sequence, upto: usize) -> usize {
        upto.div_ceil(self.cfg.block_size)
            .saturating_sub(seq.blocks.len())
    }

    /// Frees pool blocks by evicting unleased prefix-cache blocks that no request holds
    /// (evicting one a sequence still reads would free nothing and only lose the entry);
    /// true if any was freed.
    fn evict_cached(&mut self, n: usize) -> bool {
        match self.cache.as_mut() {
            Some(c) => !c
                .evict_blocks_where(n.max(1), |b| Arc::strong_count(&b.kv) == 1)
                .is_empty(),
            None => false,
        }
    }

    /// KV blocks `seq` needs to be admitted: the rest of its tokens past the cached prefix
    /// it would start from (peeked: no reference taken), plus a decode block per four
    /// running sequences.
    fn admission_need(&self, seq: &Sequence) -> usize {
        let bs = self.cfg.block_size;
        let cached_blocks = match self.cache.as_ref() {
            Some(cache) if reads_cache(seq) => {
                cache.peek_prefix(cache_probe(seq), self.version) / bs
            }
            _ => 0,
        };
        seq.tokens
            .len()
            .div_ceil(bs)
            .saturating_sub(seq.blocks.len() + cached_blocks)
            + self.running.len().div_ceil(4)
    }

    /// Leases the cached chain [`Engine::admission_need`] counts for `seq` (none without a
    /// cache or for a request that does not read it), so that eviction to admit `seq` spares
    /// it; given back with [`Engine::release_hold`] before `seq` runs or waits again.
    fn hold_peeked_prefix(&mut self, seq: &Sequence) -> PrefixLease {
        match self.cache.as_mut() {
            Some(cache) if reads_cache(seq) => cache.hold_prefix(cache_probe(seq), self.version),
            _ => PrefixLease::empty(),
        }
    }

    /// Gives back a hold of [`Engine::hold_peeked_prefix`], if one was taken.
    fn release_hold(&mut self, hold: Option<PrefixLease>) {
        if let (Some(cache), Some(hold)) = (self.cache.as_mut(), hold) {
            drop(cache.release(hold));
        }
    }

    /// Whether `seq` should wait for a running sequence that is computing full blocks of
    /// tokens `seq` begins with (beyond what that one found cached): it offers its prompt's
    /// full blocks to the prefix cache as soon as its prefill ends, and `seq`, admitted
    /// then, reads them from the cache instead of computing them again. So the samples of a
    /// GRPO group, submitted together, prefill their shared prompt once (SGLang's scheduler
    /// holds back such requests the same way).
    fn waits_for_sibling(&self, seq: &Sequence) -> bool {
        let bs = self.cfg.block_size;
        let probe = cache_probe(seq);
        if self.cache.is_none()
            || seq.prefix_checked
            || !seq.capture
            || probe.len() < bs
            || !seq.prompt_logit_positions().is_empty()
        {
            return false;
        }
        self.running.iter().any(|r| {
            r.capture
                && r.pending() > 1
                && shared_block_tokens(&r.tokens, probe, bs) > r.cached_tokens
        })
    }

    /// Moves waiting requests into the running set while slots, token budget and KV room
    /// last; requests waiting for a sibling's prefill ([`Engine::waits_for_sibling`]) keep
    /// their place in the queue.
    fn admit(&mut self, budget: usize) {
        let mut held_back = Vec::new();
        self.admit_from_queue(budget, &mut held_back);
        for seq in held_back.into_iter().rev() {
            self.waiting.push_front(seq);
        }
    }

    /// [`Engine::admit`]'s loop; requests held back go to `held_back` in queue order.
    fn admit_from_queue(&mut self, mut budget: usize, held_back: &mut Vec<Sequence>) {
        while self.running.len() < self.cfg.max_running && budget > 0 {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if self.waits_for_sibling(&seq) {
                held_back.push(seq);
                continue;
            }
            // Planned with a peek at the cache, not an attach: a request refused here holds
            // no cached block while it waits (blocks the running sequences could not get,
            // under weights that may change before it runs). While room is made for it, the
            // peeked chain is held: eviction takes other blocks, and the request attaches
            // the prefix its plan counted. (Evicting that chain would free a block and add
            // one to the need for each, so it could never make room, only lose the prefix.)
            // The hold is taken only once eviction is needed: most admissions fit without.
            let mut hold = None;
            loop {
                let (have, need) = (self.pool.available(), self.admission_need(&seq));
                if have >= need {
                    break;
                }
                if hold.is_none() {
                    hold = Some(self.hold_peeked_prefix(&seq));
                }
                if !self.evict_cached(need - have) {
                    break;
                }
            }
            if self.pool.available() < self.admission_need(&seq) && !self.running.is_empty() {
                self.release_hold(hold);
                self.waiting.push_front(seq);
                break;
            }
            if reads_cache(&seq) {
                seq.prefix_checked = true;
                if let Some(cache) = self.cache.as_mut() {
                    seq.cached_tokens =
                        attach_cached_prefix(cache, &mut seq, &self.geo, self.version);
                }
            }
            // The sequence holds its prefix's blocks itself now.
            self.release_hold(hold);
            budget = budget.saturating_sub(seq.pending());
            self.running.push(seq);
        }
    }

    /// Sends the newest running sequence back to the queue, releasing its KV (it is
    /// recomputed on re-admission; its captured route rows are kept).
    fn preempt_newest(&mut self) -> bool {
        if self.running.len() <= 1 {
            return false;
        }
        let Some(mut seq) = self.running.pop() else {
            return false;
        };
        tracing::debug!(id = seq.id, "preempting: KV pool full");
        seq.blocks.clear();
        seq.computed = 0;
        seq.prefix_checked = false;
        self.waiting.push_front(seq);
        true
    }

    /// Chunk sizes of this step per running sequence (decode first, then prefill).
    fn plan(&self) -> Vec<usize> {
        let decode = self.running.iter().filter(|s| s.pending() == 1).count();
        let mut budget = self.cfg.max_batch_tokens.saturating_sub(decode);
        self.running
            .iter()
            .map(|s| {
                let p = s.pending();
                if p == 1 {
                    1
                } else {
                    let n = p.min(budget);
                    budget -= n;
                    n
                }
            })
            .collect()
    }

    /// Plans the step and allocates its blocks, evicting and preempting as needed.
    fn plan_with_room(&mut self) -> Result<Vec<usize>, RolloutError> {
        loop {
            let plan = self.plan();
            let need: usize = self
                .running
                .iter()
                .zip(&plan)
                .map(|(s, &n)| self.blocks_short(s, s.computed + n))
                .sum();
            let have = self.pool.available();
            if need <= have {
                for (i, &n) in plan.iter().enumerate() {
                    let short = self.blocks_short(&self.running[i], self.running[i].computed + n);
                    for _ in 0..short {
                        let b =
                            self.pool
                                .allocate()
                                .ok_or_else(|| RolloutError::KvCacheExhausted {
                                    needed: short,
                                    free: self.pool.available(),
                                })?;
                        self.running[i].blocks.push(b);
                    }
                }
                return Ok(plan);
            }
            if self.evict_cached(need - have) || self.preempt_newest() {
                continue;
            }
            return Err(RolloutError::KvCacheExhausted {
                needed: need,
                free: have,
            });
        }
    }

    /// Runs one batched step; returns the requests that finished in it.
    pub fn step(&mut self) -> Result<Vec<GenerateResult>, RolloutError> {
        let decode = self.running.iter().filter(|s| s.pending() == 1).count();
        self.admit(self.cfg.max_batch_tokens.saturating_sub(decode));
        if self.running.is_empty() {
            return Ok(Vec::new());
        }
        let plan = self.plan_with_room()?;
        let mut tokens = Vec::new();
        let mut spans = Vec::new();
        let mut logit_rows = Vec::new();
        let mut sampled = Vec::new(); // (running index, logits row) of each sampled sequence
        let mut prompt_rows = Vec::new(); // (running index, position, logits row)
        let mut span_of = Vec::new(); // running index of each span
        let mut capture = false;
        for (i, (seq, &n)) in self.running.iter().zip(&plan).enumerate() {
            if n == 0 {
                continue;
            }
            let first = tokens.len();
            tokens.extend_from_slice(&seq.tokens[seq.computed..seq.computed + n]);
            spans.push(SeqSpan {
                first_token: first,
                num_tokens: n,
                start_pos: seq.computed,
                blocks: seq.blocks.iter().map(|b| b.id()).collect(),
            });
            span_of.push(i);
            capture |= seq.capture;
            let wanted = seq.prompt_logit_positions();
            let end = seq.computed + n;
            // `wanted` ends before the last prompt position, so these rows never include
            // the sampling row.
            for p in wanted.start.max(seq.computed)..wanted.end.min(end) {
                prompt_rows.push((i, p, logit_rows.len()));
                logit_rows.push(first + (p - seq.computed));
            }
            if end == seq.tokens.len() {
                sampled.push((i, logit_rows.len()));
                logit_rows.push(first + n - 1);
            }
        }
        let out = self.model.forward(
            &mut self.pool,
            &BatchInput {
                tokens: &tokens,
                spans: &spans,
                logit_rows: &logit_rows,
            },
            capture,
        )?;
        let row = self.geo.row();
        let version = self.version;
        self.capture_time += out.capture_time;
        for (span, &i) in spans.iter().zip(&span_of) {
            let seq = &mut self.running[i];
            if seq.capture {
                let start = std::time::Instant::now();
                for p in span.start_pos..span.start_pos + span.num_tokens {
                    if p == seq.route_rows() {
                        // A dense model's forward returns no ids: its rows are empty.
                        if let Some(ids) = out.routes.as_ref() {
                            let t = span.first_token + (p - span.start_pos);
                            seq.routes.extend_from_slice(&ids[t * row..(t + 1) * row]);
                        }
                        seq.route_versions.push(version);
                    }
                }
                self.capture_time += start.elapsed();
            }
            seq.computed += span.num_tokens;
            // A prefill that ends here (the step fed prompt positions, or several tokens, and
            // left none pending) offers its full blocks to the cache at once, not only when
            // the sequence retires: the requests waiting for it share them next step.
            let prefilled = span.num_tokens > 1 || span.start_pos < seq.prompt_len;
            if prefilled && seq.pending() == 0 {
                if let Some(cache) = self.cache.as_mut() {
                    insert_sequence(cache, seq, &self.geo, version, self.pool.block_bytes());
                }
            }
        }
        let vocab = self.model.config().vocab_size;
        for &(i, p, k) in &prompt_rows {
            let seq = &mut self.running[i];
            let logits = &out.logits[k * vocab..(k + 1) * vocab];
            let next = seq.tokens[p + 1] as usize;
            // Prompt log-probs are the raw distribution's at any `logprob_scale`, as SGLang's
            // input log-probs are (its temperature-scaled ones are opt-in).
            seq.prompt_logprobs.push(log_softmax_at(logits, next));
            let top = seq.request.sampling.top_logprobs;
            if top > 0 {
                seq.prompt_top_logprobs.push(top_logprobs(logits, top, 1.0));
            }
        }
        // Sample every sequence that got logits (in parallel; each has its own RNG).
        let mut targets: Vec<(usize, &mut Sequence)> = Vec::with_capacity(sampled.len());
        {
            let mut k = 0;
            for (i, seq) in self.running.iter_mut().enumerate() {
                if k < sampled.len() && sampled[k].0 == i {
                    targets.push((sampled[k].1, seq));
                    k += 1;
                }
            }
        }
        let max_pos = self.model.config().max_position_embeddings;
        let mut slots: Vec<NextTokenSlot<'_>> = targets
            .iter_mut()
            .map(|(k, seq)| {
                let seq = &mut **seq;
                NextTokenSlot {
                    logits: NextTokenLogits::Row(&out.logits[*k * vocab..(*k + 1) * vocab]),
                    params: &seq.request.sampling,
                    prompt_len: seq.prompt_len,
                    output_start: seq.prompt_logprobs_end,
                    tokens: &mut seq.tokens,
                    rng: &mut seq.rng,
                    logprobs: &mut seq.logprobs,
                    top_logprobs: &mut seq.top_logprobs,
                    finish: &mut seq.finish,
                }
            })
            .collect();
        sample_slots(&mut slots, max_pos);
        drop(slots);
        drop(targets);
        self.retire()
    }

    /// Removes finished sequences, offering their prefixes to the cache.
    fn retire(&mut self) -> Result<Vec<GenerateResult>, RolloutError> {
        let mut finished = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].finish.is_none() {
                i += 1;
                continue;
            }
            let seq = self.running.remove(i);
            if let Some(cache) = self.cache.as_mut() {
                insert_sequence(
                    cache,
                    &seq,
                    &self.geo,
                    self.version,
                    self.pool.block_bytes(),
                );
            }
            finished.push(seq);
        }
        // Route-table building is capture work; the rest of into_result is not, but it is
        // small, so timing the whole call over-counts capture slightly. Sequences that finish
        // together (a batch of one length: all at once) build their tables side by side.
        let start = std::time::Instant::now();
        let capturing = finished.iter().any(|seq| seq.capture);
        let (geo, version) = (&self.geo, self.version);
        let results = finished
            .into_par_iter()
            .map(|seq| seq.into_result(geo, version))
            .collect::<Result<Vec<_>, _>>()?;
        if capturing {
            self.capture_time += start.elapsed();
        }
        Ok(results)
    }
}

/// Whether admitting `seq` reads the prefix cache: once per admission, and never for a
/// request asking for prompt log-probs, which need the logits of the prompt positions a
/// cache hit would skip (such requests recompute their prompt).
fn reads_cache(seq: &Sequence) -> bool {
    !seq.prefix_checked && seq.prompt_logit_positions().is_empty()
}

/// The tokens a cache lookup for `seq` probes: all but the last, whose logits must be
/// computed.
fn cache_probe(seq: &Sequence) -> &[u32] {
    &seq.tokens[..seq.tokens.len().saturating_sub(1)]
}
