//! The optimiser's fused CPU passes over host memory: one AdamW pass per parameter tensor
//! (new θ, m, v and the guard's checks in a single read of θ, g, m, v; θ f32, or bf16 with θ'
//! rounded stochastically where weights are held without an f32 master) and the sum of
//! squares of a gradient in candle's own summation order.
//!
//! Each elementwise expression is the one candle's composed ops evaluate, operation for
//! operation (candle's CPU `affine(mul, add)` is `x * (mul as f32) + (add as f32)`, two
//! roundings, no fused multiply-add), so the fused results are bit-identical to the composed
//! path's. Work is split into fixed chunks on the rayon pool; every output element depends only
//! on its own inputs and the checks combine by AND and max, so nothing depends on the thread
//! count.

use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Storage, StorageRef, Tensor, Var};
use r3_model::cast16::Widened;
use r3_model::layers::gemm::{assume_init_vec, unfilled};
use r3_model::stochastic_round::{round_bf16_stochastic, DrawStream};
use rayon::prelude::*;
use std::mem::MaybeUninit;
use std::sync::Mutex;

/// Elements per parallel task: 128 KiB per stream, large enough to amortise a task, small
/// enough to spread one big tensor over every core.
const CHUNK: usize = 1 << 15;

/// The contiguous elements of a CPU tensor in its own float dtype: a gradient f32, or 16-bit
/// as a backward kept it (`train.narrow_gradients`); a variable or a moment f32 or bf16;
/// read-locked for as long as the view lives.
pub(crate) struct HostFloats<'a> {
    storage: StorageRef<'a>,
    from: usize,
    to: usize,
}

/// A tensor's elements in their own dtype.
#[derive(Clone, Copy)]
pub(crate) enum FloatSlice<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    F16(&'a [half::f16]),
}

impl<'a> HostFloats<'a> {
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
    pub(crate) fn slice(&self) -> FloatSlice<'_> {
        let r = self.from..self.to;
        match &*self.storage {
            Storage::Cpu(CpuStorage::BF16(data)) => FloatSlice::Bf16(&data[r]),
            Storage::Cpu(CpuStorage::F16(data)) => FloatSlice::F16(&data[r]),
            Storage::Cpu(CpuStorage::F32(data)) => FloatSlice::F32(&data[r]),
            // `of` admits only these CPU storages
            _ => FloatSlice::F32(&[]),
        }
    }
}

impl FloatSlice<'_> {
    /// Its length.
    pub(crate) fn len(&self) -> usize {
        match self {
            FloatSlice::F32(g) => g.len(),
            FloatSlice::Bf16(g) => g.len(),
            FloatSlice::F16(g) => g.len(),
        }
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

/// Staged values in their tensor's dtype: f32, or bf16 for weights held without an f32
/// master or moments kept in bf16 (rounded stochastically: `r3_model::stochastic_round`).
#[derive(Debug)]
pub(crate) enum StagedValues {
    /// An f32 tensor's.
    F32(Vec<f32>),
    /// A bf16 tensor's.
    Bf16(Vec<half::bf16>),
}

impl StagedValues {
    /// The values as a CPU tensor of `shape`.
    pub(crate) fn into_tensor(self, shape: &candle_core::Shape) -> candle_core::Result<Tensor> {
        match self {
            StagedValues::F32(v) => Tensor::from_vec(v, shape, &candle_core::Device::Cpu),
            StagedValues::Bf16(v) => Tensor::from_vec(v, shape, &candle_core::Device::Cpu),
        }
    }
}

/// [`StagedValues`]' buffer before the pass writes it.
#[derive(Debug)]
enum Unwritten {
    F32(Vec<MaybeUninit<f32>>),
    Bf16(Vec<MaybeUninit<half::bf16>>),
}

impl Unwritten {
    /// `n` unwritten values of `dtype` (f32 or bf16; `None` for any other).
    fn new(n: usize, dtype: DType) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Unwritten::F32(unfilled(n))),
            DType::BF16 => Some(Unwritten::Bf16(unfilled(n))),
            _ => None,
        }
    }
}

/// One tensor's new θ, m and v, not yet committed, and their checks.
#[derive(Debug)]
pub(crate) struct StagedUpdate {
    pub theta: StagedValues,
    pub m: StagedValues,
    pub v: StagedValues,
    pub checks: StagedChecks,
}

/// A stored element type of θ, m or v: read widened to f32 (exact), its new value stored in
/// its own dtype.
trait Stored: Widened + std::fmt::Debug + 'static {
    /// `x` as stored: itself in f32; in bf16 rounded stochastically by draw `low` of
    /// `draws` (the element's index's low word; the stream holds the rest).
    fn stored(x: f32, draws: DrawStream, low: u32) -> Self;
    /// The written values.
    fn staged(values: Vec<Self>) -> StagedValues;
}

impl Stored for f32 {
    #[inline(always)]
    fn stored(x: f32, _: DrawStream, _: u32) -> f32 {
        x
    }

    fn staged(values: Vec<f32>) -> StagedValues {
        StagedValues::F32(values)
    }
}

impl Stored for half::bf16 {
    #[inline(always)]
    fn stored(x: f32, draws: DrawStream, low: u32) -> half::bf16 {
        round_bf16_stochastic(x, draws.bits(low))
    }

    fn staged(values: Vec<half::bf16>) -> StagedValues {
        StagedValues::Bf16(values)
    }
}

/// The largest `|x|` bit pattern seen: for non-negative floats the integer order of the bits
/// is the numeric order, and every NaN or infinity sorts above every finite value, so one
/// integer max (which vectorises) yields both the finiteness and the largest magnitude.
const ABS_BITS: u32 = 0x7fff_ffff;
/// The bits of +∞: any `|x|` bit pattern at or above it is infinite or NaN.
const INF_BITS: u32 = 0x7f80_0000;

/// One chunk of the unwritten θ', m', v' buffers.
type OutChunks<'a, P, M> = (
    &'a mut [MaybeUninit<P>],
    &'a mut [MaybeUninit<M>],
    &'a mut [MaybeUninit<M>],
);

/// One chunk of the AdamW pass: reads θ, g, m, v once, writes θ', m', v', returns the checks.
/// Operation for operation the composed path (see `AdamW::step`). `DECAY` and `SCALE` are
/// whether `k.decay` / `k.grad_scale` are set, as constants so the loop has no branch. A bf16
/// θ' (or m', v') is rounded stochastically by draw `first + i` of `k.rounding_key` (or
/// `k.moment_keys`) for element `i` of the chunk (`first`: the chunk's offset in its tensor),
/// and checked as rounded.
fn adamw_chunk<P: Stored, G: Widened, M: Stored, const DECAY: bool, const SCALE: bool>(
    k: &AdamWConstants,
    first: u64,
    (theta, g, m, v): (&[P], &[G], &[M], &[M]),
    (theta_out, m_out, v_out): OutChunks<'_, P, M>,
) -> StagedChecks {
    let n = theta.len();
    let (g, m, v) = (&g[..n], &m[..n], &v[..n]);
    let (theta_out, m_out, v_out) = (&mut theta_out[..n], &mut m_out[..n], &mut v_out[..n]);
    let decay = k.decay.unwrap_or(1.0);
    let scale = k.grad_scale.unwrap_or(1.0);
    // A chunk lies within one 2³²-element run (its length divides 2³² and it starts at a
    // multiple of it), so each stream's salt is hashed once here.
    let high = first >> 32;
    let [m_key, v_key] = k.moment_keys.map(|key| DrawStream::new(key, high));
    let theta_key = DrawStream::new(k.rounding_key, high);
    let (mut theta_max, mut m_max, mut v_max) = (0u32, 0u32, 0u32);
    for i in 0..n {
        let at = (first as u32).wrapping_add(i as u32);
        let gi = g[i].wide();
        let g = if SCALE { gi * scale + 0.0 } else { gi };
        let m1 = M::stored(
            (m[i].wide() * k.beta1 + 0.0) + (g * k.one_minus_beta1 + 0.0),
            m_key,
            at,
        );
        let v1 = M::stored(
            (v[i].wide() * k.beta2 + 0.0) + ((g * g) * k.one_minus_beta2 + 0.0),
            v_key,
            at,
        );
        let m_hat = m1.wide() * k.inv_bc1 + 0.0;
        let denom = (v1.wide() * k.inv_bc2 + 0.0).sqrt() * 1.0 + k.eps;
        let theta_i = theta[i].wide();
        let decayed = if DECAY {
            theta_i * decay + 0.0
        } else {
            theta_i
        };
        let stored = P::stored(decayed - ((m_hat / denom) * k.lr + 0.0), theta_key, at);
        theta_out[i].write(stored);
        m_out[i].write(m1);
        v_out[i].write(v1);
        theta_max = theta_max.max(stored.wide().to_bits() & ABS_BITS);
        m_max = m_max.max(m1.wide().to_bits() & ABS_BITS);
        v_max = v_max.max(v1.wide().to_bits() & ABS_BITS);
    }
    StagedChecks::from_maxima([theta_max, m_max, v_max])
}

/// [`adamw_chunk`] with its constants chosen.
fn adamw_chunk_dispatch<P: Stored, G: Widened, M: Stored>(
    k: &AdamWConstants,
    first: u64,
    inputs: (&[P], &[G], &[M], &[M]),
    outputs: OutChunks<'_, P, M>,
) -> StagedChecks {
    match (k.decay.is_some(), k.grad_scale.is_some()) {
        (false, false) => adamw_chunk::<P, G, M, false, false>(k, first, inputs, outputs),
        (false, true) => adamw_chunk::<P, G, M, false, true>(k, first, inputs, outputs),
        (true, false) => adamw_chunk::<P, G, M, true, false>(k, first, inputs, outputs),
        (true, true) => adamw_chunk::<P, G, M, true, true>(k, first, inputs, outputs),
    }
}

/// Uninitialised buffers for one tensor's new θ (in its dtype), m and v (in theirs).
#[derive(Debug)]
pub(crate) struct FusedOutputs {
    theta: Unwritten,
    m: Unwritten,
    v: Unwritten,
}

impl FusedOutputs {
    /// Buffers of `n` elements each, θ' in `param` and the moments in `moments` (each f32 or
    /// bf16; anything else is `None`: no fused pass).
    pub(crate) fn new(n: usize, param: DType, moments: DType) -> Option<Self> {
        Some(Self {
            theta: Unwritten::new(n, param)?,
            m: Unwritten::new(n, moments)?,
            v: Unwritten::new(n, moments)?,
        })
    }
}

/// The fused AdamW pass over one tensor: new θ, m, v into `out` (nothing is written to the
/// inputs θ, g, m, v, all of `out`'s length; `g` f32, or 16-bit and widened as it is read:
/// the same values as a widened copy, without its pass; θ, and m and v, each f32, or bf16
/// and their new values rounded stochastically), chunks in parallel. `None` for a pairing it
/// does not take (θ, m or v f16, m and v in different dtypes, a bf16 θ with an f16 gradient,
/// `out` not in the inputs' dtypes).
pub(crate) fn adamw_pass(
    k: &AdamWConstants,
    (theta, g, m, v): (
        FloatSlice<'_>,
        FloatSlice<'_>,
        FloatSlice<'_>,
        FloatSlice<'_>,
    ),
    out: FusedOutputs,
) -> Option<StagedUpdate> {
    use FloatSlice as S;
    use Unwritten as U;
    let FusedOutputs {
        theta: to,
        m: mo,
        v: vo,
    } = out;
    // θ and the moments by dtype, then the gradient's.
    macro_rules! with_gradient {
        ($theta:expr, $m:expr, $v:expr, $outs:expr, $f16_ok:expr) => {
            match g {
                S::F32(g) => adamw_pass_typed(k, ($theta, g, $m, $v), $outs),
                S::Bf16(g) => adamw_pass_typed(k, ($theta, g, $m, $v), $outs),
                S::F16(g) if $f16_ok => adamw_pass_typed(k, ($theta, g, $m, $v), $outs),
                S::F16(_) => return None,
            }
        };
    }
    Some(match (theta, to, m, v, mo, vo) {
        (S::F32(t), U::F32(to), S::F32(m), S::F32(v), U::F32(mo), U::F32(vo)) => {
            with_gradient!(t, m, v, (to, mo, vo), true)
        }
        (S::F32(t), U::F32(to), S::Bf16(m), S::Bf16(v), U::Bf16(mo), U::Bf16(vo)) => {
            with_gradient!(t, m, v, (to, mo, vo), true)
        }
        (S::Bf16(t), U::Bf16(to), S::F32(m), S::F32(v), U::F32(mo), U::F32(vo)) => {
            with_gradient!(t, m, v, (to, mo, vo), false)
        }
        (S::Bf16(t), U::Bf16(to), S::Bf16(m), S::Bf16(v), U::Bf16(mo), U::Bf16(vo)) => {
            with_gradient!(t, m, v, (to, mo, vo), false)
        }
        _ => return None,
    })
}

/// [`adamw_pass`] for one parameter, gradient and moment dtype: θ', m', v' and the checks.
#[allow(clippy::type_complexity)]
fn adamw_pass_typed<P: Stored, G: Widened, M: Stored>(
    k: &AdamWConstants,
    (theta, g, m, v): (&[P], &[G], &[M], &[M]),
    (mut theta_out, mut m_out, mut v_out): (
        Vec<MaybeUninit<P>>,
        Vec<MaybeUninit<M>>,
        Vec<MaybeUninit<M>>,
    ),
) -> StagedUpdate {
    let checks = theta_out
        .par_chunks_mut(CHUNK)
        .zip(m_out.par_chunks_mut(CHUNK))
        .zip(v_out.par_chunks_mut(CHUNK))
        .enumerate()
        .map(|(c, ((to, mo), vo))| {
            let r = c * CHUNK..(c * CHUNK + to.len());
            adamw_chunk_dispatch(
                k,
                r.start as u64,
                (&theta[r.clone()], &g[r.clone()], &m[r.clone()], &v[r]),
                (to, mo, vo),
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
        theta: P::staged(theta),
        m: M::staged(m),
        v: M::staged(v),
        checks,
    }
}

/// Σ g² in f32 in exactly the order candle 0.11's CPU `g.sqr()?.sum_all()` adds on x86-64 with
/// AVX2 (32 lane accumulators over the 32-aligned prefix, reduced pairwise as its `vec_reduce`
/// does, then the tail one by one), and sequentially elsewhere (candle's scalar loop; on other
/// SIMD targets candle's order may differ in the last bits). One read of `g`.
pub(crate) fn sum_of_squares(g: FloatSlice<'_>) -> f32 {
    match g {
        FloatSlice::F32(g) => sum_of_squares_typed(g),
        FloatSlice::Bf16(g) => sum_of_squares_typed(g),
        FloatSlice::F16(g) => sum_of_squares_typed(g),
    }
}

/// [`sum_of_squares`] for one gradient dtype, each value widened as it is read (the sum of a
/// widened copy, without its pass).
fn sum_of_squares_typed<G: Widened>(g: &[G]) -> f32 {
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

/// Replaces the elements of a CPU variable by `data` (in its dtype: f32 or bf16) without
/// copying them when the variable owns its whole storage (the buffers are swapped; the old
/// one is dropped), else by one copy. Views of the variable see the new values either way, as
/// after `Var::set`.
pub(crate) fn commit_into(var: &Var, data: StagedValues) -> candle_core::Result<()> {
    let len = match &data {
        StagedValues::F32(d) => d.len(),
        StagedValues::Bf16(d) => d.len(),
    };
    if var.elem_count() != len {
        candle_core::bail!(
            "optimiser commit: {len} values for a variable of {} elements",
            var.elem_count()
        );
    }
    var.as_tensor().inplace_op1(&SwapIn(Mutex::new(data)))
}

/// The in-place op behind [`commit_into`].
struct SwapIn(Mutex<StagedValues>);

/// `new` into `data[from..to]`: swapped when it is the whole buffer, else copied.
fn swap_or_copy<E: Copy>(data: &mut Vec<E>, new: &mut Vec<E>, (from, to): (usize, usize)) {
    if from == 0 && to == data.len() {
        std::mem::swap(data, new);
    } else {
        data[from..to].copy_from_slice(new);
    }
}

impl InplaceOp1 for SwapIn {
    fn name(&self) -> &'static str {
        "adamw-commit"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some(range) = layout.contiguous_offsets() else {
            candle_core::bail!("optimiser commit: the variable is not contiguous");
        };
        let mut new = self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg("optimiser commit: poisoned".into()))?;
        match (storage, &mut *new) {
            (CpuStorage::F32(data), StagedValues::F32(new)) => swap_or_copy(data, new, range),
            (CpuStorage::BF16(data), StagedValues::Bf16(new)) => swap_or_copy(data, new, range),
            _ => candle_core::bail!(
                "optimiser commit: the staged values are not the variable's dtype"
            ),
        }
        Ok(())
    }
}
