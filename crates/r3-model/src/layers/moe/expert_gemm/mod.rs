//! Batched GEMMs over blocks of rows where each block multiplies one expert's weights, read
//! in place from the layer's stacked tensor: the routed experts' GEMMs of the padded layout
//! (`experts.rs`), forward and backward.
//!
//! The padded layout puts each expert's first `cap` rows in a main block and its rows past
//! `cap` in overflow blocks of the same size. Composed from candle's ops, the overflow blocks'
//! weights had to be gathered from the stack (`index_select`: a copy of two expert matrices
//! per block), and the gather's backward built a zero-filled gradient the size of the whole
//! stack and summed it with the main blocks' (on an H200, 60 ms of a 30B-A3B-shaped bf16
//! step's 148 ms of kernels). Here every block's GEMM points at its expert's matrices where
//! they lie (cuBLAS's batched GEMM over pointer arrays), and the weight gradient is written
//! by GEMMs into the stack's gradient directly, one GEMM per run of consecutive blocks of an
//! expert. The padded layout puts each expert's blocks side by side, so every expert's
//! gradient is one GEMM over all its rows, written once (in the 16-bit dtype itself at a
//! 16-bit precision); a block map where an expert recurs apart adds its later runs in f32.
//!
//! Which GEMMs run is a `GemmPlan` made on the host from the block → expert map alone; a
//! GPU runs it through cuBLAS, the CPU (the tests) through a plain column-major GEMM, so the
//! plan's offsets and accumulation order are checked in CI against candle's composed ops.
//!
//!
//! The plans and their op are `plan.rs`; the decode step's one-row-a-slot GEMMs, whose
//! pointer table a kernel writes from the router's ids on the device, `slots.rs`.

mod plan;
pub(crate) mod slots;

pub(crate) use slots::{expert_slots_matmul, expert_slots_matmul_narrow};

use std::sync::Arc;

use candle_core::{CustomOp2, DType, Tensor};

use crate::cast16::cast16;
use crate::error::{ModelError, Result};
use crate::layers::linear::matmul_wt_at;
use crate::layers::precomputed::{precomputed_fwd, Precomputed};
use crate::precision::{Precision, RoundTo, WeightGradients};
use crate::weights::check_narrow_copy;
use plan::{BlockMap, GemmPlan, Pass, PlannedGemm};

/// How the routed experts' bf16 GEMMs take their f32 operands on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertGemmInputs {
    /// Cast to bf16 first by r3's cast kernel (round to nearest, ties to even: the CPU
    /// engines' rounding), a bf16 GEMM with f32 accumulation: a pass over every expert stack
    /// for the forward and again for the input gradient.
    #[default]
    Cast,
    /// cuBLAS's `CUBLAS_COMPUTE_32F_FAST_16BF` on the f32 operands as they lie: the GEMM
    /// converts them to bf16 itself (no cast passes, no 16-bit copies), then the output is
    /// rounded to bf16 as the cast path's is. Its conversion is cuBLAS's, which
    /// `gemm16_modes` (check.sh step 7) compares with round-to-nearest-even; opt in only
    /// where that check says it rounds as r3 does. Only bf16 precision on a GPU; elsewhere
    /// the same as `Cast`.
    Fast16bf,
}

impl std::fmt::Display for ExpertGemmInputs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ExpertGemmInputs::Cast => "cast",
            ExpertGemmInputs::Fast16bf => "fast16bf",
        })
    }
}

impl std::str::FromStr for ExpertGemmInputs {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cast" => Ok(ExpertGemmInputs::Cast),
            "fast16bf" => Ok(ExpertGemmInputs::Fast16bf),
            other => Err(ModelError::Input(format!(
                "expert GEMM inputs {other:?}: expected cast or fast16bf"
            ))),
        }
    }
}

/// `y[b] = x[b] · w[experts[b]]ᵀ` for `x` `[blocks, cap, k]` and the stack `w` `[E, n, k]`,
/// rounded as [`matmul_wt_at`] rounds at precision `p` (16-bit operands and output, f32
/// accumulation; the weight may already be the 16-bit copy). Differentiable in `x` and `w`;
/// on a GPU the weights are read in place and their gradient written by the GEMMs (see the
/// module doc; at a 16-bit precision a 16-bit value, in the dtype `grads` says), the
/// operands turned into bf16 as `inputs` says; elsewhere the blocks'
/// weights are gathered and multiplied by candle's ops. `copy` is the stack's held 16-bit
/// copy where a trainer keeps one ([`Weights::hold_narrow_copies`]): the rounded weights are
/// read from it (forward and input gradient; on a GPU no cast of the stack at all, even
/// where `inputs` asks for `FAST_16BF`).
///
/// [`Weights::hold_narrow_copies`]: crate::weights::Weights::hold_narrow_copies
pub fn expert_blocks_matmul(
    p: Precision,
    x: &Tensor,
    w: &Tensor,
    copy: Option<&Tensor>,
    experts: &[u32],
    inputs: ExpertGemmInputs,
    grads: WeightGradients,
) -> Result<Tensor> {
    let map = BlockMap::new(x, w, experts)?;
    let compute = p.narrow_dtype().unwrap_or(DType::F32);
    let copy = copy_read_at(p, w, copy)?;
    if reads_weights_in_place(x, w, compute) {
        let fast = inputs == ExpertGemmInputs::Fast16bf
            && compute == DType::BF16
            && w.dtype() == DType::F32
            && copy.is_none();
        return in_place_matmul(x, w, BlockGemms::planned(map, compute, fast, copy, grads));
    }
    let identity = experts.iter().enumerate().all(|(b, &e)| b == e as usize);
    let gather = |t: &Tensor| -> Result<Tensor> {
        if identity && experts.len() == map.stack {
            Ok(t.clone())
        } else {
            let ids = Tensor::from_vec(experts.to_vec(), experts.len(), t.device())?;
            Ok(t.index_select(&ids, 0)?)
        }
    };
    let copy_blocks = copy.map(gather).transpose()?;
    // The gathered blocks are not the stack: their gradient reaches it through the gather's
    // f32 sum, so it is handed back in f32.
    matmul_wt_at(
        p,
        x,
        &gather(w)?,
        copy_blocks.as_ref(),
        WeightGradients::InWeightDtype,
    )
}

/// The held copy a forward at precision `p` reads: only at a 16-bit precision, checked
/// against its stack.
fn copy_read_at<'a>(
    p: Precision,
    w: &Tensor,
    copy: Option<&'a Tensor>,
) -> Result<Option<&'a Tensor>> {
    match (p.narrow_dtype(), copy) {
        (Some(narrow), Some(copy)) => {
            check_narrow_copy(w, copy, Some(narrow))?;
            Ok(Some(copy))
        }
        _ => Ok(None),
    }
}

/// [`expert_blocks_matmul`] through the planned GEMMs on any device, the operands cast to
/// the compute dtype: a GPU's form, which on the CPU (their host twin) is the tests'
/// reference for the fused padded ops (`padded_experts.rs`).
#[cfg(test)]
pub(crate) fn planned_blocks_matmul(
    p: Precision,
    x: &Tensor,
    w: &Tensor,
    copy: Option<&Tensor>,
    experts: &[u32],
    grads: WeightGradients,
) -> Result<Tensor> {
    in_place_matmul(x, w, BlockGemms::new(p, x.dims(), w, copy, experts, grads)?)
}

/// Whether the experts' GEMMs run on cuBLAS reading the stack `w` in place: on a GPU, f32
/// rows, the stack f32 or already in the `compute` dtype, neither operand empty (empty
/// operands take candle's ops: CUDA allocates no zero-byte buffer).
fn reads_weights_in_place(x: &Tensor, w: &Tensor, compute: DType) -> bool {
    x.device().is_cuda()
        && x.elem_count() > 0
        && w.elem_count() > 0
        && x.dtype() == DType::F32
        && (w.dtype() == DType::F32 || w.dtype() == compute)
}

/// The op on a GPU: the value from the forward plan, the gradients from the two backward
/// plans, operands cast to the GEMMs' compute dtype (f32, bf16 or f16) around them, or with
/// `fast16bf` (bf16 compute, f32 operands) left f32 for cuBLAS's own conversion and the
/// outputs rounded to bf16 where the cast path's are bf16; the stack's gradient in the dtype
/// the GEMMs' `grads` says.
fn in_place_matmul(x: &Tensor, w: &Tensor, gemms: BlockGemms) -> Result<Tensor> {
    let compute = gemms.compute;
    let x = x.contiguous()?;
    let value = if gemms.fast16bf {
        let y = x.detach().apply_op2_no_bwd(
            &w.detach().contiguous()?,
            &PlannedGemm::fast(Pass::Forward, &gemms.map),
        )?;
        round_bf16(&y)?
    } else {
        let xn = cast16(&x.detach(), compute)?;
        cast16(&gemms.forward(&xn, w)?, DType::F32)?
    };
    if !x.track_op() && !w.track_op() {
        return Ok(value);
    }
    let op = ExpertBlocksMatmul {
        value: Precomputed::new(value),
        gemms,
    };
    Ok(x.apply_op2(w, op)?)
}

/// The three planned GEMM passes of one stack's blocks at a compute dtype, the stack read in
/// place (or from its held 16-bit copy), each on operands already in the compute dtype: the
/// forward, the input gradient and the weight gradient. [`expert_blocks_matmul`]'s op runs
/// them, and so do the padded experts' fused ops (`padded_experts.rs`), which hold their
/// intermediates between them in the compute dtype.
#[derive(Debug, Clone)]
pub(crate) struct BlockGemms {
    map: Arc<BlockMap>,
    compute: DType,
    /// The operands stay f32 for cuBLAS's `FAST_16BF` conversion ([`ExpertGemmInputs`]).
    fast16bf: bool,
    /// The stack's held 16-bit copy, read instead of a cast of the stack.
    copy: Option<Tensor>,
    /// The dtype the stack's gradient is returned in.
    grads: WeightGradients,
}

impl BlockGemms {
    /// The passes over blocks of shape `blocks` `[blocks, cap, k]` by the stack `w` `[E, n,
    /// k]`, block `b` through expert `experts[b]`, at precision `p` (its 16-bit float, else
    /// f32), reading `copy` for the rounded stack where given (at a 16-bit precision, as
    /// [`expert_blocks_matmul`]). The stack must be f32 or already in the compute dtype.
    pub(crate) fn new(
        p: Precision,
        blocks: &[usize],
        w: &Tensor,
        copy: Option<&Tensor>,
        experts: &[u32],
        grads: WeightGradients,
    ) -> Result<Self> {
        let map = BlockMap::of_shape(blocks, w, experts)?;
        let compute = p.narrow_dtype().unwrap_or(DType::F32);
        if w.dtype() != DType::F32 && w.dtype() != compute {
            return Err(ModelError::Input(format!(
                "expert blocks: a {:?} stack at a {compute:?} compute dtype",
                w.dtype()
            )));
        }
        let copy = copy_read_at(p, w, copy)?;
        Ok(Self::planned(map, compute, false, copy, grads))
    }

    /// The passes of a checked map at `compute`, `fast16bf` for `FAST_16BF`'s f32 operands,
    /// reading `copy` (already checked against its stack) for the rounded stack.
    fn planned(
        map: BlockMap,
        compute: DType,
        fast16bf: bool,
        copy: Option<&Tensor>,
        grads: WeightGradients,
    ) -> Self {
        BlockGemms {
            map: Arc::new(map),
            compute,
            fast16bf,
            copy: copy.map(Tensor::detach),
            grads,
        }
    }

    /// The dtype the passes' operands and outputs are in.
    pub(crate) fn compute(&self) -> DType {
        self.compute
    }

    /// The blocks and the places per block.
    pub(crate) fn blocks(&self) -> (usize, usize) {
        (self.map.experts.len(), self.map.cap)
    }

    /// The stack as the forward and input-gradient GEMMs read it: its held copy, or the
    /// stack cast to the compute dtype.
    fn weights(&self, w: &Tensor) -> candle_core::Result<Tensor> {
        match &self.copy {
            Some(copy) => copy.contiguous(),
            None => cast16(&w.detach().contiguous()?, self.compute),
        }
    }

    /// `y[b] = xn[b] · w[e_b]ᵀ` for `xn` `[blocks, cap, k]` in the compute dtype: `[blocks,
    /// cap, n]` in the compute dtype (a 16-bit output rounded once).
    pub(crate) fn forward(&self, xn: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        xn.contiguous()?.apply_op2_no_bwd(
            &self.weights(w)?,
            &PlannedGemm::new(Pass::Forward, &self.map),
        )
    }

    /// `dx[b] = gn[b] · w[e_b]` for the output gradient `gn` in the compute dtype: `[blocks,
    /// cap, k]` in the compute dtype.
    pub(crate) fn input_grad(&self, gn: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        gn.contiguous()?.apply_op2_no_bwd(
            &self.weights(w)?,
            &PlannedGemm::new(Pass::InputGrad, &self.map),
        )
    }

    /// The stack's gradient `dw[e] = Σ_{b: e_b = e} gn[b]ᵀ xn[b]` from the operands `gn` and
    /// `xn` of the weight-gradient plan (of the compute type, or f32 through `FAST_16BF`).
    /// In f32, f32. At a 16-bit compute type it is the gradient at the rounded stack the
    /// forward read, so a 16-bit value, as a 16-bit GEMM writes it: in that dtype by the
    /// GEMMs themselves where one round writes every expert's (no overflow block), else (or
    /// through `FAST_16BF`, whose GEMMs write f32 only) summed in f32 and rounded once; then
    /// widened to the stack's dtype unless `grads` keeps it narrow.
    pub(crate) fn weight_grad(
        &self,
        gn: &Tensor,
        xn: &Tensor,
        w: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let plan = match self.fast16bf {
            true => PlannedGemm::fast(Pass::WeightGrad, &self.map),
            false => PlannedGemm::new(Pass::WeightGrad, &self.map),
        };
        let (g, x) = (gn.contiguous()?, xn.contiguous()?);
        let c = self.compute;
        if c == DType::F32 {
            return cast16(&g.apply_op2_no_bwd(&x, &plan)?, w.dtype());
        }
        // FAST_16BF's GEMMs write f32 only.
        let dw = if self.fast16bf || GemmPlan::new(Pass::WeightGrad, &self.map).accumulates() {
            cast16(&g.apply_op2_no_bwd(&x, &plan)?, c)?
        } else {
            g.apply_op2_no_bwd(&x, &plan.writing_weight_grad_in(c))?
        };
        match self.grads {
            WeightGradients::Narrow => Ok(dw),
            WeightGradients::InWeightDtype => cast16(&dw, w.dtype()),
        }
    }
}

/// An f32 tensor rounded to bf16 (nearest, ties to even) and widened back: the forward's
/// rounding op ([`RoundTo`], one kernel on a GPU), nothing to differentiate.
fn round_bf16(t: &Tensor) -> candle_core::Result<Tensor> {
    t.apply_op1_no_bwd(&RoundTo {
        narrow: DType::BF16,
    })
}

/// The differentiable op: its value precomputed, its backward two planned GEMM passes.
#[derive(Debug)]
struct ExpertBlocksMatmul {
    value: Precomputed,
    gemms: BlockGemms,
}

impl CustomOp2 for ExpertBlocksMatmul {
    fn name(&self) -> &'static str {
        "expert-blocks-matmul"
    }

    precomputed_fwd!(2);

    /// `dx[b] = g[b] · w[e_b]` (rounded to the compute type, as the forward's output) and
    /// `dw[e] = Σ_{b: e_b = e} g[b]ᵀ x[b]` ([`BlockGemms::weight_grad`]).
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        if self.gemms.fast16bf {
            return self.fast16bf_bwd(x, w, grad);
        }
        let c = self.gemms.compute;
        let gn = cast16(&grad.detach().contiguous()?, c)?;
        let dx = if x.track_op() {
            Some(cast16(&self.gemms.input_grad(&gn, w)?, DType::F32)?)
        } else {
            None
        };
        let dw = if w.track_op() {
            let xn = cast16(&x.detach().contiguous()?, c)?;
            Some(self.gemms.weight_grad(&gn, &xn, w)?)
        } else {
            None
        };
        Ok((dx, dw))
    }
}

impl ExpertBlocksMatmul {
    /// The backward on f32 operands through `FAST_16BF`: `dx` rounded to bf16 (the cast
    /// path's GEMM writes it in bf16), `dw` as the cast path's ([`BlockGemms::weight_grad`]).
    fn fast16bf_bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.detach().contiguous()?;
        let dx = if x.track_op() {
            let w = w.detach().contiguous()?;
            let dx =
                g.apply_op2_no_bwd(&w, &PlannedGemm::fast(Pass::InputGrad, &self.gemms.map))?;
            Some(round_bf16(&dx)?)
        } else {
            None
        };
        let dw = if w.track_op() {
            Some(self.gemms.weight_grad(&g, &x.detach().contiguous()?, w)?)
        } else {
            None
        };
        Ok((dx, dw))
    }
}

#[cfg(test)]
mod tests {
    use super::plan::{BlockMap, GemmPlan, Pass, PlannedGemm};
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::{Device, Var};

    /// The blocks of a padded layout over 3 experts: main blocks 0, 1, 2, then overflow
    /// blocks of expert 2 (three) and expert 0 (one).
    pub(super) const EXPERTS: [u32; 7] = [0, 1, 2, 2, 2, 2, 0];
    const CAST: ExpertGemmInputs = ExpertGemmInputs::Cast;
    const WIDE: WeightGradients = WeightGradients::InWeightDtype;

    #[test]
    fn expert_gemm_inputs_parse_back_and_others_are_refused() {
        for inputs in [ExpertGemmInputs::Cast, ExpertGemmInputs::Fast16bf] {
            assert_eq!(
                inputs.to_string().parse::<ExpertGemmInputs>().ok(),
                Some(inputs)
            );
        }
        let err = "tf32".parse::<ExpertGemmInputs>().expect_err("not a mode");
        assert!(err.to_string().contains("cast or fast16bf"), "{err}");
    }

    /// The GPU's differentiable op, run on the host plans: value and both gradients equal
    /// the gathered-weights composition's (the backward's two passes wired to the right
    /// operands, the weight gradient summed over an expert's main and overflow blocks).
    #[test]
    fn the_in_place_op_has_the_compositions_gradients() {
        let case = OpCase::new();
        let (x, w) = (&case.x, &case.w);
        let got = in_place_matmul(
            x,
            w,
            BlockGemms::planned(case.map.clone(), DType::F32, false, None, WIDE),
        )
        .expect("op");
        let want = expert_blocks_matmul(Precision::F32, x, w, None, &EXPERTS, CAST, WIDE)
            .expect("composed");
        assert!(max_abs_diff(&got, &want) < 1e-5, "value");
        for (name, (a, b)) in ["dx", "dw"]
            .iter()
            .zip(case.grads(&got).iter().zip(&case.grads(&want)))
        {
            assert!(max_abs_diff(a, b) < 1e-4, "{name}");
        }
    }

    /// The `FAST_16BF` op, run on the host plans (operands rounded to bf16 first): its value
    /// and input gradient are the bf16 composition's (rounded operands, f32 sums, rounded
    /// output) to within the order of the sums; so is its weight gradient, rounded to bf16
    /// as the composition's and the cast path's.
    #[test]
    fn the_fast16bf_op_has_the_bf16_compositions_values_and_gradients() {
        let case = OpCase::new();
        let (x, w) = (&case.x, &case.w);
        let got = in_place_matmul(
            x,
            w,
            BlockGemms::planned(case.map.clone(), DType::BF16, true, None, WIDE),
        )
        .expect("op");
        let bf16 = Precision::Bf16 { router_f32: false };
        let want = expert_blocks_matmul(bf16, x, w, None, &EXPERTS, CAST, WIDE).expect("composed");
        // One bf16 step of the largest output at most (sums in another order may round to
        // the neighbouring bf16 value).
        let step = max_abs(&want) / 128.0;
        assert!(max_abs_diff(&got, &want) <= step, "value");
        let is_bf16 = |t: &Tensor| max_abs_diff(&round_bf16(t).expect("round"), t) == 0.0;
        assert!(is_bf16(&got), "the value is rounded to bf16");
        let (got, want) = (case.grads(&got), case.grads(&want));
        assert!(is_bf16(&got[0]), "dx is rounded to bf16");
        assert!(is_bf16(&got[1]), "dw is rounded to bf16");
        for (name, (a, b)) in ["dx", "dw"].iter().zip(got.iter().zip(&want)) {
            let step = max_abs(b) / 128.0;
            assert!(max_abs_diff(a, b) <= step, "{name}");
        }
    }

    /// At a 16-bit precision the op's stack gradient is the gradient at the rounded stack:
    /// the plan's f32 sum over each expert's blocks rounded once to bf16, bit for bit, both
    /// where one round of GEMMs writes it in bf16 (no overflow block) and where the rounds
    /// add in f32 (overflow blocks); within a bf16 step of candle's composition (rounded
    /// operands, f32 products and `index_add`, rounded); kept narrow, the same bits in bf16.
    /// A plan that adds rounds refuses to write them in 16 bits.
    #[test]
    fn the_stacks_gradient_is_its_rounded_sum_in_either_dtype() {
        let (cap, n, k, stack) = (3, 5, 4, 3);
        let bits = crate::test_util::f32_bits;
        let bf16 = |t: &Tensor| cast16(t, DType::BF16).expect("bf16");
        for experts in [&EXPERTS[..], &[2, 0, 1][..]] {
            let blocks = experts.len();
            let x = Var::from_tensor(&seeded_tensor(&[blocks, cap, k], 1, DType::F32)).expect("x");
            let w = Var::from_tensor(&seeded_tensor(&[stack, n, k], 2, DType::F32)).expect("w");
            let probe = seeded_tensor(&[blocks, cap, n], 3, DType::F32);
            let map = BlockMap::new(&x, &w, experts).expect("map");
            let dw = |grads| {
                let y = in_place_matmul(
                    &x,
                    &w,
                    BlockGemms::planned(map.clone(), DType::BF16, false, None, grads),
                )
                .expect("op");
                let g = (&y * &probe)
                    .and_then(|l| l.sum_all())
                    .and_then(|l| l.backward())
                    .expect("backward");
                g.get(&w).expect("dw").clone()
            };
            let (wide, narrow) = (dw(WIDE), dw(WeightGradients::Narrow));
            assert_eq!((wide.dtype(), narrow.dtype()), (DType::F32, DType::BF16));
            let widened = cast16(&narrow, DType::F32).expect("widen");
            assert!(bits(&wide) == bits(&widened), "{experts:?}: narrow = wide");
            let map = Arc::new(map);
            let plan = PlannedGemm::new(Pass::WeightGrad, &map);
            let sum = bf16(&probe)
                .apply_op2_no_bwd(&bf16(&x), &plan)
                .expect("f32 sum");
            let once = cast16(&bf16(&sum), DType::F32).expect("rounded once");
            assert!(
                bits(&wide) == bits(&once),
                "{experts:?}: the sum rounded once"
            );
            let ids = Tensor::from_vec(experts.to_vec(), blocks, &Device::Cpu).expect("ids");
            let rounded = |t: &Tensor| cast16(&bf16(t), DType::F32).expect("rounded");
            let composed = rounded(&probe)
                .transpose(1, 2)
                .and_then(|gt| gt.matmul(&rounded(&x)))
                .and_then(|per_block| {
                    Tensor::zeros((stack, n, k), DType::F32, &Device::Cpu)?
                        .index_add(&ids, &per_block, 0)
                })
                .expect("composed");
            let step = max_abs(&composed) / 128.0;
            assert!(
                max_abs_diff(&wide, &rounded(&composed)) <= step,
                "{experts:?}"
            );
            let in_bf16 = bf16(&probe)
                .apply_op2_no_bwd(&bf16(&x), &plan.clone().writing_weight_grad_in(DType::BF16));
            let accumulates = GemmPlan::new(Pass::WeightGrad, &map).accumulates();
            assert_eq!(accumulates, experts.len() > stack, "{experts:?}");
            match in_bf16 {
                Ok(dw) => {
                    assert!(
                        !accumulates && bits(&cast16(&dw, DType::F32).expect("f32")) == bits(&wide)
                    )
                }
                Err(e) => assert!(accumulates && e.to_string().contains("summed over rounds")),
            }
        }
    }

    /// The GPU's op reading the stack's held bf16 copy, run on the host plans: value and
    /// both gradients bit for bit the op's casting the stack itself; a copy made different
    /// changes the value and the input gradient (both read it), not the weight gradient.
    #[test]
    fn the_in_place_op_reads_a_held_copy_as_its_cast() {
        let case = OpCase::new();
        let (x, w) = (&case.x, &case.w);
        let bits = crate::test_util::f32_bits;
        let run = |copy: Option<&Tensor>| {
            let y = in_place_matmul(
                x,
                w,
                BlockGemms::planned(case.map.clone(), DType::BF16, false, copy, WIDE),
            )
            .expect("op");
            let [dx, dw] = case.grads(&y);
            [bits(&y), bits(&dx), bits(&dw)]
        };
        let cast = run(None);
        let copy = cast16(w.as_tensor(), DType::BF16).expect("copy");
        assert!(run(Some(&copy)) == cast, "the held copy is the cast");
        let other = cast16(&(w.as_tensor() * 0.5).expect("half"), DType::BF16).expect("other");
        let [y, dx, dw] = run(Some(&other));
        assert!(
            y != cast[0] && dx != cast[1],
            "the value and dx read the copy"
        );
        assert!(dw == cast[2], "dw reads no weight");
    }

    /// The in-place op's test case: seeded rows and stack over [`EXPERTS`], a loss probe.
    struct OpCase {
        x: Var,
        w: Var,
        probe: Tensor,
        map: BlockMap,
    }

    impl OpCase {
        fn new() -> Self {
            let (cap, n, k, stack) = (3, 5, 4, 3);
            let x = Var::from_tensor(&seeded_tensor(&[EXPERTS.len(), cap, k], 1, DType::F32))
                .expect("x");
            let w = Var::from_tensor(&seeded_tensor(&[stack, n, k], 2, DType::F32)).expect("w");
            let probe = seeded_tensor(&[EXPERTS.len(), cap, n], 3, DType::F32);
            let map = BlockMap::new(&x, &w, &EXPERTS).expect("map");
            OpCase { x, w, probe, map }
        }

        /// `[dx, dw]` of `sum(y · probe)`.
        fn grads(&self, y: &Tensor) -> [Tensor; 2] {
            let g = (y * &self.probe)
                .and_then(|l| l.sum_all())
                .and_then(|l| l.backward())
                .expect("backward");
            [&self.x, &self.w].map(|v| g.get(v).expect("gradient").clone())
        }
    }

    fn max_abs(t: &Tensor) -> f64 {
        t.abs()
            .and_then(|a| a.flatten_all())
            .and_then(|a| a.max(0))
            .and_then(|a| a.to_scalar::<f32>())
            .expect("max")
            .into()
    }

    /// The differentiable wrapper off a GPU is the gathered-weights product, its gradients
    /// those of the composition; a bad map is an error naming it.
    #[test]
    fn the_wrapper_checks_its_map() {
        let x = Var::from_tensor(&seeded_tensor(&[2, 3, 4], 1, DType::F32)).expect("x");
        let w = Var::from_tensor(&seeded_tensor(&[2, 5, 4], 2, DType::F32)).expect("w");
        let y = expert_blocks_matmul(Precision::F32, &x, &w, None, &[0, 1], CAST, WIDE)
            .expect("identity");
        let want = x
            .matmul(&w.transpose(1, 2).expect("t"))
            .expect("batched matmul");
        assert_eq!(max_abs_diff(&y, &want), 0.0);
        let err = expert_blocks_matmul(Precision::F32, &x, &w, None, &[0, 2], CAST, WIDE)
            .expect_err("expert out of range")
            .to_string();
        assert!(err.contains("expert 2 of a stack of 2"), "{err}");
        assert!(expert_blocks_matmul(Precision::F32, &x, &w, None, &[0], CAST, WIDE).is_err());
    }
}
