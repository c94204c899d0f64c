//! `r3.RouteTable`: a validated MoE-only route table with its layout; decoded from SGLang's
//! and vLLM's payloads or from numpy arrays by r3-routing's decoders, encoded back by its
//! encoders.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};
use r3_routing::wire::{self, sglang, vllm, vllm_json, WireDtype};
use r3_routing::{LayerSpace, RouteTable};

use crate::args;
use crate::arrays::{to_numpy, visit_ints, IntArrayVisitor};
use crate::layout::PyLayerLayout;
use crate::{arg_err, route_err};

/// Logical expert ids `[rows, moe_layers, top_k]` of one sequence, validated, with which
/// cells are present and the absolute position of row 0.
#[pyclass(name = "RouteTable", module = "r3", frozen)]
#[derive(Debug, Clone)]
pub struct PyRouteTable {
    pub(crate) table: RouteTable,
    pub(crate) layout: PyLayerLayout,
}

fn parse_dtype(name: &str) -> PyResult<WireDtype> {
    WireDtype::parse(name).ok_or_else(|| {
        arg_err(format!(
            "unknown dtype {name:?} (uint8, uint16, int16 or int32)"
        ))
    })
}

/// A Python object as JSON text (`json.dumps`), for the decoders of JSON documents.
fn json_value(obj: &Bound<'_, PyAny>) -> PyResult<serde_json::Value> {
    let text: String = obj
        .py()
        .import("json")?
        .call_method1("dumps", (obj,))?
        .extract()?;
    serde_json::from_str(&text).map_err(|e| arg_err(format!("not JSON-serialisable: {e}")))
}

/// Sets an SGLang response's `routed_experts_dtype` (in `meta_info` when it has one, where
/// the decoder reads it) to the caller's explicit dtype.
fn with_dtype(response: &mut serde_json::Value, dtype: WireDtype) -> PyResult<()> {
    let meta = match response.get("meta_info") {
        Some(serde_json::Value::Object(_)) => &mut response["meta_info"],
        _ => response,
    };
    let obj = meta
        .as_object_mut()
        .ok_or_else(|| arg_err("sglang payload: the response is not a JSON object"))?;
    obj.insert(
        "routed_experts_dtype".to_string(),
        serde_json::Value::String(dtype.name().to_string()),
    );
    Ok(())
}

/// Whether a vLLM response dict carries vLLM 0.21's nested id lists rather than base64.
fn is_nested_json(v: &serde_json::Value) -> bool {
    let routes = v.get("routed_experts").or_else(|| {
        ["choices", "outputs"].iter().find_map(|k| {
            v.get(k)
                .and_then(|c| c.get(0))
                .and_then(|c| c.get("routed_experts"))
        })
    });
    v.get("prompt_routed_experts").is_some() || routes.is_some_and(|r| r.is_array())
}

/// The table of choice `choice` of a response, or of its only choice when `choice` is None
/// (several choices are refused then, as r3-routing's `decode_vllm_payload` refuses them).
fn pick_choice(
    tables: Result<Vec<RouteTable>, r3_routing::RouteError>,
    choice: Option<usize>,
) -> Result<RouteTable, r3_routing::RouteError> {
    let mut tables = tables?;
    match choice {
        None if tables.len() != 1 => Err(r3_routing::RouteError::length(
            "choices in the vLLM response (name one with choice=)",
            1,
            tables.len(),
        )),
        None => Ok(tables.remove(0)),
        Some(c) if c < tables.len() => Ok(tables.swap_remove(c)),
        Some(c) => Err(r3_routing::RouteError::format(
            "vllm-json",
            format!("choice {c} asked for; the response holds {}", tables.len()),
        )),
    }
}

/// A vLLM text payload (base64, or a response's JSON), one choice of it.
fn vllm_text(
    text: &str,
    choice: Option<usize>,
    shape: &r3_routing::WireShape,
) -> Result<RouteTable, r3_routing::RouteError> {
    match choice {
        None => vllm::decode_vllm_payload(text, shape),
        Some(c) => vllm::decode_vllm_choice(text, c, shape),
    }
}

/// Decodes `[rows, columns, top_k]` arrays: all-layers wire arrays through the wire
/// decoder (dense columns checked), MoE-only arrays through `RouteTable::from_flat`.
struct ArrayDecoder<'a> {
    layout: &'a PyLayerLayout,
    start: usize,
    /// Whether a MoE-only array (one column per MoE layer) is accepted.
    moe_only: bool,
    what: &'static str,
}

impl IntArrayVisitor for ArrayDecoder<'_> {
    type Out = RouteTable;

    fn visit<T: Copy + Into<i64>>(self, shape: &[usize], data: &[T]) -> PyResult<RouteTable> {
        let lay = &self.layout.layout;
        let (all, moe, k) = (
            lay.num_hidden_layers(),
            lay.num_moe_layers(),
            self.layout.top_k,
        );
        let [_, cols, top_k] = shape[..] else {
            return Err(arg_err(format!(
                "{}: expected a 3-D array [rows, layers, top_k], got shape {shape:?}",
                self.what
            )));
        };
        if top_k != k {
            return Err(arg_err(format!(
                "{}: last dimension is {top_k}, the layout's top_k is {k}",
                self.what
            )));
        }
        if cols == all {
            wire::decode_values(data, &self.layout.wire_shape(self.start)?).map_err(route_err)
        } else if self.moe_only && cols == moe {
            RouteTable::from_flat_values(
                self.layout.num_experts,
                k,
                LayerSpace::MoeOnly,
                lay.moe_layers().to_vec(),
                self.start,
                data,
            )
            .map_err(route_err)
        } else {
            let expected = if self.moe_only {
                format!("{moe} (MoE layers) or {all} (all layers)")
            } else {
                format!("{all} (num_hidden_layers)")
            };
            Err(arg_err(format!(
                "{}: {cols} layer columns, expected {expected}",
                self.what
            )))
        }
    }
}

impl PyRouteTable {
    fn wrap(table: RouteTable, layout: &PyLayerLayout) -> Self {
        PyRouteTable {
            table,
            layout: layout.clone(),
        }
    }

    /// All-layers wire values `[rows, num_hidden_layers, top_k]`.
    pub(crate) fn wire_values(&self) -> PyResult<Vec<i32>> {
        let values = wire::to_wire_values(&self.table, &self.layout.layout).map_err(route_err)?;
        // Ids are < 2^16 and the sentinels are 0 / -1: every value fits in i32.
        Ok(values.into_iter().map(|v| v as i32).collect())
    }
}

#[pymethods]
impl PyRouteTable {
    /// Decodes SGLang's `meta_info.routed_experts`: the base64 string (str or bytes) with
    /// `dtype` as `routed_experts_dtype` (int32 when not given), or the response / `meta_info`
    /// dict (token counts read from it, and its `routed_experts_dtype` unless `dtype` is
    /// given: an explicit `dtype` wins). Row 0 is position `start_len`.
    #[staticmethod]
    #[pyo3(signature = (payload, *, layout, dtype = None, start_len = 0))]
    fn from_sglang(
        payload: &Bound<'_, PyAny>,
        layout: PyRef<'_, PyLayerLayout>,
        dtype: Option<&str>,
        #[pyo3(from_py_with = args::start_len)] start_len: usize,
    ) -> PyResult<Self> {
        let shape = layout.wire_shape(start_len)?;
        let py = payload.py();
        let dtype = dtype.map(parse_dtype).transpose()?;
        // The decoders run without the GIL on data copied out of Python (or borrowed from
        // immutable str / bytes): other Python threads go on meanwhile.
        let table = if let Ok(s) = payload.downcast::<PyString>() {
            let (text, dtype) = (s.to_cow()?, dtype.unwrap_or(WireDtype::I32));
            py.allow_threads(|| sglang::decode_sglang(&text, dtype, &shape))
        } else if let Ok(b) = payload.downcast::<PyBytes>() {
            let text = std::str::from_utf8(b.as_bytes())
                .map_err(|e| arg_err(format!("sglang payload: not base64 text: {e}")))?;
            let dtype = dtype.unwrap_or(WireDtype::I32);
            py.allow_threads(|| sglang::decode_sglang(text, dtype, &shape))
        } else if payload.is_instance_of::<PyDict>() {
            let mut response = json_value(payload)?;
            if let Some(dtype) = dtype {
                with_dtype(&mut response, dtype)?;
            }
            py.allow_threads(|| sglang::decode_sglang_response(&response, &shape))
        } else {
            return Err(arg_err(
                "sglang payload must be the base64 str/bytes or the response dict",
            ));
        };
        Ok(Self::wrap(table.map_err(route_err)?, &layout))
    }

    /// Decodes vLLM's `routed_experts`: a numpy array (or nested lists)
    /// `[rows, num_hidden_layers, top_k]` (read in place), raw `.npy` bytes, the base64 `.npy`
    /// text (str / bytes / response JSON), or a response dict (base64, or vLLM 0.21's nested
    /// `prompt_routed_experts` + the choices' `routed_experts`). A response holds one
    /// `routed_experts` per choice: one of several (`n > 1`) must be named by `choice`, never
    /// taken as choice 0; an array or `.npy` is one choice (0).
    #[staticmethod]
    #[pyo3(signature = (array_or_bytes, *, layout, start_len = 0, choice = None))]
    fn from_vllm(
        array_or_bytes: &Bound<'_, PyAny>,
        layout: PyRef<'_, PyLayerLayout>,
        #[pyo3(from_py_with = args::start_len)] start_len: usize,
        #[pyo3(from_py_with = args::choice)] choice: Option<usize>,
    ) -> PyResult<Self> {
        let one_array = |what: &str| match choice {
            None | Some(0) => Ok(()),
            Some(c) => Err(arg_err(format!(
                "choice {c} asked for; {what} is one choice (0)"
            ))),
        };
        let shape = layout.wire_shape(start_len)?;
        let obj = array_or_bytes;
        let py = obj.py();
        let table = if let Ok(b) = obj.downcast::<PyBytes>() {
            let bytes = b.as_bytes();
            if bytes.starts_with(b"\x93NUMPY") {
                one_array("an .npy file")?;
                py.allow_threads(|| vllm::decode_npy_routes(bytes, &shape))
            } else {
                let text = std::str::from_utf8(bytes)
                    .map_err(|e| arg_err(format!("vllm payload: not .npy nor text: {e}")))?;
                py.allow_threads(|| vllm_text(text, choice, &shape))
            }
        } else if let Ok(s) = obj.downcast::<PyString>() {
            let text = s.to_cow()?;
            py.allow_threads(|| vllm_text(&text, choice, &shape))
        } else if obj.is_instance_of::<PyDict>() {
            let v = json_value(obj)?;
            py.allow_threads(|| {
                if is_nested_json(&v) {
                    pick_choice(vllm_json::decode_vllm_json(&v, &shape), choice)
                } else {
                    vllm_text(&v.to_string(), choice, &shape)
                }
            })
        } else {
            one_array("an array")?;
            let decoder = ArrayDecoder {
                layout: &layout,
                start: start_len,
                moe_only: false,
                what: "vllm array",
            };
            return Ok(Self::wrap(visit_ints(obj, "vllm array", decoder)?, &layout));
        };
        Ok(Self::wrap(table.map_err(route_err)?, &layout))
    }

    /// A table from ids `[rows, moe_layers, top_k]` (or the wire shape
    /// `[rows, num_hidden_layers, top_k]`) of any integer dtype; a cell of all -1 is missing.
    #[staticmethod]
    #[pyo3(signature = (ids, *, layout, start_pos = 0))]
    fn from_numpy(
        ids: &Bound<'_, PyAny>,
        layout: PyRef<'_, PyLayerLayout>,
        #[pyo3(from_py_with = args::start_pos)] start_pos: usize,
    ) -> PyResult<Self> {
        let decoder = ArrayDecoder {
            layout: &layout,
            start: start_pos,
            moe_only: true,
            what: "ids",
        };
        Ok(Self::wrap(visit_ints(ids, "ids", decoder)?, &layout))
    }

    /// Parses r3's canonical JSON route document and puts it in the layout's MoE-only space.
    #[staticmethod]
    #[pyo3(signature = (text, *, layout))]
    fn from_json(text: &str, layout: PyRef<'_, PyLayerLayout>) -> PyResult<Self> {
        let table = RouteTable::from_json_str(text)
            .and_then(|t| t.to_moe_only(&layout.layout))
            .map_err(route_err)?;
        if table.num_experts() != layout.num_experts || table.top_k() != layout.top_k {
            return Err(arg_err(format!(
                "document has {} experts, top_k {}; the layout {} experts, top_k {}",
                table.num_experts(),
                table.top_k(),
                layout.num_experts,
                layout.top_k
            )));
        }
        Ok(Self::wrap(table, &layout))
    }

    /// r3's canonical JSON route document (MoE-only columns).
    fn to_json(&self) -> String {
        self.table.to_json_string()
    }

    /// Ids `[rows, moe_layers, top_k]` as int32; missing cells are -1.
    #[getter]
    fn ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let t = &self.table;
        let (rows, cols, k) = (t.num_tokens(), t.num_columns(), t.top_k());
        let mut out = vec![-1i32; rows * cols * k];
        for (cell, ids) in out.chunks_exact_mut(k).enumerate() {
            let (tok, col) = (cell / cols, cell % cols);
            if t.is_present(tok, col) {
                for (j, v) in ids.iter_mut().enumerate() {
                    *v = t.expert_at(tok, col, j).map_or(-1, i32::from);
                }
            }
        }
        to_numpy(py, out, &[rows, cols, k])
    }

    /// Which cells hold a route, bool `[rows, moe_layers]`.
    #[getter]
    fn present<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let t = &self.table;
        let (rows, cols) = (t.num_tokens(), t.num_columns());
        let out: Vec<bool> = (0..rows * cols)
            .map(|c| t.is_present(c / cols, c % cols))
            .collect();
        to_numpy(py, out, &[rows, cols])
    }

    /// Absolute token position of row 0.
    #[getter]
    fn start_pos(&self) -> usize {
        self.table.start_pos()
    }

    /// Position one past the last row.
    #[getter]
    fn end_pos(&self) -> usize {
        self.table.end_pos()
    }

    /// Number of rows (tokens).
    #[getter]
    fn num_rows(&self) -> usize {
        self.table.num_tokens()
    }

    /// Global layer index of each column (the MoE layers).
    #[getter]
    fn layers(&self) -> Vec<usize> {
        self.table.layers().to_vec()
    }

    /// The table's layer layout.
    #[getter]
    fn layout(&self) -> PyLayerLayout {
        self.layout.clone()
    }

    /// Rows `[start, stop)` (relative to row 0) as a new table.
    fn slice_rows(
        &self,
        #[pyo3(from_py_with = args::start)] start: usize,
        #[pyo3(from_py_with = args::stop)] stop: usize,
    ) -> PyResult<Self> {
        let table = self.table.slice_rows(start, stop).map_err(route_err)?;
        Ok(Self::wrap(table, &self.layout))
    }

    /// SGLang's base64 payload (all layers; dense columns 0) in `dtype`.
    #[pyo3(signature = (dtype = "int32"))]
    fn to_sglang(&self, dtype: &str) -> PyResult<String> {
        let lay = &self.layout.layout;
        sglang::encode_sglang(
            &self.table,
            parse_dtype(dtype)?,
            lay.num_hidden_layers(),
            Some(lay),
        )
        .map_err(route_err)
    }

    /// vLLM's base64 `.npy` payload (all layers) in `dtype`, NPY format `npy_version`.
    #[pyo3(signature = (dtype = "int16", npy_version = 1))]
    fn to_vllm(
        &self,
        dtype: &str,
        #[pyo3(from_py_with = args::npy_version)] npy_version: u8,
    ) -> PyResult<String> {
        let lay = &self.layout.layout;
        vllm::encode_vllm(
            &self.table,
            parse_dtype(dtype)?,
            npy_version,
            lay.num_hidden_layers(),
            Some(lay),
        )
        .map_err(route_err)
    }

    /// The wire shape `[rows, num_hidden_layers, top_k]` as int32: dense columns 0, missing
    /// MoE cells -1.
    fn to_numpy_all_layers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let shape = [
            self.table.num_tokens(),
            self.layout.layout.num_hidden_layers(),
            self.table.top_k(),
        ];
        to_numpy(py, self.wire_values()?, &shape)
    }

    fn __len__(&self) -> usize {
        self.table.num_tokens()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .downcast::<PyRouteTable>()
            .is_ok_and(|o| o.get().table == self.table && o.get().layout == self.layout)
    }

    fn __repr__(&self) -> String {
        format!(
            "RouteTable(rows={}, start_pos={}, layers={:?}, top_k={}, present={}/{})",
            self.table.num_tokens(),
            self.table.start_pos(),
            self.table.layers(),
            self.table.top_k(),
            self.table.num_present(),
            self.table.num_tokens() * self.table.num_columns()
        )
    }
}
