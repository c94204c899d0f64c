//! Non-negative integer arguments. PyO3 extracts a negative Python int for a `usize`
//! parameter as `OverflowError` naming no argument, which `except r3.RouteError` (and
//! `except ValueError`) miss. A parameter marked `#[pyo3(from_py_with = args::NAME)]` is
//! extracted here instead: a negative or too large int raises `r3.RouteError` naming the
//! argument (and the element of a list or pair), any other type the `TypeError` PyO3 names it
//! in. PyO3 hands `from_py_with` no argument name, hence one small function per name.

use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::arg_err;

/// A value made of non-negative integers, extracted with the argument's name for errors.
pub(crate) trait Counts: Sized {
    /// Extracts `obj`; `name` names it (with an index inside a list or pair).
    fn extract_named(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self>;
}

/// An unsigned integer: PyO3's extraction, its `OverflowError` turned into `RouteError`.
fn unsigned<T>(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<T>
where
    T: for<'py> FromPyObject<'py> + Bounded,
{
    match obj.extract::<T>() {
        Ok(v) => Ok(v),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
            let text = obj
                .str()
                .map_or_else(|_| "?".to_string(), |s| s.to_string());
            Err(arg_err(if obj.lt(0)? {
                format!("{name} must be a non-negative integer, got {text}")
            } else {
                format!("{name} is {text}, above its largest value {}", T::MAX_TEXT)
            }))
        }
        Err(e) => Err(e),
    }
}

/// The largest value of an unsigned type, for the error message.
pub(crate) trait Bounded {
    /// The maximum as text.
    const MAX_TEXT: &'static str;
}

impl Bounded for usize {
    const MAX_TEXT: &'static str = "18446744073709551615";
}

impl Bounded for u8 {
    const MAX_TEXT: &'static str = "255";
}

impl Counts for usize {
    fn extract_named(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        unsigned(obj, name)
    }
}

impl Counts for u8 {
    fn extract_named(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        unsigned(obj, name)
    }
}

impl<T: Counts> Counts for Option<T> {
    fn extract_named(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        if obj.is_none() {
            Ok(None)
        } else {
            T::extract_named(obj, name).map(Some)
        }
    }
}

impl<T: Counts> Counts for Vec<T> {
    fn extract_named(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        // As PyO3's own `Vec` extraction: a sequence, but never a str.
        if obj.is_instance_of::<PyString>() {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "can't extract `str` to `Vec`",
            ));
        }
        let items: Vec<Bound<'_, PyAny>> = obj.extract()?;
        items
            .iter()
            .enumerate()
            .map(|(i, item)| T::extract_named(item, &format!("{name}[{i}]")))
            .collect()
    }
}

impl<T: Counts> Counts for (T, T) {
    fn extract_named(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        let (a, b): (Bound<'_, PyAny>, Bound<'_, PyAny>) = obj.extract()?;
        Ok((
            T::extract_named(&a, &format!("{name}[0]"))?,
            T::extract_named(&b, &format!("{name}[1]"))?,
        ))
    }
}

/// One extractor per argument name (`#[pyo3(from_py_with = args::start_len)]`).
macro_rules! named {
    ($($name:ident),* $(,)?) => {
        $(
            #[doc = concat!("Extracts the argument `", stringify!($name), "`.")]
            pub(crate) fn $name<T: Counts>(obj: &Bound<'_, PyAny>) -> PyResult<T> {
                T::extract_named(obj, stringify!($name))
            }
        )*
    };
}

named!(
    start_len,
    start_pos,
    start,
    stop,
    npy_version,
    choice,
    num_hidden_layers,
    moe_layers,
    num_experts,
    top_k,
    layer,
    num_layers,
    pp_size,
    vp_size,
    first_stage_layers,
    last_stage_layers,
    pp_rank,
    vp_stage,
    seq_lens,
    sp,
    cp,
    cu_seqlens_padded,
    padded_len,
    router_layers,
    num_tokens,
    total_tokens,
);
