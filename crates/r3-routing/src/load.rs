//! Expert-load statistics of a route table: tokens routed to each expert per layer, and the
//! per-layer max violation `max load / mean load − 1` (0 = perfectly balanced).

use serde::Serialize;

use crate::{RouteError, RouteTable};

/// Load of one layer column.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerLoad {
    /// Global layer index.
    pub layer: usize,
    /// Assignments per expert (tokens × top_k in total over present cells).
    pub counts: Vec<u64>,
    /// `max(counts) / mean(counts) − 1`; 0 when the layer has no routes.
    pub max_violation: f64,
}

/// Load statistics over all layers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExpertLoad {
    /// Per-column loads.
    pub per_layer: Vec<LayerLoad>,
    /// Mean of the per-layer max violations.
    pub mean_max_violation: f64,
    /// Largest per-layer max violation.
    pub max_max_violation: f64,
}

/// Counts expert assignments per layer (present cells only).
pub fn expert_load(table: &RouteTable) -> ExpertLoad {
    let per_layer: Vec<LayerLoad> = (0..table.num_columns())
        .map(|c| {
            let mut counts = vec![0u64; table.num_experts()];
            for t in 0..table.num_tokens() {
                for k in 0..table.top_k() {
                    if let Some(e) = table.expert_at(t, c, k) {
                        counts[usize::from(e)] += 1;
                    }
                }
            }
            LayerLoad {
                layer: table.layers()[c],
                max_violation: max_violation(&counts),
                counts,
            }
        })
        .collect();
    summarise(per_layer)
}

/// The loads of several tables of one layout (e.g. the sequences of a batch) added up per
/// layer and expert, with the violations of the sums; empty for no tables.
pub fn summed_expert_load(tables: &[RouteTable]) -> Result<ExpertLoad, RouteError> {
    let mut per_layer: Vec<LayerLoad> = Vec::new();
    for (i, table) in tables.iter().enumerate() {
        let load = expert_load(table);
        if i == 0 {
            per_layer = load.per_layer;
            continue;
        }
        let layers = |l: &[LayerLoad]| l.iter().map(|x| x.layer).collect::<Vec<_>>();
        if layers(&per_layer) != layers(&load.per_layer) {
            return Err(RouteError::Shape {
                what: "MoE layers",
                left: format!("{:?}", layers(&per_layer)),
                right: format!("{:?} (table {i})", layers(&load.per_layer)),
            });
        }
        for (acc, l) in per_layer.iter_mut().zip(load.per_layer) {
            if acc.counts.len() != l.counts.len() {
                return Err(RouteError::Shape {
                    what: "num_experts",
                    left: acc.counts.len().to_string(),
                    right: format!("{} (table {i}, layer {})", l.counts.len(), l.layer),
                });
            }
            for (a, c) in acc.counts.iter_mut().zip(l.counts) {
                *a += c;
            }
        }
    }
    for l in &mut per_layer {
        l.max_violation = max_violation(&l.counts);
    }
    Ok(summarise(per_layer))
}

/// The statistics over layers of per-layer loads.
fn summarise(per_layer: Vec<LayerLoad>) -> ExpertLoad {
    let n = per_layer.len();
    let mean_max_violation = if n == 0 {
        0.0
    } else {
        per_layer.iter().map(|l| l.max_violation).sum::<f64>() / n as f64
    };
    let max_max_violation = per_layer
        .iter()
        .map(|l| l.max_violation)
        .fold(0.0, f64::max);
    ExpertLoad {
        per_layer,
        mean_max_violation,
        max_max_violation,
    }
}

/// `max / mean − 1` of a load vector; 0 for an empty or all-zero vector.
pub fn max_violation(counts: &[u64]) -> f64 {
    let total: u64 = counts.iter().sum();
    if counts.is_empty() || total == 0 {
        return 0.0;
    }
    let mean = total as f64 / counts.len() as f64;
    let max = counts.iter().copied().max().unwrap_or(0) as f64;
    max / mean - 1.0
}
