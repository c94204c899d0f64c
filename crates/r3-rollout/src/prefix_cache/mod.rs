//! Prefix cache: a radix tree over fixed-size token blocks, after vLLM v1's block hash +
//! block pool. It owns which full blocks are cached, their lookup by chain hash (which
//! includes the weight version), lease reference counts that protect blocks in use, LRU
//! eviction of unreferenced blocks under a byte budget, invalidation on weight updates
//! and hit/miss statistics. What a block holds (KV, route rows) is the engine's payload `P`.
//!
//! Typical use by the engine for one request:
//! 1. `match_prefix(prompt, version)`: the longest cached chain of full blocks, leased.
//! 2. compute the rest; `insert(tokens, version, matched_blocks, new_payloads)` stores the
//!    new full blocks and returns a lease on the whole chain.
//! 3. `release` both leases when the request no longer needs them.

mod arena;
mod block_hash;
mod invalidate;
mod stats;
#[cfg(test)]
mod tests;
mod types;

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::ops::Bound;
use std::sync::Arc;

pub use arena::BlockId;
use arena::{Arena, Node};
pub use block_hash::{full_block_hashes, shared_block_tokens, BlockHash};
pub use stats::PrefixCacheStats;
pub use types::{BlockPayload, InsertOutcome, PrefixCacheError, PrefixLease, PrefixMatch};

/// The prefix cache; see the module docs.
#[derive(Debug)]
pub struct PrefixCache<P> {
    /// Tokens per block (> 0). Only full blocks are cached or matched.
    block_size: usize,
    /// Payload bytes the cache may keep. Exceeded only while every cached block is held by a
    /// lease (eviction never touches held blocks).
    budget_bytes: usize,
    /// Sum of `size_bytes` over every stored block, stale or not.
    used_bytes: usize,
    /// All stored blocks.
    arena: Arena<P>,
    /// Chain hash -> block, for every non-stale stored block (and nothing else).
    index: HashMap<BlockHash, BlockId>,
    /// Blocks that may be evicted now, oldest `last_used` first: exactly the non-stale blocks
    /// with `refs == 0` and `children == 0`, keyed by `(last_used, id)`.
    evictable: BTreeSet<(u64, BlockId)>,
    /// Logical clock for `last_used`; strictly increases with every touch.
    clock: u64,
    /// Counters since creation (or the last `reset_stats`).
    stats: PrefixCacheStats,
}

impl<P: BlockPayload> PrefixCache<P> {
    /// An engine's cache when `on` (else None), a zero block size read as a config error.
    pub fn for_engine(
        on: bool,
        block_size: usize,
        budget_bytes: usize,
    ) -> Result<Option<Self>, crate::error::RolloutError> {
        on.then(|| Self::new(block_size, budget_bytes))
            .transpose()
            .map_err(|e| crate::error::RolloutError::InvalidConfig(e.to_string()))
    }

    /// An empty cache of `block_size`-token blocks keeping at most `budget_bytes` of payload.
    pub fn new(block_size: usize, budget_bytes: usize) -> Result<Self, PrefixCacheError> {
        if block_size == 0 {
            return Err(PrefixCacheError::ZeroBlockSize);
        }
        Ok(PrefixCache {
            block_size,
            budget_bytes,
            used_bytes: 0,
            arena: Arena::new(),
            index: HashMap::new(),
            evictable: BTreeSet::new(),
            clock: 0,
            stats: PrefixCacheStats::default(),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Payload bytes the cache may keep.
    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    /// Payload bytes stored now.
    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    /// Number of stored blocks (including invalidated ones still held by a lease).
    pub fn num_blocks(&self) -> usize {
        self.arena.len()
    }

    /// Evicts up to `n` unleased blocks, least recently used leaves first; returns their
    /// payloads (fewer than `n` when fewer are evictable).
    pub fn evict_blocks(&mut self, n: usize) -> Vec<Arc<P>> {
        let mut evicted = Vec::new();
        while evicted.len() < n {
            let Some(payload) = self.evict_one() else {
                break;
            };
            evicted.push(payload);
        }
        evicted
    }

    /// Evicts up to `n` unleased blocks for which `frees` holds, least recently used
    /// leaves first (a parent becomes a leaf once its children are gone): each block evicted
    /// is the least recently used evictable one that `frees` accepts, so the order is
    /// [`Self::evict_blocks`]'s with the refused blocks skipped. Returns their payloads. An
    /// engine whose payloads share memory with its requests passes whether dropping the
    /// cache's payload frees it, so that eviction empties the cache only as far as that
    /// gives memory back.
    ///
    /// One walk over the evictable blocks in LRU order, `frees` asked once per block (its
    /// answer must not change when other blocks are evicted): O((k + s) log n) for `k`
    /// blocks evicted, `s` refused on the way and `n` evictable.
    pub fn evict_blocks_where(&mut self, n: usize, frees: impl Fn(&P) -> bool) -> Vec<Arc<P>> {
        let mut evicted = Vec::new();
        // The last key the walk passed: every evictable key at or before it was refused by
        // `frees`, or waits in `behind` (a parent that became a leaf when its last child
        // went, less recently used than the cursor; one more recent the walk meets ahead).
        let mut cursor: Option<(u64, BlockId)> = None;
        let mut behind: BinaryHeap<Reverse<(u64, BlockId)>> = BinaryHeap::new();
        while evicted.len() < n {
            let ahead = match cursor {
                None => self.evictable.first().copied(),
                Some(c) => self
                    .evictable
                    .range((Bound::Excluded(c), Bound::Unbounded))
                    .next()
                    .copied(),
            };
            let from_behind = behind
                .peek()
                .is_some_and(|&Reverse(b)| ahead.is_none_or(|a| b < a));
            let next = if from_behind {
                behind.pop().map(|Reverse(b)| b)
            } else {
                cursor = ahead.or(cursor);
                ahead
            };
            let Some((_, id)) = next else {
                break;
            };
            let Some(node) = self.arena.get(id) else {
                continue;
            };
            if !frees(&node.payload) {
                continue;
            }
            let parent = node.parent;
            if let Some(payload) = self.free(id) {
                self.stats.evicted_blocks += 1;
                evicted.push(payload);
            }
            let Some((p, c)) = parent.zip(cursor) else {
                continue;
            };
            if let Some(pn) = self.arena.get(p) {
                let key = (pn.last_used, p);
                if key < c && self.evictable.contains(&key) {
                    behind.push(Reverse(key));
                }
            }
        }
        evicted
    }

    /// Hit/miss and eviction counters.
    pub fn stats(&self) -> PrefixCacheStats {
        let mut s = self.stats;
        s.cached_blocks = self.arena.len();
        s.used_bytes = self.used_bytes;
        s
    }

    /// Zeroes the counters (not the cache contents).
    pub fn reset_stats(&mut self) {
        self.stats = PrefixCacheStats::default();
    }

    /// Changes the budget and evicts down to it; returns the evicted payloads.
    pub fn set_budget_bytes(&mut self, budget_bytes: usize) -> Vec<Arc<P>> {
        self.budget_bytes = budget_bytes;
        self.evict_to_budget()
    }

    /// Number of leading tokens of `tokens` that are cached under `version`, without leasing,
    /// touching or counting anything (for scheduling decisions).
    pub fn peek_prefix(&self, tokens: &[u32], version: u64) -> usize {
        self.find_chain(tokens, version).0.len() * self.block_size
    }

    /// Leases the chain [`Self::peek_prefix`] counts for `tokens` under `version`, touching
    /// and counting nothing (no lookup, no LRU change): a scheduler that planned with a peek
    /// holds the chain so while it evicts to make room, and eviction then takes other blocks
    /// than the ones it planned to read. Given back with [`Self::release`].
    pub fn hold_prefix(&mut self, tokens: &[u32], version: u64) -> PrefixLease {
        let last = self.find_chain(tokens, version).0.last().copied();
        self.lease_chain(last)
    }

    /// The longest cached chain of full blocks that prefixes `tokens` under weight version
    /// `version`, leased so it cannot be evicted. A trailing partial block never matches; an
    /// engine that needs logits for the last prompt token should pass `&prompt[..len - 1]`.
    pub fn match_prefix(&mut self, tokens: &[u32], version: u64) -> PrefixMatch<P> {
        let (blocks, collided) = self.find_chain(tokens, version);
        let full_blocks = tokens.len() / self.block_size;
        self.stats.lookups += 1;
        self.stats.queried_blocks += full_blocks as u64;
        self.stats.hit_blocks += blocks.len() as u64;
        self.stats.hash_collisions += u64::from(collided);
        if !blocks.is_empty() {
            self.stats.hit_lookups += 1;
        }
        let payloads = blocks
            .iter()
            .filter_map(|&id| self.arena.get(id).map(|n| Arc::clone(&n.payload)))
            .collect();
        for &id in &blocks {
            self.touch(id);
        }
        let lease = self.lease_chain(blocks.last().copied());
        PrefixMatch {
            matched_tokens: blocks.len() * self.block_size,
            blocks,
            payloads,
            lease,
        }
    }

    /// Stores the full blocks `start_block..start_block + payloads.len()` of `tokens` under
    /// `version`; blocks `0..start_block` must already be cached (e.g. they were matched).
    /// A block already cached keeps its payload (the given one is returned in `unused`).
    /// Returns a lease on the whole chain; evicts unreferenced blocks down to the budget.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        version: u64,
        start_block: usize,
        payloads: Vec<P>,
    ) -> Result<InsertOutcome<P>, PrefixCacheError> {
        let bs = self.block_size;
        let full_blocks = tokens.len() / bs;
        let end_block = start_block + payloads.len();
        if end_block > full_blocks {
            return Err(PrefixCacheError::TooManyPayloads {
                start_block,
                end_block,
                num_tokens: tokens.len(),
                full_blocks,
                block_size: bs,
            });
        }
        let (mut chain, _) = self.find_chain(&tokens[..start_block * bs], version);
        if chain.len() < start_block {
            let block = chain.len();
            return Err(PrefixCacheError::MissingPrefix {
                block,
                from: block * bs,
                to: (block + 1) * bs,
                version,
            });
        }
        let mut parent_hash = match chain.last().and_then(|&id| self.arena.get(id)) {
            Some(node) => node.hash,
            None => BlockHash::root(version),
        };
        let mut inserted = 0;
        let mut unused = Vec::new();
        let mut payloads = payloads.into_iter();
        for block in start_block..end_block {
            let Some(payload) = payloads.next() else {
                break;
            };
            let block_tokens = &tokens[block * bs..(block + 1) * bs];
            let hash = parent_hash.chain(version, block_tokens);
            let parent = chain.last().copied();
            match self.index.get(&hash).copied() {
                Some(id) if self.node_is(id, parent, version, block_tokens) => {
                    unused.push(Arc::new(payload));
                    chain.push(id);
                }
                Some(_) => {
                    // A different block has this hash: keep the old one, stop the chain here.
                    self.stats.hash_collisions += 1;
                    unused.push(Arc::new(payload));
                    unused.extend(payloads.by_ref().map(Arc::new));
                    break;
                }
                None => {
                    let id = self.store(hash, parent, version, block_tokens, payload);
                    inserted += 1;
                    chain.push(id);
                }
            }
            parent_hash = hash;
        }
        for &id in &chain {
            self.touch(id);
        }
        self.stats.inserted_blocks += inserted as u64;
        let lease = self.lease_chain(chain.last().copied());
        let evicted = self.evict_to_budget();
        Ok(InsertOutcome {
            blocks: chain,
            inserted,
            unused,
            evicted,
            lease,
        })
    }

    /// Takes a new lease on the chain ending at `block` (e.g. to keep blocks past the end
    /// of an earlier lease).
    pub fn acquire(&mut self, block: BlockId) -> Result<PrefixLease, PrefixCacheError> {
        match self.arena.get(block) {
            Some(node) if !node.stale => Ok(self.lease_chain(Some(block))),
            _ => Err(PrefixCacheError::UnknownBlock(block)),
        }
    }

    /// Gives a lease back. Returns the payloads of blocks freed as a result: invalidated
    /// blocks whose last lease this was, and blocks evicted to get back under the budget.
    pub fn release(&mut self, lease: PrefixLease) -> Vec<Arc<P>> {
        let mut freed = Vec::new();
        let mut cursor = lease.last;
        while let Some(id) = cursor {
            let Some(node) = self.arena.get_mut(id) else {
                break;
            };
            node.refs = node.refs.saturating_sub(1);
            cursor = node.parent;
            if node.refs > 0 {
                continue;
            }
            if node.stale {
                if node.children == 0 {
                    freed.extend(self.free(id));
                }
            } else {
                self.sync_evictable(id);
            }
        }
        freed.extend(self.evict_to_budget());
        freed
    }

    /// Blocks of `tokens` found by hash and verified (parent, version, tokens); also whether
    /// the walk stopped on a hash collision.
    fn find_chain(&self, tokens: &[u32], version: u64) -> (Vec<BlockId>, bool) {
        let mut chain: Vec<BlockId> = Vec::new();
        let mut hash = BlockHash::root(version);
        for block_tokens in tokens.chunks_exact(self.block_size) {
            hash = hash.chain(version, block_tokens);
            let Some(&id) = self.index.get(&hash) else {
                return (chain, false);
            };
            if !self.node_is(id, chain.last().copied(), version, block_tokens) {
                return (chain, true);
            }
            chain.push(id);
        }
        (chain, false)
    }

    fn node_is(&self, id: BlockId, parent: Option<BlockId>, version: u64, tokens: &[u32]) -> bool {
        self.arena.get(id).is_some_and(|n| {
            !n.stale && n.parent == parent && n.version == version && *n.tokens == *tokens
        })
    }

    fn store(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockId>,
        version: u64,
        tokens: &[u32],
        payload: P,
    ) -> BlockId {
        let size_bytes = payload.size_bytes();
        let node = Node {
            hash,
            parent,
            version,
            tokens: tokens.into(),
            payload: Arc::new(payload),
            size_bytes,
            refs: 0,
            children: 0,
            last_used: self.clock,
            stale: false,
        };
        let id = self.arena.insert(node);
        self.index.insert(hash, id);
        self.used_bytes += size_bytes;
        if let Some(p) = parent {
            if let Some(pn) = self.arena.get_mut(p) {
                pn.children += 1;
            }
            self.sync_evictable(p);
        }
        self.sync_evictable(id);
        id
    }

    /// Removes a block (which must have no children) and returns its payload.
    fn free(&mut self, id: BlockId) -> Option<Arc<P>> {
        let node = self.arena.remove(id)?;
        self.evictable.remove(&(node.last_used, id));
        if !node.stale {
            self.index.remove(&node.hash);
        }
        self.used_bytes -= node.size_bytes;
        if let Some(p) = node.parent {
            if let Some(pn) = self.arena.get_mut(p) {
                pn.children = pn.children.saturating_sub(1);
            }
            self.sync_evictable(p);
        }
        Some(node.payload)
    }

    fn evict_to_budget(&mut self) -> Vec<Arc<P>> {
        let mut evicted = Vec::new();
        while self.used_bytes > self.budget_bytes {
            let Some(payload) = self.evict_one() else {
                break;
            };
            evicted.push(payload);
        }
        evicted
    }

    /// Frees the least recently used evictable block, if any.
    fn evict_one(&mut self) -> Option<Arc<P>> {
        let (_, id) = self.evictable.pop_first()?;
        let payload = self.free(id)?;
        self.stats.evicted_blocks += 1;
        Some(payload)
    }

    fn lease_chain(&mut self, last: Option<BlockId>) -> PrefixLease {
        let mut cursor = last;
        while let Some(id) = cursor {
            let Some(node) = self.arena.get_mut(id) else {
                break;
            };
            node.refs += 1;
            cursor = node.parent;
            self.sync_evictable(id);
        }
        PrefixLease { last }
    }

    fn touch(&mut self, id: BlockId) {
        self.clock += 1;
        let clock = self.clock;
        let Some(node) = self.arena.get_mut(id) else {
            return;
        };
        let old = node.last_used;
        node.last_used = clock;
        if self.evictable.remove(&(old, id)) {
            self.evictable.insert((clock, id));
        }
    }

    /// Puts `id` in or out of the evictable set according to its state.
    fn sync_evictable(&mut self, id: BlockId) {
        let Some(node) = self.arena.get(id) else {
            return;
        };
        let key = (node.last_used, id);
        if !node.stale && node.refs == 0 && node.children == 0 {
            self.evictable.insert(key);
        } else {
            self.evictable.remove(&key);
        }
    }
}
