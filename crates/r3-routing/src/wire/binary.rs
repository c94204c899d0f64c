//! r3's compact binary route form (`r3-bin`), for storage and transport where JSON is too big:
//!
//! | bytes | field |
//! |---|---|
//! | 4 | magic `R3RT` |
//! | 1 | format version (1) |
//! | 1 | id width in bytes: 1 (≤ 256 experts) or 2 |
//! | 1 | layer space: 0 = all_layers, 1 = moe_only |
//! | 1 | flags: bit 0 = per-row weight versions follow |
//! | 4+4+4 | num_experts, top_k, num_columns (u32 LE) |
//! | 8+8 | start_pos, num_tokens (u64 LE) |
//! | 4 × columns | global layer of each column (u32 LE) |
//! | ⌈tokens·columns / 8⌉ | presence bitmap, cell `t·columns + c`, LSB first |
//! | width × tokens·columns·top_k | ids, token-major, little-endian; missing cells hold 0 |
//! | 8 × tokens | weight versions (u64 LE), only if flag bit 0 |
//!
//! Decoding checks the declared sizes against [`DecodeLimits`] and the total length against
//! the bytes present before allocating anything, then validates every cell.

use crate::build::check_counts;
use crate::{DecodeLimits, LayerSpace, RouteError, RouteTable};

const F: &str = "r3-bin";
const MAGIC: &[u8; 4] = b"R3RT";
const VERSION: u8 = 1;
const FIXED: usize = 4 + 4 + 12 + 16;

/// Encodes a table in the compact binary form.
pub fn encode_binary(table: &RouteTable) -> Vec<u8> {
    let width = if table.num_experts() <= 256 { 1 } else { 2 };
    let (t, c, k) = (table.num_tokens(), table.num_columns(), table.top_k());
    let cells = t * c;
    let mut out = Vec::with_capacity(FIXED + 4 * c + cells.div_ceil(8) + width * cells * k + 8 * t);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.push(width as u8);
    out.push(match table.space() {
        LayerSpace::AllLayers => 0,
        LayerSpace::MoeOnly => 1,
    });
    out.push(u8::from(table.versions().is_some()));
    out.extend_from_slice(&(table.num_experts() as u32).to_le_bytes());
    out.extend_from_slice(&(k as u32).to_le_bytes());
    out.extend_from_slice(&(c as u32).to_le_bytes());
    out.extend_from_slice(&(table.start_pos() as u64).to_le_bytes());
    out.extend_from_slice(&(t as u64).to_le_bytes());
    for &l in table.layers() {
        out.extend_from_slice(&(l as u32).to_le_bytes());
    }
    let mut bitmap = vec![0u8; cells.div_ceil(8)];
    for (i, &p) in table.present.iter().enumerate() {
        if p {
            bitmap[i / 8] |= 1 << (i % 8);
        }
    }
    out.extend_from_slice(&bitmap);
    match &table.ids {
        crate::table::IdStore::U8(v) => out.extend_from_slice(v),
        crate::table::IdStore::U16(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
    }
    if let Some(vs) = table.versions() {
        for v in vs {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Decodes and validates the compact binary form.
pub fn decode_binary(bytes: &[u8]) -> Result<RouteTable, RouteError> {
    if bytes.len() < FIXED || &bytes[..4] != MAGIC {
        return Err(RouteError::format(
            F,
            "not an r3 binary route table (bad magic or too short)",
        ));
    }
    if bytes[4] != VERSION {
        return Err(RouteError::format(
            F,
            format!("format version {} not supported", bytes[4]),
        ));
    }
    let width = usize::from(bytes[5]);
    let space = match bytes[6] {
        0 => LayerSpace::AllLayers,
        1 => LayerSpace::MoeOnly,
        s => {
            return Err(RouteError::format(
                F,
                format!("layer space byte {s} is not 0 or 1"),
            ))
        }
    };
    let has_versions = match bytes[7] {
        0 => false,
        1 => true,
        f => {
            return Err(RouteError::format(
                F,
                format!("flags byte {f} has unknown bits"),
            ))
        }
    };
    let (num_experts, top_k, cols) = (u32_at(bytes, 8), u32_at(bytes, 12), u32_at(bytes, 16));
    let start_pos = usize::try_from(u64_at(bytes, 20))
        .map_err(|_| RouteError::format(F, "start_pos does not fit in usize"))?;
    let tokens = usize::try_from(u64_at(bytes, 28))
        .map_err(|_| RouteError::format(F, "num_tokens does not fit in usize"))?;
    let expected_width = if num_experts <= 256 { 1 } else { 2 };
    if width != expected_width {
        return Err(RouteError::format(
            F,
            format!("id width {width} for {num_experts} experts, expected {expected_width}"),
        ));
    }
    // Everything that does not need the layer list is checked before any allocation.
    if cols == 0 {
        return Err(RouteError::Layout(
            "a route table needs at least one column (layer)".into(),
        ));
    }
    check_counts(num_experts, top_k)?;
    DecodeLimits::check_layers("num_columns", cols)?;
    DecodeLimits::check_tokens("num_tokens", tokens)?;
    let overflow = || RouteError::format(F, "declared sizes overflow");
    let cells = tokens.checked_mul(cols).ok_or_else(overflow)?;
    let id_count = cells.checked_mul(top_k).ok_or_else(overflow)?;
    let layers_at = FIXED;
    let bitmap_at = layers_at
        .checked_add(cols.checked_mul(4).ok_or_else(overflow)?)
        .ok_or_else(overflow)?;
    let ids_at = bitmap_at
        .checked_add(cells.div_ceil(8))
        .ok_or_else(overflow)?;
    let versions_at = ids_at
        .checked_add(id_count.checked_mul(width).ok_or_else(overflow)?)
        .ok_or_else(overflow)?;
    let end = versions_at
        .checked_add(if has_versions {
            tokens.checked_mul(8).ok_or_else(overflow)?
        } else {
            0
        })
        .ok_or_else(overflow)?;
    if bytes.len() != end {
        return Err(RouteError::length(
            "r3-bin payload bytes for the declared shape",
            end,
            bytes.len(),
        ));
    }
    let layers: Vec<usize> = (0..cols)
        .map(|c| u32_at(bytes, layers_at + 4 * c))
        .collect();
    let bitmap = &bytes[bitmap_at..ids_at];
    let ids = &bytes[ids_at..versions_at];
    let mut table = RouteTable::from_cells(
        num_experts,
        top_k,
        space,
        layers,
        start_pos,
        tokens,
        |cell, buf| {
            if bitmap[cell / 8] & (1 << (cell % 8)) == 0 {
                buf.fill(-1);
                return;
            }
            let base = cell * buf.len();
            if width == 1 {
                for (b, &id) in buf.iter_mut().zip(&ids[base..]) {
                    *b = i64::from(id);
                }
            } else {
                for (j, b) in buf.iter_mut().enumerate() {
                    let i = 2 * (base + j);
                    *b = i64::from(u16::from_le_bytes([ids[i], ids[i + 1]]));
                }
            }
        },
    )?;
    if has_versions {
        let vs = (0..tokens)
            .map(|t| u64_at(bytes, versions_at + 8 * t))
            .collect();
        table.set_versions(vs)?;
    }
    Ok(table)
}
