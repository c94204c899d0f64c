//! The report's figures: metrics over training steps with every run overlaid (paper Fig. 5:
//! k3 KL and F(τ=2); Fig. 6: response length, grad norm, entropy, eval score; plus reward).
//! Per-step curves are drawn raw and faint under their EMA line; eval accuracy as points
//! with ±1 standard-error bars.

use std::path::{Path, PathBuf};

use super::metrics::{keys, series};
use super::run::RunData;
use super::summary::CrashRule;
use super::ReportError;
use crate::plot::{line_plot, Canvas, LegendPosition, LinePlot, PlotError, Scale, Series};

/// One step-plot of the report.
#[derive(Debug, Clone, Copy)]
pub struct StepFigure {
    /// Metric key in metrics.jsonl (eval accuracy also reads eval.jsonl).
    pub key: &'static str,
    /// Caption.
    pub title: &'static str,
    /// y axis description.
    pub y_label: &'static str,
    /// y axis scale.
    pub y_scale: Scale,
    /// PNG file name.
    pub file: &'static str,
    /// Legend corner, chosen where the curves usually are not (rising metrics: bottom).
    pub legend: LegendPosition,
}

/// The figures, in page order.
pub const STEP_FIGURES: [StepFigure; 7] = [
    StepFigure {
        key: keys::K3_KL,
        title: "KL(rollout || training), k3 estimator, at the rollout temperature",
        y_label: "k3 KL",
        y_scale: Scale::Log10,
        file: "k3_kl.png",
        legend: LegendPosition::UpperLeft,
    },
    StepFigure {
        key: keys::F_TAU2,
        title: "Extreme-token fraction F(τ = 2)",
        y_label: "F(τ = 2)",
        y_scale: Scale::Log10,
        file: "f_tau2.png",
        legend: LegendPosition::UpperLeft,
    },
    StepFigure {
        key: keys::REWARD,
        title: "Mean reward",
        y_label: "reward",
        y_scale: Scale::Linear,
        file: "reward.png",
        legend: LegendPosition::LowerRight,
    },
    StepFigure {
        key: keys::EVAL_ACCURACY,
        title: "Eval accuracy (bars: ±1 s.e. over prompts)",
        y_label: "accuracy",
        y_scale: Scale::Linear,
        file: "eval_accuracy.png",
        legend: LegendPosition::LowerRight,
    },
    StepFigure {
        key: keys::GRAD_NORM,
        title: "Gradient norm",
        y_label: "grad norm",
        y_scale: Scale::Linear,
        file: "grad_norm.png",
        legend: LegendPosition::UpperRight,
    },
    StepFigure {
        key: keys::ENTROPY,
        title: "Policy entropy",
        y_label: "entropy (nats)",
        y_scale: Scale::Linear,
        file: "entropy.png",
        legend: LegendPosition::UpperRight,
    },
    StepFigure {
        key: keys::RESPONSE_LEN,
        title: "Mean response length",
        y_label: "tokens",
        y_scale: Scale::Linear,
        file: "response_len.png",
        legend: LegendPosition::LowerRight,
    },
];

/// A figure as the page shows it: a PNG, or why there is none.
#[derive(Debug, Clone)]
pub struct RenderedFigure {
    /// Caption.
    pub title: &'static str,
    /// The PNG, or `Err(reason)` when no run logged the metric.
    pub png: Result<PathBuf, String>,
}

fn to_points(s: &[(u64, f64)]) -> Vec<(f64, f64)> {
    s.iter().map(|&(step, v)| (step as f64, v)).collect()
}

/// One series per run for `figure`; the KL plot also shows the crash threshold as a line
/// across the logged steps, so the reader sees how close each run came.
fn figure_series(figure: &StepFigure, runs: &[RunData], rule: &CrashRule) -> Vec<Series> {
    let mut out: Vec<Series> = runs
        .iter()
        .map(|run| {
            let points = if figure.key == keys::EVAL_ACCURACY {
                to_points(&run.eval)
            } else {
                to_points(&series(&run.rows, figure.key))
            };
            Series {
                label: run.label(),
                points,
            }
        })
        .collect();
    let has_data = out.iter().any(|s| s.points.iter().any(|p| p.1.is_finite()));
    if figure.key == keys::K3_KL && has_data {
        let steps = runs
            .iter()
            .flat_map(|r| r.rows.iter().map(|row| row.step as f64));
        let (lo, hi) = steps.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), s| {
            (lo.min(s), hi.max(s))
        });
        out.push(Series {
            label: format!("crash threshold {:e}", rule.kl_threshold),
            points: vec![(lo, rule.kl_threshold), (hi, rule.kl_threshold)],
        });
    }
    out
}

/// ±1 standard error per eval point of each run (NaN where eval.jsonl states none), in the
/// order of `run.eval`.
fn eval_errors(runs: &[RunData]) -> Vec<Vec<f64>> {
    runs.iter()
        .map(|run| {
            run.eval
                .iter()
                .map(|(step, _)| {
                    run.eval_stderr
                        .iter()
                        .find(|(s, _)| s == step)
                        .map_or(f64::NAN, |&(_, e)| e)
                })
                .collect()
        })
        .collect()
}

/// Renders every figure of `STEP_FIGURES` into `out_dir`. A metric no run logged becomes a
/// "no data" entry; any other plotting failure is an error.
pub fn render_figures(
    runs: &[RunData],
    rule: &CrashRule,
    out_dir: &Path,
    canvas: Canvas,
    smoothing: f64,
) -> Result<Vec<RenderedFigure>, ReportError> {
    STEP_FIGURES
        .iter()
        .map(|figure| {
            let data = figure_series(figure, runs, rule);
            let is_eval = figure.key == keys::EVAL_ACCURACY;
            let errors = if is_eval {
                eval_errors(runs)
            } else {
                Vec::new()
            };
            let mut plot =
                LinePlot::over_steps(figure.title, figure.y_label, &data, figure.y_scale);
            plot.canvas = canvas;
            plot.markers = is_eval;
            plot.legend = figure.legend;
            // Eval points are few and each is an estimate with its own error bar: no EMA.
            plot.smoothing = (!is_eval && smoothing > 0.0).then_some(smoothing);
            plot.errors = &errors;
            let path = out_dir.join(figure.file);
            let png = match line_plot(&plot, &path) {
                Ok(()) => Ok(path),
                Err(PlotError::NoData { detail, .. }) => {
                    Err(format!("no run logged {} ({detail})", figure.key))
                }
                Err(e) => return Err(e.into()),
            };
            Ok(RenderedFigure {
                title: figure.title,
                png,
            })
        })
        .collect()
}
