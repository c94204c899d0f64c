//! `r3._r3`: the compiled core of the `r3` Python package — thin PyO3 bindings over
//! r3-routing (no codec or check of its own). Every r3-routing error becomes `r3.RouteError`
//! (a `ValueError`) with the Rust message, which names the token, layer and value.

mod args;
mod arrays;
mod layout;
mod megatron;
mod metrics;
mod table;

use pyo3::prelude::*;

pyo3::create_exception!(
    r3,
    RouteError,
    pyo3::exceptions::PyValueError,
    "Invalid routes, payload or argument; the message names the token, layer and value."
);

/// The Python exception for an r3-routing error.
pub(crate) fn route_err(e: r3_routing::RouteError) -> PyErr {
    RouteError::new_err(e.to_string())
}

/// An `r3.RouteError` with a message of the binding's own (argument shapes, dtypes).
pub(crate) fn arg_err(msg: impl Into<String>) -> PyErr {
    RouteError::new_err(msg.into())
}

#[pymodule]
fn _r3(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("RouteError", m.py().get_type::<RouteError>())?;
    m.add_class::<layout::PyLayerLayout>()?;
    m.add_class::<table::PyRouteTable>()?;
    m.add_class::<megatron::PyPipelineSplit>()?;
    m.add_function(wrap_pyfunction!(metrics::merge_resumed, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::check_covers_sequence, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::mismatch, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::routing_divergence, m)?)?;
    m.add_function(wrap_pyfunction!(megatron::rank_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(megatron::replay_ids, m)?)?;
    Ok(())
}
