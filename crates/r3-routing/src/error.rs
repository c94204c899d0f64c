//! The one error type of the routing crate: every variant names what is wrong and where
//! (token position, global layer, value) so a bad payload is never silently accepted.

use std::ops::Range;

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
    /// A negative id other than the documented missing sentinel -1: garbage, not "missing".
    #[error("token {token}, layer {layer}: id {value} is negative; only -1 marks a route as not captured")]
    NegativeId {
        /// Absolute token position.
        token: usize,
        /// Global transformer layer index.
        layer: usize,
        /// The offending value.
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
    /// Two tables, or a table and a layout or placement, disagree on one dimension.
    #[error("shape mismatch: {what} is {left} on one side, {right} on the other")]
    Shape {
        /// The dimension that differs (`num_experts`, `top_k`, `layers`, ...).
        what: &'static str,
        /// Its value on the receiving side (the table a method is called on).
        left: String,
        /// Its value on the other side (the argument, the layout, the placement).
        right: String,
    },
    /// A flat buffer whose length is not a whole number of rows (or cells).
    #[error("{what}: {len} ids is not a whole number of {unit}-id units")]
    Ragged {
        /// What the buffer is, and what a unit of it is.
        what: &'static str,
        /// Ids found.
        len: usize,
        /// Ids per row (or per cell).
        unit: usize,
    },
    /// Rows placed at positions that do not line up with the rows or the sequence they meet.
    #[error(
        "misaligned rows: {what} cover positions [{}, {}), against [{}, {}): {rule}",
        rows.start, rows.end, against.start, against.end
    )]
    Misaligned {
        /// The rows that are placed (`appended rows`, `resumed routes`, ...).
        what: &'static str,
        /// The positions they cover.
        rows: Range<usize>,
        /// The positions they are checked against (the table appended to, the earlier
        /// call, the positions a sequence feeds).
        against: Range<usize>,
        /// The rule they break.
        rule: &'static str,
    },
    /// A layer index at or past the model's layer count.
    #[error("{what} {layer} is out of range for a model of {num_layers} layers")]
    LayerOutOfRange {
        /// Where the layer index comes from (`MoE layer`, `mlp_only_layers entry`, ...).
        what: &'static str,
        /// The index.
        layer: usize,
        /// The model's `num_hidden_layers`.
        num_layers: usize,
    },
    /// A layer layout and a wire payload of different depths.
    #[error("layout has {layout} layers but the wire carries {wire}")]
    LayerCount {
        /// Layers of the layout.
        layout: usize,
        /// Layers of the wire payload.
        wire: usize,
    },
    /// A row, column or count past the end of the table it indexes.
    #[error("{what} {index} out of range (the table has {len})")]
    OutOfRange {
        /// What is indexed (`row`, `column`, `prompt rows`, ...).
        what: &'static str,
        /// The index or count asked for.
        index: usize,
        /// The table's size in that dimension.
        len: usize,
    },
    /// A size or position that does not fit in `usize`.
    #[error("{what} overflows")]
    Overflow {
        /// The quantity, with its operands.
        what: String,
    },
    /// A declared size above the documented limit ([`crate::DecodeLimits`]); refused before
    /// anything of that size is allocated.
    #[error("{what} = {value} exceeds the limit of {max}")]
    TooLarge {
        /// The size (`num_tokens`, `num_hidden_layers`, `top_k`, ...).
        what: &'static str,
        /// The value declared.
        value: usize,
        /// The largest value accepted.
        max: usize,
    },
    /// A layer layout or placement that cannot be right (ordering, duplicates, coverage).
    #[error("invalid layout: {0}")]
    Layout(String),
    /// An argument outside what the function accepts (top_k 0, a non-finite log-prob, ...).
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

    /// Shorthand for a shape mismatch of one dimension.
    pub fn shape(
        what: &'static str,
        left: impl std::fmt::Display,
        right: impl std::fmt::Display,
    ) -> Self {
        RouteError::Shape {
            what,
            left: left.to_string(),
            right: right.to_string(),
        }
    }

    /// Shorthand for a mismatch of two layer lists, each abbreviated when long.
    pub(crate) fn layers_shape(what: &'static str, left: &[usize], right: &[usize]) -> Self {
        RouteError::shape(what, abbreviate(left), abbreviate(right))
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

/// Short form of a layer list for error messages.
fn abbreviate(layers: &[usize]) -> String {
    if layers.len() <= 8 {
        format!("{layers:?}")
    } else {
        format!(
            "[{}, {}, ..., {}] ({} layers)",
            layers[0],
            layers[1],
            layers[layers.len() - 1],
            layers.len()
        )
    }
}
