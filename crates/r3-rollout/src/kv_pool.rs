//! The paged KV cache: a pool of fixed-size blocks of `block_size` token positions, each
//! holding the keys and values of every layer for those positions.
//!
//! Blocks are handed out as [`KvBlockRef`] (an `Arc`): a running sequence holds refs to the
//! blocks of its context, the prefix cache holds refs to the blocks it keeps. When the last
//! ref is dropped the block id goes back to the pool's free list (through a shared recycle
//! queue, so a ref can be dropped anywhere — e.g. inside the prefix cache on eviction).
//! A block shared by several holders is full and never written again; only a sequence's
//! own tail block is written.

use std::sync::{Arc, Mutex};

use crate::error::RolloutError;

/// Id of one KV block in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvBlockId(pub u32);

/// Shared ownership of one KV block; the block is freed when the last ref is dropped.
#[derive(Debug)]
pub struct KvBlock {
    id: KvBlockId,
    recycle: Arc<Mutex<Vec<u32>>>,
}

impl KvBlock {
    /// The block's id in the pool.
    pub fn id(&self) -> KvBlockId {
        self.id
    }
}

impl Drop for KvBlock {
    fn drop(&mut self) {
        // A poisoned lock only means another thread panicked while pushing an id; the
        // vector itself is still valid, so keep recycling.
        let mut q = match self.recycle.lock() {
            Ok(q) => q,
            Err(p) => p.into_inner(),
        };
        q.push(self.id.0);
    }
}

/// A reference-counted handle to a KV block (what sequences and the prefix cache hold).
pub type KvBlockRef = Arc<KvBlock>;

/// Geometry of one token's KV entry in one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Number of layers with attention (all transformer layers).
    pub num_layers: usize,
    /// Floats per token for keys (kv_heads × key head dim).
    pub k_dim: usize,
    /// Floats per token for values (kv_heads × value head dim).
    pub v_dim: usize,
    /// Token positions per block.
    pub block_size: usize,
}

impl KvLayout {
    /// Floats per token per layer (key then value).
    pub fn row(&self) -> usize {
        self.k_dim + self.v_dim
    }
    /// Floats per block.
    pub fn block_floats(&self) -> usize {
        self.num_layers * self.block_size * self.row()
    }
}

/// The pool of KV blocks (storage grows on demand up to `max_blocks`).
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    max_blocks: usize,
    storage: Vec<Box<[f32]>>,
    free: Vec<u32>,
    recycle: Arc<Mutex<Vec<u32>>>,
}

impl KvPool {
    /// An empty pool that may grow to `max_blocks` blocks.
    pub fn new(layout: KvLayout, max_blocks: usize) -> Result<Self, RolloutError> {
        if layout.block_size == 0 || max_blocks == 0 {
            return Err(RolloutError::InvalidConfig(
                "block_size and max_kv_blocks must be > 0".into(),
            ));
        }
        Ok(KvPool {
            layout,
            max_blocks,
            storage: Vec::new(),
            free: Vec::new(),
            recycle: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// The pool's geometry.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Takes back the ids of blocks whose last ref was dropped.
    fn drain_recycled(&mut self) {
        let mut q = match self.recycle.lock() {
            Ok(q) => q,
            Err(p) => p.into_inner(),
        };
        self.free.append(&mut q);
    }

    /// Blocks that can still be allocated (free now or not yet created).
    pub fn available(&mut self) -> usize {
        self.drain_recycled();
        self.free.len() + (self.max_blocks - self.storage.len())
    }

    /// Blocks in use (held by a sequence or the prefix cache).
    pub fn in_use(&mut self) -> usize {
        self.drain_recycled();
        self.storage.len() - self.free.len()
    }

    /// Total block budget.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// Allocates one block, or `None` when the budget is exhausted.
    pub fn allocate(&mut self) -> Option<KvBlockRef> {
        self.drain_recycled();
        let id = if let Some(id) = self.free.pop() {
            id
        } else if self.storage.len() < self.max_blocks {
            self.storage
                .push(vec![0f32; self.layout.block_floats()].into_boxed_slice());
            (self.storage.len() - 1) as u32
        } else {
            return None;
        };
        Some(Arc::new(KvBlock {
            id: KvBlockId(id),
            recycle: Arc::clone(&self.recycle),
        }))
    }

    fn offset(&self, layer: usize, slot: usize) -> usize {
        (layer * self.layout.block_size + slot) * self.layout.row()
    }

    /// Key row (`k_dim` floats) of `slot` in `block` for `layer`.
    #[inline]
    pub fn key(&self, block: KvBlockId, layer: usize, slot: usize) -> &[f32] {
        let o = self.offset(layer, slot);
        &self.storage[block.0 as usize][o..o + self.layout.k_dim]
    }

    /// Value row (`v_dim` floats) of `slot` in `block` for `layer`.
    #[inline]
    pub fn value(&self, block: KvBlockId, layer: usize, slot: usize) -> &[f32] {
        let o = self.offset(layer, slot) + self.layout.k_dim;
        &self.storage[block.0 as usize][o..o + self.layout.v_dim]
    }

    /// Writes the key and value of one token position.
    pub fn write(&mut self, block: KvBlockId, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let o = self.offset(layer, slot);
        let kd = self.layout.k_dim;
        let dst = &mut self.storage[block.0 as usize][o..o + self.layout.row()];
        dst[..kd].copy_from_slice(k);
        dst[kd..].copy_from_slice(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 2,
            k_dim: 3,
            v_dim: 2,
            block_size: 4,
        }
    }

    #[test]
    fn blocks_are_recycled_when_the_last_ref_drops() {
        let mut pool = KvPool::new(layout(), 2).unwrap();
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        assert!(pool.allocate().is_none());
        assert_eq!(pool.available(), 0);
        let a2 = Arc::clone(&a);
        drop(a);
        assert_eq!(pool.available(), 0, "still held by a2");
        drop(a2);
        assert_eq!(pool.available(), 1);
        let c = pool.allocate().unwrap();
        assert_ne!(c.id(), b.id());
        assert_eq!(pool.in_use(), 2);
    }

    #[test]
    fn write_then_read_back() {
        let mut pool = KvPool::new(layout(), 1).unwrap();
        let a = pool.allocate().unwrap();
        pool.write(a.id(), 1, 3, &[1.0, 2.0, 3.0], &[4.0, 5.0]);
        assert_eq!(pool.key(a.id(), 1, 3), &[1.0, 2.0, 3.0]);
        assert_eq!(pool.value(a.id(), 1, 3), &[4.0, 5.0]);
        assert_eq!(pool.key(a.id(), 0, 3), &[0.0, 0.0, 0.0]);
    }
}
