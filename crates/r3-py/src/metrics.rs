//! Module functions over tables and log-probs: resumed-call merging, sequence coverage,
//! training–inference mismatch metrics and routing divergence (all computed by r3-routing).

use numpy::{PyArrayDyn, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use r3_routing::MergePolicy;

use crate::args;
use crate::arrays::vector;
use crate::table::PyRouteTable;
use crate::{arg_err, route_err};

/// Merges the route tables of one request's calls (aborted, then resumed; in call order)
/// under `policy`: `keep_per_token_origin`, `replace_with_resumed` or
/// `prefer_resumed_from_its_start` (slime's merge).
#[pyfunction]
#[pyo3(signature = (pieces, policy = "keep_per_token_origin"))]
pub(crate) fn merge_resumed(
    pieces: Vec<PyRef<'_, PyRouteTable>>,
    policy: &str,
) -> PyResult<PyRouteTable> {
    let policy = match policy {
        "keep_per_token_origin" => MergePolicy::KeepPerTokenOrigin,
        "replace_with_resumed" => MergePolicy::ReplaceWithResumed,
        "prefer_resumed_from_its_start" => MergePolicy::PreferResumedFromItsStart,
        other => {
            return Err(arg_err(format!(
                "unknown policy {other:?} (keep_per_token_origin, replace_with_resumed or \
                 prefer_resumed_from_its_start)"
            )))
        }
    };
    let (first, rest) = pieces
        .split_first()
        .ok_or_else(|| arg_err("merge_resumed needs at least one table"))?;
    let mut merged = first.table.clone();
    for next in rest {
        merged = r3_routing::merge_resumed(&merged, &next.table, policy).map_err(route_err)?;
    }
    Ok(PyRouteTable {
        table: merged,
        layout: first.layout.clone(),
    })
}

/// Raises `RouteError` unless `table` covers every fed position of a sequence of
/// `total_tokens` tokens (`total_tokens - 1 - start_pos` rows).
#[pyfunction]
pub(crate) fn check_covers_sequence(
    table: PyRef<'_, PyRouteTable>,
    #[pyo3(from_py_with = args::total_tokens)] total_tokens: usize,
) -> PyResult<()> {
    r3_routing::check_covers_sequence(&table.table, total_tokens).map_err(route_err)
}

/// Log-probs as float32, the precision r3-routing computes the metrics from: a float32 array
/// as it is; anything else (float64, lists, ints) only when every value is exactly a float32,
/// else an error naming the argument, its dtype and the first value that would be rounded
/// (never a silent narrowing).
fn logprobs(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<f32>> {
    let arr = obj.py().import("numpy")?.call_method1("asarray", (obj,))?;
    if arr.downcast::<PyArrayDyn<f32>>().is_ok() {
        let v = vector::<f32>(&arr, "float32", what)?;
        let ro = v.readonly();
        return ro
            .as_slice()
            .map(<[f32]>::to_vec)
            .map_err(|e| arg_err(format!("{what}: {e}")));
    }
    let dtype = arr
        .getattr("dtype")
        .map_or_else(|_| "unknown".to_string(), |d| d.to_string());
    let wide = vector::<f64>(&arr, "float64", what)?;
    let ro = wide.readonly();
    let wide = ro.as_slice().map_err(|e| arg_err(format!("{what}: {e}")))?;
    wide.iter()
        .enumerate()
        .map(|(i, &v)| {
            let narrow = v as f32;
            if f64::from(narrow) == v || v.is_nan() {
                Ok(narrow)
            } else {
                Err(arg_err(format!(
                    "{what}: {dtype} value {v:?} at index {i} is not exactly a float32; the \
                     mismatch metrics are computed from float32 log-probs (what the engines \
                     emit): pass float32 (e.g. .astype(numpy.float32)) to accept the rounding"
                )))
            }
        })
        .collect()
}

/// Training–inference mismatch metrics over the unmasked tokens, under the keys of
/// `metrics.jsonl` (`mismatch.k3_kl`, `mismatch.f_tau2`, ...). The log-probs must be float32,
/// or values that are exactly float32 (see `logprobs`).
#[pyfunction]
#[pyo3(signature = (train_logp, rollout_logp, mask = None))]
pub(crate) fn mismatch<'py>(
    train_logp: &Bound<'py, PyAny>,
    rollout_logp: &Bound<'py, PyAny>,
    mask: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let py = train_logp.py();
    let train = logprobs(train_logp, "train_logp")?;
    let rollout = logprobs(rollout_logp, "rollout_logp")?;
    let mask = mask
        .map(|m| vector::<bool>(m, "bool", "mask"))
        .transpose()?;
    let mask_ro = mask.as_ref().map(|m| m.readonly());
    let mask: Option<Vec<bool>> = match &mask_ro {
        Some(m) => Some(
            m.as_slice()
                .map_err(|e| arg_err(format!("mask: {e}")))?
                .to_vec(),
        ),
        None => None,
    };
    // Copied out of Python: the metrics run without the GIL.
    let metrics = py
        .allow_threads(|| r3_routing::mismatch_metrics(&train, &rollout, mask.as_deref()))
        .map_err(route_err)?;
    let out = PyDict::new(py);
    for (key, value) in metrics.log_fields() {
        out.set_item(key, value)?;
    }
    Ok(out)
}

/// Divergence between two tables of the same positions (router / token fractions, the
/// per-token histogram of differing layers, per-layer figures, mean overlap), with the two
/// `metrics.jsonl` keys `divergence.router_frac` and `divergence.token_frac`.
#[pyfunction]
pub(crate) fn routing_divergence<'py>(
    a: PyRef<'py, PyRouteTable>,
    b: PyRef<'py, PyRouteTable>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = a.py();
    let d = r3_routing::divergence(&a.table, &b.table).map_err(route_err)?;
    let text = serde_json::to_string(&d).map_err(|e| arg_err(e.to_string()))?;
    let out = py.import("json")?.call_method1("loads", (text,))?;
    out.set_item("divergence.router_frac", d.router_diff_fraction)?;
    out.set_item("divergence.token_frac", d.token_diff_fraction)?;
    Ok(out)
}
