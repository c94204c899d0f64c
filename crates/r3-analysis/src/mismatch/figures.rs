//! The analysis PNGs, named after the paper's figures: probability scatters (Fig. 2a–c, 4),
//! the F(τ) curves on log axes (Fig. 2d) and the routing-divergence histograms (Fig. 3a–c,
//! plus per-layer grouped bars). A figure with nothing drawable (e.g. every F(τ) is 0, which a
//! log axis cannot show) is recorded as skipped with the reason instead of failing the run.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::plot::{
    bar_plot, grouped_bar_plot, histogram_plot, line_plot, scatter_plot, BarPlot, Canvas,
    GroupedBarPlot, HistogramPlot, LegendPosition, LinePlot, PlotError, Scale, ScatterPlot, Series,
};

use super::stats::DivergenceSection;
use crate::AnalysisError;

/// What happened to one figure.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FigureStatus {
    /// Written to this file (relative to the output directory).
    Written(String),
    /// Not drawn, and why.
    Skipped(String),
}

/// Figures by key (e.g. `fig2a_moe_native`), in a stable order.
pub type FigureIndex = BTreeMap<String, FigureStatus>;

/// Draws with `draw` into `<out>/<key>.png` and records the outcome; only `NoData` is
/// tolerated, any other plot error aborts.
fn record(
    index: &mut FigureIndex,
    out: &Path,
    key: &str,
    draw: impl FnOnce(&Path) -> Result<(), PlotError>,
) -> Result<(), AnalysisError> {
    let file = format!("{key}.png");
    let status = match draw(&out.join(&file)) {
        Ok(()) => FigureStatus::Written(file),
        Err(e @ PlotError::NoData { .. }) => {
            tracing::warn!(figure = key, reason = %e, "figure skipped");
            FigureStatus::Skipped(e.to_string())
        }
        Err(e) => return Err(e.into()),
    };
    index.insert(key.to_string(), status);
    Ok(())
}

/// A training-vs-rollout probability scatter (x rollout, y training).
pub fn scatter(
    index: &mut FigureIndex,
    out: &Path,
    key: &str,
    title: &str,
    axes: (&str, &str),
    points: &[(f64, f64)],
) -> Result<(), AnalysisError> {
    record(index, out, key, |path| {
        scatter_plot(
            &ScatterPlot::probabilities(title, axes.0, axes.1, points),
            path,
        )
    })
}

/// F(τ) curves, both axes logarithmic (Fig. 2d).
pub fn f_tau(
    index: &mut FigureIndex,
    out: &Path,
    key: &str,
    curves: &[(&str, &[(f64, f64)])],
) -> Result<(), AnalysisError> {
    let series: Vec<Series> = curves
        .iter()
        .map(|(label, points)| Series {
            label: (*label).to_string(),
            points: points.to_vec(),
        })
        .collect();
    record(index, out, key, |path| {
        let mut plot = LinePlot::log_log(
            "Extreme token distribution F(τ) (zeros not shown on log axes)",
            "τ (probability ratio threshold)",
            "F(τ): fraction of tokens with max(p_t/p_r, p_r/p_t) > τ",
            &series,
        );
        plot.markers = true;
        // F(τ) falls from the upper left to the lower right: the lower left stays empty.
        plot.legend = LegendPosition::LowerLeft;
        line_plot(&plot, path)
    })
}

/// The three Fig. 3 histograms of one divergence section.
pub fn divergence(
    index: &mut FigureIndex,
    out: &Path,
    prefix: &str,
    what: &str,
    d: &DivergenceSection,
) -> Result<(), AnalysisError> {
    let title = format!(
        "{what}: routers by number of differing experts ({:.2}% of routers differ)",
        100.0 * d.summary.router_diff_fraction
    );
    let axes = (
        "experts that differ in a router's top-k",
        "fraction of routers",
    );
    let key = format!("{prefix}a_router_level");
    share_bars(index, out, &key, &title, axes, &d.router_level)?;

    let title = format!(
        "{what}: tokens by number of layers with a different choice ({:.2}% differ in ≥ 1)",
        100.0 * d.summary.token_diff_fraction
    );
    let axes = ("MoE layers whose routers differ", "fraction of tokens");
    let key = format!("{prefix}b_token_level");
    share_bars(index, out, &key, &title, axes, &d.token_level)?;

    let counts: Vec<f64> = d
        .per_sequence_histogram
        .counts
        .iter()
        .map(|&c| c as f64)
        .collect();
    let title = format!(
        "{what}: per-sequence mean differing routers per token (mean {:.3})",
        d.summary.mean_seq_diff_layers_per_token
    );
    record(index, out, &format!("{prefix}c_sequence_level"), |path| {
        histogram_plot(
            &HistogramPlot {
                title: &title,
                x_label: "mean differing routers per token in a sequence",
                y_label: "sequences",
                edges: &d.per_sequence_histogram.edges,
                counts: &counts,
                y_scale: Scale::Linear,
                canvas: Canvas::default(),
            },
            path,
        )
    })
}

/// Fraction of differing routers per MoE layer, one bar series per comparison.
pub fn per_layer(
    index: &mut FigureIndex,
    out: &Path,
    key: &str,
    comparisons: &[(&str, &DivergenceSection)],
) -> Result<(), AnalysisError> {
    let Some((_, first)) = comparisons.first() else {
        return Ok(());
    };
    let categories: Vec<String> = first
        .per_layer
        .iter()
        .map(|l| l.layer.to_string())
        .collect();
    let series: Vec<(String, Vec<f64>)> = comparisons
        .iter()
        .map(|(label, d)| {
            let v = d.per_layer.iter().map(|l| l.diff_fraction).collect();
            ((*label).to_string(), v)
        })
        .collect();
    record(index, out, key, |path| {
        grouped_bar_plot(
            &GroupedBarPlot {
                title: "Fraction of routers that choose different experts, per MoE layer",
                x_label: "MoE layer",
                y_label: "fraction of routers that differ",
                categories: &categories,
                series: &series,
                y_scale: Scale::Linear,
                canvas: Canvas::default(),
            },
            path,
        )
    })
}

/// Bars of `counts[i] / Σ counts` over categories `0, 1, 2, …` (x, y labels in `axes`).
fn share_bars(
    index: &mut FigureIndex,
    out: &Path,
    key: &str,
    title: &str,
    axes: (&str, &str),
    counts: &[usize],
) -> Result<(), AnalysisError> {
    let categories: Vec<String> = (0..counts.len()).map(|i| i.to_string()).collect();
    let values = fractions(counts, counts.iter().sum());
    record(index, out, key, |path| {
        bar_plot(
            &BarPlot {
                title,
                x_label: axes.0,
                y_label: axes.1,
                categories: &categories,
                values: &values,
                y_scale: Scale::Linear,
                canvas: Canvas::default(),
            },
            path,
        )
    })
}

/// `counts / total` (all zeros when `total` is 0).
fn fractions(counts: &[usize], total: usize) -> Vec<f64> {
    counts
        .iter()
        .map(|&c| {
            if total == 0 {
                0.0
            } else {
                c as f64 / total as f64
            }
        })
        .collect()
}
