//! The shape of `summary.json` (every number `r3 analyze` measured, with what produced it)
//! and its short Markdown rendering `summary.md`, which sets r3's figures beside the paper's.

use std::path::PathBuf;

use serde::Serialize;

use super::dense::DenseSource;
use super::figures::FigureIndex;
use super::prompts::PromptSource;
use super::stats::{DivergenceSection, MismatchSection};
use super::training::ReplayTotals;

/// Version of the summary.json layout.
pub const SUMMARY_VERSION: u32 = 1;

/// The paper's Section 3 / 4.3 numbers (Qwen3-30B-A3B on SGLang vs Megatron), for comparison.
#[derive(Debug, Clone, Serialize)]
pub struct PaperReference {
    /// k3 KL, MoE, no replay.
    pub k3_kl_moe: f64,
    /// k3 KL, MoE with R3.
    pub k3_kl_moe_r3: f64,
    /// k3 KL, dense Qwen3-8B.
    pub k3_kl_dense: f64,
    /// Fraction of routers choosing different experts (Fig. 3a).
    pub router_diff_fraction: f64,
    /// Fraction of tokens with at least one differing layer (Fig. 3b).
    pub token_diff_fraction: f64,
    /// Typical per-sequence mean of differing routers per token (Fig. 3c).
    pub mean_seq_diff_routers_per_token: f64,
    /// k3 KL between two Megatron passes over the same sequences (Fig. 4).
    pub two_pass_k3_kl: f64,
}

/// The paper's figures.
pub const PAPER: PaperReference = PaperReference {
    k3_kl_moe: 1.535e-3,
    k3_kl_moe_r3: 7.5e-4,
    k3_kl_dense: 6.4e-4,
    router_diff_fraction: 0.10,
    token_diff_fraction: 0.94,
    mean_seq_diff_routers_per_token: 6.0,
    two_pass_k3_kl: 8.4e-4,
};

/// The analysed model.
#[derive(Debug, Clone, Serialize)]
pub struct ModelInfo {
    /// Checkpoint directory.
    pub dir: PathBuf,
    /// HF model_type.
    pub model_type: String,
    /// Transformer layers.
    pub num_hidden_layers: usize,
    /// Global indices of the MoE layers.
    pub moe_layers: Vec<usize>,
    /// Routed experts per MoE layer.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Vocabulary.
    pub vocab_size: usize,
}

/// How the rollouts were made.
#[derive(Debug, Clone, Serialize)]
pub struct RolloutInfo {
    /// Engine precision ("f16").
    pub dtype: String,
    /// Which engine and where (`cpu` = the CPU engine, `cpu-candle`, `cuda:N` = the
    /// device engine).
    pub device: String,
    /// Sampling temperature.
    pub temperature: f32,
    /// Most generated tokens per prompt.
    pub max_new_tokens: usize,
    /// Rollouts (one per prompt).
    pub samples: usize,
    /// Response tokens compared (the mismatch statistics' |T|).
    pub response_tokens: usize,
    /// Prompt + response positions whose routes were compared.
    pub routed_positions: usize,
}

/// R3's replayed forward against the rollout routes.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayCheck {
    /// Routers whose replayed experts differ from the rollout's: 0 by construction, because
    /// r3-model verifies every replayed cell against the given table and errors otherwise.
    pub differing_routers: usize,
    /// Routers the rollout routes cover.
    pub rollout_routers: usize,
    /// Every rollout router was replayed (none left to native routing).
    pub all_replayed: bool,
    /// r3-model's replay evidence.
    pub totals: ReplayTotals,
}

/// The MoE model's training–inference mismatch with and without R3.
#[derive(Debug, Clone, Serialize)]
pub struct MoeSection {
    /// Training engine (native routing) vs rollout engine (Fig. 2a).
    pub native: MismatchSection,
    /// Training engine replaying the rollout routes (R3) vs rollout engine (Fig. 2b).
    pub r3: MismatchSection,
    /// `native.k3_kl / r3.k3_kl` (None when R3's KL is 0).
    pub k3_kl_reduction_factor: Option<f64>,
    /// Rollout routes vs the training engine's native routes (Fig. 3).
    pub routing_divergence: DivergenceSection,
    /// R3: replayed routes vs rollout routes.
    pub r3_routing: ReplayCheck,
}

/// The dense reference point.
#[derive(Debug, Clone, Serialize)]
pub struct DenseSection {
    /// Where the dense model came from.
    pub source: DenseSource,
    /// Its rollout (f16) vs training (f32) mismatch (Fig. 2c).
    pub native: MismatchSection,
    /// Response tokens compared.
    pub response_tokens: usize,
}

/// Two training-engine passes over the same rollouts (Fig. 4).
#[derive(Debug, Clone, Serialize)]
pub struct TwoPasses {
    /// What differed between the passes.
    pub description: String,
    /// Second pass (as "training") vs first pass (as "rollout").
    pub mismatch: MismatchSection,
    /// Routes of the first vs the second pass.
    pub routing_divergence: DivergenceSection,
}

/// Seconds spent per stage.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Timings {
    /// MoE rollouts.
    pub rollout_s: f64,
    /// All MoE training passes.
    pub training_passes_s: f64,
    /// Dense rollouts and training pass.
    pub dense_s: f64,
    /// Statistics and figures.
    pub report_s: f64,
}

/// Everything `r3 analyze` writes to summary.json.
#[derive(Debug, Clone, Serialize)]
pub struct AnalysisSummary {
    /// Layout version.
    pub version: u32,
    /// The command line that produced this file.
    pub command: String,
    /// Seed of prompts, sampling and random dense weights.
    pub seed: u64,
    /// The MoE model.
    pub model: ModelInfo,
    /// The prompts.
    pub prompts: PromptSource,
    /// The rollouts.
    pub rollout: RolloutInfo,
    /// Training engine precision and micro-batch.
    pub training_engine: String,
    /// MoE mismatch with and without R3, routing divergence.
    pub moe: MoeSection,
    /// Dense reference.
    pub dense: DenseSection,
    /// Two identical training passes (same batches, same order).
    pub repeat_identical: TwoPasses,
    /// Two training passes with different batch composition and order.
    pub repeat_rebatched: TwoPasses,
    /// The paper's numbers for comparison.
    pub paper: PaperReference,
    /// PNGs written or skipped.
    pub figures: FigureIndex,
    /// Time per stage.
    pub timings: Timings,
}

/// Scientific notation with 3 significant digits.
fn sci(v: f64) -> String {
    format!("{v:.3e}")
}

/// Percentage with 2 decimals.
fn pct(v: f64) -> String {
    format!("{:.2}%", 100.0 * v)
}

/// What the summary's k3 KL is: its direction and its temperature.
pub const KL_NOTE: &str = "k3 KL estimates KL(π_rollout ‖ π_train): tokens sampled from the \
    rollout, mean(r − 1 − ln r) with r = π_train / π_rollout (the paper's eq. 2, which it \
    labels D_KL(π_train ‖ π_infer)), between the raw temperature-1 distributions whatever the \
    sampling temperature. An RL run's `mismatch.k3_kl` compares them at the rollout \
    temperature instead, so the two differ at T ≠ 1.\n\n";

impl AnalysisSummary {
    /// The short Markdown summary: r3's numbers beside the paper's.
    pub fn to_markdown(&self) -> String {
        let m = &self.moe;
        let d = &m.routing_divergence.summary;
        let mut s = String::new();
        s.push_str("# r3 analyze — training–inference mismatch\n\n");
        s.push_str(&format!("Command: `{}`\n\n", self.command));
        s.push_str(&format!(
            "Model `{}` ({}, {} layers, {} experts, top-{}); {} rollouts, {} response tokens; \
             rollout engine {} on `{}` (temperature {}), training engine {}.\n\n",
            self.model.dir.display(),
            self.model.model_type,
            self.model.num_hidden_layers,
            self.model.num_experts,
            self.model.top_k,
            self.rollout.samples,
            self.rollout.response_tokens,
            self.rollout.dtype,
            self.rollout.device,
            self.rollout.temperature,
            self.training_engine,
        ));
        s.push_str(KL_NOTE);
        s.push_str("| quantity | r3 | paper (Qwen3-30B-A3B / Qwen3-8B) |\n|---|---|---|\n");
        let rows = [
            (
                "k3 KL, MoE, no replay",
                sci(m.native.metrics.k3_kl),
                sci(PAPER.k3_kl_moe),
            ),
            (
                "k3 KL, MoE + R3",
                sci(m.r3.metrics.k3_kl),
                sci(PAPER.k3_kl_moe_r3),
            ),
            (
                "k3 KL, dense",
                sci(self.dense.native.metrics.k3_kl),
                sci(PAPER.k3_kl_dense),
            ),
            (
                "F(τ=2), MoE / MoE + R3 / dense",
                format!(
                    "{} / {} / {}",
                    sci(m.native.metrics.extreme_frac_tau2),
                    sci(m.r3.metrics.extreme_frac_tau2),
                    sci(self.dense.native.metrics.extreme_frac_tau2)
                ),
                "MoE ≈ 10× dense for τ > 2".to_string(),
            ),
            (
                "routers that differ (Fig. 3a)",
                pct(d.router_diff_fraction),
                pct(PAPER.router_diff_fraction),
            ),
            (
                "tokens with ≥ 1 differing layer (Fig. 3b)",
                pct(d.token_diff_fraction),
                pct(PAPER.token_diff_fraction),
            ),
            (
                "mean differing routers per token, per sequence (Fig. 3c)",
                format!("{:.3}", d.mean_seq_diff_layers_per_token),
                format!("≈ {}", PAPER.mean_seq_diff_routers_per_token),
            ),
            (
                "R3: routers differing from the rollout",
                format!(
                    "{} of {}",
                    m.r3_routing.differing_routers, m.r3_routing.rollout_routers
                ),
                "0 (by design)".to_string(),
            ),
            (
                "two identical training passes: k3 KL",
                format!(
                    "{} (bitwise identical: {})",
                    sci(self.repeat_identical.mismatch.metrics.k3_kl),
                    self.repeat_identical.mismatch.bitwise_identical
                ),
                sci(PAPER.two_pass_k3_kl),
            ),
            (
                "two re-batched training passes: k3 KL",
                format!(
                    "{} (tokens differing: {}, routers differing: {})",
                    sci(self.repeat_rebatched.mismatch.metrics.k3_kl),
                    self.repeat_rebatched.mismatch.differing_tokens,
                    pct(self
                        .repeat_rebatched
                        .routing_divergence
                        .summary
                        .router_diff_fraction)
                ),
                sci(PAPER.two_pass_k3_kl),
            ),
        ];
        for (what, ours, paper) in rows {
            s.push_str(&format!("| {what} | {ours} | {paper} |\n"));
        }
        s.push_str(&format!(
            "\nDense reference: {}.\nRe-batched passes: {}.\n",
            match &self.dense.source {
                DenseSource::Checkpoint { dir } => format!("checkpoint `{}`", dir.display()),
                DenseSource::RandomInit {
                    seed,
                    intermediate_size,
                    model_type,
                } => format!(
                    "{model_type} with MLP width {intermediate_size} (= active expert width), \
                     seeded random weights (seed {seed}), not trained"
                ),
            },
            self.repeat_rebatched.description
        ));
        s
    }
}
