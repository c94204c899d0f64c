//! `r3 bench ...`: the benchmark subcommands. Each benchmark lives in its own file
//! `cmd/bench_<name>.rs`; add one variant and one match arm here.

use clap::Subcommand;

use super::{bench_rollout, bench_routes};

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Route wire-format decode speed (MB/s) and size (bytes per token), per format.
    Routes(bench_routes::BenchRoutesArgs),
    /// Rollout engine generation throughput (tokens/s), capture on/off, prefix cache.
    Rollout(bench_rollout::BenchRolloutArgs),
    /// Decode throughput (tokens/s) of the device engine (`--device cuda`, `cpu-candle`) or
    /// the CPU engine at batch 1 / 64 / 256, with the share spent on route capture.
    Decode(super::bench_decode::BenchDecodeArgs),
    /// Training forward+backward throughput (tokens/s), Native vs Replay routing.
    Train(super::bench_train::BenchTrainArgs),
    /// Whole RL steps of a config: per phase time, share, matrix work, share of the
    /// machine's measured limit and memory high-water mark.
    Step(super::bench_step::BenchStepArgs),
    /// Rollout through 1 and 2 local HTTP workers vs the in-process engine: overhead per token.
    Fleet(super::bench_fleet::BenchFleetArgs),
    /// Reliability suite: load, slowloris, weight swaps under load, training kill/resume.
    Reliability(super::bench_reliability::BenchReliabilityArgs),
    /// Optimiser step (grad norm + AdamW), composed vs fused, against streaming bandwidth.
    Optim(super::bench_optim::BenchOptimArgs),
}

/// Runs one benchmark.
pub fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Routes(a) => bench_routes::run(a),
        BenchCommand::Rollout(a) => bench_rollout::run(a),
        BenchCommand::Decode(a) => super::bench_decode::run(a),
        BenchCommand::Train(a) => super::bench_train::run(a),
        BenchCommand::Step(a) => super::bench_step::run(a),
        BenchCommand::Fleet(a) => super::bench_fleet::run(a),
        BenchCommand::Reliability(a) => super::bench_reliability::run(a),
        BenchCommand::Optim(a) => super::bench_optim::run(a),
    }
}
