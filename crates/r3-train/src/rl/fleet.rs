//! The trainer's side of a rollout fleet (`rollout.backend = "sglang"`): connecting to the
//! workers, writing the policy's weights as an HF checkpoint under `rollout.sync_dir`
//! (temporary directory, then an atomic rename to `step_<N>`), moving every worker to
//! weight version N, pruning old sync directories, generating a step's requests (and
//! holding the batch drawn ahead for the next step, `rollout.async`), and the step's
//! fleet metrics.

use std::path::{Path, PathBuf};
use std::time::Duration;

use r3_fleet::{Fleet, FleetConfig, ModelFacts, RolloutStats};
use r3_rollout::{GenerateRequest, GenerateResult};

use crate::config::train::TrainConfig;
use crate::error::{Result, TrainError};
use crate::policy::model_text::ModelText;
use crate::policy::trainable::TrainablePolicy;
use crate::rl::ahead::AheadBatch;
use crate::rl::failed_groups::{refuse_fleet_failures, RequestOutcome};
use crate::rl::metrics_log::StepMetrics;
use crate::rl::sampling::{check_count, Generate};

const STEP_PREFIX: &str = "step_";
const TMP_PREFIX: &str = ".tmp-";
/// Sync directory name under the run directory when `rollout.sync_dir` is empty.
pub const DEFAULT_SYNC_DIR: &str = "rollout_sync";

/// The fleet and where its weights are written.
#[derive(Debug)]
pub struct FleetRollout {
    /// The HTTP client side of the workers.
    pub fleet: Fleet,
    /// Absolute directory holding `step_<N>/` checkpoints the workers load.
    pub sync_dir: PathBuf,
    /// Sync directories kept (the current one and those replies may still come from).
    keep: usize,
    /// What the last rollout batch cost (retries, stale replies, workers up).
    pub last: RolloutStats,
    /// The next step's batch when it was generated during this step (`rollout.async`).
    pub ahead: Option<AheadBatch>,
}

impl FleetRollout {
    /// Connects to the workers of `cfg.rollout` and brings them all to the policy's
    /// weights as version `step`.
    pub fn connect(
        cfg: &TrainConfig,
        policy: &TrainablePolicy,
        tokenizer: &ModelText,
        step: u64,
    ) -> Result<Self> {
        let r = &cfg.rollout;
        let model = policy.config();
        let moe = model
            .moe
            .as_ref()
            .ok_or_else(|| TrainError::InvalidConfig {
                field: "rollout.backend",
                reason: "the sglang backend needs an MoE model (routes to replay)".into(),
            })?;
        let facts = ModelFacts {
            vocab_size: model.vocab_size,
            layout: model.layout.clone(),
            top_k: moe.top_k,
            num_experts: moe.num_experts,
        };
        let fleet_cfg = FleetConfig {
            urls: r.urls.clone(),
            max_in_flight: r.max_in_flight,
            request_timeout: Duration::from_secs_f64(r.request_timeout_s),
            max_retries: r.max_retries,
            api_key: (!r.api_key.is_empty()).then(|| r.api_key.clone()),
            max_staleness: r.max_staleness,
            partial: r.partial,
            merge: r.partial_merge,
        };
        let sync_dir = if r.sync_dir.as_os_str().is_empty() {
            cfg.run_dir.join(DEFAULT_SYNC_DIR)
        } else {
            r.sync_dir.clone()
        };
        std::fs::create_dir_all(&sync_dir).map_err(TrainError::io(&sync_dir))?;
        // Workers resolve the path themselves, maybe from another working directory.
        let sync_dir = sync_dir.canonicalize().map_err(TrainError::io(&sync_dir))?;
        let mut this = FleetRollout {
            fleet: Fleet::new(fleet_cfg, facts)?,
            sync_dir,
            keep: 2 + r.max_staleness as usize,
            last: RolloutStats::default(),
            ahead: None,
        };
        this.push(policy, tokenizer, step)?;
        tracing::info!(
            workers = this.fleet.workers_up(),
            version = step,
            "rollout fleet ready"
        );
        Ok(this)
    }

    /// Writes the weights as `step_<version>` and loads them on every worker.
    pub fn push(
        &mut self,
        policy: &TrainablePolicy,
        tokenizer: &ModelText,
        version: u64,
    ) -> Result<()> {
        let dir = write_sync_checkpoint(&self.sync_dir, policy, tokenizer, version)?;
        self.fleet.sync(&dir, version)?;
        prune_sync_dirs(&self.sync_dir, self.keep)
    }

    /// Adds the last batch's `rollout.*` metrics to a step's line (the stale fraction is the
    /// trainer's: it knows which version each batch should have come from).
    pub fn fill_metrics(&self, m: &mut StepMetrics) {
        m.rollout_retries = Some(self.last.retries);
        m.rollout_workers_up = Some(self.last.workers_up as u64);
        m.rollout_partial_resumed = Some(self.last.partial_resumed);
    }

    /// A step's rollout round: one outcome per request, in request order, a request that
    /// failed for its own fault as its error (the trainer drops its group); any other failure
    /// (a worker fault out of retries, no worker left) fails the round as the fleet's batch
    /// error. The round's retries and staleness are kept in `last`.
    pub fn generate_round(
        &mut self,
        requests: Vec<GenerateRequest>,
    ) -> Result<Vec<RequestOutcome>> {
        let expected = requests.len();
        let (outcomes, stats) = self.fleet.generate_each(requests)?;
        self.last = stats;
        check_count(outcomes.len(), expected)?;
        refuse_fleet_failures(outcomes, stats)
    }

    /// A further rollout round of the same step ([`FleetRollout::generate_round`]): its cost
    /// is added to the last batch's (the counters summed, `workers_up` the round's), so the
    /// step's line counts every round.
    pub fn generate_another_round(
        &mut self,
        requests: Vec<GenerateRequest>,
    ) -> Result<Vec<RequestOutcome>> {
        let before = self.last;
        let outcomes = self.generate_round(requests);
        self.last = before.then(self.last);
        outcomes
    }

    /// The batch generated ahead for the next step, if any; its cost becomes the last
    /// batch's.
    pub fn take_ahead(&mut self) -> Option<AheadBatch> {
        let ahead = self.ahead.take()?;
        self.last = ahead.stats;
        Some(ahead)
    }
}

impl Generate for FleetRollout {
    /// The workers' results, every one (held-out evaluation: a failed request fails it);
    /// the batch's retries and staleness are kept in `last`.
    fn generate_batch(&mut self, requests: Vec<GenerateRequest>) -> Result<Vec<GenerateResult>> {
        let expected = requests.len();
        let (results, stats) = self.fleet.generate(requests)?;
        self.last = stats;
        check_count(results.len(), expected)?;
        Ok(results)
    }
}

/// Writes an HF checkpoint of `policy` (config, safetensors, tokenizer) as
/// `root/step_<version>`, atomically: a half-written directory never carries that name.
pub fn write_sync_checkpoint(
    root: &Path,
    policy: &TrainablePolicy,
    tokenizer: &ModelText,
    version: u64,
) -> Result<PathBuf> {
    let name = format!("{STEP_PREFIX}{version}");
    let tmp = root.join(format!("{TMP_PREFIX}{name}"));
    let dest = root.join(&name);
    for stale in [&tmp, &dest] {
        if stale.exists() {
            std::fs::remove_dir_all(stale).map_err(TrainError::io(stale))?;
        }
    }
    std::fs::create_dir_all(&tmp).map_err(TrainError::io(&tmp))?;
    policy.save_hf(&tmp)?;
    tokenizer.save(&tmp)?;
    std::fs::rename(&tmp, &dest).map_err(TrainError::io(&dest))?;
    Ok(dest)
}

/// Deletes all but the newest `keep` `step_<N>` directories under `root`.
pub fn prune_sync_dirs(root: &Path, keep: usize) -> Result<()> {
    let mut steps = Vec::new();
    for entry in std::fs::read_dir(root).map_err(TrainError::io(root))? {
        let entry = entry.map_err(TrainError::io(root))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(n) = name
            .strip_prefix(STEP_PREFIX)
            .and_then(|s| s.parse::<u64>().ok())
        {
            steps.push((n, entry.path()));
        }
    }
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for (_, dir) in steps.into_iter().take(excess) {
        std::fs::remove_dir_all(&dir).map_err(TrainError::io(&dir))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pruning_keeps_the_newest_steps_by_number_and_ignores_other_entries() {
        let root = std::env::temp_dir().join(format!("r3-sync-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for name in [
            "step_2",
            "step_9",
            "step_10",
            "step_11",
            ".tmp-step_12",
            "notes",
        ] {
            std::fs::create_dir_all(root.join(name)).expect("dir");
        }
        prune_sync_dirs(&root, 2).expect("prune");
        let mut left: Vec<String> = std::fs::read_dir(&root)
            .expect("read")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, vec![".tmp-step_12", "notes", "step_10", "step_11"]);
        let _ = std::fs::remove_dir_all(&root);
    }
}
