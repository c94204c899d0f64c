//! Chain hashes of full token blocks, keyed by weight version.
//!
//! A block's hash covers its parent's hash, the weight version and the block's tokens, so
//! equal hashes mean (up to collisions, which the cache checks) "the same tokens after the
//! same prefix under the same weights". Blocks computed under other weights never share a
//! hash with the current ones, so a weight update cannot produce a stale hit.

use std::hash::{DefaultHasher, Hash, Hasher};

/// Hash of a full token block and, through its parent, of the whole prefix before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(u64);

impl BlockHash {
    /// The hash every chain of weight version `version` starts from (the empty prefix).
    pub fn root(version: u64) -> Self {
        let mut h = DefaultHasher::new();
        "r3-prefix-root".hash(&mut h);
        version.hash(&mut h);
        BlockHash(h.finish())
    }

    /// Hash of the block `tokens` that follows the prefix hashed as `self`.
    pub fn chain(self, version: u64, tokens: &[u32]) -> Self {
        let mut h = DefaultHasher::new();
        self.0.hash(&mut h);
        version.hash(&mut h);
        tokens.hash(&mut h);
        BlockHash(h.finish())
    }

    /// The raw 64-bit value (for logs and debugging).
    pub fn value(self) -> u64 {
        self.0
    }
}

/// Chain hashes of every full block of `tokens` (a trailing partial block has none).
pub fn full_block_hashes(tokens: &[u32], version: u64, block_size: usize) -> Vec<BlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = BlockHash::root(version);
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            parent = parent.chain(version, block);
            parent
        })
        .collect()
}

/// Tokens of the full blocks of `block_size` that `a` and `b` both begin with: what one
/// sequence's cached blocks could serve the other (the engines hold a request back while a
/// running one computes such blocks).
pub fn shared_block_tokens(a: &[u32], b: &[u32], block_size: usize) -> usize {
    if block_size == 0 {
        return 0;
    }
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    common / block_size * block_size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_prefix_version_and_tokens() {
        let a = full_block_hashes(&[1, 2, 3, 4], 0, 2);
        let b = full_block_hashes(&[9, 9, 3, 4], 0, 2);
        let c = full_block_hashes(&[1, 2, 3, 4], 1, 2);
        assert_eq!(a.len(), 2);
        // Same second block, different first block: the chain makes the hashes differ.
        assert_ne!(a[1], b[1]);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1]);
        // Deterministic.
        assert_eq!(a, full_block_hashes(&[1, 2, 3, 4, 5], 0, 2));
    }

    #[test]
    fn partial_blocks_have_no_hash() {
        assert_eq!(full_block_hashes(&[1, 2, 3], 0, 2).len(), 1);
        assert!(full_block_hashes(&[1], 0, 2).is_empty());
        assert!(full_block_hashes(&[1, 2], 0, 0).is_empty());
    }
}
