//! The report's paired comparisons: every run's final evaluation against the first run's
//! (the reference), prompts paired. Runs of one variant under several seeds (`<variant>-s<seed>`
//! names) form one side together, so their comparison's interval adds the run-to-run spread;
//! their final evaluations must be at one step (a seed that stopped early is refused, not
//! pooled), and each side's step is shown, with any warning about the pairing.

use serde::Serialize;

use r3_tasks::estimators::PairedDifference;

use super::run::RunData;
use crate::paired::{compare_evals, load_eval, ScoredEval};

/// One row's comparison with the reference.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PairedCell {
    /// The reference variant.
    pub reference: String,
    /// This row's variant minus the reference, final evaluations, prompts paired.
    pub difference: PairedDifference,
    /// Whether the 95% interval contains 0.
    pub inside_noise: bool,
    /// The step of this row's evaluations and of the reference's.
    pub steps: (u64, u64),
    /// What could not be checked about the pairing (an old line without a prompt digest or
    /// temperature).
    pub warnings: Vec<String>,
}

impl PairedCell {
    /// `step 200 vs 0`: this side's evaluation step against the reference's.
    pub fn describe_steps(&self) -> String {
        format!("step {} vs {}", self.steps.0, self.steps.1)
    }
}

/// A run's variant: its name without a trailing `-s<seed>`.
pub fn variant_of(name: &str) -> &str {
    match name.rsplit_once("-s") {
        Some((v, seed)) if !seed.is_empty() && seed.bytes().all(|b| b.is_ascii_digit()) => v,
        _ => name,
    }
}

/// One cell per run: its variant against the first run's variant (none for the reference's
/// own runs, and where a run has no per-prompt scores or scored other prompts: logged).
pub fn paired_cells(runs: &[RunData]) -> Vec<Option<PairedCell>> {
    let Some(first) = runs.first() else {
        return Vec::new();
    };
    let reference = variant_of(&first.name);
    let finals: Vec<Option<ScoredEval>> = runs
        .iter()
        .map(|r| match load_eval(&r.dir, None) {
            Ok(e) => Some(e),
            Err(e) => {
                tracing::info!(run = %r.name, reason = %e, "no paired comparison for this run");
                None
            }
        })
        .collect();
    let side = |variant: &str| -> Option<Vec<ScoredEval>> {
        runs.iter()
            .zip(&finals)
            .filter(|(r, _)| variant_of(&r.name) == variant)
            .map(|(_, e)| e.clone())
            .collect()
    };
    let Some(base) = side(reference) else {
        return vec![None; runs.len()];
    };
    runs.iter()
        .map(|r| {
            let variant = variant_of(&r.name);
            if variant == reference {
                return None;
            }
            let this = side(variant)?;
            // compare_evals refuses a side whose evaluations differ in step: its first's is all's.
            let step = |side: &[ScoredEval]| side.first().map_or(0, |e| e.line.step);
            match compare_evals(&this, &base) {
                Ok(c) => Some(PairedCell {
                    reference: reference.to_string(),
                    inside_noise: c.difference.inside_noise(),
                    difference: c.difference,
                    steps: (step(&this), step(&base)),
                    warnings: c.warnings,
                }),
                Err(e) => {
                    tracing::warn!(run = %r.name, reason = %e, "no paired comparison");
                    None
                }
            }
        })
        .collect()
}

/// One sentence per compared variant (each once), for the page.
pub fn paired_lines(runs: &[RunData], cells: &[Option<PairedCell>]) -> Vec<String> {
    let mut seen: Vec<&str> = Vec::new();
    let mut lines = Vec::new();
    for (run, cell) in runs.iter().zip(cells) {
        let variant = variant_of(&run.name);
        let Some(cell) = cell else { continue };
        if seen.contains(&variant) {
            continue;
        }
        seen.push(variant);
        let seeds = match cell.difference.seeds {
            (1, 1) => String::new(),
            (a, b) => format!(" [{a} vs {b} seeds]"),
        };
        let warnings: String = cell
            .warnings
            .iter()
            .map(|w| format!(" (warning: {w})"))
            .collect();
        lines.push(format!(
            "{variant} − {}{seeds} ({}): {}{warnings}",
            cell.reference,
            cell.describe_steps(),
            cell.difference.describe_points()
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_drop_the_seed_suffix_only() {
        assert_eq!(variant_of("single-R3-s12"), "single-R3");
        assert_eq!(variant_of("single-R3"), "single-R3");
        assert_eq!(variant_of("runs-s"), "runs-s");
        assert_eq!(variant_of("a-sx"), "a-sx");
    }

    /// A run directory `name` whose `eval.jsonl` holds one scored evaluation at `step`.
    fn run(root: &std::path::Path, name: &str, step: u64, scores: &[f64]) -> RunData {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let line = serde_json::json!({
            "step": step, "eval_accuracy": 0.5, "n": scores.len(), "response_len_mean": 3.0,
            "samples_per_prompt": 1, "temperature": 1.0,
            "prompt_scores": scores, "prompts_digest": "d",
        });
        std::fs::write(dir.join("eval.jsonl"), format!("{line}\n")).unwrap();
        RunData {
            dir,
            name: name.into(),
            setting: String::new(),
            seed: None,
            rows: Vec::new(),
            eval: Vec::new(),
            eval_stderr: Vec::new(),
        }
    }

    #[test]
    fn a_seed_at_another_step_is_not_pooled_and_steps_are_shown() {
        let root = std::env::temp_dir().join(format!("r3-paired-table-{}", std::process::id()));
        let base = run(&root, "grpo-s1", 200, &[0.0, 0.0, 1.0]);
        let r3_a = run(&root, "r3-s1", 200, &[1.0, 0.0, 1.0]);
        let r3_late = run(&root, "r3-s2", 200, &[1.0, 1.0, 0.0]);
        let r3_early = run(&root, "r3-s3", 60, &[1.0, 1.0, 1.0]);
        // One r3 seed stopped at step 60: the r3 side is refused, not pooled.
        let runs = [base.clone(), r3_a.clone(), r3_early];
        assert_eq!(paired_cells(&runs), vec![None, None, None]);
        let runs = [base, r3_a, r3_late];
        let cells = paired_cells(&runs);
        let cell = cells[1].clone().expect("r3 at one step");
        assert_eq!(cell.steps, (200, 200));
        assert_eq!(cells[2], Some(cell.clone()));
        // (mean over seeds per prompt: 1, 0.5, 0.5) − (0, 0, 1) = (1 + 0.5 − 0.5) / 3
        assert!((cell.difference.mean - 1.0 / 3.0).abs() < 1e-12);
        let lines = paired_lines(&runs, &cells);
        assert_eq!(lines.len(), 1);
        assert!(
            lines[0].starts_with("r3 − grpo [2 vs 1 seeds] (step 200 vs 200): "),
            "{}",
            lines[0]
        );
        // Two seeds against one: a single degree of freedom for the run-to-run spread.
        assert!(lines[0].contains("too few seeds (2 vs 1)"), "{}", lines[0]);
        assert!(cell.warnings.is_empty(), "{:?}", cell.warnings);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
