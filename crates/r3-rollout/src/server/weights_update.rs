//! `/update_weights_from_disk` made safe: which directories a client may name (under the
//! weights root, one refusal message that reveals nothing about the file system), and
//! reading a checkpoint on a loader thread so the engine keeps serving — only regular files
//! (a FIFO cannot block the reader), each file's size checked against its safetensors header
//! before its data is read, every tensor present, shaped as the config says and finite —
//! into engine-layout weights that the engine worker then swaps in at once.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use r3_model::{Config, ModelError, Weights};

use super::error::ApiError;
use crate::dtype::Dtype;
use crate::error::RolloutError;
use crate::model::tensors::TensorMap;
use crate::model::weights::ModelWeights;

/// The one answer to a `model_path` the server will not read, whatever the reason (outside
/// the weights root, missing, not a directory, unreadable), so that answers cannot be used
/// to probe the file system.
pub const REFUSED_PATH: &str =
    "model_path is not a weight directory this server may load (see the server's --weights-root)";

/// Largest safetensors header (the format's own limit is 100 MB).
const MAX_HEADER_BYTES: u64 = 100 << 20;
/// Largest `model.safetensors.index.json`.
const MAX_INDEX_BYTES: u64 = 64 << 20;
const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// The directory `requested` resolves to, if a client may load weights from it: an existing
/// directory whose canonical path lies under the canonical `root` (any directory when `root`
/// is None). Every refusal is the same [`REFUSED_PATH`] 400.
pub fn allowed_dir(root: Option<&Path>, requested: &str) -> Result<PathBuf, ApiError> {
    let refused = || ApiError::bad_request(REFUSED_PATH);
    let dir = Path::new(requested).canonicalize().map_err(|_| refused())?;
    if let Some(root) = root {
        let root = root.canonicalize().map_err(|_| refused())?;
        if !dir.starts_with(&root) {
            return Err(refused());
        }
    }
    if !dir.is_dir() {
        return Err(refused());
    }
    Ok(dir)
}

/// Builds engine weights for one model (its config and compute precision) from checkpoint
/// directories; cheap to clone, used on a loader thread.
#[derive(Debug, Clone)]
pub struct WeightStager {
    cfg: Config,
    dtype: Dtype,
}

impl WeightStager {
    /// A stager for weights of `cfg` at `dtype`.
    pub fn new(cfg: Config, dtype: Dtype) -> Self {
        WeightStager { cfg, dtype }
    }

    /// Reads `dir` and checks it completely; the engine is not touched.
    pub fn stage(&self, dir: &Path) -> Result<ModelWeights, RolloutError> {
        let dir_err = |source: ModelError| RolloutError::WeightDir {
            dir: dir.to_path_buf(),
            source: Box::new(source),
        };
        let tensors = read_checkpoint(dir).map_err(dir_err)?;
        let weights = Weights::from_map(tensors);
        weights.validate(&self.cfg).map_err(dir_err)?;
        let map: TensorMap = weights.into_map();
        check_finite(&map).map_err(|msg| {
            dir_err(ModelError::Checkpoint {
                path: dir.to_path_buf(),
                msg,
            })
        })?;
        ModelWeights::from_tensors(&self.cfg, &map, self.dtype)
    }
}

/// Every tensor finite; otherwise a message naming the first bad tensor (in name order),
/// how many of its values are not finite, and the first one.
pub fn check_finite(map: &TensorMap) -> Result<(), String> {
    for (name, t) in map {
        let values = t
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| format!("tensor {name}: {e}"))?;
        let bad = values.iter().filter(|v| !v.is_finite()).count();
        if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(format!(
                "tensor {name} has {bad} non-finite values (first: {v} at flat index {i})"
            ));
        }
    }
    Ok(())
}

/// All tensors of the single-file or sharded checkpoint in `dir`, read with
/// [`read_safetensors`].
fn read_checkpoint(dir: &Path) -> Result<BTreeMap<String, Tensor>, ModelError> {
    let index = dir.join(INDEX_FILE);
    let single = dir.join(SINGLE_FILE);
    let files = if index.exists() {
        shard_files(&index)?
    } else if single.exists() {
        vec![SINGLE_FILE.to_string()]
    } else {
        return Err(checkpoint_err(
            dir,
            format!("neither {SINGLE_FILE} nor {INDEX_FILE} found"),
        ));
    };
    let mut out = BTreeMap::new();
    for file in files {
        let path = dir.join(&file);
        for (name, t) in read_safetensors(&path)? {
            if out.insert(name.clone(), t).is_some() {
                return Err(checkpoint_err(
                    &path,
                    format!("tensor `{name}` appears in two shards"),
                ));
            }
        }
    }
    Ok(out)
}

/// The shard files an index names (plain file names only), deduplicated and sorted.
fn shard_files(index: &Path) -> Result<Vec<String>, ModelError> {
    let (mut file, len) = open_regular(index)?;
    if len > MAX_INDEX_BYTES {
        return Err(checkpoint_err(
            index,
            format!("{len} bytes; an index holds at most {MAX_INDEX_BYTES}"),
        ));
    }
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(io_err(index))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: index.to_path_buf(),
            source,
        })?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| checkpoint_err(index, "no `weight_map` object"))?;
    let mut files = std::collections::BTreeSet::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| checkpoint_err(index, format!("shard of `{name}` is not a string")))?;
        if file.is_empty() || file.contains('/') || file.contains('\\') || file.contains("..") {
            return Err(checkpoint_err(
                index,
                format!("shard path `{file}` leaves the directory"),
            ));
        }
        files.insert(file.to_string());
    }
    Ok(files.into_iter().collect())
}

/// Opens `path` only if it is a regular file (after symlinks); returns it and its length.
/// The open itself does not block on a FIFO (non-blocking on unix), and the type is checked
/// on the opened handle, so a file swapped after a check cannot slip through.
fn open_regular(path: &Path) -> Result<(File, u64), ModelError> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(io_err(path))?;
    let meta = file.metadata().map_err(io_err(path))?;
    if !meta.is_file() {
        return Err(checkpoint_err(path, "not a regular file"));
    }
    Ok((file, meta.len()))
}

/// Reads one safetensors file: the header's declared data size must match the file's size
/// before the data is read, so a truncated, padded or huge file costs no allocation.
fn read_safetensors(path: &Path) -> Result<Vec<(String, Tensor)>, ModelError> {
    let (mut file, len) = open_regular(path)?;
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix).map_err(io_err(path))?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_BYTES || header_len > len.saturating_sub(8) {
        return Err(checkpoint_err(
            path,
            format!("header of {header_len} bytes in a file of {len} bytes"),
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io_err(path))?;
    let data_len = declared_data_len(&header).map_err(|msg| checkpoint_err(path, msg))?;
    if 8 + header_len + data_len != len {
        return Err(checkpoint_err(
            path,
            format!(
                "the header declares {data_len} data bytes; the file holds {}",
                len - 8 - header_len
            ),
        ));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    bytes.extend_from_slice(&prefix);
    bytes.extend_from_slice(&header);
    file.read_to_end(&mut bytes).map_err(io_err(path))?;
    if bytes.len() as u64 != len {
        return Err(checkpoint_err(path, "the file changed while it was read"));
    }
    let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
        .map_err(|e| checkpoint_err(path, e))?;
    Ok(tensors.into_iter().collect())
}

/// The end of the last tensor's data according to a safetensors JSON header.
fn declared_data_len(header: &[u8]) -> Result<u64, String> {
    let value: serde_json::Value =
        serde_json::from_slice(header).map_err(|e| format!("header is not JSON: {e}"))?;
    let entries = value.as_object().ok_or("header is not a JSON object")?;
    let mut end = 0u64;
    for (name, entry) in entries {
        if name == "__metadata__" {
            continue;
        }
        let offsets = entry
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .filter(|o| o.len() == 2)
            .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
            .ok_or_else(|| format!("tensor `{name}` has no valid data_offsets"))?;
        if offsets.0 > offsets.1 {
            return Err(format!("tensor `{name}` has data_offsets {offsets:?}"));
        }
        end = end.max(offsets.1);
    }
    Ok(end)
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn checkpoint_err(path: &Path, msg: impl ToString) -> ModelError {
    ModelError::Checkpoint {
        path: path.to_path_buf(),
        msg: msg.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_length_is_the_largest_offset() {
        let h = br#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
        assert_eq!(declared_data_len(h), Ok(12));
        let bad = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#;
        assert!(declared_data_len(bad).is_err());
    }

    #[test]
    fn non_finite_values_name_the_tensor() {
        let mut map = TensorMap::new();
        let ok = Tensor::new(&[1.0f32, 2.0], &Device::Cpu).expect("tensor");
        let bad = Tensor::new(&[1.0f32, f32::NAN, f32::INFINITY], &Device::Cpu).expect("tensor");
        map.insert("a.weight".into(), ok);
        assert_eq!(check_finite(&map), Ok(()));
        map.insert("b.weight".into(), bad);
        let msg = check_finite(&map).expect_err("NaN refused");
        assert!(
            msg.contains("b.weight") && msg.contains("2 non-finite"),
            "{msg}"
        );
    }
}
