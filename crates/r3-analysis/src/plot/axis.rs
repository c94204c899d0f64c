//! Axis ranges, tick positions and tick labels.
//!
//! Every plot is drawn on linear plotters coordinates; a log axis is drawn by plotting
//! `log10(value)` and labelling ticks with the original value. One coordinate type for all
//! plots keeps the drawing code free of per-scale generics. Linear ticks are plotters' own
//! f64 key points (1-2-5 steps).
//!
//! Log ticks stay our own (decades, with 2× and 5× on axes of at most two decades), because
//! plotters 0.3.7's `LogCoord` key points, measured over the whole-decade axes these plots
//! use (start 1e-20 to 1e4, 1 to 6 decades, 10 points asked), miss the tick at the axis start
//! on 84 of 150 axes (`ln(1e-3) / ln(10)` is −2.9999999999999996, which rounds up to −2),
//! return a single tick on some one-decade axes (`1e-3..1e-2` gives only `1e-2`), and on
//! others eleven ticks at 1×..9× with the end decade twice and values such as
//! `3.0000000000000004e-8` to label.

use std::ops::Range;

use plotters::coord::ranged1d::Ranged;
use plotters::coord::types::RangedCoordf64;

/// How values map onto an axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scale {
    /// Values as they are.
    #[default]
    Linear,
    /// Base-10 logarithm; values `<= 0` cannot be shown and are left out.
    Log10,
}

impl Scale {
    /// Maps a data value to plot coordinates; `None` if it cannot be shown on this scale.
    pub fn to_plot(self, v: f64) -> Option<f64> {
        match self {
            Scale::Linear => v.is_finite().then_some(v),
            Scale::Log10 => (v.is_finite() && v > 0.0).then(|| v.log10()),
        }
    }
}

/// A finished axis: its range and ticks in plot coordinates.
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    /// How data values were mapped.
    pub scale: Scale,
    /// Visible range in plot coordinates.
    pub range: Range<f64>,
    /// Tick positions in plot coordinates, increasing, all inside `range`.
    pub ticks: Vec<f64>,
}

/// Most ticks on a linear axis.
const LINEAR_TICKS: usize = 10;
/// Most decade ticks on a log axis before every other decade is skipped.
const MAX_DECADE_TICKS: usize = 10;

impl Axis {
    /// An axis covering the plot coordinates `lo..=hi` (already mapped by `scale`), padded so
    /// that points do not sit on the frame. Callers guarantee `lo` and `hi` are finite.
    pub fn covering(scale: Scale, lo: f64, hi: f64) -> Self {
        let (lo, hi) = if lo <= hi { (lo, hi) } else { (hi, lo) };
        match scale {
            Scale::Linear => {
                let (lo, hi) = if hi > lo {
                    let pad = 0.05 * (hi - lo);
                    (lo - pad, hi + pad)
                } else {
                    let pad = (lo.abs() * 0.1).max(1.0);
                    (lo - pad, hi + pad)
                };
                Self::linear_exact(lo, hi)
            }
            Scale::Log10 => {
                let (mut lo, mut hi) = (lo.floor(), hi.ceil());
                if hi <= lo {
                    lo -= 0.5;
                    hi += 0.5;
                }
                let ticks = log_ticks(lo, hi);
                Self {
                    scale,
                    range: lo..hi,
                    ticks,
                }
            }
        }
    }

    /// A linear axis over exactly `lo..hi` (no padding), with 1-2-5 ticks.
    pub fn linear_exact(lo: f64, hi: f64) -> Self {
        Self {
            scale: Scale::Linear,
            range: lo..hi,
            ticks: nice_ticks(lo, hi),
        }
    }

    /// Tick label for plot coordinate `t`.
    pub fn label(&self, t: f64) -> String {
        match self.scale {
            Scale::Linear => format_linear(t, self.tick_step()),
            Scale::Log10 => format_decade(t),
        }
    }

    fn tick_step(&self) -> f64 {
        match self.ticks.as_slice() {
            [a, b, ..] => b - a,
            _ => (self.range.end - self.range.start).abs(),
        }
    }
}

/// Decade ticks inside `lo..=hi` (plot coordinates), thinned to at most `MAX_DECADE_TICKS`;
/// an axis spanning at most two decades also gets ticks at 2× and 5× each decade.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let first = lo.ceil() as i64;
    let last = hi.floor() as i64;
    let count = usize::try_from(last - first + 1).unwrap_or(0);
    if hi - lo > 2.0 {
        let stride = count.div_ceil(MAX_DECADE_TICKS).max(1);
        return (first..=last).step_by(stride).map(|d| d as f64).collect();
    }
    let inside = |t: &f64| (lo - 1e-12..=hi + 1e-12).contains(t);
    (first - 1..=last)
        .flat_map(|d| [1.0f64, 2.0, 5.0].map(|m| d as f64 + m.log10()))
        .filter(inside)
        .collect()
}

/// Ticks at multiples of a 1-2-5 step inside `lo..=hi`, at most `LINEAR_TICKS` of them:
/// plotters' own f64 key points. A range that is not finite gets the one tick `lo`.
pub fn nice_ticks(lo: f64, hi: f64) -> Vec<f64> {
    if !(lo.is_finite() && hi.is_finite()) {
        return vec![lo];
    }
    RangedCoordf64::from(lo..hi).key_points(LINEAR_TICKS)
}

/// Formats a linear tick with as many decimals as its step needs.
fn format_linear(v: f64, step: f64) -> String {
    let v = if v.abs() < step * 1e-9 { 0.0 } else { v };
    let big = v.abs() >= 1e5;
    let tiny = step > 0.0 && step < 1e-3;
    if big || tiny {
        return format!("{v:.1e}");
    }
    let decimals = if step > 0.0 && step < 1.0 {
        (-step.log10().floor()) as usize
    } else {
        0
    };
    format!("{v:.decimals$}")
}

/// Formats a log-axis tick `t` (plot coordinate) as the value it stands for: plain decimals
/// from 0.01 to 1000, `2e-5` style outside.
fn format_decade(t: f64) -> String {
    // Exponent from `t` itself (with slack), so 10^-3 computed as 0.000999… still reads 1e-3.
    let exponent = (t + 1e-9).floor() as i32;
    let mantissa = 10f64.powf(t - f64::from(exponent)).round();
    let v = mantissa * 10f64.powi(exponent);
    if (-2..=3).contains(&exponent) {
        let decimals = usize::try_from(-exponent).unwrap_or(0);
        format!("{v:.decimals$}")
    } else {
        format!("{mantissa}e{exponent}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_ticks_use_one_two_five_steps() {
        // span 10 / 6 = 1.67 -> step 2 -> 0, 2, 4, 6, 8, 10
        assert_eq!(nice_ticks(0.0, 10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        // span 0.5 / 6 = 0.083 -> magnitude 0.01, n = 8.3 -> step 0.1
        let t = nice_ticks(0.25, 0.75);
        assert_eq!(t.len(), 5);
        for (got, want) in t.iter().zip([0.3, 0.4, 0.5, 0.6, 0.7]) {
            assert!((got - want).abs() < 1e-12, "{got} vs {want}");
        }
        // span 300 / 6 = 50 -> magnitude 10, n = 5 -> step 50
        assert_eq!(
            nice_ticks(-10.0, 290.0),
            vec![0.0, 50.0, 100.0, 150.0, 200.0, 250.0]
        );
    }

    #[test]
    fn degenerate_range_gets_a_single_tick() {
        assert_eq!(nice_ticks(3.0, 3.0), vec![3.0]);
    }

    #[test]
    fn log_axis_spans_whole_decades() {
        // 2e-4 .. 3e-2 -> log10 -3.7 .. -1.52 -> decades -4 ..= -1
        let a = Axis::covering(Scale::Log10, 2e-4f64.log10(), 3e-2f64.log10());
        assert_eq!(a.range, -4.0..-1.0);
        assert_eq!(a.ticks, vec![-4.0, -3.0, -2.0, -1.0]);
        assert_eq!(a.label(-3.0), "1e-3");
        assert_eq!(a.label(0.0), "1");
        assert_eq!(a.label(-1.0), "0.1");
        assert_eq!(a.label(3.0), "1000");
        assert_eq!(a.label(4.0), "1e4");
        assert_eq!(a.label(5f64.log10() - 5.0), "5e-5");
        assert_eq!(a.label(2f64.log10() - 2.0), "0.02");
    }

    #[test]
    fn narrow_log_axis_gets_two_and_five_ticks() {
        // 1 .. 10 (log 0 .. 1): 1, 2, 5, 10
        let a = Axis::covering(Scale::Log10, 0.0, 0.9);
        let values: Vec<String> = a.ticks.iter().map(|&t| a.label(t)).collect();
        assert_eq!(values, ["1", "2", "5", "10"]);
    }

    #[test]
    fn log_axis_thins_many_decades() {
        // 25 decades -> stride ceil(26 / 10) = 3
        let a = Axis::covering(Scale::Log10, -20.0, 5.0);
        assert_eq!(a.ticks.first(), Some(&-20.0));
        assert_eq!(a.ticks.get(1), Some(&-17.0));
        assert!(a.ticks.len() <= MAX_DECADE_TICKS);
    }

    #[test]
    fn single_value_axes_are_widened() {
        let lin = Axis::covering(Scale::Linear, 5.0, 5.0);
        assert_eq!(lin.range, 4.0..6.0);
        let log = Axis::covering(Scale::Log10, -3.0, -3.0);
        assert_eq!(log.range, -3.5..-2.5);
        let labels: Vec<String> = log.ticks.iter().map(|&t| log.label(t)).collect();
        assert_eq!(labels, ["5e-4", "1e-3", "2e-3"]);
    }

    #[test]
    fn scale_rejects_what_it_cannot_show() {
        assert_eq!(Scale::Log10.to_plot(0.0), None);
        assert_eq!(Scale::Log10.to_plot(-1.0), None);
        assert_eq!(Scale::Linear.to_plot(f64::NAN), None);
        assert_eq!(Scale::Log10.to_plot(100.0), Some(2.0));
    }

    #[test]
    fn linear_labels_follow_the_step() {
        assert_eq!(format_linear(0.30000000000000004, 0.1), "0.3");
        assert_eq!(format_linear(150.0, 50.0), "150");
        assert_eq!(format_linear(2e-4, 1e-4), "2.0e-4");
        assert_eq!(format_linear(1e-17, 0.1), "0.0");
    }
}
