//! Transformer blocks of the f32 training forward, built from autograd-safe composed ops.

pub mod attention;
pub mod attention_op;
pub mod attention_recompute;
mod attention_rows;
mod attention_softmax;
mod combine_slots;
pub mod dispatch;
pub mod embedding_rows;
pub mod expert_gemm;
pub mod experts;
pub mod gather_rows;
pub mod gemm;
pub mod linear;
pub mod matmul16;
pub mod mla;
pub mod mlp;
pub mod moe;
mod narrow_product;
pub mod norm;
pub mod padded_experts;
pub mod precomputed;
pub mod rope;
pub mod rope_op;
mod rope_rounded;
pub mod route_rows;
mod routed_op;
mod swiglu_halves;
