//! Histograms over a continuous x axis from already-binned data (bin edges + counts), e.g.
//! the per-sequence mean routing divergence of paper Fig. 3c. Binning belongs to the
//! statistics code (r3-routing); this module only draws.

use std::path::Path;

use plotters::prelude::*;

use super::axis::{Axis, Scale};
use super::bars::value_axis;
use super::frame::{draw_framed, Frame};
use super::line::bounds;
use super::style::series_color;
use super::{Canvas, PlotError};

/// A histogram and its bins.
#[derive(Debug, Clone, Copy)]
pub struct HistogramPlot<'a> {
    /// Caption.
    pub title: &'a str,
    /// x axis description.
    pub x_label: &'a str,
    /// y axis description (count, fraction, ...).
    pub y_label: &'a str,
    /// Bin edges: finite, strictly increasing, one more than `counts`.
    pub edges: &'a [f64],
    /// Height of each bin; a non-finite height leaves the bin empty.
    pub counts: &'a [f64],
    /// y axis scale.
    pub y_scale: Scale,
    /// PNG size.
    pub canvas: Canvas,
}

/// Checks edges against counts; returns what is wrong.
fn check_bins(edges: &[f64], counts: &[f64]) -> Result<(), String> {
    if edges.len() != counts.len() + 1 {
        return Err(format!(
            "{} bin edges for {} counts (need one more edge than counts)",
            edges.len(),
            counts.len()
        ));
    }
    if let Some(i) = edges.iter().position(|e| !e.is_finite()) {
        return Err(format!("bin edge {i} is {}", edges[i]));
    }
    if let Some(i) = edges.windows(2).position(|w| w[1] <= w[0]) {
        return Err(format!(
            "bin edges must increase: edge {} = {} then edge {} = {}",
            i,
            edges[i],
            i + 1,
            edges[i + 1]
        ));
    }
    Ok(())
}

/// Draws `plot` as a PNG at `path`.
pub fn histogram_plot(plot: &HistogramPlot<'_>, path: &Path) -> Result<(), PlotError> {
    check_bins(plot.edges, plot.counts).map_err(|what| PlotError::InvalidInput {
        plot: plot.title.to_string(),
        what,
    })?;
    let shown = plot.counts.iter().filter_map(|&c| plot.y_scale.to_plot(c));
    let (Some((y_lo, y_hi)), [first, .., last]) = (bounds(shown), plot.edges) else {
        return Err(PlotError::NoData {
            plot: plot.title.to_string(),
            detail: format!("{} bins, no height that can be shown", plot.counts.len()),
        });
    };
    let y = value_axis(plot.y_scale, y_lo, y_hi);
    let base = match plot.y_scale {
        Scale::Log10 => y.range.start,
        Scale::Linear => 0.0,
    };
    let frame = Frame {
        title: plot.title,
        x_label: plot.x_label,
        y_label: plot.y_label,
        x: Axis::linear_exact(*first, *last),
        y,
        x_tick_label: None,
        canvas: plot.canvas,
    };
    draw_framed(path, &frame, |chart, ctx| {
        let fill = series_color(0).mix(0.75).filled();
        let outline = series_color(0).stroke_width(1);
        let bins = plot.edges.windows(2).zip(plot.counts);
        let rects: Vec<[(f64, f64); 2]> = bins
            .filter_map(|(e, &c)| Some([(e[0], base), (e[1], plot.y_scale.to_plot(c)?)]))
            .collect();
        chart
            .draw_series(rects.iter().map(|r| Rectangle::new(*r, fill)))
            .map_err(|e| ctx.draw(e))?;
        chart
            .draw_series(rects.iter().map(|r| Rectangle::new(*r, outline)))
            .map_err(|e| ctx.draw(e))?;
        Ok(None)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::testutil::assert_png;
    use r3_test_support::Scratch;

    #[test]
    fn bins_are_checked() {
        assert!(check_bins(&[0.0, 1.0, 2.0], &[3.0, 4.0]).is_ok());
        let e = check_bins(&[0.0, 1.0], &[3.0, 4.0]).unwrap_err();
        assert!(e.contains("2 bin edges for 2 counts"), "{e}");
        let e = check_bins(&[0.0, 2.0, 1.0], &[3.0, 4.0]).unwrap_err();
        assert!(e.contains("edge 1 = 2 then edge 2 = 1"), "{e}");
        let e = check_bins(&[0.0, f64::NAN, 1.0], &[3.0, 4.0]).unwrap_err();
        assert!(e.contains("bin edge 1 is NaN"), "{e}");
    }

    #[test]
    fn divergence_histogram_linear_and_log() {
        let dir = Scratch::new("hist");
        let edges: Vec<f64> = (0..=24).map(|i| f64::from(i) * 0.5).collect();
        // A bump around 6 routers per token, like paper Fig. 3c, with one empty bin.
        let counts: Vec<f64> = (0..24)
            .map(|i| {
                let c = f64::from(i) * 0.5 + 0.25 - 6.0;
                if i == 3 {
                    0.0
                } else {
                    1000.0 * (-c * c / 4.0).exp()
                }
            })
            .collect();
        for (name, scale) in [("lin", Scale::Linear), ("log", Scale::Log10)] {
            let plot = HistogramPlot {
                title: "mean routers differing per token, per sequence",
                x_label: "routers",
                y_label: "sequences",
                edges: &edges,
                counts: &counts,
                y_scale: scale,
                canvas: Canvas {
                    width: 600,
                    height: 400,
                },
            };
            let path = dir.path().join(format!("{name}.png"));
            histogram_plot(&plot, &path).unwrap();
            assert_png(&path, 600, 400);
        }
    }

    #[test]
    fn empty_and_nan_bins_are_no_data() {
        let dir = Scratch::new("hist_empty");
        let mut plot = HistogramPlot {
            title: "empty",
            x_label: "x",
            y_label: "y",
            edges: &[0.0],
            counts: &[],
            y_scale: Scale::Linear,
            canvas: Canvas::default(),
        };
        let err = histogram_plot(&plot, &dir.path().join("a.png"));
        assert!(matches!(err, Err(PlotError::NoData { .. })), "{err:?}");
        plot.edges = &[0.0, 1.0];
        plot.counts = &[f64::NAN];
        let err = histogram_plot(&plot, &dir.path().join("b.png"));
        assert!(matches!(err, Err(PlotError::NoData { .. })), "{err:?}");
    }
}
