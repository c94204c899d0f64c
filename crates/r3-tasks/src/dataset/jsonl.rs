//! Reading a JSONL dataset: one JSON object per line; blank lines are skipped and do not
//! count as rows.

use super::row::{DatasetRow, RowLocation};
use crate::error::{Result, TaskError};
use std::path::Path;

/// Reads every row of a JSONL file.
pub fn read_jsonl(path: &Path, prompt_key: &str) -> Result<Vec<DatasetRow>> {
    let text = std::fs::read_to_string(path).map_err(|source| TaskError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_jsonl(&text, path, prompt_key)
}

/// Parses JSONL text; `path` only names the source in errors.
pub fn parse_jsonl(text: &str, path: &Path, prompt_key: &str) -> Result<Vec<DatasetRow>> {
    let mut rows = Vec::new();
    for (line_no, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = RowLocation {
            path,
            row: rows.len(),
        };
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| TaskError::DatasetLine {
                path: path.to_path_buf(),
                row: at.row,
                line: line_no + 1,
                reason: e.to_string(),
            })?;
        rows.push(DatasetRow::from_json(&value, prompt_key, at)?);
    }
    Ok(rows)
}

/// Writes rows as JSONL text (verl's schema, prompt under `prompt_key`).
pub fn to_jsonl(rows: &[DatasetRow], prompt_key: &str) -> String {
    let mut out = String::new();
    for r in rows {
        out.push_str(&r.to_json(prompt_key).to_string());
        out.push('\n');
    }
    out
}
