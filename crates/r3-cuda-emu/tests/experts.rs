//! The routed experts' row kernels through the emulator, in every variant and both thread
//! orders: the row gathers (`r3_gather_rows_f32`, `r3_gather_rows_u16`, their 16-byte and
//! element-wise paths), the gather's backward (`r3_gather_sum_rows_*`: fan-in sums, rows
//! past `grad_rows` zero), the gate-weighted combine (`r3_combine_slots_*`,
//! `r3_combine_in_order_*` with its round codes), its two gradients
//! (`r3_combine_slots_dy_*` with the "none" marker, `r3_combine_slots_dgates_*`, a block
//! reduction) and the expert GEMMs' pointer table (`r3_expert_slot_pointers`).
//!
//! Each kernel runs on the grid r3-model's launcher gives it and on others its contract
//! allows (one warp a block, rows wider than the block, a block of 96 threads, a few
//! threads where the kernel has no warp operation). The truth is r3-model's CPU twin through
//! its public API where it has one (`GatherRows`, `round16`), elsewhere a reference written
//! from the kernel's documented meaning: the combine's twin `combine_rows` and the slots'
//! GEMM call's pointer table (`expert_slot_pointers_twin`, with the kernel's arguments as
//! the GPU path makes them) through `r3_model::kernel_twins`; `CombineInOrder`, crate-private to r3-model, through its
//! documented value, products added in slot order from zero. Copies and fan-in sums (additions only)
//! equal the CPU bit for bit in both variants. The combine's `acc + g · y` is written with
//! the correctly rounded intrinsics (`__fadd_rn(acc, __fmul_rn(g, y))`, which nvcc never
//! contracts into a fused multiply-add), so the combines equal that reference bit for bit in
//! both variants too, the contracted one ("fma", as nvcc compiles) included. Only the gate
//! gradient (a block reduction, its sum in the block's order) is held to a tolerance.

use std::fmt::Debug;

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use r3_cuda_emu::{in_both_orders, launch, variants, LaunchShape};
use r3_model::layers::gather_rows::GatherRows;
use r3_model::round16::rounding_for;

mod common;

use common::Lcg;
use r3_model::launch_shape::row_threads;

/// The marker of a place no slot reads, as the launcher passes it (`NO_SLOT`).
const NONE: u32 = u32::MAX;

/// A value compared by its bits: a launch's outputs in both thread orders, and against the
/// truth (a NaN equals a NaN of the same bits).
trait Word: Copy + Debug {
    /// The value's bits.
    fn word(self) -> u64;
}

impl Word for f32 {
    fn word(self) -> u64 {
        u64::from(self.to_bits())
    }
}

impl Word for u16 {
    fn word(self) -> u64 {
        u64::from(self)
    }
}

impl Word for bf16 {
    fn word(self) -> u64 {
        u64::from(self.to_bits())
    }
}

impl Word for f16 {
    fn word(self) -> u64 {
        u64::from(self.to_bits())
    }
}

impl Word for u64 {
    fn word(self) -> u64 {
        self
    }
}

/// A launch's output, equal to another where every value has the same bits.
#[derive(Debug)]
struct Bits<T>(Vec<T>);

impl<T: Word> PartialEq for Bits<T> {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .zip(&other.0)
                .all(|(a, b)| a.word() == b.word())
    }
}

/// Runs `kernel` (one kernel call writing through the pointer it is given) over a grid of
/// `shape` in both thread orders, its output `len` values filled with `fill` first (on a
/// 16-byte boundary where `aligned`, as a GPU's allocations are); the output, the same bits
/// in both orders (`what` names the launch in a panic).
fn run<T: Word>(
    what: &str,
    shape: LaunchShape,
    (len, aligned): (usize, bool),
    fill: T,
    kernel: impl Fn(*mut T),
) -> Vec<T> {
    in_both_orders(what, |order| {
        let mut buffer = vec![fill; len + 16];
        let skip = if aligned { boundary(&buffer) } else { 0 };
        let out = buffer[skip..].as_mut_ptr();
        launch(shape, order, &|| kernel(out)).expect("the launch runs");
        Bits(buffer[skip..skip + len].to_vec())
    })
    .0
}

/// Where `buffer`'s first 16-byte boundary lies, in elements (within its first 16 bytes).
fn boundary<T>(buffer: &[T]) -> usize {
    let skip = buffer.as_ptr().align_offset(16);
    assert!(
        skip * std::mem::size_of::<T>() < 16,
        "a 16-byte boundary within reach"
    );
    skip
}

/// The first index where `got` and `want` differ (bits, or a NaN against a non-NaN: the
/// NaN a sum makes differs between a host and a GPU, so NaNs compare as NaNs).
fn first_difference(got: &[f32], want: &[f32]) -> Option<usize> {
    assert_eq!(got.len(), want.len(), "lengths");
    got.iter().zip(want).position(|(a, b)| {
        if a.is_nan() || b.is_nan() {
            a.is_nan() != b.is_nan()
        } else {
            a.to_bits() != b.to_bits()
        }
    })
}

/// Asserts `got` has `want`'s values (bits; NaN as NaN), naming `what` and the first index
/// that differs.
fn assert_same_values(what: &str, got: &[f32], want: &[f32]) {
    if let Some(i) = first_difference(got, want) {
        panic!(
            "{what}: value {i} is {:e} where {:e} was expected",
            got[i], want[i]
        );
    }
}

/// A host tensor's values, flattened, as f32 (exact from bf16 and f16).
fn host_values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("host values")
}

/// The launch shapes a per-row kernel over `rows` rows of `cols` entries runs on: the
/// launcher's (`LaunchShape::per_row(rows, row_threads(cols))`), one warp, three warps, and (where the
/// kernel has no warp operation, `any_block`) 7 threads.
fn per_row_shapes(rows: usize, cols: usize, any_block: bool) -> Vec<LaunchShape> {
    let mut shapes = vec![
        LaunchShape::per_row(rows, row_threads(cols)),
        LaunchShape::per_row(rows, 32),
        LaunchShape::per_row(rows, 96),
    ];
    if any_block {
        shapes.push(LaunchShape::per_row(rows, 7));
    } else {
        shapes.push(LaunchShape::per_row(rows, 1024));
    }
    shapes
}

/// `n` source values with the special values a copy must keep: a NaN with a payload, −0,
/// ±∞, a subnormal.
fn values_with_specials(rng: &mut Lcg, n: usize) -> Vec<f32> {
    let mut v = rng.values(n, -3.0, 3.0);
    let specials = [
        f32::from_bits(0x7fc0_1234),
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-40,
    ];
    for (i, s) in specials.into_iter().enumerate() {
        if let Some(x) = v.get_mut(i * 37 % n.max(1)) {
            *x = s;
        }
    }
    v
}

/// The gathered rows' ids: 23 output rows over a 20-row source (rows read 0 to 3 times).
fn gather_ids() -> Vec<u32> {
    (0..23u32).map(|i| (i * 7 + 3) % 20).collect()
}

/// `r3_gather_rows_f32` gives `GatherRows`' host gather (`out[r] = src[ids[r]]`) bit for
/// bit, NaN payloads included: 16-byte copies (`quads`, rows of 8 and of 300 floats on a
/// 16-byte boundary: 75 copies a row, more than one warp's threads) and element copies (rows
/// of 6 and 301 floats, and a source starting 3 floats past a boundary), on the launcher's
/// grid and on blocks of 32, 96 and 7 threads.
#[test]
fn gather_rows_f32_copies_the_rows_gather_rows_copies() {
    let ids = gather_ids();
    let src_rows = 20;
    for (row, skip, quads) in [
        (8, 0, 1),
        (300, 0, 1),
        (6, 0, 0),
        (301, 0, 0),
        (8, 3, 0),
        (300, 3, 0),
    ] {
        let mut rng = Lcg::new(row as u64 + 10 * skip as u64);
        let values = values_with_specials(&mut rng, src_rows * row);
        let mut storage = vec![0f32; src_rows * row + 8];
        let at = boundary(&storage) + skip;
        storage[at..at + src_rows * row].copy_from_slice(&values);
        let src = storage[at..].as_ptr();
        let want = GatherRows::new(ids.clone(), src_rows, src_rows)
            .and_then(|op| op.apply(&Tensor::from_slice(&values, (src_rows, row), &Device::Cpu)?))
            .map(|t| host_values(&t))
            .expect("the host gather");
        for shape in per_row_shapes(ids.len(), row, true) {
            for (name, k) in variants() {
                let what = format!("{name}: rows of {row} from +{skip}, quads {quads}, {shape:?}");
                let got = run(
                    &what,
                    shape,
                    (ids.len() * row, true),
                    f32::NAN,
                    |out| unsafe {
                        (k.r3_gather_rows_f32)(src, ids.as_ptr(), out, row as u32, quads)
                    },
                );
                // Copies: every bit, NaN payload included.
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{what}"
                );
            }
        }
    }
}

/// `r3_gather_rows_u16` gives candle's `index_select` of bf16 and f16 rows (`GatherRows` on
/// the host) word for word: 16-byte copies (`octs`, rows of 16 and 600 values on a 16-byte
/// boundary, and a source 8 values into its storage) and element copies (rows of 6 and 601
/// values, a source 3 values past a boundary), on the launcher's grid
/// (`row_threads(row / 2)`) and blocks of 32, 96 and 7 threads.
#[test]
fn gather_rows_u16_copies_the_rows_index_select_copies() {
    let ids = gather_ids();
    let src_rows = 20;
    for (row, skip, octs) in [
        (16, 0, 1),
        (600, 0, 1),
        (16, 8, 1),
        (6, 0, 0),
        (601, 0, 0),
        (16, 3, 0),
    ] {
        let mut rng = Lcg::new(100 + row as u64 + skip as u64);
        let values = values_with_specials(&mut rng, src_rows * row);
        for dtype in [DType::BF16, DType::F16] {
            let src_t = Tensor::from_slice(&values, (src_rows, row), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .expect("16-bit source");
            let words: Vec<u16> = match dtype {
                DType::BF16 => src_t
                    .flatten_all()
                    .and_then(|t| t.to_vec1::<bf16>())
                    .map(|v| v.iter().map(|x| x.to_bits()).collect()),
                _ => src_t
                    .flatten_all()
                    .and_then(|t| t.to_vec1::<f16>())
                    .map(|v| v.iter().map(|x| x.to_bits()).collect()),
            }
            .expect("16-bit words");
            let want: Vec<u16> = GatherRows::new(ids.clone(), src_rows, src_rows)
                .and_then(|op| Ok(src_t.apply_op1_no_bwd(&op)?))
                .and_then(|t| Ok(t.flatten_all()?))
                .and_then(|t| {
                    Ok(match dtype {
                        DType::BF16 => t.to_vec1::<bf16>()?.iter().map(|x| x.to_bits()).collect(),
                        _ => t.to_vec1::<f16>()?.iter().map(|x| x.to_bits()).collect(),
                    })
                })
                .expect("the host gather");
            let mut storage = vec![0u16; src_rows * row + 16];
            let at = boundary(&storage) + skip;
            storage[at..at + src_rows * row].copy_from_slice(&words);
            let src = storage[at..].as_ptr();
            for shape in per_row_shapes(ids.len(), row.div_ceil(2), true) {
                for (name, k) in variants() {
                    let what = format!(
                        "{name}: {dtype:?} rows of {row} from +{skip}, octs {octs}, {shape:?}"
                    );
                    let got = run(
                        &what,
                        shape,
                        (ids.len() * row, true),
                        0xffffu16,
                        |out| unsafe {
                            (k.r3_gather_rows_u16)(src, ids.as_ptr(), out, row as u32, octs)
                        },
                    );
                    assert_eq!(got, want, "{what}");
                }
            }
        }
    }
}

/// The gather's fan-in table, built from what it means: for each source row below
/// `grad_rows`, the output rows that read it (and are not `unread`), ascending; `offsets`
/// where each row's uses start, and one more, their end.
fn fan_in(ids: &[u32], unread: &[bool], grad_rows: usize) -> (Vec<u32>, Vec<u32>) {
    let mut offsets = vec![0u32];
    let mut uses = Vec::new();
    for q in 0..grad_rows as u32 {
        for (i, &id) in ids.iter().enumerate() {
            if id == q && !unread[i] {
                uses.push(i as u32);
            }
        }
        offsets.push(uses.len() as u32);
    }
    (offsets, uses)
}

/// The gather-sum cases: (row width, rows with a gradient, some outputs unread): a row wider
/// than the launcher's block, a narrow one with the last three source rows padding, and
/// unread outputs left out of the fan-in.
const SUM_CASES: [(usize, usize, bool); 4] = [
    (70, 20, false),
    (6, 17, false),
    (300, 20, false),
    (70, 18, true),
];

/// The gradient rows of a gather sum: seeded, with +∞ and −∞ among source row 3's uses
/// (their sum a NaN) and +∞ alone in source row 10's.
fn sum_gradient(ids: &[u32], row: usize, seed: u64) -> Vec<f32> {
    let mut grad = Lcg::new(seed).values(ids.len() * row, -3.0, 3.0);
    let uses_of = |q: u32| {
        ids.iter()
            .enumerate()
            .filter(move |(_, &id)| id == q)
            .map(|(i, _)| i)
    };
    let three: Vec<usize> = uses_of(3).collect();
    grad[three[0] * row] = f32::INFINITY;
    grad[three[1] * row] = f32::NEG_INFINITY;
    if let Some(i) = uses_of(10).next() {
        grad[i * row + 1] = f32::INFINITY;
    }
    grad
}

/// `r3_gather_sum_rows_f32` gives `GatherRows`' host backward (`gather_sum_host`: each
/// source row's uses added in ascending order from zero, rows past `grad_rows` zero) bit for
/// bit in both variants (additions only: nothing to contract), NaN where ±∞ meet: 50 output
/// rows over 20 source rows (fan-ins 2 to 3), rows of 70, 6 and 300, the last rows padding,
/// unread outputs, on the launcher's grid and blocks of 32, 96 and 7 threads.
#[test]
fn gather_sum_rows_f32_equals_the_host_gather_sum() {
    let ids: Vec<u32> = (0..50u32).map(|i| (i * 7 + 3) % 20).collect();
    let src_rows = 20;
    for (row, grad_rows, some_unread) in SUM_CASES {
        let unread: Vec<bool> = (0..ids.len()).map(|i| some_unread && i % 5 == 2).collect();
        let grad = sum_gradient(&ids, row, 40 + row as u64);
        let grad_t = Tensor::from_slice(&grad, (ids.len(), row), &Device::Cpu).expect("grad");
        let mut op = GatherRows::new(ids.clone(), src_rows, grad_rows).expect("op");
        if some_unread {
            op = op.with_unread_outputs(unread.clone()).expect("unread");
        }
        let want = host_values(
            &op.sum_uses_widened(&grad_t, &[src_rows, row])
                .expect("host sum"),
        );
        assert!(want[3 * row].is_nan(), "∞ − ∞ in source row 3");
        let (offsets, uses) = fan_in(&ids, &unread, grad_rows);
        for shape in per_row_shapes(src_rows, row, true) {
            for (name, k) in variants() {
                let what = format!("{name}: rows of {row}, {grad_rows} with a gradient, unread {some_unread}, {shape:?}");
                let got = run(
                    &what,
                    shape,
                    (src_rows * row, false),
                    f32::NAN,
                    |out| unsafe {
                        (k.r3_gather_sum_rows_f32)(
                            grad.as_ptr(),
                            offsets.as_ptr(),
                            uses.as_ptr(),
                            out,
                            row as u32,
                            grad_rows as u32,
                        )
                    },
                );
                assert_same_values(&what, &got, &want);
                assert!(
                    got[grad_rows * row..].iter().all(|v| v.to_bits() == 0),
                    "{what}: rows past grad_rows are +0"
                );
            }
        }
    }
}

/// `r3_gather_sum_rows_bf16` / `_f16` (16-bit gradient rows widened as read) give
/// `GatherRows::sum_uses_widened` on the host (the rows widened, then summed in f32 in the
/// fan-in's order) bit for bit in both variants, on the same cases and shapes as the f32
/// kernel.
#[test]
fn gather_sum_rows_16_bit_equals_the_widened_host_sum() {
    let ids: Vec<u32> = (0..50u32).map(|i| (i * 7 + 3) % 20).collect();
    let src_rows = 20;
    for (row, grad_rows, some_unread) in SUM_CASES {
        let unread: Vec<bool> = (0..ids.len()).map(|i| some_unread && i % 5 == 2).collect();
        let grad = sum_gradient(&ids, row, 60 + row as u64);
        let (offsets, uses) = fan_in(&ids, &unread, grad_rows);
        for dtype in [DType::BF16, DType::F16] {
            let grad_t = Tensor::from_slice(&grad, (ids.len(), row), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .expect("16-bit gradient");
            let mut op = GatherRows::new(ids.clone(), src_rows, grad_rows).expect("op");
            if some_unread {
                op = op.with_unread_outputs(unread.clone()).expect("unread");
            }
            let want = host_values(
                &op.sum_uses_widened(&grad_t, &[src_rows, row])
                    .expect("host sum"),
            );
            let narrow_bf16: Vec<bf16> = grad.iter().map(|&v| bf16::from_f32(v)).collect();
            let narrow_f16: Vec<f16> = grad.iter().map(|&v| f16::from_f32(v)).collect();
            for shape in per_row_shapes(src_rows, row, true) {
                for (name, k) in variants() {
                    let what = format!("{name}: {dtype:?} rows of {row}, {grad_rows} with a gradient, unread {some_unread}, {shape:?}");
                    let got = run(
                        &what,
                        shape,
                        (src_rows * row, false),
                        f32::NAN,
                        |out| unsafe {
                            match dtype {
                                DType::BF16 => (k.r3_gather_sum_rows_bf16)(
                                    narrow_bf16.as_ptr(),
                                    offsets.as_ptr(),
                                    uses.as_ptr(),
                                    out,
                                    row as u32,
                                    grad_rows as u32,
                                ),
                                _ => (k.r3_gather_sum_rows_f16)(
                                    narrow_f16.as_ptr(),
                                    offsets.as_ptr(),
                                    uses.as_ptr(),
                                    out,
                                    row as u32,
                                    grad_rows as u32,
                                ),
                            }
                        },
                    );
                    assert_same_values(&what, &got, &want);
                }
            }
        }
    }
}

/// A padded layout of `rows` rows of `k` slots among `places` places: each slot's place
/// (distinct, in a seeded order), and the places no slot reads.
fn padded_places(rows: usize, k: usize, places: usize, seed: u64) -> (Vec<u32>, Vec<usize>) {
    let mut rng = Lcg::new(seed);
    let mut order: Vec<u32> = (0..places as u32).collect();
    for i in (1..places).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let padding = order[rows * k..].iter().map(|&p| p as usize).collect();
    (order[..rows * k].to_vec(), padding)
}

/// The place → slot table of `place_of_slot` over `places` places, [`NONE`] where no slot
/// reads a place.
fn slot_of_place(place_of_slot: &[u32], places: usize) -> Vec<u32> {
    let mut slots = vec![NONE; places];
    for (s, &p) in place_of_slot.iter().enumerate() {
        slots[p as usize] = s as u32;
    }
    slots
}

/// The CPU's combine (`combine_rows`): `out[r] = Σ_j g[r, j] · y[place[r, j]]`, each product
/// rounded, then added in slot order from zero.
fn combine_reference(y: &[f32], g: &[f32], place: &[u32], (k, h): (usize, usize)) -> Vec<f32> {
    r3_model::kernel_twins::combine_rows(y, g, place, k, h)
}

/// The largest |got − cpu| relative to `scale`, asserting each within `k · ε` of its scale
/// (each sum within γ_k of the exact one, so the two within 2γ_k ≈ k · ε), naming `what`.
fn within_sum_tolerance(what: &str, got: &[f32], cpu: &[f32], scale: &[f32], k: usize) -> f32 {
    let mut worst = 0f32;
    for (i, ((a, b), s)) in got.iter().zip(cpu).zip(scale).enumerate() {
        let d = (a - b).abs();
        assert!(
            d <= k as f32 * f32::EPSILON * s,
            "{what}: value {i} is {a:e}, the CPU's {b:e} (scale {s:e})"
        );
        if *s > 0.0 {
            worst = worst.max(d / s);
        }
    }
    worst
}

/// A combine case: rows, slots a row, the row width, the places (padding past the slots).
const COMBINE_CASES: [(usize, usize, usize, usize); 4] = [
    (6, 3, 70, 25),
    (5, 2, 300, 13),
    (4, 1, 5, 6),
    (7, 4, 33, 30),
];

/// Expert outputs `[places, h]` for a combine: seeded, the padding places NaN (no slot reads
/// them, so no output may show it).
fn expert_outputs(places: usize, h: usize, padding: &[usize], seed: u64) -> Vec<f32> {
    let mut y = Lcg::new(seed).values(places * h, -3.0, 3.0);
    for &p in padding {
        y[p * h..(p + 1) * h].fill(f32::NAN);
    }
    y
}

/// Gates for `n` slots: seeded in [−0.9, 0.9), one of them zero.
fn gates(n: usize, seed: u64) -> Vec<f32> {
    let mut g: Vec<f32> = Lcg::new(seed)
        .values(n, -3.0, 3.0)
        .iter()
        .map(|v| v * 0.3)
        .collect();
    g[n / 2] = 0.0;
    g
}

/// `r3_combine_slots_f32` over a padded layout (padding places NaN, never read) is the
/// CPU's combine, [`combine_reference`] (`combine_rows`: products added in slot order from
/// zero), bit for bit in every variant: the kernel
/// rounds each product and each sum explicitly (`__fmul_rn`, `__fadd_rn`), so the
/// contracted "fma" build (nvcc's default) keeps those bits too.
/// Rows of 70, 300, 5 and 33 (wider than a block of 32), top-1 to top-4, on the launcher's
/// grid and blocks of 32, 96 and 7 threads.
#[test]
fn combine_slots_f32_is_the_cpu_combine_bit_for_bit() {
    for (case, (rows, k, h, places)) in COMBINE_CASES.into_iter().enumerate() {
        let (place, padding) = padded_places(rows, k, places, case as u64);
        let y = expert_outputs(places, h, &padding, 10 + case as u64);
        let g = gates(rows * k, 20 + case as u64);
        let cpu = combine_reference(&y, &g, &place, (k, h));
        assert!(cpu.iter().all(|v| v.is_finite()), "padding is never read");
        for shape in per_row_shapes(rows, h, true) {
            for (name, kern) in variants() {
                let what = format!("{name}: {rows} rows top-{k} of {h}, {shape:?}");
                let got = run(&what, shape, (rows * h, false), f32::NAN, |out| unsafe {
                    (kern.r3_combine_slots_f32)(
                        y.as_ptr(),
                        g.as_ptr(),
                        place.as_ptr(),
                        out,
                        k as u32,
                        h as u32,
                    )
                });
                assert_same_values(&what, &got, &cpu);
            }
        }
    }
}

/// The narrow copies of `y` (bf16 and f16) and their widened values.
fn narrowed(y: &[f32]) -> (Vec<bf16>, Vec<f32>, Vec<f16>, Vec<f32>) {
    let b: Vec<bf16> = y.iter().map(|&v| bf16::from_f32(v)).collect();
    let f: Vec<f16> = y.iter().map(|&v| f16::from_f32(v)).collect();
    let bw = b.iter().map(|v| v.to_f32()).collect();
    let fw = f.iter().map(|v| v.to_f32()).collect();
    (b, bw, f, fw)
}

/// `r3_combine_slots_bf16` / `_f16` (16-bit expert outputs widened as read) give, in each
/// variant, the f32 kernel's bits over the widened outputs (what the padded experts' fused
/// op, reading 16-bit outputs, and the per-step chain, reading them widened, both run on a
/// GPU: `fused_padded_experts_on_cuda_are_the_per_step_chain` asks for the same bits), and
/// so [`combine_reference`] over them, bit for bit in every variant.
#[test]
fn combine_slots_in_16_bits_is_the_f32_combine_of_the_widened_outputs() {
    for (case, (rows, k, h, places)) in COMBINE_CASES.into_iter().enumerate() {
        let (place, padding) = padded_places(rows, k, places, case as u64);
        let y = expert_outputs(places, h, &padding, 30 + case as u64);
        let g = gates(rows * k, 40 + case as u64);
        let (yb, yb_wide, yf, yf_wide) = narrowed(&y);
        for shape in [
            LaunchShape::per_row(rows, row_threads(h)),
            LaunchShape::per_row(rows, 32),
            LaunchShape::per_row(rows, 7),
        ] {
            for (name, kern) in variants() {
                for (dtype, wide) in [("bf16", &yb_wide), ("f16", &yf_wide)] {
                    let what = format!("{name}: {dtype} {rows} rows top-{k} of {h}, {shape:?}");
                    let got = run(&what, shape, (rows * h, false), f32::NAN, |out| unsafe {
                        match dtype {
                            "bf16" => (kern.r3_combine_slots_bf16)(
                                yb.as_ptr(),
                                g.as_ptr(),
                                place.as_ptr(),
                                out,
                                k as u32,
                                h as u32,
                            ),
                            _ => (kern.r3_combine_slots_f16)(
                                yf.as_ptr(),
                                g.as_ptr(),
                                place.as_ptr(),
                                out,
                                k as u32,
                                h as u32,
                            ),
                        }
                    });
                    let f32_kernel = run(&what, shape, (rows * h, false), f32::NAN, |out| unsafe {
                        (kern.r3_combine_slots_f32)(
                            wide.as_ptr(),
                            g.as_ptr(),
                            place.as_ptr(),
                            out,
                            k as u32,
                            h as u32,
                        )
                    });
                    assert_same_values(&format!("{what} vs the f32 kernel"), &got, &f32_kernel);
                    let want = combine_reference(wide, &g, &place, (k, h));
                    assert_same_values(&what, &got, &want);
                }
            }
        }
    }
}

/// `r3_combine_in_order_*` (slot `r·k + j` at place `r·k + j`, round code 0 / 1 / 2: as it
/// is, bf16, f16) is [`combine_reference`] over the identity places (products added in slot
/// order from zero) then `round16`'s rounding (r3-model's public `rounding_for`): the
/// documented meaning of the CPU's `CombineInOrder`, which is crate-private. Bit for bit in
/// every variant: the kernel's `__fadd_rn(acc, __fmul_rn(g, y))` is not contracted in the
/// "fma" build (nvcc's default) either. Expert outputs f32, bf16 and f16 (widened as read),
/// rows of 70, 300, 5 and 33, on the launcher's grid and blocks of 32, 96, 7 threads.
#[test]
fn combine_in_order_is_the_cpu_combine_then_its_rounding() {
    for (case, (rows, k, h, _)) in COMBINE_CASES.into_iter().enumerate() {
        let place: Vec<u32> = (0..(rows * k) as u32).collect();
        let y = Lcg::new(50 + case as u64).values(rows * k * h, -3.0, 3.0);
        let g = gates(rows * k, 60 + case as u64);
        let (yb, yb_wide, yf, yf_wide) = narrowed(&y);
        for (dtype, wide) in [("f32", &y), ("bf16", &yb_wide), ("f16", &yf_wide)] {
            for round in [0u32, 1, 2] {
                let rounded = |mut v: Vec<f32>| {
                    if round > 0 {
                        let to = if round == 1 { DType::BF16 } else { DType::F16 };
                        rounding_for(to, "test").expect("a 16-bit rounding")(&mut v);
                    }
                    v
                };
                let cpu = rounded(combine_reference(wide, &g, &place, (k, h)));
                for shape in per_row_shapes(rows, h, true) {
                    for (name, kern) in variants() {
                        let what = format!("{name}: {dtype} outputs, round {round}, {rows} rows top-{k} of {h}, {shape:?}");
                        let got = run(&what, shape, (rows * h, false), f32::NAN, |out| unsafe {
                            match dtype {
                                "f32" => (kern.r3_combine_in_order_f32)(
                                    y.as_ptr(),
                                    g.as_ptr(),
                                    out,
                                    k as u32,
                                    h as u32,
                                    round,
                                ),
                                "bf16" => (kern.r3_combine_in_order_bf16)(
                                    yb.as_ptr(),
                                    g.as_ptr(),
                                    out,
                                    k as u32,
                                    h as u32,
                                    round,
                                ),
                                _ => (kern.r3_combine_in_order_f16)(
                                    yf.as_ptr(),
                                    g.as_ptr(),
                                    out,
                                    k as u32,
                                    h as u32,
                                    round,
                                ),
                            }
                        });
                        assert_same_values(&what, &got, &cpu);
                    }
                }
            }
        }
    }
}

/// `r3_combine_slots_dy_*`: for each place p, `g[s] · dout[s / k]` for the slot s reading it
/// (one product: nothing to contract), zeros where `slot_of_place` holds the "none" marker,
/// written as f32 or rounded to bf16 / f16: that value (the documented meaning of the CPU's
/// crate-private `combine_dy_rows`, written out here) then candle's cast (`half`'s
/// conversion) bit for bit in both variants, NaN as NaN (0 · ∞; a GPU's narrowing
/// writes its own NaN). ∞ in the output gradient, a product past f16's range; padding places
/// between the read ones; the launcher's grid and blocks of 32, 96 and 7 threads.
#[test]
fn combine_slots_dy_is_the_gated_gradient_and_zero_on_padding() {
    for (case, (rows, k, h, places)) in COMBINE_CASES.into_iter().enumerate() {
        let (place, padding) = padded_places(rows, k, places, case as u64);
        let slots = slot_of_place(&place, places);
        let mut g = gates(rows * k, 70 + case as u64);
        let mut dout = Lcg::new(80 + case as u64).values(rows * h, -3.0, 3.0);
        // Row 0: ∞ under its first slot's zero gate (a NaN) and its second's (∞ or −∞);
        // a product of 3·10⁴ · 2.5 past f16's largest value.
        g[0] = 0.0;
        dout[0] = f32::INFINITY;
        dout[h - 1] = 3e4;
        g[k - 1] = 2.5;
        let want: Vec<f32> = (0..places * h)
            .map(|i| {
                let (p, c) = (i / h, i % h);
                match slots[p] {
                    NONE => 0.0,
                    s => g[s as usize] * dout[s as usize / k * h + c],
                }
            })
            .collect();
        if k > 1 {
            assert!(
                want[place[0] as usize * h].is_nan(),
                "0 · ∞ where slot 0 reads"
            );
        }
        for &p in &padding {
            assert!(
                want[p * h..(p + 1) * h].iter().all(|&v| v == 0.0),
                "padding place {p}"
            );
        }
        for shape in per_row_shapes(places, h, true) {
            for (name, kern) in variants() {
                let what =
                    format!("{name}: {rows} rows top-{k} of {h} over {places} places, {shape:?}");
                let got = run(&what, shape, (places * h, false), f32::NAN, |out| unsafe {
                    (kern.r3_combine_slots_dy_f32)(
                        dout.as_ptr(),
                        g.as_ptr(),
                        slots.as_ptr(),
                        out,
                        k as u32,
                        h as u32,
                        NONE,
                    )
                });
                assert_same_values(&what, &got, &want);
                // The 16-bit kernels: the f32 value cast (nearest, ties to even).
                macro_rules! sixteen_bit {
                    ($t:ty, $kernel:ident, $label:literal) => {{
                        let got = run(
                            &what,
                            shape,
                            (places * h, false),
                            <$t>::from_bits(0xffff),
                            |out| unsafe {
                                (kern.$kernel)(
                                    dout.as_ptr(),
                                    g.as_ptr(),
                                    slots.as_ptr(),
                                    out,
                                    k as u32,
                                    h as u32,
                                    NONE,
                                )
                            },
                        );
                        let cast: Vec<f32> =
                            want.iter().map(|&v| <$t>::from_f32(v).to_f32()).collect();
                        let got: Vec<f32> = got.iter().map(|v| v.to_f32()).collect();
                        assert_same_values(&format!("{what} {}", $label), &got, &cast);
                        cast
                    }};
                }
                sixteen_bit!(bf16, r3_combine_slots_dy_bf16, "bf16");
                let cast = sixteen_bit!(f16, r3_combine_slots_dy_f16, "f16");
                if k > 1 {
                    assert!(
                        cast.iter().any(|v| v.is_infinite()),
                        "{what}: past f16's range"
                    );
                }
            }
        }
    }
}

/// `r3_combine_slots_dgates_*`: `dg[s] = Σ_c y[place[s], c] · dout[s / k, c]`, a block
/// reduction, against a sum in the order of the CPU's crate-private `combine_dgates_rows`
/// (written out here: products added in column order from zero) within h·ε of Σ|y·d| in
/// both variants (the reduction adds in another order;
/// padding places hold NaN, never read); the same bits in both thread orders; 16-bit outputs
/// give the f32 kernel's bits over their widened values in each variant (the fused padded
/// experts against the per-step chain). Blocks of whole warps only (`block_reduce`): the
/// launcher's, 32, 96 and 1,024 threads (the 16-bit kernels all but the last).
#[test]
fn combine_slots_dgates_is_the_dot_product_within_the_sums_rounding() {
    for (case, (rows, k, h, places)) in COMBINE_CASES.into_iter().enumerate() {
        let (place, padding) = padded_places(rows, k, places, case as u64);
        let y = expert_outputs(places, h, &padding, 90 + case as u64);
        let dout = Lcg::new(100 + case as u64).values(rows * h, -3.0, 3.0);
        let (yb, yb_wide, yf, yf_wide) = narrowed(&y);
        let slots = rows * k;
        let cpu_order = |y: &[f32]| -> (Vec<f32>, Vec<f32>) {
            (0..slots)
                .map(|s| {
                    let (yr, dr) = (&y[place[s] as usize * h..][..h], &dout[s / k * h..][..h]);
                    let sum = yr.iter().zip(dr).fold(0f32, |acc, (a, b)| acc + a * b);
                    let scale = yr.iter().zip(dr).map(|(a, b)| (a * b).abs()).sum::<f32>();
                    (sum, scale)
                })
                .unzip()
        };
        for shape in per_row_shapes(slots, h, false) {
            for (name, kern) in variants() {
                let mut worst = 0f32;
                let what = format!("{name}: {rows} rows top-{k} of {h}, {shape:?}");
                let f32_kernel = run(&what, shape, (slots, false), f32::NAN, |out| unsafe {
                    (kern.r3_combine_slots_dgates_f32)(
                        y.as_ptr(),
                        dout.as_ptr(),
                        place.as_ptr(),
                        out,
                        k as u32,
                        h as u32,
                    )
                });
                let (cpu, scale) = cpu_order(&y);
                worst = worst.max(within_sum_tolerance(&what, &f32_kernel, &cpu, &scale, h));
                // The 16-bit kernels on the smaller blocks (a block of 1,024 fibres is slow here).
                let narrow: &[(&str, &Vec<f32>)] = match shape.block {
                    1024 => &[],
                    _ => &[("bf16", &yb_wide), ("f16", &yf_wide)],
                };
                for &(dtype, wide) in narrow {
                    let what = format!("{what} {dtype}");
                    let got = run(&what, shape, (slots, false), f32::NAN, |out| unsafe {
                        match dtype {
                            "bf16" => (kern.r3_combine_slots_dgates_bf16)(
                                yb.as_ptr(),
                                dout.as_ptr(),
                                place.as_ptr(),
                                out,
                                k as u32,
                                h as u32,
                            ),
                            _ => (kern.r3_combine_slots_dgates_f16)(
                                yf.as_ptr(),
                                dout.as_ptr(),
                                place.as_ptr(),
                                out,
                                k as u32,
                                h as u32,
                            ),
                        }
                    });
                    let widened = run(&what, shape, (slots, false), f32::NAN, |out| unsafe {
                        (kern.r3_combine_slots_dgates_f32)(
                            wide.as_ptr(),
                            dout.as_ptr(),
                            place.as_ptr(),
                            out,
                            k as u32,
                            h as u32,
                        )
                    });
                    assert_same_values(&format!("{what} vs the f32 kernel"), &got, &widened);
                    let (cpu, scale) = cpu_order(wide);
                    worst = worst.max(within_sum_tolerance(&what, &got, &cpu, &scale, h));
                }
                println!("{what}: largest |Δ| vs the CPU's order {worst:.2e} of Σ|y·d|");
            }
        }
    }
}

/// `r3_expert_slot_pointers`' table from its documented meaning, exactly: A pointers
/// `a0 + e·a_step` (e = the slot's id, expert 0 for an id past the stack), B pointers
/// `b0 + (s / share)·b_step`, C pointers `c0 + s·c_step`, in 64-bit arithmetic.
fn pointer_table(
    ids: &[u32],
    stack: u32,
    a: (u64, u64),
    b: (u64, u64),
    share: u32,
    c: (u64, u64),
) -> Vec<u64> {
    let slots = ids.len() as u64;
    let mut table = Vec::with_capacity(3 * ids.len());
    table.extend(
        ids.iter()
            .map(|&id| a.0 + u64::from(if id < stack { id } else { 0 }) * a.1),
    );
    table.extend((0..slots).map(|s| b.0 + s / u64::from(share) * b.1));
    table.extend((0..slots).map(|s| c.0 + s * c.1));
    table
}

/// `r3_expert_slot_pointers` writes the table exactly (integers): 700 slots (three of the
/// launcher's blocks of 256, the last part full) and 5, ids in the stack and past it (the
/// stack's size and u32::MAX read expert 0), `share` 1, 2 and 3 (not dividing the slots),
/// steps past 32 bits; on the launcher's grid (`LaunchShape::elementwise(slots)`), one block of 32 (a
/// grid-stride loop of many rounds) and two blocks of 96.
#[test]
fn expert_slot_pointers_write_the_table_exactly() {
    let stack = 6u32;
    for slots in [700usize, 5] {
        let mut rng = Lcg::new(slots as u64);
        let mut ids: Vec<u32> = (0..slots)
            .map(|_| rng.below(stack as usize) as u32)
            .collect();
        ids[1] = stack;
        ids[slots - 1] = u32::MAX;
        let (a, b, c) = (
            (0x7f00_0000_1000u64, 0x3_0000_0040u64),
            (0x7e00_0000_0000u64, 0x1_0000_0006u64),
            (0x7d00_0000_0200u64, 0x2_0000_0100u64),
        );
        for share in [1u32, 2, 3] {
            let want = pointer_table(&ids, stack, a, b, share, c);
            assert_eq!(want[1], a.0, "an id past the stack reads expert 0");
            let launcher = LaunchShape::elementwise(slots);
            for shape in [
                launcher,
                LaunchShape::blocks(1, 32),
                LaunchShape::blocks(2, 96),
            ] {
                for (name, kern) in variants() {
                    let what = format!("{name}: {slots} slots, share {share}, {shape:?}");
                    let got = run(&what, shape, (3 * slots, false), u64::MAX, |out| unsafe {
                        (kern.r3_expert_slot_pointers)(
                            ids.as_ptr(),
                            out,
                            slots as u32,
                            stack,
                            a.0,
                            a.1,
                            b.0,
                            b.1,
                            share,
                            c.0,
                            c.1,
                        )
                    });
                    assert_eq!(got, want, "{what}");
                }
            }
        }
    }
}

/// The table `r3_expert_slot_pointers` writes is the one cuBLAS must be handed for the
/// slots' GEMM: launched with the arguments r3-model's GPU path makes (`SlotPointerArgs`
/// from the slots' layout), it writes exactly `SlotsLayout::call`'s pointer table (the
/// call whose host run r3-model's tests hold to the gathered experts' product), for f32,
/// bf16 and f16 operands, 1, 2 and 8 slots a row, ids across the stack.
#[test]
fn expert_slot_pointers_write_the_slots_calls_table() {
    use r3_model::kernel_twins::expert_slot_pointers_twin;
    let bases = [0x7f00_0000_1000u64, 0x7e00_0000_0000, 0x7d00_0000_0200];
    for (stack, n, k) in [(6usize, 5usize, 7usize), (128, 1536, 2048)] {
        for share in [1usize, 2, 8] {
            let slots = 3 * share;
            let mut rng = Lcg::new((stack * share) as u64);
            let ids: Vec<u32> = (0..slots).map(|_| rng.below(stack) as u32).collect();
            for elem_bytes in [4usize, 2] {
                let what = format!("stack {stack} [{n}, {k}], share {share}, {elem_bytes}-byte");
                let (args, want) =
                    expert_slot_pointers_twin(&ids, [stack, n, k], share, bases, elem_bytes)
                        .expect("the layout fits");
                assert_eq!(want.len(), 3 * slots, "{what}");
                for (name, kern) in variants() {
                    let shape = LaunchShape::elementwise(slots);
                    let got = run(&what, shape, (3 * slots, false), u64::MAX, |out| unsafe {
                        (kern.r3_expert_slot_pointers)(
                            ids.as_ptr(),
                            out,
                            args.slots,
                            args.stack,
                            args.a[0],
                            args.a[1],
                            args.b[0],
                            args.b[1],
                            args.share,
                            args.c[0],
                            args.c[1],
                        )
                    });
                    assert_eq!(got, want, "{name}: {what}");
                }
            }
        }
    }
}
