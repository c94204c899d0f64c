//! r3's analysis library: the training–inference mismatch analysis of an MoE model
//! (`mismatch`, paper Section 3), the replay-mode comparison of RL runs (`compare`, Table 1),
//! the report over run directories (`report`), paired comparisons of evaluations
//! (`paired`) and the small PNG plotting layer they share
//! (`plot`). Rollouts are sampled and sequences scored through r3-train's own functions, so
//! the analysis measures exactly what the RL loop does.

pub mod compare;
mod error;
pub mod mismatch;
pub mod paired;
pub mod plot;
pub mod report;

pub use error::AnalysisError;
