//! Routing divergence between two route tables of the same tokens (e.g. rollout vs training
//! routes): how many routers chose a different expert set, how many tokens differ in at least
//! one layer, the distribution of differing layers per token, per-layer figures and the mean
//! expert overlap |A∩B|/K. Cells missing on either side are not compared, only counted.

use serde::Serialize;

use crate::{RouteError, RouteTable};

/// Divergence figures for one layer column.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerDivergence {
    /// Global layer index.
    pub layer: usize,
    /// Routers compared in this layer.
    pub compared: usize,
    /// Routers whose expert sets differ.
    pub differing: usize,
    /// `differing / compared` (0 when nothing was compared).
    pub diff_fraction: f64,
    /// Mean |A∩B|/K over compared routers (1 when nothing was compared).
    pub mean_overlap: f64,
}

/// Divergence between two tables (see module doc).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Divergence {
    /// Rows compared.
    pub num_tokens: usize,
    /// Layer columns.
    pub num_columns: usize,
    /// (token, layer) routers present on both sides.
    pub compared_routers: usize,
    /// Routers whose expert sets differ.
    pub differing_routers: usize,
    /// Routers missing on one or both sides (not compared).
    pub skipped_missing: usize,
    /// `differing_routers / compared_routers`.
    pub router_diff_fraction: f64,
    /// Tokens with at least one compared router.
    pub compared_tokens: usize,
    /// Tokens with at least one differing router.
    pub differing_tokens: usize,
    /// `differing_tokens / compared_tokens`.
    pub token_diff_fraction: f64,
    /// Mean number of differing layers per compared token.
    pub mean_diff_layers_per_token: f64,
    /// `histogram[n]` = compared tokens with exactly n differing layers (n = 0..=columns).
    pub diff_layers_histogram: Vec<usize>,
    /// Mean |A∩B|/K over compared routers.
    pub mean_overlap: f64,
    /// Per-column figures.
    pub per_layer: Vec<LayerDivergence>,
}

fn ratio(num: f64, den: usize, empty: f64) -> f64 {
    if den == 0 {
        empty
    } else {
        num / den as f64
    }
}

/// Compares two tables over the same rows, columns and experts.
pub fn divergence(a: &RouteTable, b: &RouteTable) -> Result<Divergence, RouteError> {
    a.check_same_shape(b)?;
    if a.start_pos() != b.start_pos() || a.num_tokens() != b.num_tokens() {
        return Err(RouteError::Misaligned {
            what: "compared rows",
            rows: b.start_pos()..b.end_pos(),
            against: a.start_pos()..a.end_pos(),
            rule: "both tables must cover the same positions",
        });
    }
    let (cols, k) = (a.num_columns(), a.top_k());
    let mut layer_compared = vec![0usize; cols];
    let mut layer_diff = vec![0usize; cols];
    let mut layer_overlap = vec![0usize; cols];
    let mut histogram = vec![0usize; cols + 1];
    let (mut compared_tokens, mut differing_tokens, mut skipped) = (0usize, 0usize, 0usize);
    let mut diff_layers_sum = 0usize;
    for t in 0..a.num_tokens() {
        let (mut token_compared, mut token_diff) = (0usize, 0usize);
        for c in 0..cols {
            if !a.is_present(t, c) || !b.is_present(t, c) {
                skipped += 1;
                continue;
            }
            let overlap = (0..k)
                .filter(|&i| {
                    let x = a.expert_at(t, c, i);
                    (0..k).any(|j| b.expert_at(t, c, j) == x)
                })
                .count();
            token_compared += 1;
            layer_compared[c] += 1;
            layer_overlap[c] += overlap;
            if overlap != k {
                token_diff += 1;
                layer_diff[c] += 1;
            }
        }
        if token_compared > 0 {
            compared_tokens += 1;
            histogram[token_diff] += 1;
            diff_layers_sum += token_diff;
            if token_diff > 0 {
                differing_tokens += 1;
            }
        }
    }
    let compared: usize = layer_compared.iter().sum();
    let differing: usize = layer_diff.iter().sum();
    let overlap_sum: usize = layer_overlap.iter().sum();
    let per_layer = (0..cols)
        .map(|c| LayerDivergence {
            layer: a.layers()[c],
            compared: layer_compared[c],
            differing: layer_diff[c],
            diff_fraction: ratio(layer_diff[c] as f64, layer_compared[c], 0.0),
            mean_overlap: ratio(layer_overlap[c] as f64 / k as f64, layer_compared[c], 1.0),
        })
        .collect();
    Ok(Divergence {
        num_tokens: a.num_tokens(),
        num_columns: cols,
        compared_routers: compared,
        differing_routers: differing,
        skipped_missing: skipped,
        router_diff_fraction: ratio(differing as f64, compared, 0.0),
        compared_tokens,
        differing_tokens,
        token_diff_fraction: ratio(differing_tokens as f64, compared_tokens, 0.0),
        mean_diff_layers_per_token: ratio(diff_layers_sum as f64, compared_tokens, 0.0),
        diff_layers_histogram: histogram,
        mean_overlap: ratio(overlap_sum as f64 / k as f64, compared, 1.0),
        per_layer,
    })
}

/// Pooled divergence over many sequences: router/token fractions pooled over all routers and
/// tokens, plus the mean over sequences of each sequence's mean differing layers per token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DivergenceSummary {
    /// Sequences pooled.
    pub num_sequences: usize,
    /// Pooled `differing_routers / compared_routers`.
    pub router_diff_fraction: f64,
    /// Pooled `differing_tokens / compared_tokens`.
    pub token_diff_fraction: f64,
    /// Mean over sequences of the per-sequence mean differing layers per token.
    pub mean_seq_diff_layers_per_token: f64,
    /// Pooled mean |A∩B|/K.
    pub mean_overlap: f64,
    /// Summed histogram of differing layers per token (longest histogram wins the length).
    pub diff_layers_histogram: Vec<usize>,
}

/// Pools per-sequence divergences.
pub fn summarize(seqs: &[Divergence]) -> DivergenceSummary {
    let sum = |f: fn(&Divergence) -> usize| seqs.iter().map(f).sum::<usize>();
    let compared = sum(|d| d.compared_routers);
    let tokens = sum(|d| d.compared_tokens);
    let overlap: f64 = seqs
        .iter()
        .map(|d| d.mean_overlap * d.compared_routers as f64)
        .sum();
    let with_tokens: Vec<&Divergence> = seqs.iter().filter(|d| d.compared_tokens > 0).collect();
    let len = seqs
        .iter()
        .map(|d| d.diff_layers_histogram.len())
        .max()
        .unwrap_or(0);
    let mut histogram = vec![0usize; len];
    for d in seqs {
        for (h, &n) in histogram.iter_mut().zip(&d.diff_layers_histogram) {
            *h += n;
        }
    }
    DivergenceSummary {
        num_sequences: seqs.len(),
        router_diff_fraction: ratio(sum(|d| d.differing_routers) as f64, compared, 0.0),
        token_diff_fraction: ratio(sum(|d| d.differing_tokens) as f64, tokens, 0.0),
        mean_seq_diff_layers_per_token: ratio(
            with_tokens
                .iter()
                .map(|d| d.mean_diff_layers_per_token)
                .sum(),
            with_tokens.len(),
            0.0,
        ),
        mean_overlap: ratio(overlap, compared, 1.0),
        diff_layers_histogram: histogram,
    }
}
