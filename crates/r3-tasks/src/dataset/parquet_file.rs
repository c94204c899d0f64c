//! Reading a Parquet dataset (as pandas / pyarrow write it) through the `parquet` crate's
//! record API: each row becomes the JSON object a JSONL line would hold, so both formats
//! share one schema check. A `float` (f32) value is written as f32 prints it (`0.1`), not
//! widened to f64 first (`0.10000000149011612`).

use super::row::{DatasetRow, RowLocation};
use crate::error::{Result, TaskError};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, Row};
use serde_json::Value;
use std::path::Path;

/// Reads every row of a Parquet file.
pub fn read_parquet(path: &Path, prompt_key: &str) -> Result<Vec<DatasetRow>> {
    let read_err = |e: parquet::errors::ParquetError| TaskError::DatasetRead {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let file = std::fs::File::open(path).map_err(|source| TaskError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let reader = SerializedFileReader::new(file).map_err(read_err)?;
    let mut rows = Vec::new();
    for record in reader.get_row_iter(None).map_err(read_err)? {
        let at = RowLocation {
            path,
            row: rows.len(),
        };
        let record = record.map_err(|e| TaskError::DatasetLine {
            path: path.to_path_buf(),
            row: at.row,
            line: at.row + 1,
            reason: e.to_string(),
        })?;
        rows.push(DatasetRow::from_json(&row_json(&record), prompt_key, at)?);
    }
    Ok(rows)
}

/// A Parquet row as a JSON object, as [`Row::to_json_value`] writes it but for `float`
/// fields (see [`field_json`]).
fn row_json(row: &Row) -> Value {
    Value::Object(
        row.get_column_iter()
            .map(|(name, field)| (name.clone(), field_json(field)))
            .collect(),
    )
}

/// A Parquet value as JSON: an f32 through its own shortest decimal (`0.1f32` is `0.1`, as
/// pyarrow shows it), groups, lists and map values recursively, everything else as
/// [`Field::to_json_value`] writes it (a non-finite float is `null`, as there).
fn field_json(field: &Field) -> Value {
    match field {
        Field::Float(f) => f
            .to_string()
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map_or(Value::Null, Value::Number),
        Field::Group(row) => row_json(row),
        Field::ListInternal(list) => Value::Array(list.elements().iter().map(field_json).collect()),
        Field::MapInternal(map) => Value::Object(
            map.entries()
                .iter()
                .map(|(key, value)| {
                    let key = key.to_json_value();
                    let key = key.as_str().map_or_else(|| key.to_string(), str::to_owned);
                    (key, field_json(value))
                })
                .collect(),
        ),
        other => other.to_json_value(),
    }
}
