//! r3-routing: the routing data model of r3, free of any tensor library.
//!
//! A [`RouteTable`] holds logical expert ids `[tokens, columns, top_k]` and knows its layer
//! space, the global layer of every column, its first token position and which cells are
//! missing. Around it: [`LayerLayout`] (which layers are MoE), [`ExpertPlacement`] (EPLB
//! physical → logical), the SGLang / vLLM / canonical wire codecs ([`wire`]), alignment of
//! rows with tokens ([`align`]), divergence statistics ([`divergence`](mod@divergence)), training–inference
//! mismatch metrics ([`mismatch`]), expert-load statistics ([`load`]), the routing keys of
//! an HF config ([`RoutingConfig`]) and Megatron-Core's layer and token split ([`megatron`]).

pub mod align;
mod build;
mod canonical;
pub mod divergence;
mod error;
mod hf_config;
mod layout;
mod limits;
pub mod load;
pub mod megatron;
pub mod mismatch;
mod placement;
mod space;
mod table;
pub mod wire;

pub use align::{check_covers_sequence, expected_rows, merge_resumed, MergePolicy};
pub use canonical::{CANONICAL_FORMAT, CANONICAL_VERSION};
pub use divergence::{divergence, summarize, Divergence, DivergenceSummary, LayerDivergence};
pub use error::RouteError;
pub use hf_config::{deepseek_v3_default, RoutingConfig};
pub use layout::{LayerLayout, LayerSpace, LayoutRules};
pub use limits::DecodeLimits;
pub use load::{expert_load, summed_expert_load, ExpertLoad, LayerLoad};
pub use mismatch::{extreme_fraction_curve, mismatch_metrics, MismatchMetrics};
pub use placement::ExpertPlacement;
pub use table::{RouteTable, MAX_EXPERTS};
pub use wire::{WireDtype, WireShape};
