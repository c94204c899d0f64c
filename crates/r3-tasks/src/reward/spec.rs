//! The `[reward]` configuration: one reward kind, or a weighted list of them
//! (`[[reward.funcs]]`, as ms-swift's `--reward_funcs` / `--reward_weights`).

use crate::dataset::GroundTruthUse;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Longest `timeout_s` a `command` reward accepts, in seconds (about 116 days).
pub const MAX_TIMEOUT_S: f64 = 1e7;

/// Which reward function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RewardKind {
    /// Final answer (`\boxed{}`, `#### N`, last number) equal to the ground truth.
    Math,
    /// Trimmed response equal to the trimmed ground truth.
    Exact,
    /// The built-in arithmetic task's rule (`#N`), the default.
    #[default]
    Arith,
    /// An external verifier process (see [`crate::reward::command`]).
    Command,
}

impl fmt::Display for RewardKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RewardKind::Math => "math",
            RewardKind::Exact => "exact",
            RewardKind::Arith => "arith",
            RewardKind::Command => "command",
        })
    }
}

/// One reward function with its weight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardFuncSpec {
    /// The function. Default `arith`.
    pub kind: RewardKind,
    /// Its weight in the sum. Default 1.0.
    pub weight: f64,
    /// `command` only: the verifier's argv, e.g. `["python3", "my_reward.py"]`.
    pub command: Vec<String>,
    /// `command` only: seconds one batch may take before it is an error. Default 60.
    pub timeout_s: f64,
}

impl Default for RewardFuncSpec {
    fn default() -> Self {
        Self {
            kind: RewardKind::Arith,
            weight: 1.0,
            command: Vec::new(),
            timeout_s: 60.0,
        }
    }
}

/// The `[reward]` section: `kind` (with `command` / `timeout_s`) names a single function of
/// weight 1; a non-empty `funcs` list replaces it with a weighted sum whose first entry
/// decides whether a response counts as correct. The `arith` rule's reward for a
/// well-formed wrong answer is the arithmetic task's `format_reward`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardSpec {
    /// The single reward function when `funcs` is empty. Default `arith`.
    pub kind: RewardKind,
    /// `command` only: the verifier's argv. Default empty.
    pub command: Vec<String>,
    /// `command` only: seconds one batch may take. Default 60.
    pub timeout_s: f64,
    /// Weighted reward functions (`[[reward.funcs]]`); empty = the single `kind`. Default empty.
    pub funcs: Vec<RewardFuncSpec>,
}

impl Default for RewardSpec {
    fn default() -> Self {
        Self {
            kind: RewardKind::Arith,
            command: Vec::new(),
            timeout_s: 60.0,
            funcs: Vec::new(),
        }
    }
}

impl RewardSpec {
    /// The functions this section describes: `funcs`, or the single `kind` with weight 1.
    pub fn resolved_funcs(&self) -> Vec<RewardFuncSpec> {
        if !self.funcs.is_empty() {
            return self.funcs.clone();
        }
        vec![RewardFuncSpec {
            kind: self.kind,
            weight: 1.0,
            command: self.command.clone(),
            timeout_s: self.timeout_s,
        }]
    }

    /// What the functions need of a dataset row's ground truth: text (a string or a number)
    /// when any is a built-in rule, anything when all are `command` verifiers.
    pub fn ground_truth_use(&self) -> GroundTruthUse {
        self.resolved_funcs()
            .iter()
            .find(|f| f.kind != RewardKind::Command)
            .map_or(GroundTruthUse::Any, |f| GroundTruthUse::Text(f.kind))
    }

    /// Checks the functions are usable, naming the offending field.
    pub fn validate(&self) -> std::result::Result<(), (String, String)> {
        for (i, f) in self.resolved_funcs().iter().enumerate() {
            let field = |name: &str| {
                if self.funcs.is_empty() {
                    format!("reward.{name}")
                } else {
                    format!("reward.funcs[{i}].{name}")
                }
            };
            if !f.weight.is_finite() {
                return Err((field("weight"), format!("{} must be finite", f.weight)));
            }
            if f.kind == RewardKind::Command {
                if f.command.is_empty() {
                    return Err((
                        field("command"),
                        "kind = \"command\" needs a command".into(),
                    ));
                }
                if !(f.timeout_s.is_finite() && f.timeout_s > 0.0) {
                    return Err((field("timeout_s"), format!("{} must be > 0", f.timeout_s)));
                }
                if f.timeout_s > MAX_TIMEOUT_S {
                    return Err((
                        field("timeout_s"),
                        format!(
                            "{} s is more than the {MAX_TIMEOUT_S:e} s (about 116 days) a \
                             verifier may be given",
                            f.timeout_s
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}
