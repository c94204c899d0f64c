//! A configured reward: a weighted sum of reward functions evaluated on a batch of
//! responses. The first function decides correctness (score >= 1), so an accuracy metric
//! stays meaningful when format or length terms are added behind it.

use std::time::Duration;

use crate::error::Result;
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
            RewardFn::Math => Ok(inputs
                .iter()
                .map(|i| math_reward(i.response, i.ground_truth))
                .collect()),
            RewardFn::Exact => Ok(inputs
                .iter()
                .map(|i| exact_reward(i.response, i.ground_truth))
                .collect()),
            RewardFn::Arith { format_reward } => inputs
                .iter()
                .enumerate()
                .map(|(row, i)| arith_reward(i.response, i.ground_truth, *format_reward, row))
                .collect(),
            RewardFn::Command(c) => c.score_batch(inputs),
        }
    }
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
