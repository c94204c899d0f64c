//! The routed experts' planned GEMMs: which cuBLAS calls one pass (forward, input gradient,
//! weight gradient) over a block → expert map makes, in what order, and the no-gradient op
//! that runs them, through a plain column-major GEMM on the host (the CPU tests' twin) or
//! through cuBLAS on a GPU. The plan is made on the host from the map alone, so its offsets
//! and accumulation order are checked in CI against candle's composed ops.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use crate::error::{ModelError, Result};
use crate::gemm_call::{GemmBatch, GemmCall, GemmShape};
use crate::host::{host_storage, host_values};

/// The blocks' shapes and experts, checked against the operands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BlockMap {
    /// The expert of each block.
    pub(super) experts: Vec<u32>,
    /// Experts in the stack (`E`).
    pub(super) stack: usize,
    /// Rows per block.
    pub(super) cap: usize,
    /// Output columns (`n`) and the shared inner size (`k`).
    n: usize,
    k: usize,
}

impl BlockMap {
    /// The map of the input blocks `x` by the stack `w` (see [`BlockMap::of_shape`]).
    pub(super) fn new(x: &Tensor, w: &Tensor, experts: &[u32]) -> Result<Self> {
        Self::of_shape(x.dims(), w, experts)
    }

    /// The map of input blocks of shape `x` `[blocks, cap, k]` by the stack `w`.
    pub(super) fn of_shape(x: &[usize], w: &Tensor, experts: &[u32]) -> Result<Self> {
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

/// Which product a plan computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// `(x, w) → y [blocks, cap, n]`.
    Forward,
    /// `(g, w) → dx [blocks, cap, k]`.
    InputGrad,
    /// `(g, x) → dw [E, n, k]`, in f32 or written once in a 16-bit float.
    WeightGrad,
}

/// The GEMMs of one pass, in the order they must run, and the output's size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct GemmPlan {
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
    pub(super) fn accumulates(&self) -> bool {
        self.calls.iter().any(|c| c.accumulate)
    }

    /// The plan of `pass` over these blocks. Row-major operands seen column-major are
    /// transposed, so `y = x wᵀ` is the column-major `yᵀ = w xᵀ`, and so on.
    pub(super) fn new(pass: Pass, map: &BlockMap) -> Self {
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
pub(super) struct PlannedGemm {
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
    /// The pass over `map`'s blocks: operands of one dtype, the weight gradient in f32.
    pub(super) fn new(pass: Pass, map: &Arc<BlockMap>) -> Self {
        PlannedGemm {
            pass,
            map: Arc::clone(map),
            fast16bf: false,
            weight_grad: DType::F32,
        }
    }

    /// The pass writing the weight gradient in `dtype`.
    pub(super) fn writing_weight_grad_in(self, dtype: DType) -> Self {
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
    pub(super) fn fast(pass: Pass, map: &Arc<BlockMap>) -> Self {
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

/// The plans on cuBLAS.
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::DevicePtrMut;
    use candle_core::{CudaStorage, DType, Layout};

    use super::GemmPlan;
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
}

#[cfg(test)]
mod tests {
    use super::super::round_bf16;
    use super::super::tests::EXPERTS;
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};

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
}
