//! Invalidation of cached blocks (weight updates, `clear`): stale blocks leave the index at
//! once and are freed as soon as no lease holds them.

use std::sync::Arc;

use super::{BlockId, BlockPayload, PrefixCache};

impl<P: BlockPayload> PrefixCache<P> {
    /// Invalidates every block: none is matched again. Unleased blocks are freed now (their
    /// payloads returned); leased ones are freed by the release of their last lease.
    pub fn clear(&mut self) -> Vec<Arc<P>> {
        self.invalidate(|_| true)
    }

    /// Invalidates every block whose weight version is not `keep` (call after a weight
    /// update; old versions can no longer match anyway, this frees their memory early).
    pub fn retain_version(&mut self, keep: u64) -> Vec<Arc<P>> {
        self.invalidate(|v| v != keep)
    }

    fn invalidate(&mut self, drop_version: impl Fn(u64) -> bool) -> Vec<Arc<P>> {
        let ids = self.arena.ids();
        for &id in &ids {
            let Some(node) = self.arena.get_mut(id) else {
                continue;
            };
            if node.stale || !drop_version(node.version) {
                continue;
            }
            node.stale = true;
            let (hash, last_used) = (node.hash, node.last_used);
            self.index.remove(&hash);
            self.evictable.remove(&(last_used, id));
        }
        self.stats.invalidations += 1;
        // Free unleased stale blocks leaf-first: a stale block's children are stale and, if
        // unleased, freed before it.
        let mut freed = Vec::new();
        let mut pending: Vec<BlockId> = ids;
        loop {
            let before = freed.len();
            pending.retain(|&id| match self.arena.get(id) {
                Some(n) if n.stale && n.refs == 0 && n.children == 0 => {
                    freed.extend(self.free(id));
                    false
                }
                Some(n) => n.stale && n.refs == 0,
                None => false,
            });
            if freed.len() == before {
                break;
            }
        }
        freed
    }
}
