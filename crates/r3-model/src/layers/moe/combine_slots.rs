//! The routed experts' combine as one op: each row's output is the gate-weighted sum of its
//! `top_k` expert outputs, read straight from the padded expert blocks —
//! `out[r] = Σ_j gates[r, j] · y[place(r, j)]` — with its backward as two more single passes
//! (`dy[place(r, j)] = gates[r, j] · d out[r]`, zero on padding places;
//! `d gates[r, j] = d out[r] · y[place(r, j)]`).
//!
//! Composed from candle's ops (gather the slots' rows into `[rows, top_k, H]`, broadcast
//! multiply by the gates, sum over the slots) it was eight kernels forward and backward and
//! two slot-sized buffers, ≈ 6 ms of a mid bf16 training step on an H200 (candle's broadcast
//! kernels compute strided indices per element). Each op here has a CPU implementation that
//! the tests hold to the composed ops, and a CUDA kernel (`cuda/kernels.cu`) that the device
//! tests hold to the CPU: the combine and the outputs' gradient the same operations in the
//! same order (the CPU's bits), the gate gradient the same products summed in its block's
//! order (a GPU build may fuse a product into its sum: within rounding of the CPU's). The
//! padded experts hold their outputs in the GEMMs' 16-bit float: the combine and the gate
//! gradient read them widened as they go, and the outputs' gradient is written in that float
//! (the down GEMMs' operand), so no f32 copy of either crosses memory.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use crate::device::row_ops_run_on;
use crate::error::{ModelError, Result};
use crate::host::contiguous;
use crate::math::StdFloat;
use crate::round16::{round_in_place, rounding_for};

/// Launches the twin of r3's kernel `$stem` for expert outputs `$y` (a CUDA storage of f32,
/// bf16 or f16 under `$yl`: `{stem}_f32`, `_bf16`, `_f16`) with `$len` f32 outputs, one
/// block per row of `$rows` rows of `$h` threads' work: the outputs' view first, then the
/// arguments `[$more]` and the output, then `[$after]`; an error naming `$what` for another
/// dtype.
#[cfg(feature = "cuda")]
macro_rules! launch_over_outputs {
    ($stem:literal, $what:literal, ($y:expr, $yl:expr), $len:expr, ($rows:expr, $h:expr),
     [$($more:expr),*], [$($after:expr),*]) => {{
        use candle_core::backend::BackendStorage;
        macro_rules! launch {
            ($kernel:expr, $t:ty) => {
                $crate::cuda::launch_f32!(
                    $crate::cuda::device($y),
                    $kernel,
                    $len,
                    $crate::cuda::per_row($rows, $crate::cuda::row_threads($h))?,
                    [$crate::cuda::view::<$t>($y, $yl, "expert outputs")?, $($more),*],
                    [$($after),*]
                )
            };
        }
        match $y.dtype() {
            DType::F32 => launch!(concat!($stem, "_f32"), f32),
            DType::BF16 => launch!(concat!($stem, "_bf16"), half::bf16),
            DType::F16 => launch!(concat!($stem, "_f16"), half::f16),
            dt => candle_core::bail!("{} of {dt:?} on a GPU", $what),
        }
    }};
}

/// A place no slot reads (padding), in the place → slot table.
const NO_SLOT: u32 = u32::MAX;

/// `out[r] = Σ_j gates[r, j] · y[place_of_slot[r · top_k + j]]` for `y` `[places, H]` and
/// `gates` `[rows, top_k]`, differentiable in both; None where the op does not apply (another
/// device or dtype: the caller composes). Each place is read by at most one slot.
pub(crate) fn combine_slots(
    y: &Tensor,
    gates: &Tensor,
    place_of_slot: &[u32],
) -> Result<Option<Tensor>> {
    let (places, _) = y.dims2()?;
    let (rows, top_k) = gates.dims2()?;
    if place_of_slot.len() != rows * top_k {
        return Err(ModelError::Input(format!(
            "combine: {} slot places for {rows} rows of {top_k} slots",
            place_of_slot.len()
        )));
    }
    if !row_ops_run_on(y) || gates.dtype() != y.dtype() || rows == 0 {
        return Ok(None);
    }
    let slots = SlotPlaces::new(place_of_slot, places, top_k)?;
    let place = Tensor::from_slice(place_of_slot, rows * top_k, y.device())?;
    let op = CombineSlots {
        top_k,
        slot_of_place: slots.slot_of_place,
    };
    Ok(Some(y.contiguous()?.apply_op3(
        &gates.contiguous()?,
        &place,
        op,
    )?))
}

/// The slots' places of a padded layout, checked (each place read by at most one slot) and
/// inverted: the combine's value and its gradients for an op that holds its expert outputs
/// itself (`padded_experts.rs`), with the arithmetic of [`combine_slots`].
#[derive(Debug, Clone)]
pub(crate) struct SlotPlaces {
    top_k: usize,
    place_of_slot: Arc<Vec<u32>>,
    slot_of_place: Arc<Vec<u32>>,
}

impl SlotPlaces {
    /// The places of `top_k` slots a row, `place_of_slot[r · top_k + j]` each, among `places`.
    pub(crate) fn new(place_of_slot: &[u32], places: usize, top_k: usize) -> Result<Self> {
        if top_k == 0 || !place_of_slot.len().is_multiple_of(top_k) {
            return Err(ModelError::Input(format!(
                "combine: {} slot places are not rows of {top_k} slots",
                place_of_slot.len()
            )));
        }
        let mut slot_of_place = vec![NO_SLOT; places];
        for (slot, &place) in place_of_slot.iter().enumerate() {
            match slot_of_place.get_mut(place as usize) {
                Some(s) if *s == NO_SLOT => *s = slot as u32,
                Some(_) => {
                    return Err(ModelError::Input(format!(
                        "combine: place {place} is read by two slots"
                    )))
                }
                None => {
                    return Err(ModelError::Input(format!(
                        "combine: place {place} past {places} places"
                    )))
                }
            }
        }
        Ok(SlotPlaces {
            top_k,
            place_of_slot: Arc::new(place_of_slot.to_vec()),
            slot_of_place: Arc::new(slot_of_place),
        })
    }

    /// The places' table on `y`'s device.
    fn place_tensor(&self, y: &Tensor) -> candle_core::Result<Tensor> {
        Tensor::from_slice(
            self.place_of_slot.as_slice(),
            self.place_of_slot.len(),
            y.device(),
        )
    }

    /// Whether the combine runs on `y` `[places, H]` and `gates` (on a device with the row
    /// ops) as one op: both f32 or f64, or 16-bit expert outputs (bf16, f16) with f32 gates.
    pub(crate) fn applies(&self, y_dtype: DType, gates: &Tensor) -> bool {
        let dtypes = match y_dtype {
            DType::F32 | DType::F64 => gates.dtype() == y_dtype,
            DType::BF16 | DType::F16 => gates.dtype() == DType::F32,
            _ => false,
        };
        dtypes && row_ops_run_on(gates) && !self.place_of_slot.is_empty()
    }

    /// The combine's value (nothing differentiated): `out[r] = Σ_j gates[r, j] · y[place(r,
    /// j)]`, in the gates' dtype; 16-bit expert outputs are read widened (exact: the values
    /// of the f32 outputs they widen to), with no widened copy on a GPU.
    pub(crate) fn value(&self, y: &Tensor, gates: &Tensor) -> candle_core::Result<Tensor> {
        let op = CombineSlots {
            top_k: self.top_k,
            slot_of_place: Arc::clone(&self.slot_of_place),
        };
        y.contiguous()?
            .apply_op3_no_bwd(&gates.contiguous()?, &self.place_tensor(y)?, &op)
    }

    /// The gradients `(dy, d gates)` at `y` and `gates` for the output gradient `grad`, as
    /// [`combine_slots`]' backward computes them, `dy` written in `dy_dtype`: the gradient's
    /// own dtype, or a 16-bit float it is rounded to (nearest, ties to even: the values of
    /// casting the f32 `dy`) where the down GEMMs read it in 16 bits. 16-bit `y` is read
    /// widened, as in [`SlotPlaces::value`].
    pub(crate) fn grads(
        &self,
        y: &Tensor,
        gates: &Tensor,
        grad: &Tensor,
        dy_dtype: DType,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let op = CombineSlots {
            top_k: self.top_k,
            slot_of_place: Arc::clone(&self.slot_of_place),
        };
        let (y, gates) = (y.contiguous()?, gates.contiguous()?);
        op.grads(&y, &gates, &self.place_tensor(&y)?, grad, dy_dtype)
    }
}

/// [`combine_slots`]' value for slots in order (slot `r · top_k + j` at place
/// `r · top_k + j`: a device-routed decode step's slots) with nothing differentiated, the
/// output rounded to `round` (a mixed forward's rounding of the block output, in the same
/// pass) where given: one kernel on a GPU, no place table uploaded. `y` `[rows · top_k, H]`,
/// `gates` `[rows, top_k]`; None where the op does not apply (another device or dtype, or an
/// operand to differentiate: the caller takes [`combine_slots`]).
pub(crate) fn combine_slots_in_order(
    y: &Tensor,
    gates: &Tensor,
    round: Option<DType>,
) -> Result<Option<Tensor>> {
    let (places, _) = y.dims2()?;
    let (rows, top_k) = gates.dims2()?;
    if places != rows * top_k {
        return Err(ModelError::Input(format!(
            "combine in order: {places} expert outputs for {rows} rows of {top_k} slots"
        )));
    }
    // f32 / f64 outputs with gates of their dtype, or 16-bit outputs (a device-routed
    // step's experts in their GEMMs' format, on the CPU or a GPU) with f32 gates.
    let sixteen = matches!(y.dtype(), DType::BF16 | DType::F16) && gates.dtype() == DType::F32;
    let applies = ((row_ops_run_on(y) && gates.dtype() == y.dtype()) || sixteen)
        && y.elem_count() > 0
        && rows > 0
        && !y.track_op()
        && !gates.track_op()
        && (round.is_none() || gates.dtype() == DType::F32);
    if !applies {
        return Ok(None);
    }
    Ok(Some(y.contiguous()?.apply_op2_no_bwd(
        &gates.contiguous()?,
        &CombineInOrder { top_k, round },
    )?))
}

/// The in-order combine `(y, gates) → out`, forward only ([`combine_slots_in_order`]).
#[derive(Debug, Clone, Copy)]
struct CombineInOrder {
    top_k: usize,
    /// The 16-bit float the output is rounded to, if any (f32 operands only).
    round: Option<DType>,
}

impl CustomOp2 for CombineInOrder {
    fn name(&self) -> &'static str {
        "r3-combine-slots-in-order"
    }

    /// [`combine_rows`] over the identity places, then the output rounded.
    fn cpu_fwd(
        &self,
        y: &CpuStorage,
        yl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (h, k) = (width(yl), self.top_k);
        let rows = gl.shape().elem_count() / k.max(1);
        let in_order: Vec<u32> = (0..(rows * k) as u32).collect();
        let widened = widened_outputs(y, yl)?;
        let (y, yl) = match &widened {
            Some((wide, wl)) => (wide, wl),
            None => (y, yl),
        };
        let out = match (y, g, self.round) {
            (CpuStorage::F32(y), CpuStorage::F32(g), round) => {
                let mut out = combine_rows(
                    contiguous(y, yl, "expert outputs")?,
                    contiguous(g, gl, "gates")?,
                    &in_order,
                    k,
                    h,
                );
                if let Some(narrow) = round {
                    round_in_place(&mut out, rounding_for(narrow, "combine in order")?);
                }
                CpuStorage::F32(out)
            }
            (CpuStorage::F64(y), CpuStorage::F64(g), None) => CpuStorage::F64(combine_rows(
                contiguous(y, yl, "expert outputs")?,
                contiguous(g, gl, "gates")?,
                &in_order,
                k,
                h,
            )),
            _ => candle_core::bail!(
                "combine in order: expert outputs f32, bf16 or f16 with f32 gates (or both \
                 f64, unrounded)"
            ),
        };
        Ok((out, Shape::from((rows, h))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        yl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let (h, k) = (width(yl), self.top_k);
        let rows = gl.shape().elem_count() / k.max(1);
        let round = cuda::round_code(self.round)?;
        // Block `r` writes output row `r`.
        let out = launch_over_outputs!(
            "r3_combine_in_order",
            "combine in order: expert outputs",
            (y, yl),
            rows * h,
            (rows, h),
            [cuda::view::<f32>(g, gl, "gates")?],
            [k as u32, h as u32, round]
        );
        Ok((out, Shape::from((rows, h))))
    }
}

/// The combine op `(y, gates, place) → out`; it keeps the place → slot table for `dy` on the
/// host (it reaches the device only in a backward: inference does not upload it).
#[derive(Debug, Clone)]
struct CombineSlots {
    top_k: usize,
    slot_of_place: Arc<Vec<u32>>,
}

/// The row width of `y` `[places, H]`.
fn width(yl: &Layout) -> usize {
    yl.shape().dims().last().copied().unwrap_or(1).max(1)
}

/// 16-bit expert outputs widened by candle's cast (exactly: the values a GPU kernel reads
/// widened), with their contiguous layout; None for other dtypes (read as they are).
fn widened_outputs(
    y: &CpuStorage,
    yl: &Layout,
) -> candle_core::Result<Option<(CpuStorage, Layout)>> {
    use candle_core::backend::BackendStorage;
    match y {
        CpuStorage::BF16(_) | CpuStorage::F16(_) => Ok(Some((
            y.to_dtype(yl, DType::F32)?,
            Layout::contiguous(yl.shape()),
        ))),
        _ => Ok(None),
    }
}

/// The rows function of one of the combine ops' CPU passes, for one float type: two float
/// operands, the u32 table, `top_k` and the row width.
type RowsFn<T> = fn(&[T], &[T], &[u32], usize, usize) -> Vec<T>;

/// One combine op's CPU pass: `rows` over two contiguous float operands of one dtype (f32 or
/// f64) and a contiguous u32 table, each operand named for its errors; the table's length
/// comes back with the result (the ops' output shapes follow from it).
fn cpu_pass(
    [(a, al, a_name), (b, bl, b_name)]: [(&CpuStorage, &Layout, &str); 2],
    (ids, il, ids_name): (&CpuStorage, &Layout, &str),
    (k, h): (usize, usize),
    (rows32, rows64): (RowsFn<f32>, RowsFn<f64>),
) -> candle_core::Result<(CpuStorage, usize)> {
    let ids = match ids {
        CpuStorage::U32(ids) => contiguous(ids, il, ids_name)?,
        _ => candle_core::bail!("combine: {ids_name} must be u32"),
    };
    let out = match (a, b) {
        (CpuStorage::F32(a), CpuStorage::F32(b)) => CpuStorage::F32(rows32(
            contiguous(a, al, a_name)?,
            contiguous(b, bl, b_name)?,
            ids,
            k,
            h,
        )),
        (CpuStorage::F64(a), CpuStorage::F64(b)) => CpuStorage::F64(rows64(
            contiguous(a, al, a_name)?,
            contiguous(b, bl, b_name)?,
            ids,
            k,
            h,
        )),
        _ => candle_core::bail!("combine: {a_name} and {b_name} must be both f32 or f64"),
    };
    Ok((out, ids.len()))
}

/// The forward's CPU implementation (the kernel `r3_combine_slots_f32` does the same):
/// products added in slot order from zero.
pub fn combine_rows<T: StdFloat>(
    y: &[T],
    gates: &[T],
    place: &[u32],
    k: usize,
    h: usize,
) -> Vec<T> {
    let rows = gates.len() / k;
    let mut out = vec![T::ZERO; rows * h];
    for (r, dst) in out.chunks_mut(h).enumerate() {
        for j in 0..k {
            let g = gates[r * k + j];
            let src = &y[place[r * k + j] as usize * h..][..h];
            for (d, &v) in dst.iter_mut().zip(src) {
                *d = *d + g * v;
            }
        }
    }
    out
}

impl CustomOp3 for CombineSlots {
    fn name(&self) -> &'static str {
        "r3-combine-slots"
    }

    fn cpu_fwd(
        &self,
        y: &CpuStorage,
        yl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        p: &CpuStorage,
        pl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (h, k) = (width(yl), self.top_k);
        let widened = widened_outputs(y, yl)?;
        let (y, yl) = match &widened {
            Some((wide, wl)) => (wide, wl),
            None => (y, yl),
        };
        let (out, slots) = cpu_pass(
            [(y, yl, "expert outputs"), (g, gl, "gates")],
            (p, pl, "slot places"),
            (k, h),
            (combine_rows, combine_rows),
        )?;
        Ok((out, Shape::from((slots / k, h))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        yl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        p: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let (h, k) = (width(yl), self.top_k);
        let rows = gl.shape().elem_count() / k;
        // Block `r` writes output row `r`.
        let out = launch_over_outputs!(
            "r3_combine_slots",
            "combine: expert outputs",
            (y, yl),
            rows * h,
            (rows, h),
            [
                cuda::view::<f32>(g, gl, "gates")?,
                cuda::view::<u32>(p, pl, "slot places")?
            ],
            [k as u32, h as u32]
        );
        Ok((out, Shape::from((rows, h))))
    }

    fn bwd(
        &self,
        y: &Tensor,
        gates: &Tensor,
        place: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dy, dg) = self.grads(y, gates, place, grad, grad.dtype())?;
        Ok((Some(dy), Some(dg), None))
    }
}

impl CombineSlots {
    /// `(dy, d gates)` for the output gradient `grad`, `dy` in `dy_dtype` (the gradient's
    /// dtype or a 16-bit float it is rounded to).
    fn grads(
        &self,
        y: &Tensor,
        gates: &Tensor,
        place: &Tensor,
        grad: &Tensor,
        dy_dtype: DType,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let grad = grad.contiguous()?;
        let k = self.top_k;
        let slots = Tensor::from_slice(
            self.slot_of_place.as_slice(),
            self.slot_of_place.len(),
            grad.device(),
        )?;
        let dy = grad.apply_op3_no_bwd(
            gates,
            &slots,
            &CombineDy {
                top_k: k,
                out: dy_dtype,
            },
        )?;
        let dg = y.apply_op3_no_bwd(&grad, place, &CombineDgates { top_k: k })?;
        Ok((dy, dg))
    }
}

/// `dy[p] = gates[s] · d out[s / top_k]` for the slot `s` reading place `p`, zero where no
/// slot does: `(d out, gates, slot_of_place) → dy` `[places, H]` in `out`.
#[derive(Debug, Clone, Copy)]
struct CombineDy {
    top_k: usize,
    /// The dtype `dy` is written in: the output gradient's, or a 16-bit float (rounded to
    /// nearest, ties to even, as a cast of the wide `dy` would).
    out: DType,
}

/// [`CombineDy`]'s CPU implementation (the kernel `r3_combine_slots_dy_f32` does the same).
fn combine_dy_rows<T: StdFloat>(
    dout: &[T],
    gates: &[T],
    slot_of_place: &[u32],
    k: usize,
    h: usize,
) -> Vec<T> {
    let mut dy = vec![T::ZERO; slot_of_place.len() * h];
    for (dst, &s) in dy.chunks_mut(h).zip(slot_of_place) {
        if s == NO_SLOT {
            continue;
        }
        let g = gates[s as usize];
        let src = &dout[s as usize / k * h..][..h];
        for (d, &v) in dst.iter_mut().zip(src) {
            *d = g * v;
        }
    }
    dy
}

impl CustomOp3 for CombineDy {
    fn name(&self) -> &'static str {
        "r3-combine-slots-dy"
    }

    fn cpu_fwd(
        &self,
        d: &CpuStorage,
        dl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        s: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let h = width(dl);
        let (dy, places) = cpu_pass(
            [(d, dl, "output gradient"), (g, gl, "gates")],
            (s, sl, "place slots"),
            (self.top_k, h),
            (combine_dy_rows, combine_dy_rows),
        )?;
        let shape = Shape::from((places, h));
        let dy = match self.out == dy.dtype() {
            true => dy,
            false => dy.to_dtype(&Layout::contiguous(&shape), self.out)?,
        };
        Ok((dy, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        d: &candle_core::CudaStorage,
        dl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        s: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let h = width(dl);
        let places = sl.shape().elem_count();
        macro_rules! dy {
            ($kernel:expr, $out:ty) => {
                // Block `p` writes row `p` of `dy` (zeros for a padding place).
                cuda::launch_typed!(
                    cuda::device(d),
                    $kernel,
                    $out,
                    places * h,
                    cuda::per_row(places, cuda::row_threads(h))?,
                    [
                        cuda::view::<f32>(d, dl, "output gradient")?,
                        cuda::view::<f32>(g, gl, "gates")?,
                        cuda::view::<u32>(s, sl, "place slots")?
                    ],
                    [self.top_k as u32, h as u32, NO_SLOT]
                )
            };
        }
        let dy = match self.out {
            DType::F32 => dy!("r3_combine_slots_dy_f32", f32),
            DType::BF16 => dy!("r3_combine_slots_dy_bf16", half::bf16),
            DType::F16 => dy!("r3_combine_slots_dy_f16", half::f16),
            dt => candle_core::bail!("combine: a gradient of the expert outputs in {dt:?}"),
        };
        Ok((dy, Shape::from((places, h))))
    }
}

/// `d gates[s] = d out[s / top_k] · y[place[s]]`: `(y, d out, place) → d gates`
/// `[rows, top_k]`.
#[derive(Debug, Clone, Copy)]
struct CombineDgates {
    top_k: usize,
}

/// [`CombineDgates`]'s CPU implementation (the kernel `r3_combine_slots_dgates_f32` sums the
/// products in another order: a block reduction).
fn combine_dgates_rows<T: StdFloat>(
    y: &[T],
    dout: &[T],
    place: &[u32],
    k: usize,
    h: usize,
) -> Vec<T> {
    place
        .iter()
        .enumerate()
        .map(|(s, &p)| {
            let yr = &y[p as usize * h..][..h];
            let dr = &dout[s / k * h..][..h];
            yr.iter().zip(dr).fold(T::ZERO, |acc, (&a, &b)| acc + a * b)
        })
        .collect()
}

impl CustomOp3 for CombineDgates {
    fn name(&self) -> &'static str {
        "r3-combine-slots-dgates"
    }

    fn cpu_fwd(
        &self,
        y: &CpuStorage,
        yl: &Layout,
        d: &CpuStorage,
        dl: &Layout,
        p: &CpuStorage,
        pl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let h = width(yl);
        let widened = widened_outputs(y, yl)?;
        let (y, yl) = match &widened {
            Some((wide, wl)) => (wide, wl),
            None => (y, yl),
        };
        let (dg, slots) = cpu_pass(
            [(y, yl, "expert outputs"), (d, dl, "output gradient")],
            (p, pl, "slot places"),
            (self.top_k, h),
            (combine_dgates_rows, combine_dgates_rows),
        )?;
        Ok((dg, Shape::from((slots / self.top_k, self.top_k))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        yl: &Layout,
        d: &candle_core::CudaStorage,
        dl: &Layout,
        p: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let h = width(yl);
        let slots = pl.shape().elem_count();
        // Block `s` writes slot `s`'s gate gradient.
        let dg = launch_over_outputs!(
            "r3_combine_slots_dgates",
            "combine: expert outputs",
            (y, yl),
            slots,
            (slots, h),
            [
                cuda::view::<f32>(d, dl, "output gradient")?,
                cuda::view::<u32>(p, pl, "slot places")?
            ],
            [self.top_k as u32, h as u32]
        );
        Ok((dg, Shape::from((slots / self.top_k, self.top_k))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::gather_rows::GatherRows;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::{DType, Var, D};

    /// The composed form the op replaces: gather the slots' rows, weight, sum.
    fn composed(y: &Tensor, gates: &Tensor, place: &[u32]) -> Tensor {
        let (rows, k) = gates.dims2().expect("gates");
        let (places, h) = y.dims2().expect("y");
        GatherRows::new(place.to_vec(), places, places)
            .and_then(|g| g.apply(y))
            .and_then(|s| Ok(s.reshape((rows, k, h))?))
            .and_then(|s| Ok(s.broadcast_mul(&gates.unsqueeze(D::Minus1)?)?.sum(1)?))
            .expect("composed")
    }

    /// Value and both gradients equal the composed ops (f64 to 1e-12, f32 to 1e-6), with
    /// padding places that get exactly zero gradient.
    #[test]
    fn equals_the_composed_gather_weight_sum() {
        // 5 rows top-2 over 12 places; places 7 and 11 are padding
        let place = [0u32, 4, 1, 5, 2, 6, 8, 9, 10, 3];
        for dtype in [DType::F64, DType::F32] {
            let y = Var::from_tensor(&seeded_tensor(&[12, 6], 1, dtype)).expect("y");
            let gates = Var::from_tensor(&seeded_tensor(&[5, 2], 2, dtype)).expect("gates");
            let probe = seeded_tensor(&[5, 6], 3, dtype);
            let want = composed(y.as_tensor(), gates.as_tensor(), &place);
            let got = combine_slots(y.as_tensor(), gates.as_tensor(), &place)
                .expect("combine")
                .expect("applies on the CPU");
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-6 };
            assert!(max_abs_diff(&got, &want) < tol, "{dtype:?} value");
            let grads = |out: &Tensor| {
                let g = (out * &probe)
                    .and_then(|l| l.sum_all())
                    .and_then(|l| l.backward())
                    .expect("backward");
                [&y, &gates].map(|v| g.get(v.as_tensor()).expect("grad").clone())
            };
            let (gw, gg) = (grads(&want), grads(&got));
            for (name, (a, b)) in ["dy", "dgates"].iter().zip(gw.iter().zip(gg.iter())) {
                assert!(max_abs_diff(a, b) < tol, "{dtype:?} {name}");
            }
            for padding in [7, 11] {
                let row = gg[0].get(padding).expect("row");
                assert_eq!(max_abs_diff(&row, &row.zeros_like().expect("z")), 0.0);
            }
        }
    }

    /// The padded experts' combine over 16-bit expert outputs (f32 gates) is the f32
    /// combine over the outputs widened, bit for bit: the value, the gate gradient, and the
    /// outputs' gradient written in the 16-bit float the cast of the f32 one gives — zeros
    /// on padding places; 16-bit outputs with 16-bit gates are not taken.
    #[test]
    fn sixteen_bit_expert_outputs_combine_as_their_widened_values() {
        let bits = crate::test_util::f64_bits;
        // 5 rows top-2 over 12 places; places 7 and 11 are padding
        let place = [0u32, 4, 1, 5, 2, 6, 8, 9, 10, 3];
        let slots = SlotPlaces::new(&place, 12, 2).expect("slots");
        let gates = seeded_tensor(&[5, 2], 2, DType::F32);
        let grad = seeded_tensor(&[5, 6], 3, DType::F32);
        for narrow in [DType::BF16, DType::F16] {
            let y = seeded_tensor(&[12, 6], 1, narrow);
            let wide = y.to_dtype(DType::F32).expect("widened");
            assert!(slots.applies(narrow, &gates), "{narrow:?}");
            assert!(!slots.applies(narrow, &gates.to_dtype(narrow).expect("g")));
            let got = slots.value(&y, &gates).expect("16-bit value");
            let want = slots.value(&wide, &gates).expect("f32 value");
            assert_eq!(got.dtype(), DType::F32);
            assert_eq!(bits(&got), bits(&want), "{narrow:?} value");
            let (dy, dg) = slots.grads(&y, &gates, &grad, narrow).expect("16-bit");
            let (dy_wide, dg_wide) = slots.grads(&wide, &gates, &grad, DType::F32).expect("f32");
            assert_eq!(dy.dtype(), narrow);
            let cast = dy_wide.to_dtype(narrow).expect("cast");
            assert_eq!(bits(&dy), bits(&cast), "{narrow:?} dy");
            assert_eq!(bits(&dg), bits(&dg_wide), "{narrow:?} dgates");
            // The rounding is there: the wide dy has values no 16-bit float holds.
            assert_ne!(bits(&dy), bits(&dy_wide), "{narrow:?} dy rounded");
            for padding in [7, 11] {
                let row = dy.get(padding).expect("row");
                assert_eq!(max_abs_diff(&row, &row.zeros_like().expect("z")), 0.0);
            }
        }
    }

    /// The in-order combine equals `combine_slots` over the identity places bit for bit,
    /// then `Precision::round` where it rounds (bf16, f16; f32 and f64 unrounded); it does
    /// not apply to an operand being differentiated, and a mismatched shape is an error.
    #[test]
    fn the_in_order_combine_equals_the_combine_then_the_rounding() {
        use crate::precision::Precision;
        let bits = crate::test_util::f64_bits;
        let (rows, k, h) = (5, 3, 7);
        let in_order: Vec<u32> = (0..(rows * k) as u32).collect();
        for (dtype, precision) in [
            (DType::F64, Precision::F32),
            (DType::F32, Precision::F32),
            (DType::F32, Precision::Bf16 { router_f32: false }),
            (DType::F32, Precision::F16 { router_f32: false }),
        ] {
            let y = seeded_tensor(&[rows * k, h], 4, dtype);
            let gates = seeded_tensor(&[rows, k], 5, dtype);
            let want = combine_slots(&y, &gates, &in_order)
                .expect("combine")
                .expect("applies");
            let want = precision.round(&want).expect("rounded");
            let got = combine_slots_in_order(&y, &gates, precision.narrow_dtype())
                .expect("in order")
                .expect("applies on the CPU");
            assert_eq!(bits(&got), bits(&want), "{dtype:?} {precision:?}");
        }
        // 16-bit expert outputs with f32 gates: the values of the f32 outputs they widen to.
        for narrow in [DType::BF16, DType::F16] {
            let y = seeded_tensor(&[rows * k, h], 4, narrow);
            let gates = seeded_tensor(&[rows, k], 5, DType::F32);
            let wide = y.to_dtype(DType::F32).expect("widened");
            for round in [None, Some(narrow)] {
                let got = combine_slots_in_order(&y, &gates, round)
                    .expect("16-bit")
                    .expect("applies on the CPU");
                let want = combine_slots_in_order(&wide, &gates, round)
                    .expect("f32")
                    .expect("applies");
                assert_eq!(bits(&got), bits(&want), "{narrow:?} {round:?}");
            }
        }
        let y = Var::from_tensor(&seeded_tensor(&[rows * k, h], 4, DType::F32)).expect("y");
        let gates = seeded_tensor(&[rows, k], 5, DType::F32);
        assert!(combine_slots_in_order(y.as_tensor(), &gates, None)
            .expect("tracked")
            .is_none());
        let short = seeded_tensor(&[rows * k - 1, h], 4, DType::F32);
        assert!(combine_slots_in_order(&short, &gates, None).is_err());
    }

    /// Places read twice or past the expert outputs, and a slot count that does not fit the
    /// gates, are errors naming what is wrong.
    #[test]
    fn bad_places_are_errors() {
        let y = seeded_tensor(&[4, 3], 1, DType::F32);
        let gates = seeded_tensor(&[2, 1], 2, DType::F32);
        let twice = combine_slots(&y, &gates, &[1, 1]).expect_err("twice");
        assert!(
            twice.to_string().contains("place 1 is read by two slots"),
            "{twice}"
        );
        let past = combine_slots(&y, &gates, &[0, 4]).expect_err("past");
        assert!(past.to_string().contains("place 4 past 4 places"), "{past}");
        let short = combine_slots(&y, &gates, &[0]).expect_err("short");
        assert!(
            short.to_string().contains("1 slot places for 2 rows"),
            "{short}"
        );
    }
}
