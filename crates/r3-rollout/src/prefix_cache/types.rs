//! The prefix cache's public value types: the payload trait, errors, leases and the results
//! of `match_prefix` / `insert`.

use std::sync::Arc;

use super::BlockId;

/// What the engine stores per cached block; it reports its size for the byte budget.
pub trait BlockPayload {
    /// Bytes this payload keeps alive (KV tensors, route rows, ...).
    fn size_bytes(&self) -> usize;
}

/// Errors of the prefix cache's API.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PrefixCacheError {
    /// A block size of zero tokens was requested.
    #[error("prefix cache block size must be at least 1 token")]
    ZeroBlockSize,
    /// `insert` got more payloads than the tokens have full blocks.
    #[error(
        "prefix cache insert: payloads for blocks {start_block}..{end_block} given, but the \
         {num_tokens} tokens hold only {full_blocks} full blocks of {block_size}"
    )]
    TooManyPayloads {
        /// First block a payload was given for.
        start_block: usize,
        /// One past the last block a payload was given for.
        end_block: usize,
        /// Number of tokens passed.
        num_tokens: usize,
        /// Full blocks in those tokens.
        full_blocks: usize,
        /// Tokens per block.
        block_size: usize,
    },
    /// `insert` was told blocks before `start_block` are cached, but one is not.
    #[error(
        "prefix cache insert: block {block} (tokens {from}..{to}) of weight version {version} \
         is not cached; insert the prefix before the blocks that extend it"
    )]
    MissingPrefix {
        /// Index of the first missing block.
        block: usize,
        /// First token of that block.
        from: usize,
        /// One past its last token.
        to: usize,
        /// Weight version looked up.
        version: u64,
    },
    /// A block id that is no longer (or never was) in the cache, or was invalidated.
    #[error("prefix cache block {0:?} is not cached (evicted, invalidated or never stored)")]
    UnknownBlock(BlockId),
}

/// A hold on a chain of cached blocks (from the first block up to `last`): none of them is
/// evicted until the lease is given back with [`PrefixCache::release`](super::PrefixCache::release). Not `Clone`, so each
/// hold is released once.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a lease pins cache blocks until it is released"]
pub struct PrefixLease {
    /// Last block of the held chain; `None` holds nothing.
    pub(super) last: Option<BlockId>,
}

impl PrefixLease {
    /// A lease that holds nothing (releasing it is a no-op).
    pub fn empty() -> Self {
        PrefixLease { last: None }
    }

    /// Last block of the held chain.
    pub fn last_block(&self) -> Option<BlockId> {
        self.last
    }
}

/// Result of [`PrefixCache::match_prefix`](super::PrefixCache::match_prefix).
#[derive(Debug)]
#[must_use = "the match holds a lease that must be released"]
pub struct PrefixMatch<P> {
    /// Number of leading tokens covered by cached blocks (a multiple of the block size).
    pub matched_tokens: usize,
    /// Ids of the matched blocks, first block first.
    pub blocks: Vec<BlockId>,
    /// Payload of each matched block, in order.
    pub payloads: Vec<Arc<P>>,
    /// Hold on the matched chain.
    pub lease: PrefixLease,
}

/// Result of [`PrefixCache::insert`](super::PrefixCache::insert).
#[derive(Debug)]
#[must_use = "the insert holds a lease that must be released"]
pub struct InsertOutcome<P> {
    /// Ids of the whole chain now cached for the given tokens (old and new blocks).
    pub blocks: Vec<BlockId>,
    /// Number of blocks newly stored by this call.
    pub inserted: usize,
    /// Payloads given but not stored (their block was already cached, or a hash collision
    /// stopped the insert); the engine may free what they hold.
    pub unused: Vec<Arc<P>>,
    /// Payloads of blocks evicted to stay under the budget; the engine may free them.
    pub evicted: Vec<Arc<P>>,
    /// Hold on the whole chain in `blocks`.
    pub lease: PrefixLease,
}
