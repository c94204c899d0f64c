//! The decode step's routed-expert GEMMs, one row a slot: each of a token's `top_k` slots
//! multiplies its row by the expert the router chose for it. A step routed on the device has
//! its experts only as a device tensor: its GEMMs take their pointer table from a kernel that
//! reads the ids where they are (`r3_expert_slot_pointers`), so the host never waits for
//! them. Off a GPU, or with an operand to differentiate, the product of the gathered
//! matrices; the op's host twin runs the same call as the GPU through a plain GEMM.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use super::reads_weights_in_place;
use crate::cast16::cast16;
use crate::error::{ModelError, Result};
#[cfg(any(test, feature = "cuda"))]
use crate::gemm_call::DeviceTableCall;
use crate::gemm_call::{GemmBatch, GemmCall, GemmShape};
use crate::host::{contiguous, host_storage, host_values};
use crate::layers::linear::matmul_wt_at;
use crate::precision::{Precision, WeightGradients};

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

    /// `r3_expert_slot_pointers`' arguments for operands at the device addresses `bases` (A
    /// the stack, B the rows, C the output: [`SlotsLayout::operands`]' order) of
    /// `elem_bytes` bytes an element: the kernel's steps are [`SlotsLayout::steps`] in bytes.
    fn pointer_args(
        &self,
        bases: [u64; 3],
        elem_bytes: usize,
    ) -> candle_core::Result<SlotPointerArgs> {
        let int = |v: usize| {
            u32::try_from(v).map_err(|_| {
                candle_core::Error::Msg(format!("expert slots gemm: {v} exceeds a 32-bit size"))
            })
        };
        let [a, b, c] = self.steps().map(|step| (step * elem_bytes) as u64);
        Ok(SlotPointerArgs {
            slots: int(self.slots)?,
            stack: int(self.stack)?,
            a: [bases[0], a],
            b: [bases[1], b],
            share: int(self.share)?,
            c: [bases[2], c],
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

/// `r3_expert_slot_pointers`' arguments after the ids and the table, as the GPU path passes
/// them: the slots, the stack's experts, A's (the stack's) address and step from one expert
/// to the next, B's (the rows') address and step from one row to the next, the slots a row,
/// C's (the output's) address and step from one slot to the next; steps in bytes.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotPointerArgs {
    /// Slots (GEMMs) in the table.
    pub slots: u32,
    /// Experts in the stack: an id from here on reads expert 0.
    pub stack: u32,
    /// A's address and step.
    pub a: [u64; 2],
    /// B's address and step.
    pub b: [u64; 2],
    /// Consecutive slots reading one row.
    pub share: u32,
    /// C's address and step.
    pub c: [u64; 2],
}

/// The slots' pointer kernel's twin, for the emulator's tests: for `ids` (one a slot), a
/// stack of `[stack, n, k]` and `share` slots a row, operands at `bases` (stack, rows,
/// output) of `elem_bytes` bytes an element, the kernel's arguments as the GPU path makes
/// them and the table cuBLAS must be handed (`SlotsLayout::call`'s, whose host run the tests
/// hold to the gathered experts' product).
#[doc(hidden)]
pub fn expert_slot_pointers_twin(
    ids: &[u32],
    [stack, n, k]: [usize; 3],
    share: usize,
    bases: [u64; 3],
    elem_bytes: usize,
) -> candle_core::Result<(SlotPointerArgs, Vec<u64>)> {
    let rows = ids.len().checked_div(share).unwrap_or(0);
    let layout = SlotsLayout::of(
        &Layout::contiguous((rows, 1, k)),
        &Layout::contiguous((stack, n, k)),
        &Layout::contiguous(ids.len()),
        share,
    )?;
    let table = layout.call(ids)?.pointer_table(bases, [elem_bytes; 3]);
    Ok((layout.pointer_args(bases, elem_bytes)?, table))
}

/// The slots' GEMM on cuBLAS.
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
    use candle_core::{CudaStorage, DType, Layout};

    use super::SlotsLayout;
    use crate::cuda::gemm::{self, GemmCompute, GemmOperand};

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
                    let args =
                        layout.pointer_args([a.addr, b.addr, y0], x.dtype.size_in_bytes())?;
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
                        .arg(&args.slots)
                        .arg(&args.stack)
                        .arg(&args.a[0])
                        .arg(&args.a[1])
                        .arg(&args.b[0])
                        .arg(&args.b[1])
                        .arg(&args.share)
                        .arg(&args.c[0])
                        .arg(&args.c[1]);
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
    use crate::test_util::max_abs_diff;
    use candle_core::Device;

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
}
