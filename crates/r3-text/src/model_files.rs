//! Reading the optional JSON files of an HF model directory.

use std::path::Path;

use crate::error::{Result, TextError};

/// Parses `dir/name` as JSON; `None` when the file does not exist.
pub(crate) fn read_json_opt(dir: &Path, name: &str) -> Result<Option<serde_json::Value>> {
    let path = dir.join(name);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(TextError::Io { path, source }),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TextError::Json { path, source })
}

/// Token ids of a field that is an int, a list of ints, absent or null.
pub(crate) fn id_list(
    value: Option<&serde_json::Value>,
    path: &Path,
    field: &str,
) -> Result<Vec<u32>> {
    let bad = |reason: String| TextError::BadField {
        path: path.to_path_buf(),
        field: field.to_string(),
        reason,
    };
    let as_id = |v: &serde_json::Value| -> Result<u32> {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad(format!("{v} is not a token id")))
    };
    match value {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(items)) => items.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}
