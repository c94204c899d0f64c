//! The precision grid of `r3 analyze --grid`: rollout engine {f16, bf16} × training engine
//! {f32, bf16} × {no replay, R3} on the same prompts and seeds, one table of the paper's
//! mismatch measures (k3 KL, F(τ = 2), F(τ = 5), differing routers and tokens, mean differing
//! routers per token) beside the published figures. Writes `grid.json` and `grid.md`.

use std::path::Path;
use std::time::Instant;

use indicatif::ProgressBar;
use r3_model::Precision;
use r3_rollout::Dtype;
use r3_routing::mismatch::mismatch_metrics;
use r3_train::rl::sampling::{rollout_tables, RolloutSample};
use serde::Serialize;

use super::rollout::{generate_samples, SamplingSetup};
use super::stats::divergence_section;
use super::summary::{ModelInfo, PaperReference, PAPER};
use super::training::{training_pass, Batching, PassRouting};
use super::{
    load_inputs, load_training_model, model_info, precision_name, recorded_routes, replay_check,
    rollout_engine, rollout_logps, AnalyzeOptions,
};
use crate::AnalysisError;

/// File name of the grid's JSON table.
pub const GRID_JSON: &str = "grid.json";
/// File name of the grid's Markdown table.
pub const GRID_MD: &str = "grid.md";

/// One cell: a rollout precision, a training precision, with or without R3.
#[derive(Debug, Clone, Serialize)]
pub struct GridCell {
    /// Rollout engine precision.
    pub rollout_dtype: String,
    /// Training forward precision.
    pub train_dtype: String,
    /// Whether the training pass replayed the rollout routes (R3).
    pub r3: bool,
    /// Response tokens compared.
    pub tokens: usize,
    /// k3 estimate of KL(π_rollout ‖ π_train) per token (raw T = 1 distributions).
    pub k3_kl: f64,
    /// Fraction of tokens whose probability ratio is beyond 2 either way.
    pub f_tau_2: f64,
    /// Fraction of tokens whose probability ratio is beyond 5 either way.
    pub f_tau_5: f64,
    /// Fraction of (token, MoE layer) routers whose training experts differ from the
    /// rollout's (0 under R3: every replayed router was verified to use the rollout experts).
    pub router_diff_fraction: f64,
    /// Fraction of tokens with at least one differing router.
    pub token_diff_fraction: f64,
    /// Mean over sequences of the mean number of differing routers per token.
    pub mean_diff_routers_per_token: f64,
}

/// Figures of a peer engine quoted in r3's issue tracker: HF transformers on one checkpoint and
/// the same sequences, bf16 (or full f16) against itself in f32.
#[derive(Debug, Clone, Serialize)]
pub struct PeerReference {
    /// Where the numbers come from.
    pub source: &'static str,
    /// bf16 vs f32: routers that differ.
    pub bf16_router_diff_fraction: f64,
    /// bf16 vs f32: tokens with a differing router.
    pub bf16_token_diff_fraction: f64,
    /// bf16 vs f32: k3 KL.
    pub bf16_k3_kl: f64,
    /// full f16 vs f32: routers that differ.
    pub f16_router_diff_fraction: f64,
    /// full f16 vs f32: tokens with a differing router.
    pub f16_token_diff_fraction: f64,
}

/// The peer-engine figures (HF transformers, bf16 / f16 against f32).
pub const PEER: PeerReference = PeerReference {
    source: "HF transformers, bf16 (or f16 activations too) vs f32, same checkpoint and sequences",
    bf16_router_diff_fraction: 0.011,
    bf16_token_diff_fraction: 0.041,
    bf16_k3_kl: 1.5e-2,
    f16_router_diff_fraction: 0.008,
    f16_token_diff_fraction: 0.030,
};

/// The whole grid.
#[derive(Debug, Clone, Serialize)]
pub struct GridSummary {
    /// The command line.
    pub command: String,
    /// Seed of prompts and sampling.
    pub seed: u64,
    /// The analysed model.
    pub model: ModelInfo,
    /// Rollouts per rollout precision (one per prompt).
    pub samples: usize,
    /// Rollout sampling temperature.
    pub temperature: f32,
    /// Cells in table order.
    pub cells: Vec<GridCell>,
    /// The R3 paper's figures (Qwen3-30B-A3B, SGLang vs Megatron, bf16 both sides).
    pub paper: PaperReference,
    /// Peer-engine figures.
    pub peer: PeerReference,
    /// Wall time of the grid in seconds.
    pub seconds: f64,
}

/// The native and R3 cells of one (rollout, training) precision pair.
fn cells_for(
    opts: &AnalyzeOptions,
    samples: &[RolloutSample],
    rollout_dtype: Dtype,
    precision: Precision,
    progress: &ProgressBar,
) -> Result<[GridCell; 2], AnalysisError> {
    let (_, model) = load_training_model(&opts.model, precision, opts.train_device)?;
    let batching = Batching::in_order(
        samples.len(),
        opts.micro_batch,
        opts.max_tokens_per_micro_batch,
    );
    let label = format!("{rollout_dtype}/{}", precision_name(precision));
    let native = training_pass(
        &model,
        samples,
        PassRouting::NativeRecorded,
        &batching,
        progress,
        &format!("{label} native"),
    )?;
    let replay = training_pass(
        &model,
        samples,
        PassRouting::ReplayRollout,
        &batching,
        progress,
        &format!("{label} R3"),
    )?;
    let rollout_lp = rollout_logps(samples);
    let routes = rollout_tables(samples)?;
    let div = divergence_section(
        &routes,
        recorded_routes(&native, "native")?,
        "rollout vs training routes",
    )?;
    // Errors unless every rollout router was replayed and verified used.
    replay_check(&replay, &routes)?;
    let cell = |logp: &[Vec<f32>], r3: bool| -> Result<GridCell, AnalysisError> {
        let metrics = mismatch_metrics(&logp.concat(), &rollout_lp.concat(), None)
            .map_err(AnalysisError::route(format!("{label} k3 KL")))?;
        let s = &div.summary;
        let routing = |v: f64| if r3 { 0.0 } else { v };
        Ok(GridCell {
            rollout_dtype: rollout_dtype.to_string(),
            train_dtype: precision_name(precision).to_string(),
            r3,
            tokens: metrics.num_tokens,
            k3_kl: metrics.k3_kl,
            f_tau_2: metrics.extreme_frac_tau2,
            f_tau_5: metrics.extreme_frac_tau5,
            router_diff_fraction: routing(s.router_diff_fraction),
            token_diff_fraction: routing(s.token_diff_fraction),
            mean_diff_routers_per_token: routing(s.mean_seq_diff_layers_per_token),
        })
    };
    Ok([cell(&native.logp, false)?, cell(&replay.logp, true)?])
}

/// Runs the grid over `rollout_dtypes` × `precisions` × {no replay, R3} and writes
/// `grid.json` and `grid.md` into `opts.out`. The rollouts of one rollout precision are
/// shared by every training precision; prompts and sampling seeds are the same throughout.
pub fn run_grid(
    opts: &AnalyzeOptions,
    rollout_dtypes: &[Dtype],
    precisions: &[Precision],
) -> Result<GridSummary, AnalysisError> {
    let started = Instant::now();
    let out = opts.out.as_path();
    std::fs::create_dir_all(out).map_err(AnalysisError::io(out))?;
    let inputs = load_inputs(opts)?;
    drop(inputs.model);
    let setup = SamplingSetup {
        temperature: opts.temperature,
        max_new_tokens: opts.max_new_tokens,
        seed: opts.seed,
    };
    let progress = ProgressBar::hidden();
    let mut cells = Vec::new();
    let mut samples_per_dtype = 0;
    for &dtype in rollout_dtypes {
        let cell_opts = AnalyzeOptions {
            rollout_dtype: dtype,
            ..opts.clone()
        };
        let samples = {
            let mut engine = rollout_engine(&cell_opts)?;
            generate_samples(&mut engine, &inputs.prompts.ids, setup)?
        };
        samples_per_dtype = samples.len();
        for &precision in precisions {
            let t0 = Instant::now();
            cells.extend(cells_for(opts, &samples, dtype, precision, &progress)?);
            tracing::info!(
                rollout = %dtype,
                train = precision_name(precision),
                secs = t0.elapsed().as_secs_f64(),
                "grid cell done"
            );
        }
    }
    let summary = GridSummary {
        command: opts.command.clone(),
        seed: opts.seed,
        model: model_info(&opts.model, &inputs.cfg),
        samples: samples_per_dtype,
        temperature: opts.temperature,
        cells,
        paper: PAPER,
        peer: PEER,
        seconds: started.elapsed().as_secs_f64(),
    };
    write_grid(out, &summary)?;
    Ok(summary)
}

fn write_grid(out: &Path, summary: &GridSummary) -> Result<(), AnalysisError> {
    let json_path = out.join(GRID_JSON);
    std::fs::write(&json_path, serde_json::to_string_pretty(summary)? + "\n")
        .map_err(AnalysisError::io(&json_path))?;
    let md_path = out.join(GRID_MD);
    std::fs::write(&md_path, summary.to_markdown()).map_err(AnalysisError::io(&md_path))
}

fn pct(v: f64) -> String {
    format!("{:.3}%", v * 100.0)
}

impl GridSummary {
    /// The table with the reference rows, as Markdown.
    pub fn to_markdown(&self) -> String {
        let m = &self.model;
        let mut s = format!(
            "# Precision grid: rollout vs training mismatch\n\n\
             Model `{}` ({}, {} layers, {} experts top-{}), {} rollouts per rollout precision \
             at temperature {}, seed {}.\n\n\
             | rollout | training | replay | tokens | k3 KL | F(τ=2) | F(τ=5) | routers differ | \
             tokens differ | differing routers / token |\n\
             |---|---|---|---:|---:|---:|---:|---:|---:|---:|\n",
            m.dir.display(),
            m.model_type,
            m.num_hidden_layers,
            m.num_experts,
            m.top_k,
            self.samples,
            self.temperature,
            self.seed
        );
        for c in &self.cells {
            s += &format!(
                "| {} | {} | {} | {} | {:.3e} | {} | {} | {} | {} | {:.3} |\n",
                c.rollout_dtype,
                c.train_dtype,
                if c.r3 { "R3" } else { "none" },
                c.tokens,
                c.k3_kl,
                pct(c.f_tau_2),
                pct(c.f_tau_5),
                pct(c.router_diff_fraction),
                pct(c.token_diff_fraction),
                c.mean_diff_routers_per_token
            );
        }
        let p = &self.paper;
        s += &format!(
            "| R3 paper (SGLang bf16 / Megatron bf16, Qwen3-30B-A3B) | | none | | {:.3e} | – | – | \
             {} | {} | ≈{:.0} |\n\
             | R3 paper | | R3 | | {:.3e} | – | – | 0 | 0 | 0 |\n",
            p.k3_kl_moe,
            pct(p.router_diff_fraction),
            pct(p.token_diff_fraction),
            p.mean_seq_diff_routers_per_token,
            p.k3_kl_moe_r3
        );
        let q = &self.peer;
        s += &format!(
            "| peer engine bf16 vs f32 ({}) | | none | | {:.1e} | – | – | {} | {} | – |\n\
             | peer engine full f16 vs f32 | | none | | – | – | – | {} | {} | – |\n",
            q.source,
            q.bf16_k3_kl,
            pct(q.bf16_router_diff_fraction),
            pct(q.bf16_token_diff_fraction),
            pct(q.f16_router_diff_fraction),
            pct(q.f16_token_diff_fraction),
        );
        s += "\nThe FP16 paper (\"Defeating the Training-Inference Mismatch via FP16\") reports \
              that FP16 on both sides removes most of the bf16 mismatch; compare the f16 rows \
              with the bf16 rows. Under R3 the routers are replayed (verified used), so their \
              differences are 0 by construction; what remains is the numeric mismatch.\n";
        s += &format!("\nWall time: {:.1} s.\n", self.seconds);
        s
    }
}
