//! The device engine's weights: built on its device from HF-named tensors (a copy of its
//! own, experts fused, matrices narrowed in bf16 / f16), overwritten in place by a weight
//! update, and the budgets checked against the device's free memory once they are loaded.

use std::path::Path;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, InplaceOp2, Layout, Tensor};
use half::{bf16, f16};
use r3_model::cast16::cast16_into;
use r3_model::{Config, HeldTensors, LoadOptions, Model, Precision, Weights};
use rayon::prelude::*;

use super::choice::device_engine_takes;
use super::memory::mib;
use super::{DeviceEngine, DeviceEngineConfig, HeldWeights, Loaded};
use crate::dtype::{Dtype, KvCacheDtype, RouterDtype};
use crate::error::RolloutError;
use crate::model::tensors::{load_dir_with, TensorMap};

impl DeviceEngine {
    /// Loads new weights (same config) from HF-named tensors, e.g. the trainer's; bumps the
    /// weight version. A running batch continues under them (its route rows carry the
    /// version that produced them), and so does a prefill running in chunks, its next chunks
    /// fed under them, as the CPU engine's. A tensor the precision cannot hold is refused
    /// and the old weights are kept.
    pub fn update_weights(&mut self, tensors: &TensorMap) -> Result<u64, RolloutError> {
        let held = HeldTensors::check(tensors, self.cfg.dtype.weight_precision())?;
        self.update_weights_held(held)
    }

    /// [`DeviceEngine::update_weights`] from tensors whose range is already known
    /// ([`HeldTensors`]): scanned only where that proof does not cover this engine's
    /// precision.
    pub fn update_weights_held(&mut self, held: HeldTensors<'_>) -> Result<u64, RolloutError> {
        held.ensure(self.cfg.dtype.weight_precision())?;
        // A trainer's tensors are fused already: this shares them, copying nothing.
        let source = Weights::from_map(held.tensors().clone()).fuse_experts(&self.model_cfg)?;
        self.swap_in(source)
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
        // Fused from the map it owns, each layer's per-expert tensors let go as its stacks
        // are made: a checkpoint's experts stand on the host once, not twice (≈ 19 GB more
        // at the 30B-A3B shape in f32 when the per-expert map was kept beside the stacks).
        let source = Weights::from_map(tensors).fuse_experts(&self.model_cfg)?;
        self.swap_in(source)
    }

    /// Checks `source` (experts fused) against the engine's tensors, empties the prefix
    /// cache (its keys, values
    /// and routes are the old weights'; the version in the block hashes already keeps them
    /// from matching), writes its tensors over the engine's own in place ([`overwrite`]),
    /// bumps the weight version, and waits for the device: the copies are done when this
    /// returns, so a trainer's sync time is the sync's, not the next rollout's.
    ///
    /// In place, because building a second model beside the first held the engine's weights
    /// twice during every sync (≈ 10 GB more at the 30B-A3B shape in bf16, on the GPU that
    /// holds the trainer too); now a sync of fused tensors (a trainer's) adds at most one
    /// tensor's converted copies, and per-expert tensors are first fused where they lie
    /// (on the host, for a checkpoint read from disk). Tensors of other names or shapes than
    /// the engine's are refused before anything is written, the old weights and the cache
    /// kept; a device failure part way leaves the engine refusing to generate
    /// ([`DeviceEngine::step`]) until an update succeeds.
    fn swap_in(&mut self, source: Weights) -> Result<u64, RolloutError> {
        let shapes = match &self.held {
            HeldWeights::Loaded(loaded) => shapes_of(&loaded.weights),
            HeldWeights::Released(shapes) => {
                check_same_tensors(shapes, &source)?;
                return self.load_again(source.tensors());
            }
            // On the host ([`DeviceEngine::offload_weights`]): the host copy is written,
            // and the weights brought back are the update's.
            HeldWeights::Offloaded(host) => {
                check_same_tensors(&shapes_of(host), &source)?;
                let written = overwrite(host, &source);
                return self.written(written);
            }
        };
        check_same_tensors(&shapes, &source)?;
        self.flush_prefix_cache();
        let device = self.device.clone();
        let HeldWeights::Loaded(loaded) = &mut self.held else {
            return Err(released());
        };
        let Loaded { model, weights } = &mut **loaded;
        // The copies are asynchronous on a GPU: one failing shows at the wait, and the
        // routers' host copies are read once the writes are done. Only then are the weights
        // whole, at the new version.
        let written = overwrite(weights, &source).and_then(|()| {
            let failed = |at: &str, e: &dyn std::fmt::Display| {
                (at.to_string(), candle_core::Error::Msg(e.to_string()))
            };
            device
                .synchronize()
                .map_err(|e| failed("the wait for the device's copies", &e))?;
            model
                .reload_host_copies(weights)
                .map_err(|e| failed("the routers' score biases", &e))
        });
        self.written(written)
    }

    /// An update's end: written whole, the weights are at the next version; stopped part
    /// way (at the tensor or stage named), they are torn and every step is refused until
    /// an update succeeds.
    fn written(
        &mut self,
        written: Result<(), (String, candle_core::Error)>,
    ) -> Result<u64, RolloutError> {
        if let Err((name, e)) = written {
            self.torn = Some(name.clone());
            return Err(RolloutError::Weights(format!(
                "the update failed part way, at {name} ({e}): the engine's weights are now \
                 partly the new version's and it generates nothing until an update succeeds"
            )));
        }
        self.torn = None;
        self.version += 1;
        Ok(self.version)
    }

    /// Lets the model and its weights go, so that the device memory they hold (the whole
    /// model in the engine's formats: ≈ 11 GB at the 30B-A3B shape in bf16) is free for
    /// something else — a trainer's update on the same GPU, whose sync then builds them
    /// again from the trainer's tensors ([`DeviceEngine::update_weights`]) — with the
    /// prefix cache (its keys, values and routes are these weights'). Refused while requests
    /// are queued, running or held; until an update, every step is refused.
    pub fn release_weights(&mut self) -> Result<(), RolloutError> {
        let (waiting, running) = self.queue_lengths();
        if waiting + running + self.finished.len() > 0 {
            return Err(RolloutError::InvalidRequest(format!(
                "the engine's weights cannot be released with requests in flight ({waiting} \
                 waiting, {running} running, {} finished and not yet handed out)",
                self.finished.len()
            )));
        }
        self.flush_prefix_cache();
        let shapes = match &self.held {
            HeldWeights::Loaded(loaded) => shapes_of(&loaded.weights),
            HeldWeights::Offloaded(host) => shapes_of(host),
            HeldWeights::Released(_) => return Ok(()),
        };
        self.held = HeldWeights::Released(shapes);
        Ok(())
    }

    /// Whether the weights are released ([`DeviceEngine::release_weights`]) and no update
    /// has brought them back.
    pub fn weights_released(&self) -> bool {
        matches!(self.held, HeldWeights::Released(_))
    }

    /// The model, or why no step can run: weights released, or torn by a failed update.
    pub(super) fn model(&self) -> Result<&Model, RolloutError> {
        self.check_weights_whole()?;
        self.held.loaded().map(|l| &l.model).ok_or_else(released)
    }

    /// Builds the model again from `tensors` after [`DeviceEngine::release_weights`] (as
    /// [`DeviceEngine::new`] builds it: one tensor at a time, converted where it lies);
    /// bumps the weight version.
    fn load_again(&mut self, tensors: &TensorMap) -> Result<u64, RolloutError> {
        let (model, weights) = build_model(&self.model_cfg, tensors, &self.cfg, &self.device)?;
        // As at the build: the uploads and casts are queued on this thread's stream.
        self.device.synchronize()?;
        self.held = HeldWeights::Loaded(Box::new(Loaded { model, weights }));
        self.torn = None;
        self.version += 1;
        Ok(self.version)
    }

    /// Refuses to run a step while a failed update left the weights torn, or while they are
    /// released.
    pub(super) fn check_weights_whole(&self) -> Result<(), RolloutError> {
        match (&self.torn, &self.held) {
            (Some(name), _) => Err(RolloutError::Weights(format!(
                "a weight update failed part way (at {name}): the engine's weights mix two \
                 versions; update them again before generating"
            ))),
            (None, HeldWeights::Released(_)) => Err(released()),
            (None, HeldWeights::Offloaded(_)) => Err(RolloutError::Weights(
                "the engine's weights are offloaded to the host (offload_weights, the server's \
                 /release_memory_occupation): bring them back (onload_weights, \
                 /resume_memory_occupation) before generating"
                    .into(),
            )),
            (None, HeldWeights::Loaded(_)) => Ok(()),
        }
    }
}

/// The error of a step asked of an engine whose weights are released.
fn released() -> RolloutError {
    RolloutError::Weights(
        "the engine's weights are released (release_weights): update them before generating".into(),
    )
}

/// Refuses an update whose tensors (experts fused) are not the engine's: a name the engine
/// holds and the update lacks, one the update brings and the engine does not hold (nothing
/// would read it), or another shape. Nothing is written before this passes.
fn check_same_tensors(held: &TensorShapes, source: &Weights) -> Result<(), RolloutError> {
    let source = source.tensors();
    if let Some(name) = held.keys().find(|n| !source.contains_key(*n)) {
        return Err(RolloutError::Weights(format!(
            "the update lacks {name}, which the engine holds"
        )));
    }
    if let Some(name) = source.keys().find(|n| !held.contains_key(*n)) {
        return Err(RolloutError::Weights(format!(
            "the update brings {name}, which this model does not have"
        )));
    }
    for (name, dims) in held {
        let new = &source[name];
        if new.dims() != dims.as_slice() {
            return Err(RolloutError::Weights(format!(
                "{name}: the update's shape is {:?}, the engine's {dims:?}",
                new.dims(),
            )));
        }
    }
    Ok(())
}

/// Each weight's name and shape.
type TensorShapes = std::collections::BTreeMap<String, Vec<usize>>;

/// The names and shapes of `weights`.
fn shapes_of(weights: &Weights) -> TensorShapes {
    weights
        .tensors()
        .iter()
        .map(|(name, t)| (name.clone(), t.dims().to_vec()))
        .collect()
}

/// Elements one copy writes at most: candle's CUDA `copy2d` takes 32-bit sizes, so a larger
/// tensor (a DeepSeek-V3-sized expert stack) is written in slices of its first dimension.
const MAX_COPY_ELEMS: usize = 1 << 31;

/// Writes each of `source`'s tensors over the engine's tensor of its name, in that tensor's
/// dtype and on its device, one at a time: a tensor already in the engine's dtype and on its
/// device is copied straight into the engine's storage, another is converted first (where it
/// lies, then moved: the same values [`engine_weights`] gives it; for that tensor a
/// converted copy on each device stands beside the weights until it is written). The model's
/// layers hold the same storage, so they read the new values. A failure names the tensor it
/// stopped at.
fn overwrite(held: &Weights, source: &Weights) -> Result<(), (String, candle_core::Error)> {
    for (name, dst) in held.tensors() {
        let write = || -> candle_core::Result<()> {
            let src = source
                .tensors()
                .get(name)
                .ok_or_else(|| candle_core::Error::Msg(format!("{name} vanished")))?;
            write_over(dst, src, MAX_COPY_ELEMS)
        };
        write().map_err(|e| (name.clone(), e))?;
    }
    Ok(())
}

/// Converts a host tensor's values into another host tensor's own storage (same element
/// count, both contiguous), with candle's own conversions (`half`'s round to nearest even):
/// the values `to_dtype` gives, without a converted copy beside the destination.
struct ConvertInto;

impl InplaceOp2 for ConvertInto {
    fn name(&self) -> &'static str {
        "convert-into"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        let span = |l: &Layout| {
            l.contiguous_offsets()
                .ok_or_else(|| candle_core::Error::Msg("convert-into: not contiguous".into()))
        };
        let ((d0, d1), (s0, s1)) = (span(dst_l)?, span(src_l)?);
        if d1 - d0 != s1 - s0 {
            candle_core::bail!("convert-into: {} values into {}", s1 - s0, d1 - d0);
        }
        fn convert<S: Sync + Copy, D: Send>(dst: &mut [D], src: &[S], f: impl Fn(S) -> D + Sync) {
            dst.par_iter_mut()
                .zip(src.par_iter())
                .with_min_len(1 << 14)
                .for_each(|(d, &s)| *d = f(s));
        }
        match (dst, src) {
            (CpuStorage::BF16(d), CpuStorage::F32(s)) => {
                convert(&mut d[d0..d1], &s[s0..s1], bf16::from_f32)
            }
            (CpuStorage::F16(d), CpuStorage::F32(s)) => {
                convert(&mut d[d0..d1], &s[s0..s1], f16::from_f32)
            }
            (CpuStorage::F32(d), CpuStorage::BF16(s)) => {
                convert(&mut d[d0..d1], &s[s0..s1], |v| v.to_f32())
            }
            (CpuStorage::F32(d), CpuStorage::F16(s)) => {
                convert(&mut d[d0..d1], &s[s0..s1], |v| v.to_f32())
            }
            (CpuStorage::F16(d), CpuStorage::BF16(s)) => {
                convert(&mut d[d0..d1], &s[s0..s1], |v| f16::from_f32(v.to_f32()))
            }
            (CpuStorage::BF16(d), CpuStorage::F16(s)) => {
                convert(&mut d[d0..d1], &s[s0..s1], |v| bf16::from_f32(v.to_f32()))
            }
            (d, s) => {
                candle_core::bail!("convert-into: {:?} values into {:?}", s.dtype(), d.dtype())
            }
        }
        Ok(())
    }
}

/// `t` in `dtype` on `device`, contiguous: converted where it lies, then moved (a narrowing
/// conversion then moves the narrow copy). `t` itself where nothing changes.
fn in_engine_form(t: &Tensor, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    t.to_dtype(dtype)?.to_device(device)?.contiguous()
}

/// Writes `src` (`dst`'s shape, any dtype and device) into `dst`'s own storage in `dst`'s
/// dtype. On the host a conversion writes straight into it ([`ConvertInto`]: a converted
/// copy first, then a copy of it, took half again the time); so does an f32 `src` on `dst`'s
/// GPU handle narrowed to bf16 / f16 ([`casts_in_place`]: r3's cast kernel); elsewhere `src`
/// is brought to `dst`'s form ([`in_engine_form`]) and copied. At most `max_elems` elements
/// a copy: whole where it fits (flattened views of the same storage, any rank), else in
/// slices of the first dimension, each converted alone.
fn write_over(dst: &Tensor, src: &Tensor, max_elems: usize) -> candle_core::Result<()> {
    // A tensor not contiguous would flatten into a copy, and the write would miss the
    // engine's storage: refused (the engine builds every tensor contiguous).
    if !dst.is_contiguous() {
        candle_core::bail!("the engine's tensor is not contiguous");
    }
    if src.dtype() != dst.dtype() && src.device().is_cpu() && dst.device().is_cpu() {
        return dst.inplace_op2(&src.contiguous()?, &ConvertInto);
    }
    let n = dst.elem_count();
    if n <= max_elems || dst.rank() == 0 {
        if casts_in_place(dst, src, 0) {
            return cast16_into(src, dst);
        }
        let src = in_engine_form(src, dst.dtype(), dst.device())?;
        return dst.flatten_all()?.slice_set(&src.flatten_all()?, 0, 0);
    }
    let rows = dst.dim(0)?;
    let per_row = n / rows.max(1);
    if per_row > max_elems {
        candle_core::bail!("a slice of {per_row} elements exceeds one copy's {max_elems}");
    }
    let step = max_elems / per_row.max(1);
    let in_place = casts_in_place(dst, src, step * per_row);
    // Each slice converted on its own: a GPU's cast kernels count elements in 32 bits, and
    // no converted copy of the whole tensor is held beside the engine's.
    for start in (0..rows).step_by(step) {
        let len = step.min(rows - start);
        if in_place {
            cast16_into(&src.narrow(0, start, len)?, &dst.narrow(0, start, len)?)?;
            continue;
        }
        let slice = in_engine_form(&src.narrow(0, start, len)?, dst.dtype(), dst.device())?;
        dst.slice_set(&slice, 0, start)?;
    }
    Ok(())
}

/// Whether [`write_over`] narrows `src` into `dst` in place off the host (`cast16_into`:
/// r3's cast kernel, the values `in_engine_form` would give, without a converted copy and a
/// second pass to place it): f32 into bf16 / f16 on one device handle, `src` contiguous,
/// both tensors and each slice of `slice_elems` after the first starting on the kernel's
/// 4-element boundary. On the host [`ConvertInto`] does it.
fn casts_in_place(dst: &Tensor, src: &Tensor, slice_elems: usize) -> bool {
    src.dtype() == DType::F32
        && matches!(dst.dtype(), DType::BF16 | DType::F16)
        && !dst.device().is_cpu()
        && src.device().same_device(dst.device())
        && src.is_contiguous()
        && [
            src.layout().start_offset(),
            dst.layout().start_offset(),
            slice_elems,
        ]
        .iter()
        .all(|v| v % 4 == 0)
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
         {:.0} MiB): lower kv_cache_bytes, activation_bytes or prefix_cache_bytes (`r3 serve \
         --kv-cache-mib / --activation-mib / --prefix-cache-mib`, `r3 train`'s \
         rollout.kv_cache_mib / rollout.activation_mib / rollout.prefix_cache_mib)",
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
/// The weights come back beside the model: its layers hold the same storage, which a weight
/// update overwrites.
pub(super) fn build_model(
    model_cfg: &Config,
    tensors: &TensorMap,
    cfg: &DeviceEngineConfig,
    device: &Device,
) -> Result<(Model, Weights), RolloutError> {
    let precision = precision(cfg.dtype, cfg.router_dtype);
    let weights = engine_weights(model_cfg, tensors, precision, device)?;
    let model = Model::with_precision(model_cfg, &weights, precision)?;
    Ok((model, weights))
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
            let t = match t.dtype() == dtype && t.device().same_device(device) {
                true => t.force_contiguous()?,
                false => in_engine_form(t, dtype, device)?,
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

/// The dtype the device engine's KV cache holds for `kv` in an engine computing in
/// `engine` with `model`'s attention: `auto` (or the engine's own dtype, named) the
/// forward's keys' and values' own where that float holds them exactly
/// ([`Precision::kv_dtype`]: f32 where OLMoE clamps values to a bound off it), `f32` f32;
/// any other dtype is refused by name, as it would round the forward's keys and values
/// (the rule `RolloutDevice::check_kv_cache_dtype` applies before an engine is built where a
/// front end checks first).
pub(crate) fn kv_dtype(
    kv: KvCacheDtype,
    engine: Dtype,
    model: &Config,
    device: &str,
) -> Result<DType, RolloutError> {
    device_engine_takes(kv, engine, device)?;
    Ok(match kv {
        KvCacheDtype::Fixed(Dtype::F32) => DType::F32,
        _ => precision(engine, RouterDtype::Model).kv_dtype(&model.attention),
    })
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

    /// The weights of a loaded engine.
    fn weights_of(engine: &DeviceEngine) -> &Weights {
        &engine.held.loaded().expect("a loaded engine").weights
    }
    use crate::request::GenerateRequest;
    use crate::sampler::SamplingParams;
    use r3_model::RandomInit;
    use r3_routing::RouteTable;
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

    /// Seeded random weights of `cfg`, experts fused.
    fn random(cfg: &Config, seed: u64) -> Weights {
        Weights::random(cfg, &RandomInit::new(seed), &Device::Cpu)
            .expect("weights")
            .fuse_experts(cfg)
            .expect("fuse")
    }

    fn engine_config(dtype: Dtype, router_dtype: RouterDtype) -> DeviceEngineConfig {
        DeviceEngineConfig {
            dtype,
            router_dtype,
            max_running: 4,
            kv_cache_bytes: 64 << 20,
            prefix_cache: false,
            ..DeviceEngineConfig::default()
        }
    }

    /// Greedy tokens, their log-probs and the routes of every position fed (their weight
    /// version set to 0).
    fn greedy(engine: &mut DeviceEngine) -> (Vec<u32>, Vec<f32>, Option<RouteTable>) {
        let mut request = GenerateRequest::new(vec![5, 17, 3, 250, 9], SamplingParams::greedy(6));
        request.return_routes = true;
        let got = engine.generate(vec![request]).expect("generate").remove(0);
        // The routes' weight version is the engine's own count of updates: set alike.
        let routes = got.routes.map(|mut t| {
            t.set_version_all(0);
            t
        });
        (got.output_ids, got.output_logprobs, routes)
    }

    /// DeepSeek-V3's layout at a tiny size: MLA, a dense first layer, grouped sigmoid routing
    /// with a score bias (selection reads a host copy of it).
    fn deepseek_tiny() -> Config {
        Config::from_value(serde_json::json!({
            "model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 16,
            "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
            "first_k_dense_replace": 1, "norm_topk_prob": true, "routed_scaling_factor": 2.5,
            "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "rope_interleave": true,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128,
            "tie_word_embeddings": false,
        }))
        .expect("config")
    }

    fn engine_bits(engine: &DeviceEngine) -> Vec<(String, DType, Vec<u32>)> {
        weights_of(engine)
            .tensors()
            .iter()
            .map(|(name, t)| (name.clone(), t.dtype(), bits(t)))
            .collect()
    }

    /// A weight update writes the new values over the engine's own storage: the engine then
    /// holds what an engine built from the new tensors holds, dtype and bits, the tensor
    /// handles taken before the update read the new values (the storage is the same), and
    /// greedy generation gives the fresh engine's tokens, log-probs and routes; for
    /// per-expert and fused f32 maps and a trainer's bf16-masters map, at f32, bf16 (router
    /// in bf16 or f32) and f16; Qwen3-MoE, and DeepSeek-V3 whose score biases the update
    /// moves far enough to change its routing (selection reads a host copy of them).
    #[test]
    fn an_update_overwrites_the_engines_weights_in_place() {
        for cfg in [qwen_tiny(), deepseek_tiny()] {
            updates_in_place(&cfg);
        }
    }

    fn updates_in_place(cfg: &Config) {
        let cfg = cfg.clone();
        let old = random(&cfg, 3).into_map();
        let mut new = random(&cfg, 4).into_map();
        for (name, t) in new.iter_mut() {
            if name.ends_with("e_score_correction_bias") {
                *t = (&*t * 40.0).expect("a bias that moves the selection");
            }
        }
        let new = Weights::from_map(new);
        let sources = [
            (
                "per expert",
                new.clone().unfuse_experts(&cfg).expect("unfuse").into_map(),
            ),
            ("fused", new.clone().into_map()),
            (
                "bf16 masters",
                new.narrow_for_training(&cfg, DType::BF16, true)
                    .expect("narrow")
                    .into_map(),
            ),
        ];
        let configs = [
            (Dtype::F32, RouterDtype::Model),
            (Dtype::Bf16, RouterDtype::Model),
            (Dtype::Bf16, RouterDtype::F32),
            (Dtype::F16, RouterDtype::Model),
        ];
        for (what, source) in &sources {
            for (dtype, router) in configs {
                let what = format!("{what}, {dtype} router {router:?}");
                let config = engine_config(dtype, router);
                let mut engine =
                    DeviceEngine::new(cfg.clone(), &old, config.clone()).expect("old engine");
                let handles: Vec<Tensor> =
                    weights_of(&engine).tensors().values().cloned().collect();
                let before = engine_bits(&engine);
                assert_eq!(engine.update_weights(source).expect("update"), 1, "{what}");
                let mut fresh =
                    DeviceEngine::new(cfg.clone(), source, config).expect("fresh engine");
                let want = engine_bits(&fresh);
                assert_eq!(engine_bits(&engine), want, "{what}: the engine's weights");
                assert_ne!(before, want, "{what}: the update changed nothing");
                let read: Vec<Vec<u32>> = handles.iter().map(bits).collect();
                let want_bits: Vec<Vec<u32>> = want.into_iter().map(|(_, _, b)| b).collect();
                assert_eq!(read, want_bits, "{what}: not written in place");
                assert_eq!(
                    greedy(&mut engine),
                    greedy(&mut fresh),
                    "{what}: generation"
                );
                if old.keys().any(|n| n.ends_with("e_score_correction_bias")) {
                    let mut stale =
                        DeviceEngine::new(cfg.clone(), &old, engine_config(dtype, router))
                            .expect("stale");
                    // The old biases with the new weights: other routes, so the check above
                    // could see a stale host copy.
                    let mut mixed = source.clone();
                    for (name, t) in mixed.iter_mut() {
                        if name.ends_with("e_score_correction_bias") {
                            *t = old[name].clone();
                        }
                    }
                    stale.update_weights(&mixed).expect("mixed");
                    assert_ne!(
                        greedy(&mut stale).2,
                        greedy(&mut fresh).2,
                        "{what}: the biases change no route"
                    );
                }
            }
        }
    }

    /// A tensor written in slices (more elements than one copy takes) gets the same bits as
    /// one written whole, in its own storage; a slice past one copy is refused.
    #[test]
    fn a_large_tensor_is_written_in_slices() {
        let src = Tensor::arange(0f32, 60.0, &Device::Cpu)
            .and_then(|t| t.reshape((10, 3, 2)))
            .expect("src");
        for max in [60, 59, 13, 6] {
            let dst = Tensor::zeros((10, 3, 2), DType::F32, &Device::Cpu).expect("dst");
            let handle = dst.clone();
            write_over(&dst, &src, max).expect("write");
            assert_eq!(bits(&handle), bits(&src), "at most {max} a copy");
        }
        let dst = Tensor::zeros((10, 3, 2), DType::F32, &Device::Cpu).expect("dst");
        assert!(
            write_over(&dst, &src, 5).is_err(),
            "a row of 6 past a copy of 5"
        );
        let strided = Tensor::zeros((2, 30), DType::F32, &Device::Cpu)
            .and_then(|t| t.t())
            .expect("transposed");
        let flat = src.reshape((30, 2)).expect("flat");
        assert!(write_over(&strided, &flat, 60).is_err(), "not contiguous");
    }

    /// An engine handed an opened device (a trainer's handle) other than the one its config
    /// names is refused by name; handed the one it names, it is the engine its config opens
    /// (the same greedy tokens, log-probs and routes).
    #[test]
    fn an_engine_on_another_device_than_its_config_names_is_refused() {
        let cfg = qwen_tiny();
        let tensors = random(&cfg, 3).into_map();
        let config = engine_config(Dtype::F32, RouterDtype::Model);
        let on_gpu = DeviceEngineConfig {
            device: r3_model::DeviceSpec::Cuda { ordinal: 0 },
            ..config.clone()
        };
        let Err(err) = DeviceEngine::new_on(cfg.clone(), &tensors, on_gpu, Device::Cpu) else {
            panic!("a CPU handle for a cuda:0 engine was taken");
        };
        assert!(
            err.to_string()
                .contains("configured for cuda:0 but was given cpu"),
            "{err}"
        );
        let mut opened = DeviceEngine::new(cfg.clone(), &tensors, config.clone()).expect("opened");
        let mut given =
            DeviceEngine::new_on(cfg, &tensors, config, Device::Cpu).expect("given its device");
        let (a, b) = (greedy(&mut opened), greedy(&mut given));
        assert_eq!(a.0, b.0, "tokens");
        let f32_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(f32_bits(&a.1), f32_bits(&b.1), "log-probs");
        assert_eq!(a.2, b.2, "routes");
    }

    /// An update whose tensors are not the engine's is refused before anything is written,
    /// naming what is wrong: the weights and the version stay the old ones.
    #[test]
    fn an_update_of_other_tensors_is_refused_and_changes_nothing() {
        let cfg = qwen_tiny();
        let old = random(&cfg, 3).into_map();
        let new = random(&cfg, 4).into_map();
        let config = DeviceEngineConfig {
            prefix_cache: true,
            block_size: 2,
            prefix_cache_bytes: 16 << 20,
            ..engine_config(Dtype::Bf16, RouterDtype::Model)
        };
        let mut engine = DeviceEngine::new(cfg.clone(), &old, config.clone()).expect("engine");
        greedy(&mut engine);
        let cached = engine.prefix_cache_stats().expect("on").cached_blocks;
        assert!(cached > 0, "the prompt's blocks are cached");
        let before = engine_bits(&engine);
        let norm = "model.layers.1.post_attention_layernorm.weight";
        let mut missing = new.clone();
        missing.remove(norm).expect("present");
        let mut reshaped = new.clone();
        reshaped.insert(
            norm.into(),
            Tensor::zeros(7, DType::F32, &Device::Cpu).expect("t"),
        );
        let mut extra = new.clone();
        extra.insert(
            "model.extra.weight".into(),
            Tensor::zeros(3, DType::F32, &Device::Cpu).expect("t"),
        );
        for (what, map, says) in [
            ("missing", missing, format!("lacks {norm}")),
            (
                "reshaped",
                reshaped,
                format!("{norm}: the update's shape is [7]"),
            ),
            ("extra", extra, "brings model.extra.weight".to_string()),
        ] {
            let e = engine.update_weights(&map).expect_err(what).to_string();
            assert!(e.contains(&says), "{what}: {e}");
            assert_eq!(engine_bits(&engine), before, "{what}: weights written");
            assert_eq!(engine.weight_version(), 0, "{what}");
            let stats = engine.prefix_cache_stats().expect("on");
            assert_eq!(stats.cached_blocks, cached, "{what}: the cache emptied");
            // Released, the engine is built from the update: refused all the same, by the
            // names and shapes it kept, before anything is built; it stays released.
            let mut released = DeviceEngine::new(cfg.clone(), &old, config.clone()).expect("e");
            released.release_weights().expect("release");
            let e = released.update_weights(&map).expect_err(what).to_string();
            assert!(e.contains(&says), "{what}, released: {e}");
            assert!(released.weights_released(), "{what}");
            assert_eq!(released.weight_version(), 0, "{what}");
        }
    }

    /// A write that fails part way names the tensor it stopped at, the tensors before it
    /// written; an engine left so refuses to step, naming it, until an update succeeds.
    #[test]
    fn a_torn_update_stops_generation_until_an_update_succeeds() {
        let cfg = qwen_tiny();
        let old = random(&cfg, 3).into_map();
        let new = random(&cfg, 4).into_map();
        let config = engine_config(Dtype::F32, RouterDtype::Model);
        let mut engine = DeviceEngine::new(cfg.clone(), &old, config.clone()).expect("engine");
        let names: Vec<String> = weights_of(&engine).tensors().keys().cloned().collect();
        let stop = &names[names.len() / 2];
        let mut cut = new.clone();
        cut.remove(stop).expect("present");
        let (at, _) = overwrite(weights_of(&engine), &Weights::from_map(cut)).expect_err("stops");
        assert_eq!(&at, stop);
        for (name, t) in weights_of(&engine).tensors() {
            let source = if name < stop { &new[name] } else { &old[name] };
            assert_eq!(bits(t), bits(source), "{name}");
        }

        engine.torn = Some(at);
        let e = engine.step().expect_err("torn").to_string();
        assert!(
            e.contains(stop.as_str()) && e.contains("update them again"),
            "{e}"
        );
        engine.update_weights(&new).expect("update");
        let mut fresh = DeviceEngine::new(cfg, &new, config).expect("fresh");
        assert_eq!(greedy(&mut engine), greedy(&mut fresh));
    }
}
