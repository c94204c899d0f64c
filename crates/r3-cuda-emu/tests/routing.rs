//! The device routers through the emulated grid: `r3_route_softmax_f32` (a softmax router's
//! top-k, gates and finiteness flags) and `r3_route_grouped_f32` (DeepSeek-V3's group-limited
//! sigmoid routing with its score-correction bias), each against the CPU's choice of the same
//! router (`r3_model::layers::moe::route_rows::route_rows` on the CPU: the host selection
//! `Router::select_row` and weighing `Router::weigh_row`, packed as the kernels pack it).
//!
//! The chosen experts must be the CPU's exactly (ties to the lower index, +0 before −0, ties
//! straddling the k-th place, masked groups' −∞s); the grouped router's gates must be the
//! CPU's bits (its sigmoid is `math.rs`'s `fast_exp` in explicit `fmaf` / `__f*_rn`
//! operations, which neither variant may contract), the softmax router's within a tolerance
//! (its exponentials' sum runs in a block's order, the CPU's left to right). Every case runs
//! in both kernel variants, in both thread orders, at the launcher's block size and others
//! the kernels' contract allows (a whole number of warps; for the grouped router at least one
//! thread per group).

use candle_core::{Device, Tensor};
use r3_cuda_emu::{in_both_orders, launch, variants, Kernels, LaunchShape, ThreadOrder};
use r3_model::layers::moe::route_rows::route_rows;
use r3_model::{Router, RouterKind};

mod common;

use common::{f32_bits as bits, Lcg};
use r3_model::launch_shape::{route_grouped_threads, row_threads};

/// The routed scaling factor of the grouped routers below (DeepSeek-V3's is 2.5).
const SCALE: f64 = 2.5;

/// `rows` rows of `cols` router logits: coarse values (many exact ties, +0 beside −0) in every
/// row but 1 (spread values) and 2 (all equal), and where there are that many rows a −∞ in
/// row 4, a NaN in row 5 and a +∞ in row 6 (the CPU flags such a row); where `wide`, every
/// eleventh column's value replaced by one far past the sigmoid's clamp (±100).
fn logits(rows: usize, cols: usize, seed: u64, wide: bool) -> Vec<f32> {
    let mut rng = Lcg::new(seed);
    let mut x = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let v = match r {
                1 => rng.uniform(-4.0, 4.0),
                2 => 0.5,
                // Ties: a grid of 13 values and signed zeros.
                _ => match rng.next_u32() % 15 {
                    0 => 0.0,
                    1 => -0.0,
                    n => n as f32 * 0.25 - 2.0,
                },
            };
            let v = if wide && c % 11 == 4 {
                (rng.next_u32() % 200) as f32 - 100.0
            } else {
                v
            };
            x.push(v);
        }
    }
    let mut poison = |row: usize, v: f32| {
        if row < rows {
            x[row * cols + (row * 5) % cols] = v;
        }
    };
    poison(4, f32::NEG_INFINITY);
    poison(5, f32::NAN);
    poison(6, f32::INFINITY);
    x
}

/// A router's choice of `rows` rows: `[rows · k]` gates, `[rows · k]` experts, `[rows]`
/// finiteness flags (1 finite, 0 not).
#[derive(Debug)]
struct Choice {
    /// Each row's k gates.
    gates: Vec<f32>,
    /// Each row's k experts, best first.
    ids: Vec<u32>,
    /// 1 where every logit of the row is finite, else 0.
    finite: Vec<f32>,
}

/// The CPU's choice of `router` over `logits` `[rows, E]` with `bias` (`route_rows` on the
/// CPU: the host selection and weighing).
fn cpu_choice(router: &Router, logits: &[f32], rows: usize, bias: Option<&[f32]>) -> Choice {
    let e = router.num_experts;
    let t = Tensor::from_vec(logits.to_vec(), (rows, e), &Device::Cpu).expect("logits");
    let b = bias.map(|b| Tensor::from_vec(b.to_vec(), e, &Device::Cpu).expect("bias"));
    let choice = route_rows(router, &t, b.as_ref()).expect("the CPU's choice");
    let flat = |t: &Tensor| t.flatten_all().expect("flatten");
    Choice {
        gates: flat(&choice.gates).to_vec1::<f32>().expect("gates"),
        ids: flat(&choice.ids).to_vec1::<u32>().expect("ids"),
        finite: choice.finite.to_vec1::<f32>().expect("flags"),
    }
}

/// The kernels' packed output `[gates (rows·k) | ids as floats (rows·k) | flags (rows)]`
/// read as a [`Choice`] (an id must be an exact whole number).
fn unpack(packed: &[f32], rows: usize, k: usize) -> Choice {
    let (gates, rest) = packed.split_at(rows * k);
    let (ids, finite) = rest.split_at(rows * k);
    Choice {
        gates: gates.to_vec(),
        ids: ids
            .iter()
            .map(|&v| {
                assert!(v >= 0.0 && v.fract() == 0.0, "an id {v} is no index");
                v as u32
            })
            .collect(),
        finite: finite.to_vec(),
    }
}

/// `r3_route_softmax_f32` of `kernels` over `logits` `[rows, cols]` choosing `k`
/// (renormalised where `norm`), one block of `threads` a row, in `order`: the packed
/// output's bits (every slot starts NaN, so one left unwritten shows).
#[allow(clippy::too_many_arguments)]
fn route_softmax(
    kernels: &Kernels,
    threads: u32,
    order: ThreadOrder,
    logits: &[f32],
    rows: usize,
    cols: usize,
    k: usize,
    norm: bool,
) -> Vec<u32> {
    let mut packed = vec![f32::NAN; 2 * rows * k + rows];
    let out = packed.as_mut_ptr();
    launch(
        LaunchShape::blocks(rows as u32, threads),
        order,
        &|| unsafe {
            (kernels.r3_route_softmax_f32)(
                logits.as_ptr(),
                out,
                rows as u32,
                cols as u32,
                k as u32,
                u32::from(norm),
            )
        },
    )
    .expect("launch");
    bits(&packed)
}

/// The grouped router's parameters beside its block size.
#[derive(Clone, Copy, Debug)]
struct Grouped {
    /// Experts (columns).
    cols: usize,
    /// Expert groups.
    n_group: usize,
    /// Groups kept.
    topk_group: usize,
    /// Experts chosen.
    k: usize,
    /// Whether the k gates are renormalised.
    norm: bool,
}

impl Grouped {
    /// The CPU router of these parameters.
    fn router(self) -> Router {
        Router {
            kind: RouterKind::GroupedSigmoid {
                n_group: self.n_group,
                topk_group: self.topk_group,
                norm_topk_prob: self.norm,
                routed_scaling_factor: SCALE,
            },
            num_experts: self.cols,
            top_k: self.k,
        }
    }

    /// The launcher's block (`launch_shape::route_grouped_threads`): a row's threads, and at
    /// least one thread per group.
    fn launcher_threads(self) -> u32 {
        route_grouped_threads(self.cols, self.n_group)
    }
}

/// `r3_route_grouped_f32` of `kernels` with parameters `g` over `logits` and `bias`, one
/// block of `threads` a row, in `order`: the packed output's bits (slots start NaN).
fn route_grouped(
    kernels: &Kernels,
    g: Grouped,
    threads: u32,
    order: ThreadOrder,
    logits: &[f32],
    bias: &[f32],
    rows: usize,
) -> Vec<u32> {
    let mut packed = vec![f32::NAN; 2 * rows * g.k + rows];
    let out = packed.as_mut_ptr();
    launch(
        LaunchShape::blocks(rows as u32, threads),
        order,
        &|| unsafe {
            (kernels.r3_route_grouped_f32)(
                logits.as_ptr(),
                bias.as_ptr(),
                out,
                rows as u32,
                g.cols as u32,
                g.k as u32,
                g.n_group as u32,
                g.topk_group as u32,
                u32::from(g.norm),
                SCALE as f32,
            )
        },
    )
    .expect("launch");
    bits(&packed)
}

/// Checks a kernel's choice `got` against the CPU's `want` for `rows` rows of `k`: the same
/// flags; in a finite row the same experts and gates within `tol` (0: the same bits); in a
/// flagged row zero gates. Returns the largest gate difference.
fn check_choice(what: &str, got: &Choice, want: &Choice, rows: usize, k: usize, tol: f32) -> f32 {
    assert_eq!(bits(&got.finite), bits(&want.finite), "{what}: flags");
    let mut largest = 0f32;
    for r in 0..rows {
        let row = r * k..(r + 1) * k;
        if want.finite[r] == 0.0 {
            assert_eq!(bits(&got.gates[row.clone()]), vec![0; k], "{what}, row {r}");
            continue;
        }
        assert_eq!(
            got.ids[row.clone()],
            want.ids[row.clone()],
            "{what}, row {r}"
        );
        for j in row {
            let (a, b) = (got.gates[j], want.gates[j]);
            if tol == 0.0 {
                assert_eq!(a.to_bits(), b.to_bits(), "{what}, row {r}: gate {a} vs {b}");
            } else {
                assert!((a - b).abs() <= tol, "{what}, row {r}: gate {a} vs {b}");
            }
            largest = largest.max((a - b).abs());
        }
    }
    largest
}

/// A softmax router's choice on the emulated grid is the CPU's: the same experts (ties to
/// the lower index, +0 before −0, ties across the k-th place), the same flags (a row with a
/// NaN or ±∞ flagged, its gates zero), gates within 1e-6 of the CPU's (gates lie in [0, 1];
/// the kernel sums the row's exponentials in a block's order, the CPU left to right, and
/// `expf` here is glibc's as the CPU's `f32::exp`: the sum's order is the only difference,
/// in both variants, as nothing in the kernel multiplies and adds). Experts 8 to 4,096 (the
/// most), k = 1, k = E, k = 64 (the most), renormalised or not, at the launcher's block and
/// at others: one warp for rows of up to 4,096, three warps, 1,024 threads for 8 experts.
#[test]
fn the_softmax_routers_choice_is_the_cpus() {
    // (experts, k, norm, rows, block sizes besides the launcher's)
    let cases: [(usize, usize, bool, usize, &[u32]); 10] = [
        (8, 2, true, 7, &[96]),
        (8, 1, false, 7, &[96, 1024]),
        (8, 8, true, 7, &[96]),
        (60, 4, false, 7, &[96]),
        (64, 64, true, 3, &[96]),
        (128, 8, true, 7, &[96]),
        (256, 64, false, 3, &[32]),
        (300, 5, true, 7, &[32]),
        (3000, 6, true, 4, &[32, 96]),
        (4096, 8, false, 2, &[32]),
    ];
    let mut largest = 0f32;
    for (i, &(cols, k, norm, rows, others)) in cases.iter().enumerate() {
        let router = Router {
            kind: RouterKind::Softmax {
                norm_topk_prob: norm,
            },
            num_experts: cols,
            top_k: k,
        };
        let x = logits(rows, cols, 11 + i as u64, false);
        let want = cpu_choice(&router, &x, rows, None);
        // The all-equal row 2: the first k experts, in order.
        if rows > 2 {
            assert_eq!(want.ids[2 * k..3 * k], (0..k as u32).collect::<Vec<_>>());
        }
        let mut shapes = vec![row_threads(cols)];
        shapes.extend(others.iter().filter(|&&t| t != row_threads(cols)));
        for (name, kernels) in variants() {
            for &threads in &shapes {
                let what =
                    format!("{name}, {cols} experts, top-{k}, norm {norm}, {threads} threads");
                let packed = in_both_orders(&what, |order| {
                    route_softmax(kernels, threads, order, &x, rows, cols, k, norm)
                });
                let packed: Vec<f32> = packed.into_iter().map(f32::from_bits).collect();
                let got = unpack(&packed, rows, k);
                largest = largest.max(check_choice(&what, &got, &want, rows, k, 1e-6));
            }
        }
    }
    println!("softmax router: largest gate difference {largest:e}");
}

/// The same choice with its gates checked against a sum in f64 (independent of either
/// order): each gate within 2e-7 · (1 + its value's scale) of softmax(x)[id] (renormalised
/// over the k where `norm`), so the tolerance above is not hiding a wrong formula.
#[test]
fn the_softmax_routers_gates_are_the_softmax_of_the_logits() {
    for (cols, k, norm) in [(60usize, 4usize, false), (200, 7, true), (8, 8, true)] {
        let rows = 5;
        let x = logits(rows, cols, 3 + cols as u64, false);
        for (name, kernels) in variants() {
            let packed = in_both_orders(name, |order| {
                route_softmax(kernels, row_threads(cols), order, &x, rows, cols, k, norm)
            });
            let packed: Vec<f32> = packed.into_iter().map(f32::from_bits).collect();
            let got = unpack(&packed, rows, k);
            for r in (0..rows).filter(|&r| got.finite[r] == 1.0) {
                let row = &x[r * cols..(r + 1) * cols];
                let top = row
                    .iter()
                    .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
                let sum: f64 = row.iter().map(|&v| (f64::from(v) - top).exp()).sum();
                let ids = &got.ids[r * k..(r + 1) * k];
                let mut exact: Vec<f64> = ids
                    .iter()
                    .map(|&id| (f64::from(row[id as usize]) - top).exp() / sum)
                    .collect();
                if norm {
                    let kept: f64 = exact.iter().sum();
                    exact.iter_mut().for_each(|g| *g /= kept);
                }
                for (j, &e) in exact.iter().enumerate() {
                    let g = f64::from(got.gates[r * k + j]);
                    assert!(
                        (g - e).abs() <= 2e-7 * (1.0 + e),
                        "{name}, {cols} experts, row {r}, gate {j}: {g} vs {e}"
                    );
                }
            }
        }
    }
}

/// A DeepSeek-V3 router's choice on the emulated grid is the CPU's bit for bit, experts and
/// gates, in both variants (the sigmoid, the bias's sum, the groups' two-best sums, the
/// normalisation and the scale are all explicit `fmaf` / `__f*_rn` operations that match
/// `math.rs`'s `fast_exp` and `Router::weigh_row`: nothing for nvcc to contract). Groups
/// tied, biases mixed, none (zeros) and all −1.5 (every kept score below 0, which a 0.0 fill
/// of the dropped groups would lose to; k past the kept experts takes the dropped groups'
/// −∞s, ties to the lower index), 1 to 64
/// groups (the most), topk_group 1 to n_group, k = 1 and k = E, 256 experts in 8 groups
/// (DeepSeek-V3's) and 4,096 in 64 (the most of both), logits past the sigmoid's clamp. The
/// mixed bias at the launcher's block and others (the fewest whole warps holding a thread
/// per group, three warps, 1,024 threads), the other biases at the launcher's.
#[test]
fn the_grouped_routers_choice_is_the_cpus_bit_for_bit() {
    let g = |cols, n_group, topk_group, k, norm| Grouped {
        cols,
        n_group,
        topk_group,
        k,
        norm,
    };
    // (parameters, rows, block sizes besides the launcher's)
    let cases: [(Grouped, usize, &[u32]); 10] = [
        (g(8, 4, 2, 2, true), 7, &[96, 1024]),
        (g(64, 8, 3, 6, false), 7, &[96]),
        (g(256, 8, 4, 8, true), 7, &[32, 96]),
        (g(96, 32, 5, 4, true), 7, &[96]),
        (g(128, 64, 7, 8, true), 7, &[96]),
        (g(16, 8, 8, 16, true), 5, &[96]),
        (g(32, 1, 1, 1, false), 7, &[96]),
        (g(64, 8, 1, 12, true), 7, &[96]),
        (g(64, 2, 2, 64, false), 3, &[96]),
        (g(4096, 64, 4, 8, true), 2, &[64]),
    ];
    for (i, &(params, rows, others)) in cases.iter().enumerate() {
        let cols = params.cols;
        let router = params.router();
        assert!(router.selects_on_device(), "{params:?}");
        let launcher = params.launcher_threads();
        for &t in others {
            assert!(
                t % 32 == 0 && t as usize >= params.n_group,
                "{t} threads for {params:?}"
            );
        }
        let x = logits(rows, cols, 101 + i as u64, true);
        let mixed: Vec<f32> = (0..cols).map(|e| ((e % 5) as f32 - 3.0) * 0.25).collect();
        let biases: [(&str, Vec<f32>, bool); 3] = [
            ("mixed bias", mixed, true),
            ("no bias", vec![0.0; cols], false),
            ("bias −1.5", vec![-1.5; cols], true),
        ];
        for (b, (bias_name, bias, given)) in biases.iter().enumerate() {
            // No bias: the CPU op takes none (route_rows then adds zeros, as here).
            let want = cpu_choice(&router, &x, rows, given.then_some(bias.as_slice()));
            let mut shapes = vec![launcher];
            if b == 0 {
                shapes.extend(others.iter().filter(|&&t| t != launcher));
            }
            for (name, kernels) in variants() {
                for &threads in &shapes {
                    let what = format!("{name}, {params:?}, {bias_name}, {threads} threads");
                    let packed = in_both_orders(&what, |order| {
                        route_grouped(kernels, params, threads, order, &x, bias, rows)
                    });
                    let packed: Vec<f32> = packed.into_iter().map(f32::from_bits).collect();
                    let got = unpack(&packed, rows, params.k);
                    check_choice(&what, &got, &want, rows, params.k, 0.0);
                }
            }
        }
    }
}

/// Hand-known grouped choices (four groups of two, one kept, top-3, no renormalisation). Row
/// 0 holds logits (1, 2 | 1.5, 1.5 | 0, 0 | 1.5, 1.5): sigmoid is concave past 0, so the
/// two-best sums rank group 1 above group 0, and groups 1 and 3 tie exactly: the lower one is
/// kept. Row 1's group 3 is the best. Row 2 holds a NaN. The kept group's experts come first
/// (2, 3, a tie to the lower index), then (k is past the kept experts, which a config never
/// is) the dropped experts' −∞s from the lowest. A bias of −1.5 puts every kept score below
/// 0 and changes nothing: the dropped groups hold −∞, not 0.0 (where the top-3 were the
/// three lowest dropped experts).
#[test]
fn grouped_ties_and_masked_groups_choose_as_worked_out_by_hand() {
    let params = Grouped {
        cols: 8,
        n_group: 4,
        topk_group: 1,
        k: 3,
        norm: false,
    };
    let x: Vec<f32> = vec![
        1.0,
        2.0,
        1.5,
        1.5,
        0.0,
        0.0,
        1.5,
        1.5, //
        -1.0,
        -1.0,
        -1.0,
        -1.0,
        -1.0,
        -1.0,
        3.0,
        2.0, //
        0.0,
        f32::NAN,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
    ];
    let rows = 3;
    for (bias, want_ids) in [(0.0f32, [2u32, 3, 0, 6, 7, 0]), (-1.5, [2, 3, 0, 6, 7, 0])] {
        let bias = vec![bias; 8];
        for (name, kernels) in variants() {
            let packed = in_both_orders(name, |order| {
                route_grouped(kernels, params, 32, order, &x, &bias, rows)
            });
            let packed: Vec<f32> = packed.into_iter().map(f32::from_bits).collect();
            let got = unpack(&packed, rows, 3);
            assert_eq!(&got.ids[..6], &want_ids, "{name}, bias {}", bias[0]);
            assert_eq!(got.finite, vec![1.0, 1.0, 0.0], "{name}: flags");
            assert_eq!(bits(&got.gates[6..9]), vec![0; 3], "{name}: flagged gates");
            // Unnormalised gates: sigmoid(x[id]) · 2.5 (the bias never enters them), to a
            // few ulps of the exact value.
            for (j, &id) in got.ids[..6].iter().enumerate() {
                let logit = f64::from(x[(j / 3) * 8 + id as usize]);
                let want = SCALE / (1.0 + (-logit).exp());
                let g = f64::from(got.gates[j]);
                assert!(
                    (g - want).abs() < 1e-6 * want,
                    "{name}: gate {j}: {g} vs {want}"
                );
            }
        }
    }
}

/// A negative bias on the emulated grid (worked out by hand in r3-model's router test
/// `grouped_selection_stays_inside_the_kept_groups`): 16 experts in 4 groups, 2 kept, top-4,
/// every logit 0, bias (+.6, −.6, −.6, −.6 | +.6, −.6, −.6, −.6 | −.9 × 8). Groups 0 and 1 are
/// kept, and their scores are 1.1, 1.1 and six −0.1s: the kernel must choose 0, 4, 1, 2 (HF
/// v5 / SGLang / Megatron's −∞ fill), not the dropped group 2's experts 8 and 9 that a 0.0
/// fill ranks above −0.1; the same as the CPU, gates bit for bit. Then the bias's halves
/// swapped (groups 2 and 3 kept: 8, 12, 9, 10; a 0.0 fill would take 0 and 1). Both variants,
/// both orders, at the launcher's block and at 96 and 1,024 threads.
#[test]
fn the_grouped_router_keeps_to_the_kept_groups_under_a_negative_bias() {
    let params = Grouped {
        cols: 16,
        n_group: 4,
        topk_group: 2,
        k: 4,
        norm: true,
    };
    let x = vec![0.0f32; 16];
    let mut bias = vec![-0.9f32; 16];
    bias[..8].copy_from_slice(&[0.6, -0.6, -0.6, -0.6, 0.6, -0.6, -0.6, -0.6]);
    let mut swapped = bias[8..].to_vec();
    swapped.extend_from_slice(&bias[..8]);
    let router = params.router();
    for (bias, want_ids) in [(&bias, [0u32, 4, 1, 2]), (&swapped, [8, 12, 9, 10])] {
        let want = cpu_choice(&router, &x, 1, Some(bias));
        assert_eq!(want.ids, want_ids, "the CPU's choice");
        for (name, kernels) in variants() {
            for threads in [params.launcher_threads(), 96, 1024] {
                let what = format!("{name}, bias {bias:?}, {threads} threads");
                let packed = in_both_orders(&what, |order| {
                    route_grouped(kernels, params, threads, order, &x, bias, 1)
                });
                let packed: Vec<f32> = packed.into_iter().map(f32::from_bits).collect();
                let got = unpack(&packed, 1, params.k);
                assert_eq!(got.ids, want_ids, "{what}");
                check_choice(&what, &got, &want, 1, params.k, 0.0);
            }
        }
    }
}
