//! r3's row kernels through the emulated grid against r3-model's CPU twins: the attention's
//! masked softmax and its backward, the token log-prob and its logits gradient, the greedy
//! reduction, RMSNorm (value, input gradient, per-chunk weight gradient), the rounded rotary
//! embedding and the one-kernel decode attention. Each kernel runs in every variant
//! (`plain`: rounded as written; `fma`: contracted, as nvcc compiles it) and in both thread
//! orders, at the launch shape r3-model's launcher picks and at other shapes its contract
//! allows (one warp, a block that is not a power of two, more threads than columns, fewer
//! blocks than a grid-stride loop needs). Where the twin computes in the kernel's order the
//! comparison is bit for bit in every variant: the RMSNorm gradients and the rotary
//! embedding write their products and sums with the correctly rounded intrinsics
//! (`__fmul_rn`, `__fadd_rn`, `__fsub_rn`, which nvcc never contracts), so the contracted
//! build keeps the CPU's bits too. Where the kernel reduces across its block it is a
//! tolerance relative to the values' scale, and each test says which holds in which variant
//! and why. A kernel's `expf` / `logf` is glibc's here, as the CPU's `f32::exp` / `ln` are,
//! so bits that pass through them hold on the host only: a GPU's differ by an ulp or two.

use candle_core::{DType, Device, Tensor, Var};
use r3_cuda_emu::{in_both_orders, launch, variants, LaunchShape};
use r3_model::greedy_rows::greedy_rows;
use r3_model::layers::attention::attend_additive;
use r3_model::layers::attention::rope::{Rope, Rotary};
use r3_model::layers::norm::RmsNorm;
use r3_model::sample_rows::{
    pack_draws, sample_rows_reporting, uniform_at_bound, LogprobScale, RowDraw,
};
use r3_model::token_stats::token_log_probs_recomputed;
use r3_model::{Precision, RopeConfig, RopeScaling, Weights};

mod common;

use common::{f32_bits as bits, Lcg};
use r3_model::launch_shape::{
    attend_group_shared_bytes, attend_group_spans, attend_group_threads, rms_norm_dw_chunk_threads,
    row_threads, sample_rows_shared_bytes, RMS_NORM_DW_CHUNK_ROWS, SAMPLE_ROWS_THREADS,
};

/// Runs one kernel launch of `shape` in both thread orders (`call` launches it over the
/// output pointer it is given; the output starts as NaN, so an element left unwritten shows)
/// and returns the output, which must be the same bits in both orders.
fn run(what: &str, shape: LaunchShape, len: usize, call: impl Fn(*mut f32)) -> Vec<f32> {
    let out = in_both_orders(what, |order| {
        let mut out = vec![f32::NAN; len];
        let op = out.as_mut_ptr();
        launch(shape, order, &|| call(op)).expect("launch");
        bits(&out)
    });
    out.into_iter().map(f32::from_bits).collect()
}

/// A CPU tensor's values, flattened.
fn host(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("a tensor's values")
}

/// A CPU f32 tensor of `shape` holding `data`.
fn tensor(data: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(data, shape, &Device::Cpu).expect("tensor")
}

/// `got` equals `want` bit for bit, naming `what` and the first element that differs.
fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        let differ = (0..got.len())
            .filter(|&i| got[i].to_bits() != want[i].to_bits())
            .count();
        panic!(
            "{what}: {differ} of {} values differ, first at {i}: {} vs {}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// `got` within `tol` of `want` relative to `want`'s largest finite |value| (at least
/// `floor`), NaN exactly where `want` is NaN and infinities equal; returns the largest
/// |difference| over that scale (printed, so `--nocapture` shows how close it came).
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64, floor: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want
        .iter()
        .filter(|w| w.is_finite())
        .fold(floor, |s, w| s.max(f64::from(w.abs())));
    let mut worst = 0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() || !w.is_finite() {
            assert!(
                (w.is_nan() && g.is_nan()) || g == w,
                "{what}: element {i} is {g}, the twin's {w}"
            );
            continue;
        }
        let d = (f64::from(g) - f64::from(w)).abs() / scale;
        assert!(
            d <= tol,
            "{what}: element {i} is {g}, the twin's {w} (|Δ| {d:.3e} of the scale {scale:.3e}, over {tol:.1e})"
        );
        worst = worst.max(d);
    }
    println!("{what}: largest |Δ| {worst:.3e} of the scale {scale:.3e}");
    worst
}

/// `r3_masked_softmax_f32` equals the CPU's masked softmax (`masked_softmax_rows`, reached
/// through `attend_additive` with identity keys and values, whose products are exact: the
/// probabilities as they are) within f32 rounding: rows of 300 columns over blocks of 96
/// (the launcher's), 32, 160 and 1,024 threads; grouped query rows reading their batch's and
/// query's mask row; masked keys (−∞), a finite additive bias, and one query whose keys are
/// all masked (NaN in both). The kernel sums the row's exponentials in its block's order
/// where the twin sums in column order, so a tolerance in both variants; `fma` also rounds
/// `s · scale + mask` once where the twin rounds twice.
#[test]
fn masked_softmax_rows_equal_the_cpu_softmax_within_f32_rounding() {
    let (b, kv, groups, t, s) = (2usize, 2usize, 2usize, 3usize, 300usize);
    let gt = groups * t;
    let rows = b * kv * gt;
    let scale = 0.37f32;
    let mut lcg = Lcg::new(1);
    let scores = lcg.values(rows * s, -6.0, 6.0);
    // mask [B, 1, 1, T, S]: a causal end, batch 1 left-padded by 40 keys, every seventh key
    // of batch 0 masked, a small finite bias elsewhere; batch 1's query 0 sees no key.
    let mut mask = vec![0f32; b * t * s];
    for bi in 0..b {
        for ti in 0..t {
            for j in 0..s {
                let hidden = j > s - t + ti
                    || (bi == 1 && j < 40)
                    || (bi == 0 && j % 7 == 3)
                    || (bi == 1 && ti == 0);
                mask[(bi * t + ti) * s + j] = if hidden {
                    f32::NEG_INFINITY
                } else {
                    -0.01 * (j % 13) as f32
                };
            }
        }
    }
    let scores_t = tensor(&scores, &[b, kv, gt, s]);
    let eye = Tensor::eye(s, DType::F32, &Device::Cpu)
        .and_then(|e| e.broadcast_as((b, kv, s, s)))
        .and_then(|e| e.contiguous())
        .expect("identity");
    let want = attend_additive(
        &scores_t,
        &eye,
        &eye,
        &tensor(&mask, &[b, 1, 1, t, s]),
        f64::from(scale),
        groups,
    )
    .map(|p| host(&p))
    .expect("the CPU's probabilities");
    // Batch 1's first row is its query 0, whose keys are all masked: NaN on the CPU.
    assert!(want[kv * gt * s].is_nan(), "the fully masked row");
    for (name, k) in variants() {
        for threads in [row_threads(s), 32, 160, 1024] {
            let what = format!("masked softmax {name}, {threads} threads");
            let got = run(
                &what,
                LaunchShape::blocks(rows as u32, threads),
                rows * s,
                |p| unsafe {
                    (k.r3_masked_softmax_f32)(
                        scores.as_ptr(),
                        mask.as_ptr(),
                        p,
                        scale,
                        s as u32,
                        t as u32,
                        (kv * gt) as u32,
                    )
                },
            );
            assert_close(&what, &got, &want, 1e-6, 0.0);
        }
    }
}

/// `r3_softmax_grad_f32` is `p ⊙ (dp − row_dot[row])` (the twin `softmax_grad_rows`, which
/// is private: the formula from the kernel's meaning), bit for bit in both variants (a
/// subtract then a multiply: nothing to contract): rows of 37 over 23 rows (851 elements, a
/// row boundary inside every block), at the launcher's grid of 256-thread blocks, one block
/// of 32 threads and two of 96 (grid-stride loops of many rounds).
#[test]
fn softmax_grad_is_p_times_dp_minus_the_row_dot_bit_for_bit() {
    let (rows, cols) = (23usize, 37usize);
    let n = rows * cols;
    let mut lcg = Lcg::new(2);
    let p = lcg.values(n, 0.0, 1.0);
    let dp = lcg.values(n, -3.0, 3.0);
    let row_dot = lcg.values(rows, -1.0, 1.0);
    let want: Vec<f32> = (0..n).map(|i| p[i] * (dp[i] - row_dot[i / cols])).collect();
    for (name, k) in variants() {
        for shape in [
            LaunchShape::elementwise(n),
            LaunchShape::blocks(1, 32),
            LaunchShape::blocks(2, 96),
        ] {
            let what = format!("softmax grad {name}, {shape:?}");
            let got = run(&what, shape, n, |out| unsafe {
                (k.r3_softmax_grad_f32)(
                    p.as_ptr(),
                    dp.as_ptr(),
                    row_dot.as_ptr(),
                    out,
                    cols as u32,
                    n,
                )
            });
            assert_bits(&what, &got, &want);
        }
    }
}

/// Logits `[rows, vocab]` for the token log-prob tests: spread over [−12, 12), with a few
/// masked (−∞) columns in row 2.
fn token_logits(rows: usize, vocab: usize) -> Vec<f32> {
    let mut z = Lcg::new(3).values(rows * vocab, -12.0, 12.0);
    for j in (5..vocab).step_by(11) {
        z[2 * vocab + j] = f32::NEG_INFINITY;
    }
    z
}

/// `r3_token_logprob_f32` equals the CPU's recomputing token log-prob
/// (`token_log_probs_recomputed`, its one-pass `token_logp_rows`) within f32 rounding: a
/// vocabulary of 1,001 (not a multiple of four, wider than any block) over blocks of 256
/// (the launcher's), 32, 96 and 1,024 threads; targets at the first and last column, two
/// rows sharing one, a row with −∞ columns; and NaN for a target past the vocabulary (the
/// CPU API refuses such a target, so that row's truth is the kernel's documented NaN). The
/// kernel sums in its block's order, the twin in column order: a tolerance in both variants
/// (nothing in it contracts, so `fma` gives `plain`'s bits).
#[test]
fn token_log_probs_equal_the_cpu_within_f32_rounding() {
    let (rows, vocab) = (6usize, 1001usize);
    let z = token_logits(rows, vocab);
    let targets = [0u32, 1000, 17, 17, 500, vocab as u32];
    // The CPU's values of the rows with targets in the vocabulary (the last row's target
    // replaced: its value is not compared).
    let mut valid = targets;
    valid[rows - 1] = 3;
    let want = token_log_probs_recomputed(
        &tensor(&z, &[rows, vocab]),
        &Tensor::new(&valid, &Device::Cpu).expect("targets"),
    )
    .map(|t| host(&t))
    .expect("the CPU's log-probs");
    for threads in [row_threads(vocab), 32, 96, 1024] {
        let mut plain: Option<Vec<u32>> = None;
        for (name, k) in variants() {
            let what = format!("token log-prob {name}, {threads} threads");
            let got = run(
                &what,
                LaunchShape::blocks(rows as u32, threads),
                rows,
                |out| unsafe {
                    (k.r3_token_logprob_f32)(z.as_ptr(), targets.as_ptr(), out, vocab as u32)
                },
            );
            assert!(
                got[rows - 1].is_nan(),
                "{what}: a target past the vocabulary"
            );
            assert_close(&what, &got[..rows - 1], &want[..rows - 1], 1e-6, 1.0);
            let plain = plain.get_or_insert_with(|| bits(&got));
            assert_eq!(*plain, bits(&got), "{what}: fma changed plain's bits");
        }
    }
}

/// `r3_token_logprob_grad_f32` equals the CPU's logits gradient bit for bit in both
/// variants: the twin (`token_logp_grad_rows`) reached through the recomputing token
/// log-prob's backward, fed the same row stats (lse = z[t] − logp as the backward recovers
/// it, g the output gradient). `0 − g·e` contracted is `fma(−g, e, 0)`, one rounding of
/// the same product: the same bits. The bits hold on the host because the kernel's `expf`
/// and the CPU's `f32::exp` are both glibc's `expf`; a GPU's `expf` differs from it by an
/// ulp or two, so on a GPU these bits are not promised. Blocks of 256 (the launcher's), 32
/// and 96 threads; a target past the vocabulary adds g nowhere (the formula from the
/// kernel's meaning).
#[test]
fn token_log_prob_gradient_equals_the_cpu_bit_for_bit() {
    let (rows, vocab) = (5usize, 1001usize);
    let z = token_logits(rows, vocab);
    let targets = [0u32, 1000, 17, 17, 500];
    let g = [0.5f32, -1.5, 2.0, 0.0, 0.25];
    let zv = Var::from_tensor(&tensor(&z, &[rows, vocab])).expect("logits");
    let t = Tensor::new(&targets, &Device::Cpu).expect("targets");
    let lp = token_log_probs_recomputed(zv.as_tensor(), &t).expect("log-probs");
    let grads = (&lp * tensor(&g, &[rows]))
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    let want = host(grads.get(zv.as_tensor()).expect("the logits' gradient"));
    let logp = host(&lp);
    let mut stats = Vec::new();
    for r in 0..rows {
        stats.extend([z[r * vocab + targets[r] as usize] - logp[r], g[r]]);
    }
    // A target past the vocabulary (row 1's replaced): −g · exp(z − lse) everywhere.
    let mut past = targets;
    past[1] = vocab as u32;
    let mut want_past = want.clone();
    for j in 0..vocab {
        let (lse, gr) = (stats[2], stats[3]);
        want_past[vocab + j] = 0.0 - gr * (z[vocab + j] - lse).exp();
    }
    for (name, k) in variants() {
        for threads in [row_threads(vocab), 32, 96] {
            for (case, targets, want) in [("", &targets, &want), (" past", &past, &want_past)] {
                let what = format!("token log-prob gradient{case} {name}, {threads} threads");
                let got = run(
                    &what,
                    LaunchShape::blocks(rows as u32, threads),
                    rows * vocab,
                    |out| unsafe {
                        (k.r3_token_logprob_grad_f32)(
                            z.as_ptr(),
                            targets.as_ptr(),
                            stats.as_ptr(),
                            out,
                            vocab as u32,
                        )
                    },
                );
                assert_bits(&what, &got, want);
            }
        }
    }
}

/// Each row's entropy and log-sum-exp in f64 from their definitions, `(H, lse)` per row:
/// `lse = ln Σ exp z`, `H = −Σ p ln p` over the entries with `p > 0`.
fn entropy_stats_f64(z: &[f32], vocab: usize) -> Vec<f64> {
    let mut out = Vec::new();
    for row in z.chunks(vocab) {
        let max = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
        let sum: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
        let lse = max + sum.ln();
        let h: f64 = row
            .iter()
            .map(|&v| f64::from(v) - lse)
            .filter(|lp| lp.exp() > 0.0)
            .map(|lp| -lp.exp() * lp)
            .sum();
        out.extend([h, lse]);
    }
    out
}

/// `r3_entropy_rows_f32` gives each row's entropy and log-sum-exp: within f32 rounding of
/// their definitions computed in f64, and of the CPU's own entropy (`token_stats::entropy`,
/// the fused op, on the rows without −∞ columns, which it does not take) — over a vocabulary
/// of 1,001 (wider than any block) on blocks of 256 (the launcher's), 32, 96 and 1,024
/// threads, with −∞ columns in one row (probability 0: no NaN). The kernel sums in its block's order: a tolerance, in both variants.
#[test]
fn entropy_rows_equal_their_definition_within_f32_rounding() {
    let (rows, vocab) = (6usize, 1001usize);
    let z = token_logits(rows, vocab);
    let exact = entropy_stats_f64(&z, vocab);
    let want: Vec<f32> = exact.iter().map(|&v| v as f32).collect();
    let cpu = r3_model::token_stats::entropy(&tensor(&z, &[rows, vocab]))
        .map(|t| host(&t))
        .expect("the CPU's entropy");
    for threads in [row_threads(vocab), 32, 96, 1024] {
        for (name, k) in variants() {
            let what = format!("entropy rows {name}, {threads} threads");
            let got = run(
                &what,
                LaunchShape::blocks(rows as u32, threads),
                2 * rows,
                |out| unsafe { (k.r3_entropy_rows_f32)(z.as_ptr(), out, vocab as u32) },
            );
            assert_close(&what, &got, &want, 2e-6, 1.0);
            // Row 2 has −∞ columns, which the CPU's fused op (lse − Σ p z) does not take.
            let h: Vec<f32> = got.iter().step_by(2).copied().collect();
            let finite_rows = [0, 1, 3, 4, 5];
            let pick = |v: &[f32]| finite_rows.map(|r| v[r]);
            assert_close(
                &format!("{what} beside the CPU's"),
                &pick(&h),
                &pick(&cpu),
                1e-5,
                1.0,
            );
        }
    }
}

/// `r3_entropy_grad_f32` gives the entropy's gradient `−g · p · (ln p + H)` of its
/// definition (f64, from the same row stats), within f32 rounding; a −∞ column's gradient is
/// 0 (no NaN). Blocks of 256 (the launcher's), 32 and 96 threads, both variants.
#[test]
fn entropy_gradient_equals_its_definition_within_f32_rounding() {
    let (rows, vocab) = (6usize, 1001usize);
    let z = token_logits(rows, vocab);
    let exact = entropy_stats_f64(&z, vocab);
    let stats: Vec<f32> = exact.iter().map(|&v| v as f32).collect();
    let g = [0.5f32, -1.5, 2.0, 0.0, 0.25, 1.0];
    let mut want = Vec::with_capacity(rows * vocab);
    for r in 0..rows {
        let (h, lse) = (f64::from(stats[2 * r]), f64::from(stats[2 * r + 1]));
        for &v in &z[r * vocab..(r + 1) * vocab] {
            let lp = f64::from(v) - lse;
            let p = lp.exp();
            want.push(if p > 0.0 {
                (-f64::from(g[r]) * p * (lp + h)) as f32
            } else {
                0.0
            });
        }
    }
    for (name, k) in variants() {
        for threads in [row_threads(vocab), 32, 96] {
            let what = format!("entropy gradient {name}, {threads} threads");
            let got = run(
                &what,
                LaunchShape::blocks(rows as u32, threads),
                rows * vocab,
                |out| unsafe {
                    (k.r3_entropy_grad_f32)(
                        z.as_ptr(),
                        stats.as_ptr(),
                        g.as_ptr(),
                        out,
                        vocab as u32,
                    )
                },
            );
            assert!(got.iter().all(|v| v.is_finite()), "{what}: no NaN");
            assert_close(&what, &got, &want, 1e-6, 1e-3);
        }
    }
}

/// Greedy-reduction rows of `cols` columns: ordinary values, planted ties, equal values,
/// −∞ entries, a NaN, a +∞, only −∞, a NaN first before ties, only NaN.
fn greedy_logits(cols: usize) -> (usize, Vec<f32>) {
    let rows = 9;
    let mut v = Lcg::new(4).values(rows * cols, -5.0, 5.0);
    // Row 1: the largest value at three columns in different warps and rounds (first: 7).
    for c in [cols - 1, 7, cols / 2, 7 + 32] {
        v[cols + c] = 11.0;
    }
    v[2 * cols..3 * cols].fill(0.5);
    for c in (0..cols).step_by(3) {
        v[3 * cols + c] = f32::NEG_INFINITY;
    }
    v[4 * cols + 17] = f32::NAN;
    v[5 * cols + 3] = f32::INFINITY;
    v[6 * cols..7 * cols].fill(f32::NEG_INFINITY);
    v[7 * cols] = f32::NAN;
    for c in [cols - 2, 9] {
        v[7 * cols + c] = 8.0;
    }
    v[8 * cols..9 * cols].fill(f32::NAN);
    (rows, v)
}

/// `r3_greedy_rows_f32` equals the CPU's `greedy_rows`: the largest value bit for bit, the
/// first column holding it (ties to the lower column across lanes, warps and a thread's own
/// rounds; a NaN never wins; `cols` for a row with nothing above −∞), the log-sum-exp
/// within f32 rounding (the twin sums in f64, the kernel in f32 in its block's order) and
/// NaN for a row holding a NaN or +∞; 1,000 columns over blocks of 256 (the launcher's),
/// 32, 96 and 1,024 threads, and 40 columns (threads with no column) over 32 and 96.
/// Comparisons and `expf` / `logf` only: `fma` is `plain`.
#[test]
fn greedy_rows_equal_the_cpus_largest_column_and_log_sum_exp() {
    for (cols, shapes) in [
        (1000usize, vec![row_threads(1000), 32, 96, 1024]),
        (40, vec![row_threads(40), 96]),
    ] {
        let (rows, v) = greedy_logits(cols);
        let want = greedy_rows(&tensor(&v, &[rows, cols]))
            .map(|t| host(&t))
            .expect("the CPU's greedy rows");
        assert_eq!(want[3 + 2], 7.0, "the planted ties' first column");
        assert_eq!(want[6 * 3 + 2], cols as f32, "a row of −∞ names no column");
        for &threads in &shapes {
            let mut plain: Option<Vec<u32>> = None;
            for (name, k) in variants() {
                let what = format!("greedy rows {name}, {cols} columns, {threads} threads");
                let got = run(
                    &what,
                    LaunchShape::blocks(rows as u32, threads),
                    rows * 3,
                    |out| unsafe { (k.r3_greedy_rows_f32)(v.as_ptr(), out, cols as u32) },
                );
                let pick = |x: &[f32], i: usize| x.iter().skip(i).step_by(3).copied().collect();
                let (largest, lse, first): (Vec<f32>, Vec<f32>, Vec<f32>) =
                    (pick(&got, 0), pick(&got, 1), pick(&got, 2));
                assert_bits(&format!("{what} largest"), &largest, &pick(&want, 0));
                assert_bits(&format!("{what} first column"), &first, &pick(&want, 2));
                assert_close(&format!("{what} lse"), &lse, &pick(&want, 1), 1e-6, 1.0);
                let plain = plain.get_or_insert_with(|| bits(&got));
                assert_eq!(*plain, bits(&got), "{what}: fma changed plain's bits");
            }
        }
    }
}

/// Row-draw rows of `cols` columns and their draws: ordinary values, bf16-rounded ones (a
/// coarse grid of repeated values), `−∞` entries beside finite ones, a row with a NaN, a
/// row with a `+∞`, a row of `−∞`, a row not asked, a row at temperature 0.7 and one at 1.6,
/// and draws at 0, near 1 and between; then four ordinary rows whose draws land on the bound after a
/// column (as the CPU sums: the last ulp of any sum decides between two columns there).
fn draw_rows(cols: usize) -> (usize, Vec<f32>, Vec<Option<RowDraw>>) {
    let rows = 14;
    let mut lcg = Lcg::new(11);
    let mut v = lcg.values(rows * cols, -6.0, 6.0);
    for x in &mut v[cols..2 * cols] {
        *x = half::bf16::from_f32(*x).to_f32();
    }
    for c in (0..cols).step_by(2) {
        v[2 * cols + c] = f32::NEG_INFINITY;
    }
    v[3 * cols + cols / 2] = f32::NAN;
    v[4 * cols + 1] = f32::INFINITY;
    v[5 * cols..6 * cols].fill(f32::NEG_INFINITY);
    let mut uniforms = vec![
        0.0,
        0.999_999_9,
        0.5,
        0.0,
        0.3,
        0.4,
        0.2,
        0.77,
        0.123_456,
        0.91,
    ];
    for (r, j) in (10..rows).zip([cols / 3, cols - 2, 255, 256]) {
        let row = &v[r * cols..(r + 1) * cols];
        uniforms.push(uniform_at_bound(row, j.min(cols - 2), r % 2 == 0));
    }
    let draws = (0..rows)
        .map(|r| {
            (r != 6).then_some(RowDraw {
                uniform: uniforms[r],
                inv_temperature: match r {
                    7 => 1.0 / 0.7,
                    8 => 1.0 / 1.6,
                    _ => 1.0,
                },
            })
        })
        .collect();
    (rows, v, draws)
}

/// `r3_sample_rows_f32` picks the CPU's column (`sample_rows_reporting`, the rollout
/// sampler's own full-vocabulary branch) bit for bit: the same exponentials, block sums and
/// walk, in both variants (every product and sum of the walk is a correctly rounded
/// intrinsic, so contraction changes no bit), with every row's log-prob raw and with every
/// row's scaled. The scaled log-prob (`LogprobScale::Sampling`, `(z − max) / T − ln(total)`
/// of the walk's own total) is bit for bit at every temperature, 0.7 and 1.6 included; the
/// raw one bit for bit at temperature 1 and within 1e-6 at 0.7 and 1.6 (the kernel's
/// normaliser there is a block-order f64 sum); (cols, NaN) for the rows not asked, holding a
/// NaN or a `+∞`, or all `−∞`. Over 1,000 columns (blocks of 256 and a tail of 232), 40 (one
/// short block), 4,101 (a tail of 5, under one lane's chunk) and a Qwen vocabulary's 151,936,
/// at the launcher's 512 threads and at 32, 96 and 1,024.
#[test]
fn row_draws_pick_the_cpus_column() {
    for (cols, shapes) in [
        (1000usize, vec![SAMPLE_ROWS_THREADS, 32, 96, 1024]),
        (40, vec![SAMPLE_ROWS_THREADS, 32]),
        (4101, vec![SAMPLE_ROWS_THREADS, 96]),
        (151_936, vec![SAMPLE_ROWS_THREADS]),
    ] {
        let (rows, v, draws) = draw_rows(cols);
        let mut by_scale = Vec::new();
        for scale in [LogprobScale::Raw, LogprobScale::Sampling] {
            let draws: Vec<Option<(RowDraw, LogprobScale)>> =
                draws.iter().map(|d| d.map(|d| (d, scale))).collect();
            let want = sample_rows_reporting(&tensor(&v, &[rows, cols]), &draws)
                .map(|t| host(&t))
                .expect("the CPU's draws");
            let packed = pack_draws(&draws).expect("packed draws");
            for r in [3, 4, 5, 6] {
                assert_eq!(
                    want[2 * r],
                    cols as f32,
                    "{cols} columns: row {r} names none"
                );
            }
            for &threads in &shapes {
                for (name, k) in variants() {
                    let what =
                        format!("row draws {name} {scale:?}, {cols} columns, {threads} threads");
                    let shape = LaunchShape::blocks(rows as u32, threads)
                        .with_shared_bytes(sample_rows_shared_bytes(cols));
                    let got = run(&what, shape, rows * 2, |out| unsafe {
                        (k.r3_sample_rows_f32)(v.as_ptr(), packed.as_ptr(), out, cols as u32)
                    });
                    let column = |x: &[f32]| x.iter().step_by(2).copied().collect::<Vec<f32>>();
                    assert_bits(&format!("{what} columns"), &column(&got), &column(&want));
                    for r in 0..rows {
                        let (g, w) = (got[2 * r + 1], want[2 * r + 1]);
                        if scale == LogprobScale::Raw && (r == 7 || r == 8) {
                            assert!(
                                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                                "{what}: {g} vs {w}"
                            );
                        } else {
                            assert_eq!(g.to_bits(), w.to_bits(), "{what} row {r}: {g} vs {w}");
                        }
                    }
                }
            }
            by_scale.push(want);
        }
        // The scaled log-probs are another distribution's where T ≠ 1, the raw ones' where
        // T = 1.
        let (raw, scaled) = (&by_scale[0], &by_scale[1]);
        for r in [7, 8] {
            assert!(
                (raw[2 * r + 1] - scaled[2 * r + 1]).abs() > 1e-3,
                "{cols} columns, row {r}: {} vs {}",
                raw[2 * r + 1],
                scaled[2 * r + 1]
            );
        }
        assert_eq!(
            raw[1].to_bits(),
            scaled[1].to_bits(),
            "{cols} columns, row 0"
        );
    }
}

/// RMSNorm operands: `x` and `g` `[rows, d]`, `w` `[d]`, values in [−3, 3).
fn norm_operands(rows: usize, d: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut lcg = Lcg::new(seed);
    (
        lcg.values(rows * d, -3.0, 3.0),
        lcg.values(d, -3.0, 3.0),
        lcg.values(rows * d, -3.0, 3.0),
    )
}

/// r3-model's RMSNorm (eps 1e-6, as the f32 the norm holds) at `precision` on the CPU:
/// its value and the gradients of `x` and `w` for the output gradient `g`.
fn cpu_norm(
    x: &[f32],
    w: &[f32],
    g: &[f32],
    d: usize,
    precision: Precision,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = x.len() / d;
    let xv = Var::from_tensor(&tensor(x, &[rows, d])).expect("x");
    let wv = Var::from_tensor(&tensor(w, &[d])).expect("w");
    let weights = Weights::from_map([("n.weight".to_string(), wv.as_tensor().clone())].into());
    let mut norm = RmsNorm::new(&weights, "n", NORM_EPS).expect("norm");
    norm.set_precision(precision);
    let y = norm.forward(xv.as_tensor()).expect("forward");
    // d(Σ y ⊙ g)/dy is g exactly: the backward's output gradient is `g` as it is.
    let grads = (&y * tensor(g, &[rows, d]))
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    let grad = |v: &Var| host(grads.get(v.as_tensor()).expect("gradient"));
    (host(&y), grad(&xv), grad(&wv))
}

/// The norm's eps as r3-model holds it (an f32) and hands the kernels (as f64).
const NORM_EPS: f64 = 1e-6;

/// The eps the kernels receive: [`NORM_EPS`] through the norm's f32.
fn kernel_eps() -> f64 {
    f64::from(NORM_EPS as f32)
}

/// `r3_rms_norm_f32` equals the CPU's fused RMSNorm forward bit for bit, in both variants,
/// for round codes 0 (f32), 1 (bf16) and 2 (f16: the scale read rounded, the output
/// rounded): rows of 300 (not a multiple of four, wider than the block) over blocks of 96
/// (the launcher's), 32, 160 and 1,024 threads. `x · r · w` has no add to contract; the
/// squares' f64 sums run in another order than the CPU's, but their f32 inverse RMS is the
/// same (the orders differ far below an f32 step).
#[test]
fn rms_norm_rows_equal_the_cpu_norm_bit_for_bit_at_each_rounding() {
    let (rows, d) = (5usize, 300usize);
    let (x, w, g) = norm_operands(rows, d, 5);
    for (round, precision) in [
        (0u32, Precision::F32),
        (1, Precision::Bf16 { router_f32: false }),
        (2, Precision::F16 { router_f32: false }),
    ] {
        let (want, _, _) = cpu_norm(&x, &w, &g, d, precision);
        for (name, k) in variants() {
            for threads in [row_threads(d), 32, 160, 1024] {
                let what = format!("rms norm round {round} {name}, {threads} threads");
                let got = run(
                    &what,
                    LaunchShape::blocks(rows as u32, threads),
                    rows * d,
                    |y| unsafe {
                        (k.r3_rms_norm_f32)(
                            x.as_ptr(),
                            w.as_ptr(),
                            y,
                            d as u32,
                            kernel_eps(),
                            round,
                        )
                    },
                );
                assert_bits(&what, &got, &want);
            }
        }
    }
}

/// `r3_rms_norm_dx_f32` equals the CPU's input gradient (`rms_bwd_parts`' dx, through the
/// norm's backward) bit for bit in every variant: `g·w − x·r·mean` is written with `_rn`
/// intrinsics, so the contracted build rounds each product and the difference as the CPU
/// does (the mean's f64 sum runs in the block's order, but the orders differ far below an
/// f32 step, so its f32 value is the CPU's).
/// Rows of 300 over blocks of 96 (the launcher's), 32, 160 and 1,024 threads.
#[test]
fn rms_norm_input_gradient_equals_the_cpu_bit_for_bit() {
    let (rows, d) = (5usize, 300usize);
    let (x, w, g) = norm_operands(rows, d, 6);
    let (_, want, _) = cpu_norm(&x, &w, &g, d, Precision::F32);
    for (name, k) in variants() {
        for threads in [row_threads(d), 32, 160, 1024] {
            let what = format!("rms norm dx {name}, {threads} threads");
            let got = run(
                &what,
                LaunchShape::blocks(rows as u32, threads),
                rows * d,
                |dx| unsafe {
                    (k.r3_rms_norm_dx_f32)(
                        x.as_ptr(),
                        w.as_ptr(),
                        g.as_ptr(),
                        dx,
                        d as u32,
                        kernel_eps(),
                    )
                },
            );
            assert_bits(&what, &got, &want);
        }
    }
}

/// `r3_rms_norm_dw_chunks_f32` gives each chunk's weight-gradient sum as the CPU's backward
/// does (each chunk's rows alone through the norm's backward: one CPU task, whose sum is
/// that chunk's partial as it is): two full chunks of the launcher's rows
/// (`launch_shape::RMS_NORM_DW_CHUNK_ROWS`, 64) and a last one of 5, of 40 columns, at the
/// launcher's 64 threads (`launch_shape::rms_norm_dw_chunk_threads`); one warp (every row's
/// inverse RMS on one warp, the columns in two rounds); 1,024 threads (more warps than the last chunk's rows); chunks of 16 rows
/// over 96 threads. Bit for bit in every variant: rows added in order, as the CPU adds them,
/// each `acc + g · x̂` written with `_rn` intrinsics (no contraction in the "fma" build).
#[test]
fn rms_norm_weight_gradient_chunks_equal_the_cpu_chunk_sums_bit_for_bit() {
    let chunk = RMS_NORM_DW_CHUNK_ROWS;
    let (rows, d) = (2 * chunk + 5, 40usize);
    let (x, w, g) = norm_operands(rows, d, 7);
    for (threads, chunk_rows) in [
        (rms_norm_dw_chunk_threads(d), chunk),
        (32, chunk),
        (1024, chunk),
        (96, 16),
    ] {
        let chunks = rows.div_ceil(chunk_rows);
        let want: Vec<f32> = (0..chunks)
            .flat_map(|c| {
                let span = c * chunk_rows * d..((c + 1) * chunk_rows).min(rows) * d;
                cpu_norm(&x[span.clone()], &w, &g[span], d, Precision::F32).2
            })
            .collect();
        for (name, k) in variants() {
            let what =
                format!("rms norm dw chunks {name}, {threads} threads, chunks of {chunk_rows}");
            let got = run(
                &what,
                LaunchShape::blocks(chunks as u32, threads),
                chunks * d,
                |parts| unsafe {
                    (k.r3_rms_norm_dw_chunks_f32)(
                        x.as_ptr(),
                        g.as_ptr(),
                        parts,
                        rows as u32,
                        d as u32,
                        chunk_rows as u32,
                        kernel_eps(),
                    )
                },
            );
            assert_bits(&what, &got, &want);
        }
    }
}

/// `r3_rope_rounded_f32` equals the CPU's rotation of a decode step (`PositionTables`:
/// candle's `rope` / `rope_i` for round code 0, `rotate_rounded`'s `rope_rounded` for 1
/// (bf16) and 2 (f16)) over half-split and interleaved pairs, a prefill of 5 positions and
/// a step of 1 with each sequence at its own positions, at the launcher's grid of 256-thread
/// blocks, one block of 32 and three of 96. Bit for bit in every variant: the pair's
/// `x1·c − x2·s` and `x1·s + x2·c` are written with `_rn` intrinsics, so the contracted
/// build rounds both products and the sum as the CPU does.
#[test]
fn rope_rounded_equals_the_cpus_rotation_bit_for_bit() {
    for (b, h, t, d) in [(2usize, 3usize, 5usize, 16usize), (3, 4, 1, 24)] {
        let half = d / 2;
        let x = Lcg::new(8).values(b * h * t * d, -9.0, 9.0);
        let positions: Vec<u32> = (0..b * t).map(|i| (i * 7 + 3) as u32).collect();
        for interleaved in [false, true] {
            let rope = Rope::new(&RopeConfig {
                theta: 10000.0,
                dim: d,
                interleaved,
                scaling: RopeScaling::None,
            });
            // The kernel's tables: the full tables' rows at each (b, t)'s position.
            let (all_cos, all_sin) = rope.host_tables(b * t * 7 + 3);
            let pick = |all: &[f32]| -> Vec<f32> {
                positions
                    .iter()
                    .flat_map(|&p| all[p as usize * half..][..half].to_vec())
                    .collect()
            };
            let (cos, sin) = (pick(&all_cos), pick(&all_sin));
            let tables = rope
                .tables_at(&positions, b, t, &Device::Cpu, DType::F32)
                .expect("tables");
            let xt = tensor(&x, &[b, h, t, d]);
            for (round, precision) in [
                (0u32, Precision::F32),
                (1, Precision::Bf16 { router_f32: false }),
                (2, Precision::F16 { router_f32: false }),
            ] {
                let want = match round {
                    0 => tables.rotate(&xt),
                    _ => tables.rotate_rounded(&xt, precision),
                }
                .map(|y| host(&y))
                .expect("the CPU's rotation");
                let pairs = x.len() / 2;
                for (name, k) in variants() {
                    for shape in [
                        LaunchShape::elementwise(pairs),
                        LaunchShape::blocks(1, 32),
                        LaunchShape::blocks(3, 96),
                    ] {
                        let what = format!(
                            "rope {:?} interleaved {interleaved} round {round} {name}, {shape:?}",
                            (b, h, t, d)
                        );
                        let got = run(&what, shape, x.len(), |out| unsafe {
                            (k.r3_rope_rounded_f32)(
                                x.as_ptr(),
                                cos.as_ptr(),
                                sin.as_ptr(),
                                out,
                                pairs,
                                h as u32,
                                t as u32,
                                d as u32,
                                u32::from(interleaved),
                                round,
                            )
                        });
                        assert_bits(&what, &got, &want);
                    }
                }
            }
        }
    }
}

/// `r3_attend_group_f32`, `_bf16` and `_f16` (and `r3_attend_group_combine_f32` after them
/// where the keys are split into spans) equal the CPU's composed attention
/// (`attend_additive`: the masked softmax op and candle's GEMMs, over the keys and values
/// widened to f32) within f32 rounding: keys and values of different widths (24, 40) read in
/// place from KV-cache buffers of other capacities (20 and 10 slots past the keys: batch and
/// head strides that are not the packed ones), 300 keys over several chunks of the block's
/// threads in one span, 1,500 and 1,100 in the three spans the launcher picks at these
/// blocks (merged at the launcher's grid-stride shape and at three one-warp blocks), groups
/// of two, three and ten query rows (ten: past the eight dots a key's pass computes), each
/// query row's two runs of seen slots against the additive mask they mean (batch row 0's
/// apart by more than a span, so a span starts in the gap and its first chunks have no
/// probabilities, and a causal end; batch row 1 left-padded past half its keys, which the
/// kernel does not read: its first span sees nothing and the merge weighs it 0; at three
/// queries its first query sees no key at all, NaN in both), a step of one query and of
/// three; the launcher's 128 threads with its
/// shared memory (`launch_shape::attend_group_threads`, `attend_group_shared_bytes`), and
/// 32, 96 and 1,024 threads (chunks of that many keys). The kernel sums a chunk's
/// exponentials in its warp's order and rescales per chunk (and `fma` contracts the dots and
/// the weighted sums): a tolerance in both variants.
#[test]
fn decode_attention_groups_equal_the_cpus_composed_attention() {
    let (b, kv, dq, dv) = (2usize, 2usize, 24usize, 40usize);
    let scale = 0.2f32;
    // The kernel over f32 buffers, or the bf16 / f16 one over 16-bit buffers; 300 keys in
    // one span, 1,500 and 1,100 in three (`attend_group_spans` at these blocks).
    for (groups, t, held, s) in [
        (2usize, 1usize, DType::F32, 300usize),
        (2, 3, DType::BF16, 300),
        (10, 1, DType::F16, 300),
        (10, 3, DType::BF16, 300),
        (3, 3, DType::F32, 300),
        (2, 1, DType::BF16, 1500),
        (10, 3, DType::F32, 1100),
    ] {
        let (k_cap, v_cap) = (s + 20, s + 10);
        let gt = groups * t;
        let rows = b * kv * gt;
        let mut lcg = Lcg::new(9 + (t * groups) as u64);
        let q = lcg.values(rows * dq, -3.0, 3.0);
        // Keys and values of f16-exact values (so every kernel reads the same ones), held in
        // bf16 and f16 too (f16-exact values of this range are bf16-exact only where they
        // have 8 significant bits: rounded once more for bf16).
        let f16s =
            |x: Vec<f32>| -> Vec<half::f16> { x.into_iter().map(half::f16::from_f32).collect() };
        let (k_f16, v_f16) = (
            f16s(lcg.values(b * kv * k_cap * dq, -3.0, 3.0)),
            f16s(lcg.values(b * kv * v_cap * dv, -3.0, 3.0)),
        );
        let bf16s = |x: &[half::f16]| -> Vec<half::bf16> {
            x.iter().map(|v| half::bf16::from_f32(v.to_f32())).collect()
        };
        let (k_bf16, v_bf16) = (bf16s(&k_f16), bf16s(&v_f16));
        let wide = |f: &[half::f16], b: &[half::bf16]| -> Vec<f32> {
            match held {
                DType::BF16 => b.iter().map(|x| x.to_f32()).collect(),
                _ => f.iter().map(|x| x.to_f32()).collect(),
            }
        };
        let (k_buf, v_buf) = (wide(&k_f16, &k_bf16), wide(&v_f16, &v_bf16));
        // Each query row's runs of seen slots: batch row 0 sees the first fifteenth and, past a
        // gap longer than a span, from three fifths up to its causal end (its second span
        // starts in the gap); batch row 1 is left-padded past half its keys and, at three
        // queries, its first query sees nothing (both runs empty).
        let seen: Vec<u32> = (0..b * t)
            .flat_map(|row| {
                let (bi, ti) = (row / t, row % t);
                let end = (s - t + ti + 1) as u32;
                match (bi, ti) {
                    (0, _) => [0, (s / 15) as u32, (3 * s / 5) as u32, end],
                    (_, 0) if t == 3 => [0, 0, 0, 0],
                    _ => [(s / 2) as u32, end, 0, 0],
                }
            })
            .collect();
        let mask: Vec<f32> = (0..b * t * s)
            .map(|i| {
                let (row, j) = (i / s, (i % s) as u32);
                let r = &seen[row * 4..row * 4 + 4];
                match (r[0] <= j && j < r[1]) || (r[2] <= j && j < r[3]) {
                    true => 0.0,
                    false => f32::NEG_INFINITY,
                }
            })
            .collect();
        let view = |buf: &[f32], cap: usize, width: usize| {
            tensor(buf, &[b, kv, cap, width])
                .narrow(2, 0, s)
                .expect("the cache's first slots")
        };
        let (k_view, v_view) = (view(&k_buf, k_cap, dq), view(&v_buf, v_cap, dv));
        let (ks, vs) = (k_view.stride().to_vec(), v_view.stride().to_vec());
        assert_eq!(
            (ks[0], ks[1], vs[0], vs[1]),
            (kv * k_cap * dq, k_cap * dq, kv * v_cap * dv, v_cap * dv)
        );
        let want = attend_additive(
            &tensor(&q, &[b, kv, gt, dq]),
            &k_view,
            &v_view,
            &tensor(&mask, &[b, 1, 1, t, s]),
            f64::from(scale),
            groups,
        )
        .map(|o| host(&o))
        .expect("the CPU's attention");
        let nan = want.iter().filter(|w| w.is_nan()).count();
        assert_eq!(nan, if t == 3 { kv * groups * dv } else { 0 });
        let blocks = b * kv * t;
        let (spans, span) = attend_group_spans(blocks, s);
        assert_eq!(spans, if s > 1000 { 3 } else { 1 });
        let state_len = blocks * spans * groups * (dv + 2);
        let written = if spans == 1 { rows * dv } else { state_len };
        for (name, k) in variants() {
            for threads in [attend_group_threads(groups, dq, dv), 32, 96, 1024] {
                let shared = attend_group_shared_bytes(groups, dq, dv, threads);
                let what = format!(
                    "attend groups of {groups}, t {t}, {s} keys, {name}, {threads} threads"
                );
                let shape = LaunchShape {
                    grid: [blocks as u32, spans as u32, 1],
                    block: threads,
                    shared_bytes: shared,
                };
                let dims = [kv, groups, t, s, span, dq, dv].map(|n| n as u32);
                let strides = [ks[0], ks[1], vs[0], vs[1]].map(|n| n as u64);
                let got = run(&what, shape, written, |out| unsafe {
                    let [kv_, g_, t_, s_, span_, dq_, dv_] = dims;
                    let [kb_, kh_, vb_, vh_] = strides;
                    // One kernel's call over its keys' and values' buffers.
                    macro_rules! attend {
                        ($kernel:ident, $k:expr, $v:expr) => {
                            (k.$kernel)(
                                q.as_ptr(),
                                $k.as_ptr(),
                                $v.as_ptr(),
                                seen.as_ptr(),
                                out,
                                kv_,
                                g_,
                                t_,
                                s_,
                                span_,
                                dq_,
                                dv_,
                                kb_,
                                kh_,
                                vb_,
                                vh_,
                                scale,
                            )
                        };
                    }
                    match held {
                        DType::BF16 => attend!(r3_attend_group_bf16, k_bf16, v_bf16),
                        DType::F16 => attend!(r3_attend_group_f16, k_f16, v_f16),
                        _ => attend!(r3_attend_group_f32, k_buf, v_buf),
                    }
                });
                if spans == 1 {
                    assert_close(&what, &got, &want, 1e-5, 1.0);
                    continue;
                }
                // The spans' states merged: at the launcher's grid-stride shape, and at
                // three blocks of one warp (the loop taking the rest).
                for combine in [
                    LaunchShape::elementwise(rows * dv),
                    LaunchShape::blocks(3, 32),
                ] {
                    let what = format!("{what}, merged over {:?}", combine.grid);
                    let merged = run(&what, combine, rows * dv, |out| unsafe {
                        (k.r3_attend_group_combine_f32)(
                            got.as_ptr(),
                            out,
                            blocks as u32,
                            groups as u32,
                            t as u32,
                            spans as u32,
                            dv as u32,
                        )
                    });
                    assert_close(&what, &merged, &want, 1e-5, 1.0);
                }
            }
        }
    }
}
