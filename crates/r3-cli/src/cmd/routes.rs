//! `r3 routes ...`: decode wire payloads to canonical JSON, encode back, diff two tables.

use clap::Subcommand;

/// Route subcommands.
#[derive(Debug, Subcommand)]
pub enum RoutesCommand {
    /// Read a payload on stdin, validate it and print canonical r3 JSON.
    Decode,
}

/// Runs one route subcommand.
pub fn run(command: RoutesCommand) -> anyhow::Result<()> {
    match command {
        RoutesCommand::Decode => anyhow::bail!("routes decode: not built yet"),
    }
}
