//! One MoE layer's routed experts as a single custom op with its own backward:
//! `y[r] = Σ_j g[r, j] · SwiGLU_{e(r, j)}(x[r])`, from the dispatch of rows to experts through
//! the grouped expert GEMMs (experts in parallel) to the gate-weighted combine.
//!
//! Built from candle's ops the same layer is a row gather, the experts, a gate multiply and
//! an `index_add`, each over `[rows · top_k, H]` and each with its own gradient pass in the
//! backward (upstream candle also zero-filled and added a buffer per node; the vendored one
//! does not). Here the `[rows · top_k, H]` intermediates stay inside the op.
//!
//! Candle's custom ops take at most three operands, so the gates travel with the rows: the
//! first operand is `[rows, H + top_k]`, each row's hidden state followed by its gates, and
//! its gradient is laid out the same way.
//!
//! In bf16 / f16 training ([`Precision`]) the op rounds where the composed ops round (each
//! expert's input rows and weights, its gate/up product, SwiGLU output and output), and its
//! backward rounds each gradient where the composed ops' rounding points do (a rounding's
//! gradient is the incoming one rounded): the same values up to the order of the f32 sums.
//! Composed, the bf16 layer sliced every expert out of the stacks, and candle's backward built
//! a zero-filled stack-sized gradient per expert and added them (5× slower than f32 on the
//! CPU); here each expert's job rounds its two matrices into one scratch buffer in turn.

use std::mem::MaybeUninit;
use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::dispatch::Dispatch;
use crate::host::{contiguous, with_host};
use crate::layers::gemm::{assume_init_vec, fill_zero, matmul_unfilled, unfilled, MatRef};
use crate::math::Float;
use crate::precision::Precision;
use crate::round16::rounding_to;

/// Hidden and intermediate widths of the experts.
#[derive(Debug, Clone, Copy)]
struct Dims {
    hidden: usize,
    inter: usize,
}

/// What the forward keeps for the backward: the `[rows · top_k, 2I]` gate/up activations and
/// the `[rows · top_k, H]` expert outputs, both in expert order. At a 16-bit precision both
/// are rounded by the forward, so they are kept in that float (exactly, half the bytes of
/// f32) and widened for the backward.
struct Saved {
    h: CpuStorage,
    o: CpuStorage,
}

impl Saved {
    /// `values` as the forward keeps them: in `narrow` where the op rounds to it (f32 values
    /// that are `narrow` numbers), else as computed.
    fn keep(values: CpuStorage, narrow: Option<DType>) -> candle_core::Result<CpuStorage> {
        use candle_core::backend::BackendStorage;
        match narrow {
            Some(narrow) if values.dtype() == DType::F32 => {
                let len = values.as_slice::<f32>()?.len();
                values.to_dtype(&Layout::contiguous(len), narrow)
            }
            _ => Ok(values),
        }
    }

    /// A kept buffer in the op's float `T`: as it is, or widened (exactly) from the 16-bit
    /// float it was kept in, into `widened`.
    fn read<'a, T: WithDType>(
        kept: &'a CpuStorage,
        widened: &'a mut Option<CpuStorage>,
    ) -> candle_core::Result<&'a [T]> {
        use candle_core::backend::BackendStorage;
        if kept.dtype() == T::DTYPE {
            return kept.as_slice::<T>();
        }
        let len = match kept {
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            other => candle_core::bail!(
                "routed experts: kept activations of {:?} for a {:?} backward",
                other.dtype(),
                T::DTYPE
            ),
        };
        widened
            .insert(kept.to_dtype(&Layout::contiguous(len), T::DTYPE)?)
            .as_slice::<T>()
    }
}

/// The routed-experts op `(rows with gates, gate_up, down) → y`.
pub(crate) struct RoutedSwiGlu {
    dispatch: Dispatch,
    /// The 16-bit float the rounding points round to; None in f32 / f64.
    narrow: Option<DType>,
    saved: Mutex<Option<Saved>>,
}

impl RoutedSwiGlu {
    /// The op for one dispatch, rounding as `precision` rounds (bf16 / f16 need f32 operands).
    pub fn new(dispatch: Dispatch, precision: Precision) -> Self {
        RoutedSwiGlu {
            dispatch,
            narrow: precision.narrow_dtype(),
            saved: Mutex::new(None),
        }
    }
}

/// The op's rounding points: each one rounds a buffer in place to the op's 16-bit float, or
/// leaves it as it is (f32 / f64).
#[derive(Clone, Copy)]
struct Rounding<T>(Option<fn(&mut [T])>);

impl<T: Copy> Rounding<T> {
    /// Rounds `v` in place.
    fn apply(self, v: &mut [T]) {
        if let Some(round) = self.0 {
            round(v);
        }
    }

    /// The weights `w` as the products read them: `w` itself, or its rounded copy in
    /// `scratch` (one expert's matrix, in its job's own buffer).
    fn weights<'a>(self, w: &'a [T], scratch: &'a mut Vec<T>) -> &'a [T] {
        match self.0 {
            None => w,
            Some(round) => {
                scratch.clear();
                scratch.extend_from_slice(w);
                round(scratch);
                scratch
            }
        }
    }
}

/// An expert stack as the op reads it: in the rows' own float, or in bf16 (a trainer holding
/// its matrices in bf16 with no f32 master: `train.master_weights = "bf16"`; the values the
/// bf16 rounding gives already), widened one expert's matrix at a time into its job's scratch
/// buffer, where an f32 stack is rounded into it.
#[derive(Clone, Copy)]
enum Stack<'a, T> {
    Own(&'a [T]),
    Bf16(&'a [half::bf16]),
}

impl<'a, T: Float> Stack<'a, T> {
    /// The elements `range` (one expert's matrix) as the products read them: the stack's own
    /// (rounded into `scratch` where `round` rounds), or the bf16 values widened into it.
    fn matrix<'s>(
        self,
        range: std::ops::Range<usize>,
        round: Rounding<T>,
        scratch: &'s mut Vec<T>,
    ) -> &'s [T]
    where
        'a: 's,
    {
        match self {
            Stack::Own(w) => round.weights(&w[range], scratch),
            Stack::Bf16(w) => {
                scratch.clear();
                scratch.extend(w[range].iter().map(|v| T::from_f64(f64::from(v.to_f32()))));
                scratch
            }
        }
    }
}

/// Runs `f` on a CPU stack `w`: bf16 as it is, else as `T` (the rows' float).
fn with_stack<T: WithDType, R>(
    w: &Tensor,
    f: impl FnOnce(Stack<'_, T>) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    match w.dtype() {
        DType::BF16 => with_host::<half::bf16, _>(w, |w| f(Stack::Bf16(w))),
        _ => with_host::<T, _>(w, |w| f(Stack::Own(w))),
    }
}

/// Splits a row-major buffer into the row groups `offsets` describes.
fn split_groups<'a, T>(mut buf: &'a mut [T], offsets: &[usize], width: usize) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(offsets.len().saturating_sub(1));
    for w in offsets.windows(2) {
        let (head, tail) = buf.split_at_mut((w[1] - w[0]) * width);
        out.push(head);
        buf = tail;
    }
    out
}

/// `split_groups` where the buffer is wanted, else one `None` per group.
fn optional_groups<'a, T>(
    buf: &'a mut [T],
    wanted: bool,
    offsets: &[usize],
    width: usize,
) -> Vec<Option<&'a mut [T]>> {
    if wanted {
        split_groups(buf, offsets, width)
            .into_iter()
            .map(Some)
            .collect()
    } else {
        offsets.windows(2).map(|_| None).collect()
    }
}

/// Runs `work` on every job: across the rayon pool when each job's GEMMs run on one thread
/// (`threads == 1`), else one job after another with the GEMMs using every thread.
fn run_jobs<J: Send>(jobs: Vec<J>, threads: usize, work: impl Fn(J) + Sync + Send) {
    if threads == 1 {
        jobs.into_par_iter().for_each(work);
    } else {
        jobs.into_iter().for_each(work);
    }
}

/// Threads inside each expert's GEMM: one when there are enough groups to keep every thread
/// busy across experts, else all of them.
fn inner_threads(offsets: &[usize]) -> usize {
    let threads = candle_core::utils::get_num_threads();
    let busy = offsets.windows(2).filter(|w| w[1] > w[0]).count();
    if busy >= 4 * threads {
        1
    } else {
        threads
    }
}

/// `silu(gate) · up` of each `[gate | up]` row of `h` (`2I` wide).
fn swiglu_rows<T: Float>(h: &[T], id: usize) -> Vec<T> {
    let mut a = unfilled::<T>(h.len() / 2);
    for (hr, ar) in h.chunks_exact(2 * id).zip(a.chunks_exact_mut(id)) {
        let (g, u) = hr.split_at(id);
        for ((&g, &u), a) in g.iter().zip(u).zip(ar) {
            a.write(g * g.sigmoid() * u);
        }
    }
    // SAFETY: the rows tile `a` and the loop wrote every element of each.
    unsafe { assume_init_vec(a) }
}

/// For `[gate | up]` rows `h` and the gradient `da` at `a = silu(gate) · up`: returns `a`
/// (recomputed) and the `[d gate | d up]` rows.
fn swiglu_backward_rows<T: Float>(h: &[T], da: &[T], id: usize) -> (Vec<T>, Vec<T>) {
    let mut a = unfilled::<T>(da.len());
    let mut dh = unfilled::<T>(h.len());
    let rows = h
        .chunks_exact(2 * id)
        .zip(da.chunks_exact(id))
        .zip(a.chunks_exact_mut(id).zip(dh.chunks_exact_mut(2 * id)));
    for ((hr, dar), (ar, dhr)) in rows {
        let (g, u) = hr.split_at(id);
        let (dg, du) = dhr.split_at_mut(id);
        // equal-length slices and an index loop: the form LLVM vectorises
        let (u, dar, ar, dg, du) = (
            &u[..id],
            &dar[..id],
            &mut ar[..id],
            &mut dg[..id],
            &mut du[..id],
        );
        for c in 0..id {
            let (g, u, da) = (g[c], u[c], dar[c]);
            let s = g.sigmoid();
            let silu = g * s;
            ar[c].write(silu * u);
            // d silu(g)/dg = s · (1 + g · (1 − s))
            dg[c].write(da * u * s * (T::ONE + g * (T::ONE - s)));
            du[c].write(da * silu);
        }
    }
    // SAFETY: the rows tile both buffers and the loop wrote every element of each.
    unsafe { (assume_init_vec(a), assume_init_vec(dh)) }
}

/// The operand rows: `[rows, H + top_k]`, hidden state then gates.
#[derive(Clone, Copy)]
struct Rows<'a, T> {
    data: &'a [T],
    hidden: usize,
    top_k: usize,
}

impl<'a, T: Float> Rows<'a, T> {
    fn width(&self) -> usize {
        self.hidden + self.top_k
    }

    fn hidden_of(&self, row: usize) -> &'a [T] {
        let from = row * self.width();
        &self.data[from..from + self.hidden]
    }

    fn gate(&self, slot: usize) -> T {
        let (row, j) = (slot / self.top_k, slot % self.top_k);
        self.data[row * self.width() + self.hidden + j]
    }

    /// `[m, H]` hidden states of the given slots' rows.
    fn gather(&self, slots: &[u32]) -> Vec<T> {
        let mut out = Vec::with_capacity(slots.len() * self.hidden);
        for &s in slots {
            out.extend_from_slice(self.hidden_of(s as usize / self.top_k));
        }
        out
    }
}

/// One expert's forward job: its index and its (unfilled) spans of `h` and `o`.
type ExpertSpans<'a, T> = (usize, (&'a mut [MaybeUninit<T>], &'a mut [MaybeUninit<T>]));

/// Expert outputs `o` and activations `h` (expert order), and the combined `y` `[rows, H]`.
struct Forward<T> {
    y: Vec<T>,
    h: Vec<T>,
    o: Vec<T>,
}

fn routed_forward<T: Float>(
    rows: Rows<'_, T>,
    w1: Stack<'_, T>,
    w2: Stack<'_, T>,
    disp: &Dispatch,
    d: Dims,
    round: Rounding<T>,
) -> Forward<T> {
    let (hd, id) = (d.hidden, d.inter);
    let offsets = disp.offsets();
    let places = offsets.last().copied().unwrap_or(0);
    // The experts' spans tile the expert order and each expert's products write its span.
    let mut h = unfilled::<T>(places * 2 * id);
    let mut o = unfilled::<T>(places * hd);
    let threads = inner_threads(offsets);
    let work = |(j, (hj, oj)): ExpertSpans<'_, T>| {
        let (from, to) = (offsets[j], offsets[j + 1]);
        let m = to - from;
        if m == 0 {
            return;
        }
        let mut xj = rows.gather(&disp.slots()[from..to]);
        round.apply(&mut xj);
        let mut scratch = Vec::new();
        let w1j = w1.matrix(j * 2 * id * hd..(j + 1) * 2 * id * hd, round, &mut scratch);
        let w1j = MatRef::transposed(w1j, hd);
        let hj = matmul_unfilled(m, 2 * id, hd, hj, MatRef::row_major(&xj, hd), w1j, threads);
        round.apply(hj);
        let mut a = swiglu_rows(hj, id);
        round.apply(&mut a);
        let w2j = w2.matrix(j * hd * id..(j + 1) * hd * id, round, &mut scratch);
        let w2j = MatRef::transposed(w2j, id);
        round.apply(matmul_unfilled(
            m,
            hd,
            id,
            oj,
            MatRef::row_major(&a, id),
            w2j,
            threads,
        ));
    };
    let jobs: Vec<_> = split_groups(&mut h, offsets, 2 * id)
        .into_iter()
        .zip(split_groups(&mut o, offsets, hd))
        .enumerate()
        .collect();
    run_jobs(jobs, threads, work);
    // SAFETY: the spans tile the expert order (`Dispatch` builds them so) and each job wrote
    // its span above.
    let (h, o) = unsafe { (assume_init_vec(h), assume_init_vec(o)) };
    let k = disp.top_k();
    let mut y = vec![T::ZERO; disp.rows() * hd];
    y.par_chunks_mut(hd).enumerate().for_each(|(r, yr)| {
        for slot in r * k..(r + 1) * k {
            let g = rows.gate(slot);
            let p = disp.places()[slot] as usize;
            for (y, &o) in yr.iter_mut().zip(&o[p * hd..(p + 1) * hd]) {
                *y = *y + g * o;
            }
        }
    });
    Forward { y, h, o }
}

/// Gradients of the op: the `[rows, H + top_k]` operand gradient and `dW1`, `dW2`, each
/// `None` where not wanted.
struct RoutedGrads<T> {
    drows: Option<Vec<T>>,
    dw1: Option<Vec<T>>,
    dw2: Option<Vec<T>>,
}

/// One expert's backward job: its index and its (unfilled) slices of the per-place input
/// gradient, `dW1` and `dW2`.
type ExpertJob<'a, T> = (
    usize,
    Option<&'a mut [MaybeUninit<T>]>,
    Option<&'a mut [MaybeUninit<T>]>,
    Option<&'a mut [MaybeUninit<T>]>,
);

/// Which gradients the backward computes.
#[derive(Debug, Clone, Copy)]
struct Wanted {
    rows: bool,
    dw1: bool,
    dw2: bool,
}

/// Operands and saved activations of one backward.
struct BackwardInputs<'a, T> {
    rows: Rows<'a, T>,
    w1: Stack<'a, T>,
    w2: Stack<'a, T>,
    h: &'a [T],
    o: &'a [T],
    dy: &'a [T],
}

fn routed_backward<T: Float>(
    inp: BackwardInputs<'_, T>,
    disp: &Dispatch,
    d: Dims,
    wanted: Wanted,
    round: Rounding<T>,
) -> RoutedGrads<T> {
    let (hd, id) = (d.hidden, d.inter);
    let offsets = disp.offsets();
    let places = offsets.last().copied().unwrap_or(0);
    let experts = offsets.len() - 1;
    // Every job writes all of its slices (zeros for an expert without rows) and the jobs
    // tile the buffers, so none needs a zero fill first.
    let mut dxp = unfilled::<T>(if wanted.rows { places * hd } else { 0 });
    let mut dw1 = unfilled::<T>(if wanted.dw1 { experts * 2 * id * hd } else { 0 });
    let mut dw2 = unfilled::<T>(if wanted.dw2 { experts * hd * id } else { 0 });
    let threads = inner_threads(offsets);
    let per_expert: Vec<usize> = (0..=experts).collect();
    let jobs: Vec<ExpertJob<'_, T>> = optional_groups(&mut dxp, wanted.rows, offsets, hd)
        .into_iter()
        .zip(optional_groups(
            &mut dw1,
            wanted.dw1,
            &per_expert,
            2 * id * hd,
        ))
        .zip(optional_groups(&mut dw2, wanted.dw2, &per_expert, hd * id))
        .enumerate()
        .map(|(j, ((a, b), c))| (j, a, b, c))
        .collect();
    run_jobs(jobs, threads, |job| {
        expert_backward(job, &inp, disp, d, threads, round)
    });
    // SAFETY: the jobs tile each wanted buffer and every job wrote all of its slices.
    let (dxp, dw1, dw2) = unsafe {
        (
            assume_init_vec(dxp),
            assume_init_vec(dw1),
            assume_init_vec(dw2),
        )
    };
    RoutedGrads {
        drows: wanted.rows.then(|| row_gradients(&inp, disp, hd, &dxp)),
        dw1: wanted.dw1.then_some(dw1),
        dw2: wanted.dw2.then_some(dw2),
    }
}

/// One expert's share of the backward: from the gate-weighted output gradient of its rows
/// through its SwiGLU to its slices of `dW2`, `dW1` and the per-place input gradient, each
/// gradient rounded where the forward rounded the value it belongs to.
fn expert_backward<T: Float>(
    (j, dxj, dw1j, dw2j): ExpertJob<'_, T>,
    inp: &BackwardInputs<'_, T>,
    disp: &Dispatch,
    d: Dims,
    threads: usize,
    round: Rounding<T>,
) {
    let (hd, id) = (d.hidden, d.inter);
    let (rows, dy) = (inp.rows, inp.dy);
    let offsets = disp.offsets();
    let (from, to) = (offsets[j], offsets[j + 1]);
    let m = to - from;
    if m == 0 {
        // an expert no row went to: zero weight gradients (its input slice is empty)
        dw1j.map(fill_zero);
        dw2j.map(fill_zero);
        return;
    }
    let slots = &disp.slots()[from..to];
    // gradient at this expert's outputs: each row's output gradient times its gate
    let mut go = Vec::with_capacity(m * hd);
    for &s in slots {
        let (s, g) = (s as usize, rows.gate(s as usize));
        let r = s / disp.top_k();
        go.extend(dy[r * hd..(r + 1) * hd].iter().map(|&v| g * v));
    }
    // the gradient at the rounded expert output
    round.apply(&mut go);
    let hj = &inp.h[from * 2 * id..to * 2 * id];
    let mut scratch = Vec::new();
    let w2j = inp
        .w2
        .matrix(j * hd * id..(j + 1) * hd * id, round, &mut scratch);
    // da = go · W2 (W2 is [H, I], read as-is)
    let mut da = unfilled::<T>(m * id);
    let da = matmul_unfilled(
        m,
        id,
        hd,
        &mut da,
        MatRef::row_major(&go, hd),
        MatRef::row_major(w2j, id),
        threads,
    );
    // at the rounded SwiGLU output
    round.apply(da);
    let (mut a, mut dh) = swiglu_backward_rows(hj, da, id);
    // the SwiGLU output as the forward's second product read it; the gradient at the
    // rounded gate/up product
    round.apply(&mut a);
    round.apply(&mut dh);
    if let Some(dw2j) = dw2j {
        // dW2 = goᵀ · a, at the rounded weights
        round.apply(matmul_unfilled(
            hd,
            id,
            m,
            dw2j,
            MatRef::transposed(&go, hd),
            MatRef::row_major(&a, id),
            threads,
        ));
    }
    if let Some(dw1j) = dw1j {
        // dW1 = dhᵀ · x, at the rounded weights
        let mut xj = rows.gather(slots);
        round.apply(&mut xj);
        round.apply(matmul_unfilled(
            2 * id,
            hd,
            m,
            dw1j,
            MatRef::transposed(&dh, 2 * id),
            MatRef::row_major(&xj, hd),
            threads,
        ));
    }
    if let Some(dxj) = dxj {
        // dx = dh · W1 (W1 is [2I, H], read as-is), per place, at the rounded input rows
        let w1j = inp
            .w1
            .matrix(j * 2 * id * hd..(j + 1) * 2 * id * hd, round, &mut scratch);
        round.apply(matmul_unfilled(
            m,
            hd,
            2 * id,
            dxj,
            MatRef::row_major(&dh, 2 * id),
            MatRef::row_major(w1j, hd),
            threads,
        ));
    }
}

/// The `[rows, H + top_k]` operand gradient: per row, the sum of its places' input
/// gradients `dxp`, then `dy[r] · o(place)` for each of its gates.
fn row_gradients<T: Float>(
    inp: &BackwardInputs<'_, T>,
    disp: &Dispatch,
    hd: usize,
    dxp: &[T],
) -> Vec<T> {
    let (k, width) = (disp.top_k(), inp.rows.width());
    let mut drows = vec![T::ZERO; disp.rows() * width];
    drows.par_chunks_mut(width).enumerate().for_each(|(r, dr)| {
        let (dx, dg) = dr.split_at_mut(hd);
        let dyr = &inp.dy[r * hd..(r + 1) * hd];
        for (j, dg) in dg.iter_mut().enumerate() {
            let p = disp.places()[r * k + j] as usize;
            for (dx, &v) in dx.iter_mut().zip(&dxp[p * hd..(p + 1) * hd]) {
                *dx = *dx + v;
            }
            let dot = dyr
                .iter()
                .zip(&inp.o[p * hd..(p + 1) * hd])
                .fold(T::ZERO, |acc, (&a, &b)| acc + a * b);
            *dg = dot;
        }
    });
    drows
}

impl RoutedSwiGlu {
    /// Shapes of the three operands, checked against each other and the dispatch.
    fn dims(&self, x: &Shape, w1: &Shape, w2: &Shape) -> candle_core::Result<Dims> {
        let (rows, width) = x.dims2()?;
        let (e, two_i, hd) = w1.dims3()?;
        let (e2, hd2, id) = w2.dims3()?;
        let k = self.dispatch.top_k();
        if width != hd + k || hd2 != hd || e2 != e || two_i != 2 * id {
            candle_core::bail!(
                "routed experts: rows {x:?} (hidden + top-{k} gates), gate_up {w1:?} and down {w2:?} do not fit"
            );
        }
        if self.dispatch.offsets().len() != e + 1 || self.dispatch.rows() != rows {
            candle_core::bail!(
                "routed experts: dispatch of {} rows over {} experts does not fit {rows} rows and {e} experts",
                self.dispatch.rows(),
                self.dispatch.offsets().len().saturating_sub(1)
            );
        }
        Ok(Dims {
            hidden: hd,
            inter: id,
        })
    }

    fn rows<'a, T>(&self, data: &'a [T], d: Dims) -> Rows<'a, T> {
        Rows {
            data,
            hidden: d.hidden,
            top_k: self.dispatch.top_k(),
        }
    }

    /// The rounding points of an f32 op: its 16-bit float's rounding, if any.
    fn f32_rounding(&self) -> Rounding<f32> {
        Rounding(self.narrow.and_then(rounding_to))
    }

    /// The rounding points of an f64 op: none (a 16-bit rounding needs f32 operands).
    fn f64_rounding(&self) -> candle_core::Result<Rounding<f64>> {
        match self.narrow {
            None => Ok(Rounding(None)),
            Some(narrow) => candle_core::bail!(
                "routed experts: rounding to {narrow:?} needs f32 operands, got f64"
            ),
        }
    }

    fn fwd_typed<T: Float + WithDType>(
        &self,
        x: &[T],
        w1: Stack<'_, T>,
        w2: Stack<'_, T>,
        d: Dims,
        wrap: fn(Vec<T>) -> CpuStorage,
        round: Rounding<T>,
    ) -> candle_core::Result<CpuStorage> {
        let f = routed_forward(self.rows(x, d), w1, w2, &self.dispatch, d, round);
        let mut saved = self
            .saved
            .lock()
            .map_err(|_| candle_core::Error::Msg("routed experts: cache lock poisoned".into()))?;
        *saved = Some(Saved {
            h: Saved::keep(wrap(f.h), self.narrow)?,
            o: Saved::keep(wrap(f.o), self.narrow)?,
        });
        Ok(wrap(f.y))
    }

    fn bwd_typed<T: Float + WithDType>(
        &self,
        (x, w1, w2, grad): (&Tensor, &Tensor, &Tensor, &Tensor),
        d: Dims,
        wanted: Wanted,
        round: Rounding<T>,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grads = with_host::<T, _>(x, |xv| {
            with_stack::<T, _>(w1, |w1v| {
                with_stack::<T, _>(w2, |w2v| {
                    with_host::<T, _>(grad, |dy| {
                        let saved = self.saved.lock().map_err(|_| {
                            candle_core::Error::Msg("routed experts: cache lock poisoned".into())
                        })?;
                        let rows = self.rows(xv, d);
                        let recomputed;
                        let (mut wide_h, mut wide_o) = (None, None);
                        let (h, o) = match saved.as_ref() {
                            Some(s) => (
                                Saved::read::<T>(&s.h, &mut wide_h)?,
                                Saved::read::<T>(&s.o, &mut wide_o)?,
                            ),
                            None => {
                                recomputed =
                                    routed_forward(rows, w1v, w2v, &self.dispatch, d, round);
                                (&recomputed.h[..], &recomputed.o[..])
                            }
                        };
                        let inputs = BackwardInputs {
                            rows,
                            w1: w1v,
                            w2: w2v,
                            h,
                            o,
                            dy,
                        };
                        Ok(routed_backward(inputs, &self.dispatch, d, wanted, round))
                    })
                })
            })
        })?;
        let device = x.device();
        // A bf16 stack's gradient is handed back in bf16: the backward rounded it to bf16
        // where its weights were rounded, so the narrowing is exact.
        let to_tensor = |v: Option<Vec<T>>, like: &Tensor| {
            v.map(|v| {
                let t = Tensor::from_vec(v, like.shape(), device)?;
                match like.dtype() {
                    DType::BF16 if self.narrow == Some(DType::BF16) => t.to_dtype(DType::BF16),
                    _ => Ok(t),
                }
            })
            .transpose()
        };
        Ok((
            to_tensor(grads.drows, x)?,
            to_tensor(grads.dw1, w1)?,
            to_tensor(grads.dw2, w2)?,
        ))
    }
}

impl CustomOp3 for RoutedSwiGlu {
    fn name(&self) -> &'static str {
        "r3-routed-swiglu"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w1: &CpuStorage,
        w1l: &Layout,
        w2: &CpuStorage,
        w2l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = self.dims(xl.shape(), w1l.shape(), w2l.shape())?;
        let out = match (x, w1, w2) {
            (CpuStorage::F32(x), CpuStorage::F32(w1), CpuStorage::F32(w2)) => self.fwd_typed(
                contiguous(x, xl, "rows")?,
                Stack::Own(contiguous(w1, w1l, "gate_up")?),
                Stack::Own(contiguous(w2, w2l, "down")?),
                d,
                CpuStorage::F32,
                self.f32_rounding(),
            )?,
            (CpuStorage::F32(x), CpuStorage::BF16(w1), CpuStorage::BF16(w2)) => self.fwd_typed(
                contiguous(x, xl, "rows")?,
                Stack::Bf16(contiguous(w1, w1l, "gate_up")?),
                Stack::Bf16(contiguous(w2, w2l, "down")?),
                d,
                CpuStorage::F32,
                self.f32_rounding(),
            )?,
            (CpuStorage::F64(x), CpuStorage::F64(w1), CpuStorage::F64(w2)) => self.fwd_typed(
                contiguous(x, xl, "rows")?,
                Stack::Own(contiguous(w1, w1l, "gate_up")?),
                Stack::Own(contiguous(w2, w2l, "down")?),
                d,
                CpuStorage::F64,
                self.f64_rounding()?,
            )?,
            _ => candle_core::bail!(
                "routed experts: operands must all be f32 or all f64, or f32 rows with bf16 stacks"
            ),
        };
        Ok((out, Shape::from((self.dispatch.rows(), d.hidden))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w1: &Tensor,
        w2: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = self.dims(x.shape(), w1.shape(), w2.shape())?;
        let wanted = Wanted {
            rows: x.track_op(),
            dw1: w1.track_op(),
            dw2: w2.track_op(),
        };
        match x.dtype() {
            DType::F32 => self.bwd_typed::<f32>((x, w1, w2, grad), d, wanted, self.f32_rounding()),
            DType::F64 => self.bwd_typed::<f64>((x, w1, w2, grad), d, wanted, self.f64_rounding()?),
            dt => candle_core::bail!("routed experts: no backward for {dt:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::seeded_tensor;
    use candle_core::backend::BackendStorage;

    fn host(t: &Tensor) -> Vec<f32> {
        t.flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("host values")
    }

    /// At a 16-bit precision the op keeps its gate/up activations and expert outputs in that
    /// float (half the bytes of f32), and what its backward reads back are the forward's
    /// f32 values bit for bit; in f32 it keeps them as they are.
    #[test]
    fn kept_activations_are_the_forwards_in_their_own_float() {
        let (e, h, i, k) = (5, 12, 7, 2);
        let ids = [0u32, 2, 2, 4, 3, 0, 4, 2, 0, 4, 2, 0];
        let rows = ids.len() / k;
        let dispatch = Dispatch::new(&ids, k, e).expect("dispatch");
        let x = seeded_tensor(&[rows, h + k], 1, DType::F32);
        let w1 = seeded_tensor(&[e, 2 * i, h], 2, DType::F32);
        let w2 = seeded_tensor(&[e, h, i], 3, DType::F32);
        for precision in [
            Precision::F32,
            Precision::Bf16 { router_f32: false },
            Precision::F16 { router_f32: false },
        ] {
            let op = RoutedSwiGlu::new(dispatch.clone(), precision);
            x.apply_op3_no_bwd(&w1, &w2, &op).expect("forward");
            let d = Dims {
                hidden: h,
                inter: i,
            };
            let (xv, w1v, w2v) = (host(&x), host(&w1), host(&w2));
            let f = routed_forward(
                op.rows(&xv, d),
                Stack::Own(&w1v),
                Stack::Own(&w2v),
                &dispatch,
                d,
                op.f32_rounding(),
            );
            let saved = op.saved.lock().expect("lock");
            let kept = saved.as_ref().expect("the forward kept its activations");
            let dtype = precision.narrow_dtype().unwrap_or(DType::F32);
            for (name, kept, want) in [("h", &kept.h, &f.h), ("o", &kept.o, &f.o)] {
                assert_eq!(kept.dtype(), dtype, "{precision:?} {name}");
                let mut widened = None;
                let read = Saved::read::<f32>(kept, &mut widened).expect("read");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(read), bits(want), "{precision:?} {name}");
            }
        }
    }
}
