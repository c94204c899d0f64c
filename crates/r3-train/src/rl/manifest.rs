//! A checkpoint's `manifest.json`: the sha256 of every other file in the checkpoint
//! directory. It is written last (through a temporary name and a rename), so a checkpoint
//! with a manifest is complete, and checking it on resume catches a flipped byte, an
//! edited file, a missing or an extra file.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Result, TrainError};

/// The manifest's file name inside a checkpoint.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Format version of `manifest.json`.
pub const MANIFEST_FORMAT: u32 = 1;

/// The manifest: file name → lower-case hex sha256 of its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version ([`MANIFEST_FORMAT`]).
    pub format: u32,
    /// Every file of the checkpoint except the manifest, by name.
    pub sha256: BTreeMap<String, String>,
}

fn bad(dir: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::CheckpointManifest {
        path: dir.to_path_buf(),
        reason: reason.into(),
    }
}

/// The sha256 of a file, as lower-case hex.
pub fn file_sha256(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(TrainError::io(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf).map_err(TrainError::io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The files of a checkpoint directory other than the manifest (and its temporary), by
/// name; a sub-directory or a name that is not UTF-8 is an error (checkpoints hold neither).
fn checkpoint_files(dir: &Path) -> Result<BTreeMap<String, PathBuf>> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir).map_err(TrainError::io(dir))? {
        let entry = entry.map_err(TrainError::io(dir))?;
        let path = entry.path();
        let name = entry
            .file_name()
            .into_string()
            .map_err(|n| bad(dir, format!("unexpected file name {n:?}")))?;
        if name == MANIFEST_FILE || name == tmp_name() {
            continue;
        }
        if !path.is_file() {
            return Err(bad(dir, format!("`{name}` is not a regular file")));
        }
        files.insert(name, path);
    }
    Ok(files)
}

fn tmp_name() -> String {
    format!("{MANIFEST_FILE}.tmp")
}

/// Hashes every file of `dir` and writes `manifest.json` atomically (temporary name, then
/// rename): call it after every other file is written.
pub fn write_manifest(dir: &Path) -> Result<Manifest> {
    let sha256 = checkpoint_files(dir)?
        .into_iter()
        .map(|(name, path)| Ok((name, file_sha256(&path)?)))
        .collect::<Result<BTreeMap<_, _>>>()?;
    let manifest = Manifest {
        format: MANIFEST_FORMAT,
        sha256,
    };
    let text = serde_json::to_string_pretty(&manifest)
        .map_err(TrainError::json("serialising the checkpoint manifest"))?;
    let tmp = dir.join(tmp_name());
    std::fs::write(&tmp, text).map_err(TrainError::io(&tmp))?;
    let path = dir.join(MANIFEST_FILE);
    std::fs::rename(&tmp, &path).map_err(TrainError::io(&path))?;
    Ok(manifest)
}

/// Checks `dir` against its manifest: the same set of files, each with its recorded sha256.
/// The error names the first problem (missing manifest, missing, extra or changed file).
pub fn verify_manifest(dir: &Path) -> Result<()> {
    let path = dir.join(MANIFEST_FILE);
    if !path.is_file() {
        return Err(bad(dir, "no manifest.json (incomplete checkpoint)"));
    }
    let text = std::fs::read_to_string(&path).map_err(TrainError::io(&path))?;
    let manifest: Manifest = serde_json::from_str(&text)
        .map_err(|e| bad(dir, format!("manifest.json does not parse: {e}")))?;
    if manifest.format != MANIFEST_FORMAT {
        return Err(bad(
            dir,
            format!(
                "manifest format {} (this build reads {MANIFEST_FORMAT})",
                manifest.format
            ),
        ));
    }
    let files = checkpoint_files(dir)?;
    if let Some(name) = manifest.sha256.keys().find(|n| !files.contains_key(*n)) {
        return Err(bad(dir, format!("`{name}` is missing")));
    }
    if let Some(name) = files.keys().find(|n| !manifest.sha256.contains_key(*n)) {
        return Err(bad(dir, format!("`{name}` is not in the manifest")));
    }
    for (name, want) in &manifest.sha256 {
        if &file_sha256(&files[name])? != want {
            return Err(bad(
                dir,
                format!("`{name}` does not match its sha256 in the manifest"),
            ));
        }
    }
    Ok(())
}
