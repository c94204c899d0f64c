//! Reading named weight tensors (HF names) into plain f32 buffers with shape checks.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use r3_model::{Config, Weights};

use crate::error::RolloutError;

/// A name → tensor map with HF names and the canonical per-expert layout, as r3-model's
/// `Weights` holds it (the trainer's weights, or a checkpoint read from disk).
pub type TensorMap = BTreeMap<String, Tensor>;

/// Reads a HF model directory (single-file or sharded safetensors, per-expert or fused
/// experts) with r3-model's loader, which validates every tensor against `cfg`.
pub fn load_dir(dir: &Path, cfg: &Config) -> Result<TensorMap, RolloutError> {
    let weights =
        Weights::load(dir, cfg, &Device::Cpu).map_err(|source| RolloutError::WeightDir {
            dir: dir.to_path_buf(),
            source,
        })?;
    Ok(weights.into_map())
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
        to_f32_vec(t).map_err(|source| RolloutError::TensorConversion {
            name: name.to_string(),
            source,
        })
    }
}

fn to_f32_vec(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}
