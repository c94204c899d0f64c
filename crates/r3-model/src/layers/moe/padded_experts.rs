//! The padded layout's routed experts (a GPU's training path, `experts.rs`) as two ops that
//! hold their intermediates in the GEMMs' dtype: `ExpertsUp` — the rows gathered into the
//! expert blocks, the gate-up GEMM and the SwiGLU with its rounding point — and
//! `ExpertsDown` — the down GEMM and the gate-weighted combine.
//!
//! One op per step (row gather, GEMM, SwiGLU, GEMM, combine) made candle's graph keep each
//! step's input until the backward, all in f32: the layer input with its zero row, the
//! gathered rows `[places, H]`, the gate-up output `[places, 2I]`, the SwiGLU `[places, I]`
//! and the expert outputs `[places, H]`. On the 30B-A3B shape at 8 × 512 tokens (≈ 37 k
//! places under an even load) that is ≈ 1.0 GB a layer, where HF's bf16 experts keep theirs
//! in bf16. Here the graph keeps the layer input (kept anyway: the router reads it) and the
//! SwiGLU's output in the compute dtype (the down GEMM's operand); the ops hold the gate-up
//! output and the expert outputs in the compute dtype: at bf16 ≈ 0.3 GB a layer. The
//! gathered rows are gathered again in the backward, for the gate-up weight gradient.
//!
//! Every value and gradient is the per-step chain's bit for bit — the same planned GEMMs
//! (`BlockGemms`), casts, SwiGLU, gather sums and combine in the same order — which the
//! tests check on the CPU (the planned GEMMs' host twin) and the GPU tests on a GPU.

use candle_core::{CustomOp2, CustomOp3, DType, Tensor};

use super::combine_slots::SlotPlaces;
use super::expert_gemm::BlockGemms;
use super::swiglu_halves::{
    swiglu_halves_grad, swiglu_halves_grad_narrow, swiglu_halves_narrow, swiglu_halves_rounded,
};
use crate::cast16::cast16;
use crate::error::{ModelError, Result};
use crate::layers::gather_rows::GatherRows;
use crate::layers::precomputed::{precomputed_fwd, Precomputed};
use crate::precision::{Precision, WeightGradients};

/// How a GPU runs the padded layout's routed experts in a forward that is differentiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PaddedExpertOps {
    /// Two ops holding their intermediates in the GEMMs' dtype (this module): at a 16-bit
    /// precision about a third of the per-step chain's memory, the same bits.
    #[default]
    Fused,
    /// One op per step, candle's graph keeping every step's f32 input: the reference the
    /// fused ops are checked against, and a bench's before.
    PerStep,
}

impl std::fmt::Display for PaddedExpertOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PaddedExpertOps::Fused => "fused",
            PaddedExpertOps::PerStep => "per-step",
        })
    }
}

impl std::str::FromStr for PaddedExpertOps {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fused" => Ok(PaddedExpertOps::Fused),
            "per-step" => Ok(PaddedExpertOps::PerStep),
            other => Err(ModelError::Input(format!(
                "padded expert ops {other:?}: expected \"fused\" or \"per-step\""
            ))),
        }
    }
}

/// One expert stack and its held 16-bit copy, where a trainer keeps one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stack<'a> {
    /// The stack `[E, n, k]`, f32 or in the compute dtype.
    pub weights: &'a Tensor,
    /// Its held 16-bit copy.
    pub copy: Option<&'a Tensor>,
}

/// The padded layout's tables (`experts.rs` builds them from a dispatch).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockRows<'a> {
    /// The expert of each block.
    pub experts: &'a [u32],
    /// Places per block.
    pub cap: usize,
    /// For each place the row it reads (the row count itself: the zero row of padding).
    pub gather: &'a [u32],
    /// For each slot `r · top_k + j` its place.
    pub place_of_slot: &'a [u32],
}

/// `y[r] = Σ_j gates[r, j] · SwiGLU_{e(r, j)}(x[r])` over the padded layout `blocks`, at
/// precision `p` (its rounding points, as the per-step chain's), the stacks' gradients in the
/// dtype `grads` says: `x` `[rows, H]` and `gates` `[rows, top_k]` f32, the stacks f32 or in
/// the compute dtype. None where the ops do not take these operands (the caller runs the
/// per-step chain).
pub(crate) fn fused_padded_experts(
    p: Precision,
    x: &Tensor,
    gates: &Tensor,
    gate_up: Stack<'_>,
    down: Stack<'_>,
    blocks: &BlockRows<'_>,
    grads: WeightGradients,
) -> Result<Option<Tensor>> {
    let compute = p.narrow_dtype().unwrap_or(DType::F32);
    let (rows, h) = x.dims2()?;
    let (_, top_k) = gates.dims2()?;
    let (_, two_i, _) = gate_up.weights.dims3()?;
    let i = two_i / 2;
    let fits = |w: &Tensor| w.dtype() == DType::F32 || w.dtype() == compute;
    let runs = x.device().is_cpu() || x.device().is_cuda();
    if x.dtype() != DType::F32
        || gates.dtype() != DType::F32
        || !fits(gate_up.weights)
        || !fits(down.weights)
        || !runs
        || rows == 0
        || i == 0
        || blocks.experts.is_empty()
    {
        return Ok(None);
    }
    let places = blocks.experts.len() * blocks.cap;
    let slots = SlotPlaces::new(blocks.place_of_slot, places, top_k)?;
    if !slots.applies(compute, gates) || blocks.gather.len() != places {
        return Ok(None);
    }
    let shape = |width: usize| [blocks.experts.len(), blocks.cap, width];
    let up = UpParts {
        gather: GatherRows::new(blocks.gather.to_vec(), rows + 1, rows)?,
        gemms: BlockGemms::new(
            p,
            &shape(h),
            gate_up.weights,
            gate_up.copy,
            blocks.experts,
            grads,
        )?,
        round: p.narrow_dtype(),
        rows,
    };
    let down_gemms = BlockGemms::new(p, &shape(i), down.weights, down.copy, blocks.experts, grads)?;

    let hidden = up.gemms.forward(&up.gathered(x)?, gate_up.weights)?;
    let swiglu = up.swiglu(&hidden, p)?;
    let up_tracked = x.track_op() || gate_up.weights.track_op();
    let swiglu = match up_tracked {
        true => x.apply_op2(
            gate_up.weights,
            ExpertsUp {
                value: Precomputed::new(swiglu),
                parts: up,
                hidden,
            },
        )?,
        false => {
            // Nothing to differentiate: the gate-up output is not needed past the SwiGLU.
            drop(hidden);
            swiglu
        }
    };

    let y = down_gemms.forward(&swiglu, down.weights)?;
    // The combine reads the expert outputs in the GEMMs' dtype, widening as it goes.
    let out = slots.value(&y.reshape((places, h))?, gates)?;
    if !(swiglu.track_op() || down.weights.track_op() || gates.track_op()) {
        return Ok(Some(out));
    }
    let op = ExpertsDown {
        value: Precomputed::new(out),
        gemms: down_gemms,
        slots,
        y,
    };
    Ok(Some(swiglu.apply_op3(down.weights, gates, op)?))
}

/// What [`ExpertsUp`] needs beside its held gate-up output.
#[derive(Debug)]
struct UpParts {
    /// The places' rows of the input with its zero row appended (`rows + 1` source rows,
    /// the last without a gradient).
    gather: GatherRows,
    gemms: BlockGemms,
    /// The SwiGLU's rounding point (a 16-bit precision's float).
    round: Option<DType>,
    rows: usize,
}

impl UpParts {
    /// The blocks' rows `[blocks, cap, H]` in the compute dtype: `x` `[rows, H]` cast, a zero
    /// row appended (padding's), gathered by place. The cast is elementwise, so casting the
    /// rows once and gathering them narrow gives the values of gathering them wide and
    /// casting the copies; the places outnumber the rows by about the top-k (the 30B-A3B
    /// shape: 37 k places for 4,096 rows), so the gather moves 2 bytes a value where it
    /// moved 4 and the cast pass over the places is gone (≈ 1.1 → 0.35 GB a call there, in
    /// the forward and again in the backward's weight gradient).
    fn gathered(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.dim(1)?;
        let compute = self.gemms.compute();
        let xn = cast16(&x.detach(), compute)?;
        let padded = Tensor::cat(&[&xn, &Tensor::zeros((1, h), compute, x.device())?], 0)?;
        let xs = padded.apply_op1_no_bwd(&self.gather)?;
        let (blocks, cap) = self.gemms.blocks();
        xs.reshape((blocks, cap, h))
    }

    /// The SwiGLU of the gate-up output `hidden` (in the compute dtype) rounded at `p`, in
    /// the compute dtype (the down GEMMs' operand). At a 16-bit precision one pass reads the
    /// 16-bit halves and writes the 16-bit output: the values of widening them, the f32 op
    /// with `p`'s rounding point and narrowing (the rounding point rounds to the compute
    /// dtype, whose cast then is exact), without the f32 copies.
    fn swiglu(&self, hidden: &Tensor, p: Precision) -> candle_core::Result<Tensor> {
        let compute = self.gemms.compute();
        let op = match self.round == Some(compute) {
            true => swiglu_halves_narrow(hidden),
            false => swiglu_halves_rounded(&cast16(hidden, DType::F32)?, p),
        };
        match op {
            Ok(Some(a)) => cast16(&a, compute),
            Ok(None) => candle_core::bail!(
                "padded experts: the SwiGLU op does not run on {:?} {:?} {:?}",
                hidden.device(),
                hidden.dtype(),
                hidden.dims()
            ),
            Err(e) => candle_core::bail!("padded experts: {e}"),
        }
    }
}

/// `(x [rows, H], gate_up [E, 2I, H]) → swiglu [blocks, cap, I]` in the compute dtype, holding
/// the gate-up output `hidden` `[blocks, cap, 2I]` in the compute dtype.
#[derive(Debug)]
struct ExpertsUp {
    value: Precomputed,
    parts: UpParts,
    hidden: Tensor,
}

impl CustomOp2 for ExpertsUp {
    fn name(&self) -> &'static str {
        "r3-padded-experts-up"
    }

    precomputed_fwd!(2);

    /// The SwiGLU's gradient at the held gate-up output (the rounding point's first), then
    /// the gate-up GEMMs' input and weight gradients, the input's summed back over the
    /// places that read each row.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let parts = &self.parts;
        let compute = parts.gemms.compute();
        // At a 16-bit precision the gradient arrives in the compute dtype (the down GEMMs'
        // input gradient): one pass from the 16-bit halves to the 16-bit gradient, the values
        // of the f32 chain below (whose rounding of a 16-bit gradient leaves it as it is).
        let narrow = match parts.round == Some(compute) {
            true => swiglu_halves_grad_narrow(&self.hidden, grad)
                .map_err(|e| candle_core::Error::Msg(format!("padded experts: {e}")))?,
            false => None,
        };
        let gn = match narrow {
            Some(gn) => gn,
            None => {
                let d = cast16(&grad.contiguous()?, DType::F32)?;
                let dh = swiglu_halves_grad(&cast16(&self.hidden, DType::F32)?, &d, parts.round)?;
                drop(d);
                cast16(&dh, compute)?
            }
        };
        let dx = if x.track_op() {
            // The gathered rows' gradient in the compute dtype, summed back per row in f32
            // (each 16-bit value widened as it is read).
            let dxs = parts.gemms.input_grad(&gn, w)?;
            let h = x.dim(1)?;
            let summed = parts
                .gather
                .sum_uses_widened(&dxs.reshape(((), h))?, &[parts.rows + 1, h])?;
            Some(summed.narrow(0, 0, parts.rows)?)
        } else {
            None
        };
        let dw = if w.track_op() {
            Some(parts.gemms.weight_grad(&gn, &parts.gathered(x)?, w)?)
        } else {
            None
        };
        Ok((dx, dw))
    }
}

/// `(swiglu [blocks, cap, I], down [E, H, I], gates [rows, top_k]) → out [rows, H]` f32,
/// holding the expert outputs `y` `[blocks, cap, H]` in the compute dtype.
#[derive(Debug)]
struct ExpertsDown {
    value: Precomputed,
    gemms: BlockGemms,
    slots: SlotPlaces,
    y: Tensor,
}

impl CustomOp3 for ExpertsDown {
    fn name(&self) -> &'static str {
        "r3-padded-experts-down"
    }

    precomputed_fwd!(3);

    /// The combine's gradients at the held expert outputs (read in their dtype, `dy` written
    /// in the compute dtype the down GEMMs read), then the down GEMMs' input gradient (in
    /// the compute dtype, the SwiGLU output's) and weight gradient.
    fn bwd(
        &self,
        a: &Tensor,
        w: &Tensor,
        gates: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dims = self.y.dims().to_vec();
        let places = dims[0] * dims[1];
        let y = self.y.reshape((places, dims[2]))?;
        let (dy, dgates) = self
            .slots
            .grads(&y, &gates.detach(), grad, self.gemms.compute())?;
        let gn = dy.reshape(dims)?;
        let da = if a.track_op() {
            Some(self.gemms.input_grad(&gn, w)?)
        } else {
            None
        };
        let dw = if w.track_op() {
            Some(self.gemms.weight_grad(&gn, &a.detach(), w)?)
        } else {
            None
        };
        Ok((da, dw, gates.track_op().then_some(dgates)))
    }
}
