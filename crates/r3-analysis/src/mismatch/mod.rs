//! The mismatch analysis behind `r3 analyze` (paper Section 3 and 4.3): rollouts from the
//! rollout engine (f16 by default, or bf16), the same tokens recomputed by the training engine
//! (f32 by default, or bf16 mixed precision) natively and with R3 replay, a dense reference
//! model, and two training passes compared with each other. Writes `summary.json`,
//! `summary.md` and the PNGs into one directory; `grid` runs the precision grid.

mod dense;
mod figures;
pub mod grid;
mod prompts;
mod rollout;
mod stats;
mod summary;
mod training;

use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::ProgressBar;
use r3_model::{Config, DeviceSpec, Model, Precision, Weights};
use r3_rollout::{Dtype, EngineConfig, RolloutDevice, RolloutEngine, RouterDtype};
use r3_routing::RouteTable;
use r3_train::rl::sampling::{rollout_tables, RolloutSample};

pub use summary::AnalysisSummary;

use crate::AnalysisError;
use dense::DenseModel;
use figures::FigureIndex;
use prompts::Prompts;
use rollout::{generate_samples, SamplingSetup};
use stats::{divergence_section, mismatch_section, scatter_points, MismatchSection};
use summary::{
    DenseSection, ModelInfo, MoeSection, ReplayCheck, RolloutInfo, Timings, TwoPasses, PAPER,
    SUMMARY_VERSION,
};
use training::{training_pass, Batching, PassResult, PassRouting};

/// File name of the JSON summary in the output directory.
pub const SUMMARY_JSON: &str = "summary.json";
/// File name of the Markdown summary in the output directory.
pub const SUMMARY_MD: &str = "summary.md";
/// File name of the per-sample log-probs (one JSON object per rollout).
pub const SAMPLES_JSONL: &str = "samples.jsonl";

/// What to analyse and how.
#[derive(Debug, Clone)]
pub struct AnalyzeOptions {
    /// MoE checkpoint directory (config.json + safetensors, optional tokenizer.json).
    pub model: PathBuf,
    /// Dense checkpoint for the reference point; `None` builds a random dense model.
    pub dense_model: Option<PathBuf>,
    /// Number of prompts (one rollout each).
    pub prompts: usize,
    /// Arithmetic difficulty level when the model has r3's tokenizer.
    pub level: u32,
    /// Most tokens generated per prompt.
    pub max_new_tokens: usize,
    /// Rollout sampling temperature.
    pub temperature: f32,
    /// Sequences per training forward call.
    pub micro_batch: usize,
    /// Token budget of one training forward call (rows × longest row); 0 = none.
    pub max_tokens_per_micro_batch: usize,
    /// Seed of prompts, sampling and random dense weights.
    pub seed: u64,
    /// Rollout engine precision (f16 by default).
    pub rollout_dtype: Dtype,
    /// Rollout router precision.
    pub rollout_router_dtype: RouterDtype,
    /// Training forward precision (f32 by default).
    pub train_precision: Precision,
    /// Which rollout engine generates the rollouts (the MoE model's and the dense
    /// reference's) and where: the CPU engine (`cpu`, the default) or the device engine
    /// (`cpu-candle`, `cuda`, `cuda:N`).
    pub rollout_device: RolloutDevice,
    /// Where the training passes (MoE and dense) run.
    pub train_device: DeviceSpec,
    /// Output directory.
    pub out: PathBuf,
    /// The command line, recorded in the summary.
    pub command: String,
}

/// Loads a model's config and weights for the training engine at `precision` onto `device`
/// (opened first: a device this build or machine lacks is an error before any loading).
fn load_training_model(
    dir: &Path,
    precision: Precision,
    device: DeviceSpec,
) -> Result<(Config, Model), AnalysisError> {
    let device = device.open()?;
    let cfg = Config::from_file(&dir.join("config.json")).map_err(AnalysisError::model(
        format!("reading {}/config.json", dir.display()),
    ))?;
    let weights = Weights::load(dir, &cfg, &device).map_err(AnalysisError::model(format!(
        "loading weights from {}",
        dir.display()
    )))?;
    let model = Model::with_precision(&cfg, &weights, precision)
        .map_err(AnalysisError::model("building the training model"))?;
    Ok((cfg, model))
}

/// The rollout engine config used for every rollout of `opts`.
fn engine_config(opts: &AnalyzeOptions) -> EngineConfig {
    EngineConfig {
        dtype: opts.rollout_dtype,
        router_dtype: opts.rollout_router_dtype,
        ..EngineConfig::default()
    }
}

/// The rollout engine of `opts` (its device and precision) with the MoE model's weights.
fn rollout_engine(opts: &AnalyzeOptions) -> Result<RolloutEngine, AnalysisError> {
    Ok(RolloutEngine::from_dir_with(
        opts.rollout_device,
        &opts.model,
        engine_config(opts),
        &r3_model::LoadOptions::default(),
    )?)
}

/// The name of a training precision as the summaries print it.
pub fn precision_name(p: Precision) -> &'static str {
    match p {
        Precision::F32 => "f32",
        Precision::Bf16 { router_f32: false } => "bf16",
        Precision::Bf16 { router_f32: true } => "bf16 (f32 router)",
        Precision::F16 { router_f32: false } => "f16",
        Precision::F16 { router_f32: true } => "f16 (f32 router)",
    }
}

fn rollout_logps(samples: &[RolloutSample]) -> Vec<Vec<f32>> {
    samples.iter().map(|s| s.rollout_logp.clone()).collect()
}

/// The routes a native pass recorded (always present for an MoE model).
fn recorded_routes<'a>(
    pass: &'a PassResult,
    what: &str,
) -> Result<&'a [RouteTable], AnalysisError> {
    pass.routes
        .as_deref()
        .ok_or_else(|| AnalysisError::Invalid(format!("{what} pass recorded no routes")))
}

/// Writes every rollout's tokens and its three log-prob series, so that any number in the
/// summary can be recomputed from the raw values.
fn write_samples(
    path: &Path,
    samples: &[RolloutSample],
    native: &[Vec<f32>],
    r3: &[Vec<f32>],
) -> Result<(), AnalysisError> {
    let mut text = String::new();
    for (i, s) in samples.iter().enumerate() {
        let line = serde_json::json!({
            "index": i,
            "prompt": s.prompt_ids,
            "output": s.response_ids,
            "rollout_logp": s.rollout_logp,
            "train_native_logp": native.get(i),
            "train_r3_logp": r3.get(i),
        });
        text.push_str(&serde_json::to_string(&line)?);
        text.push('\n');
    }
    std::fs::write(path, text).map_err(AnalysisError::io(path))
}

/// The MoE model and everything derived from its config before any long work: the dense
/// reference (loaded and checked first) and the prompts.
struct Inputs {
    cfg: Config,
    model: Model,
    dense: DenseModel,
    prompts: Prompts,
}

fn load_inputs(opts: &AnalyzeOptions) -> Result<Inputs, AnalysisError> {
    // The rollout device is checked before the long work too (opening it is cheap), so a
    // `cuda` the build lacks fails here and not after the training model has loaded.
    if let Some(spec) = opts.rollout_device.candle() {
        spec.open()?;
    }
    let (cfg, model) = load_training_model(&opts.model, opts.train_precision, opts.train_device)?;
    if cfg.moe.is_none() {
        return Err(AnalysisError::Invalid(format!(
            "--model {} is a dense model; r3 analyze measures an MoE model (give the dense one \
             with --dense-model)",
            opts.model.display()
        )));
    }
    let dense = match &opts.dense_model {
        Some(dir) => DenseModel::load(dir)?,
        None => DenseModel::random_like(&cfg, opts.seed)?,
    };
    let prompts = prompts::build_prompts(
        &opts.model,
        cfg.vocab_size,
        opts.prompts,
        opts.level,
        opts.seed,
    )?;
    Ok(Inputs {
        cfg,
        model,
        dense,
        prompts,
    })
}

/// The four f32 training passes over the MoE rollouts.
struct MoePasses {
    /// Native routing, routes recorded.
    native: PassResult,
    /// R3: the rollout routes replayed.
    replay: PassResult,
    /// The native pass again, same order and micro-batch.
    again: PassResult,
    /// The native pass with a different batch composition (see `rebatched`).
    other: PassResult,
    /// The batching of `other`.
    rebatched: Batching,
}

/// Reversed order and a different micro-batch size: every sequence shares its forward call
/// with different neighbours and different padding.
fn rebatched(n: usize, micro_batch: usize, max_tokens: usize) -> Batching {
    Batching {
        order: (0..n).rev().collect(),
        micro_batch: if micro_batch > 1 { 1 } else { n.max(2) },
        max_tokens,
    }
}

fn moe_passes(
    model: &Model,
    samples: &[RolloutSample],
    micro_batch: usize,
    max_tokens: usize,
    progress: &ProgressBar,
) -> Result<MoePasses, AnalysisError> {
    let in_order = Batching::in_order(samples.len(), micro_batch, max_tokens);
    let other_batching = rebatched(samples.len(), micro_batch, max_tokens);
    let pass = |routing, batching: &Batching, label: &str| {
        training_pass(model, samples, routing, batching, progress, label)
    };
    Ok(MoePasses {
        native: pass(
            PassRouting::NativeRecorded,
            &in_order,
            "training pass: native",
        )?,
        replay: pass(
            PassRouting::ReplayRollout,
            &in_order,
            "training pass: R3 replay",
        )?,
        again: pass(
            PassRouting::NativeRecorded,
            &in_order,
            "training pass: repeat",
        )?,
        other: pass(
            PassRouting::NativeRecorded,
            &other_batching,
            "training pass: re-batched",
        )?,
        rebatched: other_batching,
    })
}

/// The dense reference: its own rollouts (same prompts and seeds) and one native pass.
fn dense_reference(
    opts: &AnalyzeOptions,
    dense: &DenseModel,
    prompts: &[Vec<u32>],
    setup: SamplingSetup,
    progress: &ProgressBar,
) -> Result<(Vec<RolloutSample>, PassResult), AnalysisError> {
    let micro_batch = opts.micro_batch;
    let samples = {
        let mut engine = RolloutEngine::new(
            opts.rollout_device,
            dense.config.clone(),
            dense.weights.tensors(),
            engine_config(opts),
        )?;
        generate_samples(&mut engine, prompts, setup)?
    };
    let weights = dense.on_device(opts.train_device)?;
    let model = Model::with_precision(&dense.config, &weights, opts.train_precision)
        .map_err(AnalysisError::model("building the dense training model"))?;
    let pass = training_pass(
        &model,
        &samples,
        PassRouting::NativeRecorded,
        &Batching::in_order(samples.len(), micro_batch, opts.max_tokens_per_micro_batch),
        progress,
        "training pass: dense",
    )?;
    Ok((samples, pass))
}

/// R3's replay evidence against the routers the rollout routes cover; an error unless every
/// one of them was replayed.
fn replay_check(replay: &PassResult, routes: &[RouteTable]) -> Result<ReplayCheck, AnalysisError> {
    let rollout_routers: usize = routes
        .iter()
        .map(|t| t.num_tokens() * t.num_columns())
        .sum();
    let totals = replay.replay.unwrap_or_default();
    let check = ReplayCheck {
        differing_routers: 0,
        rollout_routers,
        all_replayed: totals.replayed_cells == rollout_routers,
        totals,
    };
    if !check.all_replayed {
        return Err(AnalysisError::Invalid(format!(
            "R3 replayed {} routers, but the rollout routes cover {rollout_routers}",
            totals.replayed_cells
        )));
    }
    Ok(check)
}

/// The MoE section: both mismatches against the rollout, the rollout-vs-training routing
/// divergence and the replay check.
fn moe_section(
    passes: &MoePasses,
    rollout_lp: &[Vec<f32>],
    routes: &[RouteTable],
) -> Result<MoeSection, AnalysisError> {
    let native = mismatch_section(&passes.native.logp, rollout_lp, "MoE native vs rollout")?;
    let r3 = mismatch_section(&passes.replay.logp, rollout_lp, "MoE R3 vs rollout")?;
    let routing_divergence = divergence_section(
        routes,
        recorded_routes(&passes.native, "native")?,
        "rollout vs training routes",
    )?;
    Ok(MoeSection {
        k3_kl_reduction_factor: (r3.metrics.k3_kl > 0.0)
            .then(|| native.metrics.k3_kl / r3.metrics.k3_kl),
        r3_routing: replay_check(&passes.replay, routes)?,
        native,
        r3,
        routing_divergence,
    })
}

/// Two training passes over the same sequences compared with each other.
fn two_passes(
    description: String,
    first: &PassResult,
    second: &PassResult,
    what: &str,
) -> Result<TwoPasses, AnalysisError> {
    Ok(TwoPasses {
        description,
        mismatch: mismatch_section(&second.logp, &first.logp, &format!("{what} log-probs"))?,
        routing_divergence: divergence_section(
            recorded_routes(first, "first")?,
            recorded_routes(second, what)?,
            &format!("{what} routes"),
        )?,
    })
}

/// Every figure of the analysis, drawn into `out`.
fn draw_figures(
    opts: &AnalyzeOptions,
    out: &Path,
    passes: &MoePasses,
    rollout_lp: &[Vec<f32>],
    dense: (&PassResult, &[Vec<f32>], &MismatchSection),
    moe: &MoeSection,
    rebatched: &TwoPasses,
) -> Result<FigureIndex, AnalysisError> {
    let (dense_pass, dense_lp, dense_native) = dense;
    let mut index = FigureIndex::new();
    let x_axis = format!("rollout engine probability ({})", opts.rollout_dtype);
    let y_axis = format!(
        "training engine probability ({})",
        precision_name(opts.train_precision)
    );
    let prob_axes = (x_axis.as_str(), y_axis.as_str());
    figures::scatter(
        &mut index,
        out,
        "fig2a_moe_native",
        "MoE: training vs rollout probability (no replay)",
        prob_axes,
        &scatter_points(&passes.native.logp, rollout_lp),
    )?;
    figures::scatter(
        &mut index,
        out,
        "fig2b_moe_r3",
        "MoE + R3: training vs rollout probability",
        prob_axes,
        &scatter_points(&passes.replay.logp, rollout_lp),
    )?;
    figures::scatter(
        &mut index,
        out,
        "fig2c_dense",
        "Dense: training vs rollout probability",
        prob_axes,
        &scatter_points(&dense_pass.logp, dense_lp),
    )?;
    figures::f_tau(
        &mut index,
        out,
        "fig2d_f_tau",
        &[
            ("MoE", &moe.native.f_tau),
            ("MoE + R3", &moe.r3.f_tau),
            ("dense", &dense_native.f_tau),
        ],
    )?;
    figures::divergence(
        &mut index,
        out,
        "fig3",
        "rollout vs training routes",
        &moe.routing_divergence,
    )?;
    figures::per_layer(
        &mut index,
        out,
        "fig3d_per_layer",
        &[
            ("rollout vs training", &moe.routing_divergence),
            (
                "training pass vs re-batched pass",
                &rebatched.routing_divergence,
            ),
        ],
    )?;
    figures::scatter(
        &mut index,
        out,
        "fig4_two_passes",
        "Two training passes (different batching)",
        ("first pass probability", "re-batched pass probability"),
        &scatter_points(&passes.other.logp, &passes.native.logp),
    )?;
    Ok(index)
}

/// What summary.json records about the model.
fn model_info(dir: &Path, cfg: &Config) -> ModelInfo {
    ModelInfo {
        dir: dir.to_path_buf(),
        model_type: cfg.architecture.model_type().to_string(),
        num_hidden_layers: cfg.num_hidden_layers,
        moe_layers: cfg.layer_layout().moe_layers().to_vec(),
        num_experts: cfg.num_experts(),
        top_k: cfg.top_k(),
        hidden_size: cfg.hidden_size,
        vocab_size: cfg.vocab_size,
    }
}

/// Writes summary.json and summary.md.
fn write_summary(out: &Path, summary: &AnalysisSummary) -> Result<(), AnalysisError> {
    let json_path = out.join(SUMMARY_JSON);
    std::fs::write(&json_path, serde_json::to_string_pretty(summary)? + "\n")
        .map_err(AnalysisError::io(&json_path))?;
    let md_path = out.join(SUMMARY_MD);
    std::fs::write(&md_path, summary.to_markdown()).map_err(AnalysisError::io(&md_path))
}

/// Runs the whole analysis and writes its files; returns the summary.
pub fn run_analysis(opts: &AnalyzeOptions) -> Result<AnalysisSummary, AnalysisError> {
    let out = opts.out.as_path();
    std::fs::create_dir_all(out).map_err(AnalysisError::io(out))?;
    let mut timings = Timings::default();
    let progress = ProgressBar::new(0);
    let setup = SamplingSetup {
        temperature: opts.temperature,
        max_new_tokens: opts.max_new_tokens,
        seed: opts.seed,
    };
    let mb = opts.micro_batch;

    let t0 = Instant::now();
    let inputs = load_inputs(opts)?;
    let samples = {
        let mut engine = rollout_engine(opts)?;
        generate_samples(&mut engine, &inputs.prompts.ids, setup)?
    };
    timings.rollout_s = t0.elapsed().as_secs_f64();
    tracing::info!(
        samples = samples.len(),
        secs = timings.rollout_s,
        "rollouts done"
    );

    let t0 = Instant::now();
    let passes = moe_passes(
        &inputs.model,
        &samples,
        mb,
        opts.max_tokens_per_micro_batch,
        &progress,
    )?;
    timings.training_passes_s = t0.elapsed().as_secs_f64();
    drop(inputs.model);

    let t0 = Instant::now();
    let (dense_samples, dense_pass) =
        dense_reference(opts, &inputs.dense, &inputs.prompts.ids, setup, &progress)?;
    timings.dense_s = t0.elapsed().as_secs_f64();

    let t0 = Instant::now();
    let n = samples.len();
    let rollout_lp = rollout_logps(&samples);
    let dense_lp = rollout_logps(&dense_samples);
    let routes = rollout_tables(&samples)?;
    let moe = moe_section(&passes, &rollout_lp, &routes)?;
    let dense_native = mismatch_section(&dense_pass.logp, &dense_lp, "dense vs rollout")?;
    let repeat_identical = two_passes(
        format!("the same {n} sequences, same order, {mb} per forward call, twice"),
        &passes.native,
        &passes.again,
        "repeat vs first pass",
    )?;
    let repeat_rebatched = two_passes(
        format!(
            "first pass: {n} sequences in order, {mb} per forward call (right-padded); second \
             pass: reversed order, {} per call — different batch composition and padding",
            passes.rebatched.micro_batch
        ),
        &passes.native,
        &passes.other,
        "re-batched vs first pass",
    )?;
    let figures = draw_figures(
        opts,
        out,
        &passes,
        &rollout_lp,
        (&dense_pass, &dense_lp, &dense_native),
        &moe,
        &repeat_rebatched,
    )?;
    timings.report_s = t0.elapsed().as_secs_f64();

    let summary = AnalysisSummary {
        version: SUMMARY_VERSION,
        command: opts.command.clone(),
        seed: opts.seed,
        model: model_info(&opts.model, &inputs.cfg),
        prompts: inputs.prompts.source,
        rollout: RolloutInfo {
            dtype: opts.rollout_dtype.to_string(),
            device: opts.rollout_device.to_string(),
            temperature: opts.temperature,
            max_new_tokens: opts.max_new_tokens,
            samples: n,
            response_tokens: moe.native.metrics.num_tokens,
            routed_positions: routes.iter().map(RouteTable::num_tokens).sum(),
        },
        training_engine: format!(
            "r3-train policy scoring, {} on `{}`, {mb} sequences per call",
            precision_name(opts.train_precision),
            opts.train_device
        ),
        moe,
        dense: DenseSection {
            source: inputs.dense.source.clone(),
            response_tokens: dense_native.metrics.num_tokens,
            native: dense_native,
        },
        repeat_identical,
        repeat_rebatched,
        paper: PAPER,
        figures,
        timings,
    };
    write_samples(
        &out.join(SAMPLES_JSONL),
        &samples,
        &passes.native.logp,
        &passes.replay.logp,
    )?;
    write_summary(out, &summary)?;
    Ok(summary)
}
