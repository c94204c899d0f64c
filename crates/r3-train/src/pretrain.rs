//! Supervised pretraining of the base model: next-token loss on the worked solution (and
//! `<eos>`) of arithmetic problems, a mixture of difficulty levels, AdamW with warm-up and
//! cosine decay, held-out greedy accuracy through the rollout engine, and an HF-layout
//! checkpoint (`config.json`, `model.safetensors`, `tokenizer.json`, `pretrain.json`)
//! written atomically. DeepSeek-V3 models also get the aux-loss-free update of their
//! selection bias after every step; every run measures its expert load on a fixed probe
//! batch before and after training.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{Device, Tensor};
use r3_model::{Batch, Config, RandomInit, Routing, Weights};
use r3_rollout::{Dtype, Engine, EngineConfig};
use r3_tasks::{
    ArithmeticTask, CharTokenizer, Difficulty, LossOn, SupervisedBatch, SupervisedBatches, PAD_ID,
};
use serde::Serialize;

use crate::error::{Result, TrainError};
use crate::expert_balance::{layer_counts, normalised_entropy, update_score_bias};
use crate::logprob::{masked_mean, token_log_probs};
use crate::optim::{decay_matrices_only, AdamW, AdamWParams};
use crate::policy::TrainablePolicy;
use crate::pretrain_config::{PretrainArchitecture, PretrainConfig};
use crate::rollout::{evaluate, EvalResult};
use crate::schedule::{LrDecay, LrSchedule};
use crate::update::{backward_and_step, UpdateOutcome};

/// Progress events of a pretraining run.
#[derive(Debug, Clone, Copy)]
pub enum PretrainEvent {
    /// A step finished.
    Step {
        /// 1-based step.
        step: u64,
        /// Mean token loss of the step (NaN when skipped).
        loss: f32,
        /// Whether the update was applied.
        applied: bool,
    },
    /// A held-out evaluation finished.
    Eval {
        /// Step after which it ran.
        step: u64,
        /// Result.
        result: EvalResult,
    },
}

/// What `pretrain.json` records beside the checkpoint.
#[derive(Debug, Clone, Serialize)]
pub struct PretrainReport {
    /// Steps run.
    pub steps: u64,
    /// Wall-clock seconds of training (including evaluations).
    pub wall_s: f64,
    /// Mean loss of the last `log_every` steps.
    pub final_loss: f64,
    /// Evaluations as (step, accuracy).
    pub evals: Vec<(u64, f64)>,
    /// Difficulty of the evaluations.
    pub eval_difficulty: u32,
    /// The MoE layers, in the order of the entropy lists.
    pub moe_layers: Vec<usize>,
    /// Normalised expert-load entropy per MoE layer on the probe batch at init (1 = uniform).
    pub load_entropy_init: Vec<f64>,
    /// The same after the last step.
    pub load_entropy_final: Vec<f64>,
    /// The resolved config.
    pub config: PretrainConfig,
}

/// Converts a padded supervised batch into sequences (pads stripped), targets and mask.
fn to_tensors(b: &SupervisedBatch) -> Result<(Vec<Vec<u32>>, Tensor, Tensor)> {
    let (n, t) = (b.batch_size, b.seq_len);
    let mut seqs = Vec::with_capacity(n);
    for row in b.input_ids.chunks(t) {
        let len = row.iter().position(|&id| id == PAD_ID).unwrap_or(t);
        seqs.push(row[..len].to_vec());
    }
    let longest = seqs.iter().map(Vec::len).max().unwrap_or(0);
    if longest == 0 {
        return Err(TrainError::EmptyPretrainRow);
    }
    let narrow =
        |flat: &[u32]| -> Vec<u32> { flat.chunks(t).flat_map(|r| r[..longest].to_vec()).collect() };
    let mask: Vec<f32> = b
        .loss_mask
        .chunks(t)
        .flat_map(|r| r[..longest].to_vec())
        .collect();
    let targets = Tensor::from_vec(narrow(&b.target_ids), (n, longest), &Device::Cpu)?;
    let mask = Tensor::from_vec(mask, (n, longest), &Device::Cpu)?;
    Ok((seqs, targets, mask))
}

/// Per-layer normalised expert-load entropy of `policy`'s routing of `probe`, with the
/// MoE layers it covers.
pub fn probe_load_entropy(
    policy: &TrainablePolicy,
    probe: &[Vec<u32>],
) -> Result<(Vec<usize>, Vec<f64>)> {
    let model = policy.frozen_model()?;
    let out = model.forward(&Batch::new(probe, PAD_ID, &Device::Cpu)?, Routing::Record)?;
    let routes = out.routes.ok_or_else(|| TrainError::Length {
        what: "route tables of the load probe (Record forward)".into(),
        got: 0,
        expected: probe.len(),
    })?;
    let loads = layer_counts(&routes)?;
    Ok((
        loads.iter().map(|l| l.layer).collect(),
        loads
            .iter()
            .map(|l| normalised_entropy(&l.counts))
            .collect(),
    ))
}

/// Greedy held-out accuracy of `policy` through a fresh f16 rollout engine.
pub fn eval_policy(
    policy: &TrainablePolicy,
    tokenizer: &CharTokenizer,
    task: &ArithmeticTask,
    max_new_tokens: usize,
) -> Result<EvalResult> {
    let cfg = EngineConfig {
        dtype: Dtype::F16,
        prefix_cache: false,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(policy.config().clone(), &policy.tensor_map()?, cfg)?;
    evaluate(
        &mut engine,
        tokenizer,
        task.eval_set(),
        max_new_tokens,
        0.0,
        0,
    )
}

/// Runs pretraining and writes the checkpoint to `cfg.out_dir`.
pub fn pretrain(
    cfg: &PretrainConfig,
    on_event: &mut dyn FnMut(PretrainEvent),
) -> Result<PretrainReport> {
    let started = Instant::now();
    let tokenizer = CharTokenizer::new()?;
    let model_cfg = Config::from_value(cfg.hf_config(tokenizer.vocab_size()))?;
    let init = RandomInit {
        seed: cfg.seed,
        std: cfg.model.init_std,
        router_std: cfg.model.router_init_std,
        norm_jitter: 0.0,
        bias_std: 0.0,
    };
    let weights = Weights::random(&model_cfg, &init, &Device::Cpu)?;
    let mut policy = TrainablePolicy::new(model_cfg, weights)?;
    // Aux-loss-free balancing moves the selection bias from each step's own routes.
    let bias_rate = match cfg.model.architecture {
        PretrainArchitecture::DeepseekV3 => cfg.model.deepseek.bias_update_rate,
        PretrainArchitecture::Qwen3Moe => 0.0,
    };
    let params = AdamWParams {
        weight_decay: cfg.weight_decay,
        ..AdamWParams::default()
    };
    let mut opt = AdamW::new(policy.vars().to_vec(), params, decay_matrices_only)?;
    let schedule = LrSchedule {
        peak_lr: cfg.lr,
        warmup_steps: cfg.warmup_steps,
        total_steps: cfg.steps,
        decay: LrDecay::Cosine,
        min_lr_ratio: cfg.min_lr_ratio,
    };
    let tasks = cfg
        .difficulties
        .iter()
        .map(|&l| ArithmeticTask::new(Difficulty::level(l)?, cfg.eval_size, cfg.eval_seed))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let eval_task = ArithmeticTask::new(
        Difficulty::level(cfg.eval_difficulty)?,
        cfg.eval_size,
        cfg.eval_seed,
    )?;
    let mut streams = tasks
        .iter()
        .zip(&cfg.difficulties)
        .map(|(t, &l)| {
            SupervisedBatches::new(
                t,
                &tokenizer,
                crate::rollout::mix_seed(&[cfg.seed, u64::from(l)]),
                cfg.batch_size,
                None,
                LossOn::Solution,
            )
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let probe = SupervisedBatches::new(
        &eval_task,
        &tokenizer,
        crate::rollout::mix_seed(&[cfg.seed, cfg.eval_seed, u64::from(cfg.eval_difficulty)]),
        cfg.batch_size,
        None,
        LossOn::Solution,
    )?
    .next()
    .ok_or(TrainError::ProblemStreamEnded)??;
    let (probe_seqs, _, _) = to_tensors(&probe)?;
    let (moe_layers, load_entropy_init) = probe_load_entropy(&policy, &probe_seqs)?;
    tracing::info!(step = 0, entropy = ?rounded(&load_entropy_init), "expert load entropy per MoE layer");
    let mut evals = Vec::new();
    let mut recent = Vec::new();
    for step in 1..=cfg.steps {
        let k = (step as usize - 1) % streams.len();
        let batch = streams[k].next().ok_or(TrainError::ProblemStreamEnded)??;
        let (seqs, targets, mask) = to_tensors(&batch)?;
        let model = policy.model()?;
        let routing = if bias_rate > 0.0 {
            Routing::Record
        } else {
            Routing::Native
        };
        let out = model.forward(&Batch::new(&seqs, PAD_ID, &Device::Cpu)?, routing)?;
        let logp = token_log_probs(&out.logits, &targets)?;
        let loss = masked_mean(&logp, &mask)?.neg()?;
        let outcome = backward_and_step(&mut opt, &loss, schedule.lr_at(step - 1), cfg.grad_clip)?;
        let (value, applied) = match outcome {
            UpdateOutcome::Applied { loss, .. } => (loss, true),
            UpdateOutcome::Skipped { loss, .. } => (loss, false),
        };
        if let Some(routes) = out.routes.as_deref() {
            update_score_bias(&mut policy, &layer_counts(routes)?, bias_rate)?;
        }
        recent.push(f64::from(value));
        if recent.len() > cfg.log_every.max(1) as usize {
            recent.remove(0);
        }
        on_event(PretrainEvent::Step {
            step,
            loss: value,
            applied,
        });
        let due = cfg.eval_every > 0 && step % cfg.eval_every == 0;
        if due || step == cfg.steps {
            let result = eval_policy(&policy, &tokenizer, &eval_task, cfg.max_new_tokens)?;
            evals.push((step, result.accuracy));
            on_event(PretrainEvent::Eval { step, result });
            let (_, entropy) = probe_load_entropy(&policy, &probe_seqs)?;
            tracing::info!(step, entropy = ?rounded(&entropy), "expert load entropy per MoE layer");
        }
    }
    let (_, load_entropy_final) = probe_load_entropy(&policy, &probe_seqs)?;
    let report = PretrainReport {
        steps: cfg.steps,
        wall_s: started.elapsed().as_secs_f64(),
        final_loss: recent.iter().sum::<f64>() / recent.len().max(1) as f64,
        evals,
        eval_difficulty: cfg.eval_difficulty,
        moe_layers,
        load_entropy_init,
        load_entropy_final,
        config: cfg.clone(),
    };
    write_checkpoint(&cfg.out_dir, &policy, &tokenizer, &report)?;
    Ok(report)
}

/// Values to 3 decimals for log lines.
fn rounded(values: &[f64]) -> Vec<f64> {
    values
        .iter()
        .map(|v| (v * 1000.0).round() / 1000.0)
        .collect()
}

/// Writes the model directory via a temporary sibling and a rename.
fn write_checkpoint(
    out: &Path,
    policy: &TrainablePolicy,
    tokenizer: &CharTokenizer,
    report: &PretrainReport,
) -> Result<()> {
    let name = out.file_name().ok_or_else(|| TrainError::UnnamedOutDir {
        path: out.to_path_buf(),
    })?;
    let parent = out
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&parent).map_err(TrainError::io(&parent))?;
    let mut tmp_name = std::ffi::OsString::from(".tmp-");
    tmp_name.push(name);
    let tmp = parent.join(tmp_name);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(TrainError::io(&tmp))?;
    }
    policy.save_hf(&tmp)?;
    tokenizer.save(&tmp.join("tokenizer.json"))?;
    let text = serde_json::to_string_pretty(report)
        .map_err(TrainError::json("serialising pretrain report"))?;
    let report_path = tmp.join("pretrain.json");
    std::fs::write(&report_path, text).map_err(TrainError::io(&report_path))?;
    if out.exists() {
        std::fs::remove_dir_all(out).map_err(TrainError::io(out))?;
    }
    std::fs::rename(&tmp, out).map_err(TrainError::io(out))
}
