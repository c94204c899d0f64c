//! Reading a JSONL dataset: one JSON object per line; blank lines are skipped and do not
//! count as rows. A `.json` file may instead hold one JSON array of row objects, as HF
//! `datasets`' json loader (verl's reader of `.json` files) accepts.

use super::row::{DatasetRow, RowLocation};
use crate::error::{Result, TaskError};
use serde_json::Value;
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

/// Reads a `.json` file: a JSON array of rows when its first non-blank character is `[`,
/// otherwise JSONL.
pub fn read_json(path: &Path, prompt_key: &str) -> Result<Vec<DatasetRow>> {
    let text = std::fs::read_to_string(path).map_err(|source| TaskError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if text.trim_start().starts_with('[') {
        parse_json_array(&text, path, prompt_key)
    } else {
        parse_jsonl(&text, path, prompt_key)
    }
}

/// Parses a JSON array of row objects (`[{…}, {…}]`, any layout); the row index of an
/// error is the array index. Rows are read one at a time, so a syntax error names its row
/// and line too.
pub fn parse_json_array(text: &str, path: &Path, prompt_key: &str) -> Result<Vec<DatasetRow>> {
    let line_of = |rest: &str| text[..text.len() - rest.len()].matches('\n').count() + 1;
    let bad = |row: usize, rest: &str, reason: String| TaskError::DatasetLine {
        path: path.to_path_buf(),
        row,
        line: line_of(rest),
        reason,
    };
    let mut rest = text.trim_start();
    rest = rest.strip_prefix('[').unwrap_or(rest).trim_start();
    let mut rows = Vec::new();
    if let Some(after) = rest.strip_prefix(']') {
        rest = after;
    } else {
        loop {
            let row = rows.len();
            let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
            let value = match stream.next() {
                Some(Ok(value)) => value,
                Some(Err(e)) => return Err(bad(row, rest, e.to_string())),
                None => return Err(bad(row, rest, "the array is not closed by `]`".into())),
            };
            let at = RowLocation { path, row };
            rows.push(DatasetRow::from_json(&value, prompt_key, at)?);
            rest = rest[stream.byte_offset()..].trim_start();
            match rest.as_bytes().first() {
                Some(b',') => rest = rest[1..].trim_start(),
                Some(b']') => {
                    rest = &rest[1..];
                    break;
                }
                _ => return Err(bad(row, rest, "expected `,` or `]` after the row".into())),
            }
        }
    }
    if !rest.trim().is_empty() {
        return Err(TaskError::DatasetRead {
            path: path.to_path_buf(),
            reason: format!(
                "text after the array's closing `]` (line {})",
                line_of(rest.trim_start())
            ),
        });
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
