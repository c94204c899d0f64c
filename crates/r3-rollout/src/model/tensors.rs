//! Reading named weight tensors (HF names) into plain f32 buffers, after checking the whole
//! map against r3-model's tensor spec (names, shapes, expert layout).

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use r3_model::{tensor_specs_in, Config, ExpertLayout, LoadOptions, Weights};

use crate::error::RolloutError;

/// A name → tensor map with HF names, routed experts either per expert (a checkpoint read
/// from disk) or fused `[E, 2I, H]` / `[E, H, I]` (the trainer's weights, handed over as
/// they are).
pub type TensorMap = BTreeMap<String, Tensor>;

/// Reads a HF model directory (single-file or sharded safetensors, per-expert or fused
/// experts) with r3-model's loader, which validates every tensor against `cfg` and refuses
/// non-finite values.
pub fn load_dir(dir: &Path, cfg: &Config) -> Result<TensorMap, RolloutError> {
    load_dir_with(dir, cfg, &LoadOptions::default())
}

/// [`load_dir`] with explicit load options (e.g. accepting non-finite weights).
pub fn load_dir_with(
    dir: &Path,
    cfg: &Config,
    options: &LoadOptions,
) -> Result<TensorMap, RolloutError> {
    let weights = Weights::load_with(dir, cfg, &Device::Cpu, options).map_err(|source| {
        RolloutError::WeightDir {
            dir: dir.to_path_buf(),
            source: Box::new(source),
        }
    })?;
    Ok(weights.into_map())
}

/// A tensor map checked against the spec of a config; hands out tensors as f32 buffers.
pub struct Fetcher<'a> {
    map: &'a TensorMap,
    layout: ExpertLayout,
}

impl<'a> Fetcher<'a> {
    /// Checks that `map` holds every tensor `cfg` requires with its shape (experts in either
    /// layout); a missing or mis-shaped tensor is an error naming it.
    pub fn new(map: &'a TensorMap, cfg: &Config) -> Result<Self, RolloutError> {
        let layout = ExpertLayout::detect(cfg, |name| map.contains_key(name));
        for spec in tensor_specs_in(cfg, layout) {
            let t = map
                .get(&spec.name)
                .ok_or_else(|| RolloutError::Weights(format!("missing tensor {}", spec.name)))?;
            if t.dims() != spec.shape.as_slice() {
                return Err(RolloutError::Weights(format!(
                    "tensor {} has shape {:?}, expected {:?}",
                    spec.name,
                    t.dims(),
                    spec.shape
                )));
            }
        }
        Ok(Fetcher { map, layout })
    }

    /// How the map holds the routed experts.
    pub fn layout(&self) -> ExpertLayout {
        self.layout
    }

    /// The tensor `name` as f32 values and its shape.
    pub fn get(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), RolloutError> {
        let t = self
            .map
            .get(name)
            .ok_or_else(|| RolloutError::Weights(format!("missing tensor {name}")))?;
        let values = to_f32_vec(t).map_err(|source| RolloutError::TensorConversion {
            name: name.to_string(),
            source,
        })?;
        Ok((values, t.dims().to_vec()))
    }

    /// The 1-D tensor `name` (a norm scale, a bias) as f32 values.
    pub fn vector(&self, name: &str) -> Result<Vec<f32>, RolloutError> {
        Ok(self.get(name)?.0)
    }
}

fn to_f32_vec(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}
