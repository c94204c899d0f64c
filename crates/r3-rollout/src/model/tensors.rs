//! Reading named weight tensors (HF names) into plain f32 buffers, after checking the whole
//! map against r3-model's tensor spec (names, shapes, expert layout).

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{CpuStorage, DType, Device, Storage, StorageRef, Tensor};
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

    /// The tensor `name` as f32 values and its shape: borrowed from the tensor's storage
    /// when it is a contiguous f32 tensor on the CPU (the trainer's are), else converted.
    pub fn get(&self, name: &str) -> Result<(F32Values<'a>, Vec<usize>), RolloutError> {
        let t = self
            .map
            .get(name)
            .ok_or_else(|| RolloutError::Weights(format!("missing tensor {name}")))?;
        let values = F32Values::of(t).map_err(|source| RolloutError::TensorConversion {
            name: name.to_string(),
            source: Box::new(source),
        })?;
        Ok((values, t.dims().to_vec()))
    }

    /// The 1-D tensor `name` (a norm scale, a bias) as f32 values.
    pub fn vector(&self, name: &str) -> Result<Vec<f32>, RolloutError> {
        Ok(self.get(name)?.0.to_vec())
    }
}

/// A tensor's values as f32: its storage, read-locked and borrowed in place, or a converted
/// copy. Dereferences to the flat row-major values.
pub enum F32Values<'a> {
    /// Elements `start..end` of a CPU f32 storage.
    Borrowed {
        /// The tensor's storage, read-locked while borrowed.
        storage: StorageRef<'a>,
        /// First element.
        start: usize,
        /// One past the last element.
        end: usize,
    },
    /// Values converted from another dtype, device or layout.
    Owned(Vec<f32>),
}

impl<'a> F32Values<'a> {
    /// The values of `t`, borrowed when it is a contiguous f32 tensor on the CPU.
    pub fn of(t: &'a Tensor) -> candle_core::Result<Self> {
        if t.dtype() == DType::F32 && t.device().is_cpu() {
            let (storage, layout) = t.storage_and_layout();
            if let (Some((start, end)), Storage::Cpu(CpuStorage::F32(_))) =
                (layout.contiguous_offsets(), &*storage)
            {
                return Ok(F32Values::Borrowed {
                    storage,
                    start,
                    end,
                });
            }
        }
        Ok(F32Values::Owned(
            t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        ))
    }
}

impl std::ops::Deref for F32Values<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            F32Values::Borrowed {
                storage,
                start,
                end,
            } => match &**storage {
                Storage::Cpu(CpuStorage::F32(v)) => &v[*start..*end],
                // `of` borrows only f32 CPU storage.
                _ => &[],
            },
            F32Values::Owned(v) => v,
        }
    }
}

/// `map` with every tensor a contiguous f32 tensor on the CPU (the others converted; the
/// rest shared, no copy), so reading it cannot fail halfway through.
pub fn cpu_f32_map(map: &TensorMap) -> Result<TensorMap, RolloutError> {
    map.iter()
        .map(|(name, t)| {
            let ready = t.dtype() == DType::F32 && t.device().is_cpu() && t.is_contiguous();
            let t = if ready {
                t.clone()
            } else {
                t.to_device(&Device::Cpu)
                    .and_then(|t| t.to_dtype(DType::F32))
                    .and_then(|t| t.contiguous())
                    .map_err(|source| RolloutError::TensorConversion {
                        name: name.clone(),
                        source: Box::new(source),
                    })?
            };
            Ok((name.clone(), t))
        })
        .collect()
}
