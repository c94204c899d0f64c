//! Run checkpoints: `checkpoints/step_<N>/` holds an HF-layout model (`config.json`,
//! `model.safetensors`, `tokenizer.json`), the AdamW moments (`optimizer.safetensors`) and
//! `trainer_state.json` (step, optimiser step count, seed, task-stream RNG position, and the
//! dataset position — epoch and index — of a dataset run).
//!
//! A checkpoint is written into a temporary sibling directory and renamed into place, so
//! a run killed mid-write never leaves a half checkpoint under a `step_<N>` name; its last
//! file is `manifest.json` (sha256 of every other file), checked on resume: a resumed run
//! takes the newest checkpoint that verifies and says why it skipped newer ones. Weights
//! with a NaN or infinity are never written.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use r3_tasks::DatasetPosition;
use serde::{Deserialize, Serialize};

use crate::algo::optim::AdamW;
use crate::error::{Result, TrainError};
use crate::policy::trainable::TrainablePolicy;
use crate::rl::manifest::{verify_manifest, write_manifest};

/// Format version of `trainer_state.json`.
pub const STATE_FORMAT: u32 = 1;
const STATE_FILE: &str = "trainer_state.json";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const STEP_PREFIX: &str = "step_";
const TMP_PREFIX: &str = ".tmp-";

/// Everything besides weights and moments that a resumed run needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Format version ([`STATE_FORMAT`]).
    pub format: u32,
    /// RL steps completed.
    pub step: u64,
    /// Optimiser updates applied (drives the LR schedule and bias correction).
    pub optimizer_steps: u64,
    /// The run seed.
    pub seed: u64,
    /// Word position of the training-problem stream's ChaCha RNG (decimal u128).
    pub stream_word_pos: String,
    /// File holding the optimiser moments, relative to the checkpoint.
    pub optimizer_file: String,
    /// Position in the training dataset (absent for the built-in task).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset_position: Option<DatasetPosition>,
}

impl TrainerState {
    /// The task stream position as a number.
    pub fn word_pos(&self) -> Result<u128> {
        self.stream_word_pos
            .parse()
            .map_err(|source| TrainError::StreamPosition {
                text: self.stream_word_pos.clone(),
                source,
            })
    }
}

/// The checkpoints directory of a run.
pub fn checkpoints_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

/// Writes checkpoint `state.step` atomically and deletes all but the newest `keep_last`
/// (0 = keep all). Returns the checkpoint directory.
pub fn save_checkpoint(
    run_dir: &Path,
    policy: &TrainablePolicy,
    optimizer: &AdamW,
    tokenizer: &crate::policy::model_text::ModelText,
    state: &TrainerState,
    keep_last: usize,
) -> Result<PathBuf> {
    let root = checkpoints_dir(run_dir);
    let name = format!("{STEP_PREFIX}{}", state.step);
    refuse_non_finite(policy, &root.join(&name))?;
    std::fs::create_dir_all(&root).map_err(TrainError::io(&root))?;
    let tmp = root.join(format!("{TMP_PREFIX}{name}"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(TrainError::io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(TrainError::io(&tmp))?;
    policy.save_hf(&tmp)?;
    tokenizer.save(&tmp)?;
    let moments: HashMap<String, Tensor> = optimizer.state_tensors();
    let opt_path = tmp.join(OPTIMIZER_FILE);
    candle_core::safetensors::save(&moments, &opt_path)?;
    let text = serde_json::to_string_pretty(state)
        .map_err(TrainError::json("serialising trainer state"))?;
    let state_path = tmp.join(STATE_FILE);
    std::fs::write(&state_path, text).map_err(TrainError::io(&state_path))?;
    write_manifest(&tmp)?;
    let dest = root.join(&name);
    if dest.exists() {
        std::fs::remove_dir_all(&dest).map_err(TrainError::io(&dest))?;
    }
    std::fs::rename(&tmp, &dest).map_err(TrainError::io(&dest))?;
    prune(&root, keep_last)?;
    Ok(dest)
}

/// An error naming the first variable with a NaN or infinite value, if any.
fn refuse_non_finite(policy: &TrainablePolicy, dest: &Path) -> Result<()> {
    for (name, var) in policy.vars() {
        let values = var
            .as_tensor()
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?;
        let count = values.iter().filter(|v| !v.is_finite()).count();
        if count > 0 {
            return Err(TrainError::NonFiniteWeights {
                path: dest.to_path_buf(),
                variable: name.clone(),
                count,
            });
        }
    }
    Ok(())
}

/// The `step_<N>` checkpoint directories of a run as `(step, dir)`, oldest first (whether
/// complete or not: [`verified_checkpoint`] checks).
pub fn list_checkpoints(run_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let root = checkpoints_dir(run_dir);
    if !root.exists() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&root).map_err(TrainError::io(&root))? {
        let entry = entry.map_err(TrainError::io(&root))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(step) = name.strip_prefix(STEP_PREFIX).and_then(|s| s.parse().ok()) else {
            continue;
        };
        if entry.path().is_dir() {
            out.push((step, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

fn prune(root: &Path, keep_last: usize) -> Result<()> {
    if keep_last == 0 {
        return Ok(());
    }
    let run_dir = root.parent().unwrap_or(root);
    let all = list_checkpoints(run_dir)?;
    for (_, dir) in all.iter().take(all.len().saturating_sub(keep_last)) {
        std::fs::remove_dir_all(dir).map_err(TrainError::io(dir))?;
    }
    Ok(())
}

/// Reads `trainer_state.json` of a checkpoint.
pub fn read_state(dir: &Path) -> Result<TrainerState> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(TrainError::io(&path))?;
    let state: TrainerState = serde_json::from_str(&text)
        .map_err(TrainError::json(format!("checkpoint {}", path.display())))?;
    if state.format != STATE_FORMAT {
        return Err(TrainError::CheckpointFormat {
            path,
            found: state.format,
            supported: STATE_FORMAT,
        });
    }
    Ok(state)
}

/// Restores the optimiser moments and step count of a checkpoint into `optimizer`.
pub fn load_optimizer(dir: &Path, state: &TrainerState, optimizer: &mut AdamW) -> Result<()> {
    let path = dir.join(&state.optimizer_file);
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).map_err(|source| {
        TrainError::CheckpointTensors {
            path: path.clone(),
            source: Box::new(source),
        }
    })?;
    optimizer.load_state(&tensors, state.optimizer_steps)?;
    Ok(())
}

/// The checkpoint a resumed run starts from, and the newer ones it passed over.
#[derive(Debug, Clone)]
pub struct ChosenCheckpoint {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Its trainer state.
    pub state: TrainerState,
    /// Newer checkpoints that failed verification, newest first, with the reason.
    pub skipped: Vec<(PathBuf, String)>,
}

/// Checks one checkpoint: its manifest matches every file, and its state file parses and
/// names the step of its directory.
pub fn verify_checkpoint(dir: &Path, step: u64) -> Result<TrainerState> {
    verify_manifest(dir)?;
    let state = read_state(dir)?;
    if state.step != step {
        return Err(TrainError::CheckpointManifest {
            path: dir.to_path_buf(),
            reason: format!("trainer_state.json says step {}", state.step),
        });
    }
    Ok(state)
}

/// The newest checkpoint of a run that is complete and verified ([`verify_checkpoint`]),
/// with the newer ones skipped; `None` when the run has no checkpoint directory at all, an
/// error when it has some but none verifies.
pub fn verified_checkpoint(run_dir: &Path) -> Result<Option<ChosenCheckpoint>> {
    let all = list_checkpoints(run_dir)?;
    if all.is_empty() {
        return Ok(None);
    }
    let mut skipped = Vec::new();
    for (step, dir) in all.into_iter().rev() {
        match verify_checkpoint(&dir, step) {
            Ok(state) => {
                return Ok(Some(ChosenCheckpoint {
                    dir,
                    state,
                    skipped,
                }))
            }
            Err(e) => skipped.push((dir, e.to_string())),
        }
    }
    Err(TrainError::NoVerifiedCheckpoint {
        path: checkpoints_dir(run_dir),
        reasons: skipped
            .iter()
            .map(|(_, why)| why.as_str())
            .collect::<Vec<_>>()
            .join("; "),
    })
}

/// The newest complete and verified checkpoint of a run with its state, if any.
pub fn latest_checkpoint(run_dir: &Path) -> Result<Option<(PathBuf, TrainerState)>> {
    Ok(verified_checkpoint(run_dir)?.map(|c| (c.dir, c.state)))
}

/// A new state record for step `step`.
pub fn state_at(step: u64, optimizer_steps: u64, seed: u64, word_pos: u128) -> TrainerState {
    TrainerState {
        format: STATE_FORMAT,
        step,
        optimizer_steps,
        seed,
        stream_word_pos: word_pos.to_string(),
        optimizer_file: OPTIMIZER_FILE.to_string(),
        dataset_position: None,
    }
}
