//! [`DecodeLimits`]: the largest size a route payload, a layer layout or an expert placement
//! may declare. Every count read from a file, a request or a flag is checked against this
//! table (and, for payloads, against the bytes actually present) before anything is
//! allocated, so a tiny input cannot ask for terabytes.

use crate::table::MAX_EXPERTS;
use crate::RouteError;

/// The documented upper bounds of the routing crate (far above any released MoE model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits;

impl DecodeLimits {
    /// Transformer layers of a model, columns of a table, and one past the largest layer
    /// index (released models have at most a few hundred).
    pub const MAX_LAYERS: usize = 1 << 12;
    /// Logical experts per MoE layer (ids are stored as u16).
    pub const MAX_EXPERTS: usize = MAX_EXPERTS;
    /// Experts chosen per token per layer.
    pub const MAX_TOP_K: usize = 1 << 8;
    /// Rows (tokens) of one route table.
    pub const MAX_TOKENS: usize = 1 << 22;
    /// Physical expert slots of an EPLB placement.
    pub const MAX_SLOTS: usize = 1 << 20;
    /// Ids of one table, `tokens × columns × top_k` (one byte each at ≤ 256 experts).
    pub const MAX_IDS: usize = 1 << 31;

    /// Refuses `value` above `max`, naming `what`.
    pub fn check(what: &'static str, value: usize, max: usize) -> Result<(), RouteError> {
        if value > max {
            return Err(RouteError::TooLarge { what, value, max });
        }
        Ok(())
    }

    /// Refuses a layer count above [`DecodeLimits::MAX_LAYERS`].
    pub fn check_layers(what: &'static str, num_layers: usize) -> Result<(), RouteError> {
        Self::check(what, num_layers, Self::MAX_LAYERS)
    }

    /// Refuses a row count above [`DecodeLimits::MAX_TOKENS`].
    pub fn check_tokens(what: &'static str, num_tokens: usize) -> Result<(), RouteError> {
        Self::check(what, num_tokens, Self::MAX_TOKENS)
    }

    /// `tokens × columns × top_k` with checked arithmetic, refused above
    /// [`DecodeLimits::MAX_IDS`].
    pub fn id_count(tokens: usize, columns: usize, top_k: usize) -> Result<usize, RouteError> {
        let n = tokens
            .checked_mul(columns)
            .and_then(|c| c.checked_mul(top_k))
            .ok_or_else(|| RouteError::Overflow {
                what: format!("ids of {tokens} tokens x {columns} columns x top_k {top_k}"),
            })?;
        Self::check("ids (tokens x columns x top_k)", n, Self::MAX_IDS)?;
        Ok(n)
    }
}
