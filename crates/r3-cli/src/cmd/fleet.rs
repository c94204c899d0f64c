//! `r3 fleet`: starts N local `r3 serve` workers on consecutive ports for a quick try of
//! `rollout.backend = "sglang"`, prints the `--set` lines that point `r3 train` at them, and
//! stops them all on Ctrl-C (or when one exits).

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::Context;
use clap::Args;

/// Arguments of `r3 fleet`.
#[derive(Debug, Args)]
pub struct FleetArgs {
    /// HF model directory every worker serves.
    #[arg(long)]
    pub model: PathBuf,
    /// Workers to start.
    #[arg(long, default_value_t = 2)]
    pub workers: u16,
    /// Port of the first worker; worker i listens on port_base + i.
    #[arg(long, default_value_t = 30000)]
    pub port_base: u16,
    /// Address the workers listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Matmul precision of the workers (as `r3 serve --dtype`).
    #[arg(long, default_value = "f16")]
    pub dtype: String,
}

/// The worker processes; killed when dropped, so an error never leaves them behind.
struct Workers(Vec<(u16, Child)>);

impl Drop for Workers {
    fn drop(&mut self) {
        for (port, child) in &mut self.0 {
            if let Err(e) = child.kill() {
                tracing::debug!(port, error = %e, "worker already gone");
            }
            let _ = child.wait();
        }
    }
}

/// Runs `r3 fleet`.
pub fn run(a: FleetArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.workers >= 1, "--workers must be at least 1");
    let last = a
        .port_base
        .checked_add(a.workers - 1)
        .context("--port-base + --workers runs past port 65535")?;
    let exe = std::env::current_exe().context("locating the r3 binary")?;
    let mut workers = Workers(Vec::new());
    for port in a.port_base..=last {
        let child = Command::new(&exe)
            .arg("serve")
            .arg("--model")
            .arg(&a.model)
            .args(["--host", &a.host, "--port", &port.to_string()])
            .args(["--dtype", &a.dtype])
            .spawn()
            .with_context(|| format!("starting the worker on port {port}"))?;
        workers.0.push((port, child));
    }
    let urls: Vec<String> = (a.port_base..=last)
        .map(|p| format!("\"http://{}:{p}\"", a.host))
        .collect();
    println!(
        "{} workers starting; train with:\n  r3 train --set rollout.backend=sglang --set 'rollout.urls=[{}]'",
        a.workers,
        urls.join(", ")
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {
                    tracing::info!("stopping the workers");
                    return Ok(());
                }
                _ = tick.tick() => {
                    for (port, child) in &mut workers.0 {
                        if let Some(status) = child.try_wait().context("watching a worker")? {
                            anyhow::bail!("the worker on port {port} exited ({status})");
                        }
                    }
                }
            }
        }
    })
}
