//! The report's paired comparisons: every run's final evaluation against the first run's
//! (the reference), prompts paired. Runs of one variant under several seeds (`<variant>-s<seed>`
//! names) form one side together, so their comparison has seeds as a second level.

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
            match compare_evals(&this, &base) {
                Ok(difference) => Some(PairedCell {
                    reference: reference.to_string(),
                    inside_noise: difference.inside_noise(),
                    difference,
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
        lines.push(format!(
            "{variant} − {}{seeds}: {}",
            cell.reference,
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
}
