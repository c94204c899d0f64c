//! `r3 bench routes`: decode throughput and bytes per token of each route wire format.

use clap::Args;

/// Options of `r3 bench routes`.
#[derive(Debug, Args)]
pub struct BenchRoutesArgs {
    /// Tokens per synthetic sequence.
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
}

/// Runs the benchmark.
pub fn run(_args: BenchRoutesArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench routes: not built yet (routing helper is writing it)")
}
