//! Bar plots over named categories: one value per category (e.g. the frequency of "k routers
//! differ", paper Fig. 3a/3b) or several series side by side per category (grouped bars, e.g.
//! best eval score per benchmark for each run).

use std::path::Path;

use plotters::prelude::*;

use super::axis::{Axis, Scale};
use super::frame::{draw_framed, Frame};
use super::line::bounds;
use super::style::series_color;
use super::{Canvas, PlotError};

/// Most category labels written under the x axis; beyond it only every k-th is written.
const MAX_CATEGORY_LABELS: usize = 20;
/// Fraction of a category's width the bars of one group fill.
const GROUP_WIDTH: f64 = 0.8;

/// One value per category.
#[derive(Debug, Clone, Copy)]
pub struct BarPlot<'a> {
    /// Caption.
    pub title: &'a str,
    /// x axis description.
    pub x_label: &'a str,
    /// y axis description.
    pub y_label: &'a str,
    /// Category names, left to right.
    pub categories: &'a [String],
    /// One value per category; a non-finite value leaves its slot empty.
    pub values: &'a [f64],
    /// y axis scale (log bars rise from the bottom of the axis).
    pub y_scale: Scale,
    /// PNG size.
    pub canvas: Canvas,
}

/// Several named series, one bar each per category, drawn side by side.
#[derive(Debug, Clone, Copy)]
pub struct GroupedBarPlot<'a> {
    /// Caption.
    pub title: &'a str,
    /// x axis description.
    pub x_label: &'a str,
    /// y axis description.
    pub y_label: &'a str,
    /// Category names, left to right.
    pub categories: &'a [String],
    /// `(legend label, one value per category)`.
    pub series: &'a [(String, Vec<f64>)],
    /// y axis scale.
    pub y_scale: Scale,
    /// PNG size.
    pub canvas: Canvas,
}

/// Draws a single-series bar plot as a PNG at `path`.
pub fn bar_plot(plot: &BarPlot<'_>, path: &Path) -> Result<(), PlotError> {
    let series = [(String::new(), plot.values.to_vec())];
    let grouped = GroupedBarPlot {
        title: plot.title,
        x_label: plot.x_label,
        y_label: plot.y_label,
        categories: plot.categories,
        series: &series,
        y_scale: plot.y_scale,
        canvas: plot.canvas,
    };
    draw_bars(&grouped, path, false)
}

/// Draws a grouped bar plot (with a legend) as a PNG at `path`.
pub fn grouped_bar_plot(plot: &GroupedBarPlot<'_>, path: &Path) -> Result<(), PlotError> {
    draw_bars(plot, path, true)
}

/// The y axis for bars: linear axes always include 0 so bar lengths are honest.
pub(super) fn value_axis(scale: Scale, lo: f64, hi: f64) -> Axis {
    match scale {
        Scale::Log10 => Axis::covering(scale, lo, hi),
        Scale::Linear if lo >= 0.0 && hi > 0.0 => Axis::linear_exact(0.0, hi * 1.08),
        Scale::Linear if hi <= 0.0 && lo < 0.0 => Axis::linear_exact(lo * 1.08, 0.0),
        Scale::Linear => Axis::covering(scale, lo.min(0.0), hi.max(0.0)),
    }
}

fn draw_bars(plot: &GroupedBarPlot<'_>, path: &Path, legend: bool) -> Result<(), PlotError> {
    let n = plot.categories.len();
    if let Some((label, values)) = plot.series.iter().find(|(_, v)| v.len() != n) {
        return Err(PlotError::InvalidInput {
            plot: plot.title.to_string(),
            what: format!(
                "series {label:?} has {} values for {n} categories",
                values.len()
            ),
        });
    }
    let shown = plot
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().filter_map(|&x| plot.y_scale.to_plot(x)));
    let Some((lo, hi)) = bounds(shown) else {
        return Err(PlotError::NoData {
            plot: plot.title.to_string(),
            detail: format!(
                "{n} categories x {} series, no value that can be shown",
                plot.series.len()
            ),
        });
    };
    let y = value_axis(plot.y_scale, lo, hi);
    let every = n.div_ceil(MAX_CATEGORY_LABELS).max(1);
    let x = Axis {
        scale: Scale::Linear,
        range: -0.6..(n as f64 - 0.4),
        ticks: (0..n).step_by(every).map(|i| i as f64).collect(),
    };
    let category_label = |t: f64| {
        let i = t.round();
        if i < 0.0 {
            return String::new();
        }
        plot.categories.get(i as usize).cloned().unwrap_or_default()
    };
    let frame = Frame {
        title: plot.title,
        x_label: plot.x_label,
        y_label: plot.y_label,
        x,
        y: y.clone(),
        x_tick_label: Some(&category_label),
        canvas: plot.canvas,
    };
    let base = match plot.y_scale {
        Scale::Log10 => y.range.start,
        Scale::Linear => 0.0,
    };
    let m = plot.series.len().max(1) as f64;
    let width = GROUP_WIDTH / m;
    draw_framed(path, &frame, |chart, ctx| {
        for (j, (label, values)) in plot.series.iter().enumerate() {
            let color = series_color(j);
            let bars = values.iter().enumerate().filter_map(|(i, &v)| {
                let top = plot.y_scale.to_plot(v)?;
                let left = i as f64 - GROUP_WIDTH / 2.0 + j as f64 * width;
                let right = left + width * 0.92;
                Some(Rectangle::new([(left, base), (right, top)], color.filled()))
            });
            let drawn = chart.draw_series(bars).map_err(|e| ctx.draw(e))?;
            if legend {
                drawn.label(label.clone()).legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled())
                });
            }
        }
        Ok(legend.then_some(SeriesLabelPosition::UpperRight))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::testutil::assert_png;
    use r3_test_support::Scratch;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| i.to_string()).collect()
    }

    #[test]
    fn bar_axis_starts_at_zero() {
        let pos = value_axis(Scale::Linear, 2.0, 10.0).range;
        assert_eq!(pos.start, 0.0);
        assert!((pos.end - 10.8).abs() < 1e-12, "{pos:?}");
        let neg = value_axis(Scale::Linear, -5.0, -1.0).range;
        assert!((neg.start + 5.4).abs() < 1e-12, "{neg:?}");
        assert_eq!(neg.end, 0.0);
        // Mixed signs: padded around both.
        let mixed = value_axis(Scale::Linear, -1.0, 1.0).range;
        assert!(mixed.start < -1.0 && mixed.end > 1.0);
    }

    #[test]
    fn router_count_frequencies_on_log_axis() {
        let dir = Scratch::new("bars_log");
        // 49 categories: labels are thinned to every 3rd.
        let cats = names(49);
        let values: Vec<f64> = (0..49).map(|k| 0.5f64.powi(k)).collect();
        let plot = BarPlot {
            title: "routers differing per token",
            x_label: "routers",
            y_label: "fraction of tokens",
            categories: &cats,
            values: &values,
            y_scale: Scale::Log10,
            canvas: Canvas::default(),
        };
        let path = dir.path().join("bars.png");
        bar_plot(&plot, &path).unwrap();
        assert_png(&path, 900, 560);
    }

    #[test]
    fn grouped_bars_with_missing_values() {
        let dir = Scratch::new("bars_grouped");
        let cats = vec!["math".to_string(), "count".to_string(), "sort".to_string()];
        let series = vec![
            ("R3".to_string(), vec![0.6, 0.4, f64::NAN]),
            ("R2".to_string(), vec![0.5, 0.3, 0.2]),
            ("none".to_string(), vec![0.1, 0.0, 0.05]),
        ];
        let plot = GroupedBarPlot {
            title: "best eval",
            x_label: "task",
            y_label: "accuracy",
            categories: &cats,
            series: &series,
            y_scale: Scale::Linear,
            canvas: Canvas {
                width: 500,
                height: 300,
            },
        };
        let path = dir.path().join("grouped.png");
        grouped_bar_plot(&plot, &path).unwrap();
        assert_png(&path, 500, 300);
    }

    #[test]
    fn mismatched_lengths_and_empty_data_are_errors() {
        let dir = Scratch::new("bars_err");
        let cats = names(3);
        let series = vec![("short".to_string(), vec![1.0, 2.0])];
        let plot = GroupedBarPlot {
            title: "bad",
            x_label: "x",
            y_label: "y",
            categories: &cats,
            series: &series,
            y_scale: Scale::Linear,
            canvas: Canvas::default(),
        };
        let err = grouped_bar_plot(&plot, &dir.path().join("bad.png"));
        assert!(
            matches!(err, Err(PlotError::InvalidInput { .. })),
            "{err:?}"
        );
        let nan = [f64::NAN; 3];
        let plot = BarPlot {
            title: "nan",
            x_label: "x",
            y_label: "y",
            categories: &cats,
            values: &nan,
            y_scale: Scale::Linear,
            canvas: Canvas::default(),
        };
        let err = bar_plot(&plot, &dir.path().join("nan.png"));
        assert!(matches!(err, Err(PlotError::NoData { .. })), "{err:?}");
        let plot = BarPlot {
            categories: &[],
            values: &[],
            ..plot
        };
        let err = bar_plot(&plot, &dir.path().join("none.png"));
        assert!(matches!(err, Err(PlotError::NoData { .. })), "{err:?}");
    }
}
