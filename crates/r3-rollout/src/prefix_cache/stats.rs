//! Counters the prefix cache keeps about its lookups, inserts and evictions.

use serde::Serialize;

/// Prefix cache counters since creation or the last reset (plus current occupancy).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PrefixCacheStats {
    /// Calls to `match_prefix`.
    pub lookups: u64,
    /// Lookups that matched at least one block.
    pub hit_lookups: u64,
    /// Full blocks asked for over all lookups.
    pub queried_blocks: u64,
    /// Full blocks found over all lookups (`<= queried_blocks`).
    pub hit_blocks: u64,
    /// Blocks newly stored by `insert`.
    pub inserted_blocks: u64,
    /// Blocks evicted to respect the byte budget.
    pub evicted_blocks: u64,
    /// Hash matches whose block turned out to hold different tokens (treated as misses).
    pub hash_collisions: u64,
    /// Calls to `clear` / `retain_version`.
    pub invalidations: u64,
    /// Blocks stored now.
    pub cached_blocks: usize,
    /// Payload bytes stored now.
    pub used_bytes: usize,
}

impl PrefixCacheStats {
    /// Fraction of queried blocks that were found (0 when nothing was queried).
    pub fn block_hit_rate(&self) -> f64 {
        if self.queried_blocks == 0 {
            0.0
        } else {
            self.hit_blocks as f64 / self.queried_blocks as f64
        }
    }
}
