//! Part (d), kill and resume: a small `r3 train` run is run once uninterrupted (the
//! reference), then again SIGKILLed at seeded random times and resumed with
//! `r3 train --resume` after each kill, until it completes. Runs are deterministic, so the
//! killed run's final weights and optimiser state must equal the reference's bit for bit,
//! and its metric and eval lines must equal the reference's (timing fields aside); torn,
//! lost and duplicated lines are counted.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use r3_train::rl::metrics_log::is_measurement;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

/// Figures of the kill/resume part.
#[derive(Debug, Clone)]
pub struct KillFigures {
    /// Training steps of the run.
    pub steps: usize,
    /// SIGKILLs delivered.
    pub kills: usize,
    /// Resumes that exited with an error (not killed).
    pub resume_failures: usize,
    /// Seconds of the uninterrupted run.
    pub reference_s: f64,
    /// Final `model.safetensors` and `optimizer.safetensors` equal to the reference's.
    pub weights_identical: bool,
    /// Metric / eval lines that are not valid JSON.
    pub torn_lines: usize,
    /// Steps of the reference missing from the killed run (metrics and eval).
    pub lost_lines: usize,
    /// Steps present more than once.
    pub duplicate_lines: usize,
    /// Lines whose values differ from the reference's (timing fields aside).
    pub differing_lines: usize,
}

/// The small training config: `steps` steps of 8 prompts × 4 samples, checkpoints every 2.
fn config_text(model: &Path, run_dir: &Path, steps: usize) -> String {
    format!(
        "seed = 0\nmodel_dir = {model:?}\nrun_dir = {run:?}\nsteps = {steps}\n\n\
         [rollout]\nprompts_per_step = 8\ngroup_size = 4\nmax_new_tokens = 24\n\n\
         [eval]\nevery = 5\nsize = 64\n\n[checkpoint]\nevery = 2\nkeep_last = 2\n",
        model = model.display().to_string(),
        run = run_dir.display().to_string(),
    )
}

/// Step of the newest checkpoint in `run_dir` (0 when there is none yet).
fn newest_checkpoint(run_dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(run_dir.join("checkpoints")) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("step_"))
                .and_then(|n| n.parse().ok())
        })
        .max()
        .unwrap_or(0)
}

/// Steps the run has logged so far (lines of its `metrics.jsonl`).
fn logged_steps(run_dir: &Path) -> usize {
    std::fs::read(run_dir.join("metrics.jsonl"))
        .map(|b| b.iter().filter(|&&c| c == b'\n').count())
        .unwrap_or(0)
}

/// Starts `r3 train` with `args`, its output appended to `log`.
fn spawn(r3: &Path, args: &[&std::ffi::OsStr], log: &Path) -> anyhow::Result<std::process::Child> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let err = out.try_clone()?;
    Command::new(r3)
        .args(["--log", "warn", "train", "--no-progress"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .context("starting r3 train")
}

/// Runs the part in `work` with `kills` kills drawn from `seed`.
pub fn run(
    r3: &Path,
    model: &Path,
    work: &Path,
    steps: usize,
    kills: usize,
    seed: u64,
) -> anyhow::Result<KillFigures> {
    let log = work.join("train.log");
    let reference_dir = work.join("train-reference");
    let killed_dir = work.join("train-killed");
    for (dir, name) in [
        (&reference_dir, "reference.toml"),
        (&killed_dir, "killed.toml"),
    ] {
        std::fs::write(work.join(name), config_text(model, dir, steps))?;
    }

    let t0 = Instant::now();
    let reference_cfg = work.join("reference.toml");
    let status = spawn(r3, &["--config".as_ref(), reference_cfg.as_os_str()], &log)?.wait()?;
    anyhow::ensure!(
        status.success(),
        "the reference run failed; see {}",
        log.display()
    );
    let reference_s = t0.elapsed().as_secs_f64();

    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut delivered, mut resume_failures) = (0, 0);
    let mut first = true;
    loop {
        let config = work.join("killed.toml");
        let mut child = if first {
            spawn(r3, &["--config".as_ref(), config.as_os_str()], &log)?
        } else {
            spawn(r3, &["--resume".as_ref(), killed_dir.as_os_str()], &log)?
        };
        first = false;
        let done = newest_checkpoint(&killed_dir);
        if delivered < kills && done + 1 < steps {
            // The kill point is drawn over what is left of the run (a resume restarts at its
            // newest checkpoint), within an even share of it per kill still to come so that
            // every kill finds the run going: after a drawn step has been logged, plus a drawn
            // part of one step's time, so kills land at any phase of a step.
            let share = ((steps - done - 1) / (kills - delivered)).max(1);
            let target = done + 1 + rng.random_range(0..share);
            let step_s = reference_s / steps as f64;
            let extra = Duration::from_secs_f64(step_s * rng.random_range(0.0..1.0));
            while child.try_wait()?.is_none() && logged_steps(&killed_dir) < target {
                std::thread::sleep(Duration::from_millis(10));
            }
            let deadline = Instant::now() + extra;
            while Instant::now() < deadline && child.try_wait()?.is_none() {
                std::thread::sleep(Duration::from_millis(10));
            }
            if child.try_wait()?.is_none() {
                child.kill().context("SIGKILL r3 train")?;
                child.wait()?;
                delivered += 1;
                continue;
            }
        }
        let status = child.wait()?;
        if status.success() {
            break;
        }
        resume_failures += 1;
        anyhow::ensure!(
            resume_failures <= 3,
            "r3 train --resume failed {resume_failures} times; see {}",
            log.display()
        );
    }

    let last = format!("checkpoints/step_{steps}");
    let same = |name: &str| -> anyhow::Result<bool> {
        let a = std::fs::read(reference_dir.join(&last).join(name))?;
        let b = std::fs::read(killed_dir.join(&last).join(name))?;
        Ok(a == b)
    };
    let weights_identical = same("model.safetensors")? && same("optimizer.safetensors")?;
    let mut figures = KillFigures {
        steps,
        kills: delivered,
        resume_failures,
        reference_s,
        weights_identical,
        torn_lines: 0,
        lost_lines: 0,
        duplicate_lines: 0,
        differing_lines: 0,
    };
    for file in ["metrics.jsonl", "eval.jsonl"] {
        compare_lines(
            &reference_dir.join(file),
            &killed_dir.join(file),
            &mut figures,
        )?;
    }
    Ok(figures)
}

/// A JSON line by step, timing fields removed (they differ between any two runs).
fn lines_by_step(path: &Path) -> anyhow::Result<(BTreeMap<u64, Vec<Value>>, usize)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut by_step: BTreeMap<u64, Vec<Value>> = BTreeMap::new();
    let mut torn = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Ok(Value::Object(mut m)) = serde_json::from_str::<Value>(line) else {
            torn += 1;
            continue;
        };
        m.retain(|k, _| !is_measurement(k));
        let step = m.get("step").and_then(Value::as_u64).unwrap_or(u64::MAX);
        by_step.entry(step).or_default().push(Value::Object(m));
    }
    Ok((by_step, torn))
}

/// Adds the differences between the reference file and the killed run's to `f`.
fn compare_lines(reference: &Path, killed: &Path, f: &mut KillFigures) -> anyhow::Result<()> {
    let (want, _) = lines_by_step(reference)?;
    let (got, torn) = lines_by_step(killed)?;
    f.torn_lines += torn;
    for (step, lines) in &want {
        match got.get(step) {
            None => f.lost_lines += 1,
            Some(g) => {
                f.duplicate_lines += g.len().saturating_sub(1);
                if g.iter().any(|v| Some(v) != lines.first()) {
                    f.differing_lines += 1;
                }
            }
        }
    }
    f.duplicate_lines += got.keys().filter(|s| !want.contains_key(s)).count();
    Ok(())
}
