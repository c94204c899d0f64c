//! Reading `metrics.jsonl` / `eval.jsonl` (as r3-train's `StepMetrics` writes them): one flat
//! JSON object per line. Any key but `step` may be absent or null, unknown keys are kept, and
//! a line that is not such an object is an error naming the file and line.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::ReportError;

/// Metric names of the run-directory schema that the report reads.
pub mod keys {
    /// Training step (required on every line).
    pub const STEP: &str = "step";
    /// k3 estimate of KL(π_rollout ‖ π_train) over response tokens (sampled from the
    /// rollout; the R3 paper's eq. 2, which it labels D_KL(π_train ‖ π_infer)), both sides at
    /// the rollout temperature.
    pub const K3_KL: &str = "mismatch.k3_kl";
    /// F(τ = 2): fraction of tokens whose train/infer probability ratio exceeds 2 either way.
    pub const F_TAU2: &str = "mismatch.f_tau2";
    /// Mean reward of the step's rollouts.
    pub const REWARD: &str = "reward_mean";
    /// Eval accuracy, only on eval steps.
    pub const EVAL_ACCURACY: &str = "eval_accuracy";
    /// Standard error of the eval accuracy over prompts (eval.jsonl).
    pub const EVAL_ACCURACY_STDERR: &str = "eval_accuracy_stderr";
    /// Gradient norm before clipping.
    pub const GRAD_NORM: &str = "grad_norm";
    /// Mean token entropy of the policy.
    pub const ENTROPY: &str = "entropy";
    /// Mean response length in tokens.
    pub const RESPONSE_LEN: &str = "response_len_mean";
    /// Replay mode: "disabled", "R2" or "R3".
    pub const REPLAY_MODE: &str = "replay_mode";
    /// Policy loss: "ppo" or "gspo".
    pub const LOSS: &str = "loss";
}

/// One step's record: the step, its numeric values and its text values.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MetricsRow {
    /// Training step.
    pub step: u64,
    numbers: BTreeMap<String, f64>,
    texts: BTreeMap<String, String>,
}

impl MetricsRow {
    /// Numeric value of `key` (booleans read as 0/1); `None` if absent, null or text.
    pub fn number(&self, key: &str) -> Option<f64> {
        self.numbers.get(key).copied()
    }

    /// Text value of `key`; `None` if absent, null or not a string.
    pub fn text(&self, key: &str) -> Option<&str> {
        self.texts.get(key).map(String::as_str)
    }
}

/// Reads the step: a non-negative integer (an integral float such as `3.0` is accepted).
fn parse_step(v: Option<&Value>) -> Result<u64, String> {
    let v = match v {
        None | Some(Value::Null) => return Err("no \"step\" (every line needs one)".into()),
        Some(v) => v,
    };
    if let Some(s) = v.as_u64() {
        return Ok(s);
    }
    match v.as_f64() {
        Some(f) if f >= 0.0 && f.fract() == 0.0 && f <= u64::MAX as f64 => Ok(f as u64),
        _ => Err(format!("\"step\" is {v}, not a non-negative integer")),
    }
}

/// Parses one non-blank line.
fn parse_line(line: &str) -> Result<MetricsRow, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not valid JSON: {e}"))?;
    let Value::Object(map) = value else {
        return Err("not a JSON object".into());
    };
    let mut row = MetricsRow {
        step: parse_step(map.get(keys::STEP))?,
        ..MetricsRow::default()
    };
    for (key, v) in map {
        match v {
            Value::Number(n) => {
                if let Some(f) = n.as_f64() {
                    row.numbers.insert(key, f);
                }
            }
            Value::Bool(b) => {
                row.numbers.insert(key, if b { 1.0 } else { 0.0 });
            }
            Value::String(s) => {
                row.texts.insert(key, s);
            }
            // Null means "not measured this step"; nested values are not part of the schema
            // and are skipped like any other unknown key.
            Value::Null | Value::Array(_) | Value::Object(_) => {}
        }
    }
    Ok(row)
}

/// Parses a JSONL metrics file's text. Blank lines are skipped. When a step appears more than
/// once (a run resumed from a checkpoint logs the steps after it again) the later line wins.
/// Rows come back sorted by step.
pub fn parse_metrics(text: &str, file: &Path) -> Result<Vec<MetricsRow>, ReportError> {
    let mut by_step = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row = parse_line(line).map_err(|what| ReportError::Malformed {
            file: file.to_path_buf(),
            line: i + 1,
            what,
        })?;
        by_step.insert(row.step, row);
    }
    Ok(by_step.into_values().collect())
}

/// Reads and parses a JSONL metrics file.
pub fn read_metrics(file: &Path) -> Result<Vec<MetricsRow>, ReportError> {
    let text = std::fs::read_to_string(file).map_err(ReportError::io(file))?;
    parse_metrics(&text, file)
}

/// `(step, value)` of every row that has a number for `key`, in step order.
pub fn series(rows: &[MetricsRow], key: &str) -> Vec<(u64, f64)> {
    rows.iter()
        .filter_map(|r| r.number(key).map(|v| (r.step, v)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<MetricsRow>, ReportError> {
        parse_metrics(text, Path::new("runs/a/metrics.jsonl"))
    }

    #[test]
    fn absent_null_unknown_and_typed_values() {
        let text = concat!(
            r#"{"step": 1, "reward_mean": 0.5, "mismatch.k3_kl": null, "replay_mode": "R3", "#,
            r#""skipped_update": true, "future.metric": 7, "nested": {"a": 1}}"#,
            "\n\n",
            r#"{"step": 2.0, "eval_accuracy": 0.25}"#,
            "\n"
        );
        let rows = parse(text).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].step, 1);
        assert_eq!(rows[0].number("reward_mean"), Some(0.5));
        assert_eq!(rows[0].number("mismatch.k3_kl"), None);
        assert_eq!(rows[0].text("replay_mode"), Some("R3"));
        assert_eq!(rows[0].number("skipped_update"), Some(1.0));
        assert_eq!(rows[0].number("future.metric"), Some(7.0));
        assert_eq!(rows[0].number("nested"), None);
        assert_eq!(rows[1].step, 2);
        assert_eq!(rows[1].number("reward_mean"), None);
        assert_eq!(series(&rows, "eval_accuracy"), vec![(2, 0.25)]);
    }

    #[test]
    fn repeated_steps_keep_the_later_line_and_rows_are_sorted() {
        let text = "{\"step\":3,\"x\":1}\n{\"step\":1,\"x\":2}\n{\"step\":3,\"x\":9}\n";
        let rows = parse(text).unwrap();
        assert_eq!(series(&rows, "x"), vec![(1, 2.0), (3, 9.0)]);
    }

    #[test]
    fn malformed_lines_name_file_and_line() {
        let cases = [
            ("{\"step\":0}\n{\"step\":1,", 2, "not valid JSON"),
            ("{\"step\":0}\n\n[1,2]\n", 3, "not a JSON object"),
            ("{\"reward_mean\":1}\n", 1, "no \"step\""),
            ("{\"step\":null}\n", 1, "no \"step\""),
            ("{\"step\":-1}\n", 1, "not a non-negative integer"),
            ("{\"step\":1.5}\n", 1, "not a non-negative integer"),
            ("{\"step\":\"7\"}\n", 1, "not a non-negative integer"),
        ];
        for (text, line, what) in cases {
            let err = parse(text).unwrap_err();
            let msg = err.to_string();
            assert!(
                matches!(err, ReportError::Malformed { line: l, .. } if l == line),
                "{msg}"
            );
            assert!(
                msg.starts_with(&format!("runs/a/metrics.jsonl:{line}: ")),
                "{msg}"
            );
            assert!(msg.contains(what), "{msg}");
        }
    }

    #[test]
    fn missing_file_is_an_io_error_naming_it() {
        let err = read_metrics(Path::new("/nonexistent/run/metrics.jsonl")).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/run/metrics.jsonl"),
            "{err}"
        );
    }
}
