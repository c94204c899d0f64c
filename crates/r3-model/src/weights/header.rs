//! The safetensors header checked against the file before the file is read: the file is a
//! regular file, the header fits in it, every tensor's byte range is `dtype size × shape`
//! (checked arithmetic) and lies inside the file. A truncated or lying file is a clear
//! error naming the tensor, not an allocation or a bounds panic.

use std::io::Read;
use std::path::Path;

use crate::error::{ModelError, Result};

/// Largest header accepted (the safetensors format's own bound).
const MAX_HEADER_BYTES: u64 = 100 << 20;

fn bad(path: &Path, msg: impl ToString) -> ModelError {
    ModelError::Checkpoint {
        path: path.to_path_buf(),
        msg: msg.to_string(),
    }
}

/// Bytes per element of a safetensors dtype name; `None` for names this crate does not know.
fn dtype_bytes(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

/// Checks one header entry: its byte range has the size its dtype and shape give and ends
/// inside the `data_len` bytes that follow the header.
fn check_entry(path: &Path, name: &str, entry: &serde_json::Value, data_len: u64) -> Result<()> {
    let field = |key: &str| {
        entry.get(key).ok_or_else(|| {
            bad(
                path,
                format!("tensor `{name}` has no `{key}` in the header"),
            )
        })
    };
    let dtype = field("dtype")?
        .as_str()
        .ok_or_else(|| bad(path, format!("tensor `{name}`: `dtype` is not a string")))?;
    let size = dtype_bytes(dtype)
        .ok_or_else(|| bad(path, format!("tensor `{name}`: unknown dtype {dtype}")))?;
    let dims = field("shape")?
        .as_array()
        .ok_or_else(|| bad(path, format!("tensor `{name}`: `shape` is not an array")))?;
    let mut bytes = size;
    for d in dims {
        let d = d.as_u64().ok_or_else(|| {
            bad(
                path,
                format!("tensor `{name}`: dimension {d} is not a count"),
            )
        })?;
        bytes = bytes
            .checked_mul(d)
            .ok_or_else(|| bad(path, format!("tensor `{name}`: shape {dims:?} overflows")))?;
    }
    let offsets = field("data_offsets")?.as_array().map(Vec::as_slice);
    let (begin, end) = match offsets {
        Some([b, e]) => match (b.as_u64(), e.as_u64()) {
            (Some(b), Some(e)) if b <= e => (b, e),
            _ => return Err(bad(path, format!("tensor `{name}`: bad data_offsets"))),
        },
        _ => return Err(bad(path, format!("tensor `{name}`: bad data_offsets"))),
    };
    if end - begin != bytes {
        return Err(bad(
            path,
            format!(
                "tensor `{name}` ({dtype}, shape {dims:?}) needs {bytes} bytes, the header gives it {}",
                end - begin
            ),
        ));
    }
    if end > data_len {
        return Err(bad(
            path,
            format!(
                "file is truncated: tensor `{name}` ends at data byte {end}, the file holds {data_len}"
            ),
        ));
    }
    Ok(())
}

/// Opens `path` only when it is a regular file (after symlinks) and returns it with its
/// length. The type is checked before opening because opening a FIFO for reading blocks until
/// a writer appears, which would hang a loader (e.g. the server's weight updates).
pub(super) fn open_regular(path: &Path) -> Result<(std::fs::File, u64)> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(bad(path, "not a regular file"));
    }
    let file = std::fs::File::open(path).map_err(io)?;
    Ok((file, meta.len()))
}

/// Checks the header of the safetensors file at `path` against the file's size, before the
/// tensor data is read.
pub(super) fn check_safetensors_file(path: &Path) -> Result<()> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let (mut file, file_len) = open_regular(path)?;
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes).map_err(|_| {
        bad(
            path,
            format!("file is {file_len} bytes, too short for a safetensors header"),
        )
    })?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES {
        return Err(bad(
            path,
            format!("header length {header_len} exceeds {MAX_HEADER_BYTES} bytes"),
        ));
    }
    let data_len = file_len.checked_sub(8 + header_len).ok_or_else(|| {
        bad(
            path,
            format!(
                "file is truncated: {file_len} bytes, the header alone says {}",
                8 + header_len
            ),
        )
    })?;
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let value: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| bad(path, format!("header is not JSON: {e}")))?;
    let entries = value
        .as_object()
        .ok_or_else(|| bad(path, "header is not a JSON object"))?;
    for (name, entry) in entries {
        if name != "__metadata__" {
            check_entry(path, name, entry, data_len)?;
        }
    }
    Ok(())
}
