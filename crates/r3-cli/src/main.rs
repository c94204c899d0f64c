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
        eprintln!("error: {}", error_line(&e));
        return ExitCode::FAILURE;
    }
    match cmd::run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
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

/// The error and its causes joined with `: `, each cause once: most library errors already
/// write their source into their own message, so a cause whose text the line already holds
/// is not repeated (anyhow's `{:#}` would print it again).
fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    one_line(&line)
}

/// Error chains can contain newlines (e.g. from serde); the contract is one line.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that writes its source into its own message and also reports it as its
    /// source, as the crates' `thiserror` errors do.
    #[derive(Debug)]
    struct Wrapping(std::io::Error);

    impl std::fmt::Display for Wrapping {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "reading weights: {}", self.0)
        }
    }

    impl std::error::Error for Wrapping {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn each_cause_is_printed_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = anyhow::Error::new(Wrapping(io)).context("loading the model");
        assert_eq!(
            format!("{e:#}"),
            "loading the model: reading weights: no such file: no such file",
            "anyhow alone repeats the cause"
        );
        assert_eq!(
            error_line(&e),
            "loading the model: reading weights: no such file"
        );
    }

    #[test]
    fn causes_not_in_the_message_are_kept_on_one_line() {
        let e = anyhow::anyhow!("bad\nvalue").context("parsing config");
        assert_eq!(error_line(&e), "parsing config: bad value");
    }
}
