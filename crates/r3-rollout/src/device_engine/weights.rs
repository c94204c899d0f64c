//! The device engine's weights: built on its device from HF-named tensors (a copy of its
//! own, experts fused, matrices narrowed in bf16 / f16), swapped in by a weight update, and
//! the budgets checked against the device's free memory once they are loaded.

use std::path::Path;

use candle_core::{DType, Device};
use r3_model::{Config, HeldTensors, LoadOptions, Model, Precision, Weights};

use super::memory::mib;
use super::{DeviceEngine, DeviceEngineConfig};
use crate::dtype::{Dtype, RouterDtype};
use crate::error::RolloutError;
use crate::model::tensors::{load_dir_with, TensorMap};

impl DeviceEngine {
    /// Loads new weights (same config) from HF-named tensors, e.g. the trainer's; bumps the
    /// weight version. A running batch continues under them (its route rows carry the
    /// version that produced them). A tensor the precision cannot hold is refused and the
    /// old weights are kept.
    pub fn update_weights(&mut self, tensors: &TensorMap) -> Result<u64, RolloutError> {
        let held = HeldTensors::check(tensors, self.cfg.dtype.weight_precision())?;
        self.update_weights_held(held)
    }

    /// [`DeviceEngine::update_weights`] from tensors whose range is already known
    /// ([`HeldTensors`]): scanned only where that proof does not cover this engine's
    /// precision.
    pub fn update_weights_held(&mut self, held: HeldTensors<'_>) -> Result<u64, RolloutError> {
        held.ensure(self.cfg.dtype.weight_precision())?;
        self.swap_in(held.tensors())
    }

    /// [`DeviceEngine::update_weights`] from a safetensors directory.
    pub fn update_weights_from_dir(&mut self, dir: &Path) -> Result<u64, RolloutError> {
        // The loader checks every value against the engine's precision, so the tensors are
        // not scanned a second time.
        let options = LoadOptions {
            precision: self.cfg.dtype.weight_precision(),
            ..LoadOptions::default()
        };
        let tensors = load_dir_with(dir, &self.model_cfg, &options)?;
        self.swap_in(&tensors)
    }

    /// Builds the model from checked tensors, bumps the weight version and empties the
    /// prefix cache (its keys, values and routes are the old weights'; the version in the
    /// block hashes already keeps them from matching, this frees them).
    fn swap_in(&mut self, tensors: &TensorMap) -> Result<u64, RolloutError> {
        self.model = build_model(&self.model_cfg, tensors, &self.cfg, &self.device)?;
        self.version += 1;
        self.flush_prefix_cache();
        Ok(self.version)
    }
}

/// Refuses budgets that the device cannot hold beside the loaded weights: on a GPU the KV
/// cache, activation and prefix-cache budgets together must fit the memory its driver
/// reports free once the model is on it, or admission's refusals would not keep a step from
/// running out of memory. The CPU reports nothing (its memory is the operating system's).
pub(super) fn check_budgets_fit(
    cfg: &DeviceEngineConfig,
    device: &Device,
) -> Result<(), RolloutError> {
    let Some((free, total)) = r3_model::device::device_memory(device)? else {
        return Ok(());
    };
    let prefix = if cfg.prefix_cache {
        cfg.prefix_cache_bytes
    } else {
        0
    };
    let budgets = cfg.kv_cache_bytes + cfg.activation_bytes + prefix;
    if budgets <= free {
        return Ok(());
    }
    Err(RolloutError::InvalidConfig(format!(
        "the device engine's budgets (KV cache {:.0} MiB + activations {:.0} MiB + prefix cache \
         {:.0} MiB = {:.0} MiB) exceed what {} has free with the model loaded ({:.0} MiB of \
         {:.0} MiB): lower kv_cache_bytes, activation_bytes or prefix_cache_bytes",
        mib(cfg.kv_cache_bytes),
        mib(cfg.activation_bytes),
        mib(prefix),
        mib(budgets),
        cfg.device,
        mib(free),
        mib(total)
    )))
}

/// r3-model's model on `device` from HF-named tensors: f32 copies on the device, experts
/// fused, and in bf16 / f16 the weight matrices stored in that format
/// (`Weights::narrow_matrices`: the values the forward rounds them to at every matmul, at
/// half the memory and with no cast per step).
pub(super) fn build_model(
    model_cfg: &Config,
    tensors: &TensorMap,
    cfg: &DeviceEngineConfig,
    device: &Device,
) -> Result<Model, RolloutError> {
    let on_device = tensors
        .iter()
        .map(|(name, t)| {
            // A tensor already in f32 on the engine's device may be the trainer's own
            // storage (its optimiser writes variables in place): the engine keeps a copy, so
            // its weights stay those of the version it loaded; the copy stays on the device.
            // A conversion or a move copies already.
            let t = if t.dtype() == DType::F32 && t.device().same_device(device) {
                t.copy()?
            } else {
                t.to_dtype(DType::F32)?.to_device(device)?
            };
            Ok((name.clone(), t))
        })
        .collect::<Result<TensorMap, RolloutError>>()?;
    let precision = precision(cfg.dtype, cfg.router_dtype);
    let mut weights = Weights::from_map(on_device).fuse_experts(model_cfg)?;
    if let Some(narrow) = precision.narrow_dtype() {
        let router_narrow = precision.router().narrow_dtype().is_some();
        weights = weights.narrow_matrices(model_cfg, narrow, router_narrow)?;
    }
    Ok(Model::with_precision(model_cfg, &weights, precision)?)
}

/// r3-model's forward precision for an engine dtype.
fn precision(dtype: Dtype, router: RouterDtype) -> Precision {
    let router_f32 = router == RouterDtype::F32;
    match dtype {
        Dtype::F32 => Precision::F32,
        Dtype::Bf16 => Precision::Bf16 { router_f32 },
        Dtype::F16 => Precision::F16 { router_f32 },
    }
}
