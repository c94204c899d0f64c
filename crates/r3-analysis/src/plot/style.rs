//! Colours and text sizes shared by all plots.

use plotters::style::RGBColor;

/// Series colours (Okabe–Ito, readable by colour-blind readers), cycled by series index.
const PALETTE: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(240, 228, 66),
];

/// Colour of the `i`-th series.
pub fn series_color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// Caption text height in pixels.
pub const CAPTION_SIZE: u32 = 22;
/// Axis description and legend text height in pixels.
pub const LABEL_SIZE: u32 = 16;
/// Tick label text height in pixels.
pub const TICK_SIZE: u32 = 13;
/// Line width of plotted series.
pub const LINE_WIDTH: u32 = 2;
