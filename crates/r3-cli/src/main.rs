//! The `r3` binary: parses the command line, sets up logging on stderr and runs one command.
//! Every failure is printed as a single `error: ...` line with a non-zero exit status.

mod allocator;
mod cmd;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    allocator::keep_freed_buffers();
    let cli = cmd::Cli::parse();
    if let Err(e) = init_logging(&cli.log) {
        eprintln!("error: {}", one_line(&format!("{e:#}")));
        return ExitCode::FAILURE;
    }
    match cmd::run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&format!("{e:#}")));
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr so that stdout carries only a command's result (JSON, tables).
fn init_logging(filter: &str) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .map_err(|e| anyhow::anyhow!("invalid --log filter {filter:?}: {e}"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    Ok(())
}

/// Error chains can contain newlines (e.g. from serde); the contract is one line.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}
