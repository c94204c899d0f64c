//! The frame every plot shares: canvas, caption, axes with their ticks and labels, and the
//! legend box. A primitive computes its axes, then draws its data inside [`draw_framed`].

use std::fmt::Display;
use std::path::Path;

use std::ops::Range;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::prelude::*;

use super::axis::Axis;
use super::font::{self, FAMILY};
use super::style::{CAPTION_SIZE, LABEL_SIZE, TICK_SIZE};
use super::{Canvas, PlotError};

/// plotters' view of an [`Axis`]: linear over its range, tick marks exactly at its ticks
/// (plotters' own f64 coordinate picks its ticks itself and cannot take ours).
pub struct AxisCoord {
    range: Range<f64>,
    ticks: Vec<f64>,
}

impl AxisCoord {
    fn new(axis: &Axis) -> Self {
        Self {
            range: axis.range.clone(),
            ticks: axis.ticks.clone(),
        }
    }
}

impl Ranged for AxisCoord {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let span = self.range.end - self.range.start;
        if span == 0.0 {
            return limit.0 + (limit.1 - limit.0) / 2;
        }
        let frac = (value - self.range.start) / span;
        let pixel = f64::from(limit.0) + f64::from(limit.1 - limit.0) * frac;
        // Far-off-range values still map to a finite pixel; the backend clips them.
        pixel.round().clamp(-1e6, 1e6) as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        // Only bold grid lines, at our ticks; no light lines between them.
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> Range<f64> {
        self.range.clone()
    }
}

/// Plot coordinates: linear f64 on both axes, with ticks chosen by [`Axis`].
pub type Coord = Cartesian2d<AxisCoord, AxisCoord>;
/// The chart a primitive draws its data on.
pub type Chart<'a, 'b> = ChartContext<'a, BitMapBackend<'b>, Coord>;

/// What the frame shows around the data.
pub struct Frame<'s> {
    /// Caption above the plot.
    pub title: &'s str,
    /// Description under the x axis.
    pub x_label: &'s str,
    /// Description beside the y axis.
    pub y_label: &'s str,
    /// The x axis.
    pub x: Axis,
    /// The y axis.
    pub y: Axis,
    /// Overrides the x tick labels (bar plots label ticks with category names).
    pub x_tick_label: Option<&'s dyn Fn(f64) -> String>,
    /// PNG size.
    pub canvas: Canvas,
}

/// Names the plot and file in drawing errors.
pub struct ErrCtx {
    plot: String,
    path: String,
}

impl ErrCtx {
    /// Context for plot `plot` written to `path`.
    pub fn new(plot: &str, path: &Path) -> Self {
        Self {
            plot: plot.to_string(),
            path: path.display().to_string(),
        }
    }

    /// Wraps a plotters error.
    pub fn draw<E: Display>(&self, e: E) -> PlotError {
        PlotError::Draw {
            plot: self.plot.clone(),
            path: self.path.clone(),
            message: e.to_string(),
        }
    }
}

/// Checks the output path is one plotters can write as PNG.
fn check_png_path(title: &str, path: &Path) -> Result<(), PlotError> {
    let is_png = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    if is_png {
        Ok(())
    } else {
        Err(PlotError::InvalidInput {
            plot: title.to_string(),
            what: format!("output path {} does not end in .png", path.display()),
        })
    }
}

/// Draws the frame into a new PNG at `path`, lets `draw` add the data, draws the legend
/// where `draw` asks for one (`Some(position)`), and writes the file.
pub fn draw_framed(
    path: &Path,
    frame: &Frame<'_>,
    draw: impl FnOnce(&mut Chart<'_, '_>, &ErrCtx) -> Result<Option<SeriesLabelPosition>, PlotError>,
) -> Result<(), PlotError> {
    font::ensure_registered()?;
    frame.canvas.validate(frame.title)?;
    check_png_path(frame.title, path)?;
    let ctx = ErrCtx::new(frame.title, path);
    let root =
        BitMapBackend::new(path, (frame.canvas.width, frame.canvas.height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| ctx.draw(e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(frame.title, (FAMILY, CAPTION_SIZE))
        .margin(14)
        .x_label_area_size(50)
        .y_label_area_size(78)
        .build_cartesian_2d(AxisCoord::new(&frame.x), AxisCoord::new(&frame.y))
        .map_err(|e| ctx.draw(e))?;
    let x_default = |t: &f64| frame.x.label(*t);
    let x_custom = |t: &f64| frame.x_tick_label.map_or_else(String::new, |f| f(*t));
    let x_fmt: &dyn Fn(&f64) -> String = if frame.x_tick_label.is_some() {
        &x_custom
    } else {
        &x_default
    };
    let y_fmt = |t: &f64| frame.y.label(*t);
    chart
        .configure_mesh()
        .x_desc(frame.x_label)
        .y_desc(frame.y_label)
        .x_label_formatter(x_fmt)
        .y_label_formatter(&y_fmt)
        .label_style((FAMILY, TICK_SIZE))
        .axis_desc_style((FAMILY, LABEL_SIZE))
        .bold_line_style(BLACK.mix(0.12))
        .draw()
        .map_err(|e| ctx.draw(e))?;
    if let Some(position) = draw(&mut chart, &ctx)? {
        chart
            .configure_series_labels()
            .position(position)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.5))
            .label_font((FAMILY, LABEL_SIZE))
            .draw()
            .map_err(|e| ctx.draw(e))?;
    }
    root.present().map_err(|e| ctx.draw(e))?;
    Ok(())
}
