//! What one RL step works on: its sampled and scored batch (trajectories, the rollout
//! log-probs and routes, GRPO advantages with dynamic sampling), the context every update
//! of the step reads, and the trace of the routes each pass used. The step itself,
//! rollout → reward → advantages → updates → weight sync → metrics, is
//! [`Trainer::rl_step`](crate::rl::trainer::Trainer::rl_step).

use candle_core::{Device, Tensor};
use r3_model::{ReplayProof, ReplayRoutes, SharedLen};
use r3_routing::{LayerLayout, RouteTable};

use crate::algo::advantage::{filter_uniform_groups, grpo_advantages, GrpoOptions};
use crate::algo::schedule::LrSchedule;
use crate::config::train::{RouterReplay, TrainConfig};
use crate::error::{Result, TrainError};
use crate::policy::trainable::ResponseBatch;
use crate::rl::minibatch::UpdateSettings;
use crate::rl::refill::SamplingRounds;
use crate::rl::sampling::{response_batch, rollout_routes, SamplingSpec, Trajectory};

/// Which routes each pass of a step used, for checking the replay modes (opt in with
/// [`Trainer::rl_step_with`](crate::rl::trainer::Trainer::rl_step_with)).
#[derive(Debug, Clone, Default)]
pub struct StepTrace {
    /// Prompt+response tokens of the step's trajectories.
    pub sequences: Vec<Vec<u32>>,
    /// Prompt tokens of each of those sequences (the rest is the response).
    pub prompt_lens: Vec<usize>,
    /// Of those, the tokens the rollout engine read from its prefix cache (not computed).
    pub cached_tokens: Vec<usize>,
    /// Rollout route tables of the step's trajectories (`len − 1` rows each).
    pub rollout_tables: Option<Vec<RouteTable>>,
    /// Reward of each of the step's trajectories.
    pub rewards: Vec<f32>,
    /// GRPO advantage of each of them (before dynamic sampling's filter).
    pub advantages: Vec<f32>,
    /// Replay proof of the separate old-log-prob pass (R3, multi mini-step).
    pub old_proof: Option<ReplayProof>,
    /// Routes recorded by the old-log-prob pass (R2 and disabled, multi mini-step).
    pub old_recorded: Option<Vec<RouteTable>>,
    /// Per update mini-batch: its trajectory rows and the replay proof of its forward.
    pub updates: Vec<(Vec<usize>, Option<ReplayProof>)>,
    /// Per trajectory, what of it the update forward computed for another sequence and not
    /// again for it (`algo.share_prefixes`): its leading positions, and those whose head row
    /// another position computed; empty: none.
    pub update_shared_lens: Vec<SharedLen>,
    /// The same for the separate old-log-prob pass.
    pub old_shared_lens: Vec<SharedLen>,
}

/// The sampled and scored batch of a step: what the updates work on.
pub(crate) struct StepBatch {
    pub(crate) trajs: Vec<Trajectory>,
    pub(crate) batch: ResponseBatch,
    /// Rollout log-probs per response token.
    pub(crate) rollout_lp: Vec<Vec<f32>>,
    /// The same aligned to the batch, `[n, W]`.
    pub(crate) rollout_logp: Tensor,
    /// Rollout routes of every trajectory, if the engine returned them.
    pub(crate) routes: Option<ReplayRoutes>,
    pub(crate) advantages: Vec<f32>,
    /// Rows that enter the loss (all, or those of non-uniform groups).
    pub(crate) kept_rows: Vec<usize>,
    pub(crate) groups_kept: usize,
    /// Groups dropped for equal rewards, over every rollout round of the step.
    pub(crate) groups_dropped: usize,
    /// The refill rounds' counts (`algo.sampling_rounds` > 1).
    pub(crate) sampling: Option<SamplingRounds>,
    /// Groups dropped for requests that failed for their own fault, and those requests,
    /// over every rollout round (fleet backend; `None` for an in-process engine).
    pub(crate) failed: Option<(usize, usize)>,
    pub(crate) rollout_s: f64,
    /// Seconds the fleet generated this batch in the previous step's shadow (`rollout.async`).
    pub(crate) rollout_ahead_s: Option<f64>,
    /// Fraction of trajectories from weights older than the trainer's (fleet backend).
    pub(crate) stale_frac: Option<f64>,
}

impl StepBatch {
    /// The batch of the scored trajectories `trajs` (group-major, `cfg.rollout.group_size`
    /// per prompt): their rollout log-probs aligned, their routes checked against `layout`
    /// (required under R3), GRPO advantages and the rows dynamic sampling keeps; the
    /// tensors on `device`, the policy's.
    pub(crate) fn new(
        trajs: Vec<Trajectory>,
        cfg: &TrainConfig,
        layout: &LayerLayout,
        device: &Device,
        rollout_s: f64,
        rollout_ahead_s: Option<f64>,
        stale_frac: Option<f64>,
    ) -> Result<Self> {
        let batch = response_batch(&trajs)?;
        let rollout_lp: Vec<Vec<f32>> = trajs
            .iter()
            .map(|t| t.sample.rollout_logp.clone())
            .collect();
        let rollout_logp = batch.align(&rollout_lp, device)?;
        let routes = match trajs.iter().all(|t| t.sample.routes.is_some()) {
            true => Some(rollout_routes(trajs.iter().map(|t| &t.sample), layout)?),
            false if cfg.algo.router_replay == RouterReplay::R3 => {
                let missing = trajs
                    .iter()
                    .position(|t| t.sample.routes.is_none())
                    .unwrap_or(0);
                return Err(TrainError::MissingRolloutRoutes {
                    trajectory: missing,
                });
            }
            false => None,
        };

        let rewards: Vec<f32> = trajs.iter().map(|t| t.reward).collect();
        let opts = GrpoOptions {
            norm_by_std: cfg.algo.adv_norm_by_std,
            eps: cfg.algo.adv_eps as f32,
        };
        let group = cfg.rollout.group_size;
        let (advantages, _) = grpo_advantages(&rewards, group, opts)?;
        let filter = filter_uniform_groups(&rewards, group)?;
        let (kept_rows, groups_kept, groups_dropped) = if cfg.algo.dynamic_sampling {
            let kept = filter.kept_groups.len();
            (filter.kept_rows(), kept, filter.dropped_groups)
        } else {
            ((0..trajs.len()).collect(), trajs.len() / group, 0)
        };
        Ok(StepBatch {
            trajs,
            batch,
            rollout_lp,
            rollout_logp,
            routes,
            advantages,
            kept_rows,
            groups_kept,
            groups_dropped,
            sampling: None,
            failed: None,
            rollout_s,
            rollout_ahead_s,
            stale_frac,
        })
    }
}

/// What every update of a step reads: the step, the config, its batch, the loss and
/// optimiser settings, and the trace to fill (when one is asked for).
pub(crate) struct StepContext<'a> {
    /// The step (1-based).
    pub(crate) step: u64,
    /// The run's config.
    pub(crate) cfg: &'a TrainConfig,
    /// The step's batch.
    pub(crate) data: &'a StepBatch,
    /// Loss and optimiser settings (the LR is set per update).
    pub(crate) settings: UpdateSettings,
    /// The run's LR schedule (its length the steps the run takes).
    pub(crate) schedule: LrSchedule,
    /// Routes each pass used, when the caller asked for them.
    pub(crate) trace: Option<&'a mut StepTrace>,
}

/// Loss and optimiser settings of the step's updates (the LR is set per update); a bad
/// `train.grad_accum_dtype` is a config error.
pub fn update_settings(cfg: &TrainConfig) -> Result<UpdateSettings> {
    Ok(UpdateSettings {
        loss: cfg.algo.loss,
        clip: cfg.clip_range(),
        agg: cfg.algo.loss_agg,
        is: cfg.is_config(),
        entropy_coef: cfg.algo.entropy_coef,
        lr: 0.0,
        grad_clip: cfg.optim.grad_clip,
        mode: cfg.algo.router_replay,
        grad_hook: None,
        max_tokens_per_micro_batch: cfg.algo.max_tokens_per_micro_batch,
        gradient_checkpointing: cfg.algo.gradient_checkpointing,
        selective_recompute: cfg.algo.selective_recompute,
        share_prefixes: cfg.algo.share_prefixes,
        head_chunk_tokens: cfg.algo.head_chunk_tokens,
        narrow_gradients: cfg.train.narrow_gradients,
        bf16_gradient_sums: cfg.train.bf16_gradient_sums()?,
        // The rollout engines sample at this temperature and report log-probs under it.
        temperature: cfg.rollout.temperature as f32,
    })
}

/// How step `step`'s batch is sampled.
pub(crate) fn sampling_spec(cfg: &TrainConfig) -> SamplingSpec {
    SamplingSpec {
        group_size: cfg.rollout.group_size,
        max_new_tokens: cfg.rollout.max_new_tokens,
        temperature: cfg.rollout.temperature as f32,
    }
}
