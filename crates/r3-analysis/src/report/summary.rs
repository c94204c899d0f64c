//! Per-run summary numbers (best eval and its step, final reward, mean k3 KL) and the crash
//! rule that decides whether and when a run collapsed.

use serde::Serialize;

use super::metrics::{keys, series};
use super::run::RunData;

/// Eval accuracy below this fraction of the best so far counts as a collapse.
pub const EVAL_COLLAPSE_FRACTION: f64 = 0.5;
/// Default k3 KL above which a step counts as a crash.
pub const DEFAULT_KL_THRESHOLD: f64 = 1e-2;

/// When a run counts as crashed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrashRule {
    /// A step whose `mismatch.k3_kl` exceeds this is a crash.
    pub kl_threshold: f64,
}

impl Default for CrashRule {
    fn default() -> Self {
        Self {
            kl_threshold: DEFAULT_KL_THRESHOLD,
        }
    }
}

impl CrashRule {
    /// The rule in words, for the report page and the results table.
    pub fn describe(&self) -> String {
        format!(
            "A run crashes at the first step where either (a) eval accuracy falls below {} of \
             the best eval accuracy reached so far (checked only after that best, and only \
             when the best is above 0), or (b) the training–inference k3 KL \
             (mismatch.k3_kl) exceeds {:e}.",
            EVAL_COLLAPSE_FRACTION, self.kl_threshold
        )
    }
}

/// A value and the step it was logged at.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepValue {
    /// Training step.
    pub step: u64,
    /// The value.
    pub value: f64,
}

/// Why a run counts as crashed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CrashCause {
    /// Eval accuracy fell below half of the best so far.
    EvalCollapse {
        /// Best eval accuracy before the collapse.
        best: f64,
        /// Step of that best.
        best_step: u64,
        /// The collapsed accuracy.
        value: f64,
    },
    /// k3 KL exceeded the threshold.
    KlAbove {
        /// The KL at the crash step.
        kl: f64,
        /// The threshold it exceeded.
        threshold: f64,
    },
}

/// The first step at which a run counts as crashed, and why.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Crash {
    /// Training step of the crash.
    pub step: u64,
    /// The rule that fired.
    pub cause: CrashCause,
}

impl Crash {
    /// Short description, e.g. "eval 0.12 < 0.5 × best 0.40 (step 30)".
    pub fn describe(&self) -> String {
        match self.cause {
            CrashCause::EvalCollapse {
                best,
                best_step,
                value,
            } => format!(
                "eval {value:.4} < {EVAL_COLLAPSE_FRACTION} × best {best:.4} (step {best_step})"
            ),
            CrashCause::KlAbove { kl, threshold } => format!("k3 KL {kl:.3e} > {threshold:e}"),
        }
    }
}

/// First eval collapse: walking evals in step order, the first value below
/// `EVAL_COLLAPSE_FRACTION` × the best value seen before it (best must be > 0).
pub fn eval_collapse(eval: &[(u64, f64)]) -> Option<Crash> {
    let mut best: Option<(u64, f64)> = None;
    for &(step, value) in eval {
        if !value.is_finite() {
            continue;
        }
        if let Some((best_step, b)) = best {
            if b > 0.0 && value < EVAL_COLLAPSE_FRACTION * b {
                return Some(Crash {
                    step,
                    cause: CrashCause::EvalCollapse {
                        best: b,
                        best_step,
                        value,
                    },
                });
            }
        }
        if best.is_none_or(|(_, b)| value > b) {
            best = Some((step, value));
        }
    }
    None
}

/// First step whose k3 KL exceeds `threshold`.
pub fn kl_crash(kl: &[(u64, f64)], threshold: f64) -> Option<Crash> {
    kl.iter()
        .find(|(_, v)| *v > threshold)
        .map(|&(step, kl)| Crash {
            step,
            cause: CrashCause::KlAbove { kl, threshold },
        })
}

/// The earlier of the two crash conditions (an eval collapse wins a tie).
pub fn find_crash(eval: &[(u64, f64)], kl: &[(u64, f64)], rule: &CrashRule) -> Option<Crash> {
    match (eval_collapse(eval), kl_crash(kl, rule.kl_threshold)) {
        (Some(e), Some(k)) => Some(if k.step < e.step { k } else { e }),
        (e, k) => e.or(k),
    }
}

/// Highest value and its step; the earliest step wins a tie. Non-finite values are skipped.
pub fn best(points: &[(u64, f64)]) -> Option<StepValue> {
    points.iter().filter(|(_, v)| v.is_finite()).fold(
        None,
        |acc: Option<StepValue>, &(step, value)| match acc {
            Some(b) if b.value >= value => Some(b),
            _ => Some(StepValue { step, value }),
        },
    )
}

/// Mean of the finite values, `None` if there are none.
pub fn mean(points: &[(u64, f64)]) -> Option<f64> {
    let finite: Vec<f64> = points
        .iter()
        .map(|p| p.1)
        .filter(|v| v.is_finite())
        .collect();
    (!finite.is_empty()).then(|| finite.iter().sum::<f64>() / finite.len() as f64)
}

/// What the report says about one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSummary {
    /// Run name.
    pub name: String,
    /// What was run (replay mode, loss).
    pub setting: String,
    /// Number of logged steps.
    pub steps_logged: usize,
    /// Last logged step.
    pub last_step: Option<u64>,
    /// Best eval accuracy and its step.
    pub best_eval: Option<StepValue>,
    /// Last eval accuracy and its step (paper Table 1 reports best and final).
    pub final_eval: Option<StepValue>,
    /// Mean reward at the last step that logged one.
    pub final_reward: Option<StepValue>,
    /// Mean of mismatch.k3_kl over the steps that logged it.
    pub mean_k3_kl: Option<f64>,
    /// First crash under the rule, if any.
    pub crash: Option<Crash>,
}

/// Summarises `run` under `rule`.
pub fn summarize(run: &RunData, rule: &CrashRule) -> RunSummary {
    let kl = series(&run.rows, keys::K3_KL);
    let reward = series(&run.rows, keys::REWARD);
    RunSummary {
        name: run.name.clone(),
        setting: run.setting.clone(),
        steps_logged: run.rows.len(),
        last_step: run.rows.last().map(|r| r.step),
        best_eval: best(&run.eval),
        final_eval: run
            .eval
            .last()
            .map(|&(step, value)| StepValue { step, value }),
        final_reward: reward
            .iter()
            .rev()
            .find(|(_, v)| v.is_finite())
            .map(|&(step, value)| StepValue { step, value }),
        mean_k3_kl: mean(&kl),
        crash: find_crash(&run.eval, &kl, rule),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eval_collapse_needs_a_drop_below_half_the_best_so_far() {
        // best so far: 0.2 (s0), 0.4 (s10), 0.4, 0.4 ; 0.25 >= 0.2 is fine, 0.19 < 0.2 collapses.
        let eval = [(0, 0.2), (10, 0.4), (20, 0.25), (30, 0.19), (40, 0.5)];
        let c = eval_collapse(&eval).unwrap();
        assert_eq!(c.step, 30);
        assert_eq!(
            c.cause,
            CrashCause::EvalCollapse {
                best: 0.4,
                best_step: 10,
                value: 0.19
            }
        );
    }

    #[test]
    fn no_collapse_when_it_never_halves_or_best_is_zero() {
        // Exactly half is not below half.
        assert_eq!(eval_collapse(&[(0, 0.4), (5, 0.2), (9, 0.3)]), None);
        // Starting at 0 and staying there is "never learned", not a crash.
        assert_eq!(eval_collapse(&[(0, 0.0), (5, 0.0)]), None);
        // An early dip before any best is reached is not a collapse either.
        assert_eq!(eval_collapse(&[(0, 0.1), (5, 0.6)]), None);
        assert_eq!(eval_collapse(&[]), None);
    }

    #[test]
    fn kl_crash_is_first_step_strictly_above() {
        let kl = [(1, 1e-3), (2, 1e-2), (3, 2e-2), (4, 5e-1)];
        let c = kl_crash(&kl, 1e-2).unwrap();
        assert_eq!(c.step, 3);
        assert_eq!(
            c.cause,
            CrashCause::KlAbove {
                kl: 2e-2,
                threshold: 1e-2
            }
        );
        assert_eq!(kl_crash(&kl, 1.0), None);
    }

    #[test]
    fn the_earlier_condition_wins() {
        let eval = [(0, 0.5), (10, 0.2)];
        let kl = [(5, 0.5)];
        let rule = CrashRule::default();
        assert_eq!(find_crash(&eval, &kl, &rule).unwrap().step, 5);
        let late_kl = [(12, 0.5)];
        assert_eq!(find_crash(&eval, &late_kl, &rule).unwrap().step, 10);
        let tie = [(10, 0.5)];
        let c = find_crash(&eval, &tie, &rule).unwrap();
        assert!(matches!(c.cause, CrashCause::EvalCollapse { .. }));
        assert_eq!(find_crash(&[], &[], &rule), None);
    }

    #[test]
    fn best_takes_earliest_of_ties_and_mean_skips_non_finite() {
        let pts = [(0, 0.1), (5, 0.7), (10, 0.7), (15, f64::NAN), (20, 0.3)];
        assert_eq!(
            best(&pts),
            Some(StepValue {
                step: 5,
                value: 0.7
            })
        );
        assert_eq!(best(&[]), None);
        // (0.1 + 0.7 + 0.7 + 0.3) / 4 = 0.45
        assert!((mean(&pts).unwrap() - 0.45).abs() < 1e-12);
        assert_eq!(mean(&[(0, f64::NAN)]), None);
    }

    #[test]
    fn rule_text_states_both_conditions() {
        let text = CrashRule { kl_threshold: 0.02 }.describe();
        assert!(text.contains("below 0.5 of the best"), "{text}");
        assert!(text.contains("exceeds 2e-2"), "{text}");
    }
}
