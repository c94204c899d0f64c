//! [`RewardInput`]: what every reward function sees of one response, and the JSON object a
//! command verifier reads per line.

use serde::Serialize;
use serde_json::Value;

/// What a reward function sees of one response (also the JSON a command verifier reads).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RewardInput<'a> {
    /// The prompt as the model saw it (rendered text).
    pub prompt: &'a str,
    /// The decoded response.
    pub response: &'a str,
    /// The row's ground truth as the dataset holds it (a command verifier reads this JSON
    /// value; the built-in rewards its text, [`crate::ground_truth_text`]).
    pub ground_truth: &'a Value,
    /// The row's data source.
    pub data_source: &'a str,
    /// The row's extra info.
    pub extra_info: &'a Value,
}
