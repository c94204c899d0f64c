//! `r3 bench train`: training-engine forward + backward throughput (tokens/s) on the
//! documented mid-size MoE config with seeded random weights (or a model directory's own
//! weights), Native against Replay routing.
//!
//! Reference point: HF transformers (PyTorch, CPU, 2 threads) trains this config at about
//! 320 tokens/s on the project machine.

use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Tensor, Var};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use r3_model::cast16::cast16_into;
use r3_model::layers::moe::expert_gemm::ExpertGemmInputs;
use r3_model::layers::moe::padded_experts::PaddedExpertOps;
use r3_model::narrow_grads::backward_narrowing;
use r3_model::precision::WeightGradients;
use r3_model::{
    presets, Batch, Config, DeviceSpec, HeadPositions, Model, Precision, RandomInit, ReplayRoutes,
    Routing, ScoreTargets, Weights,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::cpu_time::{cpu_seconds, process_cpu_ns};
use super::matmul_work::{f32_gemm_peak, machine_threads};
use super::step_phases::training_forward_flops;

/// The model `r3 bench train` trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchModel {
    /// The documented mid-size config (240.5 M parameters).
    Mid,
    /// Qwen3-30B-A3B's layer shape with 8 layers (5.6 B parameters; a GPU's size).
    #[value(name = "a3b-8l")]
    A3b8l,
}

/// Options of `r3 bench train`.
#[derive(Debug, Args)]
pub struct BenchTrainArgs {
    /// Which model: `mid`, or `a3b-8l` (Qwen3-30B-A3B's layer shape, 8 layers). On a GPU the
    /// weights are drawn by the GPU's own seeded generator (minutes faster at 5.6 B).
    #[arg(long, value_enum, default_value = "mid")]
    pub config: BenchModel,
    /// Train this HF model directory (`config.json` + safetensors, e.g. `models/gsm8k-moe`)
    /// with its own weights instead of `--config`'s random ones.
    #[arg(long, conflicts_with = "config")]
    pub model_dir: Option<std::path::PathBuf>,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    /// Timed steps per routing mode (modes alternate step by step).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Untimed warm-up steps per mode.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Seed of weights and tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where the model trains: `cpu`, `cuda` or `cuda:N` (a build with the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// Forward precision: `f32`, or `bf16` (bf16 matmuls and activations, f32 master weights).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub dtype: String,
    /// Then time each part of the model alone (embedding, attention, router, MoE block,
    /// head), forward and backward synchronised, beside the whole step.
    #[arg(long)]
    pub parts: bool,
    /// Open CUDA's profiler capture range around the first timed Native step only (for
    /// `ncu --profile-from-start off`: one step's kernels, none of the weights' drawing).
    #[arg(long)]
    pub profile_step: bool,
    /// How the routed experts' bf16 GEMMs take their f32 operands on a GPU: `cast` (r3's
    /// cast kernels first, round to nearest even) or `fast16bf` (cuBLAS's
    /// `CUBLAS_COMPUTE_32F_FAST_16BF` converting them itself: no cast passes; its rounding is
    /// what `check.sh --steps 7` checks).
    #[arg(long, default_value = "cast")]
    pub expert_gemm: ExpertGemmInputs,
    /// How a GPU runs the routed experts' padded layout in the differentiated forward:
    /// `fused` (two ops holding their intermediates in the GEMMs' dtype) or `per-step` (one
    /// op per step, the graph keeping each step's f32 input: the memory before the fused
    /// ops, for a before-and-after in one call). The same bits either way.
    #[arg(long, default_value = "fused")]
    pub padded_expert_ops: PaddedExpertOps,
    /// In bf16: hold a bf16 copy of every weight matrix beside its f32 master, read by the
    /// matmuls instead of a cast per use, and rewrite the copies once per step in a pass of
    /// their own (timed beside the step, outside its tokens/s: a trainer's AdamW pass writes
    /// them on a GPU, and the optimiser is not what this bench times): `auto` (on a GPU),
    /// `on` or `off` (`train.narrow_weight_copies`).
    #[arg(long, default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub narrow_copies: String,
    /// Activation checkpointing (`algo.gradient_checkpointing`): the forward keeps only each
    /// decoder layer's input, the backward runs every layer again before differentiating it
    /// (the same gradients; one more forward's work, counted in the backward's time). On the
    /// CPU the steps' resident-memory high-water mark is printed either way, to compare.
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Selective recomputation (`algo.selective_recompute`): each GQA layer's q and k heads
    /// (per-head norm, rotation, rounding) run again in the backward, the graph keeping the
    /// projections' outputs alone (the same gradients; counted in the backward's time).
    #[arg(long)]
    pub selective_recompute: bool,
    /// MiB of f32 scores one attention product may hold on a GPU
    /// (`algo.attention_tile_mib`): past it the query rows are attended in blocks, forward
    /// and backward; 0: one product a layer.
    #[arg(long, default_value_t = r3_train::config::DEFAULT_ATTENTION_TILE_MIB)]
    pub attention_tile_mib: usize,
    /// In bf16 (`--dtype bf16`): each weight's gradient kept in bf16 from the moment the
    /// backward completes it, where bf16 holds it exactly (`train.narrow_gradients`; the same
    /// gradients, 2 bytes a parameter instead of 4)
    #[arg(long)]
    pub narrow_gradients: bool,
    /// Score the head this many tokens at a time without keeping the logits
    /// (`algo.head_chunk_tokens`: the norm, head and token log-probs run chunk by chunk and
    /// again in the backward; one more forward of the head). 0 (default): the logits kept.
    #[arg(long, default_value_t = 0)]
    pub head_chunk_tokens: usize,
    /// The dtype the weight matrices are held in (`train.master_weights`): `f32` (f32
    /// master weights) or, with `--dtype bf16`, `bf16`: the embedding and every matrix the
    /// forward rounds held in bf16 with no f32 copy (the projections, experts, router and
    /// head; norm scales stay f32), their gradients bf16 — the precision scheme of a model
    /// trained purely in bf16, as `peer_hf.py --dtype bf16` holds HF's.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub master_weights: String,
}

/// One timed step: forward and backward wall seconds, the process's CPU seconds over both
/// (None where not measurable), and the forward's own timing of the host work its routing
/// mode adds over Native.
#[derive(Debug, Clone, Copy)]
struct StepTime {
    forward: f64,
    backward: f64,
    /// Rewriting the held 16-bit weight copies from the masters (0 without copies).
    refresh: f64,
    cpu: Option<f64>,
    routing_overhead: f64,
    /// The forward's MoE layers that waited for the device, and the host's time in them.
    waits: r3_model::RoutingWaits,
    /// What the variables' gradients held at the backward's end.
    gradients: GradientBytes,
}

/// The variables' gradients at a backward's end: their bytes, and how many were kept in 16
/// bits (`r3_model::narrow_grads`, with gradient checkpointing in a 16-bit precision).
#[derive(Debug, Clone, Copy, Default)]
struct GradientBytes {
    bytes: usize,
    tensors: usize,
    narrow: usize,
}

impl GradientBytes {
    /// Counts the gradients `grads` holds for `vars`.
    fn of(grads: &candle_core::backprop::GradStore, vars: &[Var]) -> Self {
        vars.iter()
            .filter_map(|v| grads.get(v.as_tensor()))
            .fold(Self::default(), |acc, g| GradientBytes {
                bytes: acc.bytes + g.elem_count() * g.dtype().size_in_bytes(),
                tensors: acc.tensors + 1,
                narrow: acc.narrow + usize::from(matches!(g.dtype(), DType::BF16 | DType::F16)),
            })
    }
}

impl StepTime {
    /// The step's wall seconds: forward and backward (the copies' refresh, optimiser work,
    /// is timed apart).
    fn wall(&self) -> f64 {
        self.forward + self.backward
    }
}

/// The timed steps of one mode.
#[derive(Debug, Default, Clone)]
struct Timing {
    steps: Vec<StepTime>,
}

impl Timing {
    /// Mean forward, backward and copies' refresh seconds per step.
    fn mean(&self) -> (f64, f64, f64) {
        let n = self.steps.len().max(1) as f64;
        let (f, b, r) = self.steps.iter().fold((0.0, 0.0, 0.0), |(f, b, r), s| {
            (f + s.forward, b + s.backward, r + s.refresh)
        });
        (f / n, b / n, r / n)
    }

    /// Share of the steps' wall time the routing mode's own host work took.
    fn overhead_share(&self) -> f64 {
        let (wall, extra) = self.steps.iter().fold((0.0, 0.0), |(w, o), s| {
            (w + s.wall(), o + s.routing_overhead)
        });
        if wall > 0.0 {
            extra / wall
        } else {
            0.0
        }
    }

    /// Mean MoE layers a forward waited in, and the mean milliseconds of those waits.
    fn mean_waits(&self) -> (f64, f64) {
        let n = self.steps.len().max(1) as f64;
        let (layers, secs) = self.steps.iter().fold((0.0, 0.0), |(l, t), s| {
            (l + s.waits.layers as f64, t + s.waits.time.as_secs_f64())
        });
        (layers / n, secs / n * 1e3)
    }

    /// Fewest CPU seconds of any step: steal time by other tenants does not count as ours,
    /// so this is the steadiest figure for comparing two modes.
    fn least_cpu(&self) -> Option<f64> {
        self.steps
            .iter()
            .map(|s| s.cpu)
            .collect::<Option<Vec<f64>>>()?
            .into_iter()
            .min_by(f64::total_cmp)
    }

    /// The fastest step: on a shared machine, the least disturbed by other tenants.
    fn best(&self) -> (f64, f64, f64) {
        self.steps
            .iter()
            .min_by(|a, b| a.wall().total_cmp(&b.wall()))
            .map_or((0.0, 0.0, 0.0), |s| (s.forward, s.backward, s.refresh))
    }
}

/// One forward (+ next-token cross-entropy) and backward, then the rewrite of each held
/// 16-bit copy from its master (`copies`: (master, copy) pairs), timed; with `recompute`
/// (the model's variables given) by a recomputing forward and its layer-by-layer backward;
/// with `scores` the head scored in chunks without its logits kept.
fn step(
    model: &Model,
    batch: &Batch,
    (targets, host_targets): (&Tensor, &[u32]),
    routing: Routing<'_>,
    copies: &[(Var, Var)],
    vars: &[Var],
    (recompute, narrow, scores): (bool, Option<DType>, Option<&ScoreTargets>),
) -> anyhow::Result<StepTime> {
    let cpu0 = process_cpu_ns();
    let t0 = Instant::now();
    let every = HeadPositions::From(0);
    let (out, layers) = match (scores, recompute) {
        (Some(scores), _) => model.forward_scores(batch, routing, every, scores, recompute)?,
        (None, true) => {
            let (out, layers) = model.forward_recomputing(batch, routing, every)?;
            (out, Some(layers))
        }
        (None, false) => (model.forward(batch, routing)?, None),
    };
    let layers = match (layers, narrow) {
        (Some(layers), Some(narrow)) => Some(layers.keep_gradients_narrow(narrow)),
        (layers, _) => layers,
    };
    if let (Routing::Replay(_), None) = (routing, &out.replay) {
        anyhow::bail!("replayed forward returned no replay proof");
    }
    let routing_overhead = out.routing_overhead.as_secs_f64();
    let waits = out.routing_waits;
    let logp = match scores {
        // `[B·T, 2]`: each position's target log-prob, then its entropy.
        Some(_) => out.logits.narrow(1, 0, 1)?.squeeze(1)?,
        None => {
            r3_model::token_stats::token_log_probs_host_checked(&out.logits, targets, host_targets)?
        }
    };
    let loss = logp.neg()?.mean_all()?;
    // A GPU runs queued kernels after the call returns: wait for them (no-op on the CPU).
    model.device().synchronize()?;
    let t1 = Instant::now();
    let grads = match (layers, narrow) {
        (Some(layers), _) => {
            // Nothing but the loss may hold the logits: the recomputing backward lets the
            // loss's graph go before the layers run again, as the trainer does.
            drop((out, logp));
            layers.backward(loss, vars)?
        }
        (None, Some(narrow)) => backward_narrowing(&loss, narrow)?,
        (None, None) => loss.backward()?,
    };
    model.device().synchronize()?;
    let t2 = Instant::now();
    let gradients = GradientBytes::of(&grads, vars);
    drop(grads);
    for (master, copy) in copies {
        cast16_into(master.as_tensor(), copy.as_tensor())?;
    }
    model.device().synchronize()?;
    let t3 = Instant::now();
    let cpu = cpu_seconds(cpu0, process_cpu_ns());
    Ok(StepTime {
        forward: (t1 - t0).as_secs_f64(),
        backward: (t2 - t1).as_secs_f64(),
        refresh: (t3 - t2).as_secs_f64(),
        cpu,
        routing_overhead,
        waits,
        gradients,
    })
}

/// Runs `r3 bench train`.
pub fn run(args: BenchTrainArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.batch > 0 && args.seq_len > 1,
        "need --batch ≥ 1 and --seq-len ≥ 2"
    );
    let device = args.device.open()?;
    let precision = match args.dtype.as_str() {
        "bf16" => Precision::Bf16 { router_f32: false },
        _ => Precision::F32,
    };
    let narrow_grads = match (args.narrow_gradients, precision.narrow_dtype()) {
        (false, _) => None,
        (true, Some(narrow)) => Some(narrow),
        (true, None) => anyhow::bail!("--narrow-gradients needs --dtype bf16"),
    };
    let (cfg, weights) = match &args.model_dir {
        Some(dir) => {
            let cfg = Config::from_file(&dir.join("config.json"))
                .with_context(|| format!("reading {}/config.json", dir.display()))?;
            let weights = Weights::load(dir, &cfg, &device)
                .with_context(|| format!("loading the weights of {}", dir.display()))?;
            (cfg, weights)
        }
        None => {
            let cfg = match args.config {
                BenchModel::Mid => presets::mid_size_bench_config()?,
                BenchModel::A3b8l => presets::qwen3_30b_a3b_layers_config(8)?,
            };
            let mut init = RandomInit::new(args.seed);
            init.std = 0.02;
            init.router_std = 0.02;
            init.norm_jitter = 0.0;
            let weights = Weights::random_on_device(&cfg, &init, &device)?;
            (cfg, weights)
        }
    };
    let bf16_masters = args.master_weights == "bf16";
    anyhow::ensure!(
        !bf16_masters || precision == (Precision::Bf16 { router_f32: false }),
        "--master-weights bf16 needs --dtype bf16"
    );
    anyhow::ensure!(
        !bf16_masters || args.narrow_copies != "on",
        "--narrow-copies on holds bf16 copies beside f32 masters; with --master-weights bf16 the \
         matrices are bf16 already"
    );
    let weights = match bf16_masters {
        true => weights.narrow_for_training(&cfg, DType::BF16, true)?,
        false => weights,
    };
    let (varmap, mut weights) = weights.into_trainable(&cfg)?;
    let vars = varmap.all_vars();
    let params: usize = vars.iter().map(|v| v.elem_count()).sum();
    let hold_copies = match (args.narrow_copies.as_str(), precision.narrow_dtype()) {
        _ if bf16_masters => None,
        (_, None) | ("off", _) => None,
        ("auto", Some(_)) if device.is_cpu() => None,
        (_, Some(narrow)) => Some(narrow),
    };
    let copies: Vec<(Var, Var)> = match hold_copies {
        Some(narrow) => {
            let masters = varmap
                .data()
                .lock()
                .map_err(|_| anyhow::anyhow!("VarMap lock"))?;
            weights
                .hold_narrow_copies(&cfg, narrow)?
                .into_iter()
                .map(|(name, copy)| {
                    let master = masters
                        .get(&name)
                        .with_context(|| format!("no variable {name} for its copy"))?;
                    Ok((master.clone(), copy))
                })
                .collect::<anyhow::Result<_>>()?
        }
        None => Vec::new(),
    };
    let mut model = Model::with_precision(&cfg, &weights, precision)?;
    model.set_expert_gemm_inputs(args.expert_gemm);
    model.set_padded_expert_ops(args.padded_expert_ops);
    model.set_selective_recompute(args.selective_recompute);
    model.set_score_tiles(r3_train::config::attention_tiles(args.attention_tile_mib));
    if narrow_grads.is_some() {
        model.set_weight_gradients(WeightGradients::Narrow);
    }

    let mut rng = ChaCha8Rng::seed_from_u64(args.seed ^ 0x7261_6e64);
    let seqs: Vec<Vec<u32>> = (0..args.batch)
        .map(|_| {
            (0..args.seq_len)
                .map(|_| rng.random_range(0..cfg.vocab_size as u32))
                .collect()
        })
        .collect();
    let batch = Batch::new(&seqs, 0, &device)?;
    let targets: Vec<u32> = seqs
        .iter()
        .flat_map(|s| s[1..].iter().copied().chain(std::iter::once(s[0])))
        .collect();
    let host_targets = targets;
    let targets = Tensor::from_slice(&host_targets, (args.batch, args.seq_len), &device)?;
    let scores = (args.head_chunk_tokens > 0).then(|| ScoreTargets {
        targets: host_targets.clone(),
        chunk_rows: args.head_chunk_tokens,
        entropy_grad: false,
        // The benchmark times the temperature-1 head.
        inv_temperature: 1.0,
    });
    let routes = ReplayRoutes::new(
        model
            .forward(&batch, Routing::Record)?
            .routes
            .context("record forward returned no routes")?,
        &model.config().layout,
    )?;

    let tokens = args.batch * args.seq_len;
    println!(
        "r3 bench train: {}-style, {} layers, hidden {}, {} experts (width {}) top-{}, vocab {}, {:.1}M params",
        cfg.architecture.model_type(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_experts(),
        cfg.moe.as_ref().map_or(0, |m| m.expert_intermediate_size),
        cfg.top_k(),
        cfg.vocab_size,
        params as f64 / 1e6
    );
    println!(
        "batch {} × seq {} = {tokens} tokens/step, {} on {}, {} warm-up + {} timed steps per mode, seed {}, expert GEMM inputs {}, padded expert ops {}, {}{}{}{}",
        args.batch,
        args.seq_len,
        args.dtype,
        args.device,
        args.warmup,
        args.steps,
        args.seed,
        args.expert_gemm,
        args.padded_expert_ops,
        if copies.is_empty() {
            "weights cast per use".to_string()
        } else {
            format!(
                "16-bit copies of {} weight matrices held, rewritten once per step",
                copies.len()
            )
        },
        if args.gradient_checkpointing {
            ", gradient checkpointing (each layer run again in the backward)"
        } else if args.selective_recompute {
            ", selective recomputation (q and k heads run again in the backward)"
        } else {
            ""
        },
        if narrow_grads.is_some() {
            ", gradients kept in bf16 where exact"
        } else {
            ""
        },
        match args.head_chunk_tokens {
            0 => String::new(),
            n => format!(", the head scored {n} tokens at a time (logits not kept)"),
        }
    );
    // What the parameters hold by construction (not measured): the masters (f32, or the
    // matrices bf16) and the copies. Their gradients are counted after the backward
    // (below); activations, workspace and the allocator's pools come on top (a GPU's peak is
    // what nvidia-smi reads).
    let bytes_of = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as f64 / 1e9;
    let master_gb: f64 = varmap
        .all_vars()
        .iter()
        .map(|v| bytes_of(v.as_tensor()))
        .sum();
    // A fold from +0 (a float `sum` of nothing is −0, which printed as "-0.00 GB").
    let copies_gb = copies
        .iter()
        .map(|(_, c)| bytes_of(c.as_tensor()))
        .fold(0.0, |a, b| a + b);
    let bf16_vars = vars.iter().filter(|v| v.dtype() == DType::BF16).count();
    println!(
        "parameters hold {:.2} GB: weights {master_gb:.2} GB ({}){} (gradients: below)",
        master_gb + copies_gb,
        match bf16_vars {
            0 => "f32".to_string(),
            n => format!(
                "{n} of {} tensors bf16 with no f32 copy (--master-weights bf16)",
                vars.len()
            ),
        },
        if copies.is_empty() {
            String::new()
        } else {
            format!(" + 16-bit copies {copies_gb:.2} GB")
        }
    );

    // On the CPU the step's share of the machine's limit is measured in the same run: the
    // GEMM peak before the steps and after them (the better of the two: a neighbour's burst
    // can only lower a measurement).
    let peak_before = device.is_cpu().then(|| f32_gemm_peak(machine_threads()));
    let bar = ProgressBar::new(((args.warmup + args.steps) * 2) as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} steps {msg}",
    )?);
    let mut native = Timing::default();
    let mut replay = Timing::default();
    // The steps' resident-memory high-water mark, the mark reset before them: their
    // activations and gradients at the fullest (on the CPU; a GPU's is nvidia-smi's to read).
    let memory_before = r3_train::rl::memory::reset_peak()
        .then(r3_train::rl::memory::read_memory)
        .flatten();
    // A mark the driver refuses is left out with a warning (the benchmark still runs).
    let device_peak_known = r3_model::device::reset_device_memory_peak(&device)
        .map_err(|e| tracing::warn!("device memory high-water mark left out: {e}"))
        .is_ok();
    for i in 0..args.warmup + args.steps {
        for (mode, timing) in [("native", &mut native), ("replay", &mut replay)] {
            let routing = if mode == "native" {
                Routing::Native
            } else {
                Routing::Replay(&routes)
            };
            bar.set_message(mode);
            let profiled = args.profile_step && i == args.warmup && mode == "native";
            if profiled {
                r3_model::device::profiler_capture(&device, true)?;
            }
            let t = step(
                &model,
                &batch,
                (&targets, &host_targets),
                routing,
                &copies,
                &vars,
                (args.gradient_checkpointing, narrow_grads, scores.as_ref()),
            )?;
            if profiled {
                r3_model::device::profiler_capture(&device, false)?;
            }
            if i >= args.warmup {
                timing.steps.push(t);
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();

    // Tokens/s are the forward's and backward's, as the peer's (HF's) are: the copies'
    // rewrite is optimiser work, which `r3 train` does inside AdamW's pass (the new θ
    // written rounded beside itself); its separate pass here is shown beside them.
    let refresh = |r: f64, fb: f64| {
        if copies.is_empty() {
            String::new()
        } else {
            format!(
                "  [copies' rewrite {r:6.3} s, {:7.1} tokens/s with it]",
                tokens as f64 / (fb + r)
            )
        }
    };
    let report = |name: &str, t: &Timing| {
        let (f, b, r) = t.mean();
        let (bf, bb, br) = t.best();
        println!(
            "{name:<7} mean: forward {f:6.3} s  backward {b:6.3} s{}  {:7.1} tokens/s   best step: forward {bf:6.3} s  backward {bb:6.3} s{}  {:7.1} tokens/s",
            refresh(r, f + b),
            tokens as f64 / (f + b),
            refresh(br, bf + bb),
            tokens as f64 / (bf + bb)
        );
        (f + b, bf + bb)
    };
    let (n, nb) = report("native", &native);
    let (r, rb) = report("replay", &replay);
    let cpu_cost = match (native.least_cpu(), replay.least_cpu()) {
        (Some(nc), Some(rc)) => format!(
            ", {:+.2}% by CPU time (least CPU s/step: native {nc:.2}, replay {rc:.2})",
            (rc - nc) / nc * 100.0
        ),
        _ => String::new(),
    };
    // HF's figures hold for the default workload on a 2-core CPU only.
    let reference = match (&args.model_dir, &args.config) {
        (None, BenchModel::Mid) if device.is_cpu() && args.batch == 4 && args.seq_len == 256 => {
            format!("; {}", hf_cpu_reference(precision))
        }
        _ => String::new(),
    };
    println!(
        "replay cost vs native: {:+.2}% mean, {:+.2}% best step{cpu_cost} (goal ≤ 1%){reference}",
        (r - n) / n * 100.0,
        (rb - nb) / nb * 100.0
    );
    println!(
        "replay's own work (tables → per-layer ids, forced-id overrides, verification), timed where it runs: {:.3}% of replay step time (goal ≤ 1%)",
        replay.overhead_share() * 100.0
    );
    let ((nl, nt), (rl, rt)) = (native.mean_waits(), replay.mean_waits());
    println!(
        "routing waits a forward (MoE layers whose router's choice the host read mid-forward; on a GPU each drains the queued work): native {nl:.0} layers, {nt:.2} ms; replay {rl:.0} layers, {rt:.2} ms"
    );
    if let Some(g) = native.steps.last().map(|s| s.gradients) {
        println!(
            "gradients at the backward's end: {:.2} GB, {} of {} tensors kept in 16 bits (--narrow-gradients: where exact, as a 16-bit forward's weight gradients are), the rest f32",
            g.bytes as f64 / 1e9,
            g.narrow,
            g.tensors
        );
    }
    if let (true, Some(before), Some(after)) = (
        device.is_cpu(),
        memory_before,
        r3_train::rl::memory::read_memory(),
    ) {
        // The process's resident set, whose allocator keeps freed buffers for reuse
        // (`allocator.rs`): compare peaks of runs that differ in one setting.
        println!(
            "memory: resident high-water mark during the steps {:.0} MiB (the resident set before them {:.0} MiB; gradient checkpointing {})",
            after.peak_mib,
            before.rss_mib,
            if args.gradient_checkpointing { "on" } else { "off" }
        );
    }
    let device_peak = match device_peak_known {
        true => r3_model::device::device_memory_peak(&device)
            .map_err(|e| tracing::warn!("device memory high-water mark left out: {e}"))
            .ok()
            .flatten(),
        false => None,
    };
    if let Some(peak) = device_peak {
        println!(
            "device memory: the tensors' high-water mark during the steps {:.0} MiB (the memory pool's, as PyTorch's max_memory_allocated; nvidia-smi also counts the context, cuBLAS's workspace and the pool's kept memory; gradient checkpointing {})",
            peak as f64 / (1024.0 * 1024.0),
            if args.gradient_checkpointing { "on" } else { "off" }
        );
    }
    // On a GPU the share of the GEMM peak in the step's precision (bf16: the tensor cores),
    // measured after the steps (its operands, 0.4–0.8 GB, kept out of the memory figures).
    // The backward does twice the forward's matrix work (input and weight gradients of every
    // product).
    let step_flops =
        3.0 * training_forward_flops(&cfg, args.seq_len, 0..args.seq_len) * args.batch as f64;
    let rate = |secs: f64| step_flops / secs / 1e9;
    if !device.is_cpu() {
        let gemm_dtype = precision.narrow_dtype().unwrap_or(DType::F32);
        let (size, reps) = super::matmul_work::GPU_PEAK_PRODUCTS;
        let peak = super::matmul_work::gpu_gemm_peak(&device, gemm_dtype)?;
        println!(
            "matrix work {:.1} GFLOP per step (3 × the forward's, counted from the config): native {:.1} TFLOP/s mean, {:.1} best step = {:.1}% / {:.1}% of the {gemm_dtype:?} GEMM peak measured in this run ({:.1} TFLOP/s, the best of {reps} {size}³ products)",
            step_flops / 1e9,
            rate(n) / 1e3,
            rate(nb) / 1e3,
            100.0 * rate(n) / peak,
            100.0 * rate(nb) / peak,
            peak / 1e3
        );
    }
    if let Some(before) = peak_before {
        let after = f32_gemm_peak(machine_threads());
        let peak = before.max(after);
        println!(
            "matrix work {:.1} GFLOP per step (3 × the forward's, counted from the config): native {:.1} GFLOP/s mean, {:.1} best step = {:.0}% / {:.0}% of the f32 GEMM peak measured in this run ({peak:.1} GFLOP/s, {} threads; {before:.1} before the steps, {after:.1} after) (goal ≥ 70%)",
            step_flops / 1e9,
            rate(n),
            rate(nb),
            100.0 * rate(n) / peak,
            100.0 * rate(nb) / peak,
            machine_threads()
        );
    }
    if args.parts {
        let setup = super::bench_train_parts::PartsSetup {
            cfg: &cfg,
            weights: &weights,
            precision,
            batch: args.batch,
            seq_len: args.seq_len,
            reps: args.steps,
            seed: args.seed,
        };
        super::bench_train_parts::run(&setup, n)?;
    }
    Ok(())
}

/// HF transformers on the same workload (mid, 4 × 256, the same loss) on this project's
/// 2-core CPU, by `scripts/cuda/peer_hf.py --device cpu` (re-measure with it: the figures
/// move with the machine and the versions).
fn hf_cpu_reference(precision: Precision) -> &'static str {
    match precision {
        Precision::F32 => {
            "reference HF transformers CPU 2 threads ≈ 320–380 tokens/s in f32 (transformers 5.24 / torch 2.15: 380)"
        }
        _ => {
            "reference HF transformers CPU 2 threads: f32 parameters under bf16 autocast (its Trainer's bf16, r3's scheme) ≈ 484 tokens/s, the model held in bf16 ≈ 1,099 (avx512_bf16 dot products; transformers 5.24 / torch 2.15)"
        }
    }
}
