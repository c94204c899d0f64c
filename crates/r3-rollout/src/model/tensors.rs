//! Reading named weight tensors (HF names) into plain f32 buffers with shape checks.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::error::RolloutError;

/// A name → tensor map as the trainer holds it, or as read from a safetensors directory.
pub type TensorMap = HashMap<String, Tensor>;

/// Reads every tensor of a HF model directory (`model.safetensors`, or the shards listed in
/// `model.safetensors.index.json`).
pub fn load_dir(dir: &Path) -> Result<TensorMap, RolloutError> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<std::path::PathBuf> = if index.exists() {
        let text = std::fs::read_to_string(&index)?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            RolloutError::Weights(format!("{}: not valid JSON: {e}", index.display()))
        })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                RolloutError::Weights(format!("{}: no \"weight_map\" object", index.display()))
            })?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(str::to_owned))
            .collect();
        files.sort();
        files.dedup();
        files.into_iter().map(|f| dir.join(f)).collect()
    } else {
        vec![dir.join("model.safetensors")]
    };
    let mut out = TensorMap::new();
    for f in files {
        if !f.exists() {
            return Err(RolloutError::Weights(format!(
                "missing weight file {}",
                f.display()
            )));
        }
        let part = candle_core::safetensors::load(&f, &Device::Cpu)
            .map_err(|e| RolloutError::Weights(format!("{}: {e}", f.display())))?;
        out.extend(part);
    }
    Ok(out)
}

/// Looks up tensors by name and converts them to f32 host buffers.
pub struct Fetcher<'a> {
    map: &'a TensorMap,
}

impl<'a> Fetcher<'a> {
    /// Wraps a tensor map.
    pub fn new(map: &'a TensorMap) -> Self {
        Fetcher { map }
    }

    /// Whether a tensor of this name exists.
    pub fn has(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// The tensor `name` as f32 values, checked to have exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, RolloutError> {
        let t = self
            .map
            .get(name)
            .ok_or_else(|| RolloutError::Weights(format!("missing tensor {name}")))?;
        if t.dims() != shape {
            return Err(RolloutError::Weights(format!(
                "tensor {name} has shape {:?}, expected {shape:?}",
                t.dims()
            )));
        }
        to_f32_vec(t).map_err(|e| RolloutError::Weights(format!("tensor {name}: {e}")))
    }

    /// Slice `index` of the leading dimension of a 3-D tensor (fused experts), checked to be
    /// `[_, rows, cols]`.
    pub fn get_slice(
        &self,
        name: &str,
        index: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<f32>, RolloutError> {
        let t = self
            .map
            .get(name)
            .ok_or_else(|| RolloutError::Weights(format!("missing tensor {name}")))?;
        let dims = t.dims();
        if dims.len() != 3 || dims[1] != rows || dims[2] != cols || index >= dims[0] {
            return Err(RolloutError::Weights(format!(
                "tensor {name} has shape {dims:?}, expected [>{index}, {rows}, {cols}]"
            )));
        }
        to_f32_vec(&t.get(index)?)
            .map_err(|e| RolloutError::Weights(format!("tensor {name}[{index}]: {e}")))
    }
}

fn to_f32_vec(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}
