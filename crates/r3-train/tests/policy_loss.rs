//! PPO clip-higher and GSPO against hand-computed values, an independent f64 reference
//! with finite differences, and the clip edges.

use candle_core::{Device, Tensor, Var};
use r3_train::{
    gspo_loss, ppo_clip_loss, ClipRange, LossAgg, PolicyLossInput, PolicyLossMetrics, TrainError,
};
use rand::{Rng, SeedableRng};

const CLIP: ClipRange = ClipRange {
    low: 0.2,
    high: 0.28,
    dual_clip: None,
};

fn t2(rows: &[Vec<f32>]) -> Tensor {
    Tensor::new(rows.to_vec(), &Device::Cpu).expect("tensor")
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .expect("flat")
        .to_vec1::<f32>()
        .expect("vec")
}

fn close(a: f32, b: f32, tol: f32) {
    assert!((a - b).abs() <= tol, "{a} vs {b}");
}

/// Runs a loss with `logp` as a leaf variable; returns (value, metrics, d loss / d logp).
fn run(
    f: impl Fn(&PolicyLossInput) -> r3_train::Result<(Tensor, PolicyLossMetrics)>,
    logp: &[Vec<f32>],
    old: &[Vec<f32>],
    adv: &Tensor,
    mask: &[Vec<f32>],
    w: Option<&Tensor>,
) -> (f32, PolicyLossMetrics, Vec<f32>) {
    let var = Var::from_tensor(&t2(logp)).expect("var");
    let (old, mask) = (t2(old), t2(mask));
    let input = PolicyLossInput {
        logp: var.as_tensor(),
        old_logp: &old,
        advantages: adv,
        mask: &mask,
        is_weights: w,
    };
    let (loss, m) = f(&input).expect("loss");
    let grads = loss.backward().expect("backward");
    let g = grads
        .get(var.as_tensor())
        .map(vals)
        .unwrap_or_else(|| vec![0.0; logp.len() * logp[0].len()]);
    (loss.to_scalar::<f32>().expect("scalar"), m, g)
}

#[test]
fn ppo_by_hand_both_clip_edges() {
    // ratio r = exp(logp - old); eps_low 0.2, eps_high 0.28; A per token.
    //  t0: r=1.0 A=+1: max(-1, -1)         = -1     unclipped, dL/dlogp = -A·r = -1
    //  t1: r=1.5 A=+1: max(-1.5, -1.28)    = -1.28  clipped high, grad 0
    //  t2: r=0.5 A=-1: max(0.5, 0.8)       =  0.8   clipped low, grad 0
    //  t3: r=1.1 A=-1: max(1.1, 1.1)       =  1.1   unclipped, grad +1.1
    //  t4: r=1.5 A=-1: max(1.5, 1.28)      =  1.5   unclipped (pessimistic), grad +1.5
    //  t5: r=0.5 A=+1: max(-0.5, -0.8)     = -0.5   unclipped (pessimistic), grad -0.5
    //  t6: masked out (huge ratio), contributes nothing.
    // token-mean = (-1 - 1.28 + 0.8 + 1.1 + 1.5 - 0.5) / 6 = 0.62 / 6 = 0.103333
    let r = [1.0f32, 1.5, 0.5, 1.1, 1.5, 0.5, 50.0];
    let old = vec![vec![-1.0f32; 7]];
    let logp = vec![r.iter().map(|x| x.ln() - 1.0).collect::<Vec<_>>()];
    let adv = t2(&[vec![1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0]]);
    let mask = vec![vec![1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]];
    let f = |i: &PolicyLossInput| ppo_clip_loss(i, CLIP, LossAgg::TokenMean);
    let (loss, m, g) = run(f, &logp, &old, &adv, &mask, None);
    close(loss, 0.62 / 6.0, 1e-5);
    close(m.pg_loss, loss, 0.0);
    close(m.clip_frac, 2.0 / 6.0, 1e-6);
    close(m.clip_frac_low, 1.0 / 6.0, 1e-6);
    close(m.clip_frac_high, 1.0 / 6.0, 1e-6);
    // k1 = mean(old - new) = -(2 ln1.5 + 2 ln0.5 + ln1.1)/6 = 0.0800078
    close(m.ppo_kl, 0.0800078, 1e-5);
    // k3 = mean(r - 1 - ln r) = (0 + 2·0.0945349 + 2·0.1931472 + 0.0046898)/6 = 0.0966757
    close(m.ppo_kl_k3, 0.0966757, 1e-5);
    let want = [-1.0, 0.0, 0.0, 1.1, 1.5, -0.5, 0.0].map(|x| x / 6.0);
    for (a, b) in g.iter().zip(want) {
        close(*a, b, 1e-5);
    }
}

#[test]
fn clip_gradient_switches_off_exactly_past_each_edge() {
    let old = vec![vec![0.0f32]];
    let mask = vec![vec![1.0f32]];
    let f = |i: &PolicyLossInput| ppo_clip_loss(i, CLIP, LossAgg::TokenMean);
    let grad = |ratio: f32, a: f32| {
        let adv = t2(&[vec![a]]);
        run(f, &[vec![ratio.ln()]], &old, &adv, &mask, None).2[0]
    };
    // High edge (A > 0) at 1.28.
    close(grad(1.279, 1.0), -1.279, 1e-5);
    assert_eq!(grad(1.281, 1.0), 0.0);
    // Low edge (A < 0) at 0.8.
    close(grad(0.801, -1.0), 0.801, 1e-5);
    assert_eq!(grad(0.799, -1.0), 0.0);
    // The other side of each edge never clips (pessimistic bound).
    close(grad(0.5, 1.0), -0.5, 1e-5);
    close(grad(2.0, -1.0), 2.0, 1e-5);
}

/// Independent f64 PPO loss (token-mean) for finite differences.
fn ppo_ref(logp: &[f64], old: &[f64], adv: &[f64], mask: &[f64], lo: f64, hi: f64) -> f64 {
    let mut sum = 0.0;
    for i in 0..logp.len() {
        let r = (logp[i] - old[i]).exp();
        let l = (-adv[i] * r).max(-adv[i] * r.clamp(1.0 - lo, 1.0 + hi));
        sum += l * mask[i];
    }
    sum / mask.iter().sum::<f64>()
}

#[test]
fn ppo_matches_reference_and_finite_differences() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(42);
    let (b, t) = (3, 5);
    let mut logp = vec![vec![0f32; t]; b];
    let mut old = vec![vec![0f32; t]; b];
    let mut adv = vec![0f32; b];
    let mut mask = vec![vec![0f32; t]; b];
    for i in 0..b {
        adv[i] = rng.random_range(-1.5..1.5);
        let len = rng.random_range(2..=t);
        for j in 0..t {
            old[i][j] = rng.random_range(-3.0..-0.1);
            // Ratios in [0.6, 1.5], nudged 0.01 away from the edges so differences are smooth.
            let mut r: f32 = rng.random_range(0.6..1.5);
            for edge in [0.8f32, 1.28] {
                if (r - edge).abs() < 0.01 {
                    r = edge + 0.02;
                }
            }
            logp[i][j] = old[i][j] + r.ln();
            mask[i][j] = f32::from(u8::from(j < len));
        }
    }
    let adv_t = Tensor::new(adv.clone(), &Device::Cpu).expect("adv");
    let f = |i: &PolicyLossInput| ppo_clip_loss(i, CLIP, LossAgg::TokenMean);
    let (loss, _, g) = run(f, &logp, &old, &adv_t, &mask, None);
    let flat = |v: &[Vec<f32>]| {
        v.iter()
            .flatten()
            .map(|&x| f64::from(x))
            .collect::<Vec<_>>()
    };
    let (lp, od, mk) = (flat(&logp), flat(&old), flat(&mask));
    let ad: Vec<f64> = (0..b * t).map(|k| f64::from(adv[k / t])).collect();
    let reference = |lp: &[f64]| ppo_ref(lp, &od, &ad, &mk, 0.2, 0.28);
    close(loss, reference(&lp) as f32, 1e-5);
    let h = 1e-6;
    for k in 0..b * t {
        let (mut up, mut dn) = (lp.clone(), lp.clone());
        up[k] += h;
        dn[k] -= h;
        let fd = (reference(&up) - reference(&dn)) / (2.0 * h);
        close(g[k], fd as f32, 1e-4);
    }
}

#[test]
fn seq_mean_aggregations_by_hand() {
    // r = 1 everywhere, so the per-token loss is -A. Row 0: A=1, 3 tokens; row 1: A=-2,
    // 1 token; row 2: no tokens (left out of the sequence mean).
    let old = vec![vec![0.0f32; 3]; 3];
    let adv = Tensor::new(&[1.0f32, -2.0, 5.0], &Device::Cpu).expect("adv");
    let mask = vec![
        vec![1.0, 1.0, 1.0],
        vec![1.0, 0.0, 0.0],
        vec![0.0, 0.0, 0.0],
    ];
    let loss = |agg| {
        let f = move |i: &PolicyLossInput| ppo_clip_loss(i, CLIP, agg);
        run(f, &old, &old, &adv, &mask, None).0
    };
    // token-mean: (-1·3 + 2) / 4 = -0.25
    close(loss(LossAgg::TokenMean), -0.25, 1e-6);
    // seq-mean-token-mean: (-1 + 2) / 2 = 0.5
    close(loss(LossAgg::SeqMeanTokenMean), 0.5, 1e-6);
    // seq-mean-token-sum: (-3 + 2) / 2 = -0.5
    close(loss(LossAgg::SeqMeanTokenSum), -0.5, 1e-6);
}

#[test]
fn is_weights_scale_per_token_losses() {
    // r = 1: per-token loss -A = [-1, -1]; weights [2, 0.5] → (-2 - 0.5)/2 = -1.25.
    let old = vec![vec![0.0f32, 0.0]];
    let adv = Tensor::new(&[1.0f32], &Device::Cpu).expect("adv");
    let w = t2(&[vec![2.0, 0.5]]);
    let f = |i: &PolicyLossInput| ppo_clip_loss(i, CLIP, LossAgg::TokenMean);
    let (loss, _, g) = run(f, &old, &old, &adv, &[vec![1.0, 1.0]], Some(&w));
    close(loss, -1.25, 1e-6);
    close(g[0], -1.0, 1e-6); // -A·r·w / 2
    close(g[1], -0.25, 1e-6);
}

#[test]
fn gspo_sequence_ratio_by_hand() {
    // seq-mean-token-mean over 3 rows, clip [1 - 3e-4, 1 + 4e-4] = [0.9997, 1.0004].
    // Row 0: log ratios [0.1, 0.3] → s = exp(0.2) = 1.221403, A = +1: clipped at 1.0004
    //   → per-token loss -1.0004, no gradient.
    // Row 1: log ratios [1e-4, -1e-4] → s = 1, A = -1 → per-token loss +1, unclipped;
    //   grad per token = -A·s / |y| / rows = 1 / 2 / 3 = 1/6.
    // Row 2: token 0 masked out; log ratio -0.2 → s = exp(-0.2) = 0.818731, A = +1:
    //   max(-0.818731, -0.9997) = -0.818731, unclipped; grad = -A·s / 1 / 3.
    // Loss = (-1.0004 + 1 - 0.818731) / 3.
    let old = vec![vec![-1.0f32, -2.0], vec![-1.0, -1.0], vec![-1.0, -1.0]];
    let logp = vec![
        vec![-0.9f32, -1.7],
        vec![-1.0 + 1e-4, -1.0 - 1e-4],
        vec![-1.5, -1.2],
    ];
    let mask = vec![vec![1.0, 1.0], vec![1.0, 1.0], vec![0.0, 1.0]];
    let adv = Tensor::new(&[1.0f32, -1.0, 1.0], &Device::Cpu).expect("adv");
    let clip = ClipRange {
        low: 3e-4,
        high: 4e-4,
        dual_clip: None,
    };
    let (loss, m, g) = run(|i| gspo_loss(i, clip), &logp, &old, &adv, &mask, None);
    close(loss, (-1.0004 + 1.0 - 0.818731) / 3.0, 2e-5);
    assert_eq!((g[0], g[1]), (0.0, 0.0));
    close(g[2], 1.0 / 6.0, 1e-4);
    close(g[3], 1.0 / 6.0, 1e-4);
    assert_eq!(g[4], 0.0, "masked token");
    close(g[5], -0.818731 / 3.0, 1e-5);
    close(m.clip_frac, 2.0 / 5.0, 1e-6); // row 0's two tokens of 5 response tokens
    close(m.clip_frac_high, 2.0 / 5.0, 1e-6);
}

#[test]
fn gspo_gradient_equals_sequence_level_objective() {
    // With a wide clip, GSPO's token form must have the gradient of the sequence form
    // L = mean_i(-A_i · exp(mean_t(logp - old))), computed here in f64 by differences.
    let old = vec![vec![-1.0f32, -2.0, -0.5], vec![-0.3, -1.1, -2.2]];
    let logp = vec![vec![-0.8f32, -2.1, -0.45], vec![-0.35, -1.0, -2.0]];
    let mask = vec![vec![1.0f32, 1.0, 1.0], vec![1.0, 1.0, 0.0]];
    let adv = [0.7f64, -1.3];
    let adv_t = Tensor::new(&[0.7f32, -1.3], &Device::Cpu).expect("adv");
    let wide = ClipRange {
        low: 0.9,
        high: 10.0,
        dual_clip: None,
    };
    let (loss, _, g) = run(|i| gspo_loss(i, wide), &logp, &old, &adv_t, &mask, None);
    let seq_obj = |lp: &[Vec<f64>]| {
        let mut total = 0.0;
        for i in 0..2 {
            let n: f64 = mask[i].iter().map(|&m| f64::from(m)).sum();
            let mean: f64 = (0..3)
                .map(|j| f64::from(mask[i][j]) * (lp[i][j] - f64::from(old[i][j])))
                .sum::<f64>()
                / n;
            total += -adv[i] * mean.exp();
        }
        total / 2.0
    };
    let lp64: Vec<Vec<f64>> = logp
        .iter()
        .map(|r| r.iter().map(|&x| f64::from(x)).collect())
        .collect();
    close(loss, seq_obj(&lp64) as f32, 1e-5);
    for i in 0..2 {
        for j in 0..3 {
            let (mut up, mut dn) = (lp64.clone(), lp64.clone());
            up[i][j] += 1e-6;
            dn[i][j] -= 1e-6;
            let fd = (seq_obj(&up) - seq_obj(&dn)) / 2e-6;
            close(g[i * 3 + j], fd as f32, 1e-4);
        }
    }
}

/// verl's clip-higher range with dual-clip `c = 3` (`clip_ratio_c`).
const DUAL: ClipRange = ClipRange {
    low: 0.2,
    high: 0.27,
    dual_clip: Some(3.0),
};

#[test]
fn dual_clip_caps_a_negative_advantage_loss_and_its_gradient() {
    // One token, ratio 4 (logp − old = ln 4), A = −1, ε = (0.2, 0.27):
    //   without dual-clip: max(−A·4, −A·1.27) = 4, d loss / d logp = −A·r = 4;
    //   with c = 3 (verl): min(4, −A·3) = 3, gradient 0.
    let old = vec![vec![-2.0f32]];
    let logp = vec![vec![4f32.ln() - 2.0]];
    let adv = t2(&[vec![-1.0]]);
    let mask = vec![vec![1.0]];
    let plain = ClipRange {
        dual_clip: None,
        ..DUAL
    };
    let (loss, m, g) = run(
        |i| ppo_clip_loss(i, plain, LossAgg::TokenMean),
        &logp,
        &old,
        &adv,
        &mask,
        None,
    );
    close(loss, 4.0, 1e-5);
    close(g[0], 4.0, 1e-5);
    assert_eq!(m.dual_clip_frac, 0.0);
    let (loss, m, g) = run(
        |i| ppo_clip_loss(i, DUAL, LossAgg::TokenMean),
        &logp,
        &old,
        &adv,
        &mask,
        None,
    );
    close(loss, 3.0, 1e-6);
    assert_eq!(g[0], 0.0, "a dual-clipped token has no gradient");
    close(m.dual_clip_frac, 1.0, 0.0);

    // Several tokens, token-mean over 4 (t4 masked out):
    //  t0: r=4   A=−1: min(max(4, 1.27), 3)   = 3      dual-clipped, grad 0
    //  t1: r=2   A=−1: min(max(2, 1.27), 3)   = 2      under the cap, grad −A·r = 2
    //  t2: r=4   A=+1: max(−4, −1.27)         = −1.27  clipped high (no cap for A > 0), grad 0
    //  t3: r=0.5 A=−1: min(max(0.5, 0.8), 3)  = 0.8    clipped low, grad 0
    //  t4: r=9   A=−1: masked out.
    // loss = (3 + 2 − 1.27 + 0.8) / 4 = 1.1325; gradient [0, 2/4, 0, 0, 0].
    let r = [4.0f32, 2.0, 4.0, 0.5, 9.0];
    let old = vec![vec![-1.0f32; 5]];
    let logp = vec![r.iter().map(|x| x.ln() - 1.0).collect::<Vec<_>>()];
    let adv = t2(&[vec![-1.0, -1.0, 1.0, -1.0, -1.0]]);
    let mask = vec![vec![1.0, 1.0, 1.0, 1.0, 0.0]];
    let (loss, m, g) = run(
        |i| ppo_clip_loss(i, DUAL, LossAgg::TokenMean),
        &logp,
        &old,
        &adv,
        &mask,
        None,
    );
    close(loss, 4.53 / 4.0, 1e-5);
    close(m.pg_loss, loss, 0.0);
    assert_eq!((g[0], g[2], g[3], g[4]), (0.0, 0.0, 0.0, 0.0));
    close(g[1], 0.5, 1e-6);
    close(m.dual_clip_frac, 0.25, 0.0);
    // The ratio clip counts as verl's pg_clipfrac, dual-clip or not: t2 and t3.
    close(m.clip_frac, 0.5, 0.0);

    // c must be > 1: below, the cap would undercut the clipped branch itself.
    for c in [1.0, 0.5, f64::NAN] {
        let bad = ClipRange {
            dual_clip: Some(c),
            ..DUAL
        };
        let var = t2(&logp);
        let (old, mask) = (t2(&old), t2(&mask));
        let input = PolicyLossInput {
            logp: &var,
            old_logp: &old,
            advantages: &adv,
            mask: &mask,
            is_weights: None,
        };
        assert!(matches!(
            ppo_clip_loss(&input, bad, LossAgg::TokenMean),
            Err(TrainError::OutOfRange { value, .. }) if value == c || c.is_nan()
        ));
    }
}

#[test]
fn gspo_log_ratio_clamp_cuts_the_gradient_above_ten() {
    // One row, two response tokens, A = −1, GSPO's ε. Mean log-ratio d:
    //   d = 11 > 10: s = e^10 (clamped), loss = −A·s = e^10 (clip(s) is far below), and, as
    //     verl's torch.clamp(max=10) of the whole sum, no gradient;
    //   d = 9: s = e^9, loss e^9, gradient per token −A·s / 2 tokens (seq-mean-token-mean).
    let clip = ClipRange {
        low: 3e-4,
        high: 4e-4,
        dual_clip: None,
    };
    let adv = Tensor::new(&[-1.0f32], &Device::Cpu).expect("adv");
    let mask = vec![vec![1.0f32, 1.0]];
    for (d, grad) in [(11.0f32, 0.0f64), (9.0, 9f64.exp() / 2.0)] {
        let old = vec![vec![-12.0f32, -13.0]];
        let logp = vec![vec![-12.0 + d, -13.0 + d]];
        let (loss, _, g) = run(|i| gspo_loss(i, clip), &logp, &old, &adv, &mask, None);
        let value = f64::from(d.min(10.0)).exp();
        close(loss, value as f32, value as f32 * 1e-6);
        for gt in g {
            close(gt, grad as f32, grad as f32 * 1e-6);
        }
    }
}

#[test]
fn bad_shapes_and_clip_ranges_are_errors() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 3), candle_core::DType::F32, &dev).expect("x");
    let short = Tensor::zeros((2, 2), candle_core::DType::F32, &dev).expect("s");
    let adv = Tensor::zeros(3, candle_core::DType::F32, &dev).expect("adv");
    let input = |old, advantages| PolicyLossInput {
        logp: &x,
        old_logp: old,
        advantages,
        mask: &x,
        is_weights: None,
    };
    let adv2 = Tensor::zeros(2, candle_core::DType::F32, &dev).expect("adv");
    assert!(matches!(
        ppo_clip_loss(&input(&short, &adv2), CLIP, LossAgg::TokenMean),
        Err(TrainError::Shape { .. })
    ));
    assert!(matches!(
        ppo_clip_loss(&input(&x, &adv), CLIP, LossAgg::TokenMean),
        Err(TrainError::Shape { .. })
    ));
    let bad = ClipRange {
        low: 1.0,
        high: 0.2,
        dual_clip: None,
    };
    assert!(matches!(
        ppo_clip_loss(&input(&x, &adv2), bad, LossAgg::TokenMean),
        Err(TrainError::ClipRange { .. })
    ));
}
