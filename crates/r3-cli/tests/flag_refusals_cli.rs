//! Flags that would run something other than what they say are refused at start, naming the
//! flag: a router dtype that is not the engine's (`r3 generate`, `r3 serve`), a zero KV cache
//! budget (`r3 serve`), a mode or setting given twice (`r3 compare`), and a baseline scored
//! on other prompts (`r3 eval --baseline`, before the evaluation runs).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn shipped() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/arith-moe")
}

/// Runs `r3 args`; one still running after 60 s (a server that started) is killed, and
/// its output reads as accepted.
fn r3(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_r3"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn r3");
    let started = Instant::now();
    while child.try_wait().expect("wait r3").is_none()
        && started.elapsed() < Duration::from_secs(60)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    child.wait_with_output().expect("wait r3")
}

/// The command failed with one `error:` line holding every one of `needles`.
fn assert_refused(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    // A server killed after running counts as accepted, whatever its exit status.
    assert!(err.contains("error: "), "accepted: {err}");
    assert!(!out.status.success(), "accepted: {err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line: {err}"));
    for needle in needles {
        assert!(line.contains(needle), "{needle:?} not in {line}");
    }
}

/// `r3 generate` of one token from `model` with `--dtype dtype --router-dtype router`.
fn generate_args<'a>(model: &'a str, dtype: &'a str, router: &'a str) -> [&'a str; 11] {
    [
        "generate",
        "--model",
        model,
        "--input-ids",
        "1,2",
        "--max-new-tokens",
        "1",
        "--dtype",
        dtype,
        "--router-dtype",
        router,
    ]
}

/// `--router-dtype bf16` beside `--dtype f32` (or f16) ran an f32 (f16) router, the same
/// output as `--router-dtype f32`: refused. The engine's own dtype and `f32` still run.
#[test]
fn generate_and_serve_refuse_a_router_dtype_that_is_not_the_engines() {
    let model = shipped();
    let model = model.to_str().expect("utf-8 path");
    for (dtype, router) in [("f32", "bf16"), ("f16", "bf16"), ("bf16", "f16")] {
        assert_refused(
            &r3(&generate_args(model, dtype, router)),
            &["--router-dtype", "model dtype", dtype],
        );
        let serve = [
            "serve",
            "--model",
            model,
            "--port",
            "0",
            "--dtype",
            dtype,
            "--router-dtype",
            router,
        ];
        assert_refused(&r3(&serve), &["--router-dtype", "model dtype", dtype]);
    }
    for (dtype, router) in [("bf16", "bf16"), ("f32", "f32"), ("f16", "model")] {
        let out = r3(&generate_args(model, dtype, router));
        assert!(
            out.status.success(),
            "{dtype}/{router}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `--kv-cache-mib 0` was clamped by the engine to a single KV block: refused naming the
/// flag, as `r3 train` refuses `rollout.kv_cache_mib = 0`.
#[test]
fn serve_refuses_a_zero_kv_cache_budget() {
    let model = shipped();
    let model = model.to_str().expect("utf-8 path");
    for flag in ["--kv-cache-mib", "--activation-mib", "--max-running"] {
        let out = r3(&["serve", "--model", model, "--port", "0", flag, "0"]);
        assert_refused(&out, &[flag, "at least 1"]);
    }
}

/// `--modes R3,R3` (or `r3,R3`) and `--settings single,single` ran one directory and listed
/// it twice in the results: refused naming the flag and both values, before any run.
#[test]
fn compare_refuses_a_mode_or_setting_given_twice() {
    let dir = std::env::temp_dir().join(format!("r3-compare-dups-{}", std::process::id()));
    let out_dir = dir.to_str().expect("utf-8 path");
    let out = r3(&["compare", "--out", out_dir, "--modes", "R3,r3"]);
    assert_refused(&out, &["--modes", "\"R3\"", "\"r3\""]);
    let out = r3(&["compare", "--out", out_dir, "--settings", "single,single"]);
    assert_refused(&out, &["--settings", "\"single\""]);
    let out = r3(&["compare", "--out", out_dir, "--seeds", "1,2,1"]);
    assert_refused(&out, &["--seeds", "\"1\""]);
    assert!(!dir.exists(), "a refused compare wrote {}", dir.display());
}

/// A baseline evaluated at another `eval.seed` (other prompts) is refused before the
/// evaluation runs (no table printed), and the error names the model evaluated (not an
/// empty path) and the baseline.
#[test]
fn eval_refuses_a_baseline_on_other_prompts_before_evaluating() {
    let dir = std::env::temp_dir().join(format!("r3-eval-baseline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let base = dir.join("base.json");
    let model = shipped();
    let model = model.to_str().expect("utf-8 path");
    let small = ["--set", "eval.size=4", "--k", "1"];
    let mut args = vec![
        "eval",
        "--model",
        model,
        "--out",
        base.to_str().expect("path"),
    ];
    args.extend_from_slice(&small);
    let made = r3(&args);
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let started = Instant::now();
    let mut args = vec![
        "eval",
        "--model",
        model,
        "--baseline",
        base.to_str().expect("path"),
    ];
    args.extend_from_slice(&small);
    args.extend_from_slice(&["--set", "eval.seed=99"]);
    let out = r3(&args);
    let elapsed = started.elapsed();
    assert_refused(&out, &[model, "base.json", "different prompts"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("eval time"), "evaluated first: {stdout}");
    assert!(elapsed < Duration::from_secs(60), "{elapsed:?}");
    std::fs::remove_dir_all(&dir).ok();
}
