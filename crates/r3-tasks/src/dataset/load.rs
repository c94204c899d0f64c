//! Loading dataset files by their extension (`.jsonl`, `.json`: an array of rows or lines,
//! `.parquet`).

use super::jsonl::{read_json, read_jsonl};
use super::parquet_file::read_parquet;
use super::row::{DatasetRow, RowLocation};
use crate::error::{Result, TaskError};
use crate::reward::RewardKind;
use std::path::{Path, PathBuf};

/// A dataset file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatasetFormat {
    /// One JSON object per line (`.jsonl`).
    Jsonl,
    /// A JSON array of row objects, or one object per line (`.json`), as HF `datasets`'
    /// json loader reads both.
    Json,
    /// Apache Parquet.
    Parquet,
}

impl DatasetFormat {
    /// The format a file name says (`.jsonl`, `.json`, `.parquet`).
    pub fn of(path: &Path) -> Result<Self> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("jsonl") => Ok(DatasetFormat::Jsonl),
            Some("json") => Ok(DatasetFormat::Json),
            Some("parquet") => Ok(DatasetFormat::Parquet),
            _ => Err(TaskError::DatasetRead {
                path: path.to_path_buf(),
                reason: "unknown dataset format: the name must end in .jsonl, .json or .parquet"
                    .into(),
            }),
        }
    }
}

/// Reads one dataset file.
pub fn load_file(path: &Path, prompt_key: &str) -> Result<Vec<DatasetRow>> {
    match DatasetFormat::of(path)? {
        DatasetFormat::Jsonl => read_jsonl(path, prompt_key),
        DatasetFormat::Json => read_json(path, prompt_key),
        DatasetFormat::Parquet => read_parquet(path, prompt_key),
    }
}

/// What a run's reward needs of each row's `reward_model.ground_truth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroundTruthUse {
    /// Any JSON value: only `command` verifiers read it, as the dataset holds it.
    Any,
    /// A string or a number: this built-in reward compares it as text.
    Text(RewardKind),
}

/// Reads and concatenates dataset files in order (any ground truth); a file without rows is
/// an error.
pub fn load_dataset(paths: &[PathBuf], prompt_key: &str) -> Result<Vec<DatasetRow>> {
    load_dataset_for(paths, prompt_key, GroundTruthUse::Any)
}

/// Reads and concatenates dataset files in order, every row's ground truth checked against
/// what the reward needs (an error naming file, row and field); a file without rows is an
/// error.
pub fn load_dataset_for(
    paths: &[PathBuf],
    prompt_key: &str,
    truth: GroundTruthUse,
) -> Result<Vec<DatasetRow>> {
    let mut rows = Vec::new();
    for path in paths {
        let part = load_file(path, prompt_key)?;
        if part.is_empty() {
            return Err(TaskError::DatasetRead {
                path: path.clone(),
                reason: "holds no rows".into(),
            });
        }
        if let GroundTruthUse::Text(reward) = truth {
            for (row, r) in part.iter().enumerate() {
                r.check_text_ground_truth(reward, RowLocation { path, row })?;
            }
        }
        rows.extend(part);
    }
    Ok(rows)
}
