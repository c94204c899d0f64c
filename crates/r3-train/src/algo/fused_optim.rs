//! The optimiser's fused CPU passes over f32 host memory: one AdamW pass per parameter
//! tensor (new θ, m, v and the guard's checks in a single read of θ, g, m, v) and the sum of
//! squares of a gradient in candle's own summation order.
//!
//! Each elementwise expression is the one candle's composed ops evaluate, operation for
//! operation (candle's CPU `affine(mul, add)` is `x * (mul as f32) + (add as f32)`, two
//! roundings, no fused multiply-add), so the fused results are bit-identical to the composed
//! path's. Work is split into fixed chunks on the rayon pool; every output element depends only
//! on its own inputs and the checks combine by AND and max, so nothing depends on the thread
//! count.

use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, StorageRef, Tensor, Var};
use r3_model::layers::gemm::{assume_init_vec, unfilled};
use rayon::prelude::*;
use std::mem::MaybeUninit;
use std::sync::Mutex;

/// Elements per parallel task: 128 KiB per stream, large enough to amortise a task, small
/// enough to spread one big tensor over every core.
const CHUNK: usize = 1 << 15;

/// The contiguous f32 elements of a CPU tensor, read-locked for as long as the view lives
/// (a [`HostGrad`] admitting f32 only).
pub(crate) struct HostF32<'a>(HostGrad<'a>);

impl<'a> HostF32<'a> {
    /// The view, or `None` when `t` is not a contiguous f32 tensor on the CPU (the caller then
    /// takes the composed path).
    pub(crate) fn of(t: &'a Tensor) -> Option<Self> {
        let view = HostGrad::of(t)?;
        matches!(view.slice(), GradSlice::F32(_)).then_some(Self(view))
    }

    /// The elements.
    pub(crate) fn slice(&self) -> &[f32] {
        match self.0.slice() {
            GradSlice::F32(data) => data,
            // `of` admits only f32 storage
            _ => &[],
        }
    }
}

/// The contiguous elements of a CPU tensor in its own float dtype: a gradient f32, or 16-bit
/// as a backward kept it (`train.narrow_gradients`); read-locked for as long as the view
/// lives.
pub(crate) struct HostGrad<'a> {
    storage: StorageRef<'a>,
    from: usize,
    to: usize,
}

/// A gradient's elements in their own dtype.
#[derive(Clone, Copy)]
pub(crate) enum GradSlice<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    F16(&'a [half::f16]),
}

impl<'a> HostGrad<'a> {
    /// The view, or `None` when `g` is not a contiguous f32, bf16 or f16 tensor on the CPU.
    pub(crate) fn of(g: &'a Tensor) -> Option<Self> {
        let (storage, layout) = g.storage_and_layout();
        let (from, to) = layout.contiguous_offsets()?;
        matches!(
            &*storage,
            Storage::Cpu(CpuStorage::F32(_) | CpuStorage::BF16(_) | CpuStorage::F16(_))
        )
        .then_some(Self { storage, from, to })
    }

    /// The elements.
    pub(crate) fn slice(&self) -> GradSlice<'_> {
        let r = self.from..self.to;
        match &*self.storage {
            Storage::Cpu(CpuStorage::BF16(data)) => GradSlice::Bf16(&data[r]),
            Storage::Cpu(CpuStorage::F16(data)) => GradSlice::F16(&data[r]),
            Storage::Cpu(CpuStorage::F32(data)) => GradSlice::F32(&data[r]),
            // `of` admits only these CPU storages
            _ => GradSlice::F32(&[]),
        }
    }
}

impl GradSlice<'_> {
    /// Its length.
    pub(crate) fn len(&self) -> usize {
        match self {
            GradSlice::F32(g) => g.len(),
            GradSlice::Bf16(g) => g.len(),
            GradSlice::F16(g) => g.len(),
        }
    }
}

/// A gradient value widened to f32 as it is read (exact for bf16 and f16: the value a
/// widened copy would hold).
trait WidenedGrad: Copy + Send + Sync {
    fn wide(self) -> f32;
}

impl WidenedGrad for f32 {
    #[inline(always)]
    fn wide(self) -> f32 {
        self
    }
}

impl WidenedGrad for half::bf16 {
    #[inline(always)]
    fn wide(self) -> f32 {
        self.to_f32()
    }
}

impl WidenedGrad for half::f16 {
    #[inline(always)]
    fn wide(self) -> f32 {
        self.to_f32()
    }
}

/// AdamW's per-step constants, rounded to f32 exactly where candle's `affine` rounds them:
/// one definition for the CPU pass here and the GPU pass (`r3_model::optim_pass`).
pub(crate) use r3_model::optim_pass::AdamWPassConstants as AdamWConstants;

/// What the guard needs to know of one tensor's staged update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StagedChecks {
    /// Every new parameter is finite.
    pub param_finite: bool,
    /// Every new first moment is finite.
    pub m_finite: bool,
    /// Every new second moment is finite.
    pub v_finite: bool,
    /// The largest magnitude of a new parameter (meaningful when all are finite).
    pub max_abs: f32,
}

impl StagedChecks {
    /// Checks that pass (the identity of [`StagedChecks::and`]).
    pub(crate) const ALL_GOOD: Self = Self {
        param_finite: true,
        m_finite: true,
        v_finite: true,
        max_abs: 0.0,
    };

    /// The checks of an update from the bit patterns (sign cleared) of its largest |θ'|,
    /// |m'| and |v'|: finite below the bits of +∞, and the largest |θ'| itself.
    pub(crate) fn from_maxima([theta, m, v]: [u32; 3]) -> Self {
        Self {
            param_finite: theta < INF_BITS,
            m_finite: m < INF_BITS,
            v_finite: v < INF_BITS,
            max_abs: f32::from_bits(theta),
        }
    }

    fn and(self, o: Self) -> Self {
        Self {
            param_finite: self.param_finite && o.param_finite,
            m_finite: self.m_finite && o.m_finite,
            v_finite: self.v_finite && o.v_finite,
            max_abs: self.max_abs.max(o.max_abs),
        }
    }
}

/// One tensor's new θ, m and v, not yet committed, and their checks.
#[derive(Debug)]
pub(crate) struct StagedUpdate {
    pub theta: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub checks: StagedChecks,
}

/// The largest `|x|` bit pattern seen: for non-negative floats the integer order of the bits
/// is the numeric order, and every NaN or infinity sorts above every finite value, so one
/// integer max (which vectorises) yields both the finiteness and the largest magnitude.
const ABS_BITS: u32 = 0x7fff_ffff;
/// The bits of +∞: any `|x|` bit pattern at or above it is infinite or NaN.
const INF_BITS: u32 = 0x7f80_0000;

/// One chunk of the unwritten θ', m', v' buffers.
type OutChunks<'a> = [&'a mut [MaybeUninit<f32>]; 3];

/// One chunk of the AdamW pass: reads θ, g, m, v once, writes θ', m', v', returns the checks.
/// Operation for operation the composed path (see `AdamW::step`). `DECAY` and `SCALE` are
/// whether `k.decay` / `k.grad_scale` are set, as constants so the loop has no branch.
fn adamw_chunk<G: WidenedGrad, const DECAY: bool, const SCALE: bool>(
    k: &AdamWConstants,
    (theta, g, m, v): (&[f32], &[G], &[f32], &[f32]),
    [theta_out, m_out, v_out]: OutChunks<'_>,
) -> StagedChecks {
    let n = theta.len();
    let (g, m, v) = (&g[..n], &m[..n], &v[..n]);
    let (theta_out, m_out, v_out) = (&mut theta_out[..n], &mut m_out[..n], &mut v_out[..n]);
    let decay = k.decay.unwrap_or(1.0);
    let scale = k.grad_scale.unwrap_or(1.0);
    let (mut theta_max, mut m_max, mut v_max) = (0u32, 0u32, 0u32);
    for i in 0..n {
        let gi = g[i].wide();
        let g = if SCALE { gi * scale + 0.0 } else { gi };
        let m1 = (m[i] * k.beta1 + 0.0) + (g * k.one_minus_beta1 + 0.0);
        let v1 = (v[i] * k.beta2 + 0.0) + ((g * g) * k.one_minus_beta2 + 0.0);
        let m_hat = m1 * k.inv_bc1 + 0.0;
        let denom = (v1 * k.inv_bc2 + 0.0).sqrt() * 1.0 + k.eps;
        let decayed = if DECAY {
            theta[i] * decay + 0.0
        } else {
            theta[i]
        };
        let new = decayed - ((m_hat / denom) * k.lr + 0.0);
        theta_out[i].write(new);
        m_out[i].write(m1);
        v_out[i].write(v1);
        theta_max = theta_max.max(new.to_bits() & ABS_BITS);
        m_max = m_max.max(m1.to_bits() & ABS_BITS);
        v_max = v_max.max(v1.to_bits() & ABS_BITS);
    }
    StagedChecks::from_maxima([theta_max, m_max, v_max])
}

/// [`adamw_chunk`] with its constants chosen.
fn adamw_chunk_dispatch<G: WidenedGrad>(
    k: &AdamWConstants,
    inputs: (&[f32], &[G], &[f32], &[f32]),
    outputs: OutChunks<'_>,
) -> StagedChecks {
    match (k.decay.is_some(), k.grad_scale.is_some()) {
        (false, false) => adamw_chunk::<G, false, false>(k, inputs, outputs),
        (false, true) => adamw_chunk::<G, false, true>(k, inputs, outputs),
        (true, false) => adamw_chunk::<G, true, false>(k, inputs, outputs),
        (true, true) => adamw_chunk::<G, true, true>(k, inputs, outputs),
    }
}

/// Uninitialised buffers for one tensor's new θ, m and v.
#[derive(Debug)]
pub(crate) struct FusedOutputs {
    theta: Vec<MaybeUninit<f32>>,
    m: Vec<MaybeUninit<f32>>,
    v: Vec<MaybeUninit<f32>>,
}

impl FusedOutputs {
    /// Buffers of `n` elements each.
    pub(crate) fn new(n: usize) -> Self {
        Self {
            theta: unfilled(n),
            m: unfilled(n),
            v: unfilled(n),
        }
    }
}

/// The fused AdamW pass over one tensor: new θ, m, v into `out` (nothing is written to the
/// inputs θ, g, m, v, all of `out`'s length; `g` f32, or 16-bit and widened as it is read:
/// the same values as a widened copy, without its pass), chunks in parallel.
pub(crate) fn adamw_pass(
    k: &AdamWConstants,
    (theta, g, m, v): (&[f32], GradSlice<'_>, &[f32], &[f32]),
    out: FusedOutputs,
) -> StagedUpdate {
    match g {
        GradSlice::F32(g) => adamw_pass_typed(k, (theta, g, m, v), out),
        GradSlice::Bf16(g) => adamw_pass_typed(k, (theta, g, m, v), out),
        GradSlice::F16(g) => adamw_pass_typed(k, (theta, g, m, v), out),
    }
}

/// [`adamw_pass`] for one gradient dtype.
fn adamw_pass_typed<G: WidenedGrad>(
    k: &AdamWConstants,
    (theta, g, m, v): (&[f32], &[G], &[f32], &[f32]),
    out: FusedOutputs,
) -> StagedUpdate {
    let FusedOutputs {
        theta: mut theta_out,
        m: mut m_out,
        v: mut v_out,
    } = out;
    let checks = theta_out
        .par_chunks_mut(CHUNK)
        .zip(m_out.par_chunks_mut(CHUNK))
        .zip(v_out.par_chunks_mut(CHUNK))
        .enumerate()
        .map(|(c, ((to, mo), vo))| {
            let r = c * CHUNK..(c * CHUNK + to.len());
            adamw_chunk_dispatch(
                k,
                (&theta[r.clone()], &g[r.clone()], &m[r.clone()], &v[r]),
                [to, mo, vo],
            )
        })
        .reduce(|| StagedChecks::ALL_GOOD, StagedChecks::and);
    // SAFETY: the chunks tile the three buffers and `adamw_chunk` wrote every element.
    let (theta, m, v) = unsafe {
        (
            assume_init_vec(theta_out),
            assume_init_vec(m_out),
            assume_init_vec(v_out),
        )
    };
    StagedUpdate {
        theta,
        m,
        v,
        checks,
    }
}

/// Σ g² in f32 in exactly the order candle 0.11's CPU `g.sqr()?.sum_all()` adds on x86-64 with
/// AVX2 (32 lane accumulators over the 32-aligned prefix, reduced pairwise as its `vec_reduce`
/// does, then the tail one by one), and sequentially elsewhere (candle's scalar loop; on other
/// SIMD targets candle's order may differ in the last bits). One read of `g`.
pub(crate) fn sum_of_squares(g: GradSlice<'_>) -> f32 {
    match g {
        GradSlice::F32(g) => sum_of_squares_typed(g),
        GradSlice::Bf16(g) => sum_of_squares_typed(g),
        GradSlice::F16(g) => sum_of_squares_typed(g),
    }
}

/// [`sum_of_squares`] for one gradient dtype, each value widened as it is read (the sum of a
/// widened copy, without its pass).
fn sum_of_squares_typed<G: WidenedGrad>(g: &[G]) -> f32 {
    if !candle_lane_order() {
        return g.iter().fold(0.0f32, |acc, &x| acc + x.wide() * x.wide());
    }
    let body = g.len() & !31;
    let mut lanes = [0.0f32; 32];
    for block in g[..body].chunks_exact(32) {
        for (acc, &x) in lanes.iter_mut().zip(block) {
            let x = x.wide();
            *acc += x * x;
        }
    }
    // vec_reduce: x0 += x1, x2 += x3, x0 += x2 (8 lanes each), then the two 4-lane halves
    // added, then two horizontal adds.
    let mut u = [0.0f32; 8];
    for (j, u) in u.iter_mut().enumerate() {
        *u = (lanes[j] + lanes[8 + j]) + (lanes[16 + j] + lanes[24 + j]);
    }
    let t0: [f32; 4] = std::array::from_fn(|j| u[j] + u[4 + j]);
    let mut sum = (t0[0] + t0[1]) + (t0[2] + t0[3]);
    for &x in &g[body..] {
        let x = x.wide();
        sum += x * x;
    }
    sum
}

/// Whether candle sums f32 with its AVX2 kernel on this machine.
fn candle_lane_order() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Replaces the elements of a CPU f32 variable by `data` without copying them when the
/// variable owns its whole storage (the buffers are swapped; the old one is dropped), else by
/// one copy. Views of the variable see the new values either way, as after `Var::set`.
pub(crate) fn commit_into(var: &Var, data: Vec<f32>) -> candle_core::Result<()> {
    if var.elem_count() != data.len() {
        candle_core::bail!(
            "optimiser commit: {} values for a variable of {} elements",
            data.len(),
            var.elem_count()
        );
    }
    var.as_tensor().inplace_op1(&SwapIn(Mutex::new(data)))
}

/// The in-place op behind [`commit_into`].
struct SwapIn(Mutex<Vec<f32>>);

impl InplaceOp1 for SwapIn {
    fn name(&self) -> &'static str {
        "adamw-commit"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("optimiser commit: the variable is not f32");
        };
        let Some((from, to)) = layout.contiguous_offsets() else {
            candle_core::bail!("optimiser commit: the variable is not contiguous");
        };
        let mut new = self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg("optimiser commit: poisoned".into()))?;
        if from == 0 && to == data.len() {
            std::mem::swap(data, &mut *new);
        } else {
            data[from..to].copy_from_slice(&new);
        }
        Ok(())
    }
}
