//! Model weights as a map from HF tensor name to tensor: load from safetensors (single
//! file or sharded, per-expert or fused 3-D experts; header checked against the file,
//! every tensor checked finite and within the range of the precision it is loaded for unless
//! [`LoadOptions`] allows otherwise), save in HF layout,
//! seeded random init, and the bridge to a candle `VarMap` for training.

mod finite;
mod fused;
mod header;
mod io;
mod narrow_copies;
pub(crate) mod precision;

pub use finite::{check_finite, check_holds, check_map_holds, HeldTensors};
pub use narrow_copies::check_narrow_copy;
pub use precision::WeightPrecision;

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr_free::normal_samples;

use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::spec::{tensor_specs, tensor_specs_in, weight, ExpertLayout, TensorRole, EMBED};

/// Whether an unused checkpoint tensor `name` is part of one of the model's
/// `num_hidden_layers` decoder layers that the config left out — a shared expert
/// (`mlp.shared_expert*`, `mlp.shared_experts*`) or attention (`self_attn.*`, bar the rotary
/// buffers old checkpoints saved, which the model recomputes): without it the model runs,
/// but not as the checkpoint's. Layers past `num_hidden_layers` (DeepSeek's MTP layers) and
/// anything outside the layers are left to a warning.
fn drops_part_of_a_layer(name: &str, num_hidden_layers: usize) -> bool {
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return false;
    };
    let Some((index, part)) = rest.split_once('.') else {
        return false;
    };
    let Ok(index) = index.parse::<usize>() else {
        return false;
    };
    index < num_hidden_layers
        && (part.starts_with("mlp.shared_expert")
            || (part.starts_with("self_attn.") && !part.starts_with("self_attn.rotary_emb.")))
}

/// Up to eight of `names`, and how many more.
fn named(names: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut text = names
        .iter()
        .take(SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        text.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    text
}

/// Named weights under HF names; routed experts per expert (as loaded) or fused (as trained).
#[derive(Debug, Clone)]
pub struct Weights {
    tensors: BTreeMap<String, Tensor>,
    /// 16-bit copies of some f32 matrices, held beside them for a mixed-precision trainer
    /// (`narrow_copies.rs`); none unless [`Weights::hold_narrow_copies`] made them.
    copies: BTreeMap<String, Tensor>,
}

/// Scales of seeded random init.
#[derive(Debug, Clone, Copy)]
pub struct RandomInit {
    /// RNG seed
    pub seed: u64,
    /// std of weight matrices and biases
    pub std: f64,
    /// std of router matrices (larger gives more decisive routing)
    pub router_std: f64,
    /// std of RMSNorm scales around one
    pub norm_jitter: f64,
    /// std of the DeepSeek `e_score_correction_bias` buffer
    pub bias_std: f64,
}

impl RandomInit {
    /// Defaults suited to small test models.
    pub fn new(seed: u64) -> Self {
        RandomInit {
            seed,
            std: 0.08,
            router_std: 0.5,
            norm_jitter: 0.1,
            bias_std: 0.05,
        }
    }
}

/// How [`Weights::load_with`] treats what it reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Load tensors holding NaN or ±inf, or values `precision` cannot hold, instead of
    /// refusing them (for inspecting a broken checkpoint; a forward pass over them gives
    /// non-finite logits).
    pub allow_non_finite: bool,
    /// The precision the weights are loaded for: a value past its finite range is refused
    /// like a non-finite one (f32, the default, refuses only NaN and ±inf).
    pub precision: WeightPrecision,
    /// Hold the weights a trainer keeps in a 16-bit float without f32 masters in that float
    /// as they are read ([`NarrowMasters`]), one tensor at a time: the device never holds
    /// an f32 copy of the whole model (4 bytes a parameter, where the run holds 2). None:
    /// every tensor f32.
    pub narrow_masters: Option<NarrowMasters>,
}

/// Which weights a trainer holds in a 16-bit float with no f32 master
/// (`train.master_weights = "bf16"`), and in which: what [`Weights::narrow_for_training`]
/// narrows and what [`Weights::load_with`] narrows as it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NarrowMasters {
    /// The 16-bit float.
    pub dtype: DType,
    /// Whether the routers' gates are held in it too (a router whose input the forward
    /// rounds).
    pub router: bool,
}

impl NarrowMasters {
    /// The dtype a tensor of `role` is held in: the 16-bit float for the embedding and
    /// every weight matrix (and the routers' gates where `router`), f32 for the rest (norm
    /// scales, biases, buffers).
    pub fn dtype_of(&self, role: TensorRole) -> DType {
        match role {
            TensorRole::Matrix => self.dtype,
            TensorRole::Router if self.router => self.dtype,
            _ => DType::F32,
        }
    }
}

impl Weights {
    /// Wraps an existing name→tensor map (not validated; see [`Weights::validate`]).
    pub fn from_map(tensors: BTreeMap<String, Tensor>) -> Self {
        Weights {
            tensors,
            copies: BTreeMap::new(),
        }
    }

    /// The name→tensor map.
    pub fn tensors(&self) -> &BTreeMap<String, Tensor> {
        &self.tensors
    }

    /// Consumes self, returning the name→tensor map.
    pub fn into_map(self) -> BTreeMap<String, Tensor> {
        self.tensors
    }

    /// The tensor named `name`, or an error naming it.
    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    /// How this map holds the routed experts (fused if the first MoE layer's are).
    pub fn expert_layout(&self, cfg: &Config) -> ExpertLayout {
        ExpertLayout::detect(cfg, |name| self.tensors.contains_key(name))
    }

    /// The same weights with every MoE layer's experts fused (copies the expert tensors).
    pub fn fuse_experts(self, cfg: &Config) -> Result<Weights> {
        // Held copies are of trained (fused) weights: their names do not change.
        Ok(Weights {
            tensors: fused::fuse_experts(self.tensors, cfg)?,
            copies: self.copies,
        })
    }

    /// The same weights with fused experts split into HF per-expert tensors (copies them).
    pub fn unfuse_experts(self, cfg: &Config) -> Result<Weights> {
        if self.expert_layout(cfg) == ExpertLayout::PerExpert {
            return Ok(self);
        }
        let split = fused::unfuse_experts(self.tensors.into_iter().collect(), cfg)?;
        Ok(Weights::from_map(split.into_iter().collect()))
    }

    /// Checks that every tensor the config requires is present with its shape, with the
    /// experts in either layout.
    pub fn validate(&self, cfg: &Config) -> Result<()> {
        for spec in tensor_specs_in(cfg, self.expert_layout(cfg)) {
            let t = self.get(&spec.name)?;
            if t.dims() != spec.shape.as_slice() {
                return Err(ModelError::TensorShape {
                    name: spec.name,
                    expected: spec.shape,
                    got: t.dims().to_vec(),
                });
            }
        }
        Ok(())
    }

    /// Loads `model.safetensors` or `model.safetensors.index.json` from `dir` as f32,
    /// splitting fused 3-D expert tensors into HF per-expert names and validating
    /// every tensor against `cfg`; a non-finite value is [`ModelError::NonFiniteWeight`].
    pub fn load(dir: &Path, cfg: &Config, device: &Device) -> Result<Self> {
        Self::load_with(dir, cfg, device, &LoadOptions::default())
    }

    /// [`Weights::load`] with explicit options (e.g. accepting non-finite values).
    pub fn load_with(
        dir: &Path,
        cfg: &Config,
        device: &Device,
        options: &LoadOptions,
    ) -> Result<Self> {
        let raw = io::read_checkpoint(dir, device)?;
        let mut tensors = fused::unfuse_experts(raw, cfg)?;
        let mut out = BTreeMap::new();
        for spec in &tensor_specs(cfg) {
            let t = tensors
                .remove(&spec.name)
                .ok_or_else(|| ModelError::MissingTensor(spec.name.clone()))?;
            if t.dims() != spec.shape.as_slice() {
                return Err(ModelError::TensorShape {
                    name: spec.name.clone(),
                    expected: spec.shape.clone(),
                    got: t.dims().to_vec(),
                });
            }
            if !options.allow_non_finite {
                check_holds(&spec.name, &t, options.precision)?;
            }
            let held = options
                .narrow_masters
                .map_or(DType::F32, |n| n.dtype_of(spec.role));
            // Through f32 (exact from any stored float), so a narrowed tensor has the value
            // narrowing the f32 weight gives.
            let t = match t.dtype() == held {
                true => t,
                false => t.to_dtype(DType::F32)?.to_dtype(held)?,
            };
            out.insert(spec.name.clone(), t);
        }
        if options.allow_non_finite {
            tracing::warn!(dir = %dir.display(), precision = %options.precision, "weights loaded without the finiteness and range check");
        }
        let (mut dropped, unused): (Vec<String>, Vec<String>) = tensors
            .into_keys()
            .partition(|name| drops_part_of_a_layer(name, cfg.num_hidden_layers));
        // Sorted: the map's order is random, and the error shows only the first eight.
        dropped.sort_unstable();
        if !dropped.is_empty() {
            return Err(ModelError::Checkpoint {
                path: dir.to_path_buf(),
                msg: format!(
                    "{} tensor(s) of the model's layers that the config does not use (the model \
                     would run without them; check `n_shared_experts`, \
                     `shared_expert_intermediate_size`, `qkv_bias`): {}",
                    dropped.len(),
                    named(&dropped)
                ),
            });
        }
        if let Some(first) = unused.first() {
            tracing::warn!(unused = unused.len(), first = %first, "checkpoint tensors not used by the config (e.g. MTP layers)");
        }
        Ok(Weights::from_map(out))
    }

    /// Writes `config.json` and `model.safetensors` (HF per-expert names, current dtypes)
    /// into `dir`.
    pub fn save(&self, dir: &Path, cfg: &Config) -> Result<()> {
        self.validate(cfg)?;
        let hf = self.clone().unfuse_experts(cfg)?;
        io::write_checkpoint(dir, &cfg.to_json_string(), &hf.tensors)
    }

    /// Seeded random weights for `cfg` (f32): same config and init give the same tensors.
    pub fn random(cfg: &Config, init: &RandomInit, device: &Device) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(init.seed);
        let mut tensors = BTreeMap::new();
        for spec in tensor_specs(cfg) {
            let n: usize = spec.shape.iter().product();
            let (mean, std) = match spec.role {
                TensorRole::Matrix | TensorRole::Bias => (0.0, init.std),
                TensorRole::Router => (0.0, init.router_std),
                TensorRole::NormScale => (1.0, init.norm_jitter),
                TensorRole::Buffer => (0.0, init.bias_std),
            };
            let data = normal_samples(&mut rng, n, mean, std);
            let t = Tensor::from_vec(data, spec.shape.as_slice(), device)?;
            tensors.insert(spec.name, t);
        }
        Ok(Weights::from_map(tensors))
    }

    /// Seeded random weights for `cfg` (f32) drawn by `device`'s own generator: on a GPU
    /// cuRAND seeded with `init.seed` (the same distributions as [`Weights::random`] and the
    /// same tensors for the same config, seed and device, but not its host draws); on the
    /// CPU exactly [`Weights::random`]. For benchmarks of billions of parameters, which one
    /// host thread would take minutes to draw.
    pub fn random_on_device(cfg: &Config, init: &RandomInit, device: &Device) -> Result<Self> {
        if device.is_cpu() {
            return Self::random(cfg, init, device);
        }
        device.set_seed(init.seed)?;
        let mut tensors = BTreeMap::new();
        for spec in tensor_specs(cfg) {
            let (mean, std) = match spec.role {
                TensorRole::Matrix | TensorRole::Bias => (0.0, init.std),
                TensorRole::Router => (0.0, init.router_std),
                TensorRole::NormScale => (1.0, init.norm_jitter),
                TensorRole::Buffer => (0.0, init.bias_std),
            };
            let shape = spec.shape.as_slice();
            let t = if std > 0.0 {
                Tensor::randn(mean as f32, std as f32, shape, device)?
            } else {
                Tensor::full(mean as f32, shape, device)?
            };
            tensors.insert(spec.name, t);
        }
        Ok(Weights::from_map(tensors))
    }

    /// Makes every trainable tensor a candle `Var` (same dtype, fresh storage) registered in a
    /// new `VarMap` under its HF name, with routed experts fused (one variable per layer and
    /// projection pair, as grouped GEMMs want them); returns the map (for the optimiser) and
    /// weights whose tensors are those vars, so a model built from them is differentiable in
    /// every parameter. Buffers stay constants.
    pub fn into_trainable(self, cfg: &Config) -> Result<(VarMap, Weights)> {
        self.validate(cfg)?;
        let mut fused = self.fuse_experts(cfg)?.tensors;
        let varmap = VarMap::new();
        let mut tensors = BTreeMap::new();
        {
            let mut data = varmap
                .data()
                .lock()
                .map_err(|_| ModelError::Input("VarMap lock poisoned".into()))?;
            for spec in tensor_specs_in(cfg, ExpertLayout::Fused) {
                // Taken out of the map, so each source tensor is freed once its variable
                // exists: the model is held once plus one tensor, never twice (5.6 B f32
                // parameters are 22 GB of a GPU).
                let t = fused
                    .remove(&spec.name)
                    .ok_or_else(|| ModelError::MissingTensor(spec.name.clone()))?;
                if spec.role.is_trainable() {
                    // `detach` makes even a variable's tensor a plain one, which
                    // `Var::from_tensor` copies into fresh storage.
                    let var = Var::from_tensor(&t.detach())?;
                    tensors.insert(spec.name.clone(), var.as_tensor().clone());
                    data.insert(spec.name, var);
                } else {
                    tensors.insert(spec.name, t.detach());
                }
            }
        }
        Ok((varmap, Weights::from_map(tensors)))
    }

    /// For inference at a 16-bit precision (`Precision::narrow_dtype` gives `narrow`): every
    /// weight matrix the forward rounds at each matmul stored rounded to `narrow` instead
    /// (half the memory, and a GPU's tensor-core GEMM reads it with no cast per step), the
    /// same values the forward would round it to; the router's gate too iff `router_narrow`
    /// (its logits are not computed in f32). The embedding (its rows are looked up, and its
    /// dtype is the model's), norm scales, biases and buffers stay f32. A trainer holding
    /// its weights in bf16 takes [`Weights::narrow_for_training`].
    pub fn narrow_matrices(
        self,
        cfg: &Config,
        narrow: DType,
        router_narrow: bool,
    ) -> Result<Weights> {
        let names = self.narrowed_matrix_names(cfg, router_narrow);
        let mut tensors = self.tensors;
        for name in &names {
            if let Some(t) = tensors.get_mut(name) {
                if t.dtype() == DType::F32 {
                    *t = t.to_dtype(narrow)?;
                }
            }
        }
        Ok(Weights::from_map(tensors))
    }

    /// The names [`Weights::narrow_matrices`] stores in the 16-bit float, in this map's
    /// expert layout (per expert or fused): every weight matrix but the embedding, and the
    /// routers' gates iff `router_narrow`. A loader converting tensor by tensor narrows these
    /// as it goes, with no f32 copy of the whole model in between.
    pub fn narrowed_matrix_names(
        &self,
        cfg: &Config,
        router_narrow: bool,
    ) -> std::collections::BTreeSet<String> {
        tensor_specs_in(cfg, self.expert_layout(cfg))
            .into_iter()
            .filter(|spec| match spec.role {
                TensorRole::Matrix => spec.name != weight(EMBED),
                TensorRole::Router => router_narrow,
                _ => false,
            })
            .map(|spec| spec.name)
            .collect()
    }

    /// For training with the weights held in bf16 and no f32 master (a trainer's
    /// `train.master_weights = "bf16"`): [`Weights::narrow_matrices`] to `narrow`, and the
    /// embedding too (its rows are rounded to `narrow` where the forward embeds them, so the
    /// forward reads the same values; its gradient, each row's f32 sum, is rounded to
    /// `narrow` once). Norm scales, biases and buffers stay f32: the tensors
    /// [`NarrowMasters::dtype_of`] names, the rule a loader narrowing as it reads follows.
    pub fn narrow_for_training(
        self,
        cfg: &Config,
        narrow: DType,
        router_narrow: bool,
    ) -> Result<Weights> {
        let held = NarrowMasters {
            dtype: narrow,
            router: router_narrow,
        };
        let specs = tensor_specs_in(cfg, self.expert_layout(cfg));
        let mut tensors = self.tensors;
        for spec in specs {
            let dtype = held.dtype_of(spec.role);
            if let Some(t) = tensors.get_mut(&spec.name) {
                if t.dtype() == DType::F32 && dtype != DType::F32 {
                    *t = t.to_dtype(dtype)?;
                }
            }
        }
        Ok(Weights::from_map(tensors))
    }

    /// The same weights as detached views (no copy; a variable's view sees its later
    /// updates), with the same held 16-bit copies: a model built from them builds no autograd
    /// graph.
    pub fn detached(&self) -> Weights {
        Weights {
            tensors: self
                .tensors
                .iter()
                .map(|(k, t)| (k.clone(), t.detach()))
                .collect(),
            copies: self.copies.clone(),
        }
    }

    /// Snapshot of the current values: every tensor detached from the graph and copied.
    pub fn snapshot(&self) -> Result<Weights> {
        let mut tensors = BTreeMap::new();
        for (name, t) in &self.tensors {
            tensors.insert(name.clone(), t.detach().copy()?);
        }
        Ok(Weights::from_map(tensors))
    }

    /// Converts every tensor to `dtype` (e.g. f16 for an inference engine).
    pub fn to_dtype(&self, dtype: DType) -> Result<Weights> {
        let mut tensors = BTreeMap::new();
        for (name, t) in &self.tensors {
            tensors.insert(name.clone(), t.to_dtype(dtype)?);
        }
        Ok(Weights::from_map(tensors))
    }
}

/// Box–Muller normal samples from a seeded RNG (avoids a `rand_distr` dependency).
mod rand_distr_free {
    use rand::Rng;

    /// `n` samples of N(mean, std²) as f32.
    pub fn normal_samples<R: Rng>(rng: &mut R, n: usize, mean: f64, std: f64) -> Vec<f32> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
            let u2: f64 = rng.random::<f64>();
            let r = (-2.0 * u1.ln()).sqrt();
            let theta = 2.0 * std::f64::consts::PI * u2;
            out.push((mean + std * r * theta.cos()) as f32);
            if out.len() < n {
                out.push((mean + std * r * theta.sin()) as f32);
            }
        }
        out
    }
}
