//! Wire codecs for routed-expert payloads: SGLang (base64 flat little-endian), vLLM ≥ 0.22
//! (base64 `.npy`), vLLM 0.21 (nested JSON) and r3's compact binary. Every wire format is in
//! the all-layers space `[rows, num_hidden_layers, top_k]`; given a [`LayerLayout`] a decoder
//! checks that dense columns are empty (0 or -1) and returns a MoE-only table, otherwise it
//! returns an all-layers table. Row 0 is token position `start_len`.
//!
//! Zeros: SGLang and vLLM write 0 for dense layers and for rows they never captured. With
//! `top_k > 1` such a cell (all ids 0) is an error wherever it is read as a route
//! ([`RouteError::ZeroCell`]). A top-1 cell `[0]` is expert 0, which a zero filler cannot be
//! told from; so a top-1 payload is decoded only with a layout, whose MoE columns are read as
//! routes (expert 0 included) and whose dense columns are checked empty and dropped. Without a
//! layout a top-1 decode is refused ([`RouteError::Layout`]).

pub mod binary;
pub mod npy;
pub mod sglang;
pub mod vllm;
pub mod vllm_json;

use base64::Engine as _;

use crate::build::check_counts;
use crate::{DecodeLimits, LayerLayout, LayerSpace, RouteError, RouteTable};

/// What the receiver knows about the model, needed to interpret a payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireShape {
    /// Layers on the wire (`num_hidden_layers`, dense layers included).
    pub num_layers: usize,
    /// Experts per token per layer.
    pub top_k: usize,
    /// Logical experts per MoE layer.
    pub num_experts: usize,
    /// Position of the first row (SGLang/vLLM `start_len` / prompt start).
    pub start_len: usize,
    /// Which layers are MoE; when given, decoders return MoE-only tables.
    pub layout: Option<LayerLayout>,
}

impl WireShape {
    /// Shape without a layout, rows starting at position 0.
    pub fn new(num_layers: usize, top_k: usize, num_experts: usize) -> Self {
        WireShape {
            num_layers,
            top_k,
            num_experts,
            start_len: 0,
            layout: None,
        }
    }

    /// Sets the position of row 0.
    pub fn with_start_len(mut self, start_len: usize) -> Self {
        self.start_len = start_len;
        self
    }

    /// Sets the layer layout (its layer count must equal `num_layers`).
    pub fn with_layout(mut self, layout: LayerLayout) -> Result<Self, RouteError> {
        if layout.num_hidden_layers() != self.num_layers {
            return Err(RouteError::LayerCount {
                layout: layout.num_hidden_layers(),
                wire: self.num_layers,
            });
        }
        self.layout = Some(layout);
        Ok(self)
    }

    /// Values per row on the wire (`num_layers * top_k`), error if zero; the declared sizes
    /// are checked against [`DecodeLimits`] first, so nothing is allocated from them.
    pub(crate) fn row_len(&self, format: &'static str) -> Result<usize, RouteError> {
        if self.num_layers == 0 || self.top_k == 0 {
            return Err(RouteError::format(
                format,
                format!(
                    "num_layers {} x top_k {} gives no values per row",
                    self.num_layers, self.top_k
                ),
            ));
        }
        DecodeLimits::check_layers("num_layers", self.num_layers)?;
        check_counts(self.num_experts, self.top_k)?;
        Ok(self.num_layers * self.top_k)
    }
}

/// Element type of a binary payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WireDtype {
    /// Unsigned 8-bit (cannot carry -1: no missing cells).
    U8,
    /// Unsigned 16-bit little-endian (cannot carry -1).
    U16,
    /// Signed 16-bit little-endian.
    I16,
    /// Signed 32-bit little-endian.
    I32,
}

impl WireDtype {
    /// All dtypes, for tests and benches.
    pub const ALL: [WireDtype; 4] = [
        WireDtype::U8,
        WireDtype::U16,
        WireDtype::I16,
        WireDtype::I32,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            WireDtype::U8 => 1,
            WireDtype::U16 | WireDtype::I16 => 2,
            WireDtype::I32 => 4,
        }
    }

    /// Whether -1 ("not captured") can be written.
    pub fn is_signed(self) -> bool {
        matches!(self, WireDtype::I16 | WireDtype::I32)
    }

    /// Largest id the dtype can carry.
    pub fn max_id(self) -> i64 {
        match self {
            WireDtype::U8 => 255,
            WireDtype::U16 => 65535,
            WireDtype::I16 => 32767,
            WireDtype::I32 => i64::from(i32::MAX),
        }
    }

    /// The torch/numpy name (`uint8`, `uint16`, `int16`, `int32`).
    pub fn name(self) -> &'static str {
        match self {
            WireDtype::U8 => "uint8",
            WireDtype::U16 => "uint16",
            WireDtype::I16 => "int16",
            WireDtype::I32 => "int32",
        }
    }

    /// Parses a torch/numpy name, with or without a `torch.` prefix.
    pub fn parse(name: &str) -> Option<Self> {
        match name.trim().trim_start_matches("torch.") {
            "uint8" | "u8" => Some(WireDtype::U8),
            "uint16" | "u16" => Some(WireDtype::U16),
            "int16" | "i16" => Some(WireDtype::I16),
            "int32" | "i32" => Some(WireDtype::I32),
            _ => None,
        }
    }

    /// Reads element `i` of a little-endian array; the caller has checked the length.
    #[inline]
    fn read(self, bytes: &[u8], i: usize) -> i64 {
        match self {
            WireDtype::U8 => i64::from(bytes[i]),
            WireDtype::U16 => i64::from(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
            WireDtype::I16 => i64::from(i16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
            WireDtype::I32 => {
                let b = &bytes[4 * i..4 * i + 4];
                i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
        }
    }

    /// Appends `v` (already range-checked) little-endian.
    fn write(self, out: &mut Vec<u8>, v: i64) {
        match self {
            WireDtype::U8 => out.push(v as u8),
            WireDtype::U16 => out.extend_from_slice(&(v as u16).to_le_bytes()),
            WireDtype::I16 => out.extend_from_slice(&(v as i16).to_le_bytes()),
            WireDtype::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
        }
    }
}

/// Decodes standard base64 (padding required), ignoring ASCII whitespace.
pub(crate) fn decode_base64(s: &str, format: &'static str) -> Result<Vec<u8>, RouteError> {
    let engine = base64::engine::general_purpose::STANDARD;
    // Payloads rarely hold whitespace: decode first, strip only if that fails on it (one
    // pass over a large payload instead of two).
    let r = engine.decode(s).or_else(|e| {
        if s.bytes().any(|b| b.is_ascii_whitespace()) {
            let clean: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
            engine.decode(clean)
        } else {
            Err(e)
        }
    });
    r.map_err(|e| RouteError::format(format, format!("invalid base64: {e}")))
}

/// Encodes standard base64 with padding.
pub(crate) fn encode_base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Decodes a flat little-endian `[rows, num_layers, top_k]` array.
pub(crate) fn decode_le(
    bytes: &[u8],
    dtype: WireDtype,
    shape: &WireShape,
    format: &'static str,
) -> Result<RouteTable, RouteError> {
    let row_bytes = shape.row_len(format)? * dtype.size();
    if !bytes.len().is_multiple_of(row_bytes) {
        return Err(RouteError::format(
            format,
            format!(
                "{} bytes is not a whole number of rows of {} layers x top_k {} x {} bytes ({})",
                bytes.len(),
                shape.num_layers,
                shape.top_k,
                dtype.size(),
                dtype.name()
            ),
        ));
    }
    let rows = bytes.len() / row_bytes;
    match dtype {
        WireDtype::U8 => table_from_wire(shape, rows, |i| i64::from(bytes[i])),
        WireDtype::U16 => table_from_wire(shape, rows, |i| WireDtype::U16.read(bytes, i)),
        WireDtype::I16 => table_from_wire(shape, rows, |i| WireDtype::I16.read(bytes, i)),
        WireDtype::I32 => table_from_wire(shape, rows, |i| WireDtype::I32.read(bytes, i)),
    }
}

/// Decodes an in-memory all-layers array `[rows, num_layers, top_k]` (row-major, any
/// integer type), as the wire decoders do: with a layout, dense columns must be empty and
/// the table is MoE-only. The array is read in place.
pub fn decode_values<T: Copy + Into<i64>>(
    values: &[T],
    shape: &WireShape,
) -> Result<RouteTable, RouteError> {
    let row = shape.row_len("array")?;
    if !values.len().is_multiple_of(row) {
        return Err(RouteError::Ragged {
            what: "array values in rows of num_layers x top_k",
            len: values.len(),
            unit: row,
        });
    }
    table_from_wire(shape, values.len() / row, |i| values[i].into())
}

/// A table as SGLang / vLLM would send it, as values `[rows, num_layers, top_k]`: dense
/// columns 0, missing MoE cells -1.
pub fn to_wire_values(table: &RouteTable, layout: &LayerLayout) -> Result<Vec<i64>, RouteError> {
    wire_values(
        table,
        layout.num_hidden_layers(),
        Some(layout),
        WireDtype::I32,
        "array",
    )
}

/// Why a top-1 payload is not decoded without a layout (see the module doc).
const TOP1_NEEDS_LAYOUT: &str = "top_k = 1 routes need the layer layout: the wire writes 0 \
     for dense layers and for rows never captured, which a top-1 cell cannot tell from expert 0 \
     (give the layout, e.g. --moe-layers or --first-k-dense, or every layer when all are MoE)";

/// Builds a table from an all-layers flat accessor over `[rows, num_layers, top_k]`
/// (the caller has checked the length). With a layout, dense columns must hold only 0 or -1
/// and the result is MoE-only; without one, top-1 is refused (see the module doc).
pub(crate) fn table_from_wire(
    shape: &WireShape,
    rows: usize,
    get: impl Fn(usize) -> i64,
) -> Result<RouteTable, RouteError> {
    shape.row_len("wire")?;
    DecodeLimits::id_count(rows, shape.num_layers, shape.top_k)?;
    let (l, k) = (shape.num_layers, shape.top_k);
    let Some(layout) = &shape.layout else {
        if k == 1 {
            return Err(RouteError::Layout(TOP1_NEEDS_LAYOUT.to_string()));
        }
        return RouteTable::from_fn(
            shape.num_experts,
            k,
            LayerSpace::AllLayers,
            (0..l).collect(),
            shape.start_len,
            rows,
            get,
        );
    };
    let dense: Vec<usize> = (0..l).filter(|&x| !layout.is_moe(x)).collect();
    for r in 0..rows {
        for &layer in &dense {
            for j in 0..k {
                let v = get((r * l + layer) * k + j);
                if v != 0 && v != -1 {
                    return Err(RouteError::DenseColumnNotEmpty {
                        token: shape.start_len.saturating_add(r),
                        layer,
                        value: v,
                    });
                }
            }
        }
    }
    let moe = layout.moe_layers().to_vec();
    let m = moe.len().max(1);
    let moe_for_get = moe.clone();
    RouteTable::from_cells(
        shape.num_experts,
        k,
        LayerSpace::MoeOnly,
        moe,
        shape.start_len,
        rows,
        move |cell, buf| {
            let base = ((cell / m) * l + moe_for_get[cell % m]) * k;
            for (j, b) in buf.iter_mut().enumerate() {
                *b = get(base + j);
            }
        },
    )
}

/// Flattens a table to all-layers wire values `[rows, num_layers, top_k]`. Missing cells of
/// dense layers (per `layout`, or MoE-only tables' absent layers) become 0 (SGLang's dense
/// padding); missing cells of MoE layers become -1, an error for unsigned dtypes.
pub(crate) fn wire_values(
    table: &RouteTable,
    num_layers: usize,
    layout: Option<&LayerLayout>,
    dtype: WireDtype,
    format: &'static str,
) -> Result<Vec<i64>, RouteError> {
    let all = match (table.space(), layout) {
        (LayerSpace::AllLayers, _) => {
            if table.num_columns() != num_layers {
                return Err(RouteError::length(
                    "columns of an all-layers table (num_layers)",
                    num_layers,
                    table.num_columns(),
                ));
            }
            table.clone()
        }
        (LayerSpace::MoeOnly, Some(layout)) => table.to_all_layers(layout)?,
        (LayerSpace::MoeOnly, None) => {
            return Err(RouteError::format(
                format,
                "a MoE-only table needs the layer layout to be written in all-layers wire form",
            ))
        }
    };
    if let Some(layout) = layout {
        if layout.num_hidden_layers() != num_layers {
            return Err(RouteError::LayerCount {
                layout: layout.num_hidden_layers(),
                wire: num_layers,
            });
        }
    }
    if table.num_experts() as i64 - 1 > dtype.max_id() {
        return Err(RouteError::format(
            format,
            format!(
                "{} experts do not fit in {} (max id {})",
                table.num_experts(),
                dtype.name(),
                dtype.max_id()
            ),
        ));
    }
    let k = all.top_k();
    let mut out = Vec::with_capacity(all.num_tokens() * num_layers * k);
    for t in 0..all.num_tokens() {
        for c in 0..num_layers {
            if all.is_present(t, c) {
                out.extend((0..k).map(|j| i64::from(all.expert_at(t, c, j).unwrap_or(0))));
                continue;
            }
            let dense = layout.is_some_and(|lay| !lay.is_moe(c));
            if dense {
                out.extend(std::iter::repeat_n(0, k));
            } else if dtype.is_signed() {
                out.extend(std::iter::repeat_n(-1, k));
            } else {
                return Err(RouteError::format(
                    format,
                    format!(
                        "token {}, layer {c} has no route and {} cannot carry -1",
                        all.start_pos() + t,
                        dtype.name()
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// Writes wire values little-endian.
pub(crate) fn encode_le(values: &[i64], dtype: WireDtype) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &v in values {
        dtype.write(&mut out, v);
    }
    out
}
