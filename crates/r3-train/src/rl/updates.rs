//! The updates of one RL step on its sampled batch, under the replay mode: R3 replays
//! the rollout routes in the old-log-prob pass and every update; R2 records the old
//! pass's routes and replays them in every update; disabled routes natively. With one
//! mini-batch the old policy *is* the update forward (ratio 1, as in the paper's single
//! mini-step), so no separate old pass runs: the update forward's detached log-probs
//! serve as old log-probs and for the diagnostics. With more, the old log-probs come from
//! a separate pass and the kept rows are shuffled into mini-batches.

use std::time::Instant;

use candle_core::Tensor;
use r3_model::{ReplayProof, ReplayRoutes, Routing, SharedLen};
use r3_routing::RouteTable;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::algo::logprob::scalar_f32;
use crate::algo::optim::AdamW;
use crate::config::train::RouterReplay;
use crate::error::{Result, TrainError};
use crate::policy::trainable::{score_with, ResponseBatch, ScoreOptions, TrainablePolicy};
use crate::rl::diagnostics::{
    proof_divergence, recorded_divergence, verify_proof, RouteDivergence,
};
use crate::rl::micro_batches::{merge_proofs, pack_rows, pick_rows, place_rows, place_tables};
use crate::rl::minibatch::{update_minibatch, MiniBatch, MiniBatchResult, UpdateSettings};
use crate::rl::sampling::mix_seed;
use crate::rl::step::StepContext;

/// What the old-policy view of the batch gave.
pub(crate) struct OldView {
    pub(crate) logp: Tensor,
    pub(crate) recorded: Option<Vec<RouteTable>>,
    pub(crate) entropy: f32,
    pub(crate) verified_frac: Option<f64>,
    pub(crate) divergence: Option<RouteDivergence>,
    /// Per batch row, what of it another row stood for in the old-log-prob pass
    /// (`algo.share_prefixes`).
    pub(crate) shared_lens: Vec<SharedLen>,
}

/// What the updates of a step did.
pub(crate) struct Updates {
    pub(crate) view: OldView,
    pub(crate) results: Vec<MiniBatchResult>,
    pub(crate) old_logp_s: f64,
    pub(crate) update_s: f64,
    /// Memory high-water mark of the separate old-log-prob pass, MiB (none without one).
    pub(crate) old_logp_peak_mib: Option<f64>,
}

/// The updates of a step on its batch: one over the whole batch, or one per mini-batch
/// (`algo.mini_batches`).
pub(crate) fn run_updates(
    policy: &TrainablePolicy,
    optimizer: &mut AdamW,
    ctx: StepContext<'_>,
) -> Result<Updates> {
    if ctx.cfg.algo.mini_batches > 1 {
        minibatch_updates(policy, optimizer, ctx)
    } else {
        single_update(policy, optimizer, ctx)
    }
}

/// One update over the whole batch: its forward is the old policy (R3 replays the
/// rollout routes, R2 and disabled record native routes for the divergence), and rows
/// dropped by dynamic sampling get loss weight 0.
fn single_update(
    policy: &TrainablePolicy,
    optimizer: &mut AdamW,
    ctx: StepContext<'_>,
) -> Result<Updates> {
    let StepContext {
        step,
        cfg,
        data,
        settings,
        schedule,
        trace,
    } = ctx;
    let started = Instant::now();
    let routing = match (cfg.algo.router_replay, &data.routes) {
        (RouterReplay::R3, Some(routes)) => Routing::Replay(routes),
        _ => Routing::Record,
    };
    let mut row_weight = vec![0f32; data.trajs.len()];
    for &r in &data.kept_rows {
        row_weight[r] = 1.0;
    }
    let s = UpdateSettings {
        lr: schedule.lr_at(cfg.lr_position(step, 0)),
        ..settings
    };
    let mb = MiniBatch {
        batch: &data.batch,
        old_logp: None,
        rollout_logp: data.rollout_logp.clone(),
        advantages: data.advantages.clone(),
        row_weight: Some(row_weight),
        routing,
    };
    let r = update_minibatch(policy, optimizer, &mb, &s)?;
    if let Some(trace) = trace {
        trace
            .updates
            .push(((0..data.trajs.len()).collect(), r.replay.clone()));
        trace.update_shared_lens = r.shared_lens.clone();
    }
    let update_s = started.elapsed().as_secs_f64();
    let divergence = match (&r.replay, &r.routes, &data.routes) {
        (Some(proof), _, _) => Some(proof_divergence(proof)),
        (None, Some(recorded), Some(rollout)) => {
            Some(recorded_divergence(rollout.tables(), recorded)?)
        }
        _ => None,
    };
    let view = OldView {
        logp: r.logp.clone(),
        recorded: None,
        entropy: r.entropy,
        verified_frac: r.verified_frac,
        divergence,
        shared_lens: Vec::new(),
    };
    Ok(Updates {
        view,
        results: vec![r],
        old_logp_s: 0.0,
        update_s,
        old_logp_peak_mib: None,
    })
}

/// The old-log-prob pass, then one update per mini-batch of the shuffled kept rows,
/// each replaying the mode's routes (R3: rollout, R2: the old pass's) for its rows.
fn minibatch_updates(
    policy: &TrainablePolicy,
    optimizer: &mut AdamW,
    ctx: StepContext<'_>,
) -> Result<Updates> {
    let StepContext {
        step,
        cfg,
        data,
        settings,
        schedule,
        mut trace,
    } = ctx;
    let mode = cfg.algo.router_replay;
    let t_old = Instant::now();
    let (view, proof) = old_pass(
        policy,
        &data.batch,
        data.routes.as_ref(),
        mode,
        settings.max_tokens_per_micro_batch,
        ScoreOptions {
            share_prefixes: settings.share_prefixes,
            head_chunk_tokens: settings.head_chunk_tokens,
            temperature: settings.temperature,
            ..ScoreOptions::default()
        },
    )?;
    if let Some(trace) = trace.as_deref_mut() {
        trace.old_proof = proof;
        trace.old_shared_lens = view.shared_lens.clone();
        trace.old_recorded = view.recorded.clone();
    }
    let replayed = match mode {
        RouterReplay::R3 => data.routes.clone(),
        RouterReplay::R2 => {
            let layout = &policy.config().layout;
            let recorded = view.recorded.clone();
            recorded.map(|t| ReplayRoutes::new(t, layout)).transpose()?
        }
        RouterReplay::Disabled => None,
    };
    let old_logp_s = t_old.elapsed().as_secs_f64();
    let old_logp_peak_mib = crate::rl::memory::lap_peak();

    let t_update = Instant::now();
    let mut rows = data.kept_rows.clone();
    rows.shuffle(&mut ChaCha8Rng::seed_from_u64(mix_seed(&[
        cfg.seed, step, 0x5155,
    ])));
    let chunk = rows.len().div_ceil(cfg.algo.mini_batches).max(1);
    let mut results = Vec::new();
    for (k, part) in rows.chunks(chunk).enumerate() {
        let mb_batch = data.batch.subset(part)?;
        let width = mb_batch.width();
        let pick = |t: &Tensor| pick_rows(t, part, width);
        let part_routes = replayed.as_ref().map(|r| r.select(part)).transpose()?;
        let s = UpdateSettings {
            lr: schedule.lr_at(cfg.lr_position(step, k)),
            ..settings
        };
        let mb = MiniBatch {
            batch: &mb_batch,
            old_logp: Some(pick(&view.logp)?),
            rollout_logp: pick(&data.rollout_logp)?,
            advantages: part.iter().map(|&r| data.advantages[r]).collect(),
            row_weight: None,
            routing: part_routes
                .as_ref()
                .map_or(Routing::Native, Routing::Replay),
        };
        let r = update_minibatch(policy, optimizer, &mb, &s)?;
        if let Some(trace) = trace.as_deref_mut() {
            trace.updates.push((part.to_vec(), r.replay.clone()));
            let lens = &mut trace.update_shared_lens;
            lens.resize(data.trajs.len(), SharedLen::default());
            for (&row, &len) in part.iter().zip(&r.shared_lens) {
                lens[row] = len;
            }
        }
        results.push(r);
    }
    Ok(Updates {
        view,
        results,
        old_logp_s,
        update_s: t_update.elapsed().as_secs_f64(),
        old_logp_peak_mib,
    })
}

/// The old-policy pass (no autograd graph) over the whole batch with the mode's
/// routing: R3 replays the rollout routes, R2 and disabled record native routes. It runs
/// in micro-batches of `max_tokens` tokens (0 = one forward): its logits, `[B, T, V]`, are
/// what would otherwise hold the whole batch in memory.
fn old_pass(
    policy: &TrainablePolicy,
    batch: &ResponseBatch,
    routes: Option<&ReplayRoutes>,
    mode: RouterReplay,
    max_tokens: usize,
    options: ScoreOptions,
) -> Result<(OldView, Option<ReplayProof>)> {
    let model = policy.frozen_model()?;
    if let (RouterReplay::R3, None) = (mode, routes) {
        return Err(TrainError::MissingRolloutRoutes { trajectory: 0 });
    }
    let device = policy.device();
    let n = batch.len();
    let parts = pack_rows(batch.sequences(), max_tokens, options.share_prefixes);
    let (mut logps, mut recorded, mut proofs) = (Vec::new(), Vec::new(), Vec::new());
    let mut entropy_sum = 0f64;
    let mut shared_lens = vec![SharedLen::default(); n];
    for part in &parts {
        let sub = match parts.len() {
            1 => None,
            _ => Some(batch.subset(part)?),
        };
        let sub_batch = sub.as_ref().unwrap_or(batch);
        let part_routes = match (mode, &sub, routes) {
            (RouterReplay::R3, Some(_), Some(r)) => Some(r.select(part)?),
            _ => None,
        };
        let routing = match (mode, part_routes.as_ref().or(routes)) {
            (RouterReplay::R3, Some(r)) => Routing::Replay(r),
            _ => Routing::Record,
        };
        let scored = score_with(&model, sub_batch, routing, options)?.0;
        for (&row, &len) in part.iter().zip(&scored.shared_lens) {
            shared_lens[row] = len;
        }
        let mask = sub_batch.response_mask(None, &device)?;
        let entropy = scored.entropy(false)?;
        entropy_sum += f64::from(scalar_f32(&entropy.mul(&mask)?.sum_all()?)?);
        logps.push((part.clone(), scored.logp.detach()));
        if let Some(r) = scored.routes {
            recorded.push((part.clone(), r));
        }
        if let Some(p) = scored.replay {
            proofs.push((part.clone(), p));
        }
    }
    let logp = match <[_; 1]>::try_from(logps) {
        Ok([(_, whole)]) => whole,
        Err(parts) => place_rows(&parts, n, batch.width(), &device)?,
    };
    let recorded = match recorded.is_empty() {
        true => None,
        false => Some(place_tables(recorded, n)?),
    };
    let replay = match proofs.is_empty() {
        true => None,
        false => Some(merge_proofs(proofs, n)?),
    };
    // The masked mean over the batch, divided in f32 as `masked_mean` does.
    let tokens = scalar_f32(
        &batch
            .response_mask(None, &device)?
            .sum_all()?
            .maximum(1e-8)?,
    )?;
    let entropy = entropy_sum as f32 / tokens;
    let rollout = routes.map(ReplayRoutes::tables);
    let (verified_frac, divergence) = match (&replay, &recorded, rollout) {
        (Some(proof), _, Some(t)) => (
            Some(verify_proof(proof, t, mode, "old-logp")?),
            Some(proof_divergence(proof)),
        ),
        (None, Some(rec), Some(t)) => (None, Some(recorded_divergence(t, rec)?)),
        _ => (None, None),
    };
    let view = OldView {
        logp,
        recorded,
        entropy,
        verified_frac,
        divergence,
        shared_lens,
    };
    Ok((view, replay))
}
