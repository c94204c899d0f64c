//! The MoE block (`MoeBlock`: router, routed experts, shared experts) and the routed experts'
//! ops: the dispatch of tokens to experts, the CPU's fused routed SwiGLU (`routed_op`), the
//! padded layout's expert GEMMs a GPU runs (`expert_gemm`, `padded_experts`), the SwiGLU
//! halves and the gate-weighted combine.

mod block;
pub(crate) mod combine_slots;
pub mod dispatch;
pub mod divergence;
pub mod expert_gemm;
pub mod experts;
pub mod padded_experts;
pub mod route_rows;
mod routed_op;
pub(crate) mod swiglu_halves;

pub(crate) use block::DeviceRoutes;
pub use block::{Gates, MoeBlock, MoeOutput, RoutedRows};
