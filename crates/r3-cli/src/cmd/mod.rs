//! Command-line surface of `r3`: the top-level `Cli`, the `Command` enum and its dispatch.
//! Each command lives in its own file `cmd/<name>.rs` exposing an `Args` struct and `run`.
//! To add a command: one `mod` line, one `Command` variant, one match arm in `run`.

mod analyze;
mod bench;
mod bench_decode;
mod bench_fleet;
mod bench_optim;
mod bench_reliability;
mod bench_rollout;
mod bench_routes;
mod bench_step;
mod bench_train;
mod bench_train_parts;
mod compare;
mod cpu_time;
mod data;
mod eval;
mod fleet;
mod forward;
mod generate;
mod matmul_work;
mod pretrain;
mod progress;
mod report;
mod routes;
mod serve;
mod step_phases;
mod train;

use std::path::Path;

use anyhow::Context;
use clap::{Parser, Subcommand};
use r3_text::TextTokenizer;

/// r3: RL for Mixture-of-Experts language models with Rollout Routing Replay.
#[derive(Debug, Parser)]
#[command(name = "r3", version, about, long_about = None)]
pub struct Cli {
    /// Log filter for stderr (tracing EnvFilter syntax, e.g. `info`, `r3_train=debug`).
    #[arg(long, global = true, default_value = "info")]
    pub log: String,
    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Decode, encode and compare routed-expert tables (SGLang / vLLM / r3 formats).
    #[command(subcommand)]
    Routes(routes::RoutesCommand),
    /// Speed benchmarks that print figures (never asserted in tests).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Plots and summarises RL run directories: one HTML page, PNGs and a results table.
    Report(report::ReportArgs),
    /// Training–inference mismatch of an MoE model with and without R3 (paper Section 3).
    Analyze(analyze::AnalyzeArgs),
    /// No replay vs R2 vs R3 (± TIS, GSPO) from one config and seed, then a Table-1 report.
    Compare(compare::CompareArgs),
    /// Supervised pretraining of the small MoE base model on worked arithmetic.
    Pretrain(pretrain::PretrainArgs),
    /// Held-out evaluation of a model or checkpoint without training (mean@k, pass@k, maj@k
    /// with standard errors; paired difference against a baseline evaluation).
    Eval(eval::EvalArgs),
    /// RL with router replay (disabled | R2 | R3); no arguments = the default experiment.
    Train(train::TrainArgs),
    /// RL datasets: show rows as the trainer sees them (prompt, ids, reward); generate the
    /// GSM8K-format word-problem dataset.
    #[command(subcommand)]
    Data(data::DataCommand),
    /// Generate with the rollout engine: output ids, log-probs and routes as JSON.
    Generate(generate::GenerateArgs),
    /// One training-engine forward pass: logits and recorded (or replayed) routes as JSON.
    Forward(forward::ForwardArgs),
    /// HTTP server: SGLang /generate (routed_experts), OpenAI /v1/completions, weight updates.
    Serve(serve::ServeArgs),
    /// Starts N local `r3 serve` workers for `rollout.backend = "sglang"` (Ctrl-C stops them).
    Fleet(fleet::FleetArgs),
}

/// Runs one parsed command. A command that computes on its own thread (training,
/// generation, analysis, the benchmarks) runs with this thread as worker 0 of a rayon pool
/// built for it, so each parallel op's tasks start on this thread's own queue and it works
/// beside the other workers; called from outside a pool, every op was handed across to the
/// pool's threads while this thread slept, and woken again (measured: ≈ 10% of a
/// gsm8k-style RL step on 2 cores). This thread rather than a fresh one: its allocations
/// stay in glibc's main arena, which `allocator::keep_freed_buffers` keeps whole — a
/// thread's arena gives a heap back to the kernel as soon as it empties, and the mid
/// config's training step then spent its time faulting fresh pages in (73% → 52–58% of the
/// GEMM peak). `serve` and `fleet` stay off the pool: their engines run on threads of their
/// own, each worker 0 of its own pool (`r3_server`'s engine worker).
pub fn run(command: Command) -> anyhow::Result<()> {
    if matches!(command, Command::Serve(_) | Command::Fleet(_)) {
        return dispatch(command);
    }
    // Dropped on this thread, at the end of this call, as a pool this thread works in
    // must be.
    let pool = rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("r3-compute-{i}"))
        .use_current_thread()
        .build()
        .context("starting the compute thread pool")?;
    pool.install(|| dispatch(command))
}

/// Runs one parsed command on this thread.
fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Routes(c) => routes::run(c),
        Command::Bench(c) => bench::run(c),
        Command::Generate(a) => generate::run(a),
        Command::Report(a) => report::run(a),
        Command::Analyze(a) => analyze::run(a),
        Command::Compare(a) => compare::run(a),
        Command::Pretrain(a) => pretrain::run(a),
        Command::Train(a) => train::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Data(c) => data::run(c),
        Command::Forward(a) => forward::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Fleet(a) => fleet::run(a),
    }
}

/// The tokenizer of model directory `dir` when it has a `tokenizer.json`, checked to fit the
/// model's `vocab_size` ids (a mismatched one is refused before anything runs).
pub fn model_tokenizer(dir: &Path, vocab_size: usize) -> anyhow::Result<Option<TextTokenizer>> {
    if !dir.join("tokenizer.json").is_file() {
        return Ok(None);
    }
    let mut tok = TextTokenizer::from_model_dir(dir)
        .with_context(|| format!("tokenizer of {}", dir.display()))?;
    tok.fit_model(vocab_size)
        .with_context(|| format!("model directory {}", dir.display()))?;
    Ok(Some(tok))
}
