//! Smoke tests of the analysis commands' command-line surface (`r3 analyze`, `r3 report`,
//! `r3 compare`): a result path on stdout, and every failure as one `error:` line on stderr.
//! What the commands compute is tested in r3-analysis.

use r3_test_support::Scratch;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../r3-analysis/tests/fixtures/qwen3_moe_tiny")
}

fn r3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_r3"))
        .args(args)
        .output()
        .expect("run r3")
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The one `error:` line of a failed command.
fn one_error_line(out: &Output) -> String {
    assert!(!out.status.success(), "the command succeeded");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "stderr: {stderr}");
    errors[0].to_string()
}

#[test]
fn analyze_prints_the_summary_path() {
    let out = Scratch::new("cli-analyze");
    let model = fixture();
    let run = r3(&[
        "--log",
        "warn",
        "analyze",
        "--model",
        path(&model),
        "--prompts",
        "2",
        "--max-new-tokens",
        "4",
        "--out",
        path(&out),
    ]);
    assert!(
        run.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert_eq!(stdout.trim(), path(&out.join("summary.json")));
    assert!(out.join("summary.json").is_file());
}

#[test]
fn analysis_commands_fail_with_one_error_line() {
    let out = Scratch::new("cli-errors");
    let nowhere = out.join("nowhere");
    let err = one_error_line(&r3(&[
        "analyze",
        "--model",
        path(&nowhere),
        "--out",
        path(&out),
    ]));
    assert!(err.contains("config.json"), "{err}");

    let err = one_error_line(&r3(&["report", path(&nowhere), "--out", path(&out)]));
    assert!(err.contains("nowhere/metrics.jsonl"), "{err}");

    let err = one_error_line(&r3(&["compare", "--modes", "R4", "--out", path(&out)]));
    assert!(err.contains("router replay `R4` is none of"), "{err}");
}
