//! Transformer blocks of the f32 training forward, built from autograd-safe composed ops:
//! attention (`attention/`), the MoE block and its routed experts (`moe/`), and the ops they
//! share (linear layers and GEMMs, RMSNorm, embedding and row gathers, the dense SwiGLU MLP,
//! ops with precomputed values or recomputed segments).

pub mod attention;
pub mod embedding_rows;
pub mod gather_rows;
pub mod gemm;
pub mod linear;
pub mod matmul16;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod precomputed;
pub mod recomputed_segment;
