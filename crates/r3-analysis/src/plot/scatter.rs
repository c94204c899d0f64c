//! Scatter plots of one probability against another (training engine vs rollout engine,
//! paper Fig. 2a–c and Fig. 4), with the y = x diagonal that perfect agreement would give.
//! Points are drawn translucent so that 10^5 of them still show where the mass lies.

use std::path::Path;

use plotters::prelude::*;

use super::axis::{Axis, Scale};
use super::frame::{draw_framed, Frame};
use super::line::bounds;
use super::style::series_color;
use super::{Canvas, PlotError};

/// A scatter plot and its data.
#[derive(Debug, Clone, Copy)]
pub struct ScatterPlot<'a> {
    /// Caption.
    pub title: &'a str,
    /// x axis description (e.g. "rollout probability").
    pub x_label: &'a str,
    /// y axis description (e.g. "training probability").
    pub y_label: &'a str,
    /// The `(x, y)` points; non-finite ones and ones outside `range` are left out.
    pub points: &'a [(f64, f64)],
    /// Draw the y = x line.
    pub diagonal: bool,
    /// Range of both axes; `None` fits the data. Probabilities use `Some((0.0, 1.0))`.
    pub range: Option<(f64, f64)>,
    /// PNG size.
    pub canvas: Canvas,
}

impl<'a> ScatterPlot<'a> {
    /// Probability against probability: both axes 0..1, diagonal on, square canvas.
    pub fn probabilities(
        title: &'a str,
        x_label: &'a str,
        y_label: &'a str,
        points: &'a [(f64, f64)],
    ) -> Self {
        Self {
            title,
            x_label,
            y_label,
            points,
            diagonal: true,
            range: Some((0.0, 1.0)),
            canvas: Canvas {
                width: 700,
                height: 700,
            },
        }
    }
}

/// Draws `plot` as a PNG at `path`.
pub fn scatter_plot(plot: &ScatterPlot<'_>, path: &Path) -> Result<(), PlotError> {
    if let Some((lo, hi)) = plot.range {
        if !(lo.is_finite() && hi.is_finite() && lo < hi) {
            return Err(PlotError::InvalidInput {
                plot: plot.title.to_string(),
                what: format!("axis range {lo}..{hi} is not an increasing finite range"),
            });
        }
    }
    let inside = |v: f64| v.is_finite() && plot.range.is_none_or(|(lo, hi)| (lo..=hi).contains(&v));
    let shown: Vec<(f64, f64)> = plot
        .points
        .iter()
        .copied()
        .filter(|&(x, y)| inside(x) && inside(y))
        .collect();
    let Some((lo, hi)) = bounds(shown.iter().flat_map(|&(x, y)| [x, y])) else {
        return Err(PlotError::NoData {
            plot: plot.title.to_string(),
            detail: format!(
                "{} points, none finite and inside the axis range",
                plot.points.len()
            ),
        });
    };
    let axis = match plot.range {
        Some((lo, hi)) => Axis::linear_exact(lo, hi),
        None => Axis::covering(Scale::Linear, lo, hi),
    };
    let frame = Frame {
        title: plot.title,
        x_label: plot.x_label,
        y_label: plot.y_label,
        x: axis.clone(),
        y: axis.clone(),
        x_tick_label: None,
        canvas: plot.canvas,
    };
    // Dense clouds saturate unless each point is fainter the more points there are.
    let alpha = (2000.0 / shown.len() as f64).clamp(0.08, 0.6);
    draw_framed(path, &frame, |chart, ctx| {
        let color = series_color(0);
        let dot = color.mix(alpha).filled();
        chart
            .draw_series(shown.iter().map(|&p| Circle::new(p, 1, dot)))
            .map_err(|e| ctx.draw(e))?
            .label(format!("tokens (n = {})", shown.len()))
            .legend(move |(x, y)| Circle::new((x + 10, y), 3, color.filled()));
        if plot.diagonal {
            let (a, b) = (axis.range.start, axis.range.end);
            let line = BLACK.mix(0.6).stroke_width(1);
            chart
                .draw_series(LineSeries::new([(a, a), (b, b)], line))
                .map_err(|e| ctx.draw(e))?
                .label("y = x")
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], line));
        }
        Ok(Some(SeriesLabelPosition::UpperLeft))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::testutil::assert_png;
    use r3_test_support::Scratch;

    /// Deterministic pseudo-random numbers in [0, 1) (a 64-bit LCG; no rand dependency needed).
    fn lcg(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 11) as f64 / (1u64 << 53) as f64
            })
            .collect()
    }

    #[test]
    fn hundred_thousand_probability_pairs() {
        let dir = Scratch::new("scatter_big");
        let xs = lcg(100_000, 1);
        let noise = lcg(100_000, 2);
        let points: Vec<(f64, f64)> = xs
            .iter()
            .zip(&noise)
            .map(|(&p, &n)| (p, (p * (1.0 + 0.2 * (n - 0.5))).min(1.0)))
            .collect();
        let plot = ScatterPlot::probabilities("train vs rollout", "rollout p", "train p", &points);
        let path = dir.path().join("scatter.png");
        scatter_plot(&plot, &path).unwrap();
        assert_png(&path, 700, 700);
    }

    #[test]
    fn fitted_range_and_out_of_range_points() {
        let dir = Scratch::new("scatter_fit");
        let points = [(0.5, 0.4), (f64::NAN, 0.2), (2.0, 3.0), (-1.0, 0.1)];
        let mut plot = ScatterPlot::probabilities("fit", "x", "y", &points);
        plot.range = None;
        plot.canvas = Canvas {
            width: 300,
            height: 200,
        };
        let path = dir.path().join("fit.png");
        scatter_plot(&plot, &path).unwrap();
        assert_png(&path, 300, 200);
    }

    #[test]
    fn nothing_inside_the_range_is_no_data() {
        let dir = Scratch::new("scatter_empty");
        let points = [(1.5, 0.5), (f64::NAN, f64::NAN)];
        let plot = ScatterPlot::probabilities("out", "x", "y", &points);
        let err = scatter_plot(&plot, &dir.path().join("out.png"));
        assert!(matches!(err, Err(PlotError::NoData { .. })), "{err:?}");
        let empty = ScatterPlot::probabilities("empty", "x", "y", &[]);
        let err = scatter_plot(&empty, &dir.path().join("empty.png"));
        assert!(matches!(err, Err(PlotError::NoData { .. })), "{err:?}");
        let mut bad = ScatterPlot::probabilities("bad range", "x", "y", &points);
        bad.range = Some((1.0, 1.0));
        let err = scatter_plot(&bad, &dir.path().join("bad.png"));
        assert!(
            matches!(err, Err(PlotError::InvalidInput { .. })),
            "{err:?}"
        );
    }
}
