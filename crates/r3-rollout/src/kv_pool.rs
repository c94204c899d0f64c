//! The paged KV cache: a pool of fixed-size blocks of `block_size` token positions, each
//! holding the keys and values of every layer for those positions.
//!
//! Blocks are handed out as [`KvBlockRef`] (an `Arc`): a running sequence holds refs to the
//! blocks of its context, the prefix cache holds refs to the blocks it keeps. When the last
//! ref is dropped the block id goes back to the pool's free list (through a shared recycle
//! queue, so a ref can be dropped anywhere — e.g. inside the prefix cache on eviction).
//! A block shared by several holders is full and never written again; only a sequence's
//! own tail block is written.
//!
//! The pool stores keys and values in the engine's dtype, as an f16 or bf16 GPU engine's
//! cache does (SGLang's and vLLM's `auto` KV dtype): an f16 engine's keys are rounded to f16
//! after RoPE when written, and a decode step's attention reads half the bytes an f32 cache
//! would need. The bf16 engine already rounds keys and values to bf16 before they are
//! written, so its cache holds the same values in half the memory. `KvCacheDtype` lets a user
//! keep f32 instead (the engine's `kv_cache_dtype`).

use std::sync::{Arc, Mutex};

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::dtype::Dtype;
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
    /// Values per token per layer (key then value).
    pub fn row(&self) -> usize {
        self.k_dim + self.v_dim
    }
    /// Values per block.
    pub fn block_floats(&self) -> usize {
        self.num_layers * self.block_size * self.row()
    }
}

/// A value type a KV cache stores: f32, f16 or bf16.
pub trait KvElement: Copy + Send + Sync + 'static {
    /// The nearest value of this type (ties to even; f32 as it is).
    fn narrow(v: f32) -> Self;
    /// The value as f32 (exact).
    fn widen(self) -> f32;
    /// `dst[i] = narrow(src[i])` (the slices are equally long).
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = Self::narrow(*s);
        }
    }
}

impl KvElement for f32 {
    #[inline(always)]
    fn narrow(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl KvElement for f16 {
    #[inline(always)]
    fn narrow(v: f32) -> Self {
        f16::from_f32(v)
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    /// Eight at a time where the CPU converts them (`half`'s F16C path; the same bits).
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl KvElement for bf16 {
    #[inline(always)]
    fn narrow(v: f32) -> Self {
        bf16::from_f32(v)
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// The blocks of one element type.
#[derive(Debug)]
enum KvStore {
    F32(Vec<Box<[f32]>>),
    F16(Vec<Box<[f16]>>),
    Bf16(Vec<Box<[bf16]>>),
}

impl KvStore {
    fn len(&self) -> usize {
        match self {
            KvStore::F32(b) => b.len(),
            KvStore::F16(b) => b.len(),
            KvStore::Bf16(b) => b.len(),
        }
    }
}

/// Read access to a pool's rows in its stored type (what the attention kernels take).
#[derive(Debug, Clone, Copy)]
pub struct KvRows<'a, E> {
    blocks: &'a [Box<[E]>],
    layout: KvLayout,
}

impl<'a, E: KvElement> KvRows<'a, E> {
    /// Token positions per block.
    pub fn block_size(&self) -> usize {
        self.layout.block_size
    }

    /// Key row (`k_dim` values) of `slot` in `block` for `layer`.
    #[inline]
    pub fn key(&self, block: KvBlockId, layer: usize, slot: usize) -> &'a [E] {
        let o = offset(&self.layout, layer, slot);
        &self.blocks[block.0 as usize][o..o + self.layout.k_dim]
    }

    /// Value row (`v_dim` values) of `slot` in `block` for `layer`.
    #[inline]
    pub fn value(&self, block: KvBlockId, layer: usize, slot: usize) -> &'a [E] {
        let o = offset(&self.layout, layer, slot) + self.layout.k_dim;
        &self.blocks[block.0 as usize][o..o + self.layout.v_dim]
    }

    /// The rows of slots `first..end` of `block` in `layer`, one after another (each
    /// [`KvLayout::row`] values: the key, then the value): one contiguous run of memory.
    #[inline]
    pub fn slot_run(&self, block: KvBlockId, layer: usize, first: usize, end: usize) -> &'a [E] {
        let (lo, hi) = (
            offset(&self.layout, layer, first),
            offset(&self.layout, layer, end),
        );
        &self.blocks[block.0 as usize][lo..hi]
    }

    /// The geometry of the rows.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }
}

/// A pool's rows, typed by what it stores.
#[derive(Debug, Clone, Copy)]
pub enum KvView<'a> {
    /// An f32 cache.
    F32(KvRows<'a, f32>),
    /// An f16 cache.
    F16(KvRows<'a, f16>),
    /// A bf16 cache.
    Bf16(KvRows<'a, bf16>),
}

/// Index of `(layer, slot)`'s row in a block.
#[inline]
fn offset(layout: &KvLayout, layer: usize, slot: usize) -> usize {
    (layer * layout.block_size + slot) * layout.row()
}

/// The pool of KV blocks (storage grows on demand up to `max_blocks`).
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    max_blocks: usize,
    store: KvStore,
    free: Vec<u32>,
    recycle: Arc<Mutex<Vec<u32>>>,
}

impl KvPool {
    /// An empty pool of keys and values in `dtype` that may grow to `max_blocks` blocks.
    pub fn new(layout: KvLayout, max_blocks: usize, dtype: Dtype) -> Result<Self, RolloutError> {
        if layout.block_size == 0 || max_blocks == 0 {
            return Err(RolloutError::InvalidConfig(
                "block_size and max_kv_blocks must be > 0".into(),
            ));
        }
        let store = match dtype {
            Dtype::F32 => KvStore::F32(Vec::new()),
            Dtype::F16 => KvStore::F16(Vec::new()),
            Dtype::Bf16 => KvStore::Bf16(Vec::new()),
        };
        Ok(KvPool {
            layout,
            max_blocks,
            store,
            free: Vec::new(),
            recycle: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// The pool's geometry.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The type keys and values are stored in.
    pub fn dtype(&self) -> Dtype {
        match self.store {
            KvStore::F32(_) => Dtype::F32,
            KvStore::F16(_) => Dtype::F16,
            KvStore::Bf16(_) => Dtype::Bf16,
        }
    }

    /// Bytes one block of `layout` holds in `dtype`.
    pub fn block_bytes_of(layout: &KvLayout, dtype: Dtype) -> usize {
        layout.block_floats() * dtype.bytes()
    }

    /// Bytes one block holds.
    pub fn block_bytes(&self) -> usize {
        Self::block_bytes_of(&self.layout, self.dtype())
    }

    /// The rows in their stored type.
    pub fn view(&self) -> KvView<'_> {
        let layout = self.layout;
        match &self.store {
            KvStore::F32(blocks) => KvView::F32(KvRows { blocks, layout }),
            KvStore::F16(blocks) => KvView::F16(KvRows { blocks, layout }),
            KvStore::Bf16(blocks) => KvView::Bf16(KvRows { blocks, layout }),
        }
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
        self.free.len() + (self.max_blocks - self.store.len())
    }

    /// Blocks in use (held by a sequence or the prefix cache).
    pub fn in_use(&mut self) -> usize {
        self.drain_recycled();
        self.store.len() - self.free.len()
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
        } else if self.store.len() < self.max_blocks {
            let len = self.layout.block_floats();
            match &mut self.store {
                KvStore::F32(b) => b.push(vec![0f32; len].into_boxed_slice()),
                KvStore::F16(b) => b.push(vec![f16::ZERO; len].into_boxed_slice()),
                KvStore::Bf16(b) => b.push(vec![bf16::ZERO; len].into_boxed_slice()),
            }
            (self.store.len() - 1) as u32
        } else {
            return None;
        };
        Some(Arc::new(KvBlock {
            id: KvBlockId(id),
            recycle: Arc::clone(&self.recycle),
        }))
    }

    /// Key row of `slot` in `block` for `layer`, widened to f32.
    pub fn read_key(&self, block: KvBlockId, layer: usize, slot: usize) -> Vec<f32> {
        match self.view() {
            KvView::F32(r) => widened(r.key(block, layer, slot)),
            KvView::F16(r) => widened(r.key(block, layer, slot)),
            KvView::Bf16(r) => widened(r.key(block, layer, slot)),
        }
    }

    /// Value row of `slot` in `block` for `layer`, widened to f32.
    pub fn read_value(&self, block: KvBlockId, layer: usize, slot: usize) -> Vec<f32> {
        match self.view() {
            KvView::F32(r) => widened(r.value(block, layer, slot)),
            KvView::F16(r) => widened(r.value(block, layer, slot)),
            KvView::Bf16(r) => widened(r.value(block, layer, slot)),
        }
    }

    /// Writes the key and value of one token position, each value rounded to the stored
    /// type (to nearest, ties to even).
    pub fn write(&mut self, block: KvBlockId, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let (o, kd, row) = (
            offset(&self.layout, layer, slot),
            self.layout.k_dim,
            self.layout.row(),
        );
        match &mut self.store {
            KvStore::F32(b) => write_row(&mut b[block.0 as usize][o..o + row], kd, k, v),
            KvStore::F16(b) => write_row(&mut b[block.0 as usize][o..o + row], kd, k, v),
            KvStore::Bf16(b) => write_row(&mut b[block.0 as usize][o..o + row], kd, k, v),
        }
    }
}

/// `dst = [k | v]` (key first, `kd` values), narrowed to `E`.
///
/// # Panics
/// When `k` is not `kd` values or `v` not the rest of `dst`.
fn write_row<E: KvElement>(dst: &mut [E], kd: usize, k: &[f32], v: &[f32]) {
    let (dk, dv) = dst.split_at_mut(kd);
    assert!(
        k.len() == dk.len() && v.len() == dv.len(),
        "KV row: a key of {} and a value of {} for a {}+{} row",
        k.len(),
        v.len(),
        dk.len(),
        dv.len()
    );
    E::narrow_slice(k, dk);
    E::narrow_slice(v, dv);
}

/// `row` widened to f32.
fn widened<E: KvElement>(row: &[E]) -> Vec<f32> {
    row.iter().map(|v| v.widen()).collect()
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
        let mut pool = KvPool::new(layout(), 2, Dtype::F32).unwrap();
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
        let mut pool = KvPool::new(layout(), 1, Dtype::F32).unwrap();
        let a = pool.allocate().unwrap();
        pool.write(a.id(), 1, 3, &[1.0, 2.0, 3.0], &[4.0, 5.0]);
        assert_eq!(pool.read_key(a.id(), 1, 3), [1.0, 2.0, 3.0]);
        assert_eq!(pool.read_value(a.id(), 1, 3), [4.0, 5.0]);
        assert_eq!(pool.read_key(a.id(), 0, 3), [0.0, 0.0, 0.0]);
    }

    /// A half-precision pool stores each value as `half` rounds it (to nearest, ties to
    /// even), in half the bytes; values the type holds exactly come back unchanged.
    #[test]
    fn half_pools_round_like_half_in_half_the_bytes() {
        let k = [1.0f32 + 1.0 / 3.0, -7.3e-3, 70000.0];
        let v = [0.5f32, 1.0 + f32::EPSILON];
        for dtype in [Dtype::F16, Dtype::Bf16] {
            let mut pool = KvPool::new(layout(), 1, dtype).unwrap();
            assert_eq!(pool.dtype(), dtype);
            assert_eq!(
                pool.block_bytes() * 2,
                KvPool::block_bytes_of(&layout(), Dtype::F32)
            );
            let a = pool.allocate().unwrap();
            pool.write(a.id(), 0, 2, &k, &v);
            let round = |x: f32| match dtype {
                Dtype::F16 => f16::from_f32(x).to_f32(),
                _ => bf16::from_f32(x).to_f32(),
            };
            let want_k: Vec<f32> = k.iter().map(|&x| round(x)).collect();
            let want_v: Vec<f32> = v.iter().map(|&x| round(x)).collect();
            assert_eq!(pool.read_key(a.id(), 0, 2), want_k, "{dtype}");
            assert_eq!(pool.read_value(a.id(), 0, 2), want_v, "{dtype}");
            assert_eq!(want_v[0], 0.5, "exact values stay");
        }
        // f16 overflows past 65504, as a GPU engine's f16 cache does.
        assert!(f16::from_f32(70000.0).to_f32().is_infinite());
    }
}
