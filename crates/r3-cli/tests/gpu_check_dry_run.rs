//! `scripts/cuda/check.sh --dry-run`: every r3 command line the GPU check would run in its
//! tests, training, rollout, batch-8 and RL-step steps, given to this CPU build of r3, is
//! accepted (flags and `--set` keys parse; it stops at the GPU it asks for). The GPU check
//! runs on a lent machine a few minutes at a time, where a renamed flag would cost a call;
//! here it costs a test.

use std::path::Path;
use std::process::Command;

use r3_test_support::Scratch;

#[test]
fn the_gpu_checks_command_lines_are_accepted_by_this_build() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Scratch::new("gpu-check-dry");
    let run = Command::new("bash")
        .current_dir(&root)
        .arg("scripts/cuda/check.sh")
        .arg(out.path())
        .args(["--dry-run", env!("CARGO_BIN_EXE_r3")])
        .args(["--steps", "1,2,3,4,9,10", "--budget", "1800"])
        .output()
        .expect("run bash");
    let summary = std::fs::read_to_string(out.join("summary.txt")).unwrap_or_default();
    let stderr = String::from_utf8_lossy(&run.stderr);
    let verdict = summary
        .split(" dry-run=")
        .nth(1)
        .unwrap_or_else(|| panic!("no dry-run verdict in {summary:?}; stderr {stderr}"));
    assert!(run.status.success(), "dry-run={verdict}\n{stderr}");
    let accepted: usize = verdict
        .split(" accepted")
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("dry-run={verdict}"));
    // Steps 2, 3, 4, 9 and 10 run 42 r3 command lines (fewer would mean a step stopped
    // early, its later lines unchecked).
    assert!(accepted >= 40, "dry-run={verdict}");
    assert!(verdict.contains(", 0 refused"), "dry-run={verdict}");
}
