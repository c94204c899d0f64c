//! `/update_weights_from_disk` made safe: which directories a client may name (under the
//! weights root, one refusal message that reveals nothing about the file system), and
//! reading a checkpoint on a loader thread so the engine keeps serving, through r3-model's
//! checked loader (only regular files, so a FIFO cannot block the reader; each file's size
//! checked against its safetensors header before its data is read; every tensor present,
//! shaped as the config says, finite and within the engine precision's range), into
//! engine-layout weights that the engine worker
//! then swaps in at once.

use std::path::{Path, PathBuf};

use candle_core::Device;
use r3_model::{Config, LoadOptions, Weights};

use super::error::ApiError;
use r3_rollout::dtype::{Dtype, RouterDtype};
use r3_rollout::error::RolloutError;
use r3_rollout::model::tensors::TensorMap;
use r3_rollout::model::weights::ModelWeights;

/// The one answer to a `model_path` the server will not read, whatever the reason (outside
/// the weights root, missing, not a directory, unreadable), so that answers cannot be used
/// to probe the file system.
pub const REFUSED_PATH: &str =
    "model_path is not a weight directory this server may load (see the server's --weights-root)";

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
    router_dtype: RouterDtype,
}

impl WeightStager {
    /// A stager for weights of `cfg` at `dtype` (router in the model dtype).
    pub fn new(cfg: Config, dtype: Dtype) -> Self {
        WeightStager {
            cfg,
            dtype,
            router_dtype: RouterDtype::Model,
        }
    }

    /// The same stager with the router built at `router_dtype`.
    pub fn with_router_dtype(mut self, router_dtype: RouterDtype) -> Self {
        self.router_dtype = router_dtype;
        self
    }

    /// Reads `dir` and checks it completely with r3-model's loader (regular files only, sizes
    /// against headers, every tensor present, shaped, finite and within the finite range of
    /// the engine's precision); the engine is not touched.
    pub fn stage(&self, dir: &Path) -> Result<ModelWeights, RolloutError> {
        let options = LoadOptions {
            precision: self.dtype.weight_precision(),
            ..LoadOptions::default()
        };
        let weights =
            Weights::load_with(dir, &self.cfg, &Device::Cpu, &options).map_err(|source| {
                RolloutError::WeightDir {
                    dir: dir.to_path_buf(),
                    source: Box::new(source),
                }
            })?;
        let map: TensorMap = weights.into_map();
        ModelWeights::from_tensors_with_router(&self.cfg, &map, self.dtype, self.router_dtype)
    }
}
