//! A configured reward: a weighted sum of reward functions evaluated on a batch of
//! responses. The first function decides correctness (score >= 1), so an accuracy metric
//! stays meaningful when format or length terms are added behind it.

use std::borrow::Cow;
use std::time::Duration;

use r3_text::json_kind;

use crate::dataset::ground_truth_text;
use crate::error::{Result, TaskError};
use crate::reward::answers::{arith_reward, exact_reward, math_reward};
use crate::reward::command::CommandReward;
use crate::reward::input::RewardInput;
use crate::reward::spec::{RewardKind, RewardSpec};
use crate::reward::vote;

/// The reward of one response.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RewardScore {
    /// Weighted sum of the functions' scores.
    pub reward: f32,
    /// Whether the first function scored at least 1.
    pub correct: bool,
}

#[derive(Debug, Clone, PartialEq)]
enum RewardFn {
    Math,
    Exact,
    Arith { format_reward: f32 },
    Command(CommandReward),
}

impl RewardFn {
    fn score_batch(&self, inputs: &[RewardInput<'_>]) -> Result<Vec<f32>> {
        match self {
            RewardFn::Math => inputs
                .iter()
                .enumerate()
                .map(|(row, i)| Ok(math_reward(i.response, &truth(i, row, RewardKind::Math)?)))
                .collect(),
            RewardFn::Exact => inputs
                .iter()
                .enumerate()
                .map(|(row, i)| Ok(exact_reward(i.response, &truth(i, row, RewardKind::Exact)?)))
                .collect(),
            RewardFn::Arith { format_reward } => inputs
                .iter()
                .enumerate()
                .map(|(row, i)| {
                    let t = truth(i, row, RewardKind::Arith)?;
                    arith_reward(i.response, &t, *format_reward, row)
                })
                .collect(),
            RewardFn::Command(c) => c.score_batch(inputs),
        }
    }
}

/// The ground truth of batch row `row` as the built-in reward `kind` compares it (a row that
/// loading did not check, holding an object or a list, is an error naming the row).
fn truth<'a>(input: &RewardInput<'a>, row: usize, kind: RewardKind) -> Result<Cow<'a, str>> {
    ground_truth_text(input.ground_truth).ok_or_else(|| TaskError::RewardRow {
        row,
        reason: format!(
            "the {kind} reward needs a string or number ground truth, got {}",
            json_kind(input.ground_truth)
        ),
    })
}

/// A weighted sum of reward functions.
#[derive(Debug, Clone, PartialEq)]
pub struct Reward {
    funcs: Vec<(RewardFn, f32)>,
}

impl Reward {
    /// The reward a `[reward]` section describes; `arith_format_reward` is the `arith`
    /// rule's reward for a well-formed wrong answer.
    pub fn from_spec(spec: &RewardSpec, arith_format_reward: f32) -> Self {
        let funcs = spec
            .resolved_funcs()
            .into_iter()
            .map(|f| {
                let func = match f.kind {
                    RewardKind::Math => RewardFn::Math,
                    RewardKind::Exact => RewardFn::Exact,
                    RewardKind::Arith => RewardFn::Arith {
                        format_reward: arith_format_reward,
                    },
                    RewardKind::Command => RewardFn::Command(CommandReward {
                        argv: f.command.clone(),
                        // `RewardSpec::validate` bounds the timeout; one it did not see
                        // saturates instead of panicking.
                        timeout: Duration::try_from_secs_f64(f.timeout_s.max(0.0))
                            .unwrap_or(Duration::MAX),
                    }),
                };
                (func, f.weight as f32)
            })
            .collect();
        Self { funcs }
    }

    /// The answer each response votes for under the first function (the one that decides
    /// correctness; see [`crate::reward::vote`]); `None` when that function extracts no answer
    /// (an external command).
    pub fn vote_keys(&self, inputs: &[RewardInput<'_>]) -> Option<Vec<Option<String>>> {
        let key: fn(&str) -> Option<String> = match &self.funcs.first()?.0 {
            RewardFn::Math => vote::math_vote_key,
            RewardFn::Exact => vote::exact_vote_key,
            RewardFn::Arith { .. } => vote::arith_vote_key,
            RewardFn::Command(_) => return None,
        };
        Some(inputs.iter().map(|i| key(i.response)).collect())
    }

    /// Scores a batch of responses, one score per input in order.
    pub fn score_batch(&self, inputs: &[RewardInput<'_>]) -> Result<Vec<RewardScore>> {
        let mut out = vec![
            RewardScore {
                reward: 0.0,
                correct: false
            };
            inputs.len()
        ];
        for (k, (func, weight)) in self.funcs.iter().enumerate() {
            let scores = func.score_batch(inputs)?;
            for (o, s) in out.iter_mut().zip(scores) {
                o.reward += weight * s;
                if k == 0 {
                    o.correct = s >= 1.0;
                }
            }
        }
        Ok(out)
    }
}
