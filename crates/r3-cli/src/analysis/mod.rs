//! The mismatch analysis behind `r3 analyze` (paper Section 3 and 4.3): rollouts from the
//! f16 rollout engine, the same tokens recomputed by the f32 training engine natively and with
//! R3 replay, a dense reference model, and two training passes compared with each other.
//! Writes `summary.json`, `summary.md` and the PNGs into one directory.

pub mod compare;
mod dense;
mod error;
mod figures;
mod prompts;
mod rollout;
mod stats;
mod summary;
mod training;

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::Device;
use indicatif::ProgressBar;
use r3_model::{Config, Model, Weights};
use r3_rollout::{Dtype, Engine, EngineConfig};
use r3_routing::RouteTable;

pub use error::AnalysisError;
pub use summary::AnalysisSummary;

use dense::DenseModel;
use rollout::{generate_samples, Sample, SamplingSetup};
use stats::{divergence_section, mismatch_section, scatter_points};
use summary::{
    DenseSection, ModelInfo, MoeSection, ReplayCheck, RolloutInfo, Timings, TwoPasses, PAPER,
    SUMMARY_VERSION,
};
use training::{training_pass, Batching, PassRouting};

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
    /// Seed of prompts, sampling and random dense weights.
    pub seed: u64,
    /// Output directory.
    pub out: PathBuf,
    /// The command line, recorded in the summary.
    pub command: String,
}

/// Loads a model's config and weights for the training engine.
fn load_training_model(dir: &Path) -> Result<(Config, Model), AnalysisError> {
    let cfg = Config::from_file(&dir.join("config.json")).map_err(AnalysisError::model(
        format!("reading {}/config.json", dir.display()),
    ))?;
    let weights = Weights::load(dir, &cfg, &Device::Cpu).map_err(AnalysisError::model(format!(
        "loading weights from {}",
        dir.display()
    )))?;
    let model =
        Model::new(&cfg, &weights).map_err(AnalysisError::model("building the training model"))?;
    Ok((cfg, model))
}

/// The f16 rollout engine config used for every rollout here.
fn engine_config() -> EngineConfig {
    EngineConfig {
        dtype: Dtype::F16,
        ..EngineConfig::default()
    }
}

/// Routes of every sample (present for an MoE model, checked in `generate_samples`).
fn rollout_routes(samples: &[Sample]) -> Result<Vec<RouteTable>, AnalysisError> {
    samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.routes
                .clone()
                .ok_or_else(|| AnalysisError::Invalid(format!("rollout {i} has no routes")))
        })
        .collect()
}

fn rollout_logps(samples: &[Sample]) -> Vec<Vec<f32>> {
    samples.iter().map(|s| s.rollout_logp.clone()).collect()
}

/// Writes every rollout's tokens and its three log-prob series, so that any number in the
/// summary can be recomputed from the raw values.
fn write_samples(
    path: &Path,
    samples: &[Sample],
    native: &[Vec<f32>],
    r3: &[Vec<f32>],
) -> Result<(), AnalysisError> {
    let mut text = String::new();
    for (i, s) in samples.iter().enumerate() {
        let line = serde_json::json!({
            "index": i,
            "prompt": s.prompt,
            "output": s.output,
            "rollout_logp": s.rollout_logp,
            "train_native_logp": native.get(i),
            "train_r3_logp": r3.get(i),
        });
        text.push_str(&serde_json::to_string(&line)?);
        text.push('\n');
    }
    std::fs::write(path, text).map_err(AnalysisError::io(path))
}

/// Runs the whole analysis and writes its files; returns the summary.
pub fn run_analysis(opts: &AnalyzeOptions) -> Result<AnalysisSummary, AnalysisError> {
    let out = opts.out.as_path();
    std::fs::create_dir_all(out).map_err(AnalysisError::io(out))?;
    let mut timings = Timings::default();
    let progress = ProgressBar::new(0);

    // MoE rollouts (f16 engine).
    let t0 = Instant::now();
    let (cfg, model) = load_training_model(&opts.model)?;
    if cfg.moe.is_none() {
        return Err(AnalysisError::Invalid(format!(
            "--model {} is a dense model; r3 analyze measures an MoE model (give the dense one \
             with --dense-model)",
            opts.model.display()
        )));
    }
    // The dense reference is loaded (and checked) before any long work.
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
    let setup = SamplingSetup {
        temperature: opts.temperature,
        max_new_tokens: opts.max_new_tokens,
        seed: opts.seed,
    };
    let samples = {
        let mut engine = Engine::from_dir(&opts.model, engine_config())?;
        generate_samples(&mut engine, &prompts.ids, setup, &progress)?
    };
    timings.rollout_s = t0.elapsed().as_secs_f64();
    tracing::info!(
        samples = samples.len(),
        secs = timings.rollout_s,
        "rollouts done"
    );

    // Training passes (f32): native (recorded), R3 replay, the same again, re-batched.
    let t0 = Instant::now();
    let n = samples.len();
    let mb = opts.micro_batch;
    let in_order = Batching::in_order(n, mb);
    let rebatched = Batching {
        order: (0..n).rev().collect(),
        micro_batch: if mb > 1 { 1 } else { n.max(2) },
    };
    let native = training_pass(
        &model,
        &samples,
        PassRouting::NativeRecorded,
        &in_order,
        &progress,
        "training pass: native",
    )?;
    let replay = training_pass(
        &model,
        &samples,
        PassRouting::ReplayRollout,
        &in_order,
        &progress,
        "training pass: R3 replay",
    )?;
    let again = training_pass(
        &model,
        &samples,
        PassRouting::NativeRecorded,
        &in_order,
        &progress,
        "training pass: repeat",
    )?;
    let other = training_pass(
        &model,
        &samples,
        PassRouting::NativeRecorded,
        &rebatched,
        &progress,
        "training pass: re-batched",
    )?;
    timings.training_passes_s = t0.elapsed().as_secs_f64();
    drop(model);

    // Dense reference.
    let t0 = Instant::now();
    let dense_samples = {
        let mut engine = Engine::new(
            dense.config.clone(),
            dense.weights.tensors(),
            engine_config(),
        )?;
        generate_samples(&mut engine, &prompts.ids, setup, &progress)?
    };
    let dense_model = Model::new(&dense.config, &dense.weights)
        .map_err(AnalysisError::model("building the dense training model"))?;
    let dense_pass = training_pass(
        &dense_model,
        &dense_samples,
        PassRouting::NativeRecorded,
        &in_order,
        &progress,
        "training pass: dense",
    )?;
    timings.dense_s = t0.elapsed().as_secs_f64();

    // Statistics and figures.
    let t0 = Instant::now();
    let rollout_lp = rollout_logps(&samples);
    let dense_lp = rollout_logps(&dense_samples);
    let routes = rollout_routes(&samples)?;
    let native_routes = native
        .routes
        .clone()
        .ok_or_else(|| AnalysisError::Invalid("native pass recorded no routes".into()))?;
    let again_routes = again
        .routes
        .clone()
        .ok_or_else(|| AnalysisError::Invalid("repeat pass recorded no routes".into()))?;
    let other_routes = other
        .routes
        .clone()
        .ok_or_else(|| AnalysisError::Invalid("re-batched pass recorded no routes".into()))?;

    let moe_native = mismatch_section(&native.logp, &rollout_lp, "MoE native vs rollout")?;
    let moe_r3 = mismatch_section(&replay.logp, &rollout_lp, "MoE R3 vs rollout")?;
    let dense_native = mismatch_section(&dense_pass.logp, &dense_lp, "dense vs rollout")?;
    let routing_divergence =
        divergence_section(&routes, &native_routes, "rollout vs training routes")?;
    let rollout_routers: usize = routes
        .iter()
        .map(|t| t.num_tokens() * t.num_columns())
        .sum();
    let totals = replay.replay.unwrap_or_default();
    let r3_routing = ReplayCheck {
        differing_routers: 0,
        rollout_routers,
        all_replayed: totals.replayed_cells == rollout_routers && totals.native_cells == 0,
        totals,
    };
    if !r3_routing.all_replayed {
        return Err(AnalysisError::Invalid(format!(
            "R3 replayed {} routers and left {} native, but the rollout routes cover {rollout_routers}",
            totals.replayed_cells, totals.native_cells
        )));
    }
    let repeat_identical = TwoPasses {
        description: format!("the same {n} sequences, same order, {mb} per forward call, twice"),
        mismatch: mismatch_section(&again.logp, &native.logp, "repeat vs first pass")?,
        routing_divergence: divergence_section(
            &native_routes,
            &again_routes,
            "first vs repeat routes",
        )?,
    };
    let repeat_rebatched = TwoPasses {
        description: format!(
            "first pass: {n} sequences in order, {mb} per forward call (right-padded); second \
             pass: reversed order, {} per call — different batch composition and padding",
            rebatched.micro_batch
        ),
        mismatch: mismatch_section(&other.logp, &native.logp, "re-batched vs first pass")?,
        routing_divergence: divergence_section(
            &native_routes,
            &other_routes,
            "first vs re-batched routes",
        )?,
    };

    let mut index = figures::FigureIndex::new();
    let prob_axes = (
        "rollout engine probability (f16)",
        "training engine probability (f32)",
    );
    figures::scatter(
        &mut index,
        out,
        "fig2a_moe_native",
        "MoE: training vs rollout probability (no replay)",
        prob_axes,
        &scatter_points(&native.logp, &rollout_lp),
    )?;
    figures::scatter(
        &mut index,
        out,
        "fig2b_moe_r3",
        "MoE + R3: training vs rollout probability",
        prob_axes,
        &scatter_points(&replay.logp, &rollout_lp),
    )?;
    figures::scatter(
        &mut index,
        out,
        "fig2c_dense",
        "Dense: training vs rollout probability",
        prob_axes,
        &scatter_points(&dense_pass.logp, &dense_lp),
    )?;
    figures::f_tau(
        &mut index,
        out,
        "fig2d_f_tau",
        &[
            ("MoE", &moe_native.f_tau),
            ("MoE + R3", &moe_r3.f_tau),
            ("dense", &dense_native.f_tau),
        ],
    )?;
    figures::divergence(
        &mut index,
        out,
        "fig3",
        "rollout vs training routes",
        &routing_divergence,
    )?;
    figures::per_layer(
        &mut index,
        out,
        "fig3d_per_layer",
        &[
            ("rollout vs training", &routing_divergence),
            (
                "training pass vs re-batched pass",
                &repeat_rebatched.routing_divergence,
            ),
        ],
    )?;
    figures::scatter(
        &mut index,
        out,
        "fig4_two_passes",
        "Two training passes (different batching)",
        ("first pass probability", "re-batched pass probability"),
        &scatter_points(&other.logp, &native.logp),
    )?;
    timings.report_s = t0.elapsed().as_secs_f64();

    let summary = AnalysisSummary {
        version: SUMMARY_VERSION,
        command: opts.command.clone(),
        seed: opts.seed,
        model: ModelInfo {
            dir: opts.model.clone(),
            model_type: cfg.architecture.model_type().to_string(),
            num_hidden_layers: cfg.num_hidden_layers,
            moe_layers: cfg.layer_layout().moe_layers().to_vec(),
            num_experts: cfg.num_experts(),
            top_k: cfg.top_k(),
            hidden_size: cfg.hidden_size,
            vocab_size: cfg.vocab_size,
        },
        prompts: prompts.source,
        rollout: RolloutInfo {
            dtype: Dtype::F16.to_string(),
            temperature: opts.temperature,
            max_new_tokens: opts.max_new_tokens,
            samples: n,
            response_tokens: moe_native.metrics.num_tokens,
            routed_positions: routes.iter().map(RouteTable::num_tokens).sum(),
        },
        training_engine: format!("r3-model f32 training forward, {mb} sequences per call"),
        moe: MoeSection {
            k3_kl_reduction_factor: (moe_r3.metrics.k3_kl > 0.0)
                .then(|| moe_native.metrics.k3_kl / moe_r3.metrics.k3_kl),
            native: moe_native,
            r3: moe_r3,
            routing_divergence,
            r3_routing,
        },
        dense: DenseSection {
            source: dense.source.clone(),
            response_tokens: dense_native.metrics.num_tokens,
            native: dense_native,
        },
        repeat_identical,
        repeat_rebatched,
        paper: PAPER,
        figures: index,
        timings,
    };
    write_samples(
        &out.join(SAMPLES_JSONL),
        &samples,
        &native.logp,
        &replay.logp,
    )?;
    let json_path = out.join(SUMMARY_JSON);
    std::fs::write(&json_path, serde_json::to_string_pretty(&summary)? + "\n")
        .map_err(AnalysisError::io(&json_path))?;
    let md_path = out.join(SUMMARY_MD);
    std::fs::write(&md_path, summary.to_markdown()).map_err(AnalysisError::io(&md_path))?;
    Ok(summary)
}
