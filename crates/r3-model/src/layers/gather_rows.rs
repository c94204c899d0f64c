//! A row gather whose backward is a gather too: `out[i] = src[ids[i]]`, with the gradient
//! `d src[q] = Σ_{i : ids[i] = q} d out[i]` computed by gathering each source row's uses
//! (a host-built fan-in table) and summing them in the table's order from zero, in one pass
//! (r3's kernel on a GPU, rows side by side on the host). Composed from candle's ops
//! (the gradient copied beside a zero row, `index_select` of every use, a sum over them) it
//! took three passes and a `[rows, fan-in, row]` temporary: on an H200 0.43 ms of every
//! 30B-A3B-shaped MoE layer's backward.
//!
//! candle's `index_select` has `index_add` as its backward, and candle's CUDA `index_add`
//! runs one thread per column that walks every id in sequence: for an MoE layer's tens of
//! thousands of routed slots that one kernel took most of a GPU training step. The routed
//! experts' dispatch and combine use this op on a GPU instead; each of its passes is one
//! parallel gather. The MoE block's real rows of a padded batch go through it on both
//! devices: on the host its forward, and its backward where each source row is read at most
//! once, copy rows side by side (candle's CPU `index_select` and `index_add` copy them in
//! turn).

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::gemm::{assume_init_vec, unfilled};
use crate::error::{ModelError, Result};
use crate::host::{contiguous, with_host};
use crate::math::Float;

/// Rows a task of the host gather and scatter copies at least.
const ROWS_PER_TASK: usize = 64;

/// `out[i] = src[ids[i]]` over the first dimension of `src`, differentiable by gathers.
#[derive(Debug, Clone)]
pub struct GatherRows {
    ids: Arc<Vec<u32>>,
    /// The backward's fan-in table, built when the backward first needs it: a forward
    /// without a backward (inference) never pays for it, and a training forward does not
    /// build it between a layer's routing and its experts, while the GPU waits on the host.
    fan_in: Arc<OnceLock<FanIn>>,
    src_rows: usize,
    grad_rows: usize,
    /// The ids the backward's fan-in is built from where they differ from `ids`: an unread
    /// output's ([`GatherRows::with_unread_outputs`]) past every row with a gradient, so
    /// the fan-in leaves it out as it does padding rows.
    backward_ids: Option<Arc<Vec<u32>>>,
}

/// For each source row below `grad_rows`, the output rows that read it, in ascending order,
/// stored row after row (compressed rows). A table padded to the widest fan-in would give
/// every row as many entries as a batch has padding slots, since those all read one row.
#[derive(Debug)]
struct FanIn {
    /// Per source row below `grad_rows`, where its uses start in `uses`; one more entry,
    /// their end.
    offsets: Vec<u32>,
    /// The output rows reading each source row, row after row.
    uses: Vec<u32>,
}

impl FanIn {
    /// The fan-in of `ids` over the first `grad_rows` source rows (ids already checked
    /// against the source).
    fn of(ids: &[u32], grad_rows: usize) -> Self {
        let mut offsets = vec![0u32; grad_rows + 1];
        for &id in ids.iter().filter(|&&id| (id as usize) < grad_rows) {
            offsets[id as usize + 1] += 1;
        }
        for q in 0..grad_rows {
            offsets[q + 1] += offsets[q];
        }
        let mut filled: Vec<u32> = offsets[..grad_rows].to_vec();
        let mut uses = vec![0u32; offsets[grad_rows] as usize];
        for (i, &id) in ids.iter().enumerate() {
            if let Some(at) = filled.get_mut(id as usize) {
                uses[*at as usize] = i as u32;
                *at += 1;
            }
        }
        FanIn { offsets, uses }
    }

    /// The output rows reading source row `q`, in ascending order.
    fn of_row(&self, q: usize) -> &[u32] {
        &self.uses[self.offsets[q] as usize..self.offsets[q + 1] as usize]
    }

    /// The most uses any source row has.
    fn width(&self) -> usize {
        self.offsets
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0)
    }

    /// The table padded to [`FanIn::width`] uses a row with `zero_row` (what the composed
    /// form's `index_select` reads).
    fn padded(&self, zero_row: u32) -> Vec<u32> {
        let width = self.width();
        let rows = self.offsets.len() - 1;
        let mut table = vec![zero_row; rows * width];
        for (q, slots) in table.chunks_mut(width.max(1)).enumerate().take(rows) {
            slots[..self.of_row(q).len()].copy_from_slice(self.of_row(q));
        }
        table
    }
}

impl GatherRows {
    /// Gathers rows `ids` of a source of `src_rows` rows; source rows at or past `grad_rows`
    /// (padding the caller appended) get no gradient. An id past the source is an error.
    pub fn new(ids: Vec<u32>, src_rows: usize, grad_rows: usize) -> Result<Self> {
        if grad_rows > src_rows {
            return Err(ModelError::Input(format!(
                "gather: {grad_rows} rows with gradients of a {src_rows}-row source"
            )));
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= src_rows) {
            return Err(ModelError::Input(format!(
                "gather: row id {id} past a {src_rows}-row source"
            )));
        }
        Ok(GatherRows {
            ids: Arc::new(ids),
            fan_in: Arc::new(OnceLock::new()),
            src_rows,
            grad_rows,
            backward_ids: None,
        })
    }

    /// This gather with the output rows `unread[i]` marks left out of its backward: rows
    /// nothing downstream reads, so their gradient is zero and summing it changes nothing
    /// but the work. A padded batch's padding slots all copy one row, whose gradient would
    /// otherwise be summed over every one of them (on a GPU, by one block). `unread` holds
    /// one flag per id.
    pub fn with_unread_outputs(self, unread: Vec<bool>) -> Result<Self> {
        if unread.len() != self.ids.len() {
            return Err(ModelError::Input(format!(
                "gather: {} unread flags for {} rows gathered",
                unread.len(),
                self.ids.len()
            )));
        }
        let past = u32::try_from(self.grad_rows).unwrap_or(u32::MAX);
        let backward_ids = self
            .ids
            .iter()
            .zip(&unread)
            .map(|(&id, &unread)| if unread { past } else { id })
            .collect();
        Ok(GatherRows {
            backward_ids: Some(Arc::new(backward_ids)),
            fan_in: Arc::new(OnceLock::new()),
            ..self
        })
    }

    /// The backward's fan-in, built the first time it is needed.
    fn fan_in(&self) -> &FanIn {
        self.fan_in.get_or_init(|| {
            FanIn::of(
                self.backward_ids.as_deref().unwrap_or(&self.ids),
                self.grad_rows,
            )
        })
    }

    /// `src[ids]` for `src` of `src_rows` rows (any trailing shape).
    pub fn apply(&self, src: &Tensor) -> Result<Tensor> {
        if src.rank() == 0 || src.dim(0)? != self.src_rows {
            return Err(ModelError::Input(format!(
                "gather: source {:?} does not have {} rows",
                src.dims(),
                self.src_rows
            )));
        }
        Ok(src.contiguous()?.apply_op1(self.clone())?)
    }

    /// The output shape for a source of shape `dims`.
    fn out_shape(&self, dims: &[usize]) -> Shape {
        let mut out = dims.to_vec();
        out[0] = self.ids.len();
        Shape::from(out)
    }
}

impl CustomOp1 for GatherRows {
    fn name(&self) -> &'static str {
        "gather-rows"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let shape = self.out_shape(layout.dims());
        let row = layout.dims()[1..].iter().product::<usize>();
        let out = match storage {
            CpuStorage::F32(v) => CpuStorage::F32(self.gather(contiguous(v, layout, "src")?, row)),
            CpuStorage::F64(v) => CpuStorage::F64(self.gather(contiguous(v, layout, "src")?, row)),
            _ => {
                let ids = CpuStorage::U32(self.ids.to_vec());
                storage.index_select(&ids, layout, &Layout::contiguous(self.ids.len()), 0)?
            }
        };
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        use candle_core::backend::BackendDevice;
        let shape = self.out_shape(layout.dims());
        let row = layout.dims()[1..].iter().product::<usize>();
        let ids = storage.device().storage_from_slice(self.ids.as_slice())?;
        let ids_layout = Layout::contiguous(self.ids.len());
        // r3's kernels for f32 and 16-bit rows (whole-row copies), candle's index_select
        // otherwise (it computes a strided index per element in 64-bit arithmetic).
        let kernel =
            layout.is_contiguous() && row > 0 && !self.ids.is_empty() && u32::try_from(row).is_ok();
        if kernel && matches!(storage.dtype(), DType::BF16 | DType::F16) {
            let octs = row.is_multiple_of(8) && layout.start_offset().is_multiple_of(8);
            let launch = cuda::per_row(self.ids.len(), cuda::row_threads(row.div_ceil(2)))?;
            macro_rules! gather16 {
                ($ty:ty) => {
                    cuda::launch_typed!(
                        cuda::device(storage),
                        "r3_gather_rows_u16",
                        $ty,
                        shape.elem_count(),
                        launch,
                        [
                            cuda::view::<$ty>(storage, layout, "gathered rows")?,
                            cuda::view::<u32>(&ids, &ids_layout, "row ids")?
                        ],
                        [row as u32, u32::from(octs)]
                    )
                };
            }
            let out = match storage.dtype() {
                DType::BF16 => gather16!(half::bf16),
                _ => gather16!(half::f16),
            };
            return Ok((out, shape));
        }
        if !(kernel && storage.dtype() == DType::F32) {
            let out = storage.index_select(&ids, layout, &ids_layout, 0)?;
            return Ok((out, shape));
        }
        let quads = row.is_multiple_of(4) && layout.start_offset().is_multiple_of(4);
        let out = cuda::launch_f32!(
            cuda::device(storage),
            "r3_gather_rows_f32",
            shape.elem_count(),
            cuda::per_row(self.ids.len(), cuda::row_threads(row))?,
            [
                cuda::view::<f32>(storage, layout, "gathered rows")?,
                cuda::view::<u32>(&ids, &ids_layout, "row ids")?
            ],
            [row as u32, u32::from(quads)]
        );
        Ok((out, shape))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        self.sum_uses(grad, arg.dims()).map(Some)
    }
}

impl GatherRows {
    /// The gather's backward sums (`d src[q] = Σ_{i : ids[i] = q} grad[i]`, shaped as the
    /// source `dims`, rows at or past `grad_rows` zero) of 16-bit gradient rows (bf16, f16)
    /// in f32, each row widened as it is read: the sums of the widened rows, bit for bit,
    /// without their f32 copy on a GPU (an op gathering in the GEMMs' float,
    /// `padded_experts.rs`, whose input gradient comes out of those GEMMs). Other dtypes are
    /// summed in their own, as the op's backward does.
    pub fn sum_uses_widened(&self, grad: &Tensor, dims: &[usize]) -> candle_core::Result<Tensor> {
        self.sum_uses_as(grad, dims, true)
    }

    /// The backward's value: `d src[q] = Σ_{i : ids[i] = q} grad[i]` for the gathered rows'
    /// gradient `grad`, shaped as the source `dims`; rows at or past `grad_rows` zero. An op
    /// that gathers inside itself (`padded_experts.rs`) sums its rows' gradients back by it.
    pub(crate) fn sum_uses(&self, grad: &Tensor, dims: &[usize]) -> candle_core::Result<Tensor> {
        self.sum_uses_as(grad, dims, false)
    }

    /// [`GatherRows::sum_uses`], 16-bit rows summed in f32 where `widen`: read widened by a
    /// GPU's kernel, widened first elsewhere.
    fn sum_uses_as(
        &self,
        grad: &Tensor,
        dims: &[usize],
        widen: bool,
    ) -> candle_core::Result<Tensor> {
        let row: usize = dims[1..].iter().product();
        let fan_in = self.fan_in();
        let sixteen = matches!(grad.dtype(), DType::BF16 | DType::F16);
        #[cfg(feature = "cuda")]
        if grad.device().is_cuda()
            && (grad.dtype() == DType::F32 || (widen && sixteen))
            && row > 0
            && self.src_rows > 0
            && u32::try_from(row).is_ok()
        {
            let grad = grad.contiguous()?;
            let summed = grad.apply_op1_no_bwd(&GatherSum {
                offsets: fan_in.offsets.clone(),
                uses: fan_in.uses.clone(),
                grad_rows: self.grad_rows,
                src_rows: self.src_rows,
                row,
            })?;
            return summed.reshape(dims);
        }
        if widen && sixteen {
            // Where no kernel reads them widened: widened first, then summed in f32 (the
            // host and candle's composed ops sum in the gradient's dtype).
            return self.sum_uses(&grad.to_dtype(DType::F32)?, dims);
        }
        match (grad.device().is_cpu(), grad.dtype()) {
            (true, DType::F32) => self.gather_sum_host::<f32>(grad, fan_in, row, dims),
            (true, DType::F64) => self.gather_sum_host::<f64>(grad, fan_in, row, dims),
            _ => self.bwd_composed(dims, grad, fan_in, row),
        }
    }
}

/// The backward's gather-and-sum as one GPU pass: `[uses, row]` gradient rows (f32, or 16-bit
/// widened as read) → `[src_rows, row]` f32, row `q < grad_rows` the sum of its uses in
/// ascending order from zero (the host twin's arithmetic, [`GatherRows::gather_sum_host`]),
/// the rest zero.
#[cfg(feature = "cuda")]
struct GatherSum {
    /// [`FanIn::offsets`].
    offsets: Vec<u32>,
    /// [`FanIn::uses`].
    uses: Vec<u32>,
    grad_rows: usize,
    src_rows: usize,
    row: usize,
}

#[cfg(feature = "cuda")]
impl CustomOp1 for GatherSum {
    fn name(&self) -> &'static str {
        "gather-rows-grad"
    }

    fn cpu_fwd(
        &self,
        _storage: &CpuStorage,
        _layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("gather-rows-grad runs on a GPU only (the host sums in GatherRows)")
    }

    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        use candle_core::backend::BackendDevice;
        let dev = cuda::device(storage);
        // A list of no entries (no source row read) still needs one element.
        let upload = |v: &[u32]| match v.is_empty() {
            true => dev.storage_from_slice(&[0u32]),
            false => dev.storage_from_slice(v),
        };
        let (offsets, uses) = (upload(&self.offsets)?, upload(&self.uses)?);
        let offsets_layout = Layout::contiguous(self.offsets.len().max(1));
        let uses_layout = Layout::contiguous(self.uses.len().max(1));
        let u32_of = |v: usize, what: &str| {
            u32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{what} {v} past u32")))
        };
        let (row, grad_rows) = (
            u32_of(self.row, "row")?,
            u32_of(self.grad_rows, "rows with a gradient")?,
        );
        macro_rules! sum {
            ($kernel:literal, $t:ty) => {
                cuda::launch_f32!(
                    dev.clone(),
                    $kernel,
                    self.src_rows * self.row,
                    cuda::per_row(self.src_rows, cuda::row_threads(self.row))?,
                    [
                        cuda::view::<$t>(storage, layout, "gradient rows")?,
                        cuda::view::<u32>(&offsets, &offsets_layout, "fan-in offsets")?,
                        cuda::view::<u32>(&uses, &uses_layout, "fan-in uses")?
                    ],
                    [row, grad_rows]
                )
            };
        }
        use candle_core::backend::BackendStorage;
        let out = match storage.dtype() {
            DType::F32 => sum!("r3_gather_sum_rows_f32", f32),
            DType::BF16 => sum!("r3_gather_sum_rows_bf16", half::bf16),
            DType::F16 => sum!("r3_gather_sum_rows_f16", half::f16),
            dt => candle_core::bail!("gather-rows-grad: gradient rows of {dt:?}"),
        };
        Ok((out, Shape::from((self.src_rows, self.row))))
    }
}

impl GatherRows {
    /// `src[ids]` on the host, rows copied side by side (candle's CPU `index_select` copies
    /// them in turn while the other threads wait).
    fn gather<T: Copy + Send + Sync>(&self, src: &[T], row: usize) -> Vec<T> {
        // Not zero-filled first: every element is written below.
        let mut out = unfilled::<T>(self.ids.len() * row);
        out.par_chunks_mut(row.max(1))
            .zip(self.ids.par_iter())
            .with_min_len(ROWS_PER_TASK)
            .for_each(|(o, &id)| {
                let id = id as usize;
                for (o, &v) in o.iter_mut().zip(&src[id * row..(id + 1) * row]) {
                    o.write(v);
                }
            });
        // SAFETY: one chunk of `row` elements per id tiles `out`, and each chunk was written
        // whole from its source row (`row` long: the slice above is checked).
        unsafe { assume_init_vec(out) }
    }

    /// The backward on the host: each source row's gradient is its uses' gradient rows
    /// added in ascending order from zero (the composed form's sum, whose padding entries
    /// add zeros: the same bits), rows side by side.
    fn gather_sum_host<T: Float + WithDType>(
        &self,
        grad: &Tensor,
        fan_in: &FanIn,
        row: usize,
        dims: &[usize],
    ) -> candle_core::Result<Tensor> {
        let mut out = vec![T::ZERO; self.src_rows * row];
        with_host::<T, _>(grad, |g| {
            out[..self.grad_rows * row]
                .par_chunks_mut(row.max(1))
                .enumerate()
                .with_min_len(ROWS_PER_TASK)
                .for_each(|(q, o)| {
                    for &i in fan_in.of_row(q) {
                        let i = i as usize;
                        for (o, &g) in o.iter_mut().zip(&g[i * row..(i + 1) * row]) {
                            *o += g;
                        }
                    }
                });
            Ok(())
        })?;
        Tensor::from_vec(out, dims, grad.device())
    }

    /// The backward from candle ops: each source row's uses gathered through the fan-in
    /// table (padded with a zero row) and summed (dtypes without a host or GPU pass, and
    /// the reference the tests hold those to).
    fn bwd_composed(
        &self,
        dims: &[usize],
        grad: &Tensor,
        fan_in: &FanIn,
        row: usize,
    ) -> candle_core::Result<Tensor> {
        let device = grad.device();
        let width = fan_in.width();
        let mut parts = Vec::with_capacity(2);
        if width > 0 && self.grad_rows > 0 {
            let grad = grad.reshape((self.ids.len(), row))?;
            let padded = Tensor::cat(&[&grad, &Tensor::zeros((1, row), grad.dtype(), device)?], 0)?;
            let table = fan_in.padded(self.ids.len() as u32);
            let table = Tensor::from_slice(table.as_slice(), table.len(), device)?;
            let summed = padded
                .index_select(&table, 0)?
                .reshape((self.grad_rows, width, row))?
                .sum(1)?;
            parts.push(summed);
        }
        let without = self.src_rows - if width > 0 { self.grad_rows } else { 0 };
        if without > 0 {
            parts.push(Tensor::zeros((without, row), grad.dtype(), device)?);
        }
        let whole = if parts.len() == 1 {
            parts.remove(0)
        } else {
            Tensor::cat(&parts, 0)?
        };
        whole.reshape(dims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{f64_bits, max_abs_diff, seeded_tensor};
    use candle_core::{DType, Device, Var};

    /// The gradient of `Σ y ⊙ probe` with respect to `src`.
    fn grad_of(src: &Var, y: &Tensor, probe: &Tensor) -> Tensor {
        let g = (y * probe)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
            .expect("backward");
        g.get(src.as_tensor()).expect("grad").clone()
    }

    /// Output and gradient equal candle's `index_select` and its `index_add` backward,
    /// with rows used several times, rows never used, and padding rows without gradient.
    #[test]
    fn matches_index_select_and_its_backward() {
        let src_rows = 6;
        let ids = vec![3u32, 0, 3, 5, 1, 3, 0, 5];
        for dtype in [DType::F64, DType::F32] {
            let src = Var::from_tensor(&seeded_tensor(&[src_rows, 4, 2], 1, dtype)).expect("v");
            let probe = seeded_tensor(&[ids.len(), 4, 2], 2, dtype);
            let ids_t = Tensor::new(ids.as_slice(), src.device()).expect("ids");
            let want = src.as_tensor().index_select(&ids_t, 0).expect("select");
            let op = GatherRows::new(ids.clone(), src_rows, src_rows).expect("op");
            let got = op.apply(src.as_tensor()).expect("gather");
            assert_eq!(max_abs_diff(&got, &want), 0.0, "{dtype:?} forward");
            let grad = |y: &Tensor| grad_of(&src, y, &probe);
            let (gw, gg) = (grad(&want), grad(&got));
            let tol = if dtype == DType::F64 { 1e-15 } else { 1e-6 };
            assert!(max_abs_diff(&gw, &gg) < tol, "{dtype:?} gradient");
            // rows 2 and 4 are never read: exactly zero gradient
            for r in [2, 4] {
                let row = gg.get(r).expect("row");
                assert_eq!(max_abs_diff(&row, &row.zeros_like().expect("z")), 0.0);
            }
            // the last row as padding: no gradient although it is read
            let op = GatherRows::new(ids.clone(), src_rows, src_rows - 1).expect("op");
            let g = grad(&op.apply(src.as_tensor()).expect("gather"));
            let last = g.get(src_rows - 1).expect("row");
            assert_eq!(max_abs_diff(&last, &last.zeros_like().expect("z")), 0.0);
            let first = g.narrow(0, 0, src_rows - 1).expect("first");
            let want_first = gw.narrow(0, 0, src_rows - 1).expect("first");
            assert!(max_abs_diff(&first, &want_first) < tol);
        }
    }

    /// Rows read at most once (the MoE block's real rows out of a padded batch, 150 of
    /// them: several host tasks): forward and gradient are bit for bit candle's
    /// `index_select` and its `index_add` backward, on rows with and without a gradient.
    #[test]
    fn rows_read_once_equal_index_select_and_its_backward_bit_for_bit() {
        let bits = f64_bits;
        let src_rows = 200;
        let ids: Vec<u32> = (0..src_rows as u32).filter(|r| r % 4 != 3).collect();
        for dtype in [DType::F64, DType::F32] {
            let src = Var::from_tensor(&seeded_tensor(&[src_rows, 3, 2], 5, dtype)).expect("v");
            let probe = seeded_tensor(&[ids.len(), 3, 2], 6, dtype);
            let ids_t = Tensor::new(ids.as_slice(), src.device()).expect("ids");
            for grad_rows in [src_rows, src_rows - 7] {
                let want = src.as_tensor().index_select(&ids_t, 0).expect("select");
                let op = GatherRows::new(ids.clone(), src_rows, grad_rows).expect("op");
                let got = op.apply(src.as_tensor()).expect("gather");
                assert_eq!(bits(&got), bits(&want), "{dtype:?} forward");
                let grad = |y: &Tensor| grad_of(&src, y, &probe);
                let (gw, gg) = (grad(&want), grad(&got));
                // past `grad_rows` the op gives no gradient (padding the caller appended)
                let kept = |g: &Tensor| bits(&g.narrow(0, 0, grad_rows).expect("rows"));
                assert_eq!(kept(&gg), kept(&gw), "{dtype:?} gradient");
                let rest = bits(&gg.narrow(0, grad_rows, src_rows - grad_rows).expect("rest"));
                assert!(
                    rest.iter().all(|&b| b == 0),
                    "{dtype:?}: padding rows' gradient"
                );
            }
        }
    }

    /// The fan-in holds each use once, in ascending order per source row, by hand: a
    /// padded batch's slots all reading row 0 cost their own entries, not every row's.
    #[test]
    fn the_fan_in_holds_each_use_once() {
        // Output rows 0..8 read source rows 2, 0, 0, 1, 0, 0, 3, 0 (3 past grad_rows).
        let fan_in = FanIn::of(&[2, 0, 0, 1, 0, 0, 3, 0], 3);
        assert_eq!(fan_in.offsets, vec![0, 5, 6, 7]);
        assert_eq!(fan_in.uses, vec![1, 2, 4, 5, 7, 3, 0]);
        assert_eq!(
            (fan_in.of_row(0), fan_in.of_row(1), fan_in.of_row(2)),
            (&[1, 2, 4, 5, 7][..], &[3][..], &[0][..])
        );
        assert_eq!(fan_in.width(), 5);
        // The composed form's table: each row padded to 5 uses with the zero row (8).
        assert_eq!(
            fan_in.padded(8),
            vec![1, 2, 4, 5, 7, 3, 8, 8, 8, 8, 0, 8, 8, 8, 8]
        );
        // A thousand padding slots on row 0 and a thousand rows read once: 2,000 entries.
        let ids: Vec<u32> = (0..1000).map(|_| 0).chain(1..1001).collect();
        let fan_in = FanIn::of(&ids, 1001);
        assert_eq!((fan_in.uses.len(), fan_in.width()), (2000, 1000));
    }

    /// Unread output rows leave the fan-in (by hand), and where their gradient is zero (as
    /// nothing reads them) the backward is the plain gather's bit for bit; flags of another
    /// length than the ids are refused.
    #[test]
    fn unread_outputs_leave_the_backward() {
        let unread = vec![false, true, false, false, true, true, false, true];
        let op = GatherRows::new(vec![2, 0, 0, 1, 0, 0, 3, 0], 4, 3)
            .and_then(|op| op.with_unread_outputs(unread))
            .expect("op");
        let fan_in = op.fan_in();
        assert_eq!(fan_in.offsets, vec![0, 1, 2, 3]);
        assert_eq!(fan_in.uses, vec![2, 3, 0]);
        let ids: Vec<u32> = vec![4, 0, 4, 7, 1, 0, 0, 8, 2, 0];
        let unread: Vec<bool> = (0..ids.len()).map(|i| i >= 5 && ids[i] == 0).collect();
        let src = Var::from_tensor(&seeded_tensor(&[9, 5], 7, DType::F32)).expect("src");
        // The unread rows' gradient is zero: the probe does not read them.
        let keep: Vec<f32> = unread.iter().map(|&u| if u { 0.0 } else { 1.0 }).collect();
        let probe = (seeded_tensor(&[ids.len(), 5], 8, DType::F32)
            .broadcast_mul(&Tensor::from_vec(keep, (ids.len(), 1), &Device::Cpu).expect("keep")))
        .expect("probe");
        let plain = GatherRows::new(ids.clone(), 9, 9).expect("op");
        let leaving = plain
            .clone()
            .with_unread_outputs(unread.clone())
            .expect("unread");
        let y = leaving.apply(src.as_tensor()).expect("gather");
        assert_eq!(
            f64_bits(&y),
            f64_bits(&plain.apply(src.as_tensor()).expect("gather")),
            "the forward copies every row"
        );
        let want = grad_of(&src, &plain.apply(src.as_tensor()).expect("y"), &probe);
        let got = grad_of(&src, &y, &probe);
        assert_eq!(f64_bits(&got), f64_bits(&want));
        assert_eq!(
            leaving
                .fan_in
                .get()
                .map(|f| f.of_row(0).to_vec())
                .expect("built"),
            vec![1],
            "row 0's unread uses left out"
        );
        let err = plain
            .with_unread_outputs(vec![false; 3])
            .expect_err("3 flags");
        assert!(
            err.to_string().contains("3 unread flags for 10 rows"),
            "{err}"
        );
    }

    /// Rows read several times (fan-ins of 0 to 3, padding rows past `grad_rows`): the
    /// host's one pass gives the composed ops' gather-and-sum bit for bit (the same
    /// additions in the same order; the padding entries' zeros change nothing).
    #[test]
    fn the_host_sum_is_the_composed_ops_bit_for_bit() {
        let src_rows = 9;
        let ids: Vec<u32> = vec![4, 0, 4, 7, 1, 4, 0, 8, 2, 7, 8, 1];
        for dtype in [DType::F64, DType::F32] {
            let src = seeded_tensor(&[src_rows, 5], 7, dtype);
            let grad = seeded_tensor(&[ids.len(), 5], 8, dtype);
            for grad_rows in [src_rows, src_rows - 1] {
                let op = GatherRows::new(ids.clone(), src_rows, grad_rows).expect("op");
                let fan_in = FanIn::of(&ids, grad_rows);
                assert_eq!(fan_in.width(), 3, "row 4 is read three times");
                let host = match dtype {
                    DType::F64 => op.gather_sum_host::<f64>(&grad, &fan_in, 5, src.dims()),
                    _ => op.gather_sum_host::<f32>(&grad, &fan_in, 5, src.dims()),
                }
                .expect("host");
                let composed = op
                    .bwd_composed(src.dims(), &grad, &fan_in, 5)
                    .expect("composed");
                assert_eq!(
                    f64_bits(&host),
                    f64_bits(&composed),
                    "{dtype:?} {grad_rows}"
                );
                // row 3, 5 and 6 are never read, row 8 read twice but padding at 8 rows
                let zero_rows: &[usize] = match grad_rows == src_rows {
                    true => &[3, 5, 6],
                    false => &[3, 5, 6, 8],
                };
                for &r in zero_rows {
                    let row = host.get(r).expect("row");
                    assert_eq!(max_abs_diff(&row, &row.zeros_like().expect("z")), 0.0);
                }
            }
        }
    }

    #[test]
    fn ids_past_the_source_and_wrong_sources_are_errors() {
        let err = GatherRows::new(vec![0, 4], 4, 4).expect_err("id 4");
        assert!(err.to_string().contains("row id 4"), "{err}");
        let op = GatherRows::new(vec![0, 1], 4, 4).expect("op");
        let wrong = seeded_tensor(&[3, 2], 1, DType::F32);
        let err = op.apply(&wrong).expect_err("3 rows");
        assert!(err.to_string().contains("4 rows"), "{err}");
    }
}
