//! Which global transformer layers are MoE layers, and which layer space a route table's
//! columns live in. Mapping between the two spaces goes through [`LayerLayout`] only, by
//! global layer index — never by "index + offset" (the dense-layer shift of verl #5037).

use serde::{Deserialize, Serialize};

use crate::{DecodeLimits, RouteError};

/// Which layers a route table's columns are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerSpace {
    /// One column per transformer layer, dense layers included (as SGLang and vLLM send it).
    AllLayers,
    /// One column per MoE layer only (what the model's routers consume).
    MoeOnly,
}

impl LayerSpace {
    /// The canonical-JSON name of the space.
    pub fn as_str(self) -> &'static str {
        match self {
            LayerSpace::AllLayers => "all_layers",
            LayerSpace::MoeOnly => "moe_only",
        }
    }

    /// Parses the canonical-JSON name of a space.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "all_layers" => Some(LayerSpace::AllLayers),
            "moe_only" => Some(LayerSpace::MoeOnly),
            _ => None,
        }
    }
}

/// The HF config fields that decide which layers are MoE layers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutRules {
    /// Total transformer layers (`num_hidden_layers`).
    pub num_hidden_layers: usize,
    /// Routed experts per MoE layer (`num_experts` / `n_routed_experts`); 0 = dense model.
    pub num_experts: usize,
    /// DeepSeek `first_k_dense_replace`: the first k layers are dense.
    pub first_k_dense_replace: usize,
    /// Qwen `decoder_sparse_step`: layer i is MoE iff (i+1) % step == 0. Must be > 0.
    pub decoder_sparse_step: usize,
    /// Qwen `mlp_only_layers`: layers forced dense.
    pub mlp_only_layers: Vec<usize>,
    /// DeepSeek `moe_layer_freq`: layer i is MoE iff i % freq == 0. Must be > 0.
    pub moe_layer_freq: usize,
}

impl LayoutRules {
    /// Rules for a model whose every layer is MoE.
    pub fn all_moe(num_hidden_layers: usize, num_experts: usize) -> Self {
        LayoutRules {
            num_hidden_layers,
            num_experts,
            first_k_dense_replace: 0,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
            moe_layer_freq: 1,
        }
    }
}

/// Which global transformer layers are MoE layers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LayerLayout {
    num_hidden_layers: usize,
    moe_layers: Vec<usize>,
    /// `column_of[layer]` = MoE column of a global layer, `None` for dense layers.
    column_of: Vec<Option<usize>>,
}

impl LayerLayout {
    /// Builds a layout from an explicit list of MoE layer indices (any order, no duplicates,
    /// all `< num_hidden_layers`); at most [`DecodeLimits::MAX_LAYERS`] layers.
    pub fn new(num_hidden_layers: usize, mut moe_layers: Vec<usize>) -> Result<Self, RouteError> {
        DecodeLimits::check_layers("num_hidden_layers", num_hidden_layers)?;
        moe_layers.sort_unstable();
        for w in moe_layers.windows(2) {
            if w[0] == w[1] {
                return Err(RouteError::Layout(format!(
                    "MoE layer {} listed twice",
                    w[0]
                )));
            }
        }
        if let Some(&last) = moe_layers.last() {
            if last >= num_hidden_layers {
                return Err(RouteError::LayerOutOfRange {
                    what: "MoE layer",
                    layer: last,
                    num_layers: num_hidden_layers,
                });
            }
        }
        let mut column_of = vec![None; num_hidden_layers];
        for (col, &layer) in moe_layers.iter().enumerate() {
            column_of[layer] = Some(col);
        }
        Ok(LayerLayout {
            num_hidden_layers,
            moe_layers,
            column_of,
        })
    }

    /// Applies the HF rules: layer i is MoE iff num_experts > 0 && i >= first_k_dense_replace
    /// && i not in mlp_only_layers && (i+1) % decoder_sparse_step == 0 && i % moe_layer_freq == 0.
    pub fn from_rules(rules: &LayoutRules) -> Result<Self, RouteError> {
        DecodeLimits::check_layers("num_hidden_layers", rules.num_hidden_layers)?;
        DecodeLimits::check("num_experts", rules.num_experts, DecodeLimits::MAX_EXPERTS)?;
        if rules.decoder_sparse_step == 0 {
            return Err(RouteError::Layout(
                "decoder_sparse_step must be > 0".to_string(),
            ));
        }
        if rules.moe_layer_freq == 0 {
            return Err(RouteError::Layout("moe_layer_freq must be > 0".to_string()));
        }
        if let Some(&bad) = rules
            .mlp_only_layers
            .iter()
            .find(|&&l| l >= rules.num_hidden_layers)
        {
            return Err(RouteError::LayerOutOfRange {
                what: "mlp_only_layers entry",
                layer: bad,
                num_layers: rules.num_hidden_layers,
            });
        }
        let moe = (0..rules.num_hidden_layers)
            .filter(|&i| {
                rules.num_experts > 0
                    && i >= rules.first_k_dense_replace
                    && !rules.mlp_only_layers.contains(&i)
                    && (i + 1) % rules.decoder_sparse_step == 0
                    && i % rules.moe_layer_freq == 0
            })
            .collect();
        LayerLayout::new(rules.num_hidden_layers, moe)
    }

    /// Layout of a model whose every layer is MoE. Allocates `num_hidden_layers` entries:
    /// callers pass a count they have checked (see [`DecodeLimits::check_layers`]).
    pub fn all_moe(num_hidden_layers: usize) -> Self {
        let moe_layers: Vec<usize> = (0..num_hidden_layers).collect();
        let column_of = moe_layers.iter().map(|&c| Some(c)).collect();
        LayerLayout {
            num_hidden_layers,
            moe_layers,
            column_of,
        }
    }

    /// Layout whose first `k` layers are dense and the rest MoE (DeepSeek-V3 style).
    pub fn first_k_dense(num_hidden_layers: usize, k: usize) -> Result<Self, RouteError> {
        DecodeLimits::check_layers("num_hidden_layers", num_hidden_layers)?;
        if k > num_hidden_layers {
            return Err(RouteError::LayerOutOfRange {
                what: "first_k_dense (layers before the first MoE layer)",
                layer: k,
                num_layers: num_hidden_layers,
            });
        }
        LayerLayout::new(num_hidden_layers, (k..num_hidden_layers).collect())
    }

    /// Total transformer layers.
    pub fn num_hidden_layers(&self) -> usize {
        self.num_hidden_layers
    }

    /// Global indices of the MoE layers, ascending.
    pub fn moe_layers(&self) -> &[usize] {
        &self.moe_layers
    }

    /// Number of MoE layers.
    pub fn num_moe_layers(&self) -> usize {
        self.moe_layers.len()
    }

    /// Whether global layer `layer` is an MoE layer (false for out-of-range layers).
    pub fn is_moe(&self, layer: usize) -> bool {
        self.moe_column(layer).is_some()
    }

    /// Global layer index → MoE-only column, `None` for dense or out-of-range layers.
    pub fn moe_column(&self, layer: usize) -> Option<usize> {
        self.column_of.get(layer).copied().flatten()
    }

    /// Global layer indices of every column in `space`.
    pub fn layers_of(&self, space: LayerSpace) -> Vec<usize> {
        match space {
            LayerSpace::AllLayers => (0..self.num_hidden_layers).collect(),
            LayerSpace::MoeOnly => self.moe_layers.clone(),
        }
    }
}
