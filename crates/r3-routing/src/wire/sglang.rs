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
/// `prompt_tokens + completion_tokens - 1 - start_len`; both or neither must be present, as
/// non-negative integers; `start_len == prompt_tokens + completion_tokens` (nothing
/// generated past a capture start at the prompt's end) is 0 rows.
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
    let prompt = token_count(meta, "prompt_tokens")?;
    let completion = token_count(meta, "completion_tokens")?;
    let (p, c) = match (prompt, completion) {
        (None, None) => return Ok(table),
        (Some(p), Some(c)) => (p, c),
        (Some(_), None) => return Err(one_count_missing("completion_tokens")),
        (None, Some(_)) => return Err(one_count_missing("prompt_tokens")),
    };
    let total = usize::try_from(p.saturating_add(c)).unwrap_or(usize::MAX);
    // SGLang clamps the capture start to the sequence (`min(start_len, seqlen - 1)`, rows
    // `max(0, seqlen - 1 - start_len)`) and lets `start_len` reach the whole prompt: a reply
    // of no new token from start_len = prompt_tokens is 0 rows, as the bare string decodes.
    let expected = if shape.start_len == total {
        0
    } else {
        crate::align::expected_rows(total, shape.start_len)?
    };
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
    Ok(table)
}

/// `meta_info.<name>` as a count: `None` when absent or null, an error naming the field
/// when it is anything but a non-negative integer.
fn token_count(meta: &Value, name: &str) -> Result<Option<u64>, RouteError> {
    match meta.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            RouteError::format(
                F,
                format!("`{name}` is {v}, not a non-negative integer token count"),
            )
        }),
    }
}

/// The error for a reply that gives one token count without the other.
fn one_count_missing(missing: &str) -> RouteError {
    RouteError::format(
        F,
        format!("`{missing}` is missing while the other token count is given: the row count cannot be checked"),
    )
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
