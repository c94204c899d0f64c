//! vLLM ≥ 0.22 `routed_experts`: base64 of `.npy` file bytes (NPY v1/v2/v3; `|u1`, `<u2`,
//! `<i2`, `<i4`) of shape `(tokens - 1 [- prompt_start], num_hidden_layers, top_k)`.

use serde_json::Value;

use super::npy::{parse_npy, write_npy};
use super::{
    decode_base64, decode_le, encode_base64, encode_le, wire_values, WireDtype, WireShape,
};
use crate::{LayerLayout, RouteError, RouteTable};

const F: &str = "vllm";

/// Decodes raw `.npy` bytes.
pub fn decode_npy_routes(bytes: &[u8], shape: &WireShape) -> Result<RouteTable, RouteError> {
    let arr = parse_npy(bytes)?;
    let [_, layers, k] = arr.shape[..] else {
        return Err(RouteError::format(
            F,
            format!(
                "npy shape {:?} is not 3-D (tokens, layers, top_k)",
                arr.shape
            ),
        ));
    };
    if layers != shape.num_layers || k != shape.top_k {
        return Err(RouteError::format(
            F,
            format!(
                "npy shape {:?} does not match num_layers {} x top_k {}",
                arr.shape, shape.num_layers, shape.top_k
            ),
        ));
    }
    decode_le(arr.data, arr.dtype, shape, F)
}

/// Decodes the base64 string of `routed_experts`.
pub fn decode_vllm(b64: &str, shape: &WireShape) -> Result<RouteTable, RouteError> {
    decode_npy_routes(&decode_base64(b64, F)?, shape)
}

/// Decodes a vLLM response fragment: the bare base64 string, a JSON string, or an object
/// with `routed_experts` at top level or in its one choice (`choices` / `outputs`). A
/// response of several choices (`n > 1`) is refused: each choice carries its own routes, so
/// one must be named ([`decode_vllm_choice`]).
pub fn decode_vllm_payload(text: &str, shape: &WireShape) -> Result<RouteTable, RouteError> {
    decode_payload(text, None, shape)
}

/// Decodes the routes of choice `choice` of a vLLM response (`choices[choice]` /
/// `outputs[choice]`); a bare string or a top-level `routed_experts` is choice 0.
pub fn decode_vllm_choice(
    text: &str,
    choice: usize,
    shape: &WireShape,
) -> Result<RouteTable, RouteError> {
    decode_payload(text, Some(choice), shape)
}

/// [`decode_vllm_payload`] (`choice` None: one choice at most) or [`decode_vllm_choice`].
fn decode_payload(
    text: &str,
    choice: Option<usize>,
    shape: &WireShape,
) -> Result<RouteTable, RouteError> {
    let missing_choice =
        |c: usize, holds: String| RouteError::format(F, format!("choice {c} asked for; {holds}"));
    let only_one = |found: &str| match choice {
        None | Some(0) => Ok(()),
        Some(c) => Err(missing_choice(c, format!("{found} is one choice"))),
    };
    let trimmed = text.trim();
    if !trimmed.starts_with('{') && !trimmed.starts_with('"') {
        only_one("a bare base64 payload")?;
        return decode_vllm(trimmed, shape);
    }
    let v: Value = serde_json::from_str(trimmed)
        .map_err(|e| RouteError::format(F, format!("not valid JSON: {e}")))?;
    if let Some(field) = v
        .as_str()
        .or_else(|| v.get("routed_experts").and_then(Value::as_str))
    {
        only_one("a top-level `routed_experts`")?;
        return decode_vllm(field, shape);
    }
    let Some((key, choices)) = ["choices", "outputs"]
        .iter()
        .find_map(|key| v.get(key).and_then(Value::as_array).map(|c| (*key, c)))
    else {
        return Err(RouteError::format(
            F,
            "no base64 `routed_experts` string found",
        ));
    };
    let index = match choice {
        Some(c) => c,
        None if choices.len() == 1 => 0,
        None if choices.is_empty() => {
            return Err(RouteError::format(
                F,
                format!("no base64 `routed_experts` string found (`{key}` is empty)"),
            ))
        }
        None => {
            return Err(RouteError::format(
                F,
                format!(
                    "`{key}` holds {} choices, each with its own routes: name the choice \
                     (a response of n > 1 is not one sequence)",
                    choices.len()
                ),
            ))
        }
    };
    let one = choices
        .get(index)
        .ok_or_else(|| missing_choice(index, format!("`{key}` holds {}", choices.len())))?;
    let field = one
        .get("routed_experts")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            RouteError::format(
                F,
                format!("no base64 `routed_experts` string in `{key}[{index}]`"),
            )
        })?;
    decode_vllm(field, shape)
}

/// Encodes a table as base64 `.npy` (all layers; dense columns zero) with the given dtype and
/// NPY version.
pub fn encode_vllm(
    table: &RouteTable,
    dtype: WireDtype,
    npy_version: u8,
    num_layers: usize,
    layout: Option<&LayerLayout>,
) -> Result<String, RouteError> {
    Ok(encode_base64(&encode_npy_routes(
        table,
        dtype,
        npy_version,
        num_layers,
        layout,
    )?))
}

/// Encodes a table as raw `.npy` bytes.
pub fn encode_npy_routes(
    table: &RouteTable,
    dtype: WireDtype,
    npy_version: u8,
    num_layers: usize,
    layout: Option<&LayerLayout>,
) -> Result<Vec<u8>, RouteError> {
    let values = wire_values(table, num_layers, layout, dtype, F)?;
    write_npy(
        dtype,
        &[table.num_tokens(), num_layers, table.top_k()],
        &encode_le(&values, dtype),
        npy_version,
    )
}
