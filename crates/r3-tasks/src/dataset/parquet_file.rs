//! Reading a Parquet dataset (as pandas / pyarrow write it) through the `parquet` crate's
//! record API: each row becomes the JSON object a JSONL line would hold, so both formats
//! share one schema check.

use super::row::{DatasetRow, RowLocation};
use crate::error::{Result, TaskError};
use parquet::file::reader::{FileReader, SerializedFileReader};
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
        rows.push(DatasetRow::from_json(
            &record.to_json_value(),
            prompt_key,
            at,
        )?);
    }
    Ok(rows)
}
