//! Turns per-sample log-probs and route tables into the analysis sections. The statistics
//! themselves (k3 KL, F(τ), probability differences, routing divergence) come from
//! `r3_routing::{mismatch, divergence}`; this module pools samples, adds the two views the
//! paper plots that r3-routing does not keep (differing experts per router, Fig. 3a, and the
//! binned per-sequence means, Fig. 3c) and thins scatter points for drawing.

use r3_routing::divergence::{
    divergence, summarize, Divergence, DivergenceSummary, LayerDivergence,
};
use r3_routing::mismatch::{
    default_taus, extreme_fraction_curve, mismatch_metrics, MismatchMetrics,
};
use r3_routing::RouteTable;
use serde::Serialize;

use crate::AnalysisError;

/// Most points kept for a scatter plot (evenly strided over all tokens).
pub const MAX_SCATTER_POINTS: usize = 40_000;
/// Bins of the per-sequence histogram (Fig. 3c).
pub const SEQUENCE_BINS: usize = 20;

/// Mismatch between two sets of per-token log-probs (`a` plays "training", `b` "rollout").
#[derive(Debug, Clone, Serialize)]
pub struct MismatchSection {
    /// k3 KL, F(2), F(5), probability differences, Pearson (r3-routing).
    pub metrics: MismatchMetrics,
    /// F(τ) on r3-routing's default τ grid, as `(τ, F)`.
    pub f_tau: Vec<(f64, f64)>,
    /// Whether every log-prob pair is bitwise equal.
    pub bitwise_identical: bool,
    /// Tokens whose log-probs differ at all.
    pub differing_tokens: usize,
    /// Largest |log p_a − log p_b|.
    pub max_abs_log_diff: f64,
}

/// Compares per-sample log-probs `a` (training) with `b` (rollout or another pass).
pub fn mismatch_section(
    a: &[Vec<f32>],
    b: &[Vec<f32>],
    what: &str,
) -> Result<MismatchSection, AnalysisError> {
    let (fa, fb) = flatten_pair(a, b, what)?;
    let metrics = mismatch_metrics(&fa, &fb, None).map_err(AnalysisError::route(what))?;
    let f_tau = extreme_fraction_curve(&fa, &fb, None, &default_taus())
        .map_err(AnalysisError::route(what))?;
    let differing_tokens = fa
        .iter()
        .zip(&fb)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    let max_abs_log_diff = fa
        .iter()
        .zip(&fb)
        .map(|(x, y)| f64::from(*x - *y).abs())
        .fold(0.0, f64::max);
    Ok(MismatchSection {
        metrics,
        f_tau,
        bitwise_identical: differing_tokens == 0,
        differing_tokens,
        max_abs_log_diff,
    })
}

/// Flattens two per-sample log-prob lists after checking they have the same shape.
fn flatten_pair(
    a: &[Vec<f32>],
    b: &[Vec<f32>],
    what: &str,
) -> Result<(Vec<f32>, Vec<f32>), AnalysisError> {
    if a.len() != b.len() {
        return Err(AnalysisError::Invalid(format!(
            "{what}: {} vs {} samples",
            a.len(),
            b.len()
        )));
    }
    if let Some(i) = (0..a.len()).find(|&i| a[i].len() != b[i].len()) {
        return Err(AnalysisError::Invalid(format!(
            "{what}: sample {i} has {} vs {} log-probs",
            a[i].len(),
            b[i].len()
        )));
    }
    Ok((a.concat(), b.concat()))
}

/// `(p_b, p_a)` points — x the rollout (or first pass) probability, y the training one —
/// evenly strided down to at most [`MAX_SCATTER_POINTS`].
pub fn scatter_points(a: &[Vec<f32>], b: &[Vec<f32>]) -> Vec<(f64, f64)> {
    let (fa, fb) = (a.concat(), b.concat());
    let n = fa.len().min(fb.len());
    let stride = n.div_ceil(MAX_SCATTER_POINTS).max(1);
    (0..n)
        .step_by(stride)
        .map(|i| (f64::from(fb[i]).exp(), f64::from(fa[i]).exp()))
        .collect()
}

/// Routing divergence between two route tables per sample (Fig. 3).
#[derive(Debug, Clone, Serialize)]
pub struct DivergenceSection {
    /// Pooled router / token fractions, mean per-sequence differing layers, token histogram.
    pub summary: DivergenceSummary,
    /// `router_level[d]` = routers (token, layer) whose expert sets differ in exactly `d`
    /// of their top-k experts (Fig. 3a; index 0 = identical).
    pub router_level: Vec<usize>,
    /// `token_level[n]` = tokens with exactly `n` differing layers (Fig. 3b).
    pub token_level: Vec<usize>,
    /// Each sequence's mean number of differing layers per token (Fig. 3c).
    pub per_sequence_mean: Vec<f64>,
    /// Histogram of `per_sequence_mean`: `SEQUENCE_BINS` equal bins over `[0, MoE layers]`.
    pub per_sequence_histogram: BinnedCounts,
    /// Per MoE layer, pooled over all sequences.
    pub per_layer: Vec<LayerDivergence>,
}

/// Counts over bins given by their edges (one more edge than counts).
#[derive(Debug, Clone, Serialize)]
pub struct BinnedCounts {
    /// Bin edges, increasing.
    pub edges: Vec<f64>,
    /// Values per bin; the last bin includes its upper edge.
    pub counts: Vec<usize>,
}

/// Compares `a[i]` with `b[i]` for every sample.
pub fn divergence_section(
    a: &[RouteTable],
    b: &[RouteTable],
    what: &str,
) -> Result<DivergenceSection, AnalysisError> {
    if a.len() != b.len() || a.is_empty() {
        return Err(AnalysisError::Invalid(format!(
            "{what}: {} vs {} route tables",
            a.len(),
            b.len()
        )));
    }
    let per_seq: Vec<Divergence> = a
        .iter()
        .zip(b)
        .enumerate()
        .map(|(i, (x, y))| {
            divergence(x, y).map_err(AnalysisError::route(format!("{what}, sample {i}")))
        })
        .collect::<Result<_, _>>()?;
    let summary = summarize(&per_seq);
    let top_k = a[0].top_k();
    let mut router_level = vec![0usize; top_k + 1];
    for (x, y) in a.iter().zip(b) {
        for (d, n) in differing_experts_histogram(x, y).into_iter().enumerate() {
            if let Some(slot) = router_level.get_mut(d) {
                *slot += n;
            }
        }
    }
    let per_sequence_mean: Vec<f64> = per_seq
        .iter()
        .filter(|d| d.compared_tokens > 0)
        .map(|d| d.mean_diff_layers_per_token)
        .collect();
    let columns = a[0].num_columns().max(1);
    Ok(DivergenceSection {
        token_level: summary.diff_layers_histogram.clone(),
        summary,
        router_level,
        per_sequence_histogram: bin(&per_sequence_mean, 0.0, columns as f64, SEQUENCE_BINS),
        per_sequence_mean,
        per_layer: pool_layers(&per_seq),
    })
}

/// `h[d]` = routers present in both tables whose expert sets differ in `d` experts.
fn differing_experts_histogram(a: &RouteTable, b: &RouteTable) -> Vec<usize> {
    let k = a.top_k();
    let mut h = vec![0usize; k + 1];
    let rows = a.num_tokens().min(b.num_tokens());
    let cols = a.num_columns().min(b.num_columns());
    for t in 0..rows {
        for c in 0..cols {
            let (Some(x), Some(y)) = (a.experts(t, c), b.experts(t, c)) else {
                continue;
            };
            let shared = x.iter().filter(|e| y.contains(e)).count();
            if let Some(slot) = h.get_mut(k.saturating_sub(shared)) {
                *slot += 1;
            }
        }
    }
    h
}

/// Sums per-layer figures over sequences (overlap weighted by routers compared).
fn pool_layers(seqs: &[Divergence]) -> Vec<LayerDivergence> {
    let Some(first) = seqs.first() else {
        return Vec::new();
    };
    first
        .per_layer
        .iter()
        .enumerate()
        .map(|(c, l)| {
            let (mut compared, mut differing, mut overlap) = (0usize, 0usize, 0.0f64);
            for d in seqs {
                if let Some(x) = d.per_layer.get(c) {
                    compared += x.compared;
                    differing += x.differing;
                    overlap += x.mean_overlap * x.compared as f64;
                }
            }
            let frac = |v: f64, empty: f64| {
                if compared == 0 {
                    empty
                } else {
                    v / compared as f64
                }
            };
            LayerDivergence {
                layer: l.layer,
                compared,
                differing,
                diff_fraction: frac(differing as f64, 0.0),
                mean_overlap: frac(overlap, 1.0),
            }
        })
        .collect()
}

/// Equal-width histogram of `values` over `[lo, hi]` with `bins` bins.
pub fn bin(values: &[f64], lo: f64, hi: f64, bins: usize) -> BinnedCounts {
    let bins = bins.max(1);
    let width = (hi - lo) / bins as f64;
    let edges = (0..=bins).map(|i| lo + width * i as f64).collect();
    let mut counts = vec![0usize; bins];
    for &v in values.iter().filter(|v| v.is_finite()) {
        let i = ((v - lo) / width).floor();
        let i = if i < 0.0 {
            0
        } else {
            (i as usize).min(bins - 1)
        };
        counts[i] += 1;
    }
    BinnedCounts { edges, counts }
}
