//! The training side of the analysis: f32 forward passes of the training engine (r3-model +
//! r3-train's policy scoring) over the rollouts, natively (recording routes) or replaying the
//! rollout routes (R3), in a chosen batch order and micro-batch size.

use indicatif::{ProgressBar, ProgressStyle};
use r3_model::{Model, ReplayRoutes, Routing};
use r3_routing::RouteTable;
use r3_train::policy::{score, ResponseBatch};
use r3_train::rl::diagnostics::verify_proof;
use r3_train::RouterReplay;

use crate::AnalysisError;
use r3_train::rl::sampling::RolloutSample;

/// How the MoE layers route in a training pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassRouting {
    /// Native top-k, with the chosen experts recorded (for divergence statistics).
    NativeRecorded,
    /// R3: replay each rollout's routes.
    ReplayRollout,
}

/// How the sequences are grouped into forward calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batching {
    /// Sample indices in the order they are fed.
    pub order: Vec<usize>,
    /// Sequences per forward call (right-padded to the longest in the call).
    pub micro_batch: usize,
    /// Token budget of one forward call (rows × the longest row, prompt + output): a group
    /// of `micro_batch` sequences past it is cut, in order, into calls within it (a single
    /// longer sequence is a call of its own); 0 = no budget. Bounds the memory of the
    /// logits, `[rows, T, vocab]`.
    pub max_tokens: usize,
}

impl Batching {
    /// Samples in their natural order, `micro_batch` per call, at most `max_tokens` tokens.
    pub fn in_order(n: usize, micro_batch: usize, max_tokens: usize) -> Self {
        Self {
            order: (0..n).collect(),
            micro_batch,
            max_tokens,
        }
    }

    /// The forward calls: groups of `micro_batch` in `order`, each cut in order where the
    /// next sequence would take it past `max_tokens` (`lens[i]`: tokens of sample `i`).
    pub fn calls(&self, lens: &[usize]) -> Vec<Vec<usize>> {
        let mut calls = Vec::new();
        for group in self.order.chunks(self.micro_batch.max(1)) {
            let mut current: Vec<usize> = Vec::new();
            let mut widest = 0;
            for &i in group {
                let width = widest.max(lens[i]);
                let over = (current.len() + 1).saturating_mul(width) > self.max_tokens;
                if self.max_tokens > 0 && !current.is_empty() && over {
                    calls.push(std::mem::take(&mut current));
                    widest = 0;
                }
                widest = widest.max(lens[i]);
                current.push(i);
            }
            calls.push(current);
        }
        calls
    }
}

/// Replay evidence summed over a pass (from the model's verified `ReplayProof`s).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReplayTotals {
    /// (token, layer) routers whose experts came from the rollout routes, verified used.
    pub replayed_cells: usize,
    /// Routers left to native routing: none, where the scoring feeds the positions the
    /// rollout routed (every token but the last, which predicts nothing); a forward fed the
    /// whole sequences would route each final position natively.
    pub native_cells: usize,
    /// Replayed routers whose rollout experts differ from this forward's own top-k.
    pub differs_from_native: usize,
}

/// What one training pass produced, indexed like the samples.
#[derive(Debug, Clone)]
pub struct PassResult {
    /// Training log-prob of every output token of every sample.
    pub logp: Vec<Vec<f32>>,
    /// Native pass: the routes the training engine chose for the positions the rollout
    /// routed, rows `[0, prompt + output − 1)`.
    pub routes: Option<Vec<RouteTable>>,
    /// Replay pass: what was replayed.
    pub replay: Option<ReplayTotals>,
}

/// Scores `samples` with r3-train's policy scoring (`policy::score`: prompt + output fed but
/// the last token, log-probs of the output tokens) with `routing`, grouped into forward calls by `batching`.
pub fn training_pass(
    model: &Model,
    samples: &[RolloutSample],
    routing: PassRouting,
    batching: &Batching,
    progress: &ProgressBar,
    label: &str,
) -> Result<PassResult, AnalysisError> {
    check_batching(batching, samples.len(), label)?;
    let is_moe = model.config().moe.is_some();
    let batch = ResponseBatch::new(
        samples.iter().map(RolloutSample::tokens).collect(),
        samples.iter().map(|s| s.prompt_ids.len()).collect(),
    )?;
    let mut logp: Vec<Vec<f32>> = vec![Vec::new(); samples.len()];
    let mut routes: Vec<Option<RouteTable>> = vec![None; samples.len()];
    let mut totals = ReplayTotals::default();
    progress.set_style(bar_style());
    progress.set_length(samples.len() as u64);
    progress.set_position(0);
    progress.set_message(label.to_string());
    let lens: Vec<usize> = batch.sequences().iter().map(Vec::len).collect();
    for chunk in &batching.calls(&lens) {
        let chunk = chunk.as_slice();
        let micro = batch.subset(chunk)?;
        let tables = match (routing, is_moe) {
            (PassRouting::ReplayRollout, true) => Some(
                ReplayRoutes::new(rollout_tables(samples, chunk)?, &model.config().layout)
                    .map_err(AnalysisError::model(format!("{label}: rollout routes")))?,
            ),
            _ => None,
        };
        let mode = match (&tables, routing, is_moe) {
            (Some(t), _, _) => Routing::Replay(t),
            (None, PassRouting::NativeRecorded, true) => Routing::Record,
            _ => Routing::Native,
        };
        let scored = score(model, &micro, mode)?;
        for (&i, values) in chunk.iter().zip(micro.gather_responses(&scored.logp)?) {
            logp[i] = values;
        }
        if let Some(recorded) = scored.routes {
            for (&i, table) in chunk.iter().zip(recorded) {
                routes[i] = Some(rollout_rows(&samples[i], &table, label)?);
            }
        }
        if let (Some(proof), Some(tables)) = (scored.replay, &tables) {
            verify_proof(&proof, tables.tables(), RouterReplay::R3, "analysis")?;
            totals.replayed_cells += proof.total_replayed();
            totals.native_cells += proof.native_cells.iter().sum::<usize>();
            totals.differs_from_native += proof.differs_from_native.iter().sum::<usize>();
        }
        progress.inc(chunk.len() as u64);
    }
    progress.finish_and_clear();
    let routes = match (routing, is_moe) {
        (PassRouting::NativeRecorded, true) => Some(
            routes
                .into_iter()
                .enumerate()
                .map(|(i, r)| {
                    r.ok_or_else(|| {
                        AnalysisError::Invalid(format!(
                            "{label}: no recorded routes for sample {i}"
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        _ => None,
    };
    let replay = (routing == PassRouting::ReplayRollout && is_moe).then_some(totals);
    Ok(PassResult {
        logp,
        routes,
        replay,
    })
}

/// Rejects an empty micro-batch and an order that is not a permutation of the samples.
fn check_batching(batching: &Batching, n: usize, label: &str) -> Result<(), AnalysisError> {
    if batching.micro_batch == 0 {
        return Err(AnalysisError::Invalid(
            "--micro-batch must be at least 1".into(),
        ));
    }
    let mut sorted = batching.order.clone();
    sorted.sort_unstable();
    if sorted != (0..n).collect::<Vec<_>>() {
        return Err(AnalysisError::Invalid(format!(
            "pass {label:?}: the batch order is not a permutation of the {n} samples"
        )));
    }
    Ok(())
}

/// The rollout route tables of the samples `chunk`, in chunk order.
fn rollout_tables(
    samples: &[RolloutSample],
    chunk: &[usize],
) -> Result<Vec<RouteTable>, AnalysisError> {
    chunk
        .iter()
        .map(|&i| {
            samples[i]
                .routes
                .clone()
                .ok_or_else(|| AnalysisError::Invalid(format!("sample {i} has no rollout routes")))
        })
        .collect()
}

/// A recorded table (`len` rows) cut to the rows the rollout routed (`len − 1`): the final
/// position predicts nothing, so the rollout engine never ran it.
fn rollout_rows(
    sample: &RolloutSample,
    recorded: &RouteTable,
    label: &str,
) -> Result<RouteTable, AnalysisError> {
    let rows = sample.prompt_ids.len() + sample.response_ids.len() - 1;
    recorded
        .slice_rows(0, rows)
        .map_err(AnalysisError::route(format!("{label}: recorded routes")))
}

/// Progress bar style of the training passes.
fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template("{msg:28} [{bar:30}] {pos}/{len} {elapsed}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
}

#[cfg(test)]
mod tests {
    use super::Batching;

    #[test]
    fn calls_keep_the_order_and_cut_groups_past_the_token_budget() {
        let lens = [4, 6, 3, 9, 5, 2];
        // No budget: groups of 4 in order.
        let plain = Batching::in_order(6, 4, 0);
        assert_eq!(plain.calls(&lens), vec![vec![0, 1, 2, 3], vec![4, 5]]);
        // Budget 12: [0, 1] costs 2 × 6; adding 2 would cost 18. [2] then 9 → 18: cut.
        // Row 3 (9) alone; [4, 5] costs 10.
        let budget = Batching::in_order(6, 4, 12);
        assert_eq!(
            budget.calls(&lens),
            vec![vec![0, 1], vec![2], vec![3], vec![4, 5]]
        );
        // A sequence longer than the budget is a call of its own.
        let tiny = Batching::in_order(6, 4, 3);
        assert_eq!(tiny.calls(&lens).len(), 6);
    }
}
