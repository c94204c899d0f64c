//! Supervised pretraining of the base model: next-token loss on the worked solution (and
//! `<eos>`) of arithmetic problems (a mixture of difficulty levels, character tokenizer) or
//! of GSM8K-format word problems (a BPE trained on them, ChatML prompts), AdamW with warm-up and
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
use r3_routing::summed_expert_load;
use r3_tasks::{
    ArithmeticTask, CharTokenizer, Difficulty, GroundTruthUse, LossOn, Reward, RewardKind,
    RewardSpec, SupervisedBatch, SupervisedBatches, PAD_ID,
};
use r3_text::TextTokenizer;
use serde::Serialize;

use crate::config::train::DataConfig;
use crate::policy::model_text::ModelText;
use crate::pretrain::config::Corpus;
use crate::pretrain::corpus::{
    batch_tensors, example, excluded_prompts, train_word_problem_tokenizer,
    write_word_problem_tokenizer, WordProblemStream, PAD_TOKEN, TURN_END,
};
use crate::rl::prompt_source::load_split;

use crate::algo::logprob::{masked_mean, token_log_probs};
use crate::algo::optim::{decay_matrices_only, AdamW, AdamWParams};
use crate::algo::schedule::{LrDecay, LrSchedule};
use crate::algo::update::{backward_and_step, UpdateOutcome};
use crate::error::{Result, TrainError};
use crate::policy::trainable::TrainablePolicy;
use crate::pretrain::config::PretrainConfig;
use crate::pretrain::deepseek::PretrainArchitecture;
use crate::pretrain::expert_balance::{normalised_entropy, update_score_bias};
use crate::rl::evaluation::EvalSpec;
use crate::rl::sampling::{evaluate, evaluate_prompts, EvalResult};

/// Stream tag mixed into the seed of the word-problem corpus (distinct from `r3 data
/// generate`'s seeds, and the validation questions are excluded besides).
const WORD_PROBLEM_STREAM: u64 = 0x5750;

/// Progress events of a pretraining run.
#[derive(Debug, Clone)]
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
    /// Corpus draws skipped because their question is in an excluded (validation) file.
    pub corpus_skipped: u64,
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
    if probe.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let model = policy.frozen_model()?;
    let out = model.forward(&Batch::new(probe, PAD_ID, &Device::Cpu)?, Routing::Record)?;
    let routes = out.routes.ok_or_else(|| TrainError::Length {
        what: "route tables of the load probe (Record forward)".into(),
        got: 0,
        expected: probe.len(),
    })?;
    let loads = summed_expert_load(&routes)?.per_layer;
    Ok((
        loads.iter().map(|l| l.layer).collect(),
        loads
            .iter()
            .map(|l| normalised_entropy(&l.counts))
            .collect(),
    ))
}

/// A fresh f16 rollout engine holding `policy`'s weights (for evaluations).
fn eval_engine(policy: &TrainablePolicy) -> Result<Engine> {
    let cfg = EngineConfig {
        dtype: Dtype::F16,
        prefix_cache: false,
        ..EngineConfig::default()
    };
    Ok(Engine::new(
        policy.config().clone(),
        &policy.tensor_map()?,
        cfg,
    )?)
}

/// Greedy held-out accuracy of `policy` through a fresh f16 rollout engine.
pub fn eval_policy(
    policy: &TrainablePolicy,
    tokenizer: &ModelText,
    task: &ArithmeticTask,
    max_new_tokens: usize,
) -> Result<EvalResult> {
    let mut engine = eval_engine(policy)?;
    evaluate(
        &mut engine,
        tokenizer,
        task.eval_set(),
        max_new_tokens,
        0.0,
        0,
    )
}

/// A randomly initialised policy of `cfg`'s shape with HF config `hf`.
fn init_policy(cfg: &PretrainConfig, hf: serde_json::Value) -> Result<TrainablePolicy> {
    let model_cfg = Config::from_value(hf)?;
    let init = RandomInit {
        seed: cfg.seed,
        std: cfg.model.init_std,
        router_std: cfg.model.router_init_std,
        norm_jitter: 0.0,
        bias_std: 0.0,
    };
    let weights = Weights::random(&model_cfg, &init, &Device::Cpu)?;
    TrainablePolicy::new(model_cfg, weights)
}

/// Input sequences, next-token targets `[B, T]` and loss mask `[B, T]` of one step.
type StepBatch = (Vec<Vec<u32>>, Tensor, Tensor);

/// What the training loop produced.
struct LoopOutcome {
    evals: Vec<(u64, f64)>,
    final_loss: f64,
    moe_layers: Vec<usize>,
    load_entropy_init: Vec<f64>,
    load_entropy_final: Vec<f64>,
}

impl LoopOutcome {
    /// The run's report, `started` being when the run began.
    fn into_report(
        self,
        cfg: &PretrainConfig,
        started: Instant,
        corpus_skipped: u64,
    ) -> PretrainReport {
        PretrainReport {
            steps: cfg.steps,
            wall_s: started.elapsed().as_secs_f64(),
            final_loss: self.final_loss,
            evals: self.evals,
            eval_difficulty: cfg.eval_difficulty,
            moe_layers: self.moe_layers,
            load_entropy_init: self.load_entropy_init,
            load_entropy_final: self.load_entropy_final,
            corpus_skipped,
            config: cfg.clone(),
        }
    }
}

/// The optimisation loop shared by every corpus: `next_batch` gives each step's batch,
/// `evaluate` scores the policy every `eval_every` steps and at the end; the expert load of
/// `probe` is measured before the first step, at each evaluation and after the last step.
fn train_loop(
    cfg: &PretrainConfig,
    policy: &mut TrainablePolicy,
    probe: &[Vec<u32>],
    next_batch: &mut dyn FnMut(u64) -> Result<StepBatch>,
    evaluate: &mut dyn FnMut(&TrainablePolicy) -> Result<EvalResult>,
    on_event: &mut dyn FnMut(PretrainEvent),
) -> Result<LoopOutcome> {
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
    // Aux-loss-free balancing moves the selection bias from each step's own routes.
    let bias_rate = match cfg.model.architecture {
        PretrainArchitecture::DeepseekV3 => cfg.model.deepseek.bias_update_rate,
        PretrainArchitecture::Qwen3Moe => 0.0,
    };
    let routing = if bias_rate > 0.0 {
        Routing::Record
    } else {
        Routing::Native
    };
    let (moe_layers, load_entropy_init) = probe_load_entropy(policy, probe)?;
    tracing::info!(step = 0, entropy = ?rounded(&load_entropy_init), "expert load entropy per MoE layer");
    let mut evals = Vec::new();
    let mut recent = Vec::new();
    for step in 1..=cfg.steps {
        let (seqs, targets, mask) = next_batch(step)?;
        let model = policy.model()?;
        let out = model.forward(&Batch::new(&seqs, PAD_ID, &Device::Cpu)?, routing)?;
        let logp = token_log_probs(&out.logits, &targets)?;
        let loss = masked_mean(&logp, &mask)?.neg()?;
        let outcome = backward_and_step(&mut opt, &loss, schedule.lr_at(step - 1), cfg.grad_clip)?;
        let (value, applied) = match outcome {
            UpdateOutcome::Applied { loss, .. } => (loss, true),
            UpdateOutcome::Skipped { loss, .. } => (loss, false),
        };
        if let Some(routes) = out.routes.as_deref() {
            update_score_bias(policy, &summed_expert_load(routes)?.per_layer, bias_rate)?;
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
            let result = evaluate(policy)?;
            evals.push((step, result.accuracy));
            on_event(PretrainEvent::Eval { step, result });
            let (_, entropy) = probe_load_entropy(policy, probe)?;
            tracing::info!(step, entropy = ?rounded(&entropy), "expert load entropy per MoE layer");
        }
    }
    let (_, load_entropy_final) = probe_load_entropy(policy, probe)?;
    Ok(LoopOutcome {
        evals,
        final_loss: recent.iter().sum::<f64>() / recent.len().max(1) as f64,
        moe_layers,
        load_entropy_init,
        load_entropy_final,
    })
}

/// Runs pretraining and writes the checkpoint to `cfg.out_dir`.
pub fn pretrain(
    cfg: &PretrainConfig,
    on_event: &mut dyn FnMut(PretrainEvent),
) -> Result<PretrainReport> {
    match cfg.corpus {
        Corpus::Arithmetic => pretrain_arithmetic(cfg, on_event),
        Corpus::WordProblems => pretrain_word_problems(cfg, on_event),
    }
}

/// Pretraining on worked arithmetic solutions with the character tokenizer.
fn pretrain_arithmetic(
    cfg: &PretrainConfig,
    on_event: &mut dyn FnMut(PretrainEvent),
) -> Result<PretrainReport> {
    let started = Instant::now();
    let tokenizer = CharTokenizer::new()?;
    let text = ModelText::from_parts(
        TextTokenizer::from_tokenizer(tokenizer.inner().clone(), CharTokenizer::special_tokens())?,
        None,
    );
    let mut policy = init_policy(cfg, cfg.hf_config(tokenizer.vocab_size()))?;
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
                crate::rl::sampling::mix_seed(&[cfg.seed, u64::from(l)]),
                cfg.batch_size,
                None,
                LossOn::Solution,
            )
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let probe = SupervisedBatches::new(
        &eval_task,
        &tokenizer,
        crate::rl::sampling::mix_seed(&[cfg.seed, cfg.eval_seed, u64::from(cfg.eval_difficulty)]),
        cfg.batch_size,
        None,
        LossOn::Solution,
    )?
    .next()
    .ok_or(TrainError::ProblemStreamEnded)??;
    let (probe_seqs, _, _) = to_tensors(&probe)?;
    let mut next_batch = |step: u64| -> Result<StepBatch> {
        let k = (step as usize - 1) % streams.len();
        let batch = streams[k].next().ok_or(TrainError::ProblemStreamEnded)??;
        to_tensors(&batch)
    };
    let mut evaluate = |p: &TrainablePolicy| eval_policy(p, &text, &eval_task, cfg.max_new_tokens);
    let outcome = train_loop(
        cfg,
        &mut policy,
        &probe_seqs,
        &mut next_batch,
        &mut evaluate,
        on_event,
    )?;
    let report = outcome.into_report(cfg, started, 0);
    write_checkpoint(&cfg.out_dir, &policy, &report, &|dir| {
        Ok(tokenizer.save(&dir.join("tokenizer.json"))?)
    })?;
    Ok(report)
}

/// Pretraining on GSM8K-format word problems with a BPE trained on them first; the
/// questions of `word_problems.exclude_files` never appear.
fn pretrain_word_problems(
    cfg: &PretrainConfig,
    on_event: &mut dyn FnMut(PretrainEvent),
) -> Result<PretrainReport> {
    let started = Instant::now();
    let wp = &cfg.word_problems;
    let exclude = excluded_prompts(&wp.exclude_files)?;
    let mut stream = WordProblemStream::new(
        crate::rl::sampling::mix_seed(&[cfg.seed, WORD_PROBLEM_STREAM]),
        exclude,
    );
    let text = train_word_problem_tokenizer(&mut stream, &cfg.tokenizer, &wp.system_prompt)?;
    tracing::info!(
        vocab = text.vocab_size(),
        texts = cfg.tokenizer.train_texts,
        "BPE tokenizer trained"
    );
    let mut hf = cfg.hf_config(text.vocab_size());
    // ChatML has no <bos>; generation ends at <|im_end|>.
    let ids = |t: &str| text.tokenizer().token_id(t).map(serde_json::Value::from);
    hf["bos_token_id"] = serde_json::Value::Null;
    hf["eos_token_id"] = ids(TURN_END).unwrap_or_default();
    hf["pad_token_id"] = ids(PAD_TOKEN).unwrap_or_default();
    let mut policy = init_policy(cfg, hf)?;
    let data = DataConfig {
        apply_chat_template: true,
        system_prompt: wp.system_prompt.clone(),
        max_prompt_length: 0,
        ..DataConfig::default()
    };
    let eval_items = match wp.eval_files.is_empty() {
        true => Vec::new(),
        false => {
            let room = policy.config().max_position_embeddings.saturating_sub(1);
            // Scored with the `math` reward below: its ground truths must be text.
            let truth = GroundTruthUse::Text(RewardKind::Math);
            let mut items = load_split(&wp.eval_files, &text, &data, room, "eval", truth)?.items;
            items.truncate(cfg.eval_size.max(1));
            items
        }
    };
    let reward = Reward::from_spec(
        &RewardSpec {
            kind: RewardKind::Math,
            ..RewardSpec::default()
        },
        0.0,
    );
    let mut next_batch = |_step: u64| -> Result<StepBatch> {
        let examples = (0..cfg.batch_size)
            .map(|_| example(&text, &stream.next_problem()?, &wp.system_prompt))
            .collect::<Result<Vec<_>>>()?;
        batch_tensors(&examples)
    };
    let mut evaluate = |p: &TrainablePolicy| -> Result<EvalResult> {
        if eval_items.is_empty() {
            return Ok(EvalResult {
                accuracy: f64::NAN,
                ..EvalResult::default()
            });
        }
        let mut engine = eval_engine(p)?;
        let eos = engine.eos_token_ids().to_vec();
        evaluate_prompts(
            &mut engine,
            &eos,
            &text,
            &eval_items,
            &reward,
            &EvalSpec::single(
                cfg.max_new_tokens,
                wp.eval_temperature as f32,
                cfg.eval_seed,
            ),
        )
    };
    // The held-out prompts are the load probe (none without eval files).
    let probe: Vec<Vec<u32>> = eval_items
        .iter()
        .take(cfg.batch_size)
        .map(|item| item.ids.clone())
        .collect();
    let outcome = train_loop(
        cfg,
        &mut policy,
        &probe,
        &mut next_batch,
        &mut evaluate,
        on_event,
    )?;
    let report = outcome.into_report(cfg, started, stream.skipped);
    write_checkpoint(&cfg.out_dir, &policy, &report, &|dir| {
        write_word_problem_tokenizer(&text, dir)
    })?;
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
    report: &PretrainReport,
    write_tokenizer: &dyn Fn(&Path) -> Result<()>,
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
    write_tokenizer(&tmp)?;
    let text = serde_json::to_string_pretty(report)
        .map_err(TrainError::json("serialising pretrain report"))?;
    let report_path = tmp.join("pretrain.json");
    std::fs::write(&report_path, text).map_err(TrainError::io(&report_path))?;
    if out.exists() {
        std::fs::remove_dir_all(out).map_err(TrainError::io(out))?;
    }
    std::fs::rename(&tmp, out).map_err(TrainError::io(out))
}
