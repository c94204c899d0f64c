//! The `command` reward: an external verifier process. Each batch spawns the command once,
//! writes one JSON object per response on its stdin (`prompt`, `response`, `ground_truth`,
//! `data_source`, `extra_info`), closes stdin, and reads one score per line from its stdout.
//! `ground_truth` is the row's value as the dataset holds it (a string stays a string, a
//! number a number, an object an object), as verl's reward manager hands it to
//! `compute_score`.
//!
//! Anything but a clean answer is an error naming the batch row, never a silent zero: a
//! process that cannot start, exits non-zero, outlives the timeout, prints a different number
//! of lines than it was given, or prints a line that is not a finite number.

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::error::{Result, TaskError};
use crate::reward::input::RewardInput;

/// How often a running verifier is polled for its exit.
const POLL: Duration = Duration::from_millis(5);
/// The last bytes of a failed verifier's stderr quoted in the error.
const STDERR_TAIL: usize = 400;

/// An external verifier process with a per-batch timeout.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandReward {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Longest a batch may take.
    pub timeout: Duration,
}

fn failed(argv: &[String], reason: impl Into<String>) -> TaskError {
    TaskError::RewardCommand {
        command: argv.join(" "),
        reason: reason.into(),
    }
}

/// Reads a pipe to its end on a thread; the result arrives on the returned channel.
fn drain<R: Read + Send + 'static>(mut pipe: R) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        // A read error ends the stream; the line-count check reports what is missing.
        let _ = pipe.read_to_end(&mut buf);
        let _ = tx.send(buf);
    });
    rx
}

fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    let start = text
        .char_indices()
        .rev()
        .nth(STDERR_TAIL)
        .map_or(0, |(i, _)| i);
    text[start..].to_string()
}

impl CommandReward {
    /// Scores a batch: one score per input, in order.
    pub fn score_batch(&self, inputs: &[RewardInput<'_>]) -> Result<Vec<f32>> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let Some((program, args)) = self.argv.split_first() else {
            return Err(failed(&self.argv, "empty command"));
        };
        let mut payload = Vec::new();
        for input in inputs {
            serde_json::to_writer(&mut payload, input)
                .map_err(|e| failed(&self.argv, format!("serialising a row: {e}")))?;
            payload.push(b'\n');
        }
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| failed(&self.argv, format!("cannot start: {e}")))?;
        let started = Instant::now();
        let stdout = child.stdout.take().map(drain);
        let stderr = child.stderr.take().map(drain);
        if let Some(mut stdin) = child.stdin.take() {
            // Written on a thread: a verifier that answers before reading everything (or
            // never reads) must not block us past the timeout.
            std::thread::spawn(move || {
                let _ = stdin.write_all(&payload);
            });
        }
        let status = self.wait(&mut child, started)?;
        let remaining = self
            .timeout
            .saturating_sub(started.elapsed())
            .saturating_add(POLL);
        let err_text = stderr
            .and_then(|rx| rx.recv_timeout(POLL * 20).ok())
            .unwrap_or_default();
        if !status.success() {
            return Err(failed(
                &self.argv,
                format!("exited with {status}; stderr: {}", tail(&err_text)),
            ));
        }
        let out = stdout
            .and_then(|rx| rx.recv_timeout(remaining).ok())
            .ok_or_else(|| {
                failed(
                    &self.argv,
                    "its stdout stayed open after it exited (a child process still holds it?)",
                )
            })?;
        parse_scores(&String::from_utf8_lossy(&out), inputs.len(), &self.argv)
    }

    /// Waits for the process until the timeout, killing it when the time is up.
    fn wait(&self, child: &mut Child, started: Instant) -> Result<std::process::ExitStatus> {
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Ok(status),
                Ok(None) if started.elapsed() >= self.timeout => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(failed(
                        &self.argv,
                        format!(
                            "no answer within the {:.1}s timeout (killed)",
                            self.timeout.as_secs_f64()
                        ),
                    ));
                }
                Ok(None) => std::thread::sleep(POLL),
                Err(e) => return Err(failed(&self.argv, format!("waiting for it: {e}"))),
            }
        }
    }
}

/// One finite score per line, exactly `expected` lines (blank trailing lines ignored).
fn parse_scores(stdout: &str, expected: usize, argv: &[String]) -> Result<Vec<f32>> {
    let lines: Vec<&str> = stdout.trim_end().lines().collect();
    let lines: &[&str] = if stdout.trim().is_empty() {
        &[]
    } else {
        &lines
    };
    if lines.len() != expected {
        return Err(TaskError::RewardRow {
            row: lines.len().min(expected),
            reason: format!(
                "`{}` printed {} score lines for {expected} rows",
                argv.join(" "),
                lines.len()
            ),
        });
    }
    lines
        .iter()
        .enumerate()
        .map(|(row, line)| {
            let bad = |what: &str| TaskError::RewardRow {
                row,
                reason: format!(
                    "`{}` answered {line:?} on output line {}, {what}",
                    argv.join(" "),
                    row + 1
                ),
            };
            match line.trim().parse::<f64>() {
                // The f32 is checked, not the f64: `1e39` is finite as an f64 but +inf as an f32.
                Ok(v) if (v as f32).is_finite() => Ok(v as f32),
                Ok(v) if v.is_finite() => Err(bad("outside f32's range (|score| <= 3.4e38)")),
                _ => Err(bad("not a finite number")),
            }
        })
        .collect()
}
