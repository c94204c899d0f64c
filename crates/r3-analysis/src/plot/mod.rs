//! PNG plot primitives for `r3 report` and `r3 analyze`: line plots over steps (several runs
//! overlaid, optional log axes, raw curves drawn faint under an EMA line, error bars), probability scatter plots with the y = x diagonal, histograms,
//! bar and grouped-bar plots.
//!
//! Each primitive takes plain data and an output path and returns `Result`. Non-finite values
//! (and non-positive ones on a log axis) are left out of a plot; a plot left with nothing to draw
//! is a [`PlotError::NoData`], never a panic. Text uses the DejaVu Sans font shipped in
//! `assets/`, so plots look the same on machines without system fonts.

mod axis;
mod bars;
mod font;
mod frame;
mod histogram;
mod line;
mod scatter;
mod smooth;
mod style;
#[cfg(test)]
pub(crate) mod testutil;

pub use axis::Scale;
pub use bars::{bar_plot, grouped_bar_plot, BarPlot, GroupedBarPlot};
pub use histogram::{histogram_plot, HistogramPlot};
pub use line::LegendPosition;
pub use line::{line_plot, LinePlot, Series};
pub use scatter::{scatter_plot, ScatterPlot};
pub use smooth::ema;

/// Smallest accepted canvas side in pixels: below it labels and legend no longer fit.
pub const MIN_SIDE: u32 = 200;
/// Largest accepted canvas side in pixels (keeps a typo from allocating gigabytes).
pub const MAX_SIDE: u32 = 8192;

/// Size of the PNG to write, in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Canvas {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
}

impl Default for Canvas {
    fn default() -> Self {
        Self {
            width: 900,
            height: 560,
        }
    }
}

impl Canvas {
    /// Checks that both sides lie in `MIN_SIDE..=MAX_SIDE`.
    fn validate(self, plot: &str) -> Result<(), PlotError> {
        let ok = |s: u32| (MIN_SIDE..=MAX_SIDE).contains(&s);
        if ok(self.width) && ok(self.height) {
            Ok(())
        } else {
            Err(PlotError::BadCanvas {
                plot: plot.to_string(),
                width: self.width,
                height: self.height,
            })
        }
    }
}

/// Why a plot could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// Nothing finite (and positive, on a log axis) was left to draw.
    #[error("plot {plot:?}: no data to draw ({detail})")]
    NoData {
        /// Title of the plot.
        plot: String,
        /// What was empty, e.g. "3 series, all points non-finite".
        detail: String,
    },
    /// The requested canvas is too small or too large.
    #[error(
        "plot {plot:?}: canvas {width}x{height} px is outside {MIN_SIDE}..={MAX_SIDE} px per side"
    )]
    BadCanvas {
        /// Title of the plot.
        plot: String,
        /// Requested width.
        width: u32,
        /// Requested height.
        height: u32,
    },
    /// The data are inconsistent (lengths differ, bin edges not increasing, ...).
    #[error("plot {plot:?}: {what}")]
    InvalidInput {
        /// Title of the plot.
        plot: String,
        /// What is wrong.
        what: String,
    },
    /// The bundled font could not be loaded (a corrupt build, never user input).
    #[error("bundled font DejaVuSans.ttf could not be loaded")]
    Font,
    /// plotters failed while drawing or writing the PNG.
    #[error("plot {plot:?}: drawing {path}: {message}")]
    Draw {
        /// Title of the plot.
        plot: String,
        /// Output path.
        path: String,
        /// The backend's message.
        message: String,
    },
}
