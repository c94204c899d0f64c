//! Checked conversion of a [`RouteTable`] between the all-layers space (SGLang/vLLM wire
//! shape) and the MoE-only space (what the routers consume), by global layer index.

use crate::table::IdStore;
use crate::{LayerLayout, LayerSpace, RouteError, RouteTable};

impl RouteTable {
    /// All-layers → MoE-only. Dense columns must be missing or all zero (SGLang pads dense
    /// layers with zeros), else [`RouteError::DenseColumnNotEmpty`]. A table already in
    /// MoE-only space is returned unchanged if its layers match the layout. A layout without
    /// MoE layers is an error: a table has at least one column.
    pub fn to_moe_only(&self, layout: &LayerLayout) -> Result<RouteTable, RouteError> {
        if layout.num_moe_layers() == 0 {
            return Err(RouteError::Layout(format!(
                "the layout has no MoE layer among its {} layers: a MoE-only table would have \
                 no column",
                layout.num_hidden_layers()
            )));
        }
        match self.space {
            LayerSpace::MoeOnly => {
                self.check_layers(
                    layout.moe_layers(),
                    "layers of a MoE-only table (table vs layout)",
                )?;
                return Ok(self.clone());
            }
            LayerSpace::AllLayers => {
                let all: Vec<usize> = (0..layout.num_hidden_layers()).collect();
                self.check_layers(&all, "layers of an all-layers table (table vs layout)")?;
            }
        }
        for (c, &layer) in self.layers.iter().enumerate() {
            if layout.is_moe(layer) {
                continue;
            }
            for t in 0..self.num_tokens {
                if let Some(ids) = self.experts(t, c) {
                    if let Some(&v) = ids.iter().find(|&&v| v != 0) {
                        return Err(RouteError::DenseColumnNotEmpty {
                            token: self.start_pos + t,
                            layer,
                            value: i64::from(v),
                        });
                    }
                }
            }
        }
        let keep: Vec<usize> = layout.moe_layers().to_vec();
        Ok(self.remap_columns(LayerSpace::MoeOnly, keep, Some))
    }

    /// MoE-only → all-layers: dense columns become missing cells (never zeros). A table
    /// already in all-layers space is returned unchanged if it has the layout's layer count.
    pub fn to_all_layers(&self, layout: &LayerLayout) -> Result<RouteTable, RouteError> {
        match self.space {
            LayerSpace::AllLayers => {
                let all: Vec<usize> = (0..layout.num_hidden_layers()).collect();
                self.check_layers(&all, "layers of an all-layers table (table vs layout)")?;
                Ok(self.clone())
            }
            LayerSpace::MoeOnly => {
                self.check_layers(
                    layout.moe_layers(),
                    "layers of a MoE-only table (table vs layout)",
                )?;
                let all: Vec<usize> = (0..layout.num_hidden_layers()).collect();
                Ok(self.remap_columns(LayerSpace::AllLayers, all, |layer| {
                    layout.is_moe(layer).then_some(layer)
                }))
            }
        }
    }

    fn check_layers(&self, expected: &[usize], what: &'static str) -> Result<(), RouteError> {
        if self.layers != expected {
            return Err(RouteError::layers_shape(what, &self.layers, expected));
        }
        Ok(())
    }

    /// New table with columns `new_layers`; column for layer L copies this table's column
    /// for `source(L)` (by global layer), or is missing when `source` gives None.
    fn remap_columns(
        &self,
        space: LayerSpace,
        new_layers: Vec<usize>,
        source: impl Fn(usize) -> Option<usize>,
    ) -> RouteTable {
        let k = self.top_k;
        let new_cols = new_layers.len();
        let src_cols: Vec<Option<usize>> = new_layers
            .iter()
            .map(|&l| source(l).and_then(|s| self.column_of_layer(s)))
            .collect();
        let mut ids = IdStore::zeros(self.num_experts, self.num_tokens * new_cols * k);
        let mut present = vec![false; self.num_tokens * new_cols];
        for t in 0..self.num_tokens {
            for (nc, src) in src_cols.iter().enumerate() {
                let Some(sc) = *src else { continue };
                let from = self.cell_index(t, sc);
                if !self.present[from] {
                    continue;
                }
                let to = t * new_cols + nc;
                present[to] = true;
                for j in 0..k {
                    ids.set(to * k + j, self.ids.get(from * k + j));
                }
            }
        }
        RouteTable {
            num_experts: self.num_experts,
            top_k: k,
            space,
            layers: new_layers,
            start_pos: self.start_pos,
            num_tokens: self.num_tokens,
            ids,
            present,
            versions: self.versions.clone(),
        }
    }
}
