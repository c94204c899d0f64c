//! Attention: the masked softmax core (`attend`, the CPU's fused op `masked_op`, the
//! recomputing op the other devices differentiate, `recompute`), its mask, grouped-query
//! (`GqaAttention`) and multi-head latent (`mla`) attention, rotary position embeddings
//! (`rope`), the KV cache a decode step reads, its mask (`cache_mask`), the decode kernel
//! (`rows`), and the query tiles a step over it attends in otherwise (`tiles`, within
//! `score_tiles`' bound).

mod attend;
mod cache_mask;
mod gqa;
mod kv;
mod mask;
pub mod masked_op;
pub mod mla;
mod narrow_product;
pub mod recompute;
pub mod rope;
pub mod rope_op;
mod rope_rounded;
mod rows;
mod score_tiles;
mod softmax;
mod tiles;

pub use attend::{attend, attend_additive, attend_composed, heads_to_tokens};
pub use cache_mask::CacheMask;
pub(crate) use gqa::RowAttention;
pub use gqa::{GqaAttention, SlotRows};
pub use kv::{kv_capacity_for, LayerKv};
pub use mask::AttentionMask;
pub use score_tiles::{RowBlock, ScoreTile, ScoreTiles, MAX_TENSOR_ELEMENTS};
pub use tiles::{attend_cached, attend_tiled};
