//! numpy in and out: integer arrays read in place (after `numpy.ascontiguousarray`, which
//! copies only a non-contiguous array), results handed to numpy without a copy.

use numpy::{Element, PyArray1, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::arg_err;

/// Something done with an integer array of any numpy integer dtype.
pub(crate) trait IntArrayVisitor {
    /// The result.
    type Out;
    /// Called once with the array's shape and its elements in row-major order.
    fn visit<T: Copy + Into<i64>>(self, shape: &[usize], data: &[T]) -> PyResult<Self::Out>;
}

/// `numpy.ascontiguousarray(obj)` (the same object when it already is one).
fn contiguous<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    obj.py()
        .import("numpy")?
        .call_method1("ascontiguousarray", (obj,))
}

/// Runs `visitor` on `obj` as an integer array; `what` names the argument in errors.
pub(crate) fn visit_ints<V: IntArrayVisitor>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    visitor: V,
) -> PyResult<V::Out> {
    let arr = contiguous(obj)?;
    macro_rules! try_dtype {
        ($t:ty) => {
            if let Ok(a) = arr.downcast::<PyArrayDyn<$t>>() {
                let ro = a.readonly();
                let data = ro.as_slice().map_err(|e| arg_err(format!("{what}: {e}")))?;
                return visitor.visit(a.shape(), data);
            }
        };
    }
    try_dtype!(i32);
    try_dtype!(i64);
    try_dtype!(i16);
    try_dtype!(u8);
    try_dtype!(u16);
    try_dtype!(i8);
    try_dtype!(u32);
    let dtype = arr
        .getattr("dtype")
        .map_or_else(|_| "unknown".to_string(), |d| d.to_string());
    Err(arg_err(format!(
        "{what}: expected an array of integers (int8/16/32/64, uint8/16/32), got dtype {dtype}"
    )))
}

/// `obj` as a contiguous 1-D array of `T` (converted, so copied, when its dtype differs).
pub(crate) fn vector<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    dtype: &str,
    what: &str,
) -> PyResult<Bound<'py, PyArrayDyn<T>>> {
    let np = obj.py().import("numpy")?;
    let arr = np.call_method1("ascontiguousarray", (obj, dtype))?;
    let arr = arr
        .downcast_into::<PyArrayDyn<T>>()
        .map_err(|_| arg_err(format!("{what}: not convertible to a {dtype} array")))?;
    if arr.ndim() != 1 {
        return Err(arg_err(format!(
            "{what}: expected a 1-D array, got shape {:?}",
            arr.shape()
        )));
    }
    Ok(arr)
}

/// A numpy array of `shape` that owns `data` (no copy).
pub(crate) fn to_numpy<'py, T: Element>(
    py: Python<'py>,
    data: Vec<T>,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    Ok(PyArray1::from_vec(py, data)
        .reshape(shape.to_vec())?
        .into_any())
}
