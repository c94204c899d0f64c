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

    /// Empties the prefix cache (its keys, values and routes are the old weights'; the
    /// version in the block hashes already keeps them from matching: emptied first, its
    /// memory is free for the new weights), builds the model from checked tensors, bumps
    /// the weight version, and waits for the device: the copies are done when this returns,
    /// so a trainer's sync time is the sync's, not the next rollout's.
    fn swap_in(&mut self, tensors: &TensorMap) -> Result<u64, RolloutError> {
        self.flush_prefix_cache();
        self.model = build_model(&self.model_cfg, tensors, &self.cfg, &self.device)?;
        self.version += 1;
        self.device.synchronize()?;
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

/// r3-model's model on `device` from HF-named tensors: copies on the device, experts fused,
/// and in bf16 / f16 the weight matrices stored in that format (`Weights::narrow_matrices`:
/// the values the forward rounds them to at every matmul, at half the memory and with no
/// cast per step), the rest in f32. Each matrix is converted to the 16-bit float where it
/// lies and then moved, one tensor at a time, and one already in that float is copied as it
/// is: no f32 copy of the whole model stands on the device while the engine is built (on
/// the 30B-A3B shape 20 GB beside the engine's 10, at every weight sync), and a trainer's
/// bf16 weights cross with no conversion at all. The same values as converting everything
/// to f32 first (a conversion to f32 is exact, and each rounding is the same one).
pub(super) fn build_model(
    model_cfg: &Config,
    tensors: &TensorMap,
    cfg: &DeviceEngineConfig,
    device: &Device,
) -> Result<Model, RolloutError> {
    let precision = precision(cfg.dtype, cfg.router_dtype);
    let weights = engine_weights(model_cfg, tensors, precision, device)?;
    Ok(Model::with_precision(model_cfg, &weights, precision)?)
}

/// [`build_model`]'s weights: `tensors` on `device` in the formats `precision` keeps them.
fn engine_weights(
    model_cfg: &Config,
    tensors: &TensorMap,
    precision: Precision,
    device: &Device,
) -> Result<Weights, RolloutError> {
    let router_narrow = precision.router().narrow_dtype().is_some();
    let narrowed = match precision.narrow_dtype() {
        Some(_) => {
            Weights::from_map(tensors.clone()).narrowed_matrix_names(model_cfg, router_narrow)
        }
        None => Default::default(),
    };
    let on_device = tensors
        .iter()
        .map(|(name, t)| {
            let dtype = match precision.narrow_dtype() {
                Some(narrow) if narrowed.contains(name) => narrow,
                _ => DType::F32,
            };
            // A tensor already in its dtype on the engine's device may be the trainer's own
            // storage (its optimiser writes variables in place): the engine keeps a copy, so
            // its weights stay those of the version it loaded; the copy stays on the device.
            // A conversion or a move copies already.
            let t = if t.dtype() == dtype && t.device().same_device(device) {
                t.copy()?
            } else {
                t.to_dtype(dtype)?.to_device(device)?
            };
            Ok((name.clone(), t))
        })
        .collect::<Result<TensorMap, RolloutError>>()?;
    let mut weights = Weights::from_map(on_device).fuse_experts(model_cfg)?;
    if let Some(narrow) = precision.narrow_dtype() {
        // Every matrix is narrow already, per expert or fused; this converts none that is.
        weights = weights.narrow_matrices(model_cfg, narrow, router_narrow)?;
    }
    Ok(weights)
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

#[cfg(test)]
mod tests {
    use super::*;
    use r3_model::RandomInit;
    use r3_test_support::bits;

    use super::super::memory::tests::qwen_tiny;

    /// The engine's weights as they were built before: every tensor copied to f32, the
    /// experts fused, then the matrices narrowed.
    fn through_f32(cfg: &Config, tensors: &TensorMap, precision: Precision) -> Weights {
        let wide: TensorMap = tensors
            .iter()
            .map(|(n, t)| {
                (
                    n.clone(),
                    t.to_dtype(DType::F32).expect("f32").copy().expect("copy"),
                )
            })
            .collect();
        let mut w = Weights::from_map(wide).fuse_experts(cfg).expect("fuse");
        if let Some(narrow) = precision.narrow_dtype() {
            let router = precision.router().narrow_dtype().is_some();
            w = w.narrow_matrices(cfg, narrow, router).expect("narrow");
        }
        w
    }

    /// Narrowing tensor by tensor gives the weights narrowing after an f32 copy of them all
    /// gave, dtype and bits: f32 maps per expert and fused, a trainer's map with its matrices
    /// in bf16, at f32, bf16 (router in bf16 or f32) and f16.
    #[test]
    fn tensor_by_tensor_equals_the_f32_copy_first() {
        let cfg = qwen_tiny();
        let random = Weights::random(&cfg, &RandomInit::new(3), &Device::Cpu).expect("weights");
        let per_expert = random.clone().unfuse_experts(&cfg).expect("unfuse");
        let fused = random.fuse_experts(&cfg).expect("fuse");
        let bf16_masters = fused
            .clone()
            .narrow_for_training(&cfg, DType::BF16, true)
            .expect("bf16 masters");
        let maps = [
            ("per expert", per_expert.into_map()),
            ("fused", fused.into_map()),
            ("bf16 masters", bf16_masters.into_map()),
        ];
        for (what, map) in &maps {
            for precision in [
                Precision::F32,
                Precision::Bf16 { router_f32: false },
                Precision::Bf16 { router_f32: true },
                Precision::F16 { router_f32: false },
            ] {
                let got = engine_weights(&cfg, map, precision, &Device::Cpu).expect("engine");
                let want = through_f32(&cfg, map, precision);
                let (got, want) = (got.tensors(), want.tensors());
                assert_eq!(
                    got.keys().collect::<Vec<_>>(),
                    want.keys().collect::<Vec<_>>(),
                    "{what} {precision:?}"
                );
                for (name, t) in got {
                    let w = &want[name];
                    assert_eq!(t.dtype(), w.dtype(), "{what} {precision:?} {name}");
                    assert_eq!(bits(t), bits(w), "{what} {precision:?} {name}");
                }
                if precision.narrow_dtype().is_some() {
                    assert!(
                        got.values().any(|t| t.dtype() != DType::F32),
                        "{what} {precision:?}: nothing narrowed"
                    );
                }
            }
        }
    }
}
