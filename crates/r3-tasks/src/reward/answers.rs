//! The rule-based rewards of a single response against its ground truth: `math` (final
//! answer extracted and compared numerically), `exact` (the trimmed response equals the
//! ground truth) and `arith` (the built-in task's `#N` rule).

use crate::error::{Result, TaskError};
use crate::math_answer::{extract_math_answer, math_equal};
use crate::reward::RewardConfig;

/// 1.0 when the final answer of `response` (`\boxed{}`, `#### N`, or the last number)
/// equals `ground_truth` (numerically where both are numbers), else 0.0.
pub fn math_reward(response: &str, ground_truth: &str) -> f32 {
    match extract_math_answer(response) {
        Some((answer, _)) if math_equal(&answer, ground_truth) => 1.0,
        _ => 0.0,
    }
}

/// 1.0 when the response, trimmed, is exactly the ground truth, trimmed; else 0.0.
pub fn exact_reward(response: &str, ground_truth: &str) -> f32 {
    if response.trim() == ground_truth.trim() {
        1.0
    } else {
        0.0
    }
}

/// The built-in arithmetic rule (`#N` right after the first `#`, exact integer match, and
/// `format_reward` for a well-formed wrong answer); the ground truth must be an integer.
pub fn arith_reward(
    response: &str,
    ground_truth: &str,
    format_reward: f32,
    row: usize,
) -> Result<f32> {
    let expected: i64 = ground_truth
        .trim()
        .parse()
        .map_err(|_| TaskError::RewardRow {
            row,
            reason: format!("the arith reward needs an integer ground truth, got {ground_truth:?}"),
        })?;
    Ok(RewardConfig { format_reward }.score(response, expected))
}
