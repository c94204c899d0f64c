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

use serde::Deserialize;
use serde_json::{json, Number, Value};

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
        let raw: RawCanonical = serde_path_to_error::deserialize(v).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path == "." {
                RouteError::format(F, inner.to_string())
            } else {
                RouteError::format(F, format!("`{path}`: {inner}"))
            }
        })?;
        raw.validate()
    }
}

/// A canonical document as written: the field types are checked by serde, everything that
/// relates fields to each other (or to the id range) by [`RawCanonical::validate`].
#[derive(Debug, Deserialize)]
#[serde(expecting = "a canonical route document (a JSON object)")]
struct RawCanonical {
    format: String,
    version: u64,
    num_experts: usize,
    top_k: usize,
    layer_space: String,
    layers: Vec<usize>,
    start_pos: usize,
    num_tokens: usize,
    /// `routes[t][c]`: the ids of one cell, or null. Ids stay JSON numbers here so that a
    /// non-integer id is reported with its token and layer.
    routes: Vec<Vec<Option<Vec<Number>>>>,
    #[serde(default)]
    versions: Option<Vec<u64>>,
}

impl RawCanonical {
    /// Checks the header, then every row against it, and builds the table.
    fn validate(self) -> Result<RouteTable, RouteError> {
        if self.format != CANONICAL_FORMAT {
            return Err(RouteError::format(
                F,
                format!(
                    "`format` is {:?}, expected {CANONICAL_FORMAT:?}",
                    self.format
                ),
            ));
        }
        if self.version != CANONICAL_VERSION {
            return Err(RouteError::format(
                F,
                format!(
                    "unsupported version {} (this r3 reads {CANONICAL_VERSION})",
                    self.version
                ),
            ));
        }
        let space = LayerSpace::parse(&self.layer_space).ok_or_else(|| {
            RouteError::format(
                F,
                format!(
                    "`layer_space` is {:?}, expected \"all_layers\" or \"moe_only\"",
                    self.layer_space
                ),
            )
        })?;
        check_header(self.num_experts, self.top_k, space, &self.layers)?;
        if self.routes.len() != self.num_tokens {
            return Err(RouteError::length(
                "rows in `routes` (num_tokens)",
                self.num_tokens,
                self.routes.len(),
            ));
        }
        let mut table = RouteTable::missing(
            self.num_experts,
            self.top_k,
            space,
            self.layers.clone(),
            self.start_pos,
            self.num_tokens,
        )?;
        for (t, row) in self.routes.iter().enumerate() {
            fill_row(&mut table, t, row)?;
        }
        if let Some(vs) = self.versions {
            table.set_versions(vs)?;
        }
        Ok(table)
    }
}

/// Validates row `t` of `routes` and writes its present cells into `table`.
fn fill_row(
    table: &mut RouteTable,
    t: usize,
    row: &[Option<Vec<Number>>],
) -> Result<(), RouteError> {
    let token = table.start_pos.saturating_add(t);
    let (num_experts, top_k) = (table.num_experts, table.top_k);
    if row.len() != table.layers.len() {
        return Err(RouteError::length(
            format!("cells in routes[{t}] (token {token})"),
            table.layers.len(),
            row.len(),
        ));
    }
    let mut vals = vec![0i64; top_k];
    for (c, cell) in row.iter().enumerate() {
        let Some(ids) = cell else { continue };
        let layer = table.layers[c];
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
    Ok(())
}
