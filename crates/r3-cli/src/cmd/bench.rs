//! `r3 bench ...`: the benchmark subcommands. Each benchmark lives in its own file
//! `cmd/bench_<name>.rs`; add one variant and one match arm here.

use clap::Subcommand;

use super::bench_routes;

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Route wire-format decode speed (MB/s) and size (bytes per token), per format.
    Routes(bench_routes::BenchRoutesArgs),
}

/// Runs one benchmark.
pub fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Routes(a) => bench_routes::run(a),
    }
}
