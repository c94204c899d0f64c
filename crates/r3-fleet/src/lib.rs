//! Rollouts from a fleet of SGLang-compatible servers (`r3 serve` workers, real SGLang, or
//! an sglang-router in front of them) for the r3 trainer: the `/generate` wire format with
//! checked decoding of log-probs and routed experts ([`wire`]), a pooled async HTTP client
//! ([`http`]), least-outstanding-requests balancing ([`pool`]), and the fleet itself with
//! retries, weight sync and rejoining workers ([`fleet`]); requests aborted at a weight
//! update are resumed and their pieces merged ([`partial`]).

pub mod config;
pub mod error;
pub mod fleet;
pub mod http;
pub mod partial;
pub mod pool;
pub mod wire;

pub use config::{FleetConfig, ModelFacts, PartialMode};
pub use error::{FleetError, Result};
pub use fleet::{Fleet, RolloutStats};
pub use partial::{resume_seed, Pieces};
pub use pool::{WorkerPool, WorkerSlot};
