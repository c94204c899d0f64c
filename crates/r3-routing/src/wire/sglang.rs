//! SGLang `routed_experts`: `meta_info.routed_experts` is standard base64 of a flat
//! little-endian array of dtype `meta_info.routed_experts_dtype` (`int32`, `uint16`, `uint8`;
//! `int32` when absent), logical shape
//! `[prompt_tokens + completion_tokens - 1 - start_len, num_hidden_layers, top_k]`,
//! dense layers as zero columns.

use serde_json::{json, Value};

use super::{
    decode_base64, decode_le, encode_base64, encode_le, wire_values, WireDtype, WireShape,
};
use crate::{LayerLayout, RouteError, RouteTable};

const F: &str = "sglang";

/// Dtypes SGLang sends.
pub const SGLANG_DTYPES: [WireDtype; 3] = [WireDtype::I32, WireDtype::U16, WireDtype::U8];

fn check_dtype(dtype: WireDtype) -> Result<(), RouteError> {
    if SGLANG_DTYPES.contains(&dtype) {
        Ok(())
    } else {
        Err(RouteError::format(
            F,
            format!(
                "dtype {} is not one SGLang sends (int32, uint16, uint8)",
                dtype.name()
            ),
        ))
    }
}

/// Decodes the bare base64 string of `meta_info.routed_experts`.
pub fn decode_sglang(
    b64: &str,
    dtype: WireDtype,
    shape: &WireShape,
) -> Result<RouteTable, RouteError> {
    check_dtype(dtype)?;
    let bytes = decode_base64(b64, F)?;
    decode_le(&bytes, dtype, shape, F)
}

/// Decodes an SGLang response object (`{"meta_info": {"routed_experts": ..,
/// "routed_experts_dtype": .., "prompt_tokens": .., "completion_tokens": ..}}`, or the
/// `meta_info` object itself). When the token counts are present, the row count must be
/// `prompt_tokens + completion_tokens - 1 - start_len`.
pub fn decode_sglang_response(v: &Value, shape: &WireShape) -> Result<RouteTable, RouteError> {
    let meta = v.get("meta_info").unwrap_or(v);
    let payload = meta
        .get("routed_experts")
        .ok_or_else(|| RouteError::format(F, "no `meta_info.routed_experts` field"))?;
    let b64 = payload.as_str().ok_or_else(|| {
        RouteError::format(
            F,
            "`routed_experts` must be a base64 string (null means capture was off)",
        )
    })?;
    let dtype = match meta.get("routed_experts_dtype") {
        None | Some(Value::Null) => WireDtype::I32,
        Some(Value::String(s)) => WireDtype::parse(s)
            .ok_or_else(|| RouteError::format(F, format!("unknown routed_experts_dtype {s:?}")))?,
        Some(other) => {
            return Err(RouteError::format(
                F,
                format!("routed_experts_dtype {other} is not a string"),
            ))
        }
    };
    let table = decode_sglang(b64, dtype, shape)?;
    let count = |name: &str| meta.get(name).and_then(Value::as_u64);
    if let (Some(p), Some(c)) = (count("prompt_tokens"), count("completion_tokens")) {
        let total = p.saturating_add(c);
        let expected = crate::align::expected_rows(total as usize, shape.start_len)?;
        if table.num_tokens() != expected {
            return Err(RouteError::length(
                format!(
                    "rows (prompt_tokens {p} + completion_tokens {c} - 1 - start_len {})",
                    shape.start_len
                ),
                expected,
                table.num_tokens(),
            ));
        }
    }
    Ok(table)
}

/// Encodes a table as SGLang's base64 string (all layers; dense columns zero).
pub fn encode_sglang(
    table: &RouteTable,
    dtype: WireDtype,
    num_layers: usize,
    layout: Option<&LayerLayout>,
) -> Result<String, RouteError> {
    check_dtype(dtype)?;
    let values = wire_values(table, num_layers, layout, dtype, F)?;
    Ok(encode_base64(&encode_le(&values, dtype)))
}

/// Encodes a table as an SGLang `meta_info` object with the dtype and token counts
/// (`prompt_tokens` is taken to be `start_len + prompt_rows`, completion the rest plus one).
pub fn encode_sglang_meta(
    table: &RouteTable,
    dtype: WireDtype,
    num_layers: usize,
    layout: Option<&LayerLayout>,
    prompt_tokens: usize,
) -> Result<Value, RouteError> {
    let b64 = encode_sglang(table, dtype, num_layers, layout)?;
    let total = table.end_pos() + 1;
    let completion = total
        .checked_sub(prompt_tokens)
        .ok_or(RouteError::OutOfRange {
            what: "prompt_tokens",
            index: prompt_tokens,
            len: total,
        })?;
    Ok(json!({"meta_info": {
        "routed_experts": b64,
        "routed_experts_dtype": dtype.name(),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
    }}))
}
