//! Line plots: several series overlaid with a legend, each axis linear or log10. Used for
//! metrics over training steps (paper Fig. 5, 6) and for F(τ) against τ on log-log axes
//! (Fig. 2d).

use std::path::Path;

use plotters::prelude::*;

use super::axis::{Axis, Scale};
use super::frame::{draw_framed, Frame};
use super::smooth::ema;
use super::style::{series_color, LINE_WIDTH};

/// A series split into runs of showable points (plot coordinates).
type Segments = Vec<Vec<(f64, f64)>>;

/// Opacity of a raw curve drawn under its smoothed line.
const FAINT_ALPHA: f64 = 0.25;
use super::{Canvas, PlotError};

/// Where the legend box goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LegendPosition {
    /// Top left corner of the plotting area.
    UpperLeft,
    /// Top right corner of the plotting area.
    #[default]
    UpperRight,
    /// Bottom left corner of the plotting area.
    LowerLeft,
    /// Bottom right corner of the plotting area.
    LowerRight,
}

impl LegendPosition {
    fn to_plotters(self) -> SeriesLabelPosition {
        match self {
            Self::UpperLeft => SeriesLabelPosition::UpperLeft,
            Self::UpperRight => SeriesLabelPosition::UpperRight,
            Self::LowerLeft => SeriesLabelPosition::LowerLeft,
            Self::LowerRight => SeriesLabelPosition::LowerRight,
        }
    }
}

/// One named curve.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// `(x, y)` points in drawing order; a point that cannot be shown breaks the line.
    pub points: Vec<(f64, f64)>,
}

/// A line plot and its data.
#[derive(Debug, Clone, Copy)]
pub struct LinePlot<'a> {
    /// Caption.
    pub title: &'a str,
    /// x axis description.
    pub x_label: &'a str,
    /// y axis description.
    pub y_label: &'a str,
    /// The curves, coloured in order.
    pub series: &'a [Series],
    /// x axis scale.
    pub x_scale: Scale,
    /// y axis scale.
    pub y_scale: Scale,
    /// Draw a dot on every point (for sparse series such as eval accuracy).
    pub markers: bool,
    /// Legend placement.
    pub legend: LegendPosition,
    /// PNG size.
    pub canvas: Canvas,
    /// EMA smoothing weight (see [`super::ema`]): each series is drawn raw and faint with
    /// its smoothed line over it; `None` draws the raw lines only.
    pub smoothing: Option<f64>,
    /// Error bars: `errors[i][j]` is the half-height of the bar of point `j` of series `i`
    /// (missing or non-finite entries draw none).
    pub errors: &'a [Vec<f64>],
}

impl<'a> LinePlot<'a> {
    /// A plot over training steps: linear x, `y_scale` on y, legend upper right.
    pub fn over_steps(
        title: &'a str,
        y_label: &'a str,
        series: &'a [Series],
        y_scale: Scale,
    ) -> Self {
        Self {
            title,
            x_label: "training step",
            y_label,
            series,
            x_scale: Scale::Linear,
            y_scale,
            markers: false,
            legend: LegendPosition::UpperRight,
            canvas: Canvas::default(),
            smoothing: None,
            errors: &[],
        }
    }

    /// A curve plot with both axes logarithmic (F(τ) against τ), legend upper right.
    pub fn log_log(
        title: &'a str,
        x_label: &'a str,
        y_label: &'a str,
        series: &'a [Series],
    ) -> Self {
        Self {
            title,
            x_label,
            y_label,
            series,
            x_scale: Scale::Log10,
            y_scale: Scale::Log10,
            markers: false,
            legend: LegendPosition::UpperRight,
            canvas: Canvas::default(),
            smoothing: None,
            errors: &[],
        }
    }
}

/// Splits a series into runs of consecutive showable points, in plot coordinates.
fn segments(points: &[(f64, f64)], xs: Scale, ys: Scale) -> Vec<Vec<(f64, f64)>> {
    let mut out = Vec::new();
    let mut current = Vec::new();
    for &(x, y) in points {
        match (xs.to_plot(x), ys.to_plot(y)) {
            (Some(px), Some(py)) => current.push((px, py)),
            _ => {
                if !current.is_empty() {
                    out.push(std::mem::take(&mut current));
                }
            }
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// The error bars of every series as `(x, low, high)` in plot coordinates; bars whose point
/// or ends cannot be shown are left out.
fn error_bars(plot: &LinePlot<'_>) -> Vec<Vec<(f64, f64, f64)>> {
    plot.series
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let Some(errs) = plot.errors.get(i) else {
                return Vec::new();
            };
            s.points
                .iter()
                .zip(errs)
                .filter_map(|(&(x, y), &e)| {
                    if !e.is_finite() || e <= 0.0 {
                        return None;
                    }
                    let px = plot.x_scale.to_plot(x)?;
                    let lo = plot.y_scale.to_plot(y - e)?;
                    let hi = plot.y_scale.to_plot(y + e)?;
                    Some((px, lo, hi))
                })
                .collect()
        })
        .collect()
}

/// Smallest and largest of `values`, or `None` if there are none.
pub(super) fn bounds(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// Draws `plot` as a PNG at `path`.
pub fn line_plot(plot: &LinePlot<'_>, path: &Path) -> Result<(), PlotError> {
    let per_series: Vec<Vec<Vec<(f64, f64)>>> = plot
        .series
        .iter()
        .map(|s| segments(&s.points, plot.x_scale, plot.y_scale))
        .collect();
    let bars = error_bars(plot);
    let shown = || per_series.iter().flatten().flatten();
    let bar_ends = || bars.iter().flatten().flat_map(|b| [b.1, b.2]);
    let (Some((x_lo, x_hi)), Some((y_lo, y_hi))) = (
        bounds(shown().map(|p| p.0)),
        bounds(shown().map(|p| p.1).chain(bar_ends())),
    ) else {
        let total: usize = plot.series.iter().map(|s| s.points.len()).sum();
        let log_note = if plot.x_scale == Scale::Log10 || plot.y_scale == Scale::Log10 {
            " and positive on the log axis"
        } else {
            ""
        };
        return Err(PlotError::NoData {
            plot: plot.title.to_string(),
            detail: format!(
                "{} series with {total} points, none finite{log_note}",
                plot.series.len()
            ),
        });
    };
    let frame = Frame {
        title: plot.title,
        x_label: plot.x_label,
        y_label: plot.y_label,
        x: Axis::covering(plot.x_scale, x_lo, x_hi),
        y: Axis::covering(plot.y_scale, y_lo, y_hi),
        x_tick_label: None,
        canvas: plot.canvas,
    };
    let smoothed: Option<Vec<Segments>> = plot.smoothing.map(|w| {
        plot.series
            .iter()
            .map(|s| segments(&ema(&s.points, w), plot.x_scale, plot.y_scale))
            .collect()
    });
    draw_framed(path, &frame, |chart, ctx| {
        for (i, (series, raw)) in plot.series.iter().zip(&per_series).enumerate() {
            let color = series_color(i);
            let style = color.stroke_width(LINE_WIDTH);
            // With smoothing the raw curve is a faint backdrop and the legend names the EMA.
            let segs = match &smoothed {
                Some(smooth) => {
                    let faint = color.mix(FAINT_ALPHA).stroke_width(1);
                    for seg in raw {
                        chart
                            .draw_series(LineSeries::new(seg.iter().copied(), faint))
                            .map_err(|e| ctx.draw(e))?;
                    }
                    &smooth[i]
                }
                None => raw,
            };
            // Bars of overlaid series at the same x are set a little apart, so none hides
            // another.
            let dodge = (i as f64 - (plot.series.len() as f64 - 1.0) / 2.0) * 0.006 * (x_hi - x_lo);
            let bar_lines = bars[i].iter().map(|&(x, lo, hi)| {
                PathElement::new(vec![(x + dodge, lo), (x + dodge, hi)], style)
            });
            chart.draw_series(bar_lines).map_err(|e| ctx.draw(e))?;
            let label = if segs.is_empty() {
                format!("{} (no data)", series.label)
            } else {
                series.label.clone()
            };
            // The legend entry hangs on the first drawn element, so an empty series still
            // gets one (with "no data") and the reader sees the run was considered.
            let first: &[(f64, f64)] = segs.first().map_or(&[], Vec::as_slice);
            chart
                .draw_series(LineSeries::new(first.iter().copied(), style))
                .map_err(|e| ctx.draw(e))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            for seg in segs.iter().skip(1) {
                chart
                    .draw_series(LineSeries::new(seg.iter().copied(), style))
                    .map_err(|e| ctx.draw(e))?;
            }
            // A lone point has no line to show it, so it always gets a dot.
            let dots = segs
                .iter()
                .filter(|s| plot.markers || s.len() == 1)
                .flatten()
                .map(|&p| Circle::new(p, 3, color.filled()));
            chart.draw_series(dots).map_err(|e| ctx.draw(e))?;
        }
        Ok(Some(plot.legend.to_plotters()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::testutil::assert_png;
    use r3_test_support::Scratch;

    fn series(label: &str, points: &[(f64, f64)]) -> Series {
        Series {
            label: label.to_string(),
            points: points.to_vec(),
        }
    }

    #[test]
    fn segments_break_at_unshowable_points() {
        let pts = [
            (1.0, 1.0),
            (2.0, f64::NAN),
            (3.0, 3.0),
            (4.0, 4.0),
            (5.0, 0.0),
        ];
        let lin = segments(&pts, Scale::Linear, Scale::Linear);
        assert_eq!(
            lin,
            vec![vec![(1.0, 1.0)], vec![(3.0, 3.0), (4.0, 4.0), (5.0, 0.0)]]
        );
        // On a log y axis the 0 at step 5 cannot be shown either.
        let log = segments(&pts, Scale::Linear, Scale::Log10);
        assert_eq!(log.len(), 2);
        assert_eq!(log[1].len(), 2);
        assert!((log[1][1].1 - 4f64.log10()).abs() < 1e-12);
    }

    #[test]
    fn steps_plot_with_several_runs_and_log_y() {
        let dir = Scratch::new("line_steps");
        let runs = [
            series(
                "R3",
                &[
                    (0.0, 1e-4),
                    (1.0, 2e-4),
                    (2.0, 1.5e-4),
                    (3.0, f64::NAN),
                    (4.0, 3e-4),
                ],
            ),
            series(
                "no replay",
                &[(0.0, 1e-3), (1.0, 5e-3), (2.0, 2e-2), (3.0, 0.1)],
            ),
            series("R2 (absent)", &[]),
        ];
        let mut plot = LinePlot::over_steps("k3 KL", "KL", &runs, Scale::Log10);
        plot.canvas = Canvas {
            width: 640,
            height: 400,
        };
        let path = dir.path().join("kl.png");
        line_plot(&plot, &path).unwrap();
        assert_png(&path, 640, 400);
    }

    #[test]
    fn log_log_curve_plot() {
        let dir = Scratch::new("line_loglog");
        let taus: Vec<f64> = (0..40).map(|i| 1.0 + 0.25 * f64::from(i)).collect();
        // F(τ) of a made-up heavy tail; F = 0 at large τ must be dropped, not crash.
        let curve = |scale: f64| Series {
            label: format!("scale {scale}"),
            points: taus
                .iter()
                .map(|&t| (t, if t > 8.0 { 0.0 } else { scale / (t * t) }))
                .collect(),
        };
        let data = [curve(0.1), curve(0.01)];
        let plot = LinePlot::log_log("F(τ)", "τ", "F(τ)", &data);
        let path = dir.path().join("ftau.png");
        line_plot(&plot, &path).unwrap();
        assert_png(&path, 900, 560);
    }

    #[test]
    fn empty_and_non_finite_data_are_a_no_data_error() {
        let dir = Scratch::new("line_empty");
        let path = dir.path().join("empty.png");
        let none: [Series; 0] = [];
        let err = line_plot(
            &LinePlot::over_steps("empty", "y", &none, Scale::Linear),
            &path,
        );
        assert!(matches!(err, Err(PlotError::NoData { .. })), "{err:?}");
        let nan = [series("nan", &[(0.0, f64::NAN), (f64::INFINITY, 1.0)])];
        let err = line_plot(
            &LinePlot::over_steps("nan", "y", &nan, Scale::Linear),
            &path,
        );
        assert!(matches!(err, Err(PlotError::NoData { .. })), "{err:?}");
        let zeros = [series("zero", &[(0.0, 0.0), (1.0, -1.0)])];
        let err = line_plot(
            &LinePlot::over_steps("zeros", "y", &zeros, Scale::Log10),
            &path,
        );
        let msg = err.map_err(|e| e.to_string()).unwrap_err();
        assert!(msg.contains("positive on the log axis"), "{msg}");
        assert!(!path.exists(), "no file is written for a plot without data");
    }

    #[test]
    fn bad_canvas_and_path_are_errors() {
        let dir = Scratch::new("line_bad");
        let data = [series("a", &[(0.0, 1.0), (1.0, 2.0)])];
        let mut plot = LinePlot::over_steps("tiny", "y", &data, Scale::Linear);
        plot.canvas = Canvas {
            width: 10,
            height: 400,
        };
        let err = line_plot(&plot, &dir.path().join("tiny.png"));
        assert!(
            matches!(err, Err(PlotError::BadCanvas { width: 10, .. })),
            "{err:?}"
        );
        plot.canvas = Canvas::default();
        let err = line_plot(&plot, &dir.path().join("plot.svg"));
        assert!(
            matches!(err, Err(PlotError::InvalidInput { .. })),
            "{err:?}"
        );
    }
}
