//! The conversion kernels of `kernels.cu` against the CPU's conversions: the vectorised casts
//! f32 ↔ bf16 / f16 (`r3_narrow_*`, `r3_widen_*`: four elements a thread with 16-byte loads,
//! then the tail), the narrowing that flags an inexact value (`r3_narrow_exact_*`), the
//! rounding passes that stay in f32 (`r3_round_*_f32`, `r3_add_rounded_f32` with each round
//! code) and the stochastic rounding to bf16 (`r3_round_bf16_stochastic`).
//!
//! The truth is r3-model's CPU twin through its public API (candle's casts, which are the
//! `half` crate's conversions; `narrow_where_exact`; `Precision::round` / `add_rounded`;
//! `stochastic_round_bf16`) and `half` itself. Every comparison is bit for bit, in both
//! variants: each kernel is one conversion per element (integer operations and at most one
//! f32 add), so nothing contracts. A NaN is where the two sides differ by design: narrowing,
//! the emulator's conversions write `0x7fff` in bf16 and f16 (its model of a GPU's `cvt.rn`,
//! which writes that canonical NaN), the CPU a quiet NaN that keeps the input's sign and
//! payload; where a kernel's output is an f32 NaN (a 16-bit NaN widened, a NaN sum) its bits
//! are the GPU hardware's own, so only "is a NaN" is asked of it. Those elements are compared
//! as "both NaN", and `a_nan_is_a_nan_on_both_sides_but_not_the_same_bits` pins down the
//! CPU's bits and the narrowing's canonical NaN.

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use r3_cuda_emu::{in_both_orders, launch, variants, LaunchShape};
use r3_model::narrow_grads::narrow_where_exact;
use r3_model::stochastic_round::{rounding_key, stochastic_round_bf16};
use r3_model::Precision;

mod common;

use common::Lcg;
use r3_test_support::bits;

// The aligned buffers below pack values into 16-byte words by shifts: little-endian only.
const _: () = assert!(cfg!(target_endian = "little"));

/// Values held in 16-byte words, so that the buffer starts on a 16-byte boundary as the
/// vectorised casts' loads and stores need (`x` and `y` start 16- and 8-byte aligned).
struct Aligned {
    words: Vec<u128>,
}

impl Aligned {
    /// `bits` (each `width` bits wide, 16 or 32) packed in order.
    fn pack(bits: &[u32], width: u32) -> Self {
        let per = (128 / width) as usize;
        let words = bits
            .chunks(per)
            .map(|c| {
                c.iter().enumerate().fold(0u128, |w, (j, &b)| {
                    w | (u128::from(b) << (j as u32 * width))
                })
            })
            .collect();
        Self { words }
    }

    /// f32 values.
    fn f32s(values: &[f32]) -> Self {
        Self::pack(&values.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), 32)
    }

    /// 16-bit patterns.
    fn u16s(bits: &[u16]) -> Self {
        Self::pack(&bits.iter().map(|&b| u32::from(b)).collect::<Vec<_>>(), 16)
    }

    /// The first `n` values of `width` bits.
    fn unpack(&self, n: usize, width: u32) -> Vec<u32> {
        let per = (128 / width) as usize;
        let mask = (1u128 << width) - 1;
        (0..n)
            .map(|i| ((self.words[i / per] >> ((i % per) as u32 * width)) & mask) as u32)
            .collect()
    }

    /// The buffer's start as a pointer to `T`.
    fn ptr<T>(&self) -> *const T {
        self.words.as_ptr().cast()
    }

    /// The buffer's start as a mutable pointer to `T`.
    fn mut_ptr<T>(&mut self) -> *mut T {
        self.words.as_mut_ptr().cast()
    }
}

/// `2^e`.
fn p2(e: i32) -> f32 {
    2f32.powi(e)
}

/// Values at the conversions' edges: ties to even for bf16 and f16, signed zeros,
/// infinities, bf16's and f16's largest finite values and the first values past them, f16's
/// subnormals and the ties between them, f32's subnormals (bf16 keeps them, f16 flushes
/// them to zero by rounding), and values just off a tie.
fn edge_values() -> Vec<f32> {
    vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        1.0 + p2(-8),
        1.0 + 3.0 * p2(-8),
        -(1.0 + 3.0 * p2(-8)),
        1.0 + p2(-8) + p2(-20),
        1.0 + p2(-11),
        1.0 + 3.0 * p2(-11),
        -(1.0 + p2(-11) + p2(-22)),
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        -f32::MAX,
        f32::from_bits(0x7f7f_7fff),
        f32::from_bits(0x7f7f_8000),
        f32::from_bits(0xff7f_8000),
        3e38,
        -3e38,
        65504.0,
        65519.0,
        65520.0,
        -65520.0,
        70_000.0,
        p2(-14),
        p2(-14) - p2(-25),
        p2(-14) - p2(-26),
        p2(-24),
        -p2(-24),
        p2(-25),
        3.0 * p2(-25),
        5.0 * p2(-25),
        p2(-26),
        6e-8,
        -6e-8,
        1e-40,
        -1e-40,
        f32::from_bits(1),
        f32::from_bits(0x0000_8000),
        f32::from_bits(0x0001_8000),
        f32::MIN_POSITIVE,
        1e-30,
        std::f32::consts::PI,
    ]
}

/// The edge values, then `spread` values of every magnitude from 1e-8 to 1e6, padded to a
/// multiple of four.
fn test_values(spread: usize, seed: u64) -> Vec<f32> {
    let mut rng = Lcg::new(seed);
    let mut values = edge_values();
    values.extend((0..spread).map(|i| rng.uniform(-1.0, 1.0) * 10f32.powi(i as i32 % 15 - 8)));
    while values.len() % 4 != 0 {
        values.push(rng.uniform(-1.0, 1.0));
    }
    values
}

/// NaNs of either sign, quiet and signalling, with payloads in the kept and the dropped half.
const NANS: [u32; 6] = [
    0x7fc0_0000,
    0xffc0_0000,
    0x7f80_0001,
    0xff80_0001,
    0x7fff_ffff,
    0x7fa0_1234,
];

/// The NaN the emulator's narrowing conversions write, in bf16 and in f16: its model of a
/// GPU's `cvt.rn` (PTX's canonical NaN).
const CANONICAL_NAN_16: u16 = 0x7fff;

/// The shapes each elementwise kernel runs under: the launcher's, then one block of one
/// warp (a grid-stride loop of many turns), a few blocks of a width that is a multiple of 32
/// but no power of two, and blocks of a width that is no multiple of 32 (these kernels have
/// no warp operation, so any width is theirs).
fn shapes(launcher: LaunchShape) -> [(&'static str, LaunchShape); 4] {
    [
        ("launcher", launcher),
        ("1 × 32", LaunchShape::blocks(1, 32)),
        ("3 × 96", LaunchShape::blocks(3, 96)),
        ("2 × 50", LaunchShape::blocks(2, 50)),
    ]
}

/// The CPU's cast (candle's `to_dtype`, the CPU twin of `cast16`) of f32 `values` to
/// `narrow`, as bit patterns.
fn cpu_narrowed(values: &[f32], narrow: DType) -> Vec<u16> {
    let t = Tensor::from_vec(values.to_vec(), values.len(), &Device::Cpu)
        .and_then(|t| t.to_dtype(narrow))
        .expect("the CPU's cast");
    match narrow {
        DType::BF16 => t
            .to_vec1::<bf16>()
            .expect("bf16")
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        _ => t
            .to_vec1::<f16>()
            .expect("f16")
            .iter()
            .map(|v| v.to_bits())
            .collect(),
    }
}

/// `half`'s nearest `narrow` value to `v`, as bits.
fn half_bits(v: f32, narrow: DType) -> u16 {
    match narrow {
        DType::BF16 => bf16::from_f32(v).to_bits(),
        _ => f16::from_f32(v).to_bits(),
    }
}

/// Whether the 16-bit pattern `b` of `narrow` is a NaN.
fn is_nan_16(b: u16, narrow: DType) -> bool {
    match narrow {
        DType::BF16 => bf16::from_bits(b).is_nan(),
        _ => f16::from_bits(b).is_nan(),
    }
}

/// The 16-bit patterns the narrowing kernel of `narrow` writes from `values[off .. off + n]`
/// into a buffer of `values.len()` 16-bit words filled with a sentinel, under `shape`: the
/// whole buffer, so that a write outside the range shows.
fn narrowed_by_kernel(
    k: &r3_cuda_emu::Kernels,
    narrow: DType,
    values: &Aligned,
    len: usize,
    (off, n): (usize, usize),
    shape: LaunchShape,
    what: &str,
) -> Vec<u32> {
    in_both_orders(what, |order| {
        let mut y = Aligned::u16s(&vec![SENTINEL_16; len]);
        let x = values.ptr::<f32>().wrapping_add(off);
        let yp = y.mut_ptr::<u16>().wrapping_add(off);
        launch(shape, order, &|| unsafe {
            match narrow {
                DType::BF16 => (k.r3_narrow_bf16)(x, yp.cast(), n),
                _ => (k.r3_narrow_f16)(x, yp.cast(), n),
            }
        })
        .expect("launch");
        y.unpack(len, 16)
    })
}

/// What the output buffers hold before a launch: a pattern no conversion here writes
/// (a bf16 / f16 NaN with a payload; the f32 NaN `0x7fbadbad`).
const SENTINEL_16: u16 = 0x7d5a;
/// The f32 sentinel.
const SENTINEL_32: u32 = 0x7fba_dbad;

/// Whether the f32 pattern `g` a kernel wrote where a NaN is due is a NaN other than
/// [`SENTINEL_32`] (which no widened 16-bit NaN nor any NaN sum here can be: its low half is
/// not zero, and no input holds it), so an element left unwritten still shows while the
/// NaN's own bits (a GPU's hardware writes its own) are not asked for.
fn is_written_nan(g: u32) -> bool {
    f32::from_bits(g).is_nan() && g != SENTINEL_32
}

/// The (start, length) windows each vectorised cast runs over: from the first element with
/// a tail of 0 to 3 after the quads, and from the fifth (a start on a 16-byte boundary past
/// the first) with tails of 1 and 3.
fn windows(len: usize) -> [(usize, usize); 6] {
    [
        (0, len),
        (0, len - 1),
        (0, len - 2),
        (0, len - 3),
        (4, len - 5),
        (4, len - 7),
    ]
}

/// `r3_narrow_bf16` / `r3_narrow_f16` write candle's CPU cast of every value (which is
/// `half`'s conversion), bit for bit: ties to even, overflow to ±∞, subnormals, signed
/// zeros; over windows whose lengths leave every tail after the quads, from an offset start;
/// nothing written outside the window.
#[test]
fn narrowing_casts_equal_the_cpus_cast_bit_for_bit() {
    let values = test_values(1_000, 11);
    let len = values.len();
    let x = Aligned::f32s(&values);
    for narrow in [DType::BF16, DType::F16] {
        let want = cpu_narrowed(&values, narrow);
        for (i, (&v, &w)) in values.iter().zip(&want).enumerate() {
            assert_eq!(w, half_bits(v, narrow), "{narrow:?}: candle is half, {i}");
        }
        for (variant, k) in variants() {
            for (off, n) in windows(len) {
                // The launcher's grid: one thread per quad (`LaunchShape::elementwise(n.div_ceil(4))`).
                for (shape_name, shape) in shapes(LaunchShape::elementwise(n.div_ceil(4))) {
                    let what = format!("{variant} {narrow:?} {shape_name} [{off}, +{n})");
                    let got = narrowed_by_kernel(k, narrow, &x, len, (off, n), shape, &what);
                    for (i, &g) in got.iter().enumerate() {
                        let expected = if (off..off + n).contains(&i) {
                            u32::from(want[i])
                        } else {
                            u32::from(SENTINEL_16)
                        };
                        assert_eq!(
                            g, expected,
                            "{what}: element {i} ({:e}): {g:#06x} vs {expected:#06x}",
                            values[i]
                        );
                    }
                }
            }
        }
    }
}

/// The f32 patterns the widening kernel of `narrow` writes from `bits[off .. off + n]`
/// into a buffer of `bits.len()` f32 sentinels, under `shape`.
fn widened_by_kernel(
    k: &r3_cuda_emu::Kernels,
    narrow: DType,
    bits: &Aligned,
    len: usize,
    (off, n): (usize, usize),
    shape: LaunchShape,
    what: &str,
) -> Vec<u32> {
    in_both_orders(what, |order| {
        let mut y = Aligned::pack(&vec![SENTINEL_32; len], 32);
        let x = bits.ptr::<u16>().wrapping_add(off);
        let yp = y.mut_ptr::<f32>().wrapping_add(off);
        launch(shape, order, &|| unsafe {
            match narrow {
                DType::BF16 => (k.r3_widen_bf16)(x.cast(), yp, n),
                _ => (k.r3_widen_f16)(x.cast(), yp, n),
            }
        })
        .expect("launch");
        y.unpack(len, 32)
    })
}

/// candle's CPU widening of 16-bit `bits` of `narrow` (its cast to f32), as f32 bits.
fn cpu_widened(bits: &[u16], narrow: DType) -> Vec<u32> {
    let t = match narrow {
        DType::BF16 => Tensor::from_vec(
            bits.iter().map(|&b| bf16::from_bits(b)).collect::<Vec<_>>(),
            bits.len(),
            &Device::Cpu,
        ),
        _ => Tensor::from_vec(
            bits.iter().map(|&b| f16::from_bits(b)).collect::<Vec<_>>(),
            bits.len(),
            &Device::Cpu,
        ),
    };
    t.and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.to_vec1::<f32>())
        .expect("the CPU's widening")
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// `r3_widen_bf16` / `r3_widen_f16` over every one of the 65,536 patterns (infinities,
/// subnormals, both zeros) write candle's CPU cast (`half`'s), bit for bit; every NaN pattern
/// comes out a NaN, its bits not checked (the CPU sets the quiet bit; the emulator keeps the
/// payload; a GPU's conversion writes its own). Then windows with every tail and
/// an offset start over a shorter run, nothing written outside the window.
#[test]
fn widening_casts_equal_the_cpus_cast_bit_for_bit() {
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let mut rng = Lcg::new(5);
    let some: Vec<u16> = (0..1_024).map(|_| rng.next_u32() as u16).collect();
    for narrow in [DType::BF16, DType::F16] {
        for (patterns, every_window) in [(&all, false), (&some, true)] {
            let len = patterns.len();
            let want = cpu_widened(patterns, narrow);
            let x = Aligned::u16s(patterns);
            let runs: Vec<(usize, usize)> = match every_window {
                true => windows(len).to_vec(),
                false => vec![(0, len)],
            };
            for (variant, k) in variants() {
                for &(off, n) in &runs {
                    // The launcher's grid: one thread per quad (`LaunchShape::elementwise(n.div_ceil(4))`).
                    for (shape_name, shape) in shapes(LaunchShape::elementwise(n.div_ceil(4))) {
                        let what = format!("{variant} {narrow:?} {shape_name} [{off}, +{n})");
                        let got = widened_by_kernel(k, narrow, &x, len, (off, n), shape, &what);
                        for (i, &g) in got.iter().enumerate() {
                            if !(off..off + n).contains(&i) {
                                assert_eq!(g, SENTINEL_32, "{what}: wrote outside at {i}");
                            } else if is_nan_16(patterns[i], narrow) {
                                assert!(is_written_nan(g), "{what}: {i}: {g:#010x} not a NaN");
                            } else {
                                assert_eq!(
                                    g, want[i],
                                    "{what}: pattern {:#06x}: {g:#010x} vs {:#010x}",
                                    patterns[i], want[i]
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The narrowed patterns and the `inexact` flag `r3_narrow_exact_*` of `narrow` writes for
/// `values` under `shape` (the flag starts at zero).
fn narrow_exact_by_kernel(
    k: &r3_cuda_emu::Kernels,
    narrow: DType,
    values: &[f32],
    shape: LaunchShape,
    what: &str,
) -> (Vec<u16>, u32) {
    in_both_orders(what, |order| {
        let mut y = vec![SENTINEL_16; values.len()];
        let mut flag = 0u32;
        let (yp, fp) = (y.as_mut_ptr(), &mut flag as *mut u32);
        launch(shape, order, &|| unsafe {
            match narrow {
                DType::BF16 => {
                    (k.r3_narrow_exact_bf16)(values.as_ptr(), yp.cast(), fp, values.len())
                }
                _ => (k.r3_narrow_exact_f16)(values.as_ptr(), yp.cast(), fp, values.len()),
            }
        })
        .expect("launch");
        (y, flag)
    })
}

/// `r3_narrow_exact_*` raises its flag exactly where the CPU's `narrow_where_exact` keeps
/// the gradient in f32 (some value does not narrow exactly, or is a NaN), and writes the
/// nearest 16-bit value of each element (the CPU's narrowed bits where the CPU narrows; a
/// NaN as [`CANONICAL_NAN_16`], the emulator's model of `cvt.rn`): values on both grids; one value off them at the tail; a NaN; bf16 values past f16's range
/// (and ±∞, which narrows exactly); f16's smallest subnormal (exact) and half of it (not).
#[test]
fn narrowing_with_a_flag_agrees_with_the_cpus_exact_narrowing() {
    // m · 2^e with |m| < 256 and e in [-10, 4]: 8 significant bits within f16's normal range,
    // exact in both 16-bit floats.
    let mut rng = Lcg::new(21);
    let grid: Vec<f32> = (0..1_003)
        .map(|_| {
            let m = (rng.next_u32() % 511) as f32 - 255.0;
            m * p2((rng.next_u32() % 15) as i32 - 10)
        })
        .collect();
    let with = |changes: &[(usize, f32)]| {
        let mut v = grid.clone();
        for &(i, x) in changes {
            v[i] = x;
        }
        v
    };
    let last = grid.len() - 1;
    let cases: Vec<(&str, Vec<f32>)> = vec![
        ("on both grids", with(&[(3, -0.0), (4, f32::INFINITY)])),
        ("one off at the tail", with(&[(last, 1.0 + p2(-12))])),
        ("a NaN", with(&[(5, f32::NAN)])),
        (
            "past f16's range",
            with(&[(77, p2(17)), (78, f32::NEG_INFINITY)]),
        ),
        (
            "f16's smallest subnormal",
            with(&[(9, p2(-24)), (10, -p2(-24))]),
        ),
        ("half of it", with(&[(9, p2(-25))])),
    ];
    for (case, values) in &cases {
        let host = Tensor::from_vec(values.clone(), values.len(), &Device::Cpu).expect("host");
        for narrow in [DType::BF16, DType::F16] {
            let cpu = narrow_where_exact(&host, narrow).expect("the CPU's narrowing");
            let cpu_narrowed = (cpu.dtype() == narrow).then(|| cpu_narrowed(values, narrow));
            for (variant, k) in variants() {
                for (shape_name, shape) in shapes(LaunchShape::elementwise(values.len())) {
                    let what = format!("{variant} {narrow:?} {shape_name}: {case}");
                    let (y, flag) = narrow_exact_by_kernel(k, narrow, values, shape, &what);
                    assert_eq!(
                        flag,
                        u32::from(cpu_narrowed.is_none()),
                        "{what}: the flag against the CPU's verdict"
                    );
                    for (i, (&got, &v)) in y.iter().zip(values).enumerate() {
                        let expected = match (&cpu_narrowed, v.is_nan()) {
                            (_, true) => CANONICAL_NAN_16,
                            (Some(cpu), false) => cpu[i],
                            (None, false) => half_bits(v, narrow),
                        };
                        assert_eq!(got, expected, "{what}: element {i} ({v:e})");
                    }
                }
            }
        }
    }
}

/// The f32 values `kernel(x, y, n)` (one of the `r3_round_*_f32`) writes for `values`.
fn rounded_by_kernel(
    kernel: unsafe extern "C" fn(*const f32, *mut f32, usize),
    values: &[f32],
    shape: LaunchShape,
    what: &str,
) -> Vec<u32> {
    in_both_orders(what, |order| {
        let mut y = vec![f32::from_bits(SENTINEL_32); values.len()];
        let yp = y.as_mut_ptr();
        launch(shape, order, &|| unsafe {
            kernel(values.as_ptr(), yp, values.len())
        })
        .expect("launch");
        y.iter().map(|v| v.to_bits()).collect()
    })
}

/// `r3_round_bf16_f32` / `r3_round_f16_f32` equal the CPU's rounding point
/// (`Precision::round`, r3-model's `RoundTo`) and `half`'s conversion there and back, bit for
/// bit, NaN apart: a NaN comes out a NaN on both sides, its bits not checked (the CPU writes
/// the input's NaN quieted; the kernel's is the narrowing's canonical NaN as the GPU widens
/// it, which its hardware conversion need not keep).
#[test]
fn rounding_in_f32_equals_the_cpus_rounding_point() {
    let mut values = test_values(1_000, 31);
    values.extend(NANS.map(f32::from_bits));
    values.push(0.5);
    let host = Tensor::from_vec(values.clone(), values.len(), &Device::Cpu).expect("host");
    for (narrow, precision) in [
        (DType::BF16, Precision::Bf16 { router_f32: false }),
        (DType::F16, Precision::F16 { router_f32: false }),
    ] {
        let cpu = bits(&precision.round(&host).expect("the CPU's rounding"));
        for (variant, k) in variants() {
            let kernel = match narrow {
                DType::BF16 => k.r3_round_bf16_f32,
                _ => k.r3_round_f16_f32,
            };
            for (shape_name, shape) in shapes(LaunchShape::elementwise(values.len())) {
                let what = format!("{variant} {narrow:?} {shape_name}");
                let got = rounded_by_kernel(kernel, &values, shape, &what);
                for (i, (&g, &v)) in got.iter().zip(&values).enumerate() {
                    if v.is_nan() {
                        assert!(f32::from_bits(cpu[i]).is_nan(), "{what}: CPU {i}");
                        assert!(
                            is_written_nan(g),
                            "{what}: element {i}: {g:#010x} for a NaN"
                        );
                        continue;
                    }
                    let by_half = match narrow {
                        DType::BF16 => bf16::from_f32(v).to_f32().to_bits(),
                        _ => f16::from_f32(v).to_f32().to_bits(),
                    };
                    assert_eq!(cpu[i], by_half, "{narrow:?}: the CPU is half, {v:e}");
                    assert_eq!(g, cpu[i], "{what}: element {i} ({v:e})");
                }
            }
        }
    }
}

/// `r3_add_rounded_f32` with round code 0 (as it is), 1 (bf16) and 2 (f16) equals the CPU's
/// `Precision::add_rounded` (the residual stream's rounding point: r3-model's `AddRounded`,
/// and `a + b` in f32) bit for bit: sums that land on ties, that overflow the 16-bit range
/// or f32's, that cancel to +0, −0 + −0, and ∞ − ∞ (a NaN on both sides).
#[test]
fn the_rounded_sum_equals_the_cpus_add_rounded_for_every_round_code() {
    let mut rng = Lcg::new(41);
    let mut a: Vec<f32> = (0..1_000)
        .map(|i| rng.uniform(-1.0, 1.0) * 10f32.powi(i % 9 - 4))
        .collect();
    let mut b: Vec<f32> = (0..1_000)
        .map(|i| rng.uniform(-1.0, 1.0) * 10f32.powi(i % 7 - 3))
        .collect();
    for (x, y) in [
        (1.0, p2(-8)),
        (1.0, 3.0 * p2(-8)),
        (1.0, p2(-11)),
        (65504.0, 16.0),
        (65504.0, 15.0),
        (f32::MAX, f32::MAX),
        (1.0, -1.0),
        (-0.0, -0.0),
        (f32::INFINITY, f32::NEG_INFINITY),
        (f32::INFINITY, 1.0),
        (p2(-24), p2(-25)),
        (f32::NAN, 1.0),
    ] {
        a.push(x);
        b.push(y);
    }
    let n = a.len();
    let (ta, tb) = (
        Tensor::from_vec(a.clone(), n, &Device::Cpu).expect("a"),
        Tensor::from_vec(b.clone(), n, &Device::Cpu).expect("b"),
    );
    for (round, precision) in [
        (0u32, Precision::F32),
        (1, Precision::Bf16 { router_f32: false }),
        (2, Precision::F16 { router_f32: false }),
    ] {
        let cpu = bits(&precision.add_rounded(&ta, &tb).expect("the CPU's sum"));
        for (variant, k) in variants() {
            for (shape_name, shape) in shapes(LaunchShape::elementwise(n)) {
                let what = format!("{variant} round {round} {shape_name}");
                let got = in_both_orders(&what, |order| {
                    let mut y = vec![f32::from_bits(SENTINEL_32); n];
                    let yp = y.as_mut_ptr();
                    launch(shape, order, &|| unsafe {
                        (k.r3_add_rounded_f32)(a.as_ptr(), b.as_ptr(), yp, n, round)
                    })
                    .expect("launch");
                    y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                });
                for (i, (&g, &c)) in got.iter().zip(&cpu).enumerate() {
                    let (gv, cv) = (f32::from_bits(g), f32::from_bits(c));
                    if cv.is_nan() {
                        assert!(
                            is_written_nan(g),
                            "{what}: element {i}: {g:#010x} for a NaN"
                        );
                    } else {
                        assert_eq!(
                            g, c,
                            "{what}: element {i}: {} + {}: {gv} vs {cv}",
                            a[i], b[i]
                        );
                    }
                }
            }
        }
    }
}

/// A NaN comes out a NaN on both sides, in different bits. Narrowing, the kernels write
/// [`CANONICAL_NAN_16`] (`0x7fff`, whatever the input NaN: the emulator's model of a GPU's
/// `cvt.rn`, which writes that canonical NaN), the CPU's casts (`half`'s, candle's) keep the
/// sign and the top of the payload and set the quiet bit (`f32::NAN` becomes `0x7fc0` in
/// bf16 and `0x7e00` in f16). Widening a signalling 16-bit NaN, the CPU quiets it (`0x7f81`
/// → `0x7fc10000`); the kernels' f32 is only asked to be a NaN (the emulator keeps the
/// payload, a GPU's conversion writes its own bits). Bit-for-bit comparisons with the CPU
/// hold on values without NaNs.
#[test]
fn a_nan_is_a_nan_on_both_sides_but_not_the_same_bits() {
    let values: Vec<f32> = NANS.map(f32::from_bits).to_vec();
    let padded: Vec<f32> = values.iter().copied().chain([0.0, 0.0]).collect();
    let x = Aligned::f32s(&padded);
    for narrow in [DType::BF16, DType::F16] {
        let cpu = cpu_narrowed(&values, narrow);
        assert!(
            cpu.iter().all(|&b| is_nan_16(b, narrow)),
            "{narrow:?}: {cpu:x?}"
        );
        let quiet = match narrow {
            DType::BF16 => 0x7fc0,
            _ => 0x7e00,
        };
        assert_eq!(cpu[0], quiet, "{narrow:?}: the CPU's f32::NAN");
        assert_eq!(cpu[1], quiet | 0x8000, "{narrow:?}: the sign kept");
        for (variant, k) in variants() {
            let what = format!("{variant} {narrow:?} NaNs");
            let shape = LaunchShape::elementwise(padded.len().div_ceil(4));
            let got =
                narrowed_by_kernel(k, narrow, &x, padded.len(), (0, values.len()), shape, &what);
            assert!(
                got[..values.len()]
                    .iter()
                    .all(|&g| g == u32::from(CANONICAL_NAN_16)),
                "{what}: {got:x?}"
            );
        }
    }
    // Widening: a signalling bf16 NaN and f16 NaN.
    for (narrow, pattern, cpu_bits) in [
        (DType::BF16, 0x7f81u16, 0x7fc1_0000u32),
        (DType::F16, 0x7c01, 0x7fc0_2000),
    ] {
        assert_eq!(
            cpu_widened(&[pattern], narrow),
            vec![cpu_bits],
            "{narrow:?}: CPU"
        );
        let x = Aligned::u16s(&[pattern, 0, 0, 0]);
        for (variant, k) in variants() {
            let what = format!("{variant} {narrow:?} widened NaN");
            let got =
                widened_by_kernel(k, narrow, &x, 4, (0, 4), LaunchShape::elementwise(1), &what);
            assert!(is_written_nan(got[0]), "{what}: {:#010x} not a NaN", got[0]);
        }
    }
}

/// `r3_round_bf16_stochastic` equals the CPU's `stochastic_round_bf16` (r3-model's
/// `round_slice_stochastic`, the same draw of each index) bit for bit, NaN included (both
/// write the canonical `0x7fc0`): values between bf16 neighbours, values bf16 holds exactly,
/// ±∞, NaNs of every kind, the largest finite f32s (which carry into ∞ for most draws), f32
/// subnormals and signed zeros; keys with and without a high word.
#[test]
fn stochastic_rounding_equals_the_cpus_draw_for_draw() {
    let mut values = test_values(1_200, 51);
    values.extend(NANS.map(f32::from_bits));
    values.extend([
        f32::from_bits(0x7f7f_0001),
        -f32::from_bits(0x7f7f_0001),
        1.5,
        1.0 + 0.25 * p2(-7),
    ]);
    let n = values.len();
    let host = Tensor::from_vec(values.clone(), n, &Device::Cpu).expect("host");
    for key in [rounding_key(7, 3, 2), 0xdead_beef_0000_0001, 0] {
        let cpu: Vec<u16> = stochastic_round_bf16(&host, key)
            .and_then(|t| Ok(t.to_vec1::<bf16>()?))
            .expect("the CPU's rounding")
            .iter()
            .map(|v| v.to_bits())
            .collect();
        for (variant, k) in variants() {
            for (shape_name, shape) in shapes(LaunchShape::elementwise(n)) {
                let what = format!("{variant} key {key:#x} {shape_name}");
                let got = in_both_orders(&what, |order| {
                    let mut y = vec![SENTINEL_16; n];
                    let yp = y.as_mut_ptr();
                    launch(shape, order, &|| unsafe {
                        (k.r3_round_bf16_stochastic)(values.as_ptr(), yp.cast(), n, key)
                    })
                    .expect("launch");
                    y
                });
                for (i, (&g, &c)) in got.iter().zip(&cpu).enumerate() {
                    assert_eq!(
                        g, c,
                        "{what}: element {i} ({:e}): {g:#06x} vs {c:#06x}",
                        values[i]
                    );
                }
            }
        }
    }
}
