//! [`ConfigLimits`]: the largest value every size key of a config.json may take. Sizes are
//! checked against this table before anything is built from them (layer layouts, tensor
//! specs, weights), so `"num_hidden_layers": 1000000000` is an error naming the key, not an
//! allocation. The bounds sit far above every released model.

use r3_routing::DecodeLimits;

use crate::error::{ModelError, Result};

/// Documented upper bounds of config.json sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigLimits;

impl ConfigLimits {
    /// `num_hidden_layers` (and every layer index: `first_k_dense_replace`, ...).
    pub const MAX_LAYERS: usize = DecodeLimits::MAX_LAYERS;
    /// Routed experts per MoE layer (and `n_shared_experts`, `n_group`, `topk_group`).
    pub const MAX_EXPERTS: usize = DecodeLimits::MAX_EXPERTS;
    /// `num_experts_per_tok`.
    pub const MAX_TOP_K: usize = DecodeLimits::MAX_TOP_K;
    /// `hidden_size` and the MLA lora ranks.
    pub const MAX_HIDDEN: usize = 1 << 17;
    /// `intermediate_size`, `moe_intermediate_size`, `shared_expert_intermediate_size`.
    pub const MAX_INTERMEDIATE: usize = 1 << 20;
    /// `num_attention_heads`, `num_key_value_heads`.
    pub const MAX_HEADS: usize = 1 << 12;
    /// `head_dim` and the MLA per-head widths.
    pub const MAX_HEAD_DIM: usize = 1 << 12;
    /// `vocab_size`.
    pub const MAX_VOCAB: usize = 1 << 23;
    /// `max_position_embeddings`, `sliding_window`, yarn `original_max_position_embeddings`.
    pub const MAX_POSITIONS: usize = 1 << 30;
    /// Routed expert blocks over all MoE layers (MoE layers × experts), which decides how
    /// many tensors a checkpoint has.
    pub const MAX_EXPERT_BLOCKS: usize = 1 << 20;
    /// Parameters of the whole model (sum of every tensor's element count).
    pub const MAX_PARAMETERS: usize = 1 << 42;

    /// Refuses `value` of config key `key` above `max`.
    pub fn check(key: &'static str, value: usize, max: usize) -> Result<()> {
        if value > max {
            return Err(ModelError::ConfigTooLarge { key, value, max });
        }
        Ok(())
    }

    /// [`ConfigLimits::check`] for a key that may be absent.
    pub fn check_opt(key: &'static str, value: Option<usize>, max: usize) -> Result<()> {
        value.map_or(Ok(()), |v| Self::check(key, v, max))
    }
}
