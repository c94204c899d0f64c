//! `r3.LayerLayout`: which layers are MoE layers, with the expert count and top-k, built
//! from an HF `config.json` by r3-routing's [`RoutingConfig`].

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use r3_routing::{LayerLayout, RoutingConfig};

use crate::args;
use crate::{arg_err, route_err};

/// Which layers are MoE layers, the routed-expert count and top-k of a model.
#[pyclass(name = "LayerLayout", module = "r3", frozen, eq)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PyLayerLayout {
    pub(crate) layout: LayerLayout,
    pub(crate) num_experts: usize,
    pub(crate) top_k: usize,
}

impl PyLayerLayout {
    /// What a wire decoder needs to know, rows starting at `start_len`.
    pub(crate) fn wire_shape(&self, start_len: usize) -> PyResult<r3_routing::WireShape> {
        r3_routing::WireShape::new(
            self.layout.num_hidden_layers(),
            self.top_k,
            self.num_experts,
        )
        .with_start_len(start_len)
        .with_layout(self.layout.clone())
        .map_err(route_err)
    }
}

/// Reads `config.json` text from a path (a checkpoint folder or the file itself).
fn read_config(path: PathBuf) -> PyResult<String> {
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path
    };
    std::fs::read_to_string(&file)
        .map_err(|e| arg_err(format!("cannot read {}: {e}", file.display())))
}

#[pymethods]
impl PyLayerLayout {
    /// A layout from its parts: `moe_layers` are global layer indices.
    #[new]
    #[pyo3(signature = (num_hidden_layers, moe_layers, *, num_experts, top_k))]
    fn new(
        #[pyo3(from_py_with = args::num_hidden_layers)] num_hidden_layers: usize,
        #[pyo3(from_py_with = args::moe_layers)] moe_layers: Vec<usize>,
        #[pyo3(from_py_with = args::num_experts)] num_experts: usize,
        #[pyo3(from_py_with = args::top_k)] top_k: usize,
    ) -> PyResult<Self> {
        if moe_layers.is_empty() {
            return Err(arg_err("a layout needs at least one MoE layer"));
        }
        if num_experts == 0 || top_k == 0 || top_k > num_experts {
            return Err(arg_err(format!(
                "top_k {top_k} must be in [1, num_experts = {num_experts}]"
            )));
        }
        let layout = LayerLayout::new(num_hidden_layers, moe_layers).map_err(route_err)?;
        Ok(PyLayerLayout {
            layout,
            num_experts,
            top_k,
        })
    }

    /// Reads the routing keys of an HF config: a path to `config.json` (or its folder), its
    /// text, or the parsed dict (`first_k_dense_replace`, `moe_layer_freq`,
    /// `mlp_only_layers`, `decoder_sparse_step`, `n_routed_experts` / `num_experts` /
    /// `num_local_experts`, `num_experts_per_tok`).
    #[staticmethod]
    fn from_hf_config(path_or_dict: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = path_or_dict.py();
        let text = if path_or_dict.is_instance_of::<PyDict>() {
            py.import("json")?
                .call_method1("dumps", (path_or_dict,))?
                .extract::<String>()?
        } else if let Ok(s) = path_or_dict.downcast::<PyString>() {
            let s = s.to_cow()?;
            if s.trim_start().starts_with('{') {
                s.into_owned()
            } else {
                read_config(PathBuf::from(&*s))?
            }
        } else if let Ok(p) = path_or_dict.extract::<PathBuf>() {
            read_config(p)?
        } else {
            return Err(arg_err(
                "from_hf_config takes a path, config.json text or a dict",
            ));
        };
        let cfg = RoutingConfig::from_hf_config_str(&text).map_err(route_err)?;
        Ok(PyLayerLayout {
            layout: cfg.layout().map_err(route_err)?,
            num_experts: cfg.rules.num_experts,
            top_k: cfg.top_k,
        })
    }

    /// Global indices of the MoE layers, ascending.
    #[getter]
    fn moe_layers(&self) -> Vec<usize> {
        self.layout.moe_layers().to_vec()
    }

    /// Transformer layers, dense ones included.
    #[getter]
    fn num_hidden_layers(&self) -> usize {
        self.layout.num_hidden_layers()
    }

    /// Number of MoE layers.
    #[getter]
    fn num_moe_layers(&self) -> usize {
        self.layout.num_moe_layers()
    }

    /// Routed experts per MoE layer.
    #[getter]
    fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Experts chosen per token per MoE layer.
    #[getter]
    fn top_k(&self) -> usize {
        self.top_k
    }

    /// Whether global layer `layer` is a MoE layer.
    fn is_moe(&self, #[pyo3(from_py_with = args::layer)] layer: usize) -> bool {
        self.layout.is_moe(layer)
    }

    fn __repr__(&self) -> String {
        format!(
            "LayerLayout(num_hidden_layers={}, moe_layers={:?}, num_experts={}, top_k={})",
            self.layout.num_hidden_layers(),
            self.layout.moe_layers(),
            self.num_experts,
            self.top_k
        )
    }
}
