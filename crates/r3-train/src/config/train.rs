//! The `r3 train` configuration: a serde struct read from TOML, every field documented
//! with its default, and the settings derived from it (clip range, importance sampling,
//! LR schedule, the run's length). Reading, checking and saving it is `config::load`.

use crate::algo::agg::LossAgg;
use crate::algo::loss::{ClipRange, PolicyLossKind};
use crate::algo::optim::UpdateStaging;
use crate::algo::rollout_is::{IsConfig, IsLevel, IsMode};
use crate::algo::schedule::{LrDecay, LrSchedule};
use crate::error::{Result, TrainError};
use crate::policy::precision::TrainPrecisionConfig;
use r3_model::layers::attention::ScoreTiles;
use r3_tasks::RewardSpec;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Which routes the training engine replays. Written `disabled`, `R2`, `R3` (config,
/// metrics, CLI); read in any case, and `none` as `disabled`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(try_from = "String", into = "String")]
pub enum RouterReplay {
    /// No replay: every training pass routes natively.
    Disabled,
    /// Vanilla routing replay: record the routes of the old-log-prob pass, replay them in
    /// every update pass.
    R2,
    /// Rollout routing replay: replay the rollout engine's routes in the old-log-prob pass
    /// and in every update pass.
    #[default]
    R3,
}

impl RouterReplay {
    /// The name written in configs and in the metrics' `replay_mode`.
    pub const fn as_str(self) -> &'static str {
        match self {
            RouterReplay::Disabled => "disabled",
            RouterReplay::R2 => "R2",
            RouterReplay::R3 => "R3",
        }
    }
}

impl std::fmt::Display for RouterReplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RouterReplay {
    type Err = TrainError;

    /// Case-insensitive, surrounding spaces ignored; `none` is `disabled`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "disabled" | "none" => Ok(RouterReplay::Disabled),
            "r2" => Ok(RouterReplay::R2),
            "r3" => Ok(RouterReplay::R3),
            _ => Err(TrainError::UnknownReplayMode(s.to_string())),
        }
    }
}

impl TryFrom<String> for RouterReplay {
    type Error = TrainError;

    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<RouterReplay> for String {
    fn from(mode: RouterReplay) -> String {
        mode.as_str().to_string()
    }
}

/// The whole run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Seed of every random choice (prompt order, sampling, anything else). Default 0.
    pub seed: u64,
    /// Base model directory in HF layout (`config.json`, `model.safetensors`,
    /// `tokenizer.json`). Default `models/base`.
    pub model_dir: PathBuf,
    /// Where the run writes `config.toml`, `metrics.jsonl` and checkpoints. Default `runs/default`.
    pub run_dir: PathBuf,
    /// RL steps (each: rollout, old log-probs, advantages, `algo.mini_batches` updates). Default 60.
    pub steps: u64,
    /// The verifiable task.
    pub task: TaskConfig,
    /// Sampling of responses.
    pub rollout: RolloutConfig,
    /// The RL algorithm.
    pub algo: AlgoConfig,
    /// Optimiser and learning-rate schedule.
    pub optim: OptimConfig,
    /// Held-out evaluation.
    pub eval: EvalConfig,
    /// Checkpointing.
    pub checkpoint: CheckpointConfig,
    /// A user dataset (verl's RL schema); no training files = the built-in arithmetic task.
    pub data: DataConfig,
    /// The reward of a response (default: the arithmetic task's `arith` rule).
    pub reward: RewardSpec,
    /// Training-engine precision (`[train] dtype`, `router_dtype`).
    pub train: TrainPrecisionConfig,
}

/// The arithmetic task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TaskConfig {
    /// Difficulty preset, 1 (two 1–2 digit operands, `+ -`) to 5 (4–6 operands up to 4
    /// digits, `+ - *`). Default 2.
    pub difficulty: u32,
    /// Reward for a well-formed but wrong answer; 0.0 = pure exact match. Default 0.0.
    pub format_reward: f64,
}

/// Rollout sampling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutConfig {
    /// Distinct prompts per RL step. Default 32.
    pub prompts_per_step: usize,
    /// Responses sampled per prompt (the GRPO group). Default 8.
    pub group_size: usize,
    /// Most tokens generated per response. Default 64.
    pub max_new_tokens: usize,
    /// Sampling temperature `T`, in [1e-6, 100] (below 1e-6, SGLang's greedy threshold, the
    /// engines sample greedily and report raw log-probs, so it is refused): the rollouts
    /// sample from `softmax(logits / T)` and the engines report each token's log-prob under
    /// it, and the trainer scores that same policy (its log-probs with their gradient, the
    /// old-policy pass, the entropy), as verl and slime do, so ratios, IS weights and the
    /// mismatch compare like with like. An SGLang fleet must report the tempered log-probs
    /// (its default: run it without `SGLANG_RETURN_ORIGINAL_LOGPROB`). Default 1.0 (the raw
    /// logits).
    pub temperature: f64,
    /// Rollout engine precision: `f16` (fast inference path), `bf16` (weights and activations
    /// in bf16 where SGLang / vLLM keep them) or `f32`. Default `f16`.
    pub dtype: String,
    /// Rollout router precision: `model` (the gate in the engine dtype, as vLLM and SGLang
    /// run it; `rollout.dtype`'s own name says the same) or `f32` (an fp32 router); another
    /// dtype's name is refused. Default `model`.
    pub router_dtype: String,
    /// What the rollout engine's KV cache holds keys and values in: `auto` (the engine's
    /// dtype, as SGLang's and vLLM's caches do), `f32`, `f16` or `bf16` for the CPU engine;
    /// `auto`, the engine's dtype or `f32` for the device engine (each exact there). Default
    /// `auto`.
    pub kv_cache_dtype: String,
    /// Which in-process engine generates, and where (`backend = "engine"`): `cpu` (the CPU
    /// engine), `cpu-candle` (the device engine on candle's CPU device), `cuda` / `cuda:N`
    /// (the device engine on a GPU; needs a build with the `cuda` feature). Default `cpu`.
    pub device: String,
    /// Sequences the in-process engine decodes at once at most (the rest wait for a row);
    /// `r3 serve --max-running`. Default 256.
    pub max_running: usize,
    /// The in-process engine's KV cache budget in MiB (the device engine's admission holds
    /// every batch to it); `r3 serve --kv-cache-mib`. Default 2048.
    pub kv_cache_mib: usize,
    /// The device engine's activation budget for one step in MiB (its admission holds
    /// every step to it; the CPU engine does not read it); `r3 serve --activation-mib`.
    /// Default 8192.
    pub activation_mib: usize,
    /// Positions one prefill step of the in-process engine feeds at most (the device
    /// engine's cap on a prefill batch, a longer prompt fed in chunks of it; the CPU
    /// engine's prefill tokens of one step beside its decoding rows); `r3 serve
    /// --chunked-prefill-size`. 0 is none (the
    /// device engine's prefills bounded by `activation_mib` alone, the CPU engine's steps
    /// by 4096 tokens), as `prefix_cache_mib = 0` is no cache. Default 0.
    pub chunked_prefill_size: usize,
    /// The in-process engine's prefix cache budget in MiB (0 disables it: a GRPO group's
    /// samples then prefill their prompt each); `r3 serve --prefix-cache-mib`. Default 1024.
    pub prefix_cache_mib: usize,
    /// Where rollouts come from: `engine` (the in-process engine) or `sglang` (SGLang
    /// `/generate` on the workers of `urls`: `r3 serve` processes, SGLang servers or one
    /// router). Default `engine`.
    pub backend: RolloutBackend,
    /// Worker base URLs (`http://host:port`) for `backend = "sglang"`. Default empty.
    pub urls: Vec<String>,
    /// Most `/generate` requests in flight over the whole fleet. Default 64.
    pub max_in_flight: usize,
    /// Longest wait for one worker answer, seconds. Default 120.
    pub request_timeout_s: f64,
    /// Extra attempts of a request after a worker fault (timeout, refusal, bad reply),
    /// each on another worker when one is up. Default 3.
    pub max_retries: u32,
    /// Where the trainer writes the weights workers load after each update
    /// (`step_<N>/`); empty = `<run_dir>/rollout_sync`. Workers must be able to read it.
    /// Default empty.
    pub sync_dir: PathBuf,
    /// Replies from weights up to this many versions older are accepted and counted in
    /// `rollout.stale_frac`; older ones are refused and retried. Default 0.
    pub max_staleness: u64,
    /// One-step off-policy rollout (`backend = "sglang"` only): the fleet generates step
    /// n+1's batch on the weights step n started from while step n updates, and step n's
    /// weights reach the workers once that batch is in. Every batch after the first is one
    /// version old, so it needs `max_staleness >= 1`. Default false.
    #[serde(rename = "async")]
    pub async_rollout: bool,
    /// Bearer key sent to the workers (`r3 serve --api-key`); empty = none. Default empty.
    pub api_key: String,
    /// A request a worker aborts (at a weight update): `resume` continues it from its
    /// tokens so far (partial rollout), `restart` sends it again from the prompt.
    /// Default `resume`.
    pub partial: r3_fleet::PartialMode,
    /// How a resumed request's route pieces merge: `keep_per_token_origin` (each row from
    /// the call that fed it), `replace_with_resumed` (the continuation re-reports every
    /// row) or `prefer_resumed_from_its_start` (slime's merge: the earlier rows up to the
    /// continuation's first row, then the continuation's). Default `keep_per_token_origin`.
    pub partial_merge: r3_routing::MergePolicy,
}

/// Where rollouts are generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RolloutBackend {
    /// The in-process engine holding the policy's weights.
    #[default]
    Engine,
    /// SGLang-compatible workers over HTTP.
    Sglang,
}

/// Default `algo.max_tokens_per_micro_batch`: verl's default token budget per GPU
/// micro-batch; the default run's 256 sequences of up to ~60 tokens fit in one.
pub const DEFAULT_MAX_TOKENS_PER_MICRO_BATCH: usize = 16384;

/// `algo.attention_tile_mib`'s default: 1 GiB of f32 scores per attention product.
pub const DEFAULT_ATTENTION_TILE_MIB: usize = 1024;

/// Policy optimisation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlgoConfig {
    /// Router replay: `disabled`, `R2` or `R3`. Reference and eval passes always route
    /// natively. Default `R3`.
    pub router_replay: RouterReplay,
    /// Policy loss: `ppo` (token ratio, clip-higher) or `gspo` (sequence ratio). Default `ppo`.
    pub loss: PolicyLossKind,
    /// PPO `ε_low`: ratio clipped below at `1 − eps_low`. Default 0.2.
    pub eps_low: f64,
    /// PPO `ε_high`: ratio clipped above at `1 + eps_high` (clip-higher). Default 0.27.
    pub eps_high: f64,
    /// PPO dual-clip `c` (verl's `clip_ratio_c`): where an advantage is negative, the
    /// per-token loss is also capped at `−A · c`, so a token whose ratio has run far past
    /// `1 + eps_high` stops adding loss and gradient. Must be > 1 when set; 0 = off. verl's
    /// default is 3.0, slime's is off (`--eps-clip-c` unset). `loss = ppo` only (verl's
    /// GSPO has none): set with `loss = gspo` it is refused. Default 0 (off).
    pub clip_ratio_c: f64,
    /// GSPO lower clip of the sequence ratio. Default 3e-4.
    pub gspo_eps_low: f64,
    /// GSPO upper clip of the sequence ratio. Default 4e-4.
    pub gspo_eps_high: f64,
    /// PPO loss aggregation: `token-mean`, `seq-mean-token-mean` or `seq-mean-token-sum`
    /// (GSPO always uses `seq-mean-token-mean`). The entropy bonus is aggregated the same
    /// way under either loss (as verl's actor). Default `token-mean`.
    pub loss_agg: LossAgg,
    /// Divide GRPO advantages by the group's std (false = Dr. GRPO). Default true.
    pub adv_norm_by_std: bool,
    /// Epsilon added to the group std. Default 1e-6.
    pub adv_eps: f64,
    /// Drop groups whose rewards are all equal before the update (DAPO). Default true.
    pub dynamic_sampling: bool,
    /// Most rollout rounds a step draws to fill `rollout.prompts_per_step` groups whose
    /// rewards differ (DAPO's dynamic sampling with refill; needs `dynamic_sampling`): each
    /// further round samples `prompts_per_step` fresh prompts, and the step trains on the
    /// first `prompts_per_step` kept groups. With `data.total_epochs`, refill draws only the
    /// prompts the run's later steps do not need (the run stays within its epochs). 1 = drop
    /// only (the batch shrinks). Default 1.
    pub sampling_rounds: usize,
    /// Optimiser steps per RL step. 1 = single mini-step: the whole batch in one update,
    /// old log-probs not recomputed (ratio 1 at the update). >1 = multi-mini-step: old
    /// log-probs computed once, then the batch is split into this many updates. Default 1.
    pub mini_batches: usize,
    /// Importance-sampling correction with rollout log-probs: `none`, `tis` or `mis`. Default `none`.
    pub is_mode: IsMode,
    /// IS ratio granularity: `token` or `sequence`. Default `token`.
    pub is_level: IsLevel,
    /// IS threshold `C` (TIS truncation / MIS drop-above). Default 2.0.
    pub is_threshold: f64,
    /// Entropy bonus coefficient (loss −= coef · entropy, the entropy aggregated over the
    /// response tokens with `loss_agg`); 0 disables. Default 0.0.
    pub entropy_coef: f64,
    /// Token budget of one micro-batch in every training pass that holds activations (the
    /// old-log-prob pass and each update): a micro-batch costs its rows × its longest
    /// sequence (prompt + response, the width the forward pads to). Rows are sorted by
    /// length and packed into micro-batches within the budget, their gradients summed
    /// before the one optimiser step of the mini-batch (the same update to float rounding,
    /// in memory that grows with the budget, not the batch). A single sequence longer than
    /// the budget forms its own micro-batch. 0 = the whole mini-batch in one forward.
    /// Default 16384 (verl's `ppo_max_token_len_per_gpu`).
    pub max_tokens_per_micro_batch: usize,
    /// Activation checkpointing of the update's forwards (HF's `gradient_checkpointing`,
    /// verl's `enable_gradient_checkpointing`, Megatron's full recompute): each forward keeps
    /// only every decoder layer's input and the experts it dispatched, and the backward runs
    /// each layer again, its dispatched experts forced, before differentiating it. The same
    /// gradients bit for bit, in memory that holds one layer's activations instead of all of
    /// them, for about one more forward per update (timed in `time.update_backward_s`).
    /// Default false.
    pub gradient_checkpointing: bool,
    /// Selective recomputation (Megatron's `--recompute-granularity selective`, for the
    /// cheap ops only): each update forward's attention q and k, from the projections to the
    /// rotated heads (the per-head norm, the rotation and its rounding), are one op that
    /// runs them again in the backward, so the graph keeps the projections' outputs alone
    /// instead of three more copies of q and k. The same gradients bit for bit; on the
    /// 30B-A3B layer shape at 8 × 512 tokens ≈ 0.2 GB a layer less, for those ops' forward
    /// once more. GQA layers (MLA's are unaffected). Default false.
    pub selective_recompute: bool,
    /// MiB of f32 attention scores one product of a training forward may hold on a GPU (the
    /// CPU's fused attention works in small blocks of its own): past it the query rows are
    /// attended in blocks, forward and backward, so long sequences do not hold their
    /// `heads · T²` scores at once (four such tensors in the backward). The same values;
    /// the keys' and values' gradients summed over the blocks. 0: one product a layer.
    /// Default 1024 (the 30B-A3B layer shape at 8 × 512 tokens holds 256 MiB: untouched).
    pub attention_tile_mib: usize,
    /// Positions that sequences of a training forward hold alike (a GRPO group's prompt,
    /// repeated in each of its samples; under replay only where the replayed experts agree
    /// too) are computed once per micro-batch and read by each sample's attention, and rows
    /// are packed into micro-batches in token order so that a group's samples land
    /// together: the same update to float rounding, on fewer rows (the old-log-prob pass
    /// and every update forward). In a 16-bit `train.dtype` a shared row's gradient, the sum
    /// of its sequences', is rounded once where unshared each sequence's was. GQA and MLA
    /// attention alike, with activation checkpointing or without. Default true.
    pub share_prefixes: bool,
    /// Score the vocabulary head this many response tokens at a time without keeping their
    /// logits (a fused linear cross-entropy): a forward holds `head_chunk_tokens × vocab`
    /// logits at a time instead of one row per response token, and the backward runs each
    /// chunk's norm and head again (one more forward of the head). The same log-probs and
    /// entropies; the head's weight gradient summed over the chunks. For a large
    /// vocabulary, whose logits would be a step's largest tensors. Default 0: the logits
    /// kept whole.
    pub head_chunk_tokens: usize,
}

/// AdamW and the learning-rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// Peak learning rate. Default 1e-4.
    pub lr: f64,
    /// Updates of linear warm-up (places in the schedule: `mini_batches` per step, whether
    /// or not an update ran). Default 5.
    pub warmup_steps: u64,
    /// After warm-up: `constant` or `cosine`. Default `constant`.
    pub lr_decay: LrDecay,
    /// Final LR as a fraction of the peak (cosine only). Default 0.1.
    pub min_lr_ratio: f64,
    /// Decoupled weight decay on matrices (not norms or biases). Default 0.0.
    pub weight_decay: f64,
    /// AdamW β1. Default 0.9.
    pub beta1: f64,
    /// AdamW β2. Default 0.999.
    pub beta2: f64,
    /// AdamW epsilon. Default 1e-8.
    pub adam_eps: f64,
    /// Global gradient-norm clip; 0 disables (the norm is still measured). Default 1.0.
    pub grad_clip: f64,
    /// How the guarded update is staged before it commits: `whole_step` (every tensor's new
    /// parameters and moments computed and checked, then committed: 12 bytes a parameter
    /// held meanwhile) or `tensor_by_tensor` (checked one tensor at a time, then each
    /// computed again and committed: twice the optimiser's arithmetic, one tensor's worth
    /// held). The same update either way. Default `whole_step`.
    pub update_staging: UpdateStaging,
    /// The dtype AdamW keeps both moments in: `f32` (default) or `bf16` (4 bytes a parameter
    /// instead of 8, the precision-aware optimiser's `exp_avg_dtype` / `exp_avg_sq_dtype`:
    /// each step computes them in f32 and rounds them to bf16 stochastically, seeded by the
    /// run's seed, so the second moment's small steps are kept in expectation).
    pub moments_dtype: String,
}

impl OptimConfig {
    /// The dtype `moments_dtype` names; any other value is a config error.
    pub fn moment_dtype(&self) -> crate::error::Result<candle_core::DType> {
        match self.moments_dtype.as_str() {
            "f32" => Ok(candle_core::DType::F32),
            "bf16" => Ok(candle_core::DType::BF16),
            other => Err(crate::error::TrainError::InvalidConfig {
                field: "optim.moments_dtype",
                reason: format!("`{other}` must be `f32` or `bf16`"),
            }),
        }
    }
}

/// Held-out evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Evaluate every N RL steps (and after the last); 0 = never. Default 10.
    pub every: u64,
    /// Problems in the fixed held-out eval set. Default 200.
    pub size: usize,
    /// Seed of the eval set (fixed, independent of `seed`). Default 1234.
    pub seed: u64,
    /// Eval sampling temperature; 0 = greedy, otherwise in [1e-6, 100] (the engines would
    /// sample greedily below 1e-6 as SGLang does). Default 0.0.
    pub temperature: f64,
    /// Samples per held-out prompt (`k` of `mean@k`, `pass@k`, `maj@k`); more than one
    /// needs `temperature > 0`. Default 1.
    pub samples_per_prompt: usize,
    /// Bootstrap resamples over prompts for `maj@k`'s seeded percentile bootstrap, stored in
    /// `eval.jsonl` beside the Wilson interval r3 reports (the bootstrap under-covers near 0
    /// and 1); 0 = none. Default 1000.
    pub bootstrap_resamples: usize,
}

/// Checkpointing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Write a checkpoint every N RL steps (and after the last); 0 = never. Default 20.
    pub every: u64,
    /// Checkpoints kept in the run directory (older ones deleted); 0 = keep all. Default 2.
    pub keep_last: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            model_dir: PathBuf::from("models/base"),
            run_dir: PathBuf::from("runs/default"),
            steps: 60,
            task: TaskConfig::default(),
            rollout: RolloutConfig::default(),
            algo: AlgoConfig::default(),
            optim: OptimConfig::default(),
            eval: EvalConfig::default(),
            checkpoint: CheckpointConfig::default(),
            data: DataConfig::default(),
            reward: RewardSpec::default(),
            train: TrainPrecisionConfig::default(),
        }
    }
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            difficulty: 2,
            format_reward: 0.0,
        }
    }
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            prompts_per_step: 32,
            group_size: 8,
            max_new_tokens: 64,
            temperature: 1.0,
            dtype: "f16".into(),
            router_dtype: "model".into(),
            kv_cache_dtype: "auto".into(),
            device: "cpu".into(),
            max_running: 256,
            kv_cache_mib: 2048,
            activation_mib: 8192,
            chunked_prefill_size: 0,
            prefix_cache_mib: 1024,
            backend: RolloutBackend::Engine,
            urls: Vec::new(),
            max_in_flight: 64,
            request_timeout_s: 120.0,
            max_retries: 3,
            sync_dir: PathBuf::new(),
            max_staleness: 0,
            async_rollout: false,
            api_key: String::new(),
            partial: r3_fleet::PartialMode::Resume,
            partial_merge: r3_routing::MergePolicy::KeepPerTokenOrigin,
        }
    }
}

/// The bound `mib` MiB of f32 scores puts on one attention product (0: none).
pub fn attention_tiles(mib: usize) -> ScoreTiles {
    match mib {
        0 => ScoreTiles::WHOLE,
        mib => ScoreTiles::at_most(mib.saturating_mul(1 << 20) / 4),
    }
}

impl AlgoConfig {
    /// The bound `attention_tile_mib` puts on one attention product's f32 scores.
    pub fn attention_tiles(&self) -> ScoreTiles {
        attention_tiles(self.attention_tile_mib)
    }
}

impl Default for AlgoConfig {
    fn default() -> Self {
        Self {
            router_replay: RouterReplay::R3,
            loss: PolicyLossKind::Ppo,
            eps_low: 0.2,
            eps_high: 0.27,
            clip_ratio_c: 0.0,
            gspo_eps_low: 3e-4,
            gspo_eps_high: 4e-4,
            loss_agg: LossAgg::TokenMean,
            adv_norm_by_std: true,
            adv_eps: 1e-6,
            dynamic_sampling: true,
            sampling_rounds: 1,
            mini_batches: 1,
            is_mode: IsMode::None,
            is_level: IsLevel::Token,
            is_threshold: 2.0,
            entropy_coef: 0.0,
            max_tokens_per_micro_batch: DEFAULT_MAX_TOKENS_PER_MICRO_BATCH,
            gradient_checkpointing: false,
            selective_recompute: false,
            attention_tile_mib: DEFAULT_ATTENTION_TILE_MIB,
            share_prefixes: true,
            head_chunk_tokens: 0,
        }
    }
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            lr: 1e-4,
            warmup_steps: 5,
            lr_decay: LrDecay::Constant,
            min_lr_ratio: 0.1,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            adam_eps: 1e-8,
            grad_clip: 1.0,
            update_staging: UpdateStaging::WholeStep,
            moments_dtype: "f32".into(),
        }
    }
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            every: 10,
            size: 200,
            seed: 1234,
            temperature: 0.0,
            samples_per_prompt: 1,
            bootstrap_resamples: 1000,
        }
    }
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            every: 20,
            keep_last: 2,
        }
    }
}

impl TrainConfig {
    /// The clip range of the configured loss.
    pub fn clip_range(&self) -> ClipRange {
        match self.algo.loss {
            PolicyLossKind::Ppo => ClipRange {
                low: self.algo.eps_low,
                high: self.algo.eps_high,
                // 0 is off (a config key cannot be absent: see `config::overrides`).
                dual_clip: (self.algo.clip_ratio_c != 0.0).then_some(self.algo.clip_ratio_c),
            },
            PolicyLossKind::Gspo => ClipRange {
                low: self.algo.gspo_eps_low,
                high: self.algo.gspo_eps_high,
                dual_clip: None,
            },
        }
    }

    /// The importance-sampling settings.
    pub fn is_config(&self) -> IsConfig {
        IsConfig {
            mode: self.algo.is_mode,
            level: self.algo.is_level,
            threshold: self.algo.is_threshold,
        }
    }

    /// The LR schedule over a run of `run_steps` RL steps (the steps it will take:
    /// [`TrainConfig::total_steps`], fewer than `steps` where the epochs run out first), of
    /// `mini_batches` updates each. An update's place in it is fixed by its step and its
    /// mini-batch (see [`TrainConfig::lr_position`]), whatever updates ran before it.
    pub fn lr_schedule(&self, run_steps: u64) -> LrSchedule {
        LrSchedule {
            peak_lr: self.optim.lr,
            warmup_steps: self.optim.warmup_steps,
            total_steps: run_steps * self.algo.mini_batches as u64,
            decay: self.optim.lr_decay,
            min_lr_ratio: self.optim.min_lr_ratio,
        }
    }

    /// The most tokens a training prompt may hold for the rollout backend to generate after
    /// it within a model context of `context` positions: r3's engines need one position left
    /// (they stop at the context's end); an SGLang worker refuses a request whose prompt and
    /// `max_new_tokens` pass the context (HTTP 400), so a fleet needs room for all of them.
    pub fn prompt_room(&self, context: usize) -> usize {
        match self.rollout.backend {
            RolloutBackend::Engine => context.saturating_sub(1),
            RolloutBackend::Sglang => context.saturating_sub(1 + self.rollout.max_new_tokens),
        }
    }

    /// The place in the LR schedule of mini-batch `mini_batch` (0-based) of RL step `step`
    /// (1-based): the schedule moves with the run's steps, so a skipped update, or a step
    /// whose dynamic sampling left fewer rows than `mini_batches` updates, neither holds it
    /// back nor shifts the later steps.
    pub fn lr_position(&self, step: u64, mini_batch: usize) -> u64 {
        step.saturating_sub(1) * self.algo.mini_batches as u64 + mini_batch as u64
    }
}

/// A user dataset in verl's RL schema (`[data]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Training files (`.jsonl` or `.parquet`), read in order; empty = the built-in
    /// arithmetic task. Default empty.
    pub train_files: Vec<PathBuf>,
    /// Held-out files evaluated every `eval.every` steps (first `eval.size` rows, all when
    /// 0). Default empty.
    pub val_files: Vec<PathBuf>,
    /// The column holding the prompt (messages or plain text). Default `prompt`.
    pub prompt_key: String,
    /// Longest prompt in tokens; longer rows are dropped and counted, never truncated, and
    /// so are rows that leave the model's context no position to generate in; 0 = no limit
    /// but the context. Default 512.
    pub max_prompt_length: usize,
    /// Visit the rows of each epoch in a permutation seeded by `seed` and the epoch.
    /// Default true.
    pub shuffle: bool,
    /// Passes over the training rows; the run ends early when they are done; 0 = as many
    /// as `steps` needs. Default 0.
    pub total_epochs: u64,
    /// Render prompts with the tokenizer's chat template (with the generation prompt).
    /// Default false.
    pub apply_chat_template: bool,
    /// System message put before each prompt (a `system` turn under the chat template, a
    /// line of its own without). Default empty.
    pub system_prompt: String,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            train_files: Vec::new(),
            val_files: Vec::new(),
            prompt_key: "prompt".into(),
            max_prompt_length: 512,
            shuffle: true,
            total_epochs: 0,
            apply_chat_template: false,
            system_prompt: String::new(),
        }
    }
}

impl TrainConfig {
    /// Whether the run trains on a user dataset rather than the built-in task.
    pub fn uses_dataset(&self) -> bool {
        !self.data.train_files.is_empty()
    }

    /// The steps the run will take: `steps`, or fewer when `data.total_epochs` runs out first.
    pub fn total_steps(&self, train_rows: Option<usize>) -> u64 {
        match (train_rows, self.data.total_epochs) {
            (Some(rows), epochs) if epochs > 0 => {
                let per_step = self.rollout.prompts_per_step as u64;
                let available = (rows as u64).saturating_mul(epochs) / per_step.max(1);
                self.steps.min(available)
            }
            _ => self.steps,
        }
    }
}
