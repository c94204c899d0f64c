//! Paired comparisons of held-out evaluations: loads the per-prompt scores an evaluation
//! wrote (a run directory's `eval.jsonl`, or the JSON `r3 eval --out` writes) and states the
//! difference between two models scored on the same prompts with its 95% interval (prompts
//! paired; several runs per side are seeds, whose run-to-run spread the interval adds),
//! through r3-tasks' estimators. Evaluations of different prompt sets are refused, not
//! paired, and so are evaluations sampled with a different `k` or temperature and
//! evaluations at different steps pooled as seeds of one side. A line that does not record
//! its prompt digest or temperature (written before r3 recorded them) pairs with a warning.

use std::path::{Path, PathBuf};

use r3_tasks::estimators::{paired_difference_seeds, PairedDifference};
use r3_train::rl::metrics_log::EvalLine;

/// Why two evaluations cannot be compared.
#[derive(Debug, thiserror::Error)]
pub enum PairedError {
    /// Reading a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A line is not an evaluation record.
    #[error("{}:{line}: not an evaluation line: {what}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// The parser's message.
        what: String,
    },
    /// No evaluation with per-prompt scores (at the step asked for).
    #[error("{}: no evaluation with per-prompt scores{}", path.display(), step.map_or(String::new(), |s| format!(" at step {s}")))]
    NoScores {
        /// The file or run directory.
        path: PathBuf,
        /// The step asked for.
        step: Option<u64>,
    },
    /// The two sides were evaluated on different prompts.
    #[error("{} and {} were evaluated on different prompts ({what}): a paired difference needs the same eval set", a.display(), b.display())]
    DifferentPrompts {
        /// One evaluation.
        a: PathBuf,
        /// The other.
        b: PathBuf,
        /// What differs.
        what: String,
    },
    /// The two sides sampled their answers differently (samples per prompt, temperature).
    #[error("{} and {} were sampled differently ({what}): a paired difference needs the same k and temperature", a.display(), b.display())]
    DifferentSampling {
        /// One evaluation.
        a: PathBuf,
        /// The other.
        b: PathBuf,
        /// What differs.
        what: String,
    },
    /// Evaluations pooled as seeds of one side were taken at different training steps.
    #[error("{side} side pools evaluations of different steps ({}): seeds of one side must be evaluated at the same step (pass it, e.g. --baseline-step, or compare runs that reached it)", describe_steps(evals))]
    MixedSteps {
        /// Which side (`a` / `b`).
        side: &'static str,
        /// Each evaluation of that side with its step.
        evals: Vec<(PathBuf, u64)>,
    },
    /// A side has no evaluation.
    #[error("a paired comparison needs at least one evaluation on each side")]
    Empty,
}

/// `path at step N, …` for [`PairedError::MixedSteps`].
fn describe_steps(evals: &[(PathBuf, u64)]) -> String {
    evals
        .iter()
        .map(|(p, s)| format!("{} at step {s}", p.display()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One evaluation's per-prompt scores and where they came from.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredEval {
    /// The file or run directory read.
    pub path: PathBuf,
    /// The evaluation line.
    pub line: EvalLine,
}

/// Reads the evaluation at `step` (the last one with per-prompt scores when `None`) from a
/// run directory (its `eval.jsonl`) or a file of evaluation lines (`eval.jsonl`, or the one
/// object `r3 eval --out` writes).
pub fn load_eval(path: &Path, step: Option<u64>) -> Result<ScoredEval, PairedError> {
    let file = if path.is_dir() {
        path.join("eval.jsonl")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file).map_err(|source| PairedError::Io {
        path: file.clone(),
        source,
    })?;
    let mut chosen = None;
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        let line: EvalLine = serde_json::from_str(l).map_err(|e| PairedError::Malformed {
            path: file.clone(),
            line: i + 1,
            what: e.to_string(),
        })?;
        if !line.prompt_scores.is_empty() && step.is_none_or(|s| s == line.step) {
            chosen = Some(line);
        }
    }
    let line = chosen.ok_or(PairedError::NoScores {
        path: file.clone(),
        step,
    })?;
    Ok(ScoredEval { path: file, line })
}

/// A paired difference with what its reader must know about the pairing.
#[derive(Debug, Clone, PartialEq)]
pub struct PairedComparison {
    /// `a − b`, prompts paired.
    pub difference: PairedDifference,
    /// What could not be checked (an evaluation without a prompt digest or temperature),
    /// one sentence each naming the file.
    pub warnings: Vec<String>,
}

/// The paired difference `a − b` of per-prompt scores (several evaluations per side are
/// seeds of the same model or setting); an error when any two were scored on different
/// prompts or sampled with a different `k` or temperature, or when one side's evaluations
/// are at different steps (the two sides may differ: a trained model against its base).
pub fn compare_evals(a: &[ScoredEval], b: &[ScoredEval]) -> Result<PairedComparison, PairedError> {
    let first = a.first().ok_or(PairedError::Empty)?;
    side_step(a, "a")?;
    side_step(b, "b")?;
    let mut warnings = Vec::new();
    for other in a.iter().chain(b).skip(1) {
        check_pairing(
            &first.path,
            &PairingKey::of(&first.line),
            &other.path,
            &PairingKey::of(&other.line),
        )?;
    }
    for e in a.iter().chain(b) {
        warnings.extend(PairingKey::of(&e.line).unrecorded(&e.path));
    }
    let scores = |side: &[ScoredEval]| -> Vec<Vec<f64>> {
        side.iter().map(|e| e.line.prompt_scores.clone()).collect()
    };
    let difference = paired_difference_seeds(&scores(a), &scores(b)).ok_or(PairedError::Empty)?;
    Ok(PairedComparison {
        difference,
        warnings,
    })
}

/// What two evaluations must share to be paired.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairingKey<'a> {
    /// Prompts scored.
    pub prompts: usize,
    /// sha256 of the prompts and answers (`None`: not recorded).
    pub digest: Option<&'a str>,
    /// Samples per prompt.
    pub k: usize,
    /// Sampling temperature (`None`: not recorded).
    pub temperature: Option<f64>,
}

impl<'a> PairingKey<'a> {
    /// The key of an evaluation line (a line without `samples_per_prompt` has `k` = 1).
    pub fn of(line: &'a EvalLine) -> Self {
        Self {
            prompts: line.prompt_scores.len(),
            digest: line.prompts_digest.as_deref(),
            k: line.samples_per_prompt.unwrap_or(1),
            temperature: line.temperature,
        }
    }

    /// One warning per unrecorded part of the key of the evaluation at `path`.
    pub fn unrecorded(&self, path: &Path) -> Vec<String> {
        let mut w = Vec::new();
        if self.digest.is_none() {
            w.push(format!(
                "{} records no prompt digest: paired on its prompt count ({}) alone",
                path.display(),
                self.prompts
            ));
        }
        if self.temperature.is_none() {
            w.push(format!(
                "{} records no sampling temperature: it is assumed to match",
                path.display()
            ));
        }
        w
    }
}

/// Refuses to pair the evaluation at `x_path` with the one at `y_path` when their prompt
/// counts, recorded digests, samples per prompt or recorded temperatures differ.
pub fn check_pairing(
    x_path: &Path,
    x: &PairingKey<'_>,
    y_path: &Path,
    y: &PairingKey<'_>,
) -> Result<(), PairedError> {
    let prompts = |what: String| PairedError::DifferentPrompts {
        a: x_path.to_path_buf(),
        b: y_path.to_path_buf(),
        what,
    };
    let sampling = |what: String| PairedError::DifferentSampling {
        a: x_path.to_path_buf(),
        b: y_path.to_path_buf(),
        what,
    };
    if x.prompts != y.prompts {
        return Err(prompts(format!("{} vs {} prompts", x.prompts, y.prompts)));
    }
    if let (Some(dx), Some(dy)) = (x.digest, y.digest) {
        if dx != dy {
            return Err(prompts("prompt digests differ".into()));
        }
    }
    if x.k != y.k {
        return Err(sampling(format!("{} vs {} samples per prompt", x.k, y.k)));
    }
    if let (Some(tx), Some(ty)) = (x.temperature, y.temperature) {
        // Temperatures travel as f32 in the engines: equal to f32 precision is equal.
        if (tx - ty).abs() > 1e-6 * tx.abs().max(1.0) {
            return Err(sampling(format!("temperature {tx} vs {ty}")));
        }
    }
    Ok(())
}

/// The step every evaluation of `side` was taken at; `None` for an empty side, an error
/// naming each evaluation's step when they differ.
pub fn side_step(side: &[ScoredEval], name: &'static str) -> Result<Option<u64>, PairedError> {
    let Some(first) = side.first() else {
        return Ok(None);
    };
    if side.iter().any(|e| e.line.step != first.line.step) {
        return Err(PairedError::MixedSteps {
            side: name,
            evals: side.iter().map(|e| (e.path.clone(), e.line.step)).collect(),
        });
    }
    Ok(Some(first.line.step))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(step: u64, scores: &[f64], digest: &str) -> String {
        serde_json::json!({
            "step": step, "eval_accuracy": 0.5, "n": scores.len(), "response_len_mean": 3.0,
            "samples_per_prompt": 4, "temperature": 1.0,
            "prompt_scores": scores, "prompts_digest": digest,
        })
        .to_string()
    }

    #[test]
    fn loads_runs_and_files_and_refuses_other_prompt_sets() {
        let dir = std::env::temp_dir().join(format!("r3-paired-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let run = dir.join("eval.jsonl");
        let text = [
            line(0, &[0.0, 0.5, 1.0], "d"),
            r#"{"step": 5, "eval_accuracy": 0.5, "n": 3, "response_len_mean": 1.0}"#.into(),
            line(10, &[1.0, 0.5, 1.0], "d"),
        ]
        .join("\n");
        std::fs::write(&run, text).unwrap();
        let last = load_eval(&dir, None).unwrap();
        assert_eq!(last.line.step, 10);
        let base = load_eval(&run, Some(0)).unwrap();
        assert_eq!(base.line.prompt_scores, vec![0.0, 0.5, 1.0]);
        assert!(matches!(
            load_eval(&run, Some(5)),
            Err(PairedError::NoScores { step: Some(5), .. })
        ));
        let c = compare_evals(std::slice::from_ref(&last), std::slice::from_ref(&base)).unwrap();
        assert!((c.difference.mean - 1.0 / 3.0).abs() < 1e-15);
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        let other = dir.join("other.json");
        std::fs::write(&other, line(0, &[0.0, 0.5, 1.0], "e")).unwrap();
        let other = load_eval(&other, None).unwrap();
        let err = compare_evals(&[last], &[other]).unwrap_err();
        assert!(err.to_string().contains("different prompts"), "{err}");
        let bad = dir.join("bad.jsonl");
        std::fs::write(&bad, "{\"step\": 1}\n").unwrap();
        assert!(matches!(
            load_eval(&bad, None),
            Err(PairedError::Malformed { line: 1, .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn eval_at(path: &str, step: u64, scores: &[f64]) -> ScoredEval {
        ScoredEval {
            path: PathBuf::from(path),
            line: serde_json::from_str(&line(step, scores, "d")).unwrap(),
        }
    }

    #[test]
    fn seeds_of_one_side_must_share_a_step() {
        let s1 = eval_at("runs/r3-s1", 200, &[1.0, 0.0, 1.0]);
        let s2 = eval_at("runs/r3-s2", 60, &[1.0, 1.0, 0.0]);
        let base = eval_at("runs/grpo-s1", 0, &[0.0, 0.0, 1.0]);
        let err =
            compare_evals(&[s1.clone(), s2.clone()], std::slice::from_ref(&base)).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, PairedError::MixedSteps { side: "a", .. }),
            "{msg}"
        );
        assert!(
            msg.contains("runs/r3-s1 at step 200") && msg.contains("runs/r3-s2 at step 60"),
            "{msg}"
        );
        let err = compare_evals(std::slice::from_ref(&base), &[s1.clone(), s2]).unwrap_err();
        assert!(
            matches!(err, PairedError::MixedSteps { side: "b", .. }),
            "{err}"
        );
        // Sides at different steps from each other are fine: a trained model against its base.
        let s2 = eval_at("runs/r3-s2", 200, &[1.0, 1.0, 0.0]);
        let d = compare_evals(&[s1.clone(), s2.clone()], &[base])
            .unwrap()
            .difference;
        // (mean over seeds per prompt: 1, 0.5, 0.5) − (0, 0, 1) = (1 + 0.5 − 0.5) / 3
        assert!((d.mean - 1.0 / 3.0).abs() < 1e-12, "{}", d.mean);
        assert_eq!(side_step(&[s1, s2], "a").unwrap(), Some(200));
        assert_eq!(side_step(&[], "a").unwrap(), None);
    }

    fn eval_json(path: &str, json: serde_json::Value) -> ScoredEval {
        ScoredEval {
            path: PathBuf::from(path),
            line: serde_json::from_value(json).unwrap(),
        }
    }

    #[test]
    fn different_k_or_temperature_is_refused_and_unrecorded_ones_warn() {
        let scores = [1.0, 0.0, 1.0];
        let with = |path: &str, k: usize, t: f64| {
            eval_json(
                path,
                serde_json::json!({
                    "step": 0, "eval_accuracy": 0.5, "n": 3, "response_len_mean": 1.0,
                    "samples_per_prompt": k, "temperature": t, "prompt_scores": scores,
                    "prompts_digest": "d",
                }),
            )
        };
        // A greedy one-sample baseline against a T = 1, k = 8 evaluation.
        let greedy = with("greedy.json", 1, 0.0);
        let sampled = with("sampled.json", 8, 1.0);
        let err = compare_evals(
            std::slice::from_ref(&sampled),
            std::slice::from_ref(&greedy),
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, PairedError::DifferentSampling { .. }),
            "{msg}"
        );
        assert!(msg.contains("8 vs 1 samples per prompt"), "{msg}");
        let err = compare_evals(&[with("a.json", 8, 1.0)], &[with("b.json", 8, 0.6)]).unwrap_err();
        assert!(err.to_string().contains("temperature 1 vs 0.6"), "{err}");
        // Seeds of one side must agree too.
        let err = compare_evals(
            &[with("a.json", 8, 1.0), with("a2.json", 4, 1.0)],
            std::slice::from_ref(&sampled),
        )
        .unwrap_err();
        assert!(
            matches!(err, PairedError::DifferentSampling { .. }),
            "{err}"
        );
        // f32 rounding of the same temperature is the same temperature.
        assert!(compare_evals(
            &[with("a.json", 8, 0.7)],
            &[with("b.json", 8, f64::from(0.7f32))]
        )
        .is_ok());
        // An old line: no temperature, no digest, no k (= 1). It pairs with a one-sample
        // evaluation, with a warning for each unrecorded part; a k = 8 one is refused.
        let old = eval_json(
            "old.jsonl",
            serde_json::json!({
                "step": 0, "eval_accuracy": 0.5, "n": 3, "response_len_mean": 1.0,
                "prompt_scores": scores,
            }),
        );
        let c = compare_evals(std::slice::from_ref(&greedy), std::slice::from_ref(&old)).unwrap();
        assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
        assert!(c.warnings[0]
            .contains("old.jsonl records no prompt digest: paired on its prompt count (3) alone"));
        assert!(c.warnings[1].contains("old.jsonl records no sampling temperature"));
        assert!(compare_evals(&[sampled], &[old]).is_err());
    }
}
