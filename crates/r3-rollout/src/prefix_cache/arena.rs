//! Storage of the prefix cache's blocks: a slab with generation-checked ids, so an id kept
//! after its block was freed can never alias a newer block in the same slot.

use std::sync::Arc;

use super::BlockHash;

/// Identifier of one cached block; stale ids (block freed) are detected, never aliased.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId {
    /// Index of the slot in the arena.
    pub(super) slot: u32,
    /// Generation of the slot when the block was stored; bumped each time the slot is freed.
    pub(super) generation: u32,
}

/// One cached full block of `block_size` tokens and what the engine stored for it.
#[derive(Debug)]
pub(super) struct Node<P> {
    /// Chain hash of this block; the index maps it to this node while `stale` is false.
    pub hash: BlockHash,
    /// The block before this one in the sequence; `None` for a sequence's first block.
    /// A parent is never freed while it has children.
    pub parent: Option<BlockId>,
    /// Weight version the block was computed under; equal to the parent's version.
    pub version: u64,
    /// The block's tokens (exactly `block_size`), kept to verify hash matches.
    pub tokens: Box<[u32]>,
    /// The engine's data for this block (KV handle, route rows, ...).
    pub payload: Arc<P>,
    /// `payload.size_bytes()` when stored; counted in the cache's `used_bytes`.
    pub size_bytes: usize,
    /// Number of leases holding this block. A lease holds a whole chain, so
    /// `refs(parent) >= refs(child)` for every child: a referenced block's ancestors are
    /// referenced too, and unreferenced blocks form subtrees that eviction can peel leaf-first.
    pub refs: u32,
    /// Number of cached children (blocks whose `parent` is this one).
    pub children: u32,
    /// Logical time of the last match/insert that used this block (for LRU).
    pub last_used: u64,
    /// Invalidated by `clear`/`retain_version`: unreachable through the index, freed as soon
    /// as `refs` drops to zero. A stale block's children are stale too.
    pub stale: bool,
}

/// One arena slot: a block or nothing, and the generation that validates ids.
#[derive(Debug)]
struct Slot<P> {
    generation: u32,
    node: Option<Node<P>>,
}

/// Generation-checked slab of nodes.
#[derive(Debug)]
pub(super) struct Arena<P> {
    /// All slots; a freed slot stays in the vector with `node: None` and is listed in `free`.
    slots: Vec<Slot<P>>,
    /// Indices of empty slots, reused before the vector grows.
    free: Vec<u32>,
    /// Number of occupied slots.
    len: usize,
}

impl<P> Arena<P> {
    /// An empty arena.
    pub fn new() -> Self {
        Arena {
            slots: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }

    /// Number of stored nodes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Stores a node and returns its id.
    pub fn insert(&mut self, node: Node<P>) -> BlockId {
        self.len += 1;
        if let Some(slot) = self.free.pop() {
            let entry = &mut self.slots[slot as usize];
            entry.node = Some(node);
            return BlockId {
                slot,
                generation: entry.generation,
            };
        }
        let slot = self.slots.len() as u32;
        self.slots.push(Slot {
            generation: 0,
            node: Some(node),
        });
        BlockId {
            slot,
            generation: 0,
        }
    }

    /// The node behind `id`, if it is still stored.
    pub fn get(&self, id: BlockId) -> Option<&Node<P>> {
        let slot = self.slots.get(id.slot as usize)?;
        if slot.generation != id.generation {
            return None;
        }
        slot.node.as_ref()
    }

    /// Mutable access to the node behind `id`, if it is still stored.
    pub fn get_mut(&mut self, id: BlockId) -> Option<&mut Node<P>> {
        let slot = self.slots.get_mut(id.slot as usize)?;
        if slot.generation != id.generation {
            return None;
        }
        slot.node.as_mut()
    }

    /// Removes the node behind `id`; its id (and every copy of it) becomes invalid.
    pub fn remove(&mut self, id: BlockId) -> Option<Node<P>> {
        let slot = self.slots.get_mut(id.slot as usize)?;
        if slot.generation != id.generation {
            return None;
        }
        let node = slot.node.take()?;
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(id.slot);
        self.len -= 1;
        Some(node)
    }

    /// Ids of all stored nodes (in slot order).
    pub fn ids(&self) -> Vec<BlockId> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.node.is_some())
            .map(|(i, s)| BlockId {
                slot: i as u32,
                generation: s.generation,
            })
            .collect()
    }
}
