//! `r3 bench train --parts`: where a training step's time goes, part by part. Each part of
//! the model (embedding, one decoder layer's attention, one MoE layer's routing, the whole
//! MoE layer, the head with its token log-probs) runs alone on the benchmark's shapes,
//! forward and backward each bracketed by a device synchronisation, and the parts scaled by
//! their count in the model are set beside the measured whole step. On a GPU this names the
//! part that costs what the step's FLOPs do not explain, without a profiler.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use r3_model::layers::attention::mla::MlaAttention;
use r3_model::layers::attention::rope::{Rope, RopeTables};
use r3_model::layers::attention::{AttentionMask, GqaAttention};
use r3_model::layers::linear::Linear;
use r3_model::layers::moe::{MoeBlock, RoutedRows};
use r3_model::layers::norm::RmsNorm;
use r3_model::spec::{attention_prefix, input_norm, post_attention_norm, weight, EMBED, LM_HEAD};
use r3_model::{AttentionConfig, Config, Precision, Weights};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::matmul_work;
use super::step_phases::median;

/// What the parts are timed on.
pub(super) struct PartsSetup<'a> {
    /// The benchmark's model config.
    pub cfg: &'a Config,
    /// Its trainable weights (variables: the backward computes every weight's gradient).
    pub weights: &'a Weights,
    /// The forward's precision.
    pub precision: Precision,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Timed repetitions per part (after one untimed).
    pub reps: usize,
    /// Seed of the inputs.
    pub seed: u64,
}

/// One part's median forward and backward seconds, how often the model runs it, and its
/// forward matrix FLOPs (the backward's are twice those).
struct PartTime {
    name: &'static str,
    count: usize,
    forward: f64,
    backward: f64,
    flops: f64,
}

impl PartTime {
    /// Forward + backward matrix FLOPs per second.
    fn flop_rate(&self) -> f64 {
        3.0 * self.flops / (self.forward + self.backward).max(f64::MIN_POSITIVE)
    }
}

/// Forward matrix FLOPs of the parts on `b` sequences of `t` tokens (attention over all `t`
/// positions, as the dense mask computes it; router; the first MoE layer `moe_layer`'s
/// block; head), from `matmul_work`'s per-token counts.
fn part_flops(cfg: &Config, b: usize, t: usize, moe_layer: usize) -> anyhow::Result<[f64; 4]> {
    let rows = (b * t) as f64;
    let attention = matmul_work::attention_macs(cfg, t);
    Ok([
        attention,
        matmul_work::router_macs(cfg),
        matmul_work::ffn_macs(cfg, moe_layer),
        matmul_work::head_macs(cfg),
    ]
    .map(|macs| 2.0 * rows * macs))
}

/// The attention layer a part times: GQA or MLA, as the config has it.
enum PartAttention {
    Gqa(GqaAttention),
    Mla(MlaAttention),
}

impl PartAttention {
    /// Layer `prefix`'s attention at precision `p`.
    fn new(cfg: &Config, w: &Weights, prefix: &str, p: Precision) -> anyhow::Result<Self> {
        Ok(match cfg.attention {
            AttentionConfig::Gqa { .. } => {
                let mut a = GqaAttention::new(cfg, w, prefix)?;
                a.set_precision(p);
                PartAttention::Gqa(a)
            }
            AttentionConfig::Mla { .. } => {
                let mut a = MlaAttention::new(cfg, w, prefix)?;
                a.set_precision(p);
                PartAttention::Mla(a)
            }
        })
    }

    /// `[B, T, H]` → `[B, T, H]`.
    fn forward(
        &self,
        x: &Tensor,
        rope: &RopeTables,
        mask: &AttentionMask,
    ) -> anyhow::Result<Tensor> {
        Ok(match self {
            PartAttention::Gqa(a) => a.forward(x, rope, mask)?,
            PartAttention::Mla(a) => a.forward(x, rope, mask)?,
        })
    }
}

/// Times `forward` (returning a scalar loss) and its backward, each synchronised.
fn time_part(
    device: &Device,
    reps: usize,
    forward: impl Fn() -> anyhow::Result<Tensor>,
) -> anyhow::Result<(f64, f64)> {
    let (mut f, mut b) = (Vec::new(), Vec::new());
    for rep in 0..reps + 1 {
        device.synchronize()?;
        let t0 = Instant::now();
        let loss = forward()?;
        device.synchronize()?;
        let t1 = Instant::now();
        let grads = loss.backward()?;
        device.synchronize()?;
        let t2 = Instant::now();
        drop(grads);
        if rep > 0 {
            f.push((t1 - t0).as_secs_f64());
            b.push((t2 - t1).as_secs_f64());
        }
    }
    Ok((median(&f), median(&b)))
}

/// A scalar that depends on every element of `t` with a non-uniform gradient.
fn probe_loss(t: &Tensor, probe: &Tensor) -> anyhow::Result<Tensor> {
    Ok(t.to_dtype(DType::F32)?.broadcast_mul(probe)?.sum_all()?)
}

/// Runs every part and prints the table; `step_seconds` is the measured whole step
/// (forward + backward) the parts are set beside.
pub(super) fn run(setup: &PartsSetup<'_>, step_seconds: f64) -> anyhow::Result<()> {
    let cfg = setup.cfg;
    let p = setup.precision;
    let w = setup.weights;
    let (b, t, h) = (setup.batch, setup.seq_len, cfg.hidden_size);
    let embed = w.get(&weight(EMBED))?.clone();
    let device = embed.device().clone();
    let reps = setup.reps.max(1);
    let layers = cfg.num_hidden_layers;
    let moe_layers = cfg.layout.moe_layers().len();
    let first_moe = *cfg
        .layout
        .moe_layers()
        .first()
        .ok_or_else(|| anyhow::anyhow!("--parts needs a MoE layer"))?;

    let mut rng = ChaCha8Rng::seed_from_u64(setup.seed ^ 0x7061_7274);
    let mut uniform =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1f32..1.0)).collect() };
    // A variable, so each part's backward also computes its input's gradient, as every
    // layer's does inside the model.
    let x =
        Var::from_tensor(&p.round(&Tensor::from_vec(uniform(b * t * h), (b, t, h), &device)?)?)?;
    let x = x.as_tensor();
    let probe_bth = Tensor::from_vec(uniform(b * t * h), (b, t, h), &device)?;
    let probe_rows = probe_bth.reshape((b * t, h))?;
    let ids: Vec<u32> = (0..b * t)
        .map(|i| ((i as u64 * 2_654_435_761 + setup.seed) % cfg.vocab_size as u64) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, b * t, &device)?;
    let targets = ids.reshape((b, t))?;
    let lengths = vec![t; b];
    let window = match cfg.attention {
        AttentionConfig::Gqa { sliding_window, .. } => sliding_window,
        AttentionConfig::Mla { .. } => None,
    };
    let mask = AttentionMask::new(&lengths, t, window, &device)?.to_dtype(DType::F32)?;
    let rope = Rope::new(&cfg.rope).tables(t, &device, DType::F32)?;
    let rows_host: Vec<u32> = (0..(b * t) as u32).collect();
    let rows = RoutedRows {
        host: rows_host,
        all: true,
    };

    let flops = part_flops(cfg, b, t, first_moe)?;
    let mut parts = Vec::new();
    let (f, bw) = time_part(&device, reps, || {
        let e = p.round(&embed.index_select(&ids, 0)?.reshape((b, t, h))?)?;
        probe_loss(&e, &probe_bth)
    })?;
    parts.push(PartTime {
        name: "embedding",
        count: 1,
        forward: f,
        backward: bw,
        flops: 0.0,
    });

    let norm = |name: &str| -> anyhow::Result<RmsNorm> {
        let mut n = RmsNorm::new(w, name, cfg.rms_norm_eps)?;
        n.set_precision(p);
        Ok(n)
    };
    let in_norm = norm(&input_norm(first_moe))?;
    let attention = PartAttention::new(cfg, w, &attention_prefix(first_moe), p)?;
    let (f, bw) = time_part(&device, reps, || {
        let out = attention.forward(&in_norm.forward(x)?, &rope, &mask)?;
        probe_loss(&out, &probe_bth)
    })?;
    parts.push(PartTime {
        name: "norm + attention",
        count: layers,
        forward: f,
        backward: bw,
        flops: flops[0],
    });

    let post_norm = norm(&post_attention_norm(first_moe))?;
    let mut block = MoeBlock::new(cfg, w, first_moe)?;
    block.set_precision(p);
    let x_rows = x.reshape((b * t, h))?;
    let (f, bw) = time_part(&device, reps, || {
        let logits = block.router_logits(&post_norm.forward(&x_rows)?)?;
        let host = logits
            .detach()
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        let chosen = block.router().select_rows(&host, None)?;
        let k = cfg.top_k();
        let chosen = Tensor::from_vec(chosen, (b * t, k), &device)?;
        let gates = block.router().weigh(&logits, &chosen)?;
        Ok(gates.sum_all()?)
    })?;
    parts.push(PartTime {
        name: "norm + router (logits, host top-k, gates)",
        count: moe_layers,
        forward: f,
        backward: bw,
        flops: flops[1],
    });
    let (f, bw) = time_part(&device, reps, || {
        let out = block.forward_native(&post_norm.forward(&x_rows)?, &rows)?;
        probe_loss(&out.output, &probe_rows)
    })?;
    parts.push(PartTime {
        name: "norm + MoE block (router + experts)",
        count: moe_layers,
        forward: f,
        backward: bw,
        flops: flops[2],
    });

    let final_norm = norm(r3_model::spec::FINAL_NORM)?;
    let head_name = if cfg.tie_word_embeddings {
        EMBED
    } else {
        LM_HEAD
    };
    let mut head = Linear::new(w, head_name, false)?;
    head.set_precision(p);
    let (f, bw) = time_part(&device, reps, || {
        let logits = head.forward(&final_norm.forward(x)?)?;
        let logp = r3_model::token_stats::token_log_probs(&logits, &targets)?;
        Ok(logp.neg()?.mean_all()?)
    })?;
    parts.push(PartTime {
        name: "final norm + head + token log-probs",
        count: 1,
        forward: f,
        backward: bw,
        flops: flops[3],
    });

    println!(
        "parts, each alone (median of {reps}; forward and backward each synchronised), scaled by their count in the model:"
    );
    println!(
        "{:<44} {:>5} {:>10} {:>10} {:>12} {:>7} {:>10}",
        "part", "count", "fwd ms", "bwd ms", "× count ms", "share", "TFLOP/s"
    );
    let scaled = |p: &PartTime| (p.forward + p.backward) * p.count as f64;
    // The router is inside the MoE block: it is shown, but not added twice.
    let total: f64 = parts
        .iter()
        .filter(|p| !p.name.contains("router ("))
        .map(scaled)
        .sum();
    for part in &parts {
        println!(
            "{:<44} {:>5} {:>10.3} {:>10.3} {:>12.2} {:>6.1}% {:>10.3}",
            part.name,
            part.count,
            part.forward * 1e3,
            part.backward * 1e3,
            scaled(part) * 1e3,
            scaled(part) / total.max(f64::MIN_POSITIVE) * 100.0,
            part.flop_rate() / 1e12
        );
    }
    println!(
        "sum of parts {:.2} ms (router counted inside the MoE block), whole step {:.2} ms: parts explain {:.0}% of the step",
        total * 1e3,
        step_seconds * 1e3,
        total / step_seconds.max(f64::MIN_POSITIVE) * 100.0
    );
    Ok(())
}
