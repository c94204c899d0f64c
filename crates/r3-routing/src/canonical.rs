//! r3's canonical route format. JSON (readable, what every r3 command reads and writes):
//!
//! ```json
//! {"format": "r3-routes", "version": 1, "num_experts": 8, "top_k": 2,
//!  "layer_space": "moe_only", "layers": [1, 2], "start_pos": 0, "num_tokens": 2,
//!  "routes": [[[3, 5], [0, 7]], [null, [1, 2]]], "versions": [4, 4]}
//! ```
//! `routes[t][c]` is the top-k of row t (absolute position `start_pos + t`) at column c
//! (global layer `layers[c]`), or `null` when no route was recorded. `versions` (weight
//! version per row) is omitted when unknown. Decoding validates exactly like the wire decoders.

use serde_json::{json, Map, Value};

use crate::build::{check_cell, check_header};
use crate::{LayerSpace, RouteError, RouteTable};

/// Value of the `format` field.
pub const CANONICAL_FORMAT: &str = "r3-routes";
/// Value of the `version` field.
pub const CANONICAL_VERSION: u64 = 1;

const F: &str = "r3";

impl RouteTable {
    /// Canonical JSON value (see module doc).
    pub fn to_json(&self) -> Value {
        let cols = self.num_columns();
        let routes: Vec<Value> = (0..self.num_tokens)
            .map(|t| {
                Value::Array(
                    (0..cols)
                        .map(|c| match self.experts(t, c) {
                            Some(ids) => Value::Array(ids.into_iter().map(Value::from).collect()),
                            None => Value::Null,
                        })
                        .collect(),
                )
            })
            .collect();
        let mut v = json!({
            "format": CANONICAL_FORMAT,
            "version": CANONICAL_VERSION,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "layer_space": self.space.as_str(),
            "layers": self.layers,
            "start_pos": self.start_pos,
            "num_tokens": self.num_tokens,
            "routes": routes,
        });
        if let (Some(vs), Some(obj)) = (&self.versions, v.as_object_mut()) {
            obj.insert("versions".to_string(), json!(vs));
        }
        v
    }

    /// Canonical JSON text (compact, one line).
    pub fn to_json_string(&self) -> String {
        self.to_json().to_string()
    }

    /// Parses and validates canonical JSON text.
    pub fn from_json_str(s: &str) -> Result<RouteTable, RouteError> {
        let v: Value = serde_json::from_str(s)
            .map_err(|e| RouteError::format(F, format!("not valid JSON: {e}")))?;
        RouteTable::from_json(&v)
    }

    /// Parses and validates a canonical JSON value.
    pub fn from_json(v: &Value) -> Result<RouteTable, RouteError> {
        let obj = v
            .as_object()
            .ok_or_else(|| RouteError::format(F, "expected a JSON object"))?;
        let format = field(obj, "format")?
            .as_str()
            .ok_or_else(|| RouteError::format(F, "`format` must be a string"))?;
        if format != CANONICAL_FORMAT {
            return Err(RouteError::format(
                F,
                format!("`format` is {format:?}, expected {CANONICAL_FORMAT:?}"),
            ));
        }
        let version = uint(obj, "version")?;
        if version != CANONICAL_VERSION as usize {
            return Err(RouteError::format(
                F,
                format!("unsupported version {version} (this r3 reads {CANONICAL_VERSION})"),
            ));
        }
        let num_experts = uint(obj, "num_experts")?;
        let top_k = uint(obj, "top_k")?;
        let space_name = field(obj, "layer_space")?
            .as_str()
            .ok_or_else(|| RouteError::format(F, "`layer_space` must be a string"))?;
        let space = LayerSpace::parse(space_name).ok_or_else(|| {
            RouteError::format(
                F,
                format!("`layer_space` is {space_name:?}, expected \"all_layers\" or \"moe_only\""),
            )
        })?;
        let layers = uint_array(field(obj, "layers")?, "layers")?;
        let start_pos = uint(obj, "start_pos")?;
        let num_tokens = uint(obj, "num_tokens")?;
        check_header(num_experts, top_k, space, &layers)?;
        let rows = field(obj, "routes")?
            .as_array()
            .ok_or_else(|| RouteError::format(F, "`routes` must be an array of rows"))?;
        if rows.len() != num_tokens {
            return Err(RouteError::length(
                "rows in `routes` (num_tokens)",
                num_tokens,
                rows.len(),
            ));
        }
        let mut table = RouteTable::missing(
            num_experts,
            top_k,
            space,
            layers.clone(),
            start_pos,
            num_tokens,
        )?;
        let mut vals = vec![0i64; top_k];
        for (t, row) in rows.iter().enumerate() {
            let token = start_pos.saturating_add(t);
            let cells = row.as_array().ok_or_else(|| {
                RouteError::format(F, format!("routes[{t}] (token {token}) must be an array"))
            })?;
            if cells.len() != layers.len() {
                return Err(RouteError::length(
                    format!("cells in routes[{t}] (token {token})"),
                    layers.len(),
                    cells.len(),
                ));
            }
            for (c, cell) in cells.iter().enumerate() {
                let layer = layers[c];
                if cell.is_null() {
                    continue;
                }
                let ids = cell.as_array().ok_or_else(|| {
                    RouteError::format(
                        F,
                        format!("token {token}, layer {layer}: cell must be an array or null"),
                    )
                })?;
                if ids.len() != top_k {
                    return Err(RouteError::length(
                        format!("ids at token {token}, layer {layer}"),
                        top_k,
                        ids.len(),
                    ));
                }
                for (slot, id) in vals.iter_mut().zip(ids) {
                    *slot = id.as_i64().ok_or_else(|| {
                        RouteError::format(
                            F,
                            format!("token {token}, layer {layer}: id {id} is not an integer"),
                        )
                    })?;
                }
                if check_cell(&vals, num_experts, token, layer)? {
                    let u: Vec<u32> = vals.iter().map(|&x| x as u32).collect();
                    table.set_cell(t, c, &u)?;
                }
            }
        }
        if let Some(vs) = obj.get("versions") {
            if !vs.is_null() {
                let vs = vs
                    .as_array()
                    .ok_or_else(|| RouteError::format(F, "`versions` must be an array"))?
                    .iter()
                    .map(|x| {
                        x.as_u64().ok_or_else(|| {
                            RouteError::format(
                                F,
                                format!("version {x} is not a non-negative integer"),
                            )
                        })
                    })
                    .collect::<Result<Vec<u64>, _>>()?;
                table.set_versions(vs)?;
            }
        }
        Ok(table)
    }
}

fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Result<&'a Value, RouteError> {
    obj.get(name)
        .ok_or_else(|| RouteError::format(F, format!("missing field `{name}`")))
}

fn uint(obj: &Map<String, Value>, name: &str) -> Result<usize, RouteError> {
    let v = field(obj, name)?;
    v.as_u64()
        .and_then(|x| usize::try_from(x).ok())
        .ok_or_else(|| {
            RouteError::format(
                F,
                format!("`{name}` must be a non-negative integer, got {v}"),
            )
        })
}

fn uint_array(v: &Value, name: &str) -> Result<Vec<usize>, RouteError> {
    v.as_array()
        .ok_or_else(|| RouteError::format(F, format!("`{name}` must be an array")))?
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|u| usize::try_from(u).ok())
                .ok_or_else(|| {
                    RouteError::format(
                        F,
                        format!("`{name}` entry {x} is not a non-negative integer"),
                    )
                })
        })
        .collect()
}
