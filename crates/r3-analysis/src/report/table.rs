//! The results table in the shape of the paper's Table 1: one row per run, the best score of
//! each eval column with its step, their average when there are several, and the crash step.
//! Written as Markdown (for READMEs) and JSON (for tools); `r3 compare` reuses it.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::paired_table::PairedCell;
use super::summary::{CrashRule, RunSummary, StepValue};
use super::ReportError;

/// One run's row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResultsRow {
    /// Run name.
    pub run: String,
    /// What was run (replay mode, loss).
    pub setting: String,
    /// Best score and its step per score column (`None`: never evaluated).
    pub scores: Vec<Option<StepValue>>,
    /// Mean of the best scores, when there are several columns and all have a score.
    pub average: Option<f64>,
    /// The last score of the (single) eval column and its step, when known.
    pub final_score: Option<StepValue>,
    /// Step of the first crash under the rule.
    pub crash_step: Option<u64>,
    /// Why it counts as a crash.
    pub crash_cause: Option<String>,
    /// The final evaluation against the reference run's, prompts paired (`r3 report`: the
    /// first run given).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paired: Option<PairedCell>,
}

/// The whole table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResultsTable {
    /// Names of the score columns (e.g. "eval accuracy", or one per benchmark).
    pub score_columns: Vec<String>,
    /// One row per run.
    pub rows: Vec<ResultsRow>,
    /// The crash rule, in words.
    pub crash_rule: String,
}

/// Column name of the single score `r3 report` has: eval accuracy.
pub const EVAL_COLUMN: &str = "eval accuracy";

impl ResultsRow {
    /// A row from scores; `average` is filled in when every one of several columns has one.
    pub fn new(
        run: &str,
        setting: &str,
        scores: Vec<Option<StepValue>>,
        crash: Option<(u64, String)>,
    ) -> Self {
        let all: Option<Vec<f64>> = scores.iter().map(|s| s.map(|s| s.value)).collect();
        let average = all
            .filter(|v| v.len() > 1)
            .map(|v| v.iter().sum::<f64>() / v.len() as f64);
        let (crash_step, crash_cause) = crash.map_or((None, None), |(s, c)| (Some(s), Some(c)));
        Self {
            run: run.to_string(),
            setting: setting.to_string(),
            scores,
            average,
            final_score: None,
            crash_step,
            crash_cause,
            paired: None,
        }
    }
}

impl ResultsTable {
    /// The one-score-column table of run summaries (the eval accuracy column).
    pub fn from_summaries(summaries: &[RunSummary], rule: &CrashRule) -> Self {
        let rows = summaries
            .iter()
            .map(|s| {
                let crash = s.crash.map(|c| (c.step, c.describe()));
                let mut row = ResultsRow::new(&s.name, &s.setting, vec![s.best_eval], crash);
                row.final_score = s.final_eval;
                row
            })
            .collect();
        Self {
            score_columns: vec![EVAL_COLUMN.to_string()],
            rows,
            crash_rule: rule.describe(),
        }
    }

    /// Markdown: scores as percentages with the step in parentheses, "—" where absent, the
    /// crash rule under the table.
    pub fn to_markdown(&self) -> String {
        let with_avg = self.score_columns.len() > 1;
        let mut header = vec!["run".to_string(), "setting".to_string()];
        header.extend(
            self.score_columns
                .iter()
                .map(|c| format!("{} % (step)", md_escape(c))),
        );
        if with_avg {
            header.push("avg %".to_string());
        }
        let with_final = self.rows.iter().any(|r| r.final_score.is_some());
        if with_final {
            header.push("final % (step)".to_string());
        }
        let paired_ref = self.rows.iter().find_map(|r| r.paired.as_ref());
        if let Some(p) = paired_ref {
            header.push(format!(
                "final − {} (points, 95% CI)",
                md_escape(&p.reference)
            ));
        }
        header.push("crash step".to_string());
        let mut out = format!("| {} |\n", header.join(" | "));
        out.push_str(&format!("|{}\n", " --- |".repeat(header.len())));
        for row in &self.rows {
            let mut cells = vec![md_escape(&row.run), md_escape(&row.setting)];
            cells.extend(row.scores.iter().map(|s| match s {
                Some(s) => format!("{:.2} ({})", 100.0 * s.value, s.step),
                None => "—".to_string(),
            }));
            if with_avg {
                cells.push(
                    row.average
                        .map_or("—".to_string(), |a| format!("{:.2}", 100.0 * a)),
                );
            }
            if with_final {
                cells.push(row.final_score.map_or("—".to_string(), |s| {
                    format!("{:.2} ({})", 100.0 * s.value, s.step)
                }));
            }
            if paired_ref.is_some() {
                cells.push(row.paired.as_ref().map_or("—".to_string(), paired_cell));
            }
            cells.push(row.crash_step.map_or("—".to_string(), |s| s.to_string()));
            out.push_str(&format!("| {} |\n", cells.join(" | ")));
        }
        out.push_str(&format!("\nCrash rule: {}\n", self.crash_rule));
        out
    }

    /// Pretty-printed JSON of the table (scores as fractions, not percentages).
    pub fn to_json(&self) -> Result<String, ReportError> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// Writes `<dir>/<stem>.md` and `<dir>/<stem>.json`; returns both paths.
    pub fn write(&self, dir: &Path, stem: &str) -> Result<(PathBuf, PathBuf), ReportError> {
        let md = dir.join(format!("{stem}.md"));
        let json = dir.join(format!("{stem}.json"));
        std::fs::write(&md, self.to_markdown()).map_err(ReportError::io(&md))?;
        std::fs::write(&json, self.to_json()? + "\n").map_err(ReportError::io(&json))?;
        Ok((md, json))
    }
}

/// `+2.8 [+0.1, +5.5] real (step 200 vs 200)` / `… noise …`: the paired difference in points
/// with its interval and the two sides' evaluation steps (`; too few seeds` when several
/// seeds were pooled but too few to measure their spread).
fn paired_cell(p: &PairedCell) -> String {
    let d = &p.difference;
    format!(
        "{:+.1} [{:+.1}, {:+.1}] {} ({}{})",
        100.0 * d.mean,
        100.0 * d.low,
        100.0 * d.high,
        if p.inside_noise { "noise" } else { "real" },
        p.describe_steps(),
        if d.too_few_seeds() {
            "; too few seeds"
        } else {
            ""
        }
    )
}

/// Escapes what would break a Markdown table cell.
fn md_escape(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> ResultsTable {
        let sv = |step, value| Some(StepValue { step, value });
        ResultsTable {
            score_columns: vec!["AIME24".into(), "MATH|L5".into()],
            rows: vec![
                ResultsRow::new(
                    "grpo",
                    "no replay · ppo",
                    vec![sv(40, 0.25), sv(35, 0.5)],
                    Some((60, "kl".into())),
                ),
                ResultsRow::new("r3", "R3 · ppo", vec![sv(100, 0.3125), None], None),
            ],
            crash_rule: "rule text".into(),
        }
    }

    #[test]
    fn average_only_with_several_complete_columns() {
        let t = table();
        // (0.25 + 0.5) / 2 = 0.375
        assert_eq!(t.rows[0].average, Some(0.375));
        assert_eq!(t.rows[1].average, None);
        let one = ResultsRow::new(
            "a",
            "",
            vec![Some(StepValue {
                step: 1,
                value: 0.5,
            })],
            None,
        );
        assert_eq!(one.average, None);
    }

    #[test]
    fn markdown_layout() {
        let md = table().to_markdown();
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(
            lines[0],
            "| run | setting | AIME24 % (step) | MATH\\|L5 % (step) | avg % | crash step |"
        );
        assert_eq!(lines[1], "| --- | --- | --- | --- | --- | --- |");
        assert_eq!(
            lines[2],
            "| grpo | no replay · ppo | 25.00 (40) | 50.00 (35) | 37.50 | 60 |"
        );
        assert_eq!(lines[3], "| r3 | R3 · ppo | 31.25 (100) | — | — | — |");
        assert_eq!(lines[5], "Crash rule: rule text");
    }

    #[test]
    fn final_column_appears_when_a_row_has_a_final_score() {
        let mut t = table();
        t.rows[1].final_score = Some(StepValue {
            step: 120,
            value: 0.125,
        });
        let md = t.to_markdown();
        let lines: Vec<&str> = md.lines().collect();
        assert!(
            lines[0].ends_with("| avg % | final % (step) | crash step |"),
            "{}",
            lines[0]
        );
        assert_eq!(
            lines[2],
            "| grpo | no replay · ppo | 25.00 (40) | 50.00 (35) | 37.50 | — | 60 |"
        );
        assert_eq!(
            lines[3],
            "| r3 | R3 · ppo | 31.25 (100) | — | — | 12.50 (120) | — |"
        );
    }

    #[test]
    fn paired_column_says_real_or_noise() {
        let mut t = table();
        let cell = |mean: f64, low: f64, high: f64| PairedCell {
            reference: "grpo".into(),
            difference: r3_tasks::estimators::PairedDifference {
                mean,
                stderr: 0.01,
                low,
                high,
                prompts: 200,
                seeds: (1, 1),
                df: 199.0,
            },
            inside_noise: low <= 0.0 && 0.0 <= high,
            steps: (200, 60),
            warnings: Vec::new(),
        };
        t.rows[1].paired = Some(cell(0.028, 0.001, 0.055));
        let md = t.to_markdown();
        let lines: Vec<&str> = md.lines().collect();
        assert!(
            lines[0].ends_with("| final − grpo (points, 95% CI) | crash step |"),
            "{}",
            lines[0]
        );
        assert!(lines[2].ends_with("| — | 60 |"), "{}", lines[2]);
        assert!(
            lines[3].ends_with("| +2.8 [+0.1, +5.5] real (step 200 vs 60) | — |"),
            "{}",
            lines[3]
        );
        t.rows[1].paired = Some(cell(0.01, -0.02, 0.04));
        assert!(t
            .to_markdown()
            .contains("| +1.0 [-2.0, +4.0] noise (step 200 vs 60) |"));
    }

    #[test]
    fn json_round_trips_the_numbers() {
        let json: serde_json::Value = serde_json::from_str(&table().to_json().unwrap()).unwrap();
        assert_eq!(json["rows"][0]["scores"][1]["value"], 0.5);
        assert_eq!(json["rows"][0]["scores"][1]["step"], 35);
        assert_eq!(json["rows"][0]["crash_step"], 60);
        assert!(json["rows"][1]["scores"][1].is_null());
        assert!(json["rows"][1]["crash_step"].is_null());
        assert_eq!(json["crash_rule"], "rule text");
    }
}
