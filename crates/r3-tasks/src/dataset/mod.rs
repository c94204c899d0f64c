//! RL datasets in verl's schema: rows with a `prompt` (chat messages or plain text), a
//! `reward_model.ground_truth`, a `data_source` and free-form `extra_info`, read from JSONL
//! or Parquet files, and the seeded epoch order a trainer walks them in.

pub mod cursor;
pub mod jsonl;
pub mod load;
pub mod parquet_file;
pub mod parquet_write;
pub mod row;

pub use cursor::{DatasetCursor, DatasetPosition};
pub use load::{load_dataset, load_dataset_for, load_file, DatasetFormat, GroundTruthUse};
pub use parquet_write::write_parquet;
pub use row::{ground_truth_text, ChatMessage, DatasetRow, Prompt, RowLocation};
