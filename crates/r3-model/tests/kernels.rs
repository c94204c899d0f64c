//! r3's own row ops one at a time on another device against the CPU: the attention that
//! recomputes its probabilities (masked softmax forward, softmax backward), RMSNorm (value,
//! input and weight gradients), the recomputing token log-prob (value and logits gradient),
//! bf16 / f16 rounding (value and gradient), the f32 ↔ bf16 / f16 casts, rotary embedding
//! (candle's kernel with r3's backward on a GPU), the token embedding's backward, the row
//! draws of the rollout sampler (`sample_rows`: the same columns bit for bit), and the
//! routed experts under a skewed load, which a GPU runs as padded batched GEMMs with
//! overflow blocks and one combine op (the CPU as its fused op).
//! On a GPU each runs r3's CUDA kernel (`src/cuda/kernels.cu`), so a failure here names the
//! kernel where `devices.rs` would only name a model. Without the `cuda` feature (CI) the
//! same comparisons run against a second CPU computation and demand the same bits.

use candle_core::{DType, Device, Tensor, Var};
use r3_model::cast16::cast16;
use r3_model::layers::attention::recompute::{attend_recomputed, NarrowOperands};
use r3_model::layers::attention::rope::Rope;
use r3_model::layers::attention::{AttentionMask, ScoreTiles};
use r3_model::layers::embedding_rows::embedding_rows;
use r3_model::layers::gather_rows::GatherRows;
use r3_model::layers::moe::dispatch::Dispatch;
use r3_model::layers::moe::experts::RoutedExperts;
use r3_model::layers::moe::padded_experts::PaddedExpertOps;
use r3_model::layers::norm::RmsNorm;
use r3_model::token_stats::token_log_probs_recomputed;
use r3_model::{Precision, Weights};
use r3_model::{RopeConfig, RopeScaling};
use r3_test_support::bits;

/// A seeded tensor of `shape` on `device`, values in [−3, 3).
fn seeded(shape: &[usize], seed: u64, device: &Device) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    let data: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 6.0 - 3.0
        })
        .collect();
    Tensor::from_vec(data, shape, device).expect("seeded tensor")
}

/// max |a − b| and max |b| (both brought to the CPU).
fn diff_and_scale(a: &Tensor, b: &Tensor) -> (f32, f32) {
    let host = |t: &Tensor| {
        t.to_device(&Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("to host")
    };
    let (a, b) = (host(a), host(b));
    assert_eq!(a.len(), b.len(), "shapes differ");
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    (diff, scale)
}

/// `a` within `tol` of `b` relative to `b`'s largest entry (at least 1), naming `what`.
fn assert_close(what: &str, a: &Tensor, b: &Tensor, tol: f32) {
    let (diff, scale) = diff_and_scale(a, b);
    println!("{what}: max |Δ| {diff:.3e} (largest |x| {scale:.3e})");
    assert!(
        diff <= tol * scale.max(1.0),
        "{what}: max |Δ| {diff} over {tol} × {scale}"
    );
}

/// The recomputing attention's value and its q, k, v gradients on `device` (GQA with three
/// query heads per key/value head, key padding, a sliding window); with `narrow` the
/// operands and the output's gradient hold bf16 values and their products are 16-bit GEMMs
/// on a GPU.
fn attention(device: &Device, window: Option<usize>, narrow: NarrowOperands) -> [Tensor; 4] {
    let (b, kv, groups, t, d) = (2, 2, 3, 37, 16);
    let mask = AttentionMask::new(&[37, 20], t, window, device).expect("mask");
    let values = |dims: &[usize], seed: u64| -> Tensor {
        let t = seeded(dims, seed, device);
        match narrow.queries_keys {
            Some(n) => t
                .to_dtype(n)
                .and_then(|t| t.to_dtype(DType::F32))
                .expect("16-bit values"),
            None => t,
        }
    };
    let q = Var::from_tensor(&values(&[b, kv, groups * t, d], 1)).expect("q");
    let k = Var::from_tensor(&values(&[b, kv, t, d], 2)).expect("k");
    let v = Var::from_tensor(&values(&[b, kv, t, d], 3)).expect("v");
    let probe = values(&[b, kv, groups * t, d], 4);
    let y = attend_recomputed(
        &q,
        &k,
        &v,
        mask.additive(),
        0.25,
        groups,
        narrow,
        ScoreTiles::WHOLE,
    )
    .expect("attend");
    let grads = (&y * &probe)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    let g = |x: &Var| grads.get(x.as_tensor()).expect("gradient").clone();
    [y, g(&q), g(&k), g(&v)]
}

/// The recomputing token log-probs and the logits' gradient on `device` (a vocabulary wider
/// than one block's threads, rows sharing a target).
fn token_logprobs(device: &Device) -> [Tensor; 2] {
    let (rows, vocab) = (9, 3001);
    let z =
        Var::from_tensor(&(seeded(&[rows, vocab], 5, device) * 4.0).expect("scale")).expect("z");
    let targets =
        Tensor::new(&[0u32, 3000, 17, 17, 1500, 2, 999, 1024, 7], device).expect("targets");
    let w = seeded(&[rows], 6, device);
    let lp = token_log_probs_recomputed(&z, &targets).expect("log-probs");
    let grads = (&lp * &w)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    [lp, grads.get(z.as_tensor()).expect("gradient").clone()]
}

/// Each row's entropy (`token_stats::entropy`: on a GPU the row kernels, on the CPU its
/// fused op) and the logits' gradient, on `device`, over a vocabulary wider than one block's
/// threads.
fn entropies(device: &Device) -> [Tensor; 2] {
    let (rows, vocab) = (9, 3001);
    let z =
        Var::from_tensor(&(seeded(&[rows, vocab], 7, device) * 4.0).expect("scale")).expect("z");
    let w = seeded(&[rows], 8, device);
    let h = r3_model::token_stats::entropy(&z).expect("entropy");
    let grads = (&h * &w)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    [h, grads.get(z.as_tensor()).expect("gradient").clone()]
}

/// Rows of a Qwen vocabulary (151,936 columns) drawn from on `device` (`sample_rows`: on a
/// GPU its kernel, on the CPU the rollout sampler's full-vocabulary branch): `[rows, 2]` of
/// (column, log-prob). Every other row is rounded to bf16 (repeated values); rows 0–3 have
/// draws on the bound after a column as the host sums (`uniform_at_bound`: an ulp anywhere in a
/// device's sums picks the other column); rows 4 and 5 are at temperature 0.7.
fn row_draws(device: &Device) -> Tensor {
    use r3_model::sample_rows::{sample_rows, uniform_at_bound, RowDraw};
    let (rows, vocab) = (12, 151_936);
    let z = (seeded(&[rows, vocab], 11, device) * 3.0).expect("scale");
    let bf16 = z
        .to_dtype(DType::BF16)
        .and_then(|t| t.to_dtype(DType::F32))
        .expect("bf16");
    let parity = Tensor::from_vec(
        (0..rows).map(|r| (r % 2) as u8).collect::<Vec<u8>>(),
        (rows, 1),
        device,
    )
    .and_then(|m| m.broadcast_as((rows, vocab)))
    .expect("parity");
    let z = parity.where_cond(&bf16, &z).expect("rows");
    let host: Vec<Vec<f32>> = z
        .to_device(&Device::Cpu)
        .and_then(|t| t.to_vec2())
        .expect("rows");
    let draws: Vec<Option<RowDraw>> = (0..rows)
        .map(|r| {
            let uniform = if r < 4 {
                uniform_at_bound(&host[r], [77, 150_000, 255, 80_128][r], r % 2 == 0)
            } else {
                (r as f64 * 0.618_033_988_7).fract()
            };
            let t = if r == 4 || r == 5 { 0.7f32 } else { 1.0 };
            Some(RowDraw {
                uniform,
                inv_temperature: 1.0 / t,
            })
        })
        .collect();
    sample_rows(&z, &draws).expect("draws")
}

/// A rounded tensor and the rounded gradient coming back through it, on `device`.
fn rounding(device: &Device, precision: Precision) -> [Tensor; 2] {
    let x = Var::from_tensor(&(seeded(&[3, 1000], 7, device) * 1000.0).expect("x")).expect("x");
    let probe = (seeded(&[3, 1000], 8, device) * 0.001).expect("probe");
    let y = precision.round(&x).expect("round");
    let grads = (&y * &probe)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    [y, grads.get(x.as_tensor()).expect("gradient").clone()]
}

/// RMSNorm's value and the gradients of its input and weight on `device` at `precision`
/// (bf16 / f16: the scale and the output rounded inside the op; more rows than one
/// weight-gradient chunk holds, a width over one block's threads).
fn rms_norm(device: &Device, precision: Precision) -> [Tensor; 3] {
    let (rows, d) = (150, 1300);
    let x = Var::from_tensor(&seeded(&[rows, d], 9, device)).expect("x");
    let w = Var::from_tensor(&seeded(&[d], 10, device)).expect("w");
    let weights = Weights::from_map([("n.weight".to_string(), w.as_tensor().clone())].into());
    let mut norm = RmsNorm::new(&weights, "n", 1e-6).expect("norm");
    norm.set_precision(precision);
    let probe = seeded(&[rows, d], 11, device);
    let y = norm.forward(&x).expect("forward");
    let grads = (&y * &probe)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    let g = |v: &Var| grads.get(v.as_tensor()).expect("gradient").clone();
    [y, g(&x), g(&w)]
}

/// The routed experts' output and the gradients of rows, gates and both stacked weights on
/// `device` at `precision`, under a load skewed enough that a GPU's padded layout spills
/// expert 0 into overflow blocks (1,400 of 2,000 rows on one of four experts, top-1: blocks
/// of 500 with two overflow blocks cost 3,256 padded rows, one block of 1,400 each 5,600), so
/// the weight gradient adds an overflow run to the main blocks' on a GPU.
fn skewed_experts(device: &Device, precision: Precision) -> [Tensor; 5] {
    skewed_experts_by(device, precision, PaddedExpertOps::Fused)
}

/// [`skewed_experts`] with a GPU's padded layout run as `ops` says.
fn skewed_experts_by(device: &Device, precision: Precision, ops: PaddedExpertOps) -> [Tensor; 5] {
    let rows = 2000;
    let ids: Vec<u32> = (0..rows as u32)
        .map(|r| if r % 10 < 7 { 0 } else { 1 + r % 3 })
        .collect();
    experts_case(device, precision, ops, (16, 8), &ids, 1)
}

/// Top-2 over wide rows (`H` = 320: several columns a thread and three warps a block in the
/// combine's kernels), expert 0 in every row (overflow blocks), with a GPU's padded layout
/// run as `ops` says.
fn wide_top2_experts_by(
    device: &Device,
    precision: Precision,
    ops: PaddedExpertOps,
) -> [Tensor; 5] {
    let ids: Vec<u32> = (0..600u32).flat_map(|r| [0, 1 + r % 3]).collect();
    experts_case(device, precision, ops, (320, 24), &ids, 2)
}

/// The routed experts (4 of them, widths `(H, I)`) over the rows routed to `ids` (`top_k` a
/// row) on `device` at `precision`: the output and the gradients of the rows, gates and both
/// stacks for a seeded probe.
fn experts_case(
    device: &Device,
    precision: Precision,
    ops: PaddedExpertOps,
    (h, i): (usize, usize),
    ids: &[u32],
    top_k: usize,
) -> [Tensor; 5] {
    let (e, rows) = (4, ids.len() / top_k);
    let dispatch = Dispatch::new(ids, top_k, e).expect("dispatch");
    let gate_up =
        Var::from_tensor(&(seeded(&[e, 2 * i, h], 12, device) * 0.3).expect("w")).expect("gate_up");
    let down = Var::from_tensor(&(seeded(&[e, h, i], 13, device) * 0.3).expect("w")).expect("down");
    let weights = Weights::from_map(
        [
            (
                "m.experts.gate_up_proj".to_string(),
                gate_up.as_tensor().clone(),
            ),
            ("m.experts.down_proj".to_string(), down.as_tensor().clone()),
        ]
        .into(),
    );
    let mut experts = RoutedExperts::new(&weights, "m", e).expect("experts");
    experts.set_precision(precision);
    experts.set_padded_ops(ops);
    let x = Var::from_tensor(&seeded(&[rows, h], 14, device)).expect("x");
    let gates =
        Var::from_tensor(&(seeded(&[rows, top_k], 15, device) * 0.2).expect("g")).expect("g");
    let probe = seeded(&[rows, h], 16, device);
    let y = experts
        .forward(&x, &gates, &dispatch)
        .expect("experts forward");
    let grads = (&y * &probe)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    let g = |v: &Var| grads.get(v.as_tensor()).expect("gradient").clone();
    [y, g(&x), g(&gates), g(&gate_up), g(&down)]
}

/// On a GPU the padded experts' two fused ops (`padded_experts.rs`, the default, holding
/// their intermediates in the GEMMs' dtype and running their passes in it) give the
/// per-step chain's output and the gradients of rows, gates and both stacks bit for bit, in
/// f32, bf16 and f16, under the skewed load (overflow blocks), top-1 over narrow rows and
/// top-2 over wide ones.
#[cfg(feature = "cuda")]
#[test]
fn fused_padded_experts_on_cuda_are_the_per_step_chain() {
    let device = r3_model::DeviceSpec::Cuda { ordinal: 0 }
        .open()
        .expect("a CUDA GPU (this test runs on the GPU machine)");
    for precision in [
        Precision::F32,
        Precision::Bf16 { router_f32: false },
        Precision::F16 { router_f32: false },
    ] {
        type Case = fn(&Device, Precision, PaddedExpertOps) -> [Tensor; 5];
        let cases: [(&str, Case); 2] = [
            ("top-1", skewed_experts_by),
            ("wide top-2", wide_top2_experts_by),
        ];
        for (case, run) in cases {
            let fused = run(&device, precision, PaddedExpertOps::Fused);
            let per_step = run(&device, precision, PaddedExpertOps::PerStep);
            let names = ["output", "d x", "d gates", "d gate_up", "d down"];
            for ((a, b), name) in fused.iter().zip(&per_step).zip(names) {
                assert_eq!(a.dtype(), b.dtype(), "{case} {precision:?} {name}");
                assert_eq!(bits(a), bits(b), "{case} {precision:?} {name}");
            }
        }
    }
}

/// Rotary embedding on `device` of a transposed `[B, T, H, D]` input (a GPU: candle's rope
/// kernel with r3's backward) and the input's gradient, half-split or interleaved.
fn rope(device: &Device, interleaved: bool) -> [Tensor; 2] {
    let (b, t, h, d) = (2, 33, 3, 16);
    let rope = Rope::new(&RopeConfig {
        theta: 10000.0,
        dim: d,
        interleaved,
        scaling: RopeScaling::None,
    });
    let tables = rope.tables(t, device, DType::F32).expect("tables");
    let x = Var::from_tensor(&seeded(&[b, t, h, d], 18, device)).expect("x");
    let probe = seeded(&[b, h, t, d], 19, device);
    let y = tables
        .apply(&x.transpose(1, 2).expect("transpose"))
        .expect("rope");
    let grads = (&y * &probe)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    [y, grads.get(x.as_tensor()).expect("gradient").clone()]
}

/// Token embedding rows on `device` and the table's gradient (repeated and unused tokens).
fn embedding(device: &Device) -> [Tensor; 2] {
    let host: Vec<u32> = (0..300u32).map(|p| (p * p + 7 * p) % 97).collect();
    let table = Var::from_tensor(&seeded(&[120, 40], 20, device)).expect("table");
    let ids = Tensor::new(host.as_slice(), device).expect("ids");
    let probe = seeded(&[host.len(), 40], 21, device);
    let y = embedding_rows(table.as_tensor(), &ids, &host).expect("rows");
    let grads = (&y * &probe)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    [y, grads.get(table.as_tensor()).expect("gradient").clone()]
}

/// Rows gathered by `GatherRows` on `device` (a GPU: r3's row-copy kernel, 16-byte copies
/// where the row allows) and the source's gradient (each row's fan-in gathered and summed in
/// one pass: r3's kernel), for rows of 8 and of 6 floats, a source that is a view starting
/// 3 floats into its variable's storage (the kernel's row-by-row path: no 16-byte copies
/// off a four-float boundary), and its last 3 rows padding without a gradient; the gradient
/// is the whole variable's.
fn gathered_rows(device: &Device) -> Vec<Tensor> {
    let ids: Vec<u32> = (0..50u32).map(|i| (i * 7 + 3) % 20).collect();
    let mut out = Vec::new();
    for (width, skip, grad_rows) in [(8, 0, 20), (6, 0, 20), (8, 3, 20), (8, 0, 17)] {
        let flat = Var::from_tensor(&seeded(&[20 * width + skip], 30 + width as u64, device))
            .expect("var");
        let src = flat
            .as_tensor()
            .narrow(0, skip, 20 * width)
            .and_then(|t| t.reshape((20, width)))
            .expect("source");
        assert_eq!(src.layout().start_offset(), skip, "the source is a view");
        let op = GatherRows::new(ids.clone(), 20, grad_rows).expect("op");
        let y = op.apply(&src).expect("gather");
        let probe = seeded(&[ids.len(), width], 31, device);
        let grads = (&y * &probe)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
            .expect("backward");
        out.push(y);
        out.push(grads.get(flat.as_tensor()).expect("gradient").clone());
    }
    out
}

/// The gradient sums of gathered rows from 16-bit gradient rows (`GatherRows::sum_uses_widened`,
/// as the padded experts sum their gate-up GEMMs' 16-bit input gradient back per row: on a GPU
/// r3's sum kernel reading bf16 / f16, widened as read), for rows of 16 and 6 values and the
/// last 3 source rows without a gradient: f32 sums, each source row's uses in order.
fn gathered_sums_16(device: &Device) -> Vec<Tensor> {
    let ids: Vec<u32> = (0..50u32).map(|i| (i * 7 + 3) % 20).collect();
    let mut out = Vec::new();
    for dtype in [DType::BF16, DType::F16] {
        for (width, grad_rows) in [(16, 20), (6, 17)] {
            let grad = seeded(&[ids.len(), width], 50 + width as u64, device)
                .to_dtype(dtype)
                .expect("16-bit gradient rows");
            let op = GatherRows::new(ids.clone(), 20, grad_rows).expect("op");
            let sums = op.sum_uses_widened(&grad, &[20, width]).expect("sums");
            assert_eq!(sums.dtype(), DType::F32, "{dtype:?}: summed in f32");
            out.push(sums);
        }
    }
    out
}

/// Rows of bf16 and f16 values gathered by `GatherRows` on `device` (a GPU: r3's 16-bit
/// row-copy kernel, 16-byte copies where the row is a multiple of eight values on a 16-byte
/// boundary), as the padded experts gather their narrowed rows: rows of 16 and of 6 values,
/// and views starting 3 and 8 values into their storage; each widened to f32 (exact) for
/// the comparison.
fn gathered_rows_16(device: &Device) -> Vec<Tensor> {
    let ids: Vec<u32> = (0..50u32).map(|i| (i * 7 + 3) % 20).collect();
    let mut out = Vec::new();
    for dtype in [DType::BF16, DType::F16] {
        for (width, skip) in [(16, 0), (6, 0), (16, 3), (16, 8)] {
            let flat = seeded(&[20 * width + skip], 40 + width as u64, device)
                .to_dtype(dtype)
                .expect("narrow");
            let src = flat
                .narrow(0, skip, 20 * width)
                .and_then(|t| t.reshape((20, width)))
                .expect("source");
            assert_eq!(src.layout().start_offset(), skip, "the source is a view");
            let op = GatherRows::new(ids.clone(), 20, 20).expect("op");
            let y = src.apply_op1_no_bwd(&op).expect("gather");
            assert_eq!(y.dtype(), dtype);
            out.push(y.to_dtype(DType::F32).expect("widened"));
        }
    }
    out
}

/// `cast16` on `device` both ways against the CPU's cast, bit for bit: ties, infinities,
/// signed zeros, values past the 16-bit ranges and subnormals; a length that is not a
/// multiple of four (the kernels' tail), a view starting on a four-element boundary (the
/// kernel) and one starting off it (candle's cast).
fn casts_match_the_cpu(device: &Device) {
    let mut values: Vec<f32> = vec![
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        1.0 + 2f32.powi(-11),
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        0.0,
        1e-40,
        -3e38,
        70_000.0,
        6e-8,
    ];
    let spread = seeded(&[1000], 17, &Device::Cpu)
        .to_vec1::<f32>()
        .expect("spread");
    values.extend(
        spread
            .iter()
            .enumerate()
            .map(|(i, v)| v * 10f32.powi(i as i32 % 9 - 4)),
    );
    let host = Tensor::from_vec(values.clone(), values.len(), &Device::Cpu).expect("host");
    let on = host.to_device(device).expect("to device");
    for narrow in [DType::BF16, DType::F16] {
        for start in [0, 4, 1] {
            let len = values.len() - start;
            let (x, x_cpu) = (
                on.narrow(0, start, len).expect("view"),
                host.narrow(0, start, len).expect("view"),
            );
            let want = x_cpu.to_dtype(narrow).expect("cpu cast");
            let got = cast16(&x, narrow).expect("cast");
            assert_eq!(got.dtype(), narrow);
            assert!(bits(&got) == bits(&want), "{narrow:?} narrow from {start}");
            let back = cast16(&got, DType::F32).expect("widen");
            let want_back = want.to_dtype(DType::F32).expect("cpu widen");
            assert!(
                bits(&back) == bits(&want_back),
                "{narrow:?} widen from {start}"
            );
        }
    }
    println!("casts f32 ↔ bf16 / f16: bit for bit");
}

/// The stochastic roundings on `device` against the CPU's, bit for bit (the draws are a
/// function of key and index): f32 to bf16 (`r3_round_bf16_stochastic`, the composed AdamW
/// path's), and the sums of every pair of f32 / bf16 addends (`r3_sum_bf16_stochastic_*`, a
/// gradient summed over micro-batches in bf16), over 300,001 values (no multiple of a block)
/// with non-finite values: a NaN addend gives the canonical NaN on both devices, though the
/// GPU's f32 sum with it is another NaN than the CPU's.
fn stochastic_rounding_matches_the_cpu(device: &Device) {
    use r3_model::stochastic_round::{
        stochastic_round_bf16, sum_round_bf16_stochastic, sum_rounding_key,
    };
    let n = 300_001;
    let mut a = seeded(&[n], 31, &Device::Cpu).to_vec1::<f32>().expect("a");
    a[7] = f32::INFINITY;
    a[8] = f32::NAN;
    let a = Tensor::from_vec(a, n, &Device::Cpu).expect("a");
    let b = (seeded(&[n], 32, &Device::Cpu) * 1e-3).expect("b");
    let key = sum_rounding_key(9, 2, 1, 5);
    let on = |t: &Tensor| t.to_device(device).expect("to device");
    let want = stochastic_round_bf16(&a, key).expect("cpu rounding");
    let got = stochastic_round_bf16(&on(&a), key).expect("rounding");
    assert!(bits(&got) == bits(&want), "stochastic rounding");
    for (da, db) in [
        (DType::F32, DType::F32),
        (DType::F32, DType::BF16),
        (DType::BF16, DType::F32),
        (DType::BF16, DType::BF16),
    ] {
        let (x, y) = (a.to_dtype(da).expect("a"), b.to_dtype(db).expect("b"));
        let want = sum_round_bf16_stochastic(&x, &y, key).expect("cpu sum");
        let got = sum_round_bf16_stochastic(&on(&x), &on(&y), key).expect("sum");
        assert_eq!(got.dtype(), DType::BF16);
        assert!(bits(&got) == bits(&want), "stochastic sum {da:?} + {db:?}");
    }
    println!("stochastic rounding and sums to bf16: bit for bit");
}

/// Every op on `device` against the CPU: attention and log-probs within `tol` (relative),
/// rounding bit for bit (round to nearest even has one answer).
fn compare(device: &Device, tol: f32) {
    casts_match_the_cpu(device);
    stochastic_rounding_matches_the_cpu(device);
    // 16-bit products (a GPU's tensor cores) of bf16 values: the same products as f32's,
    // summed in f32 in cuBLAS's order, so within the f32 GEMMs' tolerance of the CPU.
    let bf16 = NarrowOperands {
        queries_keys: Some(DType::BF16),
        values_grad: Some(DType::BF16),
    };
    for (window, narrow) in [
        (None, NarrowOperands::default()),
        (Some(9), NarrowOperands::default()),
        (None, bf16),
        (Some(9), bf16),
    ] {
        let names = ["value", "dq", "dk", "dv"];
        for ((got, want), name) in attention(device, window, narrow)
            .iter()
            .zip(attention(&Device::Cpu, window, narrow).iter())
            .zip(names)
        {
            assert_close(
                &format!("attention {window:?} {narrow:?} {name}"),
                got,
                want,
                tol,
            );
        }
    }
    // Rounded to a 16-bit float, a value an f32 ulp from a rounding boundary may land one
    // 16-bit step away (a step is up to 2⁻⁷ relative in bf16, 2⁻¹⁰ in f16).
    for (precision, tol) in [
        (Precision::F32, tol),
        (
            Precision::Bf16 { router_f32: false },
            if tol > 0.0 { 1e-2 } else { 0.0 },
        ),
        (
            Precision::F16 { router_f32: false },
            if tol > 0.0 { 1e-3 } else { 0.0 },
        ),
    ] {
        for ((got, want), name) in rms_norm(device, precision)
            .iter()
            .zip(rms_norm(&Device::Cpu, precision).iter())
            .zip(["value", "dx", "dw"])
        {
            assert_close(&format!("rms norm {precision:?} {name}"), got, want, tol);
        }
    }
    // bf16: a GPU rounds the same points but sums in cuBLAS's order and adds the overflow
    // run's weight gradient in f32, so the comparison allows a few bf16 steps.
    let bf16 = Precision::Bf16 { router_f32: false };
    for (precision, tol) in [
        (Precision::F32, tol),
        (bf16, if tol > 0.0 { 2e-2 } else { 0.0 }),
    ] {
        for ((got, want), name) in skewed_experts(device, precision)
            .iter()
            .zip(skewed_experts(&Device::Cpu, precision).iter())
            .zip(["value", "dx", "dgates", "dgate_up", "ddown"])
        {
            assert_close(
                &format!("skewed experts {precision:?} {name}"),
                got,
                want,
                tol,
            );
        }
        let wide =
            |device: &Device| wide_top2_experts_by(device, precision, PaddedExpertOps::Fused);
        for ((got, want), name) in wide(device)
            .iter()
            .zip(wide(&Device::Cpu).iter())
            .zip(["value", "dx", "dgates", "dgate_up", "ddown"])
        {
            assert_close(
                &format!("wide top-2 experts {precision:?} {name}"),
                got,
                want,
                tol,
            );
        }
    }
    for interleaved in [false, true] {
        for ((got, want), name) in rope(device, interleaved)
            .iter()
            .zip(rope(&Device::Cpu, interleaved).iter())
            .zip(["value", "dx"])
        {
            assert_close(
                &format!("rope interleaved={interleaved} {name}"),
                got,
                want,
                tol,
            );
        }
    }
    for ((got, want), name) in embedding(device)
        .iter()
        .zip(embedding(&Device::Cpu).iter())
        .zip(["value", "dtable"])
    {
        assert_close(&format!("embedding {name}"), got, want, tol);
    }
    // The gather copies and the gradient sums each row's fan-in in the host's order: both
    // bit for bit.
    for (i, (got, want)) in gathered_rows(device)
        .iter()
        .zip(gathered_rows(&Device::Cpu).iter())
        .enumerate()
    {
        let (name, tol) = if i % 2 == 0 {
            ("value", 0.0)
        } else {
            ("dsrc", 0.0)
        };
        assert_close(
            &format!("gathered rows case {} {name}", i / 2),
            got,
            want,
            tol,
        );
    }
    for (i, (got, want)) in gathered_rows_16(device)
        .iter()
        .zip(gathered_rows_16(&Device::Cpu).iter())
        .enumerate()
    {
        assert_close(&format!("gathered 16-bit rows case {i}"), got, want, 0.0);
    }
    for (i, (got, want)) in gathered_sums_16(device)
        .iter()
        .zip(gathered_sums_16(&Device::Cpu).iter())
        .enumerate()
    {
        assert_close(
            &format!("16-bit gradient rows' sums case {i}"),
            got,
            want,
            0.0,
        );
    }
    let [lp, dz] = token_logprobs(device);
    let [lp_cpu, dz_cpu] = token_logprobs(&Device::Cpu);
    assert_close("token log-probs", &lp, &lp_cpu, tol);
    assert_close("token log-probs dz", &dz, &dz_cpu, tol);
    let [h, dz] = entropies(device);
    let [h_cpu, dz_cpu] = entropies(&Device::Cpu);
    assert_close("entropy", &h, &h_cpu, tol);
    assert_close("entropy dz", &dz, &dz_cpu, tol);
    // The drawn columns are the host's bit for bit on every device; the log-probs within
    // 1e-6 (a GPU's `log` of the same total, and at T ≠ 1 its own normaliser's sum).
    let drawn = row_draws(device);
    let drawn_cpu = row_draws(&Device::Cpu);
    let columns = |t: &Tensor| t.narrow(1, 0, 1).expect("columns");
    assert_close("drawn columns", &columns(&drawn), &columns(&drawn_cpu), 0.0);
    let logprobs = |t: &Tensor| t.narrow(1, 1, 1).expect("log-probs");
    assert_close(
        "drawn log-probs",
        &logprobs(&drawn),
        &logprobs(&drawn_cpu),
        tol.min(1e-6),
    );
    for precision in [
        Precision::Bf16 { router_f32: false },
        Precision::F16 { router_f32: false },
    ] {
        let [y, dx] = rounding(device, precision);
        let [y_cpu, dx_cpu] = rounding(&Device::Cpu, precision);
        assert_close(&format!("{precision:?} rounding"), &y, &y_cpu, 0.0);
        assert_close(
            &format!("{precision:?} rounding gradient"),
            &dx,
            &dx_cpu,
            0.0,
        );
    }
}

#[test]
fn a_second_cpu_computation_gives_the_same_bits() {
    compare(&Device::Cpu, 0.0);
}

#[cfg(feature = "cuda")]
#[test]
fn each_kernel_on_cuda_matches_the_cpu() {
    let device = r3_model::DeviceSpec::Cuda { ordinal: 0 }
        .open()
        .expect("a CUDA GPU (this test runs on the GPU machine)");
    compare(&device, 1e-4);
}

/// Casting into a tensor's own storage on the GPU (`cast16_into`: r3's narrowing kernel
/// writing into the destination, a held weight copy's rewrite) gives the CPU cast's bits,
/// for lengths with and without a tail past the kernel's four-value steps.
#[cfg(feature = "cuda")]
#[test]
fn casting_into_place_on_cuda_is_the_cpus_cast() {
    use r3_model::cast16::cast16_into;
    let device = r3_model::DeviceSpec::Cuda { ordinal: 0 }
        .open()
        .expect("a CUDA GPU (this test runs on the GPU machine)");
    for n in [4usize, 1027, 65_536 + 3] {
        let x = seeded(&[n], 9, &Device::Cpu);
        for narrow in [DType::BF16, DType::F16] {
            let dst = Var::zeros(n, narrow, &device).expect("destination");
            cast16_into(&x.to_device(&device).expect("x"), dst.as_tensor()).expect("cast into");
            let bits = |t: &Tensor| -> Vec<u32> {
                t.to_device(&Device::Cpu)
                    .and_then(|t| t.to_dtype(DType::F32))
                    .and_then(|t| t.to_vec1::<f32>())
                    .expect("values")
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            let want = x.to_dtype(narrow).expect("cpu cast");
            assert!(
                bits(dst.as_tensor()) == bits(&want),
                "{n} values, {narrow:?}"
            );
        }
    }
}

/// The routed experts' bf16 GEMMs on cuBLAS's FAST_16BF (f32 operands converted inside the
/// GEMM) against the cast path on the same GPU: values and input gradients within a bf16
/// step of the largest, the weight gradient within 1%, the value and `dx` bf16 numbers.
/// Whether FAST_16BF rounds as r3's casts do is `gemm16_modes`' question (check.sh step 7);
/// this checks the path's plumbing (operand types, pointers, passes).
#[cfg(feature = "cuda")]
#[test]
fn expert_gemms_on_fast16bf_match_the_cast_path_on_cuda() {
    use r3_model::layers::moe::expert_gemm::{expert_blocks_matmul, ExpertGemmInputs};
    use r3_model::precision::WeightGradients;
    let device = r3_model::DeviceSpec::Cuda { ordinal: 0 }
        .open()
        .expect("a CUDA GPU (this test runs on the GPU machine)");
    let experts = [0u32, 1, 2, 2, 2, 0, 3];
    let wide = WeightGradients::InWeightDtype;
    let (cap, k, n, stack) = (5, 64, 96, 4);
    let bf16 = Precision::Bf16 { router_f32: false };
    let probe = seeded(&[experts.len(), cap, n], 3, &device);
    let run_with = |inputs, held: bool| {
        let x = Var::from_tensor(&seeded(&[experts.len(), cap, k], 1, &device)).expect("x");
        let w = Var::from_tensor(&seeded(&[stack, n, k], 2, &device)).expect("w");
        let copy = held.then(|| cast16(w.as_tensor(), DType::BF16).expect("copy"));
        let y = expert_blocks_matmul(bf16, &x, &w, copy.as_ref(), &experts, inputs, wide)
            .expect("gemm");
        let grads = (&y * &probe)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
            .expect("backward");
        let dx = grads.get(&x).expect("dx").clone();
        let dw = grads.get(&w).expect("dw").clone();
        (y, dx, dw)
    };
    let run = |inputs| run_with(inputs, false);
    let (y_cast, dx_cast, dw_cast) = run(ExpertGemmInputs::Cast);
    let (y_fast, dx_fast, dw_fast) = run(ExpertGemmInputs::Fast16bf);
    // The stack's held bf16 copy (a trainer's, `Weights::hold_narrow_copies`) gives the cast
    // path's value and gradients bit for bit, whichever inputs are asked for.
    for inputs in [ExpertGemmInputs::Cast, ExpertGemmInputs::Fast16bf] {
        let (y, dx, dw) = run_with(inputs, true);
        for (name, held, cast) in [
            ("value", &y, &y_cast),
            ("dx", &dx, &dx_cast),
            ("dw", &dw, &dw_cast),
        ] {
            let (d, _) = diff_and_scale(held, cast);
            assert_eq!(d, 0.0, "{inputs} with the held copy: {name}");
        }
    }
    for (name, fast, cast, tol) in [
        ("value", &y_fast, &y_cast, 1.0 / 128.0),
        ("dx", &dx_fast, &dx_cast, 1.0 / 128.0),
        ("dw", &dw_fast, &dw_cast, 1e-2),
    ] {
        let (d, scale) = diff_and_scale(fast, cast);
        println!("fast16bf {name}: max |Δ| {d:.3e} of {scale:.3e}");
        assert!(d <= tol * scale, "{name}: {d} of {scale}");
    }
    for (name, t) in [("value", &y_fast), ("dx", &dx_fast), ("dw", &dw_fast)] {
        let rounded = cast16(&cast16(t, DType::BF16).expect("bf16"), DType::F32).expect("f32");
        let (d, _) = diff_and_scale(t, &rounded);
        assert_eq!(d, 0.0, "{name} is a bf16 number");
    }
}

/// The routed experts' stack gradient on cuBLAS in bf16 is a bf16 number, both where the
/// GEMMs write it in bf16 themselves (no overflow block) and where their f32 rounds are
/// summed and rounded once (an expert with overflow blocks); handed back narrow
/// (`WeightGradients::Narrow`) it has the same bits in bf16; it is within a bf16 step of the
/// CPU's composition (rounded operands, each block's product rounded, summed).
#[cfg(feature = "cuda")]
#[test]
fn expert_stack_gradients_on_cuda_are_bf16_numbers_in_either_dtype() {
    use r3_model::layers::moe::expert_gemm::{expert_blocks_matmul, ExpertGemmInputs};
    use r3_model::precision::WeightGradients;
    let device = r3_model::DeviceSpec::Cuda { ordinal: 0 }
        .open()
        .expect("a CUDA GPU (this test runs on the GPU machine)");
    let (cap, k, n, stack) = (5, 64, 96, 4);
    let bf16 = Precision::Bf16 { router_f32: false };
    for experts in [&[0u32, 1, 2, 2, 2, 0, 3][..], &[3, 0, 2, 1][..]] {
        let dw_on = |device: &Device, grads| {
            let x = Var::from_tensor(&seeded(&[experts.len(), cap, k], 1, device)).expect("x");
            let w = Var::from_tensor(&seeded(&[stack, n, k], 2, device)).expect("w");
            let probe = seeded(&[experts.len(), cap, n], 3, device);
            let y =
                expert_blocks_matmul(bf16, &x, &w, None, experts, ExpertGemmInputs::Cast, grads)
                    .expect("gemm");
            let g = (&y * &probe)
                .and_then(|l| l.sum_all())
                .and_then(|l| l.backward())
                .expect("backward");
            g.get(&w).expect("dw").clone()
        };
        let wide = dw_on(&device, WeightGradients::InWeightDtype);
        let narrow = dw_on(&device, WeightGradients::Narrow);
        assert_eq!(
            (wide.dtype(), narrow.dtype()),
            (DType::F32, DType::BF16),
            "{experts:?}"
        );
        assert_eq!(
            diff_and_scale(&wide, &narrow).0,
            0.0,
            "{experts:?}: narrow = wide"
        );
        let rounded = cast16(&cast16(&wide, DType::BF16).expect("bf16"), DType::F32).expect("f32");
        assert_eq!(
            diff_and_scale(&wide, &rounded).0,
            0.0,
            "{experts:?}: a bf16 number"
        );
        let (d, scale) =
            diff_and_scale(&wide, &dw_on(&Device::Cpu, WeightGradients::InWeightDtype));
        println!("stack gradient {experts:?} against the CPU: max |Δ| {d:.3e} of {scale:.3e}");
        assert!(d <= scale / 128.0, "{experts:?}: {d} of {scale}");
    }
}
