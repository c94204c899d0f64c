//! The routed experts of one MoE layer as two stacked tensors — `gate_up` `[E, 2I, H]` (gate
//! rows first) and `down` `[E, H, I]`, the transformers-5 fused layout — and the gate-weighted
//! sum of their SwiGLUs over each row's chosen experts.
//!
//! On CPU in f32/f64, and in bf16 / f16 training on f32 operands (the op rounding where the
//! composed ops do), the whole layer (dispatch, grouped GEMMs with experts in parallel,
//! combine) is one custom op with its own backward (`routed_op`); candle's autograd would
//! otherwise build ~10 nodes per expert, each with a gradient pass over its input (upstream
//! candle, measured then, also zero-filled one per node) — most of a training step's time at
//! 32 experts.

use candle_core::{DType, Tensor, D};

use super::combine_slots::{combine_slots, combine_slots_in_order};
use super::dispatch::Dispatch;
#[cfg(test)]
use super::expert_gemm::planned_blocks_matmul;
use super::expert_gemm::{
    expert_blocks_matmul, expert_slots_matmul, expert_slots_matmul_narrow, ExpertGemmInputs,
};
use super::padded_experts::{fused_padded_experts, BlockRows, PaddedExpertOps, Stack};
use super::routed_op::RoutedSwiGlu;
use super::swiglu_halves::{swiglu_halves, swiglu_halves_narrow, swiglu_halves_rounded};
use crate::error::{ModelError, Result};
use crate::layers::gather_rows::GatherRows;
use crate::layers::linear::matmul_wt;
use crate::precision::{Precision, WeightGradients};
use crate::spec::fused_expert_names;
use crate::weights::Weights;

/// The routed experts of one MoE layer, stacked.
#[derive(Debug, Clone)]
pub struct RoutedExperts {
    gate_up: Tensor,
    down: Tensor,
    /// The stacks' held 16-bit copies, where a trainer keeps them
    /// ([`Weights::hold_narrow_copies`]): read by the GPU's GEMMs instead of casting the
    /// stacks per use. The CPU's fused op rounds the stacks itself (the same values).
    copies: Option<(Tensor, Tensor)>,
    intermediate: usize,
    precision: Precision,
    gemm_inputs: ExpertGemmInputs,
    weight_grads: WeightGradients,
    padded_ops: PaddedExpertOps,
}

impl RoutedExperts {
    /// Takes the fused expert pair under `{moe_prefix}.experts` (see `Weights::fuse_experts`).
    pub fn new(weights: &Weights, moe_prefix: &str, num_experts: usize) -> Result<Self> {
        let (gate_up_name, down_name) = fused_expert_names(moe_prefix);
        let gate_up = weights.get(&gate_up_name)?.clone();
        let down = weights.get(&down_name)?.clone();
        let (e, two_i, h) = gate_up.dims3()?;
        let (e2, h2, i) = down.dims3()?;
        if e != num_experts || e2 != e || h2 != h || two_i != 2 * i {
            return Err(ModelError::TensorShape {
                name: gate_up_name,
                expected: vec![num_experts, 2 * i, h2],
                got: gate_up.dims().to_vec(),
            });
        }
        let copies = match (
            weights.narrow_copy(&gate_up_name),
            weights.narrow_copy(&down_name),
        ) {
            (Some(g), Some(d)) => Some((g.clone(), d.clone())),
            _ => None,
        };
        Ok(RoutedExperts {
            gate_up,
            down,
            copies,
            intermediate: i,
            precision: Precision::F32,
            gemm_inputs: ExpertGemmInputs::Cast,
            weight_grads: WeightGradients::InWeightDtype,
            padded_ops: PaddedExpertOps::Fused,
        })
    }

    /// Sets the precision. bf16 rounds every expert matmul (inputs, weights, outputs) and
    /// the SwiGLU output (on the CPU inside the fused op, elsewhere in the padded or composed
    /// ops); the gate-weighted sum stays f32 (the caller rounds the block output, or asks
    /// [`RoutedExperts::forward_gathered`] to).
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    /// Sets how the GEMMs of the padded layout take their f32 operands on a GPU in bf16.
    pub fn set_gemm_inputs(&mut self, inputs: ExpertGemmInputs) {
        self.gemm_inputs = inputs;
    }

    /// Sets the dtype the stacks' gradients leave the GPU's GEMMs in ([`WeightGradients`]).
    pub fn set_weight_gradients(&mut self, grads: WeightGradients) {
        self.weight_grads = grads;
    }

    /// Sets how a GPU runs the padded layout in a differentiated forward
    /// ([`PaddedExpertOps`]: fused, holding the intermediates in the GEMMs' dtype, or one op
    /// per step).
    pub fn set_padded_ops(&mut self, ops: PaddedExpertOps) {
        self.padded_ops = ops;
    }

    /// `y[r] = Σ_j gates[r, j] · SwiGLU_{e(r, j)}(x[r])` for `x` `[rows, H]` and `gates`
    /// `[rows, top_k]`, the experts `e(r, j)` as `dispatch` groups them.
    pub fn forward(&self, x: &Tensor, gates: &Tensor, dispatch: &Dispatch) -> Result<Tensor> {
        let e = self.gate_up.dim(0)?;
        let (rows, _) = x.dims2()?;
        let k = dispatch.top_k();
        if dispatch.rows() != rows || dispatch.offsets().len() != e + 1 {
            return Err(ModelError::Input(format!(
                "dispatch of {} rows over {} experts does not fit {rows} rows and {e} experts",
                dispatch.rows(),
                dispatch.offsets().len().saturating_sub(1)
            )));
        }
        if gates.dims() != [rows, k] {
            return Err(ModelError::Input(format!(
                "gates {:?} are not [{rows}, {k}]",
                gates.dims()
            )));
        }
        // The fused op takes rows and stacks of one dtype, or f32 rows with bf16 stacks (a
        // trainer's matrices held in bf16: `train.master_weights`), and rounds to a 16-bit
        // float on f32 rows only.
        let stacks_fit =
            |dtype: DType| dtype == x.dtype() || (x.dtype() == DType::F32 && dtype == DType::BF16);
        let fused_dtype = match x.dtype() {
            candle_core::DType::F32 => true,
            candle_core::DType::F64 => !self.precision.is_mixed(),
            _ => false,
        } && stacks_fit(self.gate_up.dtype())
            && stacks_fit(self.down.dtype());
        if x.device().is_cpu() && fused_dtype {
            let rows_with_gates = Tensor::cat(&[x, &gates.to_dtype(x.dtype())?], 1)?;
            Ok(rows_with_gates.apply_op3(
                &self.gate_up.contiguous()?,
                &self.down.contiguous()?,
                RoutedSwiGlu::new(dispatch.clone(), self.precision),
            )?)
        } else if !x.device().is_cpu() && !dispatch.slots().is_empty() {
            self.forward_padded(x, gates, dispatch, OVERFLOW_BLOCK_ROWS, Gemms::Chosen)
        } else {
            self.forward_composed(x, gates, dispatch)
        }
    }

    /// Bytes of one expert's two matrices (what [`RoutedExperts::forward_gathered`] reads
    /// for each slot).
    pub fn expert_bytes(&self) -> usize {
        let per_expert = |t: &Tensor| {
            let e = t.dim(0).unwrap_or(1).max(1);
            t.elem_count() / e * t.dtype().size_in_bytes()
        };
        per_expert(&self.gate_up) + per_expert(&self.down)
    }

    /// The same sum with the chosen experts given as a device tensor: `ids` `[rows, top_k]`
    /// (u32, on `x`'s device), so that a step routed on the device never waits for the host.
    /// Each (row, slot) runs through its expert's matrices, one row per block of two batched
    /// GEMMs (`expert_slots_matmul`: on a GPU read in place through a pointer table
    /// written on the device, elsewhere gathered), then the slots are weighted and summed in
    /// slot order (`combine_slots`, slot `r · top_k + j` at place `r · top_k + j`). Every
    /// slot reads its expert's matrices, even where rows share one, so this is for a few
    /// rows: a decode step at a small batch. The rounding points of the dispatched forms;
    /// with `round_output` the sum is also rounded at this block's precision (the MoE
    /// block's output rounding, where nothing is added to it: done in the combine's pass).
    /// `narrowed`, where given, is `x` already cast to this block's 16-bit float (a GPU step
    /// narrows the block input once for the router's GEMM and these): the 16-bit GEMMs read
    /// it instead of casting `x` again.
    pub fn forward_gathered(
        &self,
        x: &Tensor,
        narrowed: Option<&Tensor>,
        gates: &Tensor,
        ids: &Tensor,
        round_output: bool,
    ) -> Result<Tensor> {
        let (rows, h) = x.dims2()?;
        let k = ids.dim(1)?;
        if ids.dims() != [rows, k] || gates.dims() != [rows, k] {
            return Err(ModelError::Input(format!(
                "device-routed experts: ids {:?} and gates {:?} are not both [{rows}, top_k]",
                ids.dims(),
                gates.dims()
            )));
        }
        let (slots, i, p) = (rows * k, self.intermediate, self.precision);
        if slots == 0 {
            return Ok(x.zeros_like()?);
        }
        let chosen = ids.flatten_all()?;
        let rows_narrow = narrowed.filter(|n| {
            Some(n.dtype()) == p.narrow_dtype() && n.dims() == x.dims() && !n.track_op()
        });
        if let Some(out) =
            self.forward_gathered_narrow(rows_narrow.unwrap_or(x), gates, &chosen, round_output)?
        {
            return Ok(out);
        }
        let (gate_up, down) = self.stacks_read();
        // Row r read by its top_k slots (`expert_slots_matmul` points each slot at it).
        let hidden = expert_slots_matmul(p, &x.unsqueeze(1)?, gate_up, &chosen)?;
        let a = match swiglu_halves(&hidden)? {
            Some(a) => a,
            None => (hidden.narrow(2, 0, i)?.silu()? * hidden.narrow(2, i, i)?)?,
        };
        // The down projection rounds its input itself (every form of
        // `expert_slots_matmul`); the rounding point here matters only to a gradient
        // passing back through it, so with nothing differentiated it is left out.
        let a = if a.track_op() { p.round(&a)? } else { a };
        let y = expert_slots_matmul(p, &a, down, &chosen)?.reshape((slots, h))?;
        let gates = gates.to_dtype(x.dtype())?;
        let round = p.narrow_dtype().filter(|_| round_output);
        if let Some(out) = combine_slots_in_order(&y, &gates, round)? {
            return Ok(out);
        }
        let in_order: Vec<u32> = (0..slots as u32).collect();
        let out = match combine_slots(&y, &gates, &in_order)? {
            Some(out) => out,
            None => y
                .reshape((rows, k, h))?
                .broadcast_mul(&gates.unsqueeze(D::Minus1)?)?
                .sum(1)?,
        };
        if round_output {
            return p.round(&out);
        }
        Ok(out)
    }

    /// [`RoutedExperts::forward_gathered`] on a GPU in bf16 / f16 with nothing
    /// differentiated, the experts' activations kept in the 16-bit float between its ops:
    /// the gate-up GEMM's output read by a 16-bit SwiGLU whose output the down GEMM reads,
    /// whose output the combine reads (`expert_slots_matmul_narrow`, `swiglu_halves_narrow`,
    /// `combine_slots_in_order`). The same values as the f32 forms, which widen each GEMM's
    /// 16-bit output and narrow the SwiGLU's (exact conversions and the same rounding), in
    /// three kernels fewer. `x` is f32 or already in the 16-bit float. None where it does
    /// not apply.
    fn forward_gathered_narrow(
        &self,
        x: &Tensor,
        gates: &Tensor,
        chosen: &Tensor,
        round_output: bool,
    ) -> Result<Option<Tensor>> {
        let Some(narrow) = self.precision.narrow_dtype() else {
            return Ok(None);
        };
        if gates.track_op() {
            return Ok(None);
        }
        let h = x.dim(1)?;
        let (gate_up, down) = self.stacks_read();
        let hidden = match expert_slots_matmul_narrow(&x.unsqueeze(1)?, gate_up, chosen, narrow)? {
            Some(hidden) => hidden,
            None => return Ok(None),
        };
        let Some(a) = swiglu_halves_narrow(&hidden)? else {
            return Ok(None);
        };
        let Some(y) = expert_slots_matmul_narrow(&a, down, chosen, narrow)? else {
            return Ok(None);
        };
        let y = y.reshape((chosen.elem_count(), h))?;
        let gates = gates.to_dtype(DType::F32)?;
        combine_slots_in_order(&y, &gates, Some(narrow).filter(|_| round_output))
    }

    /// The same computation as batched GEMMs over all experts at once, for a GPU: the first
    /// `cap` rows of each expert that has any gathered into a main block (shorter experts
    /// padded with a zero row; an expert without rows has no block, so a decode step of a few
    /// rows reads only its chosen experts' weights), an expert's rows past `cap` into further
    /// `cap`-row overflow blocks right after its main block ([`PaddedLayout`]), every block
    /// `· [H, 2I]` of its expert, SwiGLU, `· [I, H]`
    /// (two batched GEMMs for the whole layer, where one GEMM per chosen expert took about
    /// ten launches each), the experts' matrices read
    /// in place from the stacks and their gradients written into the stacks' gradients
    /// ([`expert_blocks_matmul`]), then each row's `top_k` outputs read back in slot order,
    /// weighted by its gates and summed (one op, [`combine_slots`], where the device has it).
    /// A few launches per layer instead of three per expert (slicing each expert out of the
    /// stack would make candle's backward build a zero-filled copy of the whole stack per
    /// expert: 4 s of a 30B-A3B-shaped step on an H200). The row gathers are [`GatherRows`],
    /// whose backward is a gather too (candle's `index_select` → `index_add` backward is
    /// serial over the rows on a GPU). The same rounding points as `forward_composed`. The
    /// block size weighs padded rows against what overflow blocks cost (`overflow_rows` per
    /// block, [`OVERFLOW_BLOCK_ROWS`] in the model).
    fn forward_padded(
        &self,
        x: &Tensor,
        gates: &Tensor,
        dispatch: &Dispatch,
        overflow_rows: usize,
        gemms: Gemms,
    ) -> Result<Tensor> {
        let device = x.device();
        let (rows, h) = x.dims2()?;
        let k = dispatch.top_k();
        let layout = padded_layout(dispatch, rows, overflow_rows);
        let (blocks, cap) = (layout.blocks.len(), layout.cap);
        let gates = gates.to_dtype(x.dtype())?;
        if let Some(out) = self.forward_fused(x, &gates, &layout, gemms)? {
            return Ok(out);
        }
        // Row `rows` of `x_pad` is the zero row padding reads; it gets no gradient.
        let x_pad = Tensor::cat(&[x, &Tensor::zeros((1, h), x.dtype(), device)?], 0)?;
        let xs = GatherRows::new(layout.gather, rows + 1, rows)?
            .apply(&x_pad)?
            .reshape((blocks, cap, h))?;
        let y = self
            .swiglu_blocks(&xs, &layout.blocks, gemms)?
            .reshape((blocks * cap, h))?;
        if let Some(out) = combine_slots(&y, &gates, &layout.place_of_slot)? {
            return Ok(out);
        }
        let by_slot = GatherRows::new(layout.place_of_slot, blocks * cap, blocks * cap)?
            .apply(&y)?
            .reshape((rows, k, h))?;
        Ok(by_slot
            .broadcast_mul(&gates.unsqueeze(D::Minus1)?)?
            .sum(1)?)
    }

    /// The padded layout through the two fused ops (`padded_experts.rs`), where this layer
    /// asks for them and they apply: planned GEMMs (a GPU's, or the tests' on the CPU) with
    /// their operands cast (not `FAST_16BF`'s f32 operands). None otherwise.
    fn forward_fused(
        &self,
        x: &Tensor,
        gates: &Tensor,
        layout: &PaddedLayout,
        gemms: Gemms,
    ) -> Result<Option<Tensor>> {
        let planned = match gemms {
            Gemms::Chosen => x.device().is_cuda(),
            #[cfg(test)]
            Gemms::Planned => true,
        };
        let fast16bf = self.gemm_inputs == ExpertGemmInputs::Fast16bf
            && self.precision.narrow_dtype() == Some(DType::BF16)
            && self.copies.is_none()
            && (self.gate_up.dtype() == DType::F32 || self.down.dtype() == DType::F32);
        if !planned || fast16bf || self.padded_ops != PaddedExpertOps::Fused {
            return Ok(None);
        }
        let (gate_up_copy, down_copy) = match &self.copies {
            Some((g, d)) => (Some(g), Some(d)),
            None => (None, None),
        };
        fused_padded_experts(
            self.precision,
            x,
            gates,
            Stack {
                weights: &self.gate_up,
                copy: gate_up_copy,
            },
            Stack {
                weights: &self.down,
                copy: down_copy,
            },
            &BlockRows {
                experts: &layout.blocks,
                cap: layout.cap,
                gather: &layout.gather,
                place_of_slot: &layout.place_of_slot,
            },
            self.weight_grads,
        )
    }

    /// The stacks a forward with nothing to differentiate in them reads: their held 16-bit
    /// copies where there are some (the values the forward rounds the stacks to, so no cast
    /// per use), else the stacks.
    fn stacks_read(&self) -> (&Tensor, &Tensor) {
        match &self.copies {
            Some((g, d)) if !self.gate_up.track_op() && !self.down.track_op() => (g, d),
            _ => (&self.gate_up, &self.down),
        }
    }

    /// The padded blocks' SwiGLU: `xs` `[blocks, cap, H]`, block `b` through expert
    /// `experts[b]`'s `gate_up` `[2I, H]` and `down` `[H, I]`, read in place from the stacks
    /// ([`expert_blocks_matmul`]), rounded where `forward_composed` rounds.
    fn swiglu_blocks(&self, xs: &Tensor, experts: &[u32], gemms: Gemms) -> Result<Tensor> {
        let (i, p) = (self.intermediate, self.precision);
        let (gate_up_copy, down_copy) = match &self.copies {
            Some((g, d)) => (Some(g), Some(d)),
            None => (None, None),
        };
        let matmul = |x: &Tensor, w: &Tensor, copy: Option<&Tensor>| match gemms {
            Gemms::Chosen => {
                expert_blocks_matmul(p, x, w, copy, experts, self.gemm_inputs, self.weight_grads)
            }
            #[cfg(test)]
            Gemms::Planned => planned_blocks_matmul(p, x, w, copy, experts, self.weight_grads),
        };
        let hidden = matmul(xs, &self.gate_up, gate_up_copy)?;
        // The SwiGLU with its rounding point in one op: the graph holds no unrounded copy.
        let a = match swiglu_halves_rounded(&hidden, p)? {
            Some(a) => a,
            None => p.round(&(hidden.narrow(2, 0, i)?.silu()? * hidden.narrow(2, i, i)?)?)?,
        };
        matmul(&a, &self.down, down_copy)
    }

    /// The same computation from candle's composed ops, expert by expert (other devices and
    /// dtypes, and the reference the fused op is tested against).
    fn forward_composed(&self, x: &Tensor, gates: &Tensor, dispatch: &Dispatch) -> Result<Tensor> {
        let i = self.intermediate;
        let device = x.device();
        let source = Tensor::from_vec(dispatch.source_rows(), dispatch.slots().len(), device)?;
        let xs = x.index_select(&source, 0)?;
        let mut outputs = Vec::new();
        for (j, w) in dispatch.offsets().windows(2).enumerate() {
            if w[0] == w[1] {
                continue;
            }
            let p = self.precision;
            let xj = xs.narrow(0, w[0], w[1] - w[0])?;
            let h = p.round(&matmul_wt(
                &p.round(&xj)?,
                &p.round(&self.gate_up.get(j)?)?,
            )?)?;
            let a = p.round(&(h.narrow(1, 0, i)?.silu()? * h.narrow(1, i, i)?)?)?;
            outputs.push(p.round(&matmul_wt(&a, &p.round(&self.down.get(j)?)?)?)?);
        }
        if outputs.is_empty() {
            return Ok(x.zeros_like()?);
        }
        let expert_out = Tensor::cat(&outputs, 0)?;
        let slots = Tensor::from_vec(dispatch.slots().to_vec(), dispatch.slots().len(), device)?;
        let weights = gates
            .to_dtype(x.dtype())?
            .flatten_all()?
            .index_select(&slots, 0)?
            .unsqueeze(D::Minus1)?;
        let weighted = expert_out.broadcast_mul(&weights)?;
        Ok(x.zeros_like()?.index_add(&source, &weighted, 0)?)
    }
}

/// Which GEMMs the padded layout runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gemms {
    /// As [`expert_blocks_matmul`] chooses by device: planned on a GPU (and there the fused
    /// ops, where asked), gathered weights elsewhere.
    Chosen,
    /// Planned on any device, the fused ops where asked: the tests' form of a GPU's path on
    /// the CPU.
    #[cfg(test)]
    Planned,
}

/// The padded layout of a dispatch: for each expert with rows, in expert order, a main block
/// of `cap` places filled in the dispatch's order, then its rows past `cap` in overflow
/// blocks of `cap` places each, right after it. Each expert's blocks are consecutive, so its
/// rows are one run of places and its weight gradient one GEMM over them (one round, written
/// in the 16-bit dtype directly: `expert_gemm/plan.rs`); with the overflow blocks after every main
/// block an expert's gradient was a main GEMM plus an overflow GEMM added in f32, which
/// brought a stack-sized f32 gradient and a rounding pass over it (H200, call 17: 0.8 ms a
/// 30B-A3B layer).
#[derive(Debug, Clone, PartialEq, Eq)]
struct PaddedLayout {
    /// The expert of each block, in block order: ascending, an expert's blocks consecutive.
    blocks: Vec<u32>,
    cap: usize,
    /// For each of the `blocks · cap` places the row it reads (`rows`, the zero row, for
    /// padding).
    gather: Vec<u32>,
    /// For each slot `r · top_k + j` its place.
    place_of_slot: Vec<u32>,
}

#[cfg(test)]
impl PaddedLayout {
    /// The blocks past each expert's first (its rows past `cap`).
    fn overflow_blocks(&self) -> usize {
        let mut experts = self.blocks.clone();
        experts.dedup();
        self.blocks.len() - experts.len()
    }
}

/// What one overflow block costs beyond its places, in padded rows: its expert's two weight
/// matrices are read again by the forward and the input-gradient GEMMs (12·I·H bytes in
/// bf16) where a padded row costs the GEMMs 18·I·H FLOPs forward and backward; on an H200
/// (4.8 TB/s, several hundred TFLOP/s in bf16) that is about 70 rows, and a run of overflow
/// blocks adds a weight-gradient GEMM of its own. Decode steps, whose GEMMs are bound by
/// reading weights, pay more per extra read, so the estimate is rounded up. With a cost of
/// zero a decode step at batch 256 split its ~32 rows per expert into overflow blocks and
/// ran slower (H200, 2026-11-27). (Before the weights were read in place each block's
/// matrices were copied, and any overflow block brought stack-sized gradient passes: ≈ 5 ms
/// a 30B-A3B layer.)
const OVERFLOW_BLOCK_ROWS: usize = 128;

/// The places a block size of `cap` takes for these expert loads: every expert's main block
/// plus one more block per `cap` rows past its first `cap`.
fn places_for(counts: &[usize], cap: usize) -> usize {
    counts.iter().map(|&c| c.div_ceil(cap).max(1) * cap).sum()
}

/// The cost of a block size in padded rows: its places, plus `overflow_rows` for each of its
/// overflow blocks ([`OVERFLOW_BLOCK_ROWS`] on a GPU).
fn cost_of(counts: &[usize], cap: usize, overflow_rows: usize) -> usize {
    let places = places_for(counts, cap);
    let overflow_blocks = places / cap.max(1) - counts.len();
    places + overflow_blocks * overflow_rows
}

/// The block size of least cost ([`cost_of`]: places, padding included, and each overflow
/// block's weight re-read) for these loads, between the mean load (overflow blocks then
/// number at most the experts, so the weights are read at most once more) and the busiest expert's (no overflow); among equals the largest. The cost is the
/// size times a block count, plus the count's excess, and the count only falls where some
/// expert's rows fill `j` blocks exactly (`⌈c / j⌉`), so those points and the mean are the
/// only candidates: at most twice the experts of them.
fn block_size(counts: &[usize], overflow_rows: usize) -> usize {
    let slots: usize = counts.iter().sum();
    let busiest = counts.iter().copied().max().unwrap_or(0);
    let low = slots.div_ceil(counts.len().max(1)).max(1);
    if busiest <= low {
        return low;
    }
    let mut candidates: Vec<usize> = counts
        .iter()
        .flat_map(|&c| (1..=c.div_ceil(low)).map(move |j| c.div_ceil(j)))
        .filter(|&cap| cap >= low && cap <= busiest)
        .chain([low])
        .collect();
    candidates.sort_unstable();
    candidates.dedup();
    let mut best = busiest;
    let mut best_cost = cost_of(counts, busiest, overflow_rows);
    for &cap in candidates.iter().rev() {
        let cost = cost_of(counts, cap, overflow_rows);
        if cost < best_cost {
            (best, best_cost) = (cap, cost);
        }
    }
    best
}

/// The padded layout of `dispatch` over `rows` rows, overflow blocks costing `overflow_rows`
/// when the block size is chosen (over the loads of the experts with rows).
fn padded_layout(dispatch: &Dispatch, rows: usize, overflow_rows: usize) -> PaddedLayout {
    let offsets = dispatch.offsets();
    let counts: Vec<usize> = offsets.windows(2).map(|w| w[1] - w[0]).collect();
    let loads: Vec<usize> = counts.iter().copied().filter(|&c| c > 0).collect();
    let cap = block_size(&loads, overflow_rows);
    let k = dispatch.top_k();
    let mut blocks = Vec::new();
    let mut gather = Vec::new();
    let mut place_of_slot = vec![0u32; dispatch.slots().len()];
    for (expert, w) in offsets.windows(2).enumerate() {
        let count = w[1] - w[0];
        if count == 0 {
            continue;
        }
        let first = blocks.len() * cap;
        let spans = count.div_ceil(cap);
        blocks.extend(std::iter::repeat_n(expert as u32, spans));
        gather.resize(blocks.len() * cap, rows as u32);
        for (n, &slot) in dispatch.slots()[w[0]..w[1]].iter().enumerate() {
            gather[first + n] = slot / k as u32;
            place_of_slot[slot as usize] = (first + n) as u32;
        }
    }
    PaddedLayout {
        blocks,
        cap,
        gather,
        place_of_slot,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{f64_bits, max_abs_diff, seeded_tensor};
    use candle_core::{DType, Var};

    fn experts(e: usize, h: usize, i: usize, dtype: DType) -> (Var, Var, RoutedExperts) {
        let gu = Var::from_tensor(&seeded_tensor(&[e, 2 * i, h], 2, dtype)).expect("var");
        let dn = Var::from_tensor(&seeded_tensor(&[e, h, i], 3, dtype)).expect("var");
        let experts = RoutedExperts {
            gate_up: gu.as_tensor().clone(),
            down: dn.as_tensor().clone(),
            copies: None,
            intermediate: i,
            precision: Precision::F32,
            gemm_inputs: ExpertGemmInputs::Cast,
            weight_grads: WeightGradients::InWeightDtype,
            padded_ops: PaddedExpertOps::Fused,
        };
        (gu, dn, experts)
    }

    /// The case both path comparisons run: 6 rows, top-2 over 5 experts of width 7
    /// (expert 1 gets no row, expert 3 one), seeded rows, gates, weights and loss probe.
    struct PathCase {
        dispatch: Dispatch,
        rows: usize,
        x: Var,
        gates: Var,
        gu: Var,
        dn: Var,
        experts: RoutedExperts,
        probe: Tensor,
    }

    impl PathCase {
        fn new(dtype: DType, precision: Precision) -> Self {
            Self::with_ids(dtype, precision, &[0, 2, 2, 4, 3, 0, 4, 2, 0, 4, 2, 0])
        }

        /// The case with each row's two experts (of five) given by `ids`.
        fn with_ids(dtype: DType, precision: Precision, ids: &[u32]) -> Self {
            let (e, h, i, k) = (5, 12, 7, 2);
            let rows = ids.len() / k;
            let dispatch = Dispatch::new(ids, k, e).expect("dispatch");
            let x = Var::from_tensor(&seeded_tensor(&[rows, h], 1, dtype)).expect("var");
            let gates = Var::from_tensor(&seeded_tensor(&[rows, k], 5, dtype)).expect("var");
            let (gu, dn, mut experts) = experts(e, h, i, dtype);
            experts.set_precision(precision);
            let probe = seeded_tensor(&[rows, h], 4, dtype);
            PathCase {
                dispatch,
                rows,
                x,
                gates,
                gu,
                dn,
                experts,
                probe,
            }
        }

        /// The gradients of `sum(y · probe)`.
        fn grads(&self, y: &Tensor) -> candle_core::backprop::GradStore {
            (y * &self.probe)
                .and_then(|l| l.sum_all())
                .and_then(|l| l.backward())
                .expect("backward")
        }

        /// The layer's output by `forward` (the fused op on the CPU) and by the composed ops.
        fn fused_and_composed(&self) -> (Tensor, Tensor) {
            let (x, gates) = (self.x.as_tensor(), self.gates.as_tensor());
            let fused = self
                .experts
                .forward(x, gates, &self.dispatch)
                .expect("fused");
            let composed = self
                .experts
                .forward_composed(x, gates, &self.dispatch)
                .expect("composed");
            (fused, composed)
        }

        /// The four variables, by name.
        fn vars(&self) -> [(&'static str, &Var); 4] {
            [
                ("x", &self.x),
                ("gates", &self.gates),
                ("gate_up", &self.gu),
                ("down", &self.dn),
            ]
        }
    }

    /// The fused op and candle's composed ops agree on outputs and on the gradients of the
    /// rows, the gates and both expert weights, including an expert no row goes to.
    #[test]
    fn fused_matches_composed_ops() {
        for dtype in [DType::F64, DType::F32] {
            let c = PathCase::new(dtype, Precision::F32);
            assert_eq!(c.dispatch.offsets()[1], c.dispatch.offsets()[2]);
            let (fused, composed) = c.fused_and_composed();
            let (gf, gc) = (c.grads(&fused), c.grads(&composed));
            let tol = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
            assert!(max_abs_diff(&fused, &composed) < tol, "{dtype:?} outputs");
            for (name, v) in c.vars() {
                let a = gf.get(v.as_tensor()).expect("fused grad");
                let b = gc.get(v.as_tensor()).expect("composed grad");
                assert!(max_abs_diff(a, b) < tol, "{dtype:?} grad of {name}");
            }
            // expert 1 has no rows: its weight gradients are exactly zero
            let dw = gf.get(c.gu.as_tensor()).expect("grad").get(1).expect("e1");
            assert_eq!(max_abs_diff(&dw, &dw.zeros_like().expect("z")), 0.0);
        }
    }

    /// Mean absolute difference of two tensors.
    fn mean_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b)
            .and_then(|d| d.abs())
            .and_then(|d| d.mean_all())
            .and_then(|d| d.to_dtype(DType::F64))
            .and_then(|d| d.to_scalar::<f64>())
            .expect("mean abs diff")
    }

    /// In bf16 and f16 the fused op rounds where the composed ops round, forward and
    /// backward: its output and the gradients of the rows, the gates and both stacks equal
    /// the composed ops' up to a rounding landing one ulp apart (the two sum in different
    /// orders), and on average they lie far closer to them than the unrounded f32 values do
    /// (a rounding point missing from the op, in the forward or in a gradient, would put
    /// its tensor as far off as f32 is).
    #[test]
    fn fused_rounds_where_the_composed_ops_round() {
        for precision in [
            Precision::Bf16 { router_f32: false },
            Precision::F16 { router_f32: false },
        ] {
            let c = PathCase::new(DType::F32, precision);
            let (fused, composed) = c.fused_and_composed();
            let mut unrounded = c.experts.clone();
            unrounded.set_precision(Precision::F32);
            let (x, gates) = (c.x.as_tensor(), c.gates.as_tensor());
            let exact = unrounded.forward(x, gates, &c.dispatch).expect("f32");
            let (gf, gc, ge) = (c.grads(&fused), c.grads(&composed), c.grads(&exact));
            let mut pairs = vec![("output", fused, composed, exact)];
            for (name, v) in c.vars() {
                let get = |g: &candle_core::backprop::GradStore| {
                    g.get(v.as_tensor()).expect("grad").clone()
                };
                pairs.push((name, get(&gf), get(&gc), get(&ge)));
            }
            for (name, fused, composed, exact) in pairs {
                let scale = max_abs_diff(&composed, &composed.zeros_like().expect("zeros"));
                assert!(
                    max_abs_diff(&fused, &composed) <= 1e-2 * scale.max(1.0),
                    "{precision:?} {name}: fused and composed differ by more than a rounding"
                );
                let (near, far) = (
                    mean_abs_diff(&fused, &composed),
                    mean_abs_diff(&exact, &composed),
                );
                assert!(
                    far > 0.0,
                    "{precision:?} {name}: f32 equals the rounded ops"
                );
                assert!(
                    near < 0.1 * far,
                    "{precision:?} {name}: fused {near:e} from the composed ops, f32 {far:e}"
                );
            }
        }
    }

    /// Every slot has its own place, that place reads the slot's row, every other place
    /// reads the zero row, each block holds rows of its own expert only, and an expert's
    /// blocks are consecutive (its weight gradient one GEMM) with its rows first in them.
    fn assert_layout_places_every_slot(dispatch: &Dispatch, layout: &PaddedLayout, rows: usize) {
        let k = dispatch.top_k();
        let blocks = layout.blocks.len();
        assert_eq!(layout.gather.len(), blocks * layout.cap);
        assert!(
            layout.blocks.windows(2).all(|w| w[0] <= w[1]),
            "blocks in expert order, each expert's consecutive: {:?}",
            layout.blocks
        );
        let mut places = layout.place_of_slot.clone();
        places.sort_unstable();
        places.dedup();
        assert_eq!(places.len(), dispatch.slots().len(), "one place per slot");
        for (slot, &place) in layout.place_of_slot.iter().enumerate() {
            assert_eq!(layout.gather[place as usize] as usize, slot / k);
        }
        let used = layout
            .gather
            .iter()
            .filter(|&&r| r as usize != rows)
            .count();
        assert_eq!(used, dispatch.slots().len(), "padding reads the zero row");
        let ids = dispatch.experts_of_rows();
        for (slot, &place) in layout.place_of_slot.iter().enumerate() {
            let expert = layout.blocks[place as usize / layout.cap];
            assert!(ids[slot / k].contains(&expert), "slot {slot}");
        }
        // Within an expert's run of blocks its rows come first, then padding.
        let mut start = 0;
        for run in layout.blocks.chunk_by(|a, b| a == b) {
            let places = &layout.gather[start * layout.cap..(start + run.len()) * layout.cap];
            let filled = places.iter().take_while(|&&r| r as usize != rows).count();
            assert!(
                places[filled..].iter().all(|&r| r as usize == rows),
                "expert {}: padding only after its rows",
                run[0]
            );
            assert!(
                filled > (run.len() - 1) * layout.cap,
                "no empty overflow block"
            );
            start += run.len();
        }
    }

    /// The padded path and the composed ops agree on outputs and on the gradients of the
    /// rows, the gates and both stacked weights, in f64, f32 and bf16 rounding.
    fn assert_padded_matches_composed(ids: &[u32], overflow_rows: usize) {
        for (dtype, precision, tol) in [
            (DType::F64, Precision::F32, 1e-12),
            (DType::F32, Precision::F32, 2e-5),
            // bf16: the two sum in different orders, so a rounding may land one ulp apart
            (DType::F32, Precision::Bf16 { router_f32: false }, 1e-2),
        ] {
            let c = PathCase::with_ids(dtype, precision, ids);
            let (x, gates) = (c.x.as_tensor(), c.gates.as_tensor());
            let padded = c
                .experts
                .forward_padded(x, gates, &c.dispatch, overflow_rows, Gemms::Chosen)
                .expect("padded");
            let composed = c
                .experts
                .forward_composed(x, gates, &c.dispatch)
                .expect("composed");
            let (gp, gc) = (c.grads(&padded), c.grads(&composed));
            let scale = max_abs_diff(&composed, &composed.zeros_like().expect("z"));
            assert!(scale > 0.1, "a non-trivial output");
            assert!(
                max_abs_diff(&padded, &composed) < tol * scale.max(1.0),
                "{dtype:?} {precision:?} outputs"
            );
            for (name, v) in c.vars() {
                let a = gp.get(v.as_tensor()).expect("padded grad");
                let b = gc.get(v.as_tensor()).expect("composed grad");
                let scale = max_abs_diff(b, &b.zeros_like().expect("z")).max(1.0);
                assert!(
                    max_abs_diff(a, b) < tol * scale,
                    "{dtype:?} {precision:?} grad of {name}"
                );
            }
        }
    }

    /// The padded batched layout (the GPU's path) equals the expert-by-expert composed ops,
    /// with an expert no row goes to and uneven expert loads.
    #[test]
    fn padded_matches_composed_ops() {
        let case = PathCase::new(DType::F64, Precision::F32);
        let rows = case.rows;
        let layout = padded_layout(&case.dispatch, rows, 0);
        let cap = layout.cap;
        // loads 4, 0, 4, 1, 3: expert 1 has no block; one block of 4 for each of the other
        // four has the fewest places (16; blocks of 3 would take 18)
        assert_eq!(
            (layout.blocks.clone(), cap, layout.overflow_blocks()),
            (vec![0, 2, 3, 4], 4, 0),
            "experts 0 and 2 carry four rows each"
        );
        // expert 3's block (the third) holds its one row, then padding: the zero row
        assert!(layout.gather[2 * cap + 1..3 * cap]
            .iter()
            .all(|&r| r as usize == rows));
        assert_layout_places_every_slot(&case.dispatch, &layout, rows);
        assert_padded_matches_composed(&[0, 2, 2, 4, 3, 0, 4, 2, 0, 4, 2, 0], 0);
    }

    /// How a case holds its stacks: f32, f32 with held 16-bit copies, or in the 16-bit
    /// float itself (a trainer's `train.master_weights = "bf16"`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum StackForm {
        F32,
        HeldCopies,
        Narrow,
    }

    /// The fused padded ops (`padded_experts.rs`) give the per-step chain's outputs and the
    /// gradients of the rows, gates and both stacks bit for bit (and in the same dtypes),
    /// both through the planned GEMMs (a GPU's path; here their host twin): in f32, bf16 and
    /// f16, the stacks f32, with held 16-bit copies or 16-bit themselves, their gradients
    /// wide and narrow, with one block per expert and with overflow blocks.
    #[test]
    fn the_fused_padded_ops_are_the_per_step_chain_bit_for_bit() {
        let even = [0, 2, 2, 4, 3, 0, 4, 2, 0, 4, 2, 0];
        let skewed = [0, 2, 2, 0, 0, 3, 0, 2, 4, 0, 0, 2, 3, 0, 0, 2, 0, 3, 2, 0];
        let bf16 = Precision::Bf16 { router_f32: false };
        let f16 = Precision::F16 { router_f32: false };
        let forms = [StackForm::F32, StackForm::HeldCopies, StackForm::Narrow];
        let mut runs = 0;
        for ids in [&even[..], &skewed[..]] {
            for precision in [Precision::F32, bf16, f16] {
                for form in forms {
                    for grads in [WeightGradients::InWeightDtype, WeightGradients::Narrow] {
                        let mut c = PathCase::with_ids(DType::F32, precision, ids);
                        c.experts.set_weight_gradients(grads);
                        let narrow = precision.narrow_dtype();
                        match (form, narrow) {
                            (StackForm::F32, _) => {}
                            (_, None) => continue,
                            (StackForm::HeldCopies, Some(narrow)) => {
                                let copy = |v: &Var| v.as_tensor().to_dtype(narrow).expect("copy");
                                c.experts.copies = Some((copy(&c.gu), copy(&c.dn)));
                            }
                            (StackForm::Narrow, Some(narrow)) => {
                                let held = |v: &Var| {
                                    Var::from_tensor(&v.as_tensor().to_dtype(narrow).expect("n"))
                                        .expect("var")
                                };
                                (c.gu, c.dn) = (held(&c.gu), held(&c.dn));
                                c.experts.gate_up = c.gu.as_tensor().clone();
                                c.experts.down = c.dn.as_tensor().clone();
                            }
                        }
                        let (x, gates) = (c.x.as_tensor(), c.gates.as_tensor());
                        let layout = padded_layout(&c.dispatch, c.rows, 0);
                        let fused = c
                            .experts
                            .forward_fused(x, gates, &layout, Gemms::Planned)
                            .expect("fused")
                            .expect("the fused ops take f32 rows and gates");
                        let mut per_step = c.experts.clone();
                        per_step.set_padded_ops(PaddedExpertOps::PerStep);
                        let reference = per_step
                            .forward_padded(x, gates, &c.dispatch, 0, Gemms::Planned)
                            .expect("per step");
                        let case = format!("{precision:?} {form:?} {grads:?} {ids:?}");
                        assert_eq!(f64_bits(&fused), f64_bits(&reference), "{case}: output");
                        let (gf, gr) = (c.grads(&fused), c.grads(&reference));
                        for (name, v) in c.vars() {
                            let a = gf.get(v.as_tensor()).expect("fused grad");
                            let b = gr.get(v.as_tensor()).expect("per-step grad");
                            assert_eq!(a.dtype(), b.dtype(), "{case}: dtype of d {name}");
                            assert_eq!(f64_bits(a), f64_bits(b), "{case}: d {name}");
                        }
                        runs += 1;
                    }
                }
            }
        }
        // per load: f32 in one form, bf16 and f16 in three, each with two gradient dtypes
        assert_eq!(runs, 2 * (2 + 6 + 6), "every case ran");
    }

    /// A skewed load spills past the block size into overflow blocks (their weights read
    /// in place from the stack), and still equals the composed ops, gradients of the stack
    /// included.
    #[test]
    fn overflow_blocks_match_composed_ops() {
        // ten rows: expert 0 in every row, expert 2 in six, 3 in three, 4 in one, 1 in none
        let ids = [0, 2, 2, 0, 0, 3, 0, 2, 4, 0, 0, 2, 3, 0, 0, 2, 0, 3, 2, 0];
        let case = PathCase::with_ids(DType::F64, Precision::F32, &ids);
        let layout = padded_layout(&case.dispatch, case.rows, 0);
        // loads 10, 6, 3, 1 on the four experts with rows (mean 5): blocks of 5 take 30
        // places (experts 0 and 2 in two blocks each), of 6 also 30 (expert 0 in two: the
        // larger of equals is kept), one block of 10 each 40
        // expert 0's overflow block right after its main block
        assert_eq!((layout.cap, layout.overflow_blocks()), (6, 1));
        assert_eq!(layout.blocks, vec![0, 0, 2, 3, 4]);
        assert_layout_places_every_slot(&case.dispatch, &layout, case.rows);
        assert_padded_matches_composed(&ids, 0);
        // each overflow block costing 128 rows, one block of 10 each (40 places) is cheaper
        let costed = padded_layout(&case.dispatch, case.rows, 128);
        assert_eq!((costed.cap, costed.overflow_blocks()), (10, 0));
    }

    /// The block size: the mean load when loads are even, the busiest load when one block
    /// each costs least, overflow blocks when one expert takes far more than the rest.
    #[test]
    fn the_block_size_takes_the_least_cost() {
        assert_eq!(block_size(&[4, 4, 4, 4], 0), 4);
        // 20 places either way: the busiest load's size, with no overflow block
        assert_eq!(block_size(&[5, 4, 4, 3], 0), 5);
        // 20 places against 24: the mean, expert 0 in two blocks; not when a block costs 8
        assert_eq!(block_size(&[6, 4, 4, 2], 0), 4);
        assert_eq!(block_size(&[6, 4, 4, 2], 8), 6);
        // one expert with all 64 slots of 8 experts: blocks of 8 (8 + 7 · 8 = 64 + 56 places)
        // beat one block of 64 each (512 places); at 128 rows per overflow block, blocks of
        // 32 (9 · 32 + 128 = 416) beat both 8 (120 + 7 · 128) and 64 (512)
        let skewed = [64, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(block_size(&skewed, 0), 8);
        assert_eq!(places_for(&skewed, 8), 120);
        assert_eq!(cost_of(&skewed, 8, 128), 120 + 7 * 128);
        assert_eq!(cost_of(&skewed, 32, 128), 416);
        assert_eq!(block_size(&skewed, 128), 32);
        // brute force: no block size between the mean and the busiest load costs less
        for counts in [
            vec![7, 1, 9, 3],
            vec![100, 3, 5, 40, 2],
            vec![5, 5, 6, 5],
            vec![300, 0, 0, 1, 2, 0, 0, 9, 50, 0],
            vec![1000, 999, 17, 0],
            vec![4000, 500, 510, 490, 20, 700, 505, 512],
        ] {
            for overflow_rows in [0, 1, 16, 128] {
                let chosen = cost_of(&counts, block_size(&counts, overflow_rows), overflow_rows);
                let low = counts.iter().sum::<usize>().div_ceil(counts.len());
                let busiest = *counts.iter().max().expect("max");
                for cap in low..=busiest {
                    let cost = cost_of(&counts, cap, overflow_rows);
                    assert!(cost >= chosen, "{counts:?} cost {overflow_rows} cap {cap}");
                }
            }
        }
        // a training-sized skew (mid's 32 experts, 16,384 slots): overflow blocks pay, 2
        // blocks of 512 past expert 0's first (17,408 places + 2 · 128) against 35,200
        // places in one block each
        let mut training = vec![512; 32];
        training[0] = 1100;
        training[1] = 0;
        training[2] = 436;
        assert_eq!(block_size(&training, OVERFLOW_BLOCK_ROWS), 512);
        // a 30B-A3B-like load (128 experts, 64 rows on most, 100 on eight, 150 on one): at
        // 128 rows a block, blocks of 67 cost least (8,576 places + 10 overflow blocks of
        // 67 + 128 = 10,526, against 19,200 places in one block each)
        let mut a3b = vec![64; 128];
        a3b[..8].fill(100);
        a3b[8] = 150;
        assert_eq!(block_size(&a3b, OVERFLOW_BLOCK_ROWS), 67);
        assert_eq!(cost_of(&a3b, 67, OVERFLOW_BLOCK_ROWS), 10_526);
    }

    /// A decode step's sparse dispatch lays out blocks for its chosen experts only (one row
    /// each: blocks of one place), and the padded path still equals the composed ops.
    #[test]
    fn sparse_dispatches_get_blocks_for_their_experts_only() {
        // one row top-2 over 8 experts (a decode step): two blocks of one place
        let sparse = Dispatch::new(&[5, 3], 2, 8).expect("dispatch");
        let layout = padded_layout(&sparse, 1, OVERFLOW_BLOCK_ROWS);
        assert_eq!((layout.blocks.clone(), layout.cap), (vec![3, 5], 1));
        assert_eq!(layout.overflow_blocks(), 0);
        assert_layout_places_every_slot(&sparse, &layout, 1);
        // two rows over five experts: experts 1 and 4 only, then 0, 2, 3 in turn
        assert_padded_matches_composed(&[1, 4, 4, 1], OVERFLOW_BLOCK_ROWS);
        assert_padded_matches_composed(&[0, 2, 3, 0], OVERFLOW_BLOCK_ROWS);
    }

    /// One row, one expert, gate 1: the output is that expert's SwiGLU, computed by hand.
    #[test]
    fn single_row_is_the_chosen_experts_swiglu() {
        let (e, h, i) = (3, 4, 2);
        let (_, _, experts) = experts(e, h, i, DType::F64);
        let x = seeded_tensor(&[1, h], 9, DType::F64);
        let gates = Tensor::new(&[[1.0f64]], x.device()).expect("gates");
        let dispatch = Dispatch::new(&[2], 1, e).expect("dispatch");
        let y = experts.forward(&x, &gates, &dispatch).expect("forward");
        let xv = x.flatten_all().and_then(|t| t.to_vec1::<f64>()).expect("x");
        let w1 = experts
            .gate_up
            .get(2)
            .and_then(|t| t.to_vec2::<f64>())
            .expect("w1");
        let w2 = experts
            .down
            .get(2)
            .and_then(|t| t.to_vec2::<f64>())
            .expect("w2");
        let dot = |w: &[f64], v: &[f64]| w.iter().zip(v).map(|(a, b)| a * b).sum::<f64>();
        let a: Vec<f64> = (0..i)
            .map(|c| {
                let g = dot(&w1[c], &xv);
                let u = dot(&w1[i + c], &xv);
                g / (1.0 + (-g).exp()) * u
            })
            .collect();
        let want: Vec<f64> = (0..h).map(|o| dot(&w2[o], &a)).collect();
        let got = y.flatten_all().and_then(|t| t.to_vec1::<f64>()).expect("y");
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-12, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn a_dispatch_or_gates_that_do_not_fit_are_errors() {
        let (_, _, experts) = experts(2, 3, 2, DType::F64);
        let x = seeded_tensor(&[3, 3], 3, DType::F64);
        let gates = seeded_tensor(&[3, 1], 4, DType::F64);
        let two_rows = Dispatch::new(&[0, 1], 1, 2).expect("dispatch");
        let err = experts.forward(&x, &gates, &two_rows).expect_err("rows");
        assert!(err.to_string().contains("dispatch"), "{err}");
        let three_experts = Dispatch::new(&[0, 1, 2], 1, 3).expect("dispatch");
        let err = experts
            .forward(&x, &gates, &three_experts)
            .expect_err("experts");
        assert!(err.to_string().contains("experts"), "{err}");
        let fits = Dispatch::new(&[0, 1, 1], 1, 2).expect("dispatch");
        let wide = seeded_tensor(&[3, 2], 4, DType::F64);
        let err = experts.forward(&x, &wide, &fits).expect_err("gates");
        assert!(err.to_string().contains("gates"), "{err}");
    }
}
