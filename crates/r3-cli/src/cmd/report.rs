//! `r3 report RUN_DIR... [--out DIR]`: plots of metrics over training steps for several runs
//! overlaid (raw and faint under an EMA line, eval accuracy with error bars), a summary per
//! run with the crash step, each run's final evaluation against the first run's (paired
//! difference, 95% interval), one self-contained HTML page and a results table (Markdown +
//! JSON).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use r3_analysis::plot::Canvas;
use r3_analysis::report::{
    build_report, CrashRule, ReportOptions, DEFAULT_KL_THRESHOLD, DEFAULT_SMOOTHING,
};

/// Options of `r3 report`.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Run directories, each with metrics.jsonl (and optionally config.toml, eval.jsonl).
    #[arg(required = true, value_name = "RUN_DIR")]
    pub runs: Vec<PathBuf>,
    /// Output directory for report.html, the PNGs and results.{md,json}.
    #[arg(long, default_value = "report")]
    pub out: PathBuf,
    /// A step whose mismatch.k3_kl exceeds this counts as a crash.
    #[arg(long, default_value_t = DEFAULT_KL_THRESHOLD)]
    pub kl_threshold: f64,
    /// Width of each plot in pixels.
    #[arg(long, default_value_t = Canvas::default().width)]
    pub width: u32,
    /// Height of each plot in pixels.
    #[arg(long, default_value_t = Canvas::default().height)]
    pub height: u32,
    /// EMA weight of the per-step curves, in [0, 1): each is drawn raw and faint under its
    /// debiased exponential moving average (0.9 ≈ a 10-step window; 0 = raw only).
    #[arg(long, default_value_t = DEFAULT_SMOOTHING)]
    pub smoothing: f64,
}

/// Builds the report and prints the page's path on stdout.
pub fn run(args: ReportArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.kl_threshold.is_finite() && args.kl_threshold > 0.0,
        "--kl-threshold must be a positive number, got {}",
        args.kl_threshold
    );
    anyhow::ensure!(
        (0.0..1.0).contains(&args.smoothing),
        "--smoothing must be in [0, 1), got {}",
        args.smoothing
    );
    let opts = ReportOptions {
        out_dir: args.out,
        crash_rule: CrashRule {
            kl_threshold: args.kl_threshold,
        },
        canvas: Canvas {
            width: args.width,
            height: args.height,
        },
        smoothing: args.smoothing,
    };
    let out = build_report(&args.runs, &opts).context("building the report")?;
    for s in &out.summaries {
        match s.crash {
            Some(c) => tracing::info!(run = %s.name, step = c.step, cause = %c.describe(), "crash"),
            None => tracing::info!(run = %s.name, "no crash"),
        }
    }
    tracing::info!(
        pngs = out.figures.len(),
        table = %out.table_md.display(),
        json = %out.table_json.display(),
        "report written"
    );
    println!("{}", out.html.display());
    Ok(())
}
