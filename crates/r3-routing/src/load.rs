//! Expert-load statistics of a route table: tokens routed to each expert per layer, and the
//! per-layer max violation `max load / mean load − 1` (0 = perfectly balanced).

use serde::Serialize;

use crate::RouteTable;

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
