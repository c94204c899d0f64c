//! vLLM 0.21 routed experts as nested JSON int arrays: `prompt_routed_experts`
//! `[prompt_rows][num_layers][top_k]` plus per-choice `routed_experts` for the generated rows,
//! `-1` (or an empty / null cell) where nothing was captured. A choice's table is the prompt
//! rows followed by its own rows, row 0 at position `start_len`; a choice must carry its
//! `routed_experts` (an empty list when it has no rows): one without them, or with `null`, is
//! an error, never a table of the prompt rows alone.

use serde_json::{json, Value};

use super::{table_from_wire, wire_values, WireDtype, WireShape};
use crate::{DecodeLimits, LayerLayout, RouteError, RouteTable};

const F: &str = "vllm-json";

/// Decodes a vLLM 0.21 response object into one table per choice (`choices` or `outputs`,
/// or a top-level `routed_experts` for a single choice; prompt rows only if there is no
/// choice at all). A choice without `routed_experts` (or with `null`) is an error.
pub fn decode_vllm_json(v: &Value, shape: &WireShape) -> Result<Vec<RouteTable>, RouteError> {
    shape.row_len(F)?;
    let obj = v
        .as_object()
        .ok_or_else(|| RouteError::format(F, "expected a JSON object"))?;
    let mut prompt = Vec::new();
    let prompt_rows = match obj.get("prompt_routed_experts") {
        None | Some(Value::Null) => 0,
        Some(rows) => push_rows(rows, shape, 0, "prompt_routed_experts", &mut prompt)?,
    };
    let choices: Vec<(String, Option<&Value>)> = match (
        obj.get("choices").or_else(|| obj.get("outputs")),
        obj.get("routed_experts"),
    ) {
        (Some(Value::Array(cs)), _) => cs
            .iter()
            .enumerate()
            .map(|(i, c)| {
                (
                    format!("choices[{i}].routed_experts"),
                    c.get("routed_experts"),
                )
            })
            .collect(),
        (Some(_), _) => return Err(RouteError::format(F, "`choices` must be an array")),
        (None, Some(r)) => vec![("routed_experts".to_string(), Some(r))],
        (None, None) => Vec::new(),
    };
    if choices.is_empty() {
        if prompt_rows == 0 && !obj.contains_key("prompt_routed_experts") {
            return Err(RouteError::format(
                F,
                "no `prompt_routed_experts` and no `routed_experts`",
            ));
        }
        return Ok(vec![table_from_wire(shape, prompt_rows, |i| prompt[i])?]);
    }
    let mut out = Vec::with_capacity(choices.len());
    for (what, rows) in choices {
        let rows = match rows {
            None | Some(Value::Null) => {
                return Err(RouteError::format(
                    F,
                    format!(
                        "`{what}` is missing or null: the choice's routes were not captured \
                         (an empty list means a choice without rows)"
                    ),
                ))
            }
            Some(rows) => rows,
        };
        let mut flat = prompt.clone();
        let n = push_rows(rows, shape, prompt_rows, &what, &mut flat)?;
        out.push(table_from_wire(shape, prompt_rows + n, |i| flat[i])?);
    }
    Ok(out)
}

/// Appends `[rows][num_layers][top_k]` to `flat` (-1 for missing cells); returns the row count.
fn push_rows(
    rows: &Value,
    shape: &WireShape,
    first_row: usize,
    what: &str,
    flat: &mut Vec<i64>,
) -> Result<usize, RouteError> {
    let rows = rows
        .as_array()
        .ok_or_else(|| RouteError::format(F, format!("`{what}` must be an array of rows")))?;
    let (l, k) = (shape.num_layers, shape.top_k);
    DecodeLimits::check_tokens("rows", first_row.saturating_add(rows.len()))?;
    // The whole table's size is checked, but memory grows row by row as rows prove to be
    // whole: a long list of empty rows must not reserve the ids they claim.
    DecodeLimits::id_count(first_row.saturating_add(rows.len()), l, k)?;
    for (r, row) in rows.iter().enumerate() {
        let token = shape.start_len.saturating_add(first_row + r);
        let cells = row.as_array().ok_or_else(|| {
            RouteError::format(F, format!("{what}[{r}] (token {token}) must be an array"))
        })?;
        if cells.len() != l {
            return Err(RouteError::length(
                format!("layers in {what}[{r}] (token {token})"),
                l,
                cells.len(),
            ));
        }
        flat.reserve(l * k);
        for (layer, cell) in cells.iter().enumerate() {
            let ids: &[Value] = match cell {
                Value::Null => &[],
                Value::Array(a) => a,
                other => {
                    return Err(RouteError::format(
                        F,
                        format!("token {token}, layer {layer}: cell {other} is not an array"),
                    ))
                }
            };
            if ids.is_empty() {
                flat.extend(std::iter::repeat_n(-1, k));
                continue;
            }
            if ids.len() != k {
                return Err(RouteError::length(
                    format!("ids at token {token}, layer {layer}"),
                    k,
                    ids.len(),
                ));
            }
            for id in ids {
                let v = id.as_i64().ok_or_else(|| {
                    RouteError::format(
                        F,
                        format!("token {token}, layer {layer}: {id} is not an integer"),
                    )
                })?;
                flat.push(v);
            }
        }
    }
    Ok(rows.len())
}

/// Encodes a table as a vLLM 0.21 object: the first `prompt_rows` rows as
/// `prompt_routed_experts`, the rest as `choices[0].routed_experts`; -1 where missing.
pub fn encode_vllm_json(
    table: &RouteTable,
    prompt_rows: usize,
    num_layers: usize,
    layout: Option<&LayerLayout>,
) -> Result<Value, RouteError> {
    if prompt_rows > table.num_tokens() {
        return Err(RouteError::OutOfRange {
            what: "prompt_rows",
            index: prompt_rows,
            len: table.num_tokens(),
        });
    }
    let values = wire_values(table, num_layers, layout, WireDtype::I32, F)?;
    let k = table.top_k();
    let row_vals = num_layers * k;
    let rows: Vec<Value> = (0..table.num_tokens())
        .map(|t| {
            Value::Array(
                (0..num_layers)
                    .map(|l| {
                        let base = t * row_vals + l * k;
                        json!(values[base..base + k])
                    })
                    .collect(),
            )
        })
        .collect();
    let (prompt, gen) = rows.split_at(prompt_rows);
    Ok(json!({
        "prompt_routed_experts": prompt,
        "choices": [{"routed_experts": gen}],
    }))
}
