//! Hand-written CPU kernels of the inference path (f32 / f16 on plain slices).

pub mod attention;
pub mod linear;
pub mod ops;
pub mod packed_f16;
