//! The one error type of the routing crate: every variant names what is wrong and where
//! (token position, global layer, value) so a bad payload is never silently accepted.

use thiserror::Error;

/// Everything that can go wrong when building, converting, decoding or comparing routes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RouteError {
    /// An expert id is outside `[0, num_experts)`.
    #[error("token {token}, layer {layer}: expert id {value} out of range [0, {num_experts})")]
    ExpertOutOfRange {
        /// Absolute token position.
        token: usize,
        /// Global transformer layer index.
        layer: usize,
        /// The offending id as read.
        value: i64,
        /// Number of experts the table was declared with.
        num_experts: usize,
    },
    /// The same expert appears twice in one (token, layer) cell.
    #[error("token {token}, layer {layer}: expert {expert} appears more than once in the top-k")]
    DuplicateExpert {
        /// Absolute token position.
        token: usize,
        /// Global transformer layer index.
        layer: usize,
        /// The repeated expert id.
        expert: u32,
    },
    /// A cell mixes negative "not captured" markers with real ids.
    #[error("token {token}, layer {layer}: cell mixes missing (-1) and present ids ({value})")]
    PartiallyMissing {
        /// Absolute token position.
        token: usize,
        /// Global transformer layer index.
        layer: usize,
        /// The first negative value seen.
        value: i64,
    },
    /// A cell whose ids are all 0 with top_k > 1: a dense layer or a route that was never
    /// captured (vLLM #33013), not a real top-k choice.
    #[error("token {token}, layer {layer}: all {top_k} ids are 0 — an uncaptured route or a dense layer (give the layer layout, e.g. --first-k-dense), not a top-k choice")]
    ZeroCell {
        /// Absolute token position.
        token: usize,
        /// Global transformer layer index.
        layer: usize,
        /// Experts per cell.
        top_k: usize,
    },
    /// A cell that must hold routes has none.
    #[error("token {token}, layer {layer}: no route recorded (cell is marked missing)")]
    MissingRoute {
        /// Absolute token position.
        token: usize,
        /// Global transformer layer index.
        layer: usize,
    },
    /// A dense (non-MoE) layer carries a non-empty route.
    #[error("token {token}, layer {layer} is a dense layer but carries expert id {value} (dense columns must be empty, 0 or -1)")]
    DenseColumnNotEmpty {
        /// Absolute token position.
        token: usize,
        /// Global transformer layer index.
        layer: usize,
        /// The offending id.
        value: i64,
    },
    /// A physical (EPLB slot) id is outside the placement.
    #[error(
        "token {token}, layer {layer}: physical expert slot {value} out of range [0, {num_slots})"
    )]
    PhysicalOutOfRange {
        /// Absolute token position.
        token: usize,
        /// Global transformer layer index.
        layer: usize,
        /// The offending slot id.
        value: i64,
        /// Number of physical slots in the placement.
        num_slots: usize,
    },
    /// A length or count does not match what the shape requires.
    #[error("{what}: expected {expected}, got {got}")]
    Length {
        /// What was being counted.
        what: String,
        /// The count the shape requires.
        expected: usize,
        /// The count found.
        got: usize,
    },
    /// Two tables (or a table and a layout) do not describe the same shape or space.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// Rows appended or merged at the wrong position.
    #[error("misaligned rows: {0}")]
    Misaligned(String),
    /// A layer layout or placement that cannot be right.
    #[error("invalid layout: {0}")]
    Layout(String),
    /// An argument outside what the function accepts (top_k 0, too many experts, ...).
    #[error("invalid argument: {0}")]
    Argument(String),
    /// A wire payload that cannot be decoded.
    #[error("{format} payload: {msg}")]
    Format {
        /// Wire format name (`sglang`, `vllm`, `vllm-json`, `r3`, `r3-bin`).
        format: &'static str,
        /// What is wrong with it.
        msg: String,
    },
}

impl RouteError {
    /// Shorthand for a wire-format error.
    pub fn format(format: &'static str, msg: impl Into<String>) -> Self {
        RouteError::Format {
            format,
            msg: msg.into(),
        }
    }

    /// Shorthand for a length mismatch.
    pub fn length(what: impl Into<String>, expected: usize, got: usize) -> Self {
        RouteError::Length {
            what: what.into(),
            expected,
            got,
        }
    }
}
