//! Reading the answer out of a model completion and scoring it: the built-in arithmetic
//! task's rule here, and the configurable rewards for datasets in the submodules (math,
//! exact, an external command, weighted combinations).

pub mod answers;
pub mod combined;
pub mod command;
pub mod input;
pub mod spec;
pub mod vote;

pub use combined::{Reward, RewardScore};
pub use command::CommandReward;
pub use input::RewardInput;
pub use spec::{RewardFuncSpec, RewardKind, RewardSpec};

use serde::{Deserialize, Serialize};

/// Longest digit run accepted as an answer; longer runs are treated as garbage (no overflow).
const MAX_ANSWER_DIGITS: usize = 18;

/// Extracts the final answer: the integer (optional `-`, then 1–18 digits) right after the
/// first `#`. Anything after the number is ignored. Returns `None` when there is no `#`, no
/// digits follow it, or the digit run is too long to be an answer.
pub fn extract_answer(completion: &str) -> Option<i64> {
    let (_, after) = completion.split_once('#')?;
    let (negative, body) = match after.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, after),
    };
    let digits: &str = {
        let end = body
            .char_indices()
            .find(|(_, c)| !c.is_ascii_digit())
            .map_or(body.len(), |(i, _)| i);
        &body[..end]
    };
    if digits.is_empty() || digits.len() > MAX_ANSWER_DIGITS {
        return None;
    }
    let value: i64 = digits.parse().ok()?;
    Some(if negative { -value } else { value })
}

/// How a completion relates to the expected answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// The extracted answer equals the expected one.
    Correct,
    /// An answer was extracted but it is wrong.
    Wrong,
    /// No answer could be extracted.
    Unparsed,
}

/// Judges a completion against the expected answer.
pub fn judge(completion: &str, expected: i64) -> Verdict {
    match extract_answer(completion) {
        Some(a) if a == expected => Verdict::Correct,
        Some(_) => Verdict::Wrong,
        None => Verdict::Unparsed,
    }
}

/// How verdicts become scalar rewards.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RewardConfig {
    /// Reward for a well-formed but wrong answer (0.0 = plain exact match, the default).
    pub format_reward: f32,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self { format_reward: 0.0 }
    }
}

impl RewardConfig {
    /// Reward of a verdict: 1.0 correct, `format_reward` wrong, 0.0 unparsed.
    pub fn reward(&self, verdict: Verdict) -> f32 {
        match verdict {
            Verdict::Correct => 1.0,
            Verdict::Wrong => self.format_reward,
            Verdict::Unparsed => 0.0,
        }
    }

    /// Judges and scores a completion in one call.
    pub fn score(&self, completion: &str, expected: i64) -> f32 {
        self.reward(judge(completion, expected))
    }
}
