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
//! A step routed on the device has its experts only as a device tensor: its GEMMs
//! (`expert_slots_matmul`, one row a slot) take their pointer table from a kernel that reads
//! the ids where they are, so the host never waits for them.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use crate::cast16::cast16;
use crate::error::{ModelError, Result};
#[cfg(any(test, feature = "cuda"))]
use crate::gemm_call::DeviceTableCall;
use crate::gemm_call::{GemmBatch, GemmCall, GemmShape};
use crate::host::contiguous;
use crate::layers::linear::matmul_wt_at;
use crate::layers::precomputed::{precomputed_fwd, Precomputed};
use crate::precision::{Precision, RoundTo, WeightGradients};
use crate::weights::check_narrow_copy;

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

/// `y [slots, 1, n] = x[s / share] · w[ids[s]]ᵀ` for rows `x` `[slots / share, 1, k]` (each
/// row read by `share` consecutive slots: a token's `top_k` slots read its row once each),
/// the stack `w` `[E, n, k]` and the slots' experts `ids` `[slots]` (u32, on the device, each
/// below `E`: the router's own top-k), at precision `p`. On a GPU one batched cuBLAS GEMM
/// whose pointer table a kernel writes from `ids` (`r3_expert_slot_pointers`): the experts'
/// matrices and the rows read in place, the ids never copied to the host. Elsewhere, or with
/// an operand to differentiate, the product of the gathered matrices with the rows repeated.
/// The forward's rounding points either way ([`matmul_wt_at`]).
pub(crate) fn expert_slots_matmul(
    p: Precision,
    x: &Tensor,
    w: &Tensor,
    ids: &Tensor,
) -> Result<Tensor> {
    let share = slots_share(x, w, ids)?;
    let compute = p.narrow_dtype().unwrap_or(DType::F32);
    // The pointer GEMM has no backward: a differentiated operand takes the gathered form.
    if reads_weights_in_place(x, w, compute) {
        if let Some(y) = slots_gemm(x, w, ids, compute, share)? {
            return Ok(cast16(&y, DType::F32)?);
        }
    }
    let (rows, _, k) = x.dims3()?;
    let slots = ids.elem_count();
    let repeated = if share == 1 {
        x.clone()
    } else {
        x.broadcast_as((rows, share, k))?
            .contiguous()?
            .reshape((slots, 1, k))?
    };
    matmul_wt_at(
        p,
        &repeated,
        &w.index_select(ids, 0)?,
        None,
        WeightGradients::InWeightDtype,
    )
}

/// [`expert_slots_matmul`]'s pointer GEMM on a GPU with its output left in `compute` (the
/// 16-bit float of a mixed precision, or f32), its rows `x` f32 or already in `compute`:
/// the same values as the f32 form before its widening, for a chain of ops that read the
/// 16-bit output as it is (a device-routed decode step's experts: no widen and narrow pair
/// between the GEMMs and the SwiGLU). None where it does not apply (not a GPU, an operand
/// to differentiate, no slots, the stack in another dtype).
pub(crate) fn expert_slots_matmul_narrow(
    x: &Tensor,
    w: &Tensor,
    ids: &Tensor,
    compute: DType,
) -> Result<Option<Tensor>> {
    let share = slots_share(x, w, ids)?;
    slots_gemm(x, w, ids, compute, share)
}

/// The pointer GEMM of `share`-slot rows (operands checked by [`slots_share`]), its output
/// in `compute`; None where it does not apply (not a GPU, operands in another dtype, one
/// empty or differentiated).
fn slots_gemm(
    x: &Tensor,
    w: &Tensor,
    ids: &Tensor,
    compute: DType,
    share: usize,
) -> Result<Option<Tensor>> {
    let applies = x.device().is_cuda()
        && (x.dtype() == DType::F32 || x.dtype() == compute)
        && (w.dtype() == DType::F32 || w.dtype() == compute)
        && x.elem_count() > 0
        && w.elem_count() > 0
        && ids.elem_count() > 0
        && !x.track_op()
        && !w.track_op();
    if !applies {
        return Ok(None);
    }
    let xn = cast16(&x.contiguous()?, compute)?;
    let wn = cast16(&w.contiguous()?, compute)?;
    Ok(Some(xn.apply_op3_no_bwd(
        &wn,
        &ids.contiguous()?,
        &SlotsGemm { share },
    )?))
}

/// The slots a row of `x` `[rows, 1, k]` is read by, with `x`, the stack `w` `[E, n, k]` and
/// the slots' experts `ids` `[slots]` (u32) checked against each other.
fn slots_share(x: &Tensor, w: &Tensor, ids: &Tensor) -> Result<usize> {
    let (rows, one, k) = x.dims3()?;
    let (_, _, k2) = w.dims3()?;
    let slots = ids.elem_count();
    let share = slots.checked_div(rows).unwrap_or(0);
    if one != 1
        || k2 != k
        || ids.dims() != [slots]
        || ids.dtype() != DType::U32
        || share * rows != slots
    {
        return Err(ModelError::Input(format!(
            "expert slots: input {:?}, stacked weights {:?} and ids {:?} ({:?}) are not \
             [rows, 1, k], [E, n, k] and [slots] u32 with slots a multiple of rows",
            x.dims(),
            w.dims(),
            ids.dims(),
            ids.dtype()
        )));
    }
    Ok(share)
}

/// The slots' GEMM as an op over (rows, stack, ids), all on a GPU: `share` consecutive
/// slots read one row.
#[derive(Debug, Clone, Copy)]
struct SlotsGemm {
    share: usize,
}

impl CustomOp3 for SlotsGemm {
    fn name(&self) -> &'static str {
        "expert-slots-gemm"
    }

    /// The host twin: [`SlotsLayout::call`] for the ids, run by the plain column-major
    /// GEMM, written in the operands' dtype (a 16-bit output rounded once) as cuBLAS does.
    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sids: &CpuStorage,
        lids: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let what = "expert slots gemm on the host";
        let layout = SlotsLayout::of(lx, lw, lids, self.share)?;
        let ((x, x_dtype), (w, w_dtype)) =
            (host_values(sx, lx, "rows")?, host_values(sw, lw, "stack")?);
        if x_dtype != w_dtype {
            candle_core::bail!("{what}: operands {x_dtype:?} and {w_dtype:?}");
        }
        let CpuStorage::U32(ids) = sids else {
            candle_core::bail!("{what}: the ids must be u32");
        };
        let mut y = vec![0f32; layout.slots * layout.n];
        let [a, b] = SlotsLayout::operands(&x, &w);
        layout
            .call(contiguous(ids, lids, "ids")?)?
            .run_host(a, b, &mut y, what)?;
        Ok((host_storage(y, x_dtype, what)?, layout.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
        sids: &candle_core::CudaStorage,
        lids: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let layout = SlotsLayout::of(lx, lw, lids, self.share)?;
        let out = cuda::run_slots(sx, lx, sw, lw, sids, lids, layout)?;
        Ok((out, layout.out_shape()))
    }
}

/// Where the slots' pointer GEMM reads and writes: slot `s` multiplies row `s / share` of
/// the rows `[slots / share, 1, k]` by its expert's `[n, k]` of the stack `[stack, n, k]`,
/// transposed, into row `s` of the output `[slots, 1, n]`. On a GPU `r3_expert_slot_pointers`
/// writes each slot's addresses at [`SlotsLayout::steps`] from the ids where they lie;
/// [`SlotsLayout::call`] is the same call for host ids (the host twin, the tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SlotsLayout {
    slots: usize,
    stack: usize,
    n: usize,
    k: usize,
    share: usize,
}

impl SlotsLayout {
    /// The layout of rows, stack and ids laid out as `lx`, `lw` and `lids`, `share` slots a
    /// row, or an error naming what does not fit.
    fn of(lx: &Layout, lw: &Layout, lids: &Layout, share: usize) -> candle_core::Result<Self> {
        let slots = lids.shape().elem_count();
        let fits = match (lx.shape().dims3(), lw.shape().dims3()) {
            (Ok((rows, 1, k)), Ok((stack, n, k2))) if k2 == k && stack > 0 && share > 0 => {
                (rows.checked_mul(share) == Some(slots)).then_some((stack, n, k))
            }
            _ => None,
        };
        let Some((stack, n, k)) = fits else {
            candle_core::bail!(
                "expert slots gemm: rows {:?}, stack {:?} and {slots} ids at {share} slots a row \
                 are not [slots / share, 1, k] and [E ≥ 1, n, k]",
                lx.dims(),
                lw.dims()
            );
        };
        Ok(SlotsLayout {
            slots,
            stack,
            n,
            k,
            share,
        })
    }

    /// The output's shape, `[slots, 1, n]`.
    fn out_shape(&self) -> Shape {
        Shape::from((self.slots, 1, self.n))
    }

    /// The GEMM of each slot, A the stack and B the rows:
    /// `yᵀ (n × 1) = (w_e: k × n col-major)ᵀ · (x_rowᵀ: k × 1)`.
    fn shape(&self) -> GemmShape {
        GemmShape {
            trans_a: true,
            trans_b: false,
            m: self.n,
            n: 1,
            k: self.k,
            lda: self.k,
            ldb: self.k,
            ldc: self.n,
        }
    }

    /// cuBLAS's A and B from the rows and the stack: A the stack, B the rows (the host twin
    /// and the GPU both take them from here, the kernel's table too).
    fn operands<T>(rows: T, stack: T) -> [T; 2] {
        [stack, rows]
    }

    /// Elements from one expert's matrices to the next, one row to the next, one output row
    /// to the next: the kernel's steps (in bytes there).
    fn steps(&self) -> [usize; 3] {
        [self.n * self.k, self.k, self.n]
    }

    /// The call for `ids` (one a slot), at the offsets the kernel writes: an id past the
    /// stack, which no router gives, reads expert 0 there and here.
    fn call(&self, ids: &[u32]) -> candle_core::Result<GemmCall> {
        if ids.len() != self.slots {
            candle_core::bail!(
                "expert slots gemm: {} ids for {} slots",
                ids.len(),
                self.slots
            );
        }
        let [a, b, c] = self.steps();
        let offsets = ids
            .iter()
            .enumerate()
            .map(|(s, &e)| {
                let e = if (e as usize) < self.stack {
                    e as usize
                } else {
                    0
                };
                [e * a, s / self.share * b, s * c]
            })
            .collect();
        Ok(GemmCall {
            shape: self.shape(),
            batch: GemmBatch::Offsets(offsets),
            accumulate: false,
        })
    }

    /// The call as a GPU checks it before the kernel writes its table: `slots` GEMMs, the
    /// `s`-th output `n` elements on, none further into the stack than the last expert, into
    /// the rows than the last row or into the output than the last slot.
    #[cfg(any(test, feature = "cuda"))]
    fn table_call(&self) -> DeviceTableCall {
        let [a, b, c] = self.steps();
        let last = self.slots.saturating_sub(1);
        DeviceTableCall {
            shape: self.shape(),
            count: self.slots,
            furthest: [(self.stack - 1) * a, last / self.share * b, last * c],
            c_step: c,
        }
    }
}

/// The blocks' shapes and experts, checked against the operands.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BlockMap {
    /// The expert of each block.
    experts: Vec<u32>,
    /// Experts in the stack (`E`).
    stack: usize,
    /// Rows per block.
    cap: usize,
    /// Output columns (`n`) and the shared inner size (`k`).
    n: usize,
    k: usize,
}

impl BlockMap {
    fn new(x: &Tensor, w: &Tensor, experts: &[u32]) -> Result<Self> {
        Self::of_shape(x.dims(), w, experts)
    }

    /// The map of input blocks of shape `x` `[blocks, cap, k]` by the stack `w`.
    fn of_shape(x: &[usize], w: &Tensor, experts: &[u32]) -> Result<Self> {
        let shape_error = || {
            ModelError::Input(format!(
                "expert blocks: input {x:?} and stacked weights {:?} are not [blocks, cap, k] and [E, n, k] with {} blocks",
                w.dims(),
                experts.len()
            ))
        };
        let &[blocks, cap, k] = x else {
            return Err(shape_error());
        };
        let (stack, n, k2) = w.dims3().map_err(|_| shape_error())?;
        if k2 != k || blocks != experts.len() {
            return Err(shape_error());
        }
        if let Some(&bad) = experts.iter().find(|&&e| e as usize >= stack) {
            return Err(ModelError::Input(format!(
                "expert blocks: expert {bad} of a stack of {stack}"
            )));
        }
        let fits = |v: usize| i32::try_from(v).is_ok();
        if !(fits(n) && fits(k) && fits(cap.saturating_mul(blocks)) && fits(blocks)) {
            return Err(ModelError::Input(format!(
                "expert blocks: {blocks} blocks of {cap} × {k} by {n} exceed a 32-bit GEMM size"
            )));
        }
        Ok(BlockMap {
            experts: experts.to_vec(),
            stack,
            cap,
            n,
            k,
        })
    }
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

/// Which product a plan computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// `(x, w) → y [blocks, cap, n]`.
    Forward,
    /// `(g, w) → dx [blocks, cap, k]`.
    InputGrad,
    /// `(g, x) → dw [E, n, k]`, in f32 or written once in a 16-bit float.
    WeightGrad,
}

/// The GEMMs of one pass, in the order they must run, and the output's size.
#[derive(Debug, Clone, PartialEq, Eq)]
struct GemmPlan {
    calls: Vec<GemmCall>,
    /// Elements of the output.
    out_len: usize,
    /// The output must start zeroed (an expert of the stack has no block, so no GEMM
    /// writes its gradient).
    zeroed: bool,
}

impl GemmPlan {
    /// Whether a later round adds into what an earlier one wrote (an expert's overflow
    /// blocks: its gradient is a sum of GEMM outputs, which must be kept in f32).
    fn accumulates(&self) -> bool {
        self.calls.iter().any(|c| c.accumulate)
    }

    /// The plan of `pass` over these blocks. Row-major operands seen column-major are
    /// transposed, so `y = x wᵀ` is the column-major `yᵀ = w xᵀ`, and so on.
    fn new(pass: Pass, map: &BlockMap) -> Self {
        let (cap, n, k) = (map.cap, map.n, map.k);
        let blocks = map.experts.len();
        match pass {
            Pass::Forward | Pass::InputGrad => {
                let (shape, in_width, out_width) = if pass == Pass::Forward {
                    // yᵀ (n × cap) = (w_e: k × n col-major)ᵀ · (xᵀ: k × cap)
                    let s = GemmShape {
                        trans_a: true,
                        trans_b: false,
                        m: n,
                        n: cap,
                        k,
                        lda: k,
                        ldb: k,
                        ldc: n,
                    };
                    (s, k, n)
                } else {
                    // dxᵀ (k × cap) = (w_e: k × n col-major) · (gᵀ: n × cap)
                    let s = GemmShape {
                        trans_a: false,
                        trans_b: false,
                        m: k,
                        n: cap,
                        k: n,
                        lda: k,
                        ldb: n,
                        ldc: k,
                    };
                    (s, n, k)
                };
                let offsets = map
                    .experts
                    .iter()
                    .enumerate()
                    .map(|(b, &e)| [e as usize * n * k, b * cap * in_width, b * cap * out_width])
                    .collect();
                GemmPlan {
                    calls: vec![GemmCall {
                        shape,
                        batch: GemmBatch::Offsets(offsets),
                        accumulate: false,
                    }],
                    out_len: blocks * cap * out_width,
                    zeroed: false,
                }
            }
            Pass::WeightGrad => Self::weight_grad(map),
        }
    }

    /// `dwᵀ (k × n) = (xᵀ: k × rows) · (gᵀ: n × rows)ᵀ` per run of consecutive blocks of one
    /// expert (their rows are contiguous, so a run is one GEMM over `len · cap` rows). The
    /// `r`-th run of every expert forms round `r`; a round's runs are distinct experts, so
    /// they run side by side, batched by run length; round 0 writes, later rounds add.
    fn weight_grad(map: &BlockMap) -> Self {
        let (cap, n, k) = (map.cap, map.n, map.k);
        // (expert, first block, blocks) of each run, in block order.
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        for (b, &e) in map.experts.iter().enumerate() {
            match runs.last_mut() {
                Some(run) if run.0 == e as usize && run.1 + run.2 == b => run.2 += 1,
                _ => runs.push((e as usize, b, 1)),
            }
        }
        let mut round_of_run = Vec::with_capacity(runs.len());
        let mut seen = vec![0usize; map.stack];
        for &(e, _, _) in &runs {
            round_of_run.push(seen[e]);
            seen[e] += 1;
        }
        let rounds = seen.iter().copied().max().unwrap_or(0);
        let mut calls = Vec::new();
        for round in 0..rounds {
            let mut lengths: Vec<usize> = runs
                .iter()
                .zip(&round_of_run)
                .filter(|(_, &r)| r == round)
                .map(|(run, _)| run.2)
                .collect();
            lengths.sort_unstable();
            lengths.dedup();
            for len in lengths {
                let offsets = runs
                    .iter()
                    .zip(&round_of_run)
                    .filter(|(run, &r)| r == round && run.2 == len)
                    .map(|(&(e, first, _), _)| [first * cap * k, first * cap * n, e * n * k])
                    .collect();
                calls.push(GemmCall {
                    shape: GemmShape {
                        trans_a: false,
                        trans_b: true,
                        m: k,
                        n,
                        k: len * cap,
                        lda: k,
                        ldb: n,
                        ldc: k,
                    },
                    batch: GemmBatch::Offsets(offsets),
                    accumulate: round > 0,
                });
            }
        }
        GemmPlan {
            calls,
            out_len: map.stack * n * k,
            zeroed: seen.contains(&0),
        }
    }

    /// The plan run by a plain column-major GEMM on host slices (f32 accumulation): the
    /// CPU twin of the cuBLAS calls, each call checked against the operands' lengths first
    /// as on a GPU.
    fn run_host(&self, a: &[f32], b: &[f32]) -> candle_core::Result<Vec<f32>> {
        let mut c = vec![0f32; self.out_len];
        for call in &self.calls {
            call.run_host(a, b, &mut c, "expert blocks gemm on the host")?;
        }
        Ok(c)
    }
}

/// The output shape of `pass` over `map`.
fn out_shape(pass: Pass, map: &BlockMap) -> Shape {
    let blocks = map.experts.len();
    match pass {
        Pass::Forward => Shape::from((blocks, map.cap, map.n)),
        Pass::InputGrad => Shape::from((blocks, map.cap, map.k)),
        Pass::WeightGrad => Shape::from((map.stack, map.n, map.k)),
    }
}

/// cuBLAS's A and B of a plan from the op's two operands: A is the second (the stack, or the
/// input rows of the weight gradient) and B the first, in every pass. The host twin and the
/// GPU both take them from here, so the host tests check the order a GPU is given.
fn plan_operands<T>(first: T, second: T) -> [T; 2] {
    [second, first]
}

/// One pass's GEMMs as a no-gradient op over its two operands (both of the compute type, or
/// both f32 for `FAST_16BF`).
#[derive(Debug, Clone)]
struct PlannedGemm {
    pass: Pass,
    map: Arc<BlockMap>,
    /// f32 operands converted to bf16 inside cuBLAS (`CUBLAS_COMPUTE_32F_FAST_16BF`), f32
    /// output.
    fast16bf: bool,
    /// The dtype the weight gradient is written in: f32, or a 16-bit float (each value
    /// rounded once from the f32 sum; only a plan that never accumulates).
    weight_grad: DType,
}

impl PlannedGemm {
    fn new(pass: Pass, map: &Arc<BlockMap>) -> Self {
        PlannedGemm {
            pass,
            map: Arc::clone(map),
            fast16bf: false,
            weight_grad: DType::F32,
        }
    }

    /// The pass writing the weight gradient in `dtype`.
    fn writing_weight_grad_in(self, dtype: DType) -> Self {
        PlannedGemm {
            weight_grad: dtype,
            ..self
        }
    }

    /// The dtype of the output, given the operands': theirs, the weight gradient's own
    /// (refused in 16 bits where the plan adds rounds: a sum rounded twice).
    fn out_dtype(&self, plan: &GemmPlan, operands: DType) -> candle_core::Result<DType> {
        if self.pass != Pass::WeightGrad {
            return Ok(operands);
        }
        if self.weight_grad != DType::F32 && plan.accumulates() {
            candle_core::bail!(
                "expert blocks gemm: a weight gradient summed over rounds is written in f32, \
                 not {:?}",
                self.weight_grad
            );
        }
        Ok(self.weight_grad)
    }

    /// The pass on f32 operands through `FAST_16BF`.
    fn fast(pass: Pass, map: &Arc<BlockMap>) -> Self {
        PlannedGemm {
            fast16bf: true,
            ..Self::new(pass, map)
        }
    }

    /// Refuses operands whose shapes are not the ones the plan was made for: its GEMMs read
    /// and write at the plan's offsets, so on a GPU a smaller operand would be read past
    /// its end without a word (the host twin would panic on the index).
    fn check_operands(&self, first: &Layout, second: &Layout) -> candle_core::Result<()> {
        let map = &self.map;
        let blocks = map.experts.len();
        let (want_first, want_second) = match self.pass {
            Pass::Forward => ([blocks, map.cap, map.k], [map.stack, map.n, map.k]),
            Pass::InputGrad => ([blocks, map.cap, map.n], [map.stack, map.n, map.k]),
            Pass::WeightGrad => ([blocks, map.cap, map.n], [blocks, map.cap, map.k]),
        };
        if first.dims() != want_first || second.dims() != want_second {
            candle_core::bail!(
                "expert blocks gemm ({:?}): operands {:?} and {:?}, planned for {want_first:?} \
                 and {want_second:?}",
                self.pass,
                first.dims(),
                second.dims()
            );
        }
        Ok(())
    }
}

impl CustomOp2 for PlannedGemm {
    fn name(&self) -> &'static str {
        "expert-blocks-gemm"
    }

    /// The host twin, f32 only (the tests' path); `FAST_16BF`'s twin rounds the operands to
    /// bf16 first (nearest, ties to even: what r3 requires of cuBLAS's conversion).
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.check_operands(l1, l2)?;
        let plan = GemmPlan::new(self.pass, &self.map);
        let [(sa, la), (sb, lb)] = plan_operands((s1, l1), (s2, l2));
        let ((a, a_dtype), (b, b_dtype)) = (host_values(sa, la, "A")?, host_values(sb, lb, "B")?);
        if a_dtype != b_dtype || (self.fast16bf && a_dtype != DType::F32) {
            candle_core::bail!(
                "expert blocks gemm on the host: operands {a_dtype:?} and {b_dtype:?} (one \
                 dtype; f32 for FAST_16BF)"
            );
        }
        let out = if self.fast16bf {
            let bf16 = |v: &[f32]| -> Vec<f32> {
                v.iter()
                    .map(|&x| half::bf16::from_f32(x).to_f32())
                    .collect()
            };
            plan.run_host(&bf16(&a), &bf16(&b))?
        } else {
            plan.run_host(&a, &b)?
        };
        // As cuBLAS writes it: in the operands' dtype, the weight gradient in its own.
        let dtype = self.out_dtype(&plan, a_dtype)?;
        let out = host_storage(out, dtype, "expert blocks gemm on the host")?;
        Ok((out, out_shape(self.pass, &self.map)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        self.check_operands(l1, l2)?;
        let plan = GemmPlan::new(self.pass, &self.map);
        let [(sa, la), (sb, lb)] = plan_operands((s1, l1), (s2, l2));
        let out_dtype = self.out_dtype(&plan, sa.dtype())?;
        let out = cuda::run_plan(&plan, out_dtype, sa, la, sb, lb, self.fast16bf)?;
        Ok((out, out_shape(self.pass, &self.map)))
    }
}

/// A host GEMM's f32 output written in `dtype` as cuBLAS writes an output of that type (a
/// 16-bit value rounded once, to nearest, ties to even).
fn host_storage(out: Vec<f32>, dtype: DType, what: &str) -> candle_core::Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(out),
        DType::BF16 => CpuStorage::BF16(out.iter().map(|&v| half::bf16::from_f32(v)).collect()),
        DType::F16 => CpuStorage::F16(out.iter().map(|&v| half::f16::from_f32(v)).collect()),
        other => candle_core::bail!("{what}: {other:?} output"),
    })
}

/// The contiguous elements of a host operand as f32 (bf16 and f16 widened, exactly), and
/// its dtype.
fn host_values<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<(std::borrow::Cow<'a, [f32]>, DType)> {
    use std::borrow::Cow;
    Ok(match s {
        CpuStorage::F32(v) => (Cow::Borrowed(contiguous(v, l, what)?), DType::F32),
        CpuStorage::BF16(v) => (
            Cow::Owned(contiguous(v, l, what)?.iter().map(|x| x.to_f32()).collect()),
            DType::BF16,
        ),
        CpuStorage::F16(v) => (
            Cow::Owned(contiguous(v, l, what)?.iter().map(|x| x.to_f32()).collect()),
            DType::F16,
        ),
        _ => candle_core::bail!("expert blocks gemm on the host takes f32, bf16 or f16 {what}"),
    })
}

/// The plans on cuBLAS.
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
    use candle_core::{CudaStorage, DType, Layout};

    use super::{GemmPlan, SlotsLayout};
    use crate::cuda::gemm::{self, GemmCompute, GemmOperand};

    /// Runs `plan` with A = `(sa, la)` and B = `(sb, lb)` (one dtype), into a fresh output
    /// of `out_dtype` (the operands' for the forward and input gradient; the weight
    /// gradient's own), each call checked against the operands' lengths. With `fast16bf`
    /// the operands are f32 and cuBLAS converts them to bf16 itself
    /// (`CUBLAS_COMPUTE_32F_FAST_16BF`).
    pub(super) fn run_plan(
        plan: &GemmPlan,
        out_dtype: DType,
        sa: &CudaStorage,
        la: &Layout,
        sb: &CudaStorage,
        lb: &Layout,
        fast16bf: bool,
    ) -> candle_core::Result<CudaStorage> {
        let what = "expert blocks gemm";
        let dev = sa.device().clone();
        let stream = dev.cuda_stream();
        let compute = match fast16bf {
            true => GemmCompute::Fast16bf,
            false => GemmCompute::F32,
        };
        let (a, _read_a) = crate::cuda::gemm_operand(sa, la, &stream, what)?;
        let (b, _read_b) = crate::cuda::gemm_operand(sb, lb, &stream, what)?;
        macro_rules! alloc {
            ($t:ty) => {
                if plan.zeroed {
                    dev.alloc_zeros::<$t>(plan.out_len)?
                } else {
                    // SAFETY: without `zeroed` the plan's first GEMMs write every element.
                    unsafe { dev.alloc::<$t>(plan.out_len)? }
                }
            };
        }
        macro_rules! run {
            ($t:ty) => {{
                let mut out = alloc!($t);
                {
                    let (c0, _write) = out.device_ptr_mut(&stream);
                    let c = GemmOperand {
                        addr: c0,
                        len: plan.out_len,
                        dtype: out_dtype,
                    };
                    for call in &plan.calls {
                        gemm::run(&dev, call, [a, b, c], compute, what)?;
                    }
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        Ok(match out_dtype {
            DType::F32 => run!(f32),
            DType::BF16 => run!(half::bf16),
            DType::F16 => run!(half::f16),
            other => candle_core::bail!("{what}: {other:?} output"),
        })
    }

    /// [`super::SlotsGemm`]: row `s / share` `[1, k]` of `sx` times expert `ids[s]`'s `[n, k]`
    /// of the stack `sw`, transposed, into row `s` of a fresh `[slots, 1, n]` output of the
    /// operands' dtype. The table call (`SlotsLayout::table_call`: the furthest GEMM any
    /// table holds) is checked against the operands, then a kernel writes the pointer table
    /// from the ids on the device (at `layout`'s steps) and one `cublasGemmBatchedEx` of
    /// `layout`'s shape reads it.
    pub(super) fn run_slots(
        sx: &CudaStorage,
        lx: &Layout,
        sw: &CudaStorage,
        lw: &Layout,
        sids: &CudaStorage,
        lids: &Layout,
        layout: SlotsLayout,
    ) -> candle_core::Result<CudaStorage> {
        let what = "expert slots gemm";
        let dev = sx.device().clone();
        let stream = dev.cuda_stream();
        let table_call = layout.table_call();
        let (slots, n) = (layout.slots, layout.n);
        let int = |v: usize| {
            u32::try_from(v)
                .map_err(|_| candle_core::Error::Msg(format!("{what}: {v} exceeds a 32-bit size")))
        };
        let (slots32, stack32, share32) = (int(slots)?, int(layout.stack)?, int(layout.share)?);
        let (x, _read_x) = crate::cuda::gemm_operand(sx, lx, &stream, what)?;
        let (w, _read_w) = crate::cuda::gemm_operand(sw, lw, &stream, what)?;
        let [a, b] = SlotsLayout::operands(x, w);
        let ids = crate::cuda::view::<u32>(sids, lids, "expert ids")?;
        if ids.len() != slots {
            candle_core::bail!("{what}: {} ids for {slots} slots", ids.len());
        }
        if a.dtype != b.dtype {
            candle_core::bail!("{what}: operands {:?} and {:?}", a.dtype, b.dtype);
        }
        // Before the kernel writes the table (and again by `run_device_table`, its contract).
        table_call.check_within([a.len, b.len, slots * n], what)?;
        let size = x.dtype.size_in_bytes() as u64;
        let [a_step, b_step, c_step] = layout.steps().map(|step| step as u64 * size);
        macro_rules! run {
            ($t:ty) => {{
                // SAFETY: one GEMM per slot writes its whole output row.
                let mut out = unsafe { dev.alloc::<$t>(slots * n)? };
                {
                    let (y0, _write_y) = out.device_ptr_mut(&stream);
                    let y = GemmOperand {
                        addr: y0,
                        len: slots * n,
                        dtype: x.dtype,
                    };
                    // SAFETY: the kernel writes all 3 · slots pointers.
                    let mut table = unsafe { dev.alloc::<u64>(3 * slots)? };
                    let (func, kernel_stream) =
                        crate::cuda::kernel(&dev, "r3_expert_slot_pointers")?;
                    let mut launch = crate::cuda::CheckedLaunch::new(
                        &kernel_stream,
                        &func,
                        "r3_expert_slot_pointers",
                    );
                    launch
                        .arg(&ids)
                        .arg(&mut table)
                        .arg(&slots32)
                        .arg(&stack32)
                        .arg(&a.addr)
                        .arg(&a_step)
                        .arg(&b.addr)
                        .arg(&b_step)
                        .arg(&share32)
                        .arg(&y0)
                        .arg(&c_step);
                    // SAFETY: the arguments are the kernel's signature; the ids view holds
                    // `slots` ids and the table 3 · slots pointers.
                    unsafe { launch.launch(crate::cuda::elementwise(slots)) }?;
                    let (table_ptr, _sync) = table.device_ptr(&stream);
                    // SAFETY: the kernel writes slot `s`'s pointers at `layout`'s offsets
                    // for its id (an id past the stack read as expert 0): no further into
                    // any operand than `table_call`'s furthest GEMM, its C at `s · n`, as
                    // `run_device_table` checks against the operands.
                    unsafe {
                        gemm::run_device_table(
                            &dev,
                            &table_call,
                            [a, b, y],
                            GemmCompute::F32,
                            table_ptr,
                            what,
                        )
                    }?;
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        Ok(match x.dtype {
            DType::F32 => run!(f32),
            DType::BF16 => run!(half::bf16),
            DType::F16 => run!(half::f16),
            other => candle_core::bail!("{what}: {other:?} operands"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::{Device, Var};

    /// The blocks of a padded layout over 3 experts: main blocks 0, 1, 2, then overflow
    /// blocks of expert 2 (three) and expert 0 (one).
    const EXPERTS: [u32; 7] = [0, 1, 2, 2, 2, 2, 0];
    const CAST: ExpertGemmInputs = ExpertGemmInputs::Cast;
    const WIDE: WeightGradients = WeightGradients::InWeightDtype;

    /// A `[d0, d1, ..]` f32 tensor of small integers (-3..=3): every product and sum of
    /// these GEMMs is exact in f32 and bf16, so any summation order gives the same bits.
    fn small_ints(dims: &[usize], seed: usize) -> Tensor {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 5 + seed * 11) % 7) as f32 - 3.0)
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).expect("tensor")
    }

    /// The slots' pointer GEMM as a GPU is given it (`SlotsLayout::call`: the stack as
    /// cuBLAS's A, the rows as its B, the offsets `r3_expert_slot_pointers` writes), run by
    /// the op's host twin, is the gathered experts' product with each row repeated for its
    /// slots — what `expert_slots_matmul` computes off a GPU — bit for bit, in f32, bf16 and
    /// f16, for one, two and four slots a row, in the operands' dtype. A swapped operand,
    /// transpose, step or row share reads other elements.
    #[test]
    fn the_slots_call_is_the_gathered_product() {
        let (stack, n, k) = (5, 6, 7);
        let w = small_ints(&[stack, n, k], 1);
        for share in [1, 2, 4] {
            let rows = 3;
            let slots = rows * share;
            let x = small_ints(&[rows, 1, k], share);
            let ids: Vec<u32> = (0..slots)
                .map(|s| ((s * 3 + share) % stack) as u32)
                .collect();
            let ids = Tensor::from_vec(ids, slots, &Device::Cpu).expect("ids");
            let repeated = x
                .broadcast_as((rows, share, k))
                .and_then(|t| t.contiguous())
                .and_then(|t| t.reshape((slots, 1, k)))
                .expect("repeated rows");
            let gathered = w.index_select(&ids, 0).expect("gather");
            let want = repeated.matmul(&gathered.t().expect("t")).expect("product");
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let (xd, wd) = (x.to_dtype(dtype).expect("x"), w.to_dtype(dtype).expect("w"));
                let got = xd
                    .apply_op3_no_bwd(&wd, &ids, &SlotsGemm { share })
                    .expect("host twin");
                assert_eq!(got.dtype(), dtype);
                assert_eq!(got.dims(), &[slots, 1, n]);
                let got = got.to_dtype(DType::F32).expect("widen");
                assert_eq!(max_abs_diff(&got, &want), 0.0, "share {share} {dtype:?}");
            }
        }
    }

    /// The table call a GPU checks before the kernel writes its pointers: its furthest GEMM
    /// is, offset by offset, the furthest of the host call's for any ids (every expert at
    /// every slot tried), its outputs are the host call's, and it fits the operands' lengths
    /// with nothing to spare (one element short of any operand fails). A layout that does
    /// not fit its operands, and outputs closer than their span, are refused by name.
    #[test]
    fn the_slots_table_call_reaches_each_operands_end() {
        let (rows, share, stack, n, k) = (3, 2, 4, 5, 6);
        let x = Layout::contiguous((rows, 1, k));
        let w = Layout::contiguous((stack, n, k));
        let ids = Layout::contiguous(rows * share);
        let layout = SlotsLayout::of(&x, &w, &ids, share).expect("fits");
        let slots = rows * share;
        let table = layout.table_call();
        let mut furthest = [0usize; 3];
        for e in 0..stack as u32 {
            let call = layout.call(&vec![e; slots]).expect("call");
            assert_eq!(call.shape, table.shape);
            for (s, offsets) in call.offsets().enumerate() {
                assert_eq!(offsets[2], s * table.c_step, "slot {s}'s output");
                for (f, o) in furthest.iter_mut().zip(offsets) {
                    *f = (*f).max(o);
                }
            }
        }
        assert_eq!(furthest, table.furthest);
        assert_eq!(table.count, slots);
        let lens = [stack * n * k, rows * k, slots * n];
        table.check_within(lens, "test").expect("tight lengths fit");
        for short in 0..3 {
            let mut less = lens;
            less[short] -= 1;
            table
                .check_within(less, "test")
                .expect_err("one element short");
        }
        let close = DeviceTableCall {
            c_step: n - 1,
            furthest: [table.furthest[0], table.furthest[1], (slots - 1) * (n - 1)],
            ..table
        };
        let err = close
            .check_within(lens, "test")
            .expect_err("outputs overlap");
        assert!(err.to_string().contains("overlapping"), "{err}");
        let three = Layout::contiguous(3);
        let err = SlotsLayout::of(&x, &w, &three, share).expect_err("3 ids for 3 rows × 2");
        assert!(err.to_string().contains("3 ids at 2 slots a row"), "{err}");
        let err = layout.call(&[0, 1]).expect_err("2 ids for 6 slots");
        assert!(err.to_string().contains("2 ids for 6 slots"), "{err}");
    }

    /// Each pass's host plan equals candle's composed ops: the forward and input gradient bit
    /// for bit per block's dot products (the same f32 sums, in `k` order), the weight
    /// gradient summed over every block of an expert (overflow runs added after the main
    /// block, to rounding).
    #[test]
    fn the_plans_equal_the_gathered_weights_products() {
        let (cap, n, k, stack) = (3, 5, 4, 3);
        let blocks = EXPERTS.len();
        let x = seeded_tensor(&[blocks, cap, k], 1, DType::F32);
        let w = seeded_tensor(&[stack, n, k], 2, DType::F32);
        let g = seeded_tensor(&[blocks, cap, n], 3, DType::F32);
        let map = Arc::new(BlockMap::new(&x, &w, &EXPERTS).expect("map"));
        let ids = Tensor::from_vec(EXPERTS.to_vec(), blocks, x.device()).expect("ids");
        let wb = w.index_select(&ids, 0).expect("gather");
        let y = x
            .apply_op2_no_bwd(&w, &PlannedGemm::new(Pass::Forward, &map))
            .expect("forward");
        let want = x.matmul(&wb.transpose(1, 2).expect("t")).expect("y");
        assert!(max_abs_diff(&y, &want) < 1e-5, "forward");
        let dx = g
            .apply_op2_no_bwd(&w, &PlannedGemm::new(Pass::InputGrad, &map))
            .expect("dx");
        let want_dx = g.matmul(&wb).expect("dx");
        assert!(max_abs_diff(&dx, &want_dx) < 1e-5, "input gradient");
        let dw = g
            .apply_op2_no_bwd(&x, &PlannedGemm::new(Pass::WeightGrad, &map))
            .expect("dw");
        let per_block = g
            .transpose(1, 2)
            .and_then(|gt| gt.matmul(&x))
            .expect("per-block dw");
        let want_dw = Tensor::zeros((stack, n, k), DType::F32, x.device())
            .and_then(|z| z.index_add(&ids, &per_block, 0))
            .expect("sum");
        assert!(max_abs_diff(&dw, &want_dw) < 1e-4, "weight gradient");
    }

    /// A plan applied to operands of other shapes than it was made for is refused, naming
    /// both (each pass, each operand one row short or one column wide), never run at the
    /// plan's offsets.
    #[test]
    fn a_plan_refuses_operands_of_other_shapes() {
        let (cap, n, k, stack) = (3, 5, 4, 3);
        let blocks = EXPERTS.len();
        let x = seeded_tensor(&[blocks, cap, k], 1, DType::F32);
        let w = seeded_tensor(&[stack, n, k], 2, DType::F32);
        let g = seeded_tensor(&[blocks, cap, n], 3, DType::F32);
        let map = Arc::new(BlockMap::new(&x, &w, &EXPERTS).expect("map"));
        let short = |t: &Tensor| t.narrow(1, 0, t.dim(1).expect("dim") - 1).expect("short");
        let wide = |t: &Tensor| {
            let last = t.dims().len() - 1;
            Tensor::cat(&[t, &t.narrow(last, 0, 1).expect("column")], last).expect("wide")
        };
        for (pass, first, second) in [
            (Pass::Forward, &x, &w),
            (Pass::InputGrad, &g, &w),
            (Pass::WeightGrad, &g, &x),
        ] {
            let plan = PlannedGemm::new(pass, &map);
            first
                .apply_op2_no_bwd(second, &plan)
                .unwrap_or_else(|e| panic!("{pass:?} on its own shapes: {e}"));
            for (a, b) in [
                (short(first), second.clone()),
                (wide(first), second.clone()),
                (first.clone(), short(second)),
                (first.clone(), wide(second)),
            ] {
                let err = a
                    .contiguous()
                    .and_then(|a| a.apply_op2_no_bwd(&b.contiguous()?, &plan))
                    .expect_err("a mis-shaped operand");
                let text = err.to_string();
                assert!(
                    text.contains("planned for") && text.contains(&format!("{:?}", a.dims())),
                    "{pass:?}: {text}"
                );
            }
        }
    }

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

    /// The `FAST_16BF` plans' host twin is the plans over the operands rounded to bf16
    /// (nearest, ties to even) first, bit for bit: the semantics r3 asks of cuBLAS's own
    /// conversion (check.sh step 7 checks that cuBLAS has them).
    #[test]
    fn the_fast16bf_plans_are_the_plans_of_bf16_rounded_operands() {
        let (cap, k, stack, n) = (3, 4, 3, 5);
        let x = (seeded_tensor(&[EXPERTS.len(), cap, k], 1, DType::F32) * 1.37).expect("x");
        let w = (seeded_tensor(&[stack, n, k], 2, DType::F32) * 0.71).expect("w");
        let map = Arc::new(BlockMap::new(&x, &w, &EXPERTS).expect("map"));
        let rounded = |t: &Tensor| round_bf16(t).expect("round");
        let fast = x
            .apply_op2_no_bwd(&w, &PlannedGemm::fast(Pass::Forward, &map))
            .expect("fast");
        let exact = rounded(&x)
            .apply_op2_no_bwd(&rounded(&w), &PlannedGemm::new(Pass::Forward, &map))
            .expect("rounded operands");
        assert_eq!(max_abs_diff(&fast, &exact), 0.0);
        let unrounded = x
            .apply_op2_no_bwd(&w, &PlannedGemm::new(Pass::Forward, &map))
            .expect("f32");
        assert!(
            max_abs_diff(&fast, &unrounded) > 0.0,
            "the operands were rounded"
        );
    }

    /// The weight gradient's rounds: the main blocks overwrite, each later run adds, runs of
    /// one length share a call, and an expert without blocks leaves a zeroed gradient.
    #[test]
    fn the_weight_gradient_plan_writes_once_then_adds() {
        let x = seeded_tensor(&[EXPERTS.len(), 2, 4], 1, DType::F32);
        let w = seeded_tensor(&[4, 5, 4], 2, DType::F32);
        let map = BlockMap::new(&x, &w, &EXPERTS).expect("map");
        let plan = GemmPlan::new(Pass::WeightGrad, &map);
        let summary: Vec<(usize, usize, bool)> = plan
            .calls
            .iter()
            .map(|c| (c.count(), c.shape.k, c.accumulate))
            .collect();
        // round 0: experts 0 and 1 one block each, expert 2's main block and its three
        // overflow blocks (contiguous: one run of 4 blocks, 8 rows) in a call of its own;
        // round 1: expert 0's overflow block, added.
        assert_eq!(summary, vec![(2, 2, false), (1, 8, false), (1, 2, true)]);
        assert!(plan.zeroed, "expert 3 has no block");
        let full =
            BlockMap::new(&x, &seeded_tensor(&[3, 5, 4], 2, DType::F32), &EXPERTS).expect("map");
        assert!(!GemmPlan::new(Pass::WeightGrad, &full).zeroed);
    }

    /// Blocks laid out as the padded layout lays them (each expert's side by side, overflow
    /// after its main block): one round, every expert's gradient one GEMM over its rows and
    /// nothing added, so a 16-bit precision writes the gradient in 16 bits directly; the
    /// same experts with an overflow block apart need a second, adding round.
    #[test]
    fn consecutive_blocks_write_each_experts_gradient_once() {
        let x = seeded_tensor(&[6, 2, 4], 1, DType::F32);
        let w = seeded_tensor(&[3, 5, 4], 2, DType::F32);
        let side_by_side = BlockMap::new(&x, &w, &[0, 0, 1, 2, 2, 2]).expect("map");
        let plan = GemmPlan::new(Pass::WeightGrad, &side_by_side);
        assert!(!plan.accumulates());
        let summary: Vec<(usize, usize)> =
            plan.calls.iter().map(|c| (c.count(), c.shape.k)).collect();
        // expert 1 one block (2 rows), expert 0 two (4 rows), expert 2 three (6 rows)
        assert_eq!(summary, vec![(1, 2), (1, 4), (1, 6)]);
        let apart = BlockMap::new(&x, &w, &[0, 1, 2, 2, 2, 0]).expect("map");
        assert!(GemmPlan::new(Pass::WeightGrad, &apart).accumulates());
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
