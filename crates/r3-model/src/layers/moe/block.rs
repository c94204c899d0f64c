//! Sparse MoE block: router logits → ids (own top-k, or forced by replay) → gates
//! (`Router::weigh`, kept in the autograd graph) → rows grouped by expert (`Dispatch`) →
//! the gate-weighted sum of the chosen experts' SwiGLUs (`RoutedExperts`), plus the shared
//! expert where the architecture has one. A decode step of a few rows can instead keep its
//! ids on the device (`MoeBlock::forward_routed_on_device`: no host wait inside the layer).

use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use super::dispatch::Dispatch;
use super::expert_gemm::ExpertGemmInputs;
use super::experts::RoutedExperts;
use super::padded_experts::PaddedExpertOps;
use super::route_rows::{read_choice, route_rows};
use crate::cast16::cast16;
use crate::config::{Config, SharedExpert};
use crate::error::{ModelError, Result};
use crate::layers::gather_rows::GatherRows;
use crate::layers::linear::Linear;
use crate::layers::matmul16::narrowed_product;
use crate::layers::mlp::SwiGlu;
use crate::layers::moe::divergence::Divergence;
use crate::precision::{Precision, WeightGradients};
use crate::router::Router;
use crate::routing_mode::{same_experts, LayerPlan};
use crate::spec::SWIGLU_HF;
use crate::weights::Weights;

/// Where a MoE block weighs its chosen experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gates {
    /// By candle's ops on the logits' device: differentiable, and the same ops as every
    /// training forward (a frozen old-policy pass gives the update pass's bits).
    Differentiable,
    /// By [`Router::weigh_row`]'s formula when nothing tracks the logits (the rollout
    /// engine's steps): where the router selects on the device by the selection's own op,
    /// else on the host; where something tracks them, as [`Gates::Differentiable`].
    HostWhenUntracked,
}

/// Rows per parallel task when the host weighs gates or counts a replay's differing rows.
const OVERRIDE_ROWS_PER_TASK: usize = 512;

/// The forced rows of `plan` whose experts (as a set) differ from `native`, the router's
/// own `[rows · k]` choice: a replay's routing divergence in one layer. Each run of forced
/// rows (a sequence's rows but its final position) is first compared whole, one `memcmp`,
/// and only a run that differs row by row: most rows are their table's rows exactly, and a
/// mid layer's 4,096 rows then take a few µs on the calling thread, where comparing row by
/// row took 25–45 µs and waking the thread pool for it 18–42 µs.
fn forced_rows_differing(plan: &LayerPlan, native: &[u32], k: usize) -> usize {
    let k = k.max(1);
    let weight = |r: usize| match plan.copies.as_deref() {
        // A row computed once for several positions differs at each of them.
        Some(copies) => copies.get(r).map_or(1, |&c| c as usize),
        None => 1,
    };
    let rows = plan
        .forced
        .len()
        .min(native.len() / k)
        .min(plan.ids.len() / k);
    let mut differing = 0;
    let mut start = 0;
    while start < rows {
        if !plan.forced[start] {
            start += 1;
            continue;
        }
        let end = plan.forced[start..rows]
            .iter()
            .position(|&f| !f)
            .map_or(rows, |len| start + len);
        let (own, given) = (&native[start * k..end * k], &plan.ids[start * k..end * k]);
        if own != given {
            differing += own
                .chunks(k)
                .zip(given.chunks(k))
                .enumerate()
                .filter(|(_, (own, given))| !same_experts(given, own))
                .map(|(r, _)| weight(start + r))
                .sum::<usize>();
        }
        start = end;
    }
    differing
}

/// The always-on expert.
#[derive(Debug, Clone)]
enum Shared {
    None,
    Plain(SwiGlu),
    Gated { mlp: SwiGlu, gate: Linear },
}

/// One sparse MoE layer.
#[derive(Debug, Clone)]
pub struct MoeBlock {
    router: Router,
    gate_weight: Tensor,
    score_bias: Option<Vec<f32>>,
    /// The same bias in f32 on the weights' device, for the selection there.
    score_bias_on_device: Option<Tensor>,
    experts: RoutedExperts,
    shared: Shared,
    precision: Precision,
    /// The dtype a 16-bit forward hands the router's gradient back in.
    weight_grads: WeightGradients,
}

/// Rows of the batch a MoE layer routes (the real, non-padding tokens).
#[derive(Debug, Clone)]
pub struct RoutedRows {
    /// index of each routed row in the flattened `[B·T]` batch
    pub host: Vec<u32>,
    /// whether every row of the batch is routed (no padding)
    pub all: bool,
}

/// The DeepSeek `e_score_correction_bias` of the MoE block at `prefix`, if the weights hold
/// one: in f32 on the weights' device (the weights' own tensor where it is f32), and its host
/// copy.
fn score_bias_of(weights: &Weights, prefix: &str) -> Result<Option<(Tensor, Vec<f32>)>> {
    let name = format!("{prefix}.gate.e_score_correction_bias");
    Ok(match weights.tensors().get(&name) {
        Some(b) => {
            let on_device = b.to_dtype(candle_core::DType::F32)?;
            let host = on_device.to_vec1::<f32>()?;
            // The selection ranks `sigmoid + bias`: with a NaN there its order is undefined
            // (a host keeps the NaN's sign, a GPU's sum makes it positive), whatever the
            // load allowed.
            if let Some((index, value)) = host.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(ModelError::Input(format!(
                    "tensor `{name}` holds {value} at index {index}: a router cannot select \
                     experts with a non-finite score bias"
                )));
            }
            Some((on_device, host))
        }
        None => None,
    })
}

/// What one MoE layer did.
#[derive(Debug)]
pub struct MoeOutput {
    /// `[B·T, H]` block output (zero on padding rows, apart from the shared expert)
    pub output: Tensor,
    /// `[routed rows · top_k]` ids as dispatched to the experts, in selection order
    pub ids: Vec<u32>,
    /// forced rows whose expert set differs from this layer's own top-k (counted on the
    /// host, or on the device and read at the end of the forward)
    pub differs_from_native: Divergence,
    /// wall time of the replay's own work here: the plan's ids put in place of the
    /// router's own, and the forced rows whose experts differ from them counted
    pub replay_time: Duration,
    /// wall time the host waited for the router's choice: on a GPU the queued work before
    /// it, then the copy of the chosen ids (or of the logits, where the host selects)
    pub device_wait: Duration,
    /// whether the layer waited for the device at all (a replay forcing every row of a
    /// router that selects on the device does not)
    pub waited: bool,
}

impl MoeBlock {
    /// Reads the router's score bias of layer `layer` from `weights` again: selection reads a
    /// host copy made when the block was built, so weights written in place (a rollout
    /// engine's weight update) reach the selection only through this.
    pub fn reload_score_bias(
        &mut self,
        cfg: &Config,
        weights: &Weights,
        layer: usize,
    ) -> Result<()> {
        let p = format!("{}.{}", crate::spec::layer_prefix(layer), cfg.moe_prefix());
        (self.score_bias_on_device, self.score_bias) = score_bias_of(weights, &p)?.unzip();
        Ok(())
    }

    /// Builds the MoE block of layer `layer` from weights with fused experts.
    pub fn new(cfg: &Config, weights: &Weights, layer: usize) -> Result<Self> {
        let moe = cfg.moe.as_ref().ok_or_else(|| {
            ModelError::InvalidConfig(format!("layer {layer} is MoE in a dense config"))
        })?;
        let p = format!("{}.{}", crate::spec::layer_prefix(layer), cfg.moe_prefix());
        let gate_weight = weights.get(&format!("{p}.gate.weight"))?.clone();
        let (score_bias_on_device, score_bias) = score_bias_of(weights, &p)?.unzip();
        let experts = RoutedExperts::new(weights, &p, moe.num_experts)?;
        let shared = match moe.shared {
            SharedExpert::None => Shared::None,
            SharedExpert::Plain { .. } => Shared::Plain(SwiGlu::new(
                weights,
                &format!("{p}.shared_experts"),
                &SWIGLU_HF,
            )?),
            SharedExpert::Gated { .. } => Shared::Gated {
                mlp: SwiGlu::new(weights, &format!("{p}.shared_expert"), &SWIGLU_HF)?,
                gate: Linear::new(weights, &format!("{p}.shared_expert_gate"), false)?,
            },
        };
        Ok(MoeBlock {
            router: Router::new(moe),
            gate_weight,
            score_bias,
            score_bias_on_device,
            experts,
            shared,
            precision: Precision::F32,
            weight_grads: WeightGradients::InWeightDtype,
        })
    }

    /// Sets the precision of the router (see [`Precision::router`]), the experts, the shared
    /// expert and the block output.
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
        self.experts.set_precision(precision);
        match &mut self.shared {
            Shared::None => {}
            Shared::Plain(mlp) => mlp.set_precision(precision),
            Shared::Gated { mlp, gate } => {
                mlp.set_precision(precision);
                gate.set_precision(precision);
            }
        }
    }

    /// Sets how the routed experts' GEMMs take their f32 operands on a GPU in bf16.
    pub fn set_expert_gemm_inputs(&mut self, inputs: ExpertGemmInputs) {
        self.experts.set_gemm_inputs(inputs);
    }

    /// Sets how a GPU runs the routed experts' padded layout in a differentiated forward
    /// ([`PaddedExpertOps`]).
    pub fn set_padded_expert_ops(&mut self, ops: PaddedExpertOps) {
        self.experts.set_padded_ops(ops);
    }

    /// Sets the dtype a 16-bit forward hands the block's weights' gradients back in
    /// (the router's, the routed experts' stacks', the shared expert's).
    pub fn set_weight_gradients(&mut self, grads: WeightGradients) {
        self.weight_grads = grads;
        self.experts.set_weight_gradients(grads);
        match &mut self.shared {
            Shared::None => {}
            Shared::Plain(mlp) => mlp.set_weight_gradients(grads),
            Shared::Gated { mlp, gate } => {
                mlp.set_weight_gradients(grads);
                gate.set_weight_gradients(grads);
            }
        }
    }

    /// The router of this block.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Router logits `[rows, E]` for `x` `[rows, H]`.
    pub fn router_logits(&self, x: &Tensor) -> Result<Tensor> {
        let p = self.precision.router();
        crate::layers::linear::matmul_wt_at(p, x, &self.gate_weight, None, self.weight_grads)
    }

    /// The gates `[n, k]` of the rows' chosen `ids` (`n · k`) from their router logits
    /// `host` (`n · E`, on the host), by [`Router::weigh_row`], rows side by side.
    fn host_gates(
        &self,
        host: &[f32],
        ids: &[u32],
        device: &candle_core::Device,
    ) -> Result<Tensor> {
        let (e, k) = (self.router.num_experts.max(1), self.router.top_k.max(1));
        let n = ids.len() / k;
        let mut gates = vec![0f32; n * k];
        gates
            .par_chunks_mut(k)
            .zip(ids.par_chunks(k))
            .zip(host.par_chunks(e))
            .with_min_len(OVERRIDE_ROWS_PER_TASK)
            .try_for_each(|((out, ids), logits)| self.router.weigh_row(logits, ids, out))?;
        Ok(Tensor::from_vec(gates, (n, k), device)?)
    }

    /// Runs the block on `x` `[B·T, H]` with its own routing of `rows` (the Native mode;
    /// `r3 bench train --parts` times a block alone with it).
    pub fn forward_native(&self, x: &Tensor, rows: &RoutedRows) -> Result<MoeOutput> {
        self.forward(x, rows, None, Gates::Differentiable)
    }

    /// Runs the block on `x` `[B·T, H]`, routing `rows`; `plan` forces ids on its rows;
    /// `gates` says where the chosen experts are weighed.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        rows: &RoutedRows,
        plan: Option<&LayerPlan>,
        gates: Gates,
    ) -> Result<MoeOutput> {
        let k = self.router.top_k;
        let e = self.router.num_experts;
        let x_routed = if rows.all {
            x.clone()
        } else {
            // candle's `index_select` and its `index_add` backward copy row after row (one
            // serial pass per column on a GPU, one thread on the CPU); GatherRows' passes
            // are parallel gathers.
            let batch_rows = x.dim(0)?;
            GatherRows::new(rows.host.clone(), batch_rows, batch_rows)?.apply(x)?
        };
        let logits = self.router_logits(&x_routed)?;
        // The shared expert depends on nothing the routing decides: queued before the
        // routing's wait for the logits (where the layer waits), a GPU runs it meanwhile.
        let shared = self.shared_output(x)?;
        let n = rows.host.len();
        if let Some(plan) = plan {
            if plan.forced.len() != n || plan.ids.len() != n * k {
                return Err(ModelError::Input(format!(
                    "replay plan covers {} rows, layer routes {n}",
                    plan.forced.len()
                )));
            }
        }
        // Every row forced: the router's own choice serves only the divergence count. None
        // counted (a layer run again for its backward), or counted where the logits are (a
        // router selecting on the device): its logits stay on the device (no host round trip
        // on a GPU between the router and the experts) and serve the gates alone.
        let all_forced = plan.filter(|p| p.forced.iter().all(|&f| f));
        let count_on_device =
            all_forced.is_some_and(|p| p.count_differences) && self.router.selects_on_device();
        let forced_ids = all_forced
            .filter(|p| !p.count_differences || count_on_device)
            .map(|p| p.ids.clone());
        // A router that selects on the device chooses there and only its ids cross (k + 1
        // values a row where the logits are E, and no ranking on the host while a GPU waits);
        // where nothing differentiates through the gates (the rollout engine's steps) they
        // are weighed there too, by the host's row formula (`Router::weigh_row`), unless a
        // plan replaces ids (then the host's copy of the logits weighs them).
        let untracked_gates = gates == Gates::HostWhenUntracked && !logits.track_op();
        let choose_on_device = self.routes_on_device() && !(untracked_gates && plan.is_some());
        // The router's own choice, where this layer takes it: the host ids, the host's
        // logits (host selection) or the ids on the device (device selection).
        let (mut ids, host, mut native_on_device, device_wait) = match forced_ids {
            Some(ids) => (ids, None, None, Duration::ZERO),
            None if choose_on_device => {
                let waiting = Instant::now();
                let choice = read_choice(
                    &self.router,
                    &logits,
                    self.score_bias_on_device.as_ref(),
                    untracked_gates,
                )?;
                let chosen = (choice.on_device, choice.gates);
                (choice.ids, None, Some(chosen), waiting.elapsed())
            }
            None => {
                let waiting = Instant::now();
                let host = logits
                    .detach()
                    .flatten_all()?
                    .to_dtype(candle_core::DType::F32)?
                    .to_vec1::<f32>()?;
                let device_wait = waiting.elapsed();
                let ids = self.router.select_rows(&host, self.score_bias.as_deref())?;
                (ids, Some(host), None, device_wait)
            }
        };
        let routed_here = host.is_some() || native_on_device.is_some();
        let mut replay_time = Duration::ZERO;
        // The router's own ids, kept where the plan's replace them: how many forced rows
        // differ is counted once the experts' work is queued (on a GPU the host counts while
        // the device runs them; before, the GPU waited on the count between router and
        // experts).
        let native = match plan.filter(|_| routed_here) {
            Some(plan) => {
                let started = Instant::now();
                // The plan's ids copied whole, then the few rows it leaves to the router (a
                // sequence's final position) patched back: the GPU waits for this between
                // the router and the experts, and a copy row by row over every row took 25–65
                // µs a mid layer of 4,096 rows.
                let mut dispatched = plan.ids.clone();
                for ((given, own), _) in dispatched
                    .chunks_mut(k.max(1))
                    .zip(ids.chunks(k.max(1)))
                    .zip(&plan.forced)
                    .filter(|(_, &forced)| !forced)
                {
                    given.copy_from_slice(own);
                }
                let native = std::mem::replace(&mut ids, dispatched);
                // The device's ids are the router's own, no longer the ones dispatched.
                native_on_device = None;
                replay_time += started.elapsed();
                Some((plan, native))
            }
            None => None,
        };
        let mut ids_on_device = None;
        let gates = match (untracked_gates, host.as_ref(), native_on_device) {
            // Nothing differentiates through the gates, and the host holds the logits
            // already: the gates by the row form the CPU rollout engine weighs with, one
            // upload instead of the ids' upload and four kernels (softmax, gather, sum,
            // divide) on a GPU.
            (true, Some(host), _) => self
                .host_gates(host, &ids, x.device())?
                .to_dtype(logits.dtype())?,
            // The same formula, weighed where the ids were chosen.
            (true, None, Some((_, Some(gates)))) => gates.to_dtype(logits.dtype())?,
            (_, _, chosen) => {
                let ids_tensor = match chosen {
                    // The ids dispatched are the ones chosen on the device: no upload.
                    Some((on_device, _)) => on_device,
                    None => Tensor::from_vec(ids.clone(), (n, k), x.device())?,
                };
                let gates = self.router.weigh(&logits, &ids_tensor)?;
                ids_on_device = Some(ids_tensor);
                gates
            }
        };

        let dispatch = Dispatch::new(&ids, k, e)?;
        // The replay proof compares the tables with `ids`; that the experts ran exactly
        // those rows is Dispatch's contract, re-checked only in debug builds.
        if cfg!(debug_assertions) {
            check_dispatch(&dispatch, &ids, k)?;
        }
        let routed = self.experts.forward(&x_routed, &gates, &dispatch)?;
        let out = if rows.all {
            routed
        } else {
            scatter_rows(&routed, &rows.host, x.dim(0)?)?
        };
        let output = self.combined(out, shared)?;
        let started = Instant::now();
        let counted = match (native, all_forced, ids_on_device) {
            (Some((plan, native)), _, _) => {
                Some(Divergence::Counted(forced_rows_differing(plan, &native, k)))
            }
            (None, Some(plan), Some(forced)) if count_on_device => Some(Divergence::on_device(
                &self.router,
                &logits,
                &forced,
                plan.copies.as_deref().map(Vec::as_slice),
                self.score_bias_on_device.as_ref(),
            )?),
            _ => None,
        };
        // Timed only where a replay counts (a native forward adds no work of its own).
        let differs = match counted {
            Some(counted) => {
                replay_time += started.elapsed();
                counted
            }
            None => Divergence::Counted(0),
        };
        Ok(MoeOutput {
            output,
            ids,
            differs_from_native: differs,
            replay_time,
            device_wait,
            waited: routed_here,
        })
    }

    /// The block output from the routed experts' sum `routed`: the shared expert's output
    /// added where the architecture has one, rounded at the block's precision.
    fn with_shared(&self, x: &Tensor, routed: Tensor) -> Result<Tensor> {
        let shared = self.shared_output(x)?;
        self.combined(routed, shared)
    }

    /// The shared expert's term of the block output for `x` (gated where the architecture
    /// gates it), None without one.
    fn shared_output(&self, x: &Tensor) -> Result<Option<Tensor>> {
        Ok(match &self.shared {
            Shared::None => None,
            Shared::Plain(mlp) => Some(mlp.forward(x)?),
            Shared::Gated { mlp, gate } => {
                let g = candle_nn::ops::sigmoid(&gate.forward(x)?)?;
                Some(mlp.forward(x)?.broadcast_mul(&g)?)
            }
        })
    }

    /// The block output: the routed sum plus the shared expert's term, rounded at the
    /// block's precision.
    fn combined(&self, routed: Tensor, shared: Option<Tensor>) -> Result<Tensor> {
        let output = match shared {
            None => routed,
            Some(shared) => (routed + shared)?,
        };
        self.precision.round(&output)
    }

    /// Whether this block can choose its experts on the device
    /// (`MoeBlock::forward_routed_on_device`): see [`Router::selects_on_device`].
    pub fn routes_on_device(&self) -> bool {
        self.router.selects_on_device()
    }

    /// Bytes of one routed expert's matrices (what a device-routed step reads per slot).
    pub fn expert_bytes(&self) -> usize {
        self.experts.expert_bytes()
    }

    /// Runs the block on every row of `x` `[rows, H]` (native routing, nothing
    /// differentiated) with the experts chosen on the device; returns the `[rows, H]` block
    /// output and the choice: the router's top-k and gates in one op (`route_rows`:
    /// the host selection's experts and `Router::weigh_row`'s gates) and the experts through
    /// [`RoutedExperts::forward_gathered`]. Nothing waits for the host, so a GPU runs the
    /// layer while the host queues the next; the chosen ids stay on the device for one copy a
    /// step. For the rows of a decode step at a small batch (each slot reads its expert).
    pub(crate) fn forward_routed_on_device(&self, x: &Tensor) -> Result<(Tensor, DeviceRoutes)> {
        // Where the router's GEMM and the experts' share a 16-bit input on a GPU, the input is
        // narrowed once for both (each GEMM cast it before): the same values, a kernel fewer.
        // The router's precision is the block's, or f32 (then nothing is shared).
        let narrowed = match self.precision.router().narrow_dtype() {
            Some(narrow) if x.device().is_cuda() && x.dtype() == DType::F32 && !x.track_op() => {
                Some(cast16(&x.contiguous()?, narrow)?)
            }
            _ => None,
        };
        let logits = match &narrowed {
            // `matmul_wt_at`'s GPU form on the input it would have cast.
            Some(xn) => narrowed_product(xn, &self.gate_weight, xn.dtype(), false)?,
            None => self.router_logits(x)?,
        };
        let choice = route_rows(&self.router, &logits, self.score_bias_on_device.as_ref())?;
        // Without a shared expert the block output is the routed sum rounded: the experts
        // round it in their combine's pass.
        let alone = matches!(self.shared, Shared::None);
        let routed = self.experts.forward_gathered(
            x,
            narrowed.as_ref(),
            &choice.gates,
            &choice.ids,
            alone,
        )?;
        let output = if alone {
            routed
        } else {
            self.with_shared(x, routed)?
        };
        Ok((
            output,
            DeviceRoutes {
                record: choice.record,
                logits,
            },
        ))
    }

    /// The host's check of router logits the device flagged not finite: the selection's own
    /// error naming the first row and expert ([`Router::select_rows`]).
    pub(crate) fn check_logits_on_host(&self, logits: &Tensor) -> Result<()> {
        let host = logits
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?;
        self.router.select_rows(&host, self.score_bias.as_deref())?;
        Ok(())
    }
}

/// What a MoE layer routed on the device chose ([`MoeBlock::forward_routed_on_device`]),
/// all on the device, kept until the step's routes are copied.
#[derive(Debug)]
pub(crate) struct DeviceRoutes {
    /// `[rows · top_k + rows]` f32: the chosen experts (best first, exact in f32), then per
    /// row 1 where every logit was finite, 0 where one was not (`DeviceChoice::record`).
    pub record: Tensor,
    /// `[rows, E]` router logits (kept for the host's check of a row flagged not finite).
    pub logits: Tensor,
}

/// `routed` `[n, H]` placed at the batch rows `at` of a zero `[batch_rows, H]`, as a gather
/// (each batch row reads its routed row, or a zero row appended after them), so that its
/// backward is a gather too: the GPU's form of `zeros.index_add(at, routed)`.
fn scatter_rows(routed: &Tensor, at: &[u32], batch_rows: usize) -> Result<Tensor> {
    let (n, h) = routed.dims2()?;
    let mut source = vec![n as u32; batch_rows];
    for (j, &row) in at.iter().enumerate() {
        let slot = source.get_mut(row as usize).ok_or_else(|| {
            ModelError::Input(format!("routed row {row} past a {batch_rows}-row batch"))
        })?;
        *slot = j as u32;
    }
    let padded = Tensor::cat(
        &[
            routed,
            &Tensor::zeros((1, h), routed.dtype(), routed.device())?,
        ],
        0,
    )?;
    GatherRows::new(source, n + 1, n)?.apply(&padded)
}

/// Errors if a row was dispatched to other experts than the ones routing chose for it.
fn check_dispatch(dispatch: &Dispatch, ids: &[u32], k: usize) -> Result<()> {
    for (r, dispatched) in dispatch.experts_of_rows().into_iter().enumerate() {
        let mut chosen = ids[r * k..(r + 1) * k].to_vec();
        chosen.sort_unstable();
        if chosen != dispatched {
            return Err(ModelError::Input(format!(
                "dispatch of row {r} used experts {dispatched:?}, routing chose {chosen:?}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::{DType, Device, Var};

    /// The run-wise count of a replay's differing rows equals counting row by row: rows left
    /// to the router are never counted, a row holding its table's experts in another order
    /// is not a difference, a run whose whole slice differs is counted row by row, and a row
    /// standing for several positions counts at each.
    #[test]
    fn differing_rows_counted_by_runs_equal_the_row_by_row_count() {
        let k = 3;
        // 12 rows: runs [0, 4), [5, 9), [10, 12); rows 4 and 9 left to the router
        let forced: Vec<bool> = (0..12).map(|r| r != 4 && r != 9).collect();
        let given: Vec<u32> = (0..12 * k as u32).map(|i| i % 7).collect();
        let mut native = given.clone();
        native[4 * k] = 6; // an unforced row: not counted
        native[9 * k + 1] = 5; // another
        native.swap(6 * k, 6 * k + 2); // the same experts in another order: not a difference
        native[7 * k + 1] = 9; // a difference
        native[11 * k] = 8; // a difference in the last run
        let by_rows = |plan: &LayerPlan| -> usize {
            native
                .chunks(k)
                .zip(plan.ids.chunks(k))
                .zip(&plan.forced)
                .enumerate()
                .filter(|(_, ((own, given), &forced))| forced && !same_experts(given, own))
                .map(|(r, _)| plan.copies.as_deref().map_or(1, |c| c[r] as usize))
                .sum()
        };
        let mut plan = LayerPlan {
            ids: given,
            forced,
            count_differences: true,
            copies: None,
        };
        assert_eq!(forced_rows_differing(&plan, &native, k), 2);
        assert_eq!(forced_rows_differing(&plan, &native, k), by_rows(&plan));
        plan.copies = Some(std::sync::Arc::new((1..=12).collect()));
        assert_eq!(forced_rows_differing(&plan, &native, k), 8 + 12);
        assert_eq!(forced_rows_differing(&plan, &native, k), by_rows(&plan));
        assert_eq!(forced_rows_differing(&plan, &plan.ids.clone(), k), 0);
    }

    /// The gather form of the scatter equals `zeros.index_add` bit for bit, and so does its
    /// gradient (the probe's routed rows), with padding rows left at zero.
    #[test]
    fn scatter_rows_equals_index_add_forward_and_backward() {
        let at = [4u32, 0, 2, 5];
        let routed = Var::from_tensor(&seeded_tensor(&[4, 3], 7, DType::F64)).expect("var");
        let probe = seeded_tensor(&[6, 3], 8, DType::F64);
        let ids = Tensor::new(&at, &Device::Cpu).expect("ids");
        let gathered = scatter_rows(routed.as_tensor(), &at, 6).expect("scatter");
        let added = Tensor::zeros((6, 3), DType::F64, &Device::Cpu)
            .and_then(|z| z.index_add(&ids, routed.as_tensor(), 0))
            .expect("index_add");
        assert_eq!(max_abs_diff(&gathered, &added), 0.0);
        let pad = gathered
            .get(1)
            .and_then(|r| r.to_vec1::<f64>())
            .expect("row 1");
        assert_eq!(pad, vec![0.0; 3]);
        let grad = |y: &Tensor| {
            let g = (y * &probe)
                .and_then(|l| l.sum_all())
                .and_then(|l| l.backward())
                .expect("backward");
            g.get(routed.as_tensor()).expect("grad").clone()
        };
        assert_eq!(max_abs_diff(&grad(&gathered), &grad(&added)), 0.0);
        let want = probe.index_select(&ids, 0).expect("select");
        assert_eq!(max_abs_diff(&grad(&gathered), &want), 0.0);
    }

    /// A one-layer Qwen3-MoE block of 6 experts, top-2, hidden 16.
    fn tiny_block() -> MoeBlock {
        use crate::config::Config;
        use crate::weights::{RandomInit, Weights};
        let cfg = Config::from_value(serde_json::json!({
            "model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "intermediate_size": 24, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": false,
            "rope_theta": 10000.0, "num_experts": 6, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, "norm_topk_prob": true, "decoder_sparse_step": 1,
            "mlp_only_layers": []
        }))
        .expect("config");
        let weights = Weights::random(&cfg, &RandomInit::new(3), &Device::Cpu)
            .and_then(|w| w.fuse_experts(&cfg))
            .expect("weights");
        MoeBlock::new(&cfg, &weights, 0).expect("block")
    }

    /// A native layer whose router selects on the device chooses there and reads back only
    /// the ids: they are the host selection's over the router's logits, the output is the
    /// one of dispatching those ids as a plan (their gates weighed alike, bit for bit), a
    /// partly forced plan dispatches its own ids with the router's in the rows it leaves
    /// (the device's ids are then not the ones weighed) and counts the forced rows that
    /// differ, and a non-finite score is the host selection's error, naming the same row
    /// and expert.
    #[test]
    fn a_native_layer_chooses_on_the_device_as_the_host_would() {
        let block = tiny_block();
        assert!(block.routes_on_device());
        let (n, k) = (11, 2);
        let x = seeded_tensor(&[n, 16], 5, DType::F32);
        let rows = RoutedRows {
            host: (0..n as u32).collect(),
            all: true,
        };
        let host_logits = |x: &Tensor| {
            block
                .router_logits(x)
                .and_then(|l| Ok(l.flatten_all()?.to_vec1::<f32>()?))
                .expect("host logits")
        };
        let want = block
            .router
            .select_rows(&host_logits(&x), None)
            .expect("host choice");
        let forced = |ids: Vec<u32>, forced: Vec<bool>| LayerPlan {
            ids,
            forced,
            count_differences: false,
            copies: None,
        };
        // `ids` dispatched as a plan forcing every row.
        let as_plan = |ids: &[u32]| {
            block
                .forward(
                    &x,
                    &rows,
                    Some(&forced(ids.to_vec(), vec![true; n])),
                    Gates::Differentiable,
                )
                .expect("as a plan")
        };
        let native = block.forward_native(&x, &rows).expect("native");
        assert_eq!(native.ids, want);
        let bits = crate::test_util::f32_bits;
        assert_eq!(bits(&native.output), bits(&as_plan(&want).output));

        // Rows 0..8 forced to (r, r + 3) mod 6, rows 8..11 left to the router.
        let given: Vec<u32> = (0..n as u32).flat_map(|r| [r % 6, (r + 3) % 6]).collect();
        let keep: Vec<bool> = (0..n).map(|r| r < 8).collect();
        let mut merged = given.clone();
        merged[8 * k..].copy_from_slice(&want[8 * k..]);
        let mut partly = forced(given.clone(), keep.clone());
        partly.count_differences = true;
        let out = block
            .forward(&x, &rows, Some(&partly), Gates::Differentiable)
            .expect("partly forced");
        assert_eq!(out.ids, merged);
        assert_eq!(bits(&out.output), bits(&as_plan(&merged).output));
        let differing = (0..8)
            .filter(|&r| !same_experts(&given[r * k..(r + 1) * k], &want[r * k..(r + 1) * k]))
            .count();
        assert!(differing > 0, "the plan differs from the router somewhere");
        assert!(matches!(
            out.differs_from_native,
            Divergence::Counted(c) if c == differing
        ));

        // A NaN in row 7's input: every logit of that row is NaN.
        let mut values = x.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("x");
        values[7 * 16 + 3] = f32::NAN;
        let bad = Tensor::from_vec(values, (n, 16), &Device::Cpu).expect("bad x");
        let want_err = block
            .router
            .select_rows(&host_logits(&bad), None)
            .expect_err("host refuses");
        let got = block
            .forward_native(&bad, &rows)
            .expect_err("device refuses");
        assert!(
            matches!(
                got,
                ModelError::NonFiniteScore {
                    row: 7,
                    expert: 0,
                    ..
                }
            ),
            "{got}"
        );
        assert_eq!(got.to_string(), want_err.to_string());
    }

    /// A layer run with every row forced and no divergence counted (a recomputed layer)
    /// dispatches the forced experts without its router's logits going to the host: no wait,
    /// no native choice compared; its output and ids are those of the same plan counting
    /// the divergence (where the host routes natively and then overrides every row).
    #[test]
    fn a_fully_forced_layer_skips_the_native_choice_and_gives_the_same_output() {
        let block = tiny_block();
        let n = 9;
        let x = seeded_tensor(&[n, 16], 4, DType::F32);
        let rows = RoutedRows {
            host: (0..n as u32).collect(),
            all: true,
        };
        // Experts (r, r + 1) mod 6: not what the router picks for most rows.
        let ids: Vec<u32> = (0..n as u32).flat_map(|r| [r % 6, (r + 1) % 6]).collect();
        let run = |count_differences: bool| {
            let plan = LayerPlan {
                ids: ids.clone(),
                forced: vec![true; n],
                count_differences,
                copies: None,
            };
            block
                .forward(&x, &rows, Some(&plan), Gates::Differentiable)
                .expect("forward")
        };
        let (skipped, counted) = (run(false), run(true));
        assert_eq!(skipped.ids, ids);
        assert_eq!(counted.ids, ids);
        for out in [&skipped, &counted] {
            assert_eq!(
                out.device_wait,
                Duration::ZERO,
                "no host copy of the logits"
            );
        }
        assert!(matches!(
            skipped.differs_from_native,
            Divergence::Counted(0)
        ));
        // Counted where the logits are: the host's count of the router's own choice.
        assert!(matches!(
            counted.differs_from_native,
            Divergence::OnDevice { .. }
        ));
        let logits = block.router_logits(&x).expect("logits");
        let host = logits
            .flatten_all()
            .and_then(|l| l.to_vec1::<f32>())
            .expect("host logits");
        let native = block.router.select_rows(&host, None).expect("native");
        let plan = LayerPlan {
            ids: ids.clone(),
            forced: vec![true; n],
            count_differences: true,
            copies: None,
        };
        let want = forced_rows_differing(&plan, &native, 2);
        assert!(want > 0, "the plan differs from the router");
        let got = crate::layers::moe::divergence::resolve(std::slice::from_ref(
            &counted.differs_from_native,
        ))
        .expect("resolve");
        assert_eq!(got, vec![want]);
        assert_eq!(
            crate::test_util::f32_bits(&skipped.output),
            crate::test_util::f32_bits(&counted.output)
        );
    }

    #[test]
    fn a_routed_row_past_the_batch_is_an_error() {
        let routed = seeded_tensor(&[2, 3], 7, DType::F32);
        let err = scatter_rows(&routed, &[0, 9], 4).expect_err("past the batch");
        assert!(err.to_string().contains("routed row 9"), "{err}");
    }
}
