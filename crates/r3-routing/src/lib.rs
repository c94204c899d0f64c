//! r3-routing: the routing data model of r3, free of any tensor library.
//!
//! A [`RouteTable`] holds logical expert ids `[tokens, columns, top_k]` and knows its layer
//! space, the global layer of every column, its first token position and which cells are
//! missing. Around it: [`LayerLayout`] (which layers are MoE), [`ExpertPlacement`] (EPLB
//! physical → logical), the SGLang / vLLM / canonical wire codecs, alignment of rows with
//! tokens, validation, divergence statistics and training–inference mismatch metrics.

mod build;
mod canonical;
mod error;
mod layout;
mod placement;
mod space;
mod table;

pub use canonical::{CANONICAL_FORMAT, CANONICAL_VERSION};
pub use error::RouteError;
pub use layout::{LayerLayout, LayerSpace, LayoutRules};
pub use placement::ExpertPlacement;
pub use table::{RouteTable, MAX_EXPERTS};
