//! The optimiser's kernels of `kernels.cu` against the CPU's optimiser:
//!
//! - the ten fused AdamW passes (`r3_adamw_*`: θ f32 or bf16, the gradient f32, bf16 or
//!   f16, the moments f32 or bf16; the staged 16-bit copy of θ; the maxima the guard reads)
//!   against r3-train's `AdamW::step_scaled` on the CPU, whose fused pass (`fused_optim.rs`
//!   `adamw_chunk`) the GPU test `cuda_adamw_pass_equals_the_cpu_bit_for_bit` holds them to
//!   bit for bit. Every kernel operation is a `__f*_rn` intrinsic, which neither nvcc nor the
//!   emulator's contracted variant fuses, so the bits hold in both variants;
//! - the gradient norm's sums of squares (`r3_sum_squares_*` per tensor into f64 partials,
//!   `r3_sum_squares_total`) against an f64 reference and r3-train's CPU norm, within a
//!   tolerance (the sums are added in another order);
//! - the stochastically rounded sums of two addends (`r3_sum_bf16_stochastic_*`) against
//!   r3-model's `sum_round_bf16_stochastic` on the CPU, bit for bit, NaN and ∞ included.
//!
//! Every launch runs in both thread orders (a race shows as two answers) and under the
//! launcher's shape and at least one other.

use std::collections::HashMap;
use std::ffi::c_void;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use half::{bf16, f16};
use r3_cuda_emu::{in_both_orders, launch, variants, Kernels, LaunchShape};
use r3_model::optim_pass::AdamWPassConstants;
use r3_model::stochastic_round::{sum_round_bf16_stochastic, sum_rounding_key};
use r3_train::{adamw_constants, AdamW, AdamWParams, AdamWStep, UpdateAt};

mod common;

use common::Lcg;
use r3_model::launch_shape::{sum_squares_blocks, SUM_SQUARES_THREADS, SUM_SQUARES_TOTAL_THREADS};
use r3_test_support::bits;

/// The shapes an elementwise kernel runs under: the launcher's, one block of one warp (a
/// grid-stride loop of many turns), and a few blocks of a width that is a multiple of 32 but
/// no power of two.
fn shapes(n: usize) -> [(&'static str, LaunchShape); 3] {
    [
        ("launcher", LaunchShape::elementwise(n)),
        ("1 × 32", LaunchShape::blocks(1, 32)),
        ("3 × 96", LaunchShape::blocks(3, 96)),
    ]
}

/// Values of one float dtype (f32, bf16 or f16), the form a kernel's buffer takes.
#[derive(Clone, Debug, PartialEq)]
enum Floats {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Floats {
    /// `values` rounded to `dtype` (nearest, ties to even).
    fn new(values: &[f32], dtype: DType) -> Self {
        match dtype {
            DType::F32 => Floats::F32(values.to_vec()),
            DType::BF16 => Floats::Bf16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
            DType::F16 => Floats::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            other => panic!("no kernel buffer of {other:?}"),
        }
    }

    /// `n` values of `dtype` that no kernel writes (NaNs with a payload), to see a gap.
    fn unwritten(n: usize, dtype: DType) -> Self {
        match dtype {
            DType::F32 => Floats::F32(vec![f32::from_bits(0x7fba_dbad); n]),
            DType::BF16 => Floats::Bf16(vec![bf16::from_bits(0x7fba); n]),
            DType::F16 => Floats::F16(vec![f16::from_bits(0x7d5a); n]),
            other => panic!("no kernel buffer of {other:?}"),
        }
    }

    /// The buffer's start.
    fn ptr(&self) -> *const c_void {
        match self {
            Floats::F32(v) => v.as_ptr().cast(),
            Floats::Bf16(v) => v.as_ptr().cast(),
            Floats::F16(v) => v.as_ptr().cast(),
        }
    }

    /// The buffer's start, for writing.
    fn mut_ptr(&mut self) -> *mut c_void {
        match self {
            Floats::F32(v) => v.as_mut_ptr().cast(),
            Floats::Bf16(v) => v.as_mut_ptr().cast(),
            Floats::F16(v) => v.as_mut_ptr().cast(),
        }
    }

    /// The values widened to f32 (exact), as bit patterns.
    fn bits(&self) -> Vec<u32> {
        match self {
            Floats::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            Floats::Bf16(v) => v.iter().map(|x| x.to_f32().to_bits()).collect(),
            Floats::F16(v) => v.iter().map(|x| x.to_f32().to_bits()).collect(),
        }
    }

    /// The values as a CPU tensor of their dtype.
    fn tensor(&self) -> Tensor {
        let n = match self {
            Floats::F32(v) => v.len(),
            Floats::Bf16(v) => v.len(),
            Floats::F16(v) => v.len(),
        };
        match self {
            Floats::F32(v) => Tensor::from_vec(v.clone(), n, &Device::Cpu),
            Floats::Bf16(v) => Tensor::from_vec(v.clone(), n, &Device::Cpu),
            Floats::F16(v) => Tensor::from_vec(v.clone(), n, &Device::Cpu),
        }
        .expect("a CPU tensor")
    }
}

/// One AdamW kernel's dtypes: (kernel, θ, gradient, moments), every kernel the optimiser
/// launches (`optim_pass.rs`, the `_mbf16` name for bf16 moments).
const ADAMW_KERNELS: [(&str, DType, DType, DType); 10] = [
    ("r3_adamw_f32", DType::F32, DType::F32, DType::F32),
    (
        "r3_adamw_f32_grad_bf16",
        DType::F32,
        DType::BF16,
        DType::F32,
    ),
    ("r3_adamw_f32_grad_f16", DType::F32, DType::F16, DType::F32),
    ("r3_adamw_bf16", DType::BF16, DType::F32, DType::F32),
    (
        "r3_adamw_bf16_grad_bf16",
        DType::BF16,
        DType::BF16,
        DType::F32,
    ),
    ("r3_adamw_f32_mbf16", DType::F32, DType::F32, DType::BF16),
    (
        "r3_adamw_f32_grad_bf16_mbf16",
        DType::F32,
        DType::BF16,
        DType::BF16,
    ),
    (
        "r3_adamw_f32_grad_f16_mbf16",
        DType::F32,
        DType::F16,
        DType::BF16,
    ),
    ("r3_adamw_bf16_mbf16", DType::BF16, DType::F32, DType::BF16),
    (
        "r3_adamw_bf16_grad_bf16_mbf16",
        DType::BF16,
        DType::BF16,
        DType::BF16,
    ),
];

/// The run's seed of the stochastic roundings.
const SEED: u64 = 7;
/// The optimiser's hyper-parameters: the defaults with weight decay.
const PARAMS: AdamWParams = AdamWParams {
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.05,
};

/// One variable's inputs to an update: its name (the variables sort by it, which gives the
/// slot index the draws' keys depend on), whether it decays, θ, g, m and v in their dtypes.
#[derive(Clone, Debug)]
struct VarInputs {
    name: &'static str,
    decay: bool,
    theta: Floats,
    g: Floats,
    m: Floats,
    v: Floats,
}

/// One update's setting: the step `t` (1-based), the learning rate, the gradient-clip
/// factor, and the dtype of a held 16-bit copy of θ.
#[derive(Clone, Copy, Debug)]
struct Setting {
    t: u64,
    lr: f64,
    scale: Option<f32>,
    copy: Option<DType>,
}

/// Two variables' seeded inputs for the kernel `(θ, gradient, moments)` dtypes: `a`
/// (1,003 values, decayed) and `b` (77 values, not decayed, so slot 1 with another key); the
/// second moments non-negative.
fn inputs(param: DType, grad: DType, moments: DType, seed: u64) -> Vec<VarInputs> {
    let mut rng = Lcg::new(seed);
    [("a", 1_003usize, true), ("b", 77, false)]
        .into_iter()
        .map(|(name, n, decay)| {
            let theta = spread_values(&mut rng, n, 2.0);
            let g = spread_values(&mut rng, n, 1.0);
            let m = spread_values(&mut rng, n, 0.1);
            let v: Vec<f32> = spread_values(&mut rng, n, 0.01)
                .iter()
                .map(|x| x.abs())
                .collect();
            VarInputs {
                name,
                decay,
                theta: Floats::new(&theta, param),
                g: Floats::new(&g, grad),
                m: Floats::new(&m, moments),
                v: Floats::new(&v, moments),
            }
        })
        .collect()
}

/// One variable's update as bits: θ', m', v' (widened to f32), the 16-bit copy (widened)
/// where one is held.
#[derive(Debug, PartialEq)]
struct Updated {
    theta: Vec<u32>,
    m: Vec<u32>,
    v: Vec<u32>,
    copy: Option<Vec<u32>>,
}

/// The CPU's update of `vars` (r3-train's `AdamW` at step `s.t`, the moments and step count
/// loaded as the inputs give them): its outcome and, where applied, each variable's update.
fn cpu_update(vars: &[VarInputs], moments: DType, s: Setting) -> (AdamWStep, Vec<Updated>) {
    let held: Vec<(String, Var)> = vars
        .iter()
        .map(|x| {
            let var = Var::from_tensor(&x.theta.tensor()).expect("variable");
            (x.name.to_string(), var)
        })
        .collect();
    let decayed: Vec<&str> = vars.iter().filter(|x| x.decay).map(|x| x.name).collect();
    let mut opt =
        AdamW::new(held.clone(), PARAMS, |name, _| decayed.contains(&name)).expect("AdamW");
    opt.set_rounding_seed(SEED);
    opt.set_moment_dtype(moments).expect("moments");
    let state: HashMap<String, Tensor> = vars
        .iter()
        .flat_map(|x| {
            [
                (format!("adamw.m.{}", x.name), x.m.tensor()),
                (format!("adamw.v.{}", x.name), x.v.tensor()),
            ]
        })
        .collect();
    opt.load_state(&state, s.t - 1).expect("state");
    let copies: Vec<(String, Var)> = match s.copy {
        Some(dtype) => held
            .iter()
            .map(|(name, var)| {
                let copy = Tensor::zeros(var.dims(), dtype, &Device::Cpu)
                    .and_then(|z| Var::from_tensor(&z))
                    .expect("copy");
                (name.clone(), copy)
            })
            .collect(),
        None => Vec::new(),
    };
    if !copies.is_empty() {
        opt.hold_narrow_copies(copies.clone()).expect("copies");
    }
    let mut grads = GradStore::default();
    for ((_, var), x) in held.iter().zip(vars) {
        grads.insert(var.as_tensor(), x.g.tensor());
    }
    let outcome = opt.step_scaled(&grads, s.lr, s.scale).expect("step");
    let state = opt.state_tensors();
    let updated = held
        .iter()
        .enumerate()
        .map(|(i, (name, var))| Updated {
            theta: bits(var.as_tensor()),
            m: bits(&state[&format!("adamw.m.{name}")]),
            v: bits(&state[&format!("adamw.v.{name}")]),
            copy: copies.get(i).map(|(_, c)| bits(c.as_tensor())),
        })
        .collect();
    (outcome, updated)
}

/// The constants of slot `slot`'s pass at `s`: r3-train's `adamw_constants`, which the CPU
/// pass and the GPU launcher receive.
fn constants(s: Setting, slot: usize, decay: bool) -> AdamWPassConstants {
    let at = UpdateAt {
        t: s.t,
        lr: s.lr,
        grad_scale: s.scale,
        rounding_seed: SEED,
    };
    adamw_constants(&PARAMS, at, slot, decay)
}

/// What one AdamW launch wrote: the update and the three maxima (bit patterns).
#[derive(Debug, PartialEq)]
struct KernelUpdate {
    updated: Updated,
    maxima: [u32; 3],
}

/// The AdamW kernel `name` of `k` over one variable's inputs `x` with the constants `c`
/// under `shape`, as r3-model's launcher passes them (`decay` and `scale` 1 where unused,
/// the copy's code 1 bf16, 2 f16, 0 none with a null pointer), outputs fresh and maxima zero.
fn kernel_update(
    k: &Kernels,
    (name, param, moments): (&str, DType, DType),
    x: &VarInputs,
    c: &AdamWPassConstants,
    copy: Option<DType>,
    shape: LaunchShape,
    what: &str,
) -> KernelUpdate {
    let n = match &x.theta {
        Floats::F32(v) => v.len(),
        Floats::Bf16(v) => v.len(),
        Floats::F16(v) => v.len(),
    };
    in_both_orders(what, |order| {
        let mut theta_out = Floats::unwritten(n, param);
        let mut m_out = Floats::unwritten(n, moments);
        let mut v_out = Floats::unwritten(n, moments);
        let mut copy_out = copy.map(|d| Floats::unwritten(n, d));
        let mut maxima = [0u32; 3];
        let (tp, gp, mp, vp) = (x.theta.ptr(), x.g.ptr(), x.m.ptr(), x.v.ptr());
        let (top, mop, vop) = (theta_out.mut_ptr(), m_out.mut_ptr(), v_out.mut_ptr());
        let cp = copy_out
            .as_mut()
            .map_or(std::ptr::null_mut(), Floats::mut_ptr);
        let code = match copy {
            Some(DType::BF16) => 1u32,
            Some(_) => 2,
            None => 0,
        };
        let xp = maxima.as_mut_ptr();
        let (decay, scale) = (c.decay.unwrap_or(1.0), c.grad_scale.unwrap_or(1.0));
        let (use_decay, use_scale) = (
            u32::from(c.decay.is_some()),
            u32::from(c.grad_scale.is_some()),
        );
        let [m_key, v_key] = c.moment_keys;
        // Every AdamW kernel has the one signature, its pointers' types by the name.
        macro_rules! call {
            ($kernel:ident) => {
                (k.$kernel)(
                    tp.cast(),
                    gp.cast(),
                    mp.cast(),
                    vp.cast(),
                    top.cast(),
                    mop.cast(),
                    vop.cast(),
                    xp,
                    n,
                    c.beta1,
                    c.one_minus_beta1,
                    c.beta2,
                    c.one_minus_beta2,
                    c.inv_bc1,
                    c.inv_bc2,
                    c.eps,
                    c.lr,
                    decay,
                    scale,
                    use_decay,
                    use_scale,
                    cp,
                    code,
                    c.rounding_key,
                    m_key,
                    v_key,
                )
            };
        }
        launch(shape, order, &|| unsafe {
            match name {
                "r3_adamw_f32" => call!(r3_adamw_f32),
                "r3_adamw_f32_grad_bf16" => call!(r3_adamw_f32_grad_bf16),
                "r3_adamw_f32_grad_f16" => call!(r3_adamw_f32_grad_f16),
                "r3_adamw_bf16" => call!(r3_adamw_bf16),
                "r3_adamw_bf16_grad_bf16" => call!(r3_adamw_bf16_grad_bf16),
                "r3_adamw_f32_mbf16" => call!(r3_adamw_f32_mbf16),
                "r3_adamw_f32_grad_bf16_mbf16" => call!(r3_adamw_f32_grad_bf16_mbf16),
                "r3_adamw_f32_grad_f16_mbf16" => call!(r3_adamw_f32_grad_f16_mbf16),
                "r3_adamw_bf16_mbf16" => call!(r3_adamw_bf16_mbf16),
                "r3_adamw_bf16_grad_bf16_mbf16" => call!(r3_adamw_bf16_grad_bf16_mbf16),
                other => panic!("no AdamW kernel {other}"),
            }
        })
        .expect("launch");
        KernelUpdate {
            updated: Updated {
                theta: theta_out.bits(),
                m: m_out.bits(),
                v: v_out.bits(),
                copy: copy_out.map(|c| c.bits()),
            },
            maxima,
        }
    })
}

/// The largest `|x|` bit pattern of `bits` (what the guard's maxima hold).
fn largest_magnitude(bits: &[u32]) -> u32 {
    bits.iter().map(|b| b & 0x7fff_ffff).max().unwrap_or(0)
}

/// The bits of +∞: a maximum at or above it is a NaN or an infinity.
const INF_BITS: u32 = 0x7f80_0000;

/// Each of the ten AdamW kernels equals the CPU's update (r3-train's `AdamW::step_scaled`,
/// its fused pass) bit for bit, in both variants, under the launcher's shape and others:
/// θ', m', v', the staged 16-bit copy of an f32 θ (bf16 and f16, against the copy the CPU
/// optimiser rewrites from θ'), and the maxima (the largest |θ'|, |m'|, |v'| of the CPU's
/// values). Two variables (decayed or not; slot 0 and 1, whose draws' keys differ), steps
/// with and without a gradient-clip factor, a first step from zero moments.
#[test]
fn adamw_kernels_equal_the_cpus_update_bit_for_bit() {
    for (name, param, grad, moments) in ADAMW_KERNELS {
        let settings = [
            Setting {
                t: 5,
                lr: 3e-2,
                scale: Some(0.37),
                copy: None,
            },
            Setting {
                t: 1,
                lr: 1e-3,
                scale: None,
                copy: None,
            },
        ];
        // A held copy of θ is for f32 θ only (the launcher refuses it for bf16 θ).
        let copies: &[Option<DType>] = match param {
            DType::F32 => &[None, Some(DType::BF16), Some(DType::F16)],
            _ => &[None],
        };
        for (si, setting) in settings.iter().enumerate() {
            for &copy in copies {
                let s = Setting { copy, ..*setting };
                let mut vars = inputs(param, grad, moments, 100 + si as u64);
                if s.t == 1 {
                    for x in &mut vars {
                        let n = x.m.bits().len();
                        x.m = Floats::new(&vec![0.0; n], moments);
                        x.v = Floats::new(&vec![0.0; n], moments);
                    }
                }
                let (outcome, cpu) = cpu_update(&vars, moments, s);
                assert_eq!(outcome, AdamWStep::Applied, "{name} {s:?}");
                for (slot, (x, want)) in vars.iter().zip(&cpu).enumerate() {
                    let c = constants(s, slot, x.decay);
                    let maxima = [
                        largest_magnitude(&want.theta),
                        largest_magnitude(&want.m),
                        largest_magnitude(&want.v),
                    ];
                    let n = want.theta.len();
                    for (variant, k) in variants() {
                        for (shape_name, shape) in shapes(n) {
                            let what = format!("{variant} {name} {shape_name} {s:?} {}", x.name);
                            let got =
                                kernel_update(k, (name, param, moments), x, &c, copy, shape, &what);
                            for (part, g, w) in [
                                ("θ'", &got.updated.theta, &want.theta),
                                ("m'", &got.updated.m, &want.m),
                                ("v'", &got.updated.v, &want.v),
                            ] {
                                if let Some(i) = (0..n).find(|&i| g[i] != w[i]) {
                                    panic!(
                                        "{what}: {part}[{i}] = {} (bits {:#010x}), the CPU's {} \
                                         ({:#010x})",
                                        f32::from_bits(g[i]),
                                        g[i],
                                        f32::from_bits(w[i]),
                                        w[i]
                                    );
                                }
                            }
                            assert_eq!(got.updated.copy, want.copy, "{what}: the copy");
                            assert_eq!(got.maxima, maxima, "{what}: the maxima");
                        }
                    }
                }
            }
        }
    }
}

/// The guard's verdict from kernels' maxima, the variables in slot order: the first
/// non-finite part (`parameter`, `first moment`, `second moment`) of the first variable
/// with one, as r3-train's `AdamW` reports it; `None` when every maximum is finite.
fn verdict(maxima: &[(&str, [u32; 3])]) -> Option<(String, &'static str)> {
    maxima.iter().find_map(|(name, m)| {
        ["parameter", "first moment", "second moment"]
            .into_iter()
            .zip(m)
            .find(|(_, &b)| b >= INF_BITS)
            .map(|(what, _)| (name.to_string(), what))
    })
}

/// Where an update turns non-finite, the kernels' maxima say so as the CPU's guard does
/// (r3-train refuses the step, naming the variable and the part): a NaN gradient (every part
/// NaN: "parameter"), a gradient whose square overflows f32 (v' = ∞ while θ' stays finite:
/// "second moment"), an infinite gradient (θ' = ∞/∞, a NaN). The finite variable's maxima
/// stay finite.
#[test]
fn adamw_maxima_flag_non_finite_updates_as_the_cpus_guard_does() {
    for (name, param, grad, moments) in ADAMW_KERNELS {
        // f16 holds no 1e20: its overflowing square is ∞'s.
        let huge = if grad == DType::F16 { 6e4 } else { 1e20 };
        for (poison, expected) in [
            (f32::NAN, "parameter"),
            (huge, "second moment"),
            (f32::INFINITY, "parameter"),
        ] {
            // An f16 gradient of 6e4: its square (3.6e9) is finite; nothing to refuse.
            let refused = !(grad == DType::F16 && poison == huge);
            let s = Setting {
                t: 3,
                lr: 3e-2,
                scale: None,
                copy: None,
            };
            let mut vars = inputs(param, grad, moments, 300);
            let mut g = vars[1].g.bits();
            g[40] = poison.to_bits();
            let g: Vec<f32> = g.into_iter().map(f32::from_bits).collect();
            vars[1].g = Floats::new(&g, grad);
            let (outcome, _) = cpu_update(&vars, moments, s);
            let cpu = match outcome {
                AdamWStep::NonFinite { variable, what } => Some((variable, what)),
                AdamWStep::Applied => None,
                other => panic!("{name}: {other:?}"),
            };
            if refused {
                assert_eq!(cpu, Some(("b".to_string(), expected)), "{name} {poison}");
            }
            for (variant, k) in variants() {
                for (shape_name, shape) in [shapes(77)[0], shapes(77)[2]] {
                    let maxima: Vec<(&str, [u32; 3])> = vars
                        .iter()
                        .enumerate()
                        .map(|(slot, x)| {
                            let c = constants(s, slot, x.decay);
                            let what = format!("{variant} {name} {shape_name} poison {poison}");
                            let got =
                                kernel_update(k, (name, param, moments), x, &c, None, shape, &what);
                            (x.name, got.maxima)
                        })
                        .collect();
                    assert_eq!(
                        verdict(&maxima),
                        cpu,
                        "{variant} {name} {shape_name} poison {poison}: {maxima:x?}"
                    );
                }
            }
        }
    }
}

/// `n` values uniform in [-scale, scale), a few of each magnitude down to scale · 1e-4.
fn spread_values(rng: &mut Lcg, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| rng.uniform(-1.0, 1.0) * scale * 10f32.powi(-((i % 5) as i32)))
        .collect()
}

/// The partial sums `r3_sum_squares_*` writes for `g` (its kernel by dtype) at
/// `partials[first ..]` under `blocks` blocks of `threads`, into `partials`.
fn squares_into(
    k: &Kernels,
    g: &Floats,
    partials: &mut [f64],
    first: u32,
    (blocks, threads): (u32, u32),
    order: r3_cuda_emu::ThreadOrder,
) {
    let n = g.bits().len();
    let (gp, pp) = (g.ptr(), partials.as_mut_ptr());
    launch(LaunchShape::blocks(blocks, threads), order, &|| unsafe {
        match g {
            Floats::F32(_) => (k.r3_sum_squares_f32)(gp.cast(), n, pp, first),
            Floats::Bf16(_) => (k.r3_sum_squares_bf16)(gp.cast(), n, pp, first),
            Floats::F16(_) => (k.r3_sum_squares_f16)(gp.cast(), n, pp, first),
        }
    })
    .expect("launch");
}

/// The whole norm's Σ g² as the GPU computes it: one launch per tensor of `blocks_of(n)`
/// blocks of `threads` into one buffer of partials (each starting as a NaN, so a partial no
/// block writes shows), then `r3_sum_squares_total` in one block of `total_threads`.
/// Returns the partials and the total's bits; the same in both thread orders.
fn norm_squared(
    k: &Kernels,
    grads: &[Floats],
    blocks_of: impl Fn(usize) -> u32,
    threads: u32,
    total_threads: u32,
    what: &str,
) -> (Vec<u64>, u32) {
    let blocks: Vec<u32> = grads.iter().map(|g| blocks_of(g.bits().len())).collect();
    let mut offsets = vec![0u32];
    for b in &blocks {
        offsets.push(offsets[offsets.len() - 1] + b);
    }
    in_both_orders(what, |order| {
        let mut partials = vec![f64::NAN; offsets[offsets.len() - 1] as usize];
        for ((g, &b), &first) in grads.iter().zip(&blocks).zip(&offsets) {
            squares_into(k, g, &mut partials, first, (b, threads), order);
        }
        let mut out = [f32::NAN];
        let (pp, op, outp) = (partials.as_ptr(), offsets.as_ptr(), out.as_mut_ptr());
        let tensors = grads.len() as u32;
        launch(LaunchShape::blocks(1, total_threads), order, &|| unsafe {
            (k.r3_sum_squares_total)(pp, op, tensors, outp)
        })
        .expect("launch");
        (
            partials.iter().map(|p| p.to_bits()).collect(),
            out[0].to_bits(),
        )
    })
}

/// Σ x² of `g` in f64, each square computed in f32 first as the kernel and the CPU square
/// it (the exact sum of the f32 squares, to f64's rounding).
fn reference_squares(g: &Floats) -> f64 {
    g.bits()
        .iter()
        .map(|&b| {
            let x = f32::from_bits(b);
            f64::from(x * x)
        })
        .sum()
}

/// Gradients of every dtype the norm takes, in sizes that give the launcher's grid one to
/// three blocks, one value and none; values up to ±4 (f16 within range).
fn norm_gradients(seed: u64) -> Vec<Floats> {
    let mut rng = Lcg::new(seed);
    [
        (DType::F32, 5_000usize),
        (DType::BF16, 4_097),
        (DType::F16, 300),
        (DType::F32, 1),
        (DType::BF16, 0),
        (DType::F32, 9_001),
    ]
    .iter()
    .map(|&(dtype, n)| Floats::new(&spread_values(&mut rng, n, 4.0), dtype))
    .collect()
}

/// The CPU's gradient norm (r3-train's `global_grad_norm` over CPU tensors: each tensor's
/// squares summed in f32 in candle's order, the tensors' sums added in order).
fn cpu_norm(grads: &[Floats]) -> f32 {
    let vars: Vec<Var> = grads
        .iter()
        .map(|g| Var::zeros(g.bits().len(), DType::F32, &Device::Cpu).expect("var"))
        .collect();
    let mut store = GradStore::default();
    for (var, g) in vars.iter().zip(grads) {
        store.insert(var.as_tensor(), g.tensor());
    }
    r3_train::global_grad_norm(vars.iter(), &store).expect("the CPU's norm")
}

/// A grid's blocks for a tensor of `n` values.
type BlocksOf<'a> = &'a dyn Fn(usize) -> u32;

/// The gradient norm's sums of squares: under the launcher's grid (each tensor's
/// `launch_shape::sum_squares_blocks(n)` blocks of `SUM_SQUARES_THREADS`, a function of its
/// length alone, laid out by `launcher_blocks`; the total in one block of
/// `SUM_SQUARES_TOTAL_THREADS`) each tensor's f64 partials add up to the f64 reference of its
/// f32 squares (relative 1e-12: f64 sums in another order), the total to the reference's
/// tensor sums rounded to f32 and added in f32 (relative 1e-6), and its root to the CPU's norm
/// (relative 1e-5: the CPU sums in f32). Other grids (one warp; 96 threads, one to three
/// blocks; a total of one warp) are as close to the reference.
#[test]
fn sums_of_squares_match_an_f64_reference_and_the_cpus_norm() {
    let grads = norm_gradients(500);
    let sums: Vec<f64> = grads.iter().map(reference_squares).collect();
    let want_total = sums
        .iter()
        .map(|&s| s as f32)
        .reduce(|t, s| t + s)
        .expect("tensors");
    let cpu = cpu_norm(&grads);
    // The largest relative differences: per tensor, total, norm against the CPU's.
    let mut largest = (0f64, 0f64, 0f64);
    for (variant, k) in variants() {
        let launcher = norm_squared(
            k,
            &grads,
            sum_squares_blocks,
            SUM_SQUARES_THREADS,
            SUM_SQUARES_TOTAL_THREADS,
            variant,
        );
        let other_shapes: [(&str, BlocksOf, u32, u32); 3] = [
            ("one warp", &|_| 1, 32, 32),
            ("96 threads", &|n| (n as u32 % 3) + 1, 96, 96),
            (
                "launcher blocks, total of one warp",
                &sum_squares_blocks,
                SUM_SQUARES_THREADS,
                32,
            ),
        ];
        let mut all = vec![(
            format!("{variant} launcher"),
            launcher_blocks(&grads, sum_squares_blocks),
            launcher,
        )];
        for (shape_name, blocks_of, threads, total_threads) in other_shapes {
            let what = format!("{variant} {shape_name}");
            let got = norm_squared(k, &grads, blocks_of, threads, total_threads, &what);
            all.push((what, launcher_blocks(&grads, blocks_of), got));
        }
        for (what, blocks, (partials, total)) in &all {
            let mut at = 0usize;
            for (t, (&b, &want)) in blocks.iter().zip(&sums).enumerate() {
                let got: f64 = partials[at..at + b as usize]
                    .iter()
                    .map(|&p| f64::from_bits(p))
                    .sum();
                at += b as usize;
                let rel = (got - want).abs() / want.max(f64::MIN_POSITIVE);
                largest.0 = largest.0.max(rel);
                assert!(rel <= 1e-12, "{what}: tensor {t}: {got} vs {want}");
            }
            let total = f32::from_bits(*total);
            let rel = (f64::from(total) - f64::from(want_total)).abs() / f64::from(want_total);
            largest.1 = largest.1.max(rel);
            assert!(rel <= 1e-6, "{what}: total {total} vs {want_total}");
            let rel_cpu = (f64::from(total.sqrt()) - f64::from(cpu)).abs() / f64::from(cpu);
            largest.2 = largest.2.max(rel_cpu);
            assert!(
                rel_cpu <= 1e-5,
                "{what}: norm {} vs the CPU's {cpu}",
                total.sqrt()
            );
        }
    }
    println!(
        "sums of squares: largest relative difference per tensor {:e}, total {:e}, norm \
         against the CPU's {:e}",
        largest.0, largest.1, largest.2
    );
}

/// The blocks each tensor of `grads` launches under `blocks_of`.
fn launcher_blocks(grads: &[Floats], blocks_of: impl Fn(usize) -> u32) -> Vec<u32> {
    grads.iter().map(|g| blocks_of(g.bits().len())).collect()
}

/// A non-finite gradient makes the norm non-finite as on the CPU: a NaN (bf16) gives NaN, an
/// ∞ (f16) gives ∞, and an f32 value whose square overflows f32 (1e20: squared in f32 as the
/// CPU squares it, though f64 would hold it) gives ∞.
#[test]
fn a_non_finite_gradient_makes_the_norm_non_finite() {
    for (t, i, poison, nan) in [
        (1usize, 17usize, f32::NAN, true),
        (2, 299, f32::INFINITY, false),
        (0, 4_999, 1e20, false),
    ] {
        let mut grads = norm_gradients(600);
        let mut values: Vec<f32> = grads[t].bits().into_iter().map(f32::from_bits).collect();
        values[i] = poison;
        let dtype = match &grads[t] {
            Floats::F32(_) => DType::F32,
            Floats::Bf16(_) => DType::BF16,
            Floats::F16(_) => DType::F16,
        };
        grads[t] = Floats::new(&values, dtype);
        let cpu = cpu_norm(&grads);
        assert_eq!(cpu.is_nan(), nan, "the CPU's norm {cpu}");
        assert!(!cpu.is_finite(), "the CPU's norm {cpu}");
        for (variant, k) in variants() {
            let what = format!("{variant} poison {poison} in tensor {t}");
            let (_, total) = norm_squared(
                k,
                &grads,
                sum_squares_blocks,
                SUM_SQUARES_THREADS,
                SUM_SQUARES_TOTAL_THREADS,
                &what,
            );
            let total = f32::from_bits(total);
            assert_eq!(total.is_nan(), nan, "{what}: {total}");
            assert!(!total.is_finite(), "{what}: {total}");
        }
    }
}

/// The bf16 patterns `r3_sum_bf16_stochastic_*` (by the addends' dtypes) writes for `a + b`.
fn stochastic_sum_by_kernel(
    k: &Kernels,
    a: &Floats,
    b: &Floats,
    key: u64,
    shape: LaunchShape,
    what: &str,
) -> Vec<u16> {
    let n = a.bits().len();
    in_both_orders(what, |order| {
        let mut out = vec![0x7fbau16; n];
        let (ap, bp, op) = (a.ptr(), b.ptr(), out.as_mut_ptr());
        launch(shape, order, &|| unsafe {
            match (a, b) {
                (Floats::F32(_), Floats::F32(_)) => {
                    (k.r3_sum_bf16_stochastic_f32_f32)(ap.cast(), bp.cast(), op.cast(), n, key)
                }
                (Floats::F32(_), Floats::Bf16(_)) => {
                    (k.r3_sum_bf16_stochastic_f32_bf16)(ap.cast(), bp.cast(), op.cast(), n, key)
                }
                (Floats::Bf16(_), Floats::F32(_)) => {
                    (k.r3_sum_bf16_stochastic_bf16_f32)(ap.cast(), bp.cast(), op.cast(), n, key)
                }
                (Floats::Bf16(_), Floats::Bf16(_)) => {
                    (k.r3_sum_bf16_stochastic_bf16_bf16)(ap.cast(), bp.cast(), op.cast(), n, key)
                }
                _ => panic!("no stochastic sum of these addends"),
            }
        })
        .expect("launch");
        out
    })
}

/// `r3_sum_bf16_stochastic_*` (f32 / bf16 addends each way) equals the CPU's
/// `sum_round_bf16_stochastic` bit for bit, NaN included: the f32 sum rounded by each
/// index's draw, NaN addends of several payloads (the CPU's f32 sum keeps its NaN operand, a
/// GPU's writes `0x7fffffff`: both become the canonical `0x7fc0`), ∞ + finite, ∞ − ∞, sums
/// past bf16's largest value, addends that cancel; keys with and without a high word.
#[test]
fn stochastic_sums_equal_the_cpus_draw_for_draw() {
    let mut rng = Lcg::new(700);
    let n = 1_100;
    let mut a = spread_values(&mut rng, n, 3.0);
    let mut b: Vec<f32> = spread_values(&mut rng, n, 3e-2);
    let specials = [
        (f32::NAN, 1.0),
        (1.0, f32::from_bits(0xffc0_0001)),
        (f32::from_bits(0x7f80_0001), f32::from_bits(0x7fff_ffff)),
        (f32::INFINITY, -1.0),
        (f32::NEG_INFINITY, f32::INFINITY),
        (f32::NEG_INFINITY, f32::NEG_INFINITY),
        (f32::MAX, f32::MAX),
        (f32::from_bits(0x7f7f_0000), f32::from_bits(0x7f7f_0000)),
        (3e38, 3e38),
        (1.5, -1.5),
        (-0.0, -0.0),
        (1.0, 2f32.powi(-7) / 40.0),
    ];
    for (i, &(x, y)) in specials.iter().enumerate() {
        a[3 * i + 1] = x;
        b[3 * i + 1] = y;
    }
    // And at the tail.
    a[n - 1] = f32::NAN;
    for key in [sum_rounding_key(9, 2, 1, 5), 0x1234_5678_9abc_def0, 0] {
        for (da, db) in [
            (DType::F32, DType::F32),
            (DType::F32, DType::BF16),
            (DType::BF16, DType::F32),
            (DType::BF16, DType::BF16),
        ] {
            let (fa, fb) = (Floats::new(&a, da), Floats::new(&b, db));
            let cpu: Vec<u16> = sum_round_bf16_stochastic(&fa.tensor(), &fb.tensor(), key)
                .and_then(|t| Ok(t.to_vec1::<bf16>()?))
                .expect("the CPU's sum")
                .iter()
                .map(|v| v.to_bits())
                .collect();
            for (variant, k) in variants() {
                // No warp operation here: a block of no multiple of 32 is one of its shapes.
                let odd = ("2 × 50", LaunchShape::blocks(2, 50));
                for (shape_name, shape) in shapes(n).into_iter().chain([odd]) {
                    let what = format!("{variant} {da:?} + {db:?} key {key:#x} {shape_name}");
                    let got = stochastic_sum_by_kernel(k, &fa, &fb, key, shape, &what);
                    for (i, (&g, &c)) in got.iter().zip(&cpu).enumerate() {
                        assert_eq!(
                            g, c,
                            "{what}: element {i} ({} + {}): {g:#06x} vs {c:#06x}",
                            a[i], b[i]
                        );
                    }
                }
            }
        }
    }
}
