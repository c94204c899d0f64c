//! The device engine's side of the prefix cache (`crate::prefix_cache`, the radix tree the
//! CPU engine uses too): what it keeps per cached block — the keys and values of the
//! block's positions in every layer, as device tensors of their own ([`RowKv`]), and the
//! route rows of those positions — and how a batch row reads from and writes to it.
//!
//! A block is `block_size` positions; only full blocks are cached, matched by the chain
//! hash of their tokens and the weight version. A row offers its fed positions when it
//! finishes or is aborted (blocks whose route rows were all made under the current weights,
//! so a chain never mixes weights); a new row takes the longest cached chain of its
//! servable positions ([`servable`]) as its first keys, values and route rows. The route
//! rows of a hit are the ones recorded when those positions were first fed, so a hit
//! returns what a cold prefill recorded.

use std::sync::Arc;

use r3_model::model::decode::{KvCache, RowKv};

use super::batch::Row;
use crate::engine::sequence::RouteGeometry;
use crate::error::RolloutError;
use crate::prefix_cache::{BlockPayload, PrefixCache};
use crate::sampler::SamplingParams;

/// Payload of one cached block of `block_size` positions.
#[derive(Debug)]
pub struct DeviceBlock {
    /// Keys and values of the block's positions in every layer, on the engine's device.
    pub kv: RowKv,
    /// Route rows of the block's positions, position-major (`block_size × moe_layers ×
    /// top_k` ids).
    pub routes: Arc<[u16]>,
}

impl BlockPayload for DeviceBlock {
    fn size_bytes(&self) -> usize {
        self.kv.bytes() + self.routes.len() * std::mem::size_of::<u16>()
    }
}

/// A cached prefix found for a row.
#[derive(Debug)]
pub struct Hit {
    /// Keys and values of its positions (a copy: the cache may evict its blocks at once).
    pub kv: RowKv,
    /// Its route rows, position-major.
    pub routes: Vec<u16>,
    /// Positions served.
    pub tokens: usize,
}

/// Leading positions of a prompt of `len` tokens that a cache hit may serve: all but the
/// last (its logits sample the first token), and none from the first position whose prompt
/// log-prob is asked for (those come from the prefill's logits). `logprobs_end` is where the
/// reported prompt ends (the original prompt of a resumed request).
pub fn servable(len: usize, sampling: &SamplingParams, logprobs_end: usize) -> usize {
    let last = len.saturating_sub(1);
    match sampling.prompt_logprobs_from {
        Some(from) => {
            let start = from.min(logprobs_end.saturating_sub(1));
            if start + 1 < logprobs_end {
                last.min(start)
            } else {
                last
            }
        }
        None => last,
    }
}

/// The longest cached prefix of `row`'s servable positions under `version`, copied out of
/// the cache (its lease is given back at once, so a hit pins nothing).
pub fn lookup(
    cache: &mut PrefixCache<DeviceBlock>,
    row: &Row,
    version: u64,
) -> Result<Option<Hit>, RolloutError> {
    let n = servable(
        row.tokens.len(),
        &row.request.sampling,
        row.prompt_logprobs_end(),
    );
    let found = cache.match_prefix(&row.tokens[..n], version);
    let hit = if found.matched_tokens == 0 {
        Ok(None)
    } else {
        let parts: Vec<&RowKv> = found.payloads.iter().map(|p| &p.kv).collect();
        RowKv::concat(&parts).map(|kv| {
            Some(Hit {
                kv,
                routes: found
                    .payloads
                    .iter()
                    .flat_map(|p| p.routes.iter().copied())
                    .collect(),
                tokens: found.matched_tokens,
            })
        })
    };
    drop(cache.release(found.lease));
    Ok(hit?)
}

/// Offers the full blocks of `row`'s fed positions (row `b` of `kv`, its position `p` in
/// slot `row.pad + p`) to the cache: those not cached yet are copied out of the batch. Only
/// a chain whose route rows were all made under `version` is offered (a row that lived
/// through a weight update holds keys and values of both weights).
pub fn offer(
    cache: &mut PrefixCache<DeviceBlock>,
    row: &Row,
    kv: &KvCache,
    b: usize,
    version: u64,
    geo: &RouteGeometry,
) -> Result<(), RolloutError> {
    let width = geo.row();
    if !row.capture {
        return Ok(());
    }
    let bs = cache.block_size();
    // The last token is never fed; the cache holds the slots fed so far.
    let fed = (row.tokens.len().saturating_sub(1))
        .min(row.route_versions.len())
        .min(kv.slots().saturating_sub(row.pad));
    let current = row.route_versions[..fed]
        .iter()
        .position(|&v| v != version)
        .unwrap_or(fed);
    let full = current / bs;
    let tokens = &row.tokens[..full * bs];
    let start = cache.peek_prefix(tokens, version) / bs;
    if start >= full {
        return Ok(());
    }
    let payloads = (start..full)
        .map(|blk| {
            Ok(DeviceBlock {
                kv: kv.row_slots(b, row.pad + blk * bs, bs)?,
                routes: Arc::from(&row.routes[blk * bs * width..(blk + 1) * bs * width]),
            })
        })
        .collect::<Result<Vec<_>, RolloutError>>()?;
    match cache.insert(tokens, version, start, payloads) {
        Ok(outcome) => drop(cache.release(outcome.lease)),
        // The cache refuses only an inconsistent insert; the row's result is unaffected.
        Err(e) => tracing::warn!(error = %e, "prefix cache insert failed; continuing without it"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servable_positions_stop_before_the_last_and_the_first_prompt_logprob() {
        let plain = SamplingParams::greedy(1);
        assert_eq!(servable(10, &plain, 10), 9);
        assert_eq!(servable(1, &plain, 1), 0);
        let from = |f| SamplingParams {
            prompt_logprobs_from: Some(f),
            ..SamplingParams::greedy(1)
        };
        // Log-probs of positions 4.. need the logits of 4..9.
        assert_eq!(servable(10, &from(4), 10), 4);
        // From past the end: nothing to compute, the whole prompt but the last is servable.
        assert_eq!(servable(10, &from(20), 10), 9);
        // A resumed request reports its original prompt (6 of 10 tokens).
        assert_eq!(servable(10, &from(2), 6), 2);
    }
}
