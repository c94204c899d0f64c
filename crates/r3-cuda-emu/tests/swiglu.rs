//! The SwiGLU kernels and the token embedding's backward through the emulated grid.
//!
//! SwiGLU over a gate-up projection's halves `h [rows, 2I]`: `y = silu(g) · u` with
//! `silu(g) = g / (1 + exp(−g))` (`r3_swiglu_f32`, its output rounded to bf16 / f16 by its
//! `round` code; `r3_swiglu_narrow_bf16` / `_f16` over 16-bit halves), and its backward
//! `d gate = d · u · σ(g) · (1 + g · (1 − σ(g)))`, `d up = d · silu(g)` (`r3_swiglu_grad_f32`,
//! `r3_swiglu_grad_narrow_bf16` / `_f16`). Their CPU twins (`layers/moe/swiglu_halves.rs`)
//! are not public: the forward's truth is candle's composed `silu(gate) · up` on the CPU
//! (which r3-model's own tests hold the twin to bit for bit) then `r3_model::round16`'s
//! rounding (the twin's rounding point) or candle's cast; the backward's is the documented
//! formula in f32 (the twin's arithmetic) and, independently, candle's autograd of the
//! composed ops in f64.
//!
//! `r3_embedding_grad_f32`: `d[v] = Σ grad[p]` over token v's positions in order, zeros for
//! an unused token, against `r3_model::layers::embedding_rows::embedding_rows`' backward on
//! the CPU (its twin `table_gradient_rows`), bit for bit.
//!
//! Every case runs in both kernel variants, in both thread orders, at the launcher's shape
//! and others (a grid-stride loop with fewer blocks than it needs, one warp, three warps).
//! Every comparison with the twin's arithmetic is bit for bit in both: the backward writes
//! `1 + g · (1 − σ(g))` with the correctly rounded intrinsics (`__fadd_rn`, `__fmul_rn`,
//! `__fsub_rn`, which nvcc never contracts into a fused multiply-add), so the contracted
//! build ("fma", as nvcc compiles) keeps the CPU's bits too. (`expf` here is glibc's, as
//! the CPU's `f32::exp`; a GPU's `expf` may differ from it by an ulp or two.)

use candle_core::{DType, Device, Tensor, Var};
use r3_cuda_emu::{in_both_orders, launch, variants, LaunchShape};
use r3_model::layers::embedding_rows::embedding_rows;
use r3_model::round16::{round_in_place, rounding_for};

mod common;

use common::Lcg;
use r3_model::launch_shape::row_threads;

/// The launcher's grid for `n` elements, then grid-stride shapes with fewer threads than
/// elements: 3 blocks of 64, one warp, 5 blocks of three warps.
fn elementwise_shapes(n: usize) -> [LaunchShape; 4] {
    [
        LaunchShape::elementwise(n),
        LaunchShape::blocks(3, 64),
        LaunchShape::blocks(1, 32),
        LaunchShape::blocks(5, 96),
    ]
}

/// The SwiGLU cases' `(rows, I)`: a length (259) no multiple of 4 or of a block, rows wider
/// than a block, a single element.
const SIZES: [(usize, usize); 3] = [(7, 37), (2, 300), (1, 1)];

/// A gate-up projection `[rows, 2I]`: gates over [−12, 12] with exact zeros of both signs,
/// values whose `exp(−g)` overflows (g = −100: silu is −0) or vanishes (g = 100), and where
/// `nonfinite`, ±∞ gates and ups (silu(−∞) is NaN); ups over [−3, 3].
fn gate_up(rows: usize, half: usize, seed: u64, nonfinite: bool) -> Vec<f32> {
    let mut rng = Lcg::new(seed);
    let mut h = Vec::with_capacity(rows * 2 * half);
    for _ in 0..rows {
        for j in 0..half {
            h.push(match j % 17 {
                3 => 0.0,
                5 => -0.0,
                7 => -100.0,
                11 => 100.0,
                13 if nonfinite => f32::NEG_INFINITY,
                14 if nonfinite => f32::INFINITY,
                _ => rng.uniform(-12.0, 12.0),
            });
        }
        for j in 0..half {
            h.push(match j % 19 {
                2 if nonfinite => f32::INFINITY,
                _ => rng.uniform(-3.0, 3.0),
            });
        }
    }
    h
}

/// An output gradient `[rows, I]` over [−2, 2].
fn output_grad(rows: usize, half: usize, seed: u64) -> Vec<f32> {
    let mut rng = Lcg::new(seed);
    (0..rows * half).map(|_| rng.uniform(-2.0, 2.0)).collect()
}

/// Whether two f32 values are the same bits, or both NaN (a NaN's bits are each
/// arithmetic's own: a GPU writes another NaN than the host).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// candle's composed SwiGLU on the CPU: `silu(h[.., :I]) · h[.., I:]` of the f32 `h`
/// `[rows, 2I]`.
fn composed_swiglu(h: &[f32], rows: usize, half: usize) -> Vec<f32> {
    let t = Tensor::from_vec(h.to_vec(), (rows, 2 * half), &Device::Cpu).expect("gate-up");
    let gate = t.narrow(1, 0, half).and_then(|g| g.silu()).expect("silu");
    let up = t.narrow(1, half, half).expect("up");
    (gate * up)
        .and_then(|y| y.flatten_all())
        .and_then(|y| y.to_vec1::<f32>())
        .expect("composed swiglu")
}

/// The rounding of `r3_swiglu_f32`'s `round` code on the CPU (`round16`, the twin's
/// rounding point): 0 none, 1 bf16, 2 f16.
fn round_as(values: &mut [f32], round: u32) {
    let narrow = match round {
        0 => return,
        1 => DType::BF16,
        _ => DType::F16,
    };
    round_in_place(values, rounding_for(narrow, "swiglu").expect("a rounding"));
}

/// `r3_swiglu_f32` equals candle's composed `silu(gate) · up` then the rounding of its
/// `round` code (0 none, 1 bf16, 2 f16: `swiglu_halves_rounded`'s), bit for bit in both
/// variants: the kernel's `g / (1 + expf(−g)) · u` has no product beside a sum for nvcc to
/// contract. The bits hold on the host because both sides call glibc's `expf` (the CPU's
/// `f32::exp` is it); a GPU's `expf` differs by an ulp or two. Signed zeros, overflowing
/// exponentials and ±∞ included (a NaN compared as a NaN).
#[test]
fn swiglu_in_f32_equals_the_composed_ops_then_the_rounding() {
    for (s, &(rows, half)) in SIZES.iter().enumerate() {
        let n = rows * half;
        let h = gate_up(rows, half, 1 + s as u64, true);
        let composed = composed_swiglu(&h, rows, half);
        for round in [0u32, 1, 2] {
            let mut want = composed.clone();
            round_as(&mut want, round);
            for (name, k) in variants() {
                for shape in elementwise_shapes(n) {
                    let what = format!("{name}, {rows}×{half}, round {round}, {shape:?}");
                    let y = in_both_orders(&what, |order| {
                        let mut y = vec![f32::NAN; n];
                        let yp = y.as_mut_ptr();
                        launch(shape, order, &|| unsafe {
                            (k.r3_swiglu_f32)(h.as_ptr(), yp, n, half as u32, round)
                        })
                        .expect("launch");
                        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    });
                    for (i, (&got, &w)) in y.iter().zip(&want).enumerate() {
                        let got = f32::from_bits(got);
                        assert!(same(got, w), "{what}: element {i}: {got} vs {w}");
                    }
                }
            }
        }
    }
}

/// `r3_swiglu_narrow_bf16` / `_f16` over 16-bit halves equal widening them, candle's
/// composed SwiGLU in f32 and candle's cast back (`SwigluHalvesNarrow::cpu_fwd`'s path), bit
/// for bit in both variants (the same arithmetic as `r3_swiglu_f32`: nothing to contract;
/// on the host, where both sides call glibc's `expf`: a GPU's differs by an ulp or two).
/// Finite inputs only: a NaN's 16-bit bits are the conversion's own (the emulator's and a
/// GPU's canonical 0x7fff, `half`'s quiet NaN keeping the sign).
#[test]
fn swiglu_over_16_bit_halves_equals_widen_composed_narrow() {
    for (s, &(rows, half)) in SIZES.iter().enumerate() {
        let n = rows * half;
        let wide = gate_up(rows, half, 11 + s as u64, false);
        for narrow in [DType::BF16, DType::F16] {
            let t = Tensor::from_vec(wide.clone(), (rows, 2 * half), &Device::Cpu)
                .and_then(|t| t.to_dtype(narrow))
                .expect("16-bit gate-up");
            let widened = t
                .to_dtype(DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .expect("widened");
            let want: Vec<u16> =
                Tensor::from_vec(composed_swiglu(&widened, rows, half), n, &Device::Cpu)
                    .and_then(|y| y.to_dtype(narrow))
                    .map(|y| sixteen_bits(&y))
                    .expect("narrowed");
            let input = sixteen_bits(&t.flatten_all().expect("flat"));
            for (name, k) in variants() {
                for shape in elementwise_shapes(n) {
                    let what = format!("{name}, {narrow:?}, {rows}×{half}, {shape:?}");
                    let y = in_both_orders(&what, |order| {
                        // 0xffff, a NaN in both floats: an element left unwritten shows.
                        let mut y = vec![0xffffu16; n];
                        let (hp, yp) = (input.as_ptr(), y.as_mut_ptr());
                        launch(shape, order, &|| unsafe {
                            match narrow {
                                DType::BF16 => {
                                    (k.r3_swiglu_narrow_bf16)(hp.cast(), yp.cast(), n, half as u32)
                                }
                                _ => (k.r3_swiglu_narrow_f16)(hp.cast(), yp.cast(), n, half as u32),
                            }
                        })
                        .expect("launch");
                        y
                    });
                    assert_eq!(y, want, "{what}");
                }
            }
        }
    }
}

/// The bits of a bf16 or f16 tensor's values.
fn sixteen_bits(t: &Tensor) -> Vec<u16> {
    let t = t.flatten_all().expect("flat");
    match t.dtype() {
        DType::BF16 => t
            .to_vec1::<half::bf16>()
            .expect("bf16")
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        _ => t
            .to_vec1::<half::f16>()
            .expect("f16")
            .iter()
            .map(|v| v.to_bits())
            .collect(),
    }
}

/// The CPU's SwiGLU backward (`swiglu_grad_rows`): `dh [rows, 2I]` of `h [rows, 2I]` and
/// `d [rows, I]`.
fn documented_grad(h: &[f32], d: &[f32], rows: usize, half: usize) -> Vec<f32> {
    assert_eq!(
        (h.len(), d.len()),
        (rows * 2 * half, rows * half),
        "operand shapes"
    );
    r3_model::kernel_twins::swiglu_grad_rows(h, d, half)
}

/// candle's autograd of the composed `silu(gate) · up` in f64 for the output gradient `d`:
/// `dh [rows, 2I]`, independent of the kernel's formula.
fn autograd_grad(h: &[f32], d: &[f32], rows: usize, half: usize) -> Vec<f64> {
    let wide = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    let hv = Var::from_tensor(
        &Tensor::from_vec(wide(h), (rows, 2 * half), &Device::Cpu).expect("gate-up"),
    )
    .expect("var");
    let probe = Tensor::from_vec(wide(d), (rows, half), &Device::Cpu).expect("probe");
    let gate = hv.narrow(1, 0, half).and_then(|g| g.silu()).expect("silu");
    let y = (gate * hv.narrow(1, half, half).expect("up")).expect("swiglu");
    let grads = (y * probe)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    grads
        .get(hv.as_tensor())
        .expect("gradient")
        .flatten_all()
        .and_then(|g| g.to_vec1::<f64>())
        .expect("values")
}

/// `r3_swiglu_grad_f32` writes both halves of `dh` as documented: exactly the twin's f32
/// arithmetic (bits) in every variant (the kernel's `1 + g · (1 − s)` is written with `_rn`
/// intrinsics, so the contracted build rounds the product and the sum as the CPU does; the
/// bits hold on the host because both sides call glibc's `expf`, which a GPU's differs from
/// by an ulp or two), and within 1e-6 of its scale of candle's f64 autograd of the composed
/// ops.
#[test]
fn swiglu_gradient_in_f32_is_the_documented_formula() {
    for (s, &(rows, half)) in SIZES.iter().enumerate() {
        let n = rows * half;
        let h = gate_up(rows, half, 21 + s as u64, false);
        let d = output_grad(rows, half, 31 + s as u64);
        let want = documented_grad(&h, &d, rows, half);
        let exact = autograd_grad(&h, &d, rows, half);
        for (name, k) in variants() {
            for shape in elementwise_shapes(n) {
                let what = format!("{name}, {rows}×{half}, {shape:?}");
                let dh = in_both_orders(&what, |order| {
                    let mut dh = vec![f32::NAN; 2 * n];
                    let dp = dh.as_mut_ptr();
                    launch(shape, order, &|| unsafe {
                        (k.r3_swiglu_grad_f32)(h.as_ptr(), d.as_ptr(), dp, n, half as u32)
                    })
                    .expect("launch");
                    dh.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                });
                for (i, &bits) in dh.iter().enumerate() {
                    let (got, w) = (f32::from_bits(bits), want[i]);
                    let (r, c) = (i / (2 * half), i % (2 * half));
                    let j = c % half;
                    let at = r * 2 * half + j;
                    let (g, u, dd) = (h[at], h[at + half], d[r * half + j]);
                    assert_eq!(bits, w.to_bits(), "{what}: dh[{i}] {got} vs {w}");
                    let scale = dd.abs() * (u.abs() * (1.0 + g.abs()) + g.abs());
                    let err = (f64::from(got) - exact[i]).abs();
                    assert!(
                        err <= 1e-6 * f64::from(scale.max(1e-30)),
                        "{what}: dh[{i}] {got} vs exact {}",
                        exact[i]
                    );
                }
            }
        }
    }
}

/// Operands `(g, u, d)`, each exact in `narrow` (bf16 or f16), whose d gate narrowed to
/// `narrow` is another 16-bit value where `1 + g · (1 − s)` is one fused multiply-add (what
/// nvcc's contraction would compute) than where it is rounded twice (the twin's
/// arithmetic): planted in the 16-bit test's data, so a kernel whose d gate were contracted
/// fails it (an f32 value an ulp off seldom crosses a 16-bit rounding boundary, so seeded
/// data alone would not show it). The first `count` of a seeded search over gates near
/// −1.28, where `1 + g · (1 − s)` nearly cancels and the two roundings differ most.
fn contraction_witnesses(narrow: DType, count: usize) -> Vec<(f32, f32, f32)> {
    let bits16 = |v: f32| match narrow {
        DType::BF16 => half::bf16::from_f32(v).to_bits(),
        _ => half::f16::from_f32(v).to_bits(),
    };
    let exact = |v: f32| match narrow {
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        _ => half::f16::from_f32(v).to_f32(),
    };
    let mut rng = Lcg::new(61);
    let mut found = Vec::with_capacity(count);
    for _ in 0..1_000_000 {
        if found.len() == count {
            break;
        }
        let g = exact(rng.uniform(-1.5, -1.1));
        let (u, dd) = (exact(rng.uniform(-3.0, 3.0)), exact(rng.uniform(-2.0, 2.0)));
        let s = 1.0 / (1.0 + (-g).exp());
        let twice = dd * u * (s * (1.0 + g * (1.0 - s)));
        let fused = dd * u * (s * g.mul_add(1.0 - s, 1.0));
        if bits16(twice) != bits16(fused) {
            found.push((g, u, dd));
        }
    }
    assert_eq!(
        found.len(),
        count,
        "{narrow:?}: contraction witnesses found"
    );
    found
}

/// `r3_swiglu_grad_narrow_bf16` / `_f16` equal widening both operands, the documented f32
/// backward and narrowing (`SwigluGrad::cpu_fwd`'s 16-bit branch) bit for bit in every
/// variant (the f32 arithmetic of `r3_swiglu_grad_f32`, its `_rn` intrinsics included; on
/// the host, where both sides call glibc's `expf`: a GPU's differs by an ulp or two).
/// Row 0 starts with [`contraction_witnesses`], on which a contracted d gate would differ.
#[test]
fn swiglu_gradient_over_16_bit_halves_equals_widen_formula_narrow() {
    for (s, &(rows, half)) in SIZES.iter().enumerate() {
        let n = rows * half;
        for narrow in [DType::BF16, DType::F16] {
            let to16 = |v: Vec<f32>, dims: (usize, usize)| {
                Tensor::from_vec(v, dims, &Device::Cpu)
                    .and_then(|t| t.to_dtype(narrow))
                    .expect("16-bit")
            };
            let widen = |t: &Tensor| {
                t.to_dtype(DType::F32)
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1::<f32>())
                    .expect("widened")
            };
            let mut hv = gate_up(rows, half, 41 + s as u64, false);
            let mut dv = output_grad(rows, half, 51 + s as u64);
            for (j, (g, u, dd)) in contraction_witnesses(narrow, half.min(2))
                .into_iter()
                .enumerate()
            {
                (hv[j], hv[half + j], dv[j]) = (g, u, dd);
            }
            let h16 = to16(hv, (rows, 2 * half));
            let d16 = to16(dv, (rows, half));
            let want = sixteen_bits(&to16(
                documented_grad(&widen(&h16), &widen(&d16), rows, half),
                (rows, 2 * half),
            ));
            let (hb, db) = (sixteen_bits(&h16), sixteen_bits(&d16));
            for (name, k) in variants() {
                for shape in elementwise_shapes(n) {
                    let what = format!("{name}, {narrow:?}, {rows}×{half}, {shape:?}");
                    let dh = in_both_orders(&what, |order| {
                        let mut dh = vec![0xffffu16; 2 * n];
                        let (hp, dp, op) = (hb.as_ptr(), db.as_ptr(), dh.as_mut_ptr());
                        launch(shape, order, &|| unsafe {
                            let half = half as u32;
                            match narrow {
                                DType::BF16 => (k.r3_swiglu_grad_narrow_bf16)(
                                    hp.cast(),
                                    dp.cast(),
                                    op.cast(),
                                    n,
                                    half,
                                ),
                                _ => (k.r3_swiglu_grad_narrow_f16)(
                                    hp.cast(),
                                    dp.cast(),
                                    op.cast(),
                                    n,
                                    half,
                                ),
                            }
                        })
                        .expect("launch");
                        dh
                    });
                    for (i, (&got, &w)) in dh.iter().zip(&want).enumerate() {
                        assert_eq!(got, w, "{what}: dh[{i}]");
                    }
                }
            }
        }
    }
}

/// The token embedding's gradient `[V, H]` on the CPU: `embedding_rows`' backward for the
/// output gradient `grad` `[N, H]` (the gradient of `Σ rows ⊙ grad`) of tokens `ids`.
fn cpu_table_gradient(ids: &[u32], grad: &[f32], vocab: usize, h: usize) -> Vec<f32> {
    let table = Var::from_tensor(&Tensor::zeros((vocab, h), DType::F32, &Device::Cpu).expect("t"))
        .expect("table");
    let ids_t = Tensor::new(ids, &Device::Cpu).expect("ids");
    let rows = embedding_rows(table.as_tensor(), &ids_t, ids).expect("rows");
    let probe = Tensor::from_vec(grad.to_vec(), (ids.len(), h), &Device::Cpu).expect("probe");
    let grads = (rows * probe)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    grads
        .get(table.as_tensor())
        .expect("gradient")
        .flatten_all()
        .and_then(|g| g.to_vec1::<f32>())
        .expect("values")
}

/// The kernel's position tables for `ids` over `vocab` tokens: `offsets [V + 1]` (token v's
/// positions are `order[offsets[v] .. offsets[v + 1]]`) and `order [N]`, each token's
/// positions ascending.
fn position_tables(ids: &[u32], vocab: usize) -> (Vec<u32>, Vec<u32>) {
    let mut offsets = vec![0u32];
    let mut order = Vec::with_capacity(ids.len());
    for v in 0..vocab as u32 {
        order.extend((0..ids.len() as u32).filter(|&p| ids[p as usize] == v));
        offsets.push(order.len() as u32);
    }
    (offsets, order)
}

/// `r3_embedding_grad_f32` equals the CPU embedding's backward bit for bit in both variants
/// (each column's sum from zero in position order, as the CPU adds: no product to
/// contract), the NaN of +∞ + −∞ as a NaN (its bits are the adding hardware's own: the
/// host's default NaN here, a GPU's another): tokens used once, many times (with addends of
/// very different sizes, whose sum another order would round otherwise), not at all (zeros)
/// and with +∞ and −∞ addends (a NaN), widths no multiple of 4, wider than a block and
/// narrower than a warp, at the launcher's block (one a vocabulary row) and one warp, three
/// warps, 1,024 threads.
#[test]
fn embedding_gradient_equals_the_cpu_backward_bit_for_bit() {
    let vocab = 13usize;
    // Token 3 six times, 0 twice, 5 three times, 9 and 12 once; 1, 2, 4, 6, 7, 8, 10, 11
    // unused; 11 holds the ±∞.
    let ids: Vec<u32> = vec![3, 0, 3, 5, 11, 3, 9, 0, 5, 3, 12, 3, 5, 11, 3];
    let (offsets, order) = position_tables(&ids, vocab);
    for (case, h) in [37usize, 300, 5].into_iter().enumerate() {
        let mut rng = Lcg::new(61 + case as u64);
        let mut grad: Vec<f32> = (0..ids.len() * h)
            .map(|i| match i % 7 {
                // Large addends beside small ones: the order of a token's sum shows.
                0 => rng.uniform(-1e8, 1e8),
                _ => rng.uniform(-2.0, 2.0),
            })
            .collect();
        // Token 11 (positions 4 and 13): +∞ then −∞ in column 1.
        grad[4 * h + 1] = f32::INFINITY;
        grad[13 * h + 1] = f32::NEG_INFINITY;
        let want = cpu_table_gradient(&ids, &grad, vocab, h);
        assert!(want[11 * h + 1].is_nan());
        assert!(
            want[4 * h..5 * h].iter().all(|&v| v.to_bits() == 0),
            "unused"
        );
        let launcher = row_threads(h);
        let mut shapes = vec![launcher];
        shapes.extend([32, 96, 1024].into_iter().filter(|&t| t != launcher));
        for (name, k) in variants() {
            for &threads in &shapes {
                let what = format!("{name}, H {h}, {threads} threads");
                let d = in_both_orders(&what, |order_| {
                    // A value no sum here reaches (not a NaN, so an unwritten NaN slot shows).
                    let mut d = vec![f32::MAX; vocab * h];
                    let dp = d.as_mut_ptr();
                    launch(
                        LaunchShape::blocks(vocab as u32, threads),
                        order_,
                        &|| unsafe {
                            (k.r3_embedding_grad_f32)(
                                grad.as_ptr(),
                                offsets.as_ptr(),
                                order.as_ptr(),
                                dp,
                                h as u32,
                            )
                        },
                    )
                    .expect("launch");
                    d.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                });
                for (i, (&got, &w)) in d.iter().zip(&want).enumerate() {
                    let (r, c) = (i / h, i % h);
                    if w.is_nan() {
                        assert!(f32::from_bits(got).is_nan(), "{what}: d[{r}, {c}] {got:#x}");
                    } else {
                        assert_eq!(got, w.to_bits(), "{what}: d[{r}, {c}] {got:#x} vs {w}");
                    }
                }
            }
        }
    }
}
