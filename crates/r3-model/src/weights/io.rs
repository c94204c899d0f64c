//! Checkpoint files: read `model.safetensors` or a sharded `model.safetensors.index.json`,
//! write `config.json` + `model.safetensors` with the `format: pt` metadata HF expects.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use candle_core::{Device, Tensor};

use crate::error::{ModelError, Result};

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";
/// Largest `model.safetensors.index.json` read (real ones are well under 1 MB).
const MAX_INDEX_BYTES: u64 = 64 << 20;

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

/// The shard files named by an index.json's `weight_map`, deduplicated in order.
fn shard_files(index_path: &Path) -> Result<Vec<String>> {
    let (file, len) = super::header::open_regular(index_path)?;
    if len > MAX_INDEX_BYTES {
        return Err(checkpoint_err(
            index_path,
            format!("{len} bytes, more than an index may hold ({MAX_INDEX_BYTES})"),
        ));
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(file, MAX_INDEX_BYTES), &mut text)
        .map_err(io_err(index_path))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: index_path.to_path_buf(),
            source,
        })?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| checkpoint_err(index_path, "no `weight_map` object"))?;
    let mut files = BTreeSet::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            checkpoint_err(index_path, format!("shard of `{name}` is not a string"))
        })?;
        if file.contains('/') || file.contains("..") {
            return Err(checkpoint_err(
                index_path,
                format!("shard path `{file}` leaves the directory"),
            ));
        }
        files.insert(file.to_string());
    }
    Ok(files.into_iter().collect())
}

fn read_file(path: &Path, device: &Device, out: &mut HashMap<String, Tensor>) -> Result<()> {
    super::header::check_safetensors_file(path)?;
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    let tensors = candle_core::safetensors::load_buffer(&bytes, device)
        .map_err(|e| checkpoint_err(path, e))?;
    for (name, t) in tensors {
        if out.insert(name.clone(), t).is_some() {
            return Err(checkpoint_err(
                path,
                format!("tensor `{name}` appears in two shards"),
            ));
        }
    }
    Ok(())
}

/// All tensors of the checkpoint in `dir`, in their stored dtypes.
pub(super) fn read_checkpoint(dir: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    let index = dir.join(INDEX_FILE);
    let single = dir.join(SINGLE_FILE);
    if index.exists() {
        for file in shard_files(&index)? {
            read_file(&dir.join(file), device, &mut out)?;
        }
    } else if single.exists() {
        read_file(&single, device, &mut out)?;
    } else {
        return Err(checkpoint_err(
            dir,
            format!("neither {SINGLE_FILE} nor {INDEX_FILE} found"),
        ));
    }
    Ok(out)
}

/// Writes `config.json` and a single `model.safetensors` into `dir` (created if needed).
pub(super) fn write_checkpoint(
    dir: &Path,
    config_json: &str,
    tensors: &BTreeMap<String, Tensor>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, config_json).map_err(io_err(&config_path))?;
    let mut contiguous = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let t = t.detach().to_device(&Device::Cpu)?.contiguous()?;
        contiguous.push((name.clone(), t));
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let path = dir.join(SINGLE_FILE);
    safetensors::serialize_to_file(contiguous, Some(metadata), &path)
        .map_err(|e| checkpoint_err(&path, e))?;
    Ok(())
}
