//! Reports over RL run directories (`r3 report`, later `r3 compare`): reads each run's
//! metrics, summarises it (best eval, final reward, mean k3 KL, crash step under a stated
//! rule), plots metrics over steps with all runs overlaid (per-step curves raw and faint
//! under an EMA line, eval accuracy with ±1 s.e. bars), states each run's final evaluation
//! against the first run's as a paired difference with its 95% interval, and writes PNGs,
//! one self-contained HTML page and a Table-1-style results table (Markdown + JSON).

mod error;
mod figures;
mod html;
mod metrics;
mod paired_table;
mod run;
mod summary;
mod table;

use std::path::PathBuf;

pub use error::ReportError;
pub use paired_table::PairedCell;
pub use run::{load_run, RunData};
pub use summary::{summarize, CrashRule, RunSummary, DEFAULT_KL_THRESHOLD};
pub use table::ResultsTable;

use crate::plot::Canvas;
use html::PageFigure;

/// Where and how to write a report.
#[derive(Debug, Clone)]
pub struct ReportOptions {
    /// Output directory (created if missing).
    pub out_dir: PathBuf,
    /// When a run counts as crashed.
    pub crash_rule: CrashRule,
    /// Size of each PNG.
    pub canvas: Canvas,
    /// EMA weight of the per-step curves (drawn raw and faint under the smoothed line);
    /// 0 draws them raw only. See [`crate::plot::ema`].
    pub smoothing: f64,
}

/// Default EMA weight of the report's per-step curves: about a 10-step window.
pub const DEFAULT_SMOOTHING: f64 = 0.9;

/// What a report wrote.
#[derive(Debug, Clone)]
pub struct ReportOutput {
    /// The HTML page.
    pub html: PathBuf,
    /// The PNGs written (metrics no run logged have none).
    pub figures: Vec<PathBuf>,
    /// The results table as Markdown.
    pub table_md: PathBuf,
    /// The results table as JSON.
    pub table_json: PathBuf,
    /// One summary per run, in the order given.
    pub summaries: Vec<RunSummary>,
}

/// File stem of the results table in the output directory.
pub const TABLE_STEM: &str = "results";
/// File name of the HTML page in the output directory.
pub const PAGE_FILE: &str = "report.html";

/// Names runs by their directory; where names collide (the same variant under several seeds)
/// the seed is appended (`single-R3-s1`), and where that still collides the full path is used.
fn disambiguate(runs: &mut [RunData]) {
    let collides =
        |runs: &[RunData], name: &str| runs.iter().filter(|r| r.name == name).count() > 1;
    let seeded: Vec<Option<String>> = runs
        .iter()
        .map(|r| match r.seed {
            Some(seed) if collides(runs, &r.name) => Some(format!("{}-s{seed}", r.name)),
            _ => None,
        })
        .collect();
    for (run, name) in runs.iter_mut().zip(seeded) {
        if let Some(name) = name {
            run.name = name;
        }
    }
    let names: Vec<String> = runs.iter().map(|r| r.name.clone()).collect();
    for run in runs.iter_mut() {
        if names.iter().filter(|n| **n == run.name).count() > 1 {
            run.name = run.dir.display().to_string();
        }
    }
}

/// Builds the report for `run_dirs` into `opts.out_dir`.
pub fn build_report(
    run_dirs: &[PathBuf],
    opts: &ReportOptions,
) -> Result<ReportOutput, ReportError> {
    if run_dirs.is_empty() {
        return Err(ReportError::NoRuns);
    }
    let mut runs = run_dirs
        .iter()
        .map(|d| load_run(d))
        .collect::<Result<Vec<_>, _>>()?;
    disambiguate(&mut runs);
    for run in &runs {
        tracing::info!(run = %run.name, steps = run.rows.len(), evals = run.eval.len(), "loaded run");
    }
    let summaries: Vec<RunSummary> = runs
        .iter()
        .map(|r| summarize(r, &opts.crash_rule))
        .collect();
    let out = opts.out_dir.as_path();
    std::fs::create_dir_all(out).map_err(ReportError::io(out))?;

    let rendered =
        figures::render_figures(&runs, &opts.crash_rule, out, opts.canvas, opts.smoothing)?;
    let mut page_figures = Vec::with_capacity(rendered.len());
    let mut pngs = Vec::new();
    for fig in &rendered {
        let png = match &fig.png {
            Ok(path) => {
                pngs.push(path.clone());
                Ok(std::fs::read(path).map_err(ReportError::io(path))?)
            }
            Err(why) => Err(why.clone()),
        };
        page_figures.push(PageFigure {
            title: fig.title,
            png,
        });
    }

    let mut table = ResultsTable::from_summaries(&summaries, &opts.crash_rule);
    let paired = paired_table::paired_cells(&runs);
    for (row, cell) in table.rows.iter_mut().zip(&paired) {
        row.paired.clone_from(cell);
    }
    let (table_md, table_json) = table.write(out, TABLE_STEM)?;
    let html = out.join(PAGE_FILE);
    let notes = html::PageNotes {
        smoothing: opts.smoothing,
        paired: paired_table::paired_lines(&runs, &paired),
    };
    let page = html::render_page(&runs, &summaries, &opts.crash_rule, &page_figures, &notes);
    std::fs::write(&html, page).map_err(ReportError::io(&html))?;
    Ok(ReportOutput {
        html,
        figures: pngs,
        table_md,
        table_json,
        summaries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(dir: &str, seed: Option<i64>) -> RunData {
        let dir = PathBuf::from(dir);
        RunData {
            name: dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            dir,
            setting: String::new(),
            seed,
            rows: Vec::new(),
            eval: Vec::new(),
            eval_stderr: Vec::new(),
        }
    }

    /// The same variant under three seeds gets the seed appended; a unique name stays; two
    /// runs that collide even with their seed fall back to their paths.
    #[test]
    fn colliding_names_take_the_seed_then_the_path() {
        let mut runs = vec![
            run("s0/runs/single-R3", Some(0)),
            run("s1/runs/single-R3", Some(1)),
            run("s2/runs/single-R3", Some(2)),
            run("s0/runs/multi-R3", Some(0)),
            run("a/x", Some(5)),
            run("b/x", Some(5)),
        ];
        disambiguate(&mut runs);
        let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "single-R3-s0",
                "single-R3-s1",
                "single-R3-s2",
                "multi-R3",
                "a/x",
                "b/x"
            ]
        );
    }
}
