//! The training side of the analysis: f32 forward passes of the training engine (r3-model +
//! r3-train's log-probs) over the rollouts, natively (recording routes) or replaying the
//! rollout routes (R3), in a chosen batch order and micro-batch size.

use candle_core::{Device, Tensor};
use indicatif::ProgressBar;
use r3_model::{Batch, Model, ReplayRoutes, Routing};
use r3_routing::RouteTable;
use r3_train::token_log_probs;

use super::rollout::{bar_style, Sample};
use super::AnalysisError;

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
}

impl Batching {
    /// Samples in their natural order, `micro_batch` per call.
    pub fn in_order(n: usize, micro_batch: usize) -> Self {
        Self {
            order: (0..n).collect(),
            micro_batch,
        }
    }
}

/// Replay evidence summed over a pass (from the model's verified `ReplayProof`s).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReplayTotals {
    /// (token, layer) routers whose experts came from the rollout routes, verified used.
    pub replayed_cells: usize,
    /// Routers left to native routing (none when every row was given).
    pub native_cells: usize,
    /// Replayed routers whose rollout experts differ from this forward's own top-k.
    pub differs_from_native: usize,
}

/// What one training pass produced, indexed like the samples.
#[derive(Debug, Clone)]
pub struct PassResult {
    /// Training log-prob of every output token of every sample.
    pub logp: Vec<Vec<f32>>,
    /// Native pass: the routes the training engine chose, rows `[0, prompt + output − 1)`.
    pub routes: Option<Vec<RouteTable>>,
    /// Replay pass: what was replayed.
    pub replay: Option<ReplayTotals>,
}

/// Runs the training engine over `samples` with `routing`, grouped by `batching`.
pub fn training_pass(
    model: &Model,
    samples: &[Sample],
    routing: PassRouting,
    batching: &Batching,
    progress: &ProgressBar,
    label: &str,
) -> Result<PassResult, AnalysisError> {
    if batching.micro_batch == 0 {
        return Err(AnalysisError::Invalid(
            "--micro-batch must be at least 1".into(),
        ));
    }
    let mut sorted = batching.order.clone();
    sorted.sort_unstable();
    if sorted != (0..samples.len()).collect::<Vec<_>>() {
        return Err(AnalysisError::Invalid(format!(
            "pass {label:?}: the batch order is not a permutation of the {} samples",
            samples.len()
        )));
    }
    let is_moe = model.config().moe.is_some();
    let mut logp: Vec<Vec<f32>> = vec![Vec::new(); samples.len()];
    let mut routes: Vec<Option<RouteTable>> = vec![None; samples.len()];
    let mut totals = ReplayTotals::default();
    progress.set_style(bar_style());
    progress.set_length(samples.len() as u64);
    progress.set_position(0);
    progress.set_message(label.to_string());
    for chunk in batching.order.chunks(batching.micro_batch) {
        let inputs: Vec<Vec<u32>> = chunk.iter().map(|&i| samples[i].forward_input()).collect();
        let batch = Batch::new(&inputs, 0, &Device::Cpu)
            .map_err(AnalysisError::model(format!("{label}: building a batch")))?;
        let tables: ReplayRoutes;
        let mode = match (routing, is_moe) {
            (PassRouting::ReplayRollout, true) => {
                let rollout = chunk
                    .iter()
                    .map(|&i| {
                        samples[i].routes.clone().ok_or_else(|| {
                            AnalysisError::Invalid(format!("sample {i} has no rollout routes"))
                        })
                    })
                    .collect::<Result<_, _>>()?;
                tables = ReplayRoutes::new(rollout, &model.config().layout)
                    .map_err(AnalysisError::model(format!("{label}: rollout routes")))?;
                Routing::Replay(&tables)
            }
            (PassRouting::NativeRecorded, true) => Routing::Record,
            (_, false) => Routing::Native,
        };
        let out = model
            .forward(&batch, mode)
            .map_err(AnalysisError::model(format!("{label}: training forward")))?;
        let targets = padded_targets(chunk, samples, batch.seq_len())?;
        let token_logp = token_log_probs(&out.logits, &targets)?.to_vec2::<f32>()?;
        for (row, &i) in chunk.iter().enumerate() {
            let s = &samples[i];
            let from = s.prompt.len() - 1;
            let values = token_logp
                .get(row)
                .and_then(|r| r.get(from..from + s.output.len()))
                .ok_or_else(|| {
                    AnalysisError::Invalid(format!("{label}: logits too short for sample {i}"))
                })?;
            logp[i] = values.to_vec();
        }
        if let Some(recorded) = out.routes {
            for (&i, table) in chunk.iter().zip(recorded) {
                routes[i] = Some(table);
            }
        }
        if let Some(proof) = out.replay {
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

/// `[B, T]` u32 targets of a micro-batch, padded with 0 (those positions are never read).
fn padded_targets(chunk: &[usize], samples: &[Sample], t: usize) -> Result<Tensor, AnalysisError> {
    let mut flat = Vec::with_capacity(chunk.len() * t);
    for &i in chunk {
        let targets = samples[i].targets();
        flat.extend_from_slice(&targets);
        flat.extend(std::iter::repeat_n(0u32, t.saturating_sub(targets.len())));
    }
    Ok(Tensor::from_vec(flat, (chunk.len(), t), &Device::Cpu)?)
}
