//! Writing rows as a Parquet file in verl's schema (what `r3 data generate` ships): the
//! prompt as a `LIST` of `{role, content}` structs (or a string column), `data_source`,
//! `reward_model {style, ground_truth}` and `extra_info` as a struct whose string and
//! integer fields are the same on every row. Snappy-compressed, like pyarrow's default.

use std::path::Path;
use std::sync::Arc;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use serde_json::Value;

use super::row::{ground_truth_text, DatasetRow, Prompt};
use crate::error::{Result, TaskError};

/// One leaf column's data: values, plus definition / repetition levels for list leaves.
enum Column {
    Text(Vec<ByteArray>, Option<(Vec<i16>, Vec<i16>)>),
    Int(Vec<i64>),
}

/// The type of one `extra_info` field.
#[derive(Clone, Copy, PartialEq)]
enum ExtraType {
    Text,
    Int,
}

fn write_err(path: &Path, reason: impl Into<String>) -> TaskError {
    TaskError::DatasetRead {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The `extra_info` fields of the first row with their types; every row must match.
fn extra_fields(rows: &[DatasetRow], path: &Path) -> Result<Vec<(String, ExtraType)>> {
    let Some(Value::Object(first)) = rows.first().map(|r| &r.extra_info) else {
        return Ok(Vec::new());
    };
    let mut fields = Vec::new();
    for (k, v) in first {
        let ty = match v {
            Value::String(_) => ExtraType::Text,
            Value::Number(n) if n.is_i64() => ExtraType::Int,
            _ => {
                return Err(write_err(
                    path,
                    format!("extra_info.{k}: only string and integer fields can be written"),
                ))
            }
        };
        fields.push((k.clone(), ty));
    }
    Ok(fields)
}

/// Writes `rows` to `path`, prompt column named `prompt_key`.
pub fn write_parquet(path: &Path, rows: &[DatasetRow], prompt_key: &str) -> Result<()> {
    let messages = matches!(rows.first().map(|r| &r.prompt), Some(Prompt::Messages(_)));
    let extra = extra_fields(rows, path)?;
    let mut schema = String::from("message verl {\n  required binary data_source (UTF8);\n");
    if messages {
        schema.push_str(&format!(
            "  required group {prompt_key} (LIST) {{\n    repeated group list {{\n      required group element {{\n        required binary role (UTF8);\n        required binary content (UTF8);\n      }}\n    }}\n  }}\n"
        ));
    } else {
        schema.push_str(&format!("  required binary {prompt_key} (UTF8);\n"));
    }
    schema.push_str("  required group reward_model {\n    required binary style (UTF8);\n    required binary ground_truth (UTF8);\n  }\n");
    if !extra.is_empty() {
        schema.push_str("  required group extra_info {\n");
        for (k, ty) in &extra {
            match ty {
                ExtraType::Text => schema.push_str(&format!("    required binary {k} (UTF8);\n")),
                ExtraType::Int => schema.push_str(&format!("    required int64 {k};\n")),
            }
        }
        schema.push_str("  }\n");
    }
    schema.push('}');

    let text = |s: &str| ByteArray::from(s.as_bytes().to_vec());
    let mut columns = vec![Column::Text(
        rows.iter().map(|r| text(&r.data_source)).collect(),
        None,
    )];
    if messages {
        let (mut roles, mut contents, mut def, mut rep) = (vec![], vec![], vec![], vec![]);
        for (i, r) in rows.iter().enumerate() {
            let Prompt::Messages(m) = &r.prompt else {
                return Err(write_err(
                    path,
                    format!("row {i}: prompts must all be messages"),
                ));
            };
            if m.is_empty() {
                return Err(write_err(path, format!("row {i}: empty message list")));
            }
            for (j, msg) in m.iter().enumerate() {
                roles.push(text(&msg.role));
                contents.push(text(&msg.content));
                def.push(1);
                rep.push(if j == 0 { 0 } else { 1 });
            }
        }
        columns.push(Column::Text(roles, Some((def.clone(), rep.clone()))));
        columns.push(Column::Text(contents, Some((def, rep))));
    } else {
        let mut values = Vec::with_capacity(rows.len());
        for (i, r) in rows.iter().enumerate() {
            let Prompt::Text(t) = &r.prompt else {
                return Err(write_err(
                    path,
                    format!("row {i}: prompts must all be text"),
                ));
            };
            values.push(text(t));
        }
        columns.push(Column::Text(values, None));
    }
    columns.push(Column::Text(
        rows.iter().map(|_| text("rule")).collect(),
        None,
    ));
    let mut truths = Vec::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        // The column is text (verl's GSM8K files hold strings); a number goes as JSON writes it.
        let Some(t) = ground_truth_text(&r.ground_truth) else {
            return Err(write_err(
                path,
                format!("row {i}: the ground truth must be a string or a number"),
            ));
        };
        truths.push(text(&t));
    }
    columns.push(Column::Text(truths, None));
    for (k, ty) in &extra {
        let mut strings = Vec::new();
        let mut ints = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            match (ty, r.extra_info.get(k)) {
                (ExtraType::Text, Some(Value::String(s))) => strings.push(text(s)),
                (ExtraType::Int, Some(Value::Number(n))) if n.is_i64() => {
                    ints.push(n.as_i64().unwrap_or_default())
                }
                _ => {
                    return Err(write_err(
                        path,
                        format!("row {i}: extra_info.{k} differs in type from row 0"),
                    ))
                }
            }
        }
        columns.push(match ty {
            ExtraType::Text => Column::Text(strings, None),
            ExtraType::Int => Column::Int(ints),
        });
    }

    let pq = |e: parquet::errors::ParquetError| write_err(path, e.to_string());
    let schema = Arc::new(parse_message_type(&schema).map_err(pq)?);
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .build(),
    );
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let io = |source| TaskError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::create(&tmp).map_err(io)?;
    let mut writer = SerializedFileWriter::new(file, schema, props).map_err(pq)?;
    let mut group = writer.next_row_group().map_err(pq)?;
    let mut columns = columns.into_iter();
    while let Some(mut col) = group.next_column().map_err(pq)? {
        let data = columns
            .next()
            .ok_or_else(|| write_err(path, "schema has more columns than data"))?;
        match data {
            Column::Text(values, levels) => {
                let (def, rep) = match &levels {
                    Some((d, r)) => (Some(d.as_slice()), Some(r.as_slice())),
                    None => (None, None),
                };
                col.typed::<ByteArrayType>()
                    .write_batch(&values, def, rep)
                    .map_err(pq)?;
            }
            Column::Int(values) => {
                col.typed::<Int64Type>()
                    .write_batch(&values, None, None)
                    .map_err(pq)?;
            }
        }
        col.close().map_err(pq)?;
    }
    group.close().map_err(pq)?;
    writer.close().map_err(pq)?;
    std::fs::rename(&tmp, path).map_err(io)
}
