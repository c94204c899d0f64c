//! The server under test: `r3 serve` started as a child process (the same binary, or the one
//! given) on a free local port, with its log in the work directory; killed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use r3_fleet::http::JsonClient;

/// A running `r3 serve` child.
pub struct ServerProcess {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
}

impl ServerProcess {
    /// Starts `r3 serve --model model --weights-root root` plus `extra` flags and waits
    /// (at most 120 s) until `/health` answers.
    pub async fn start(
        r3: &Path,
        model: &Path,
        root: &Path,
        log: &Path,
        extra: &[String],
    ) -> anyhow::Result<Self> {
        let port = free_port()?;
        let log_file = std::fs::File::create(log)
            .with_context(|| format!("creating the server log {}", log.display()))?;
        let child = Command::new(r3)
            .arg("--log")
            .arg("warn")
            .arg("serve")
            .arg("--model")
            .arg(model)
            .arg("--weights-root")
            .arg(root)
            .arg("--port")
            .arg(port.to_string())
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("starting {} serve", r3.display()))?;
        let mut server = ServerProcess {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let client = JsonClient::new(None);
        let t0 = Instant::now();
        loop {
            if client
                .get(&server.url("/health"), Duration::from_secs(2))
                .await
                .is_ok()
            {
                return Ok(server);
            }
            if let Some(status) = server.child.try_wait()? {
                anyhow::bail!("r3 serve exited ({status}); see {}", log.display());
            }
            if t0.elapsed() > Duration::from_secs(120) {
                anyhow::bail!("r3 serve did not answer /health within 120 s");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The URL of `path` on this server.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The `host:port` the server listens on.
    pub fn addr(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port that was free a moment ago (bound to port 0 and released).
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// The binary to start: `given`, or the running `r3` itself.
pub fn r3_binary(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    match given {
        Some(p) => Ok(p.to_path_buf()),
        None => std::env::current_exe().context("locating the r3 binary"),
    }
}
