//! The engine's side of the prefix cache: what it stores per cached block (a ref to the KV
//! block and the block's route rows) and how sequences read from and write to the cache.

use std::sync::Arc;

use crate::engine::sequence::{RouteGeometry, Sequence};
use crate::kv_pool::KvBlockRef;
use crate::prefix_cache::{BlockPayload, PrefixCache};

/// Payload of one cached block of `block_size` positions.
#[derive(Debug)]
pub struct CachedBlock {
    /// The block's keys and values (all layers); the cache holds one ref.
    pub kv: KvBlockRef,
    /// Route rows of the block's positions, token-major (`block_size × moe_layers × top_k`).
    pub routes: Arc<[u16]>,
    /// Bytes of the KV block (for the cache budget).
    pub kv_bytes: usize,
}

impl BlockPayload for CachedBlock {
    fn size_bytes(&self) -> usize {
        self.kv_bytes + self.routes.len() * 2
    }
}

/// Fills a freshly admitted sequence from the cache: the longest cached prefix of its tokens
/// (minus the last, whose logits must be computed) becomes its first KV blocks and route
/// rows. Returns the number of positions served.
pub fn attach_cached_prefix(
    cache: &mut PrefixCache<CachedBlock>,
    seq: &mut Sequence,
    geo: &RouteGeometry,
    version: u64,
) -> usize {
    let probe = &seq.tokens[..seq.tokens.len() - 1];
    let m = cache.match_prefix(probe, version);
    let matched = m.matched_tokens;
    if matched > 0 {
        seq.blocks.clear();
        let mut routes = Vec::with_capacity(matched * geo.row());
        for p in &m.payloads {
            seq.blocks.push(Arc::clone(&p.kv));
            routes.extend_from_slice(&p.routes);
        }
        // Rows already captured (a preempted sequence) keep their origin.
        let have = seq.route_rows();
        if matched > have {
            seq.routes
                .extend_from_slice(&routes[have * geo.row()..matched * geo.row()]);
            seq.route_versions
                .extend(std::iter::repeat_n(version, matched - have));
        }
        seq.computed = matched;
    }
    // The sequence holds its own refs to the KV blocks, so the lease can go at once; the
    // cache may later evict these blocks without freeing memory the sequence still uses.
    drop(cache.release(m.lease));
    matched
}

/// Offers the full blocks of a sequence's computed positions to the cache. Only blocks whose
/// route rows were all produced under the current weights are offered.
pub fn insert_sequence(
    cache: &mut PrefixCache<CachedBlock>,
    seq: &Sequence,
    geo: &RouteGeometry,
    version: u64,
    kv_bytes: usize,
) {
    let bs = cache.block_size();
    if !seq.capture {
        return;
    }
    let rows = seq.route_rows().min(seq.computed);
    let mut full = rows / bs;
    full = full.min(seq.blocks.len());
    if let Some(stale) = seq.route_versions[..full * bs]
        .iter()
        .position(|&v| v != version)
    {
        full = stale / bs;
    }
    if full == 0 {
        return;
    }
    let row = geo.row();
    let payloads: Vec<CachedBlock> = (0..full)
        .map(|b| CachedBlock {
            kv: Arc::clone(&seq.blocks[b]),
            routes: Arc::from(&seq.routes[b * bs * row..(b + 1) * bs * row]),
            kv_bytes,
        })
        .collect();
    match cache.insert(&seq.tokens[..full * bs], version, 0, payloads) {
        Ok(outcome) => {
            drop(cache.release(outcome.lease));
        }
        Err(e) => tracing::warn!(error = %e, "prefix cache insert failed; continuing without it"),
    }
}
