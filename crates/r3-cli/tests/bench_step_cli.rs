//! `r3 bench step` on the shipped default config: the table names every phase of the
//! step, the shares add up to the whole step, and `--json` carries the same phases.

use std::path::Path;
use std::process::{Command, Output};

const PHASES: [&str; 7] = [
    "rollout+capture",
    "old log-probs",
    "update forward",
    "update backward",
    "optimiser",
    "weight sync",
    "other",
];

/// `r3 bench step` from the repository root (the default config names `models/arith-moe`),
/// a warm-up and one measured step of 4 prompts × 8 samples.
fn bench_step(extra: &[&str]) -> Output {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    Command::new(env!("CARGO_BIN_EXE_r3"))
        .current_dir(root)
        .args(["bench", "step", "--steps", "1", "--warmup", "1"])
        .args(["--set", "rollout.prompts_per_step=4"])
        .args(extra)
        .output()
        .expect("run r3")
}

#[test]
fn the_table_names_every_phase_and_the_shares_make_the_step() {
    let out = bench_step(&["--set", "algo.mini_batches=2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut shares = 0.0;
    let mut seconds = 0.0;
    for phase in PHASES {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(phase))
            .unwrap_or_else(|| panic!("no row {phase:?} in\n{stdout}"));
        let fields: Vec<&str> = line[phase.len()..].split_whitespace().collect();
        let time: f64 = fields[0].parse().expect("time column");
        let share: f64 = fields[1]
            .trim_end_matches('%')
            .parse()
            .expect("share column");
        assert!(time >= 0.0 && (0.0..=100.0).contains(&share), "{line}");
        seconds += time;
        shares += share;
    }
    // Each share is rounded to 0.1%: seven of them sum to 100% within 0.35%.
    assert!(
        (shares - 100.0).abs() <= 0.35,
        "shares sum to {shares}%\n{stdout}"
    );
    let step = stdout
        .lines()
        .find(|l| l.starts_with("step "))
        .unwrap_or_else(|| panic!("no step row in\n{stdout}"));
    let step_fields: Vec<&str> = step.split_whitespace().collect();
    let step_s: f64 = step_fields[1].parse().expect("step time");
    assert!((step_s - seconds).abs() <= 1e-3, "{step_s} vs {seconds}");
    // Two mini-batches: a separate old-log-prob pass, with its work counted.
    let old = stdout
        .lines()
        .find(|l| l.starts_with("old log-probs"))
        .expect("old row");
    let gflop = old["old log-probs".len()..].split_whitespace().nth(2);
    assert!(
        gflop.is_some_and(|g| g.parse::<f64>().is_ok_and(|v| v > 0.0)),
        "{old}"
    );
    // The mark is known where the kernel lets a process reset it (as it lets this one).
    if cfg!(target_os = "linux") && std::fs::write("/proc/self/clear_refs", "5").is_ok() {
        let peak = step_fields.last().expect("peak column");
        assert!(peak.parse::<f64>().is_ok_and(|v| v > 0.0), "{step}");
    }
}

#[test]
fn json_carries_the_phases_and_the_machine() {
    let out = bench_step(&["--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    let names: Vec<&str> = v["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .map(|p| p["phase"].as_str().expect("name"))
        .collect();
    assert_eq!(names, PHASES);
    let shares: f64 = v["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .map(|p| p["share_pct"].as_f64().expect("share"))
        .sum();
    assert!((shares - 100.0).abs() < 1e-9, "{shares}");
    assert!(v["gemm_peak_gflops"].as_f64().is_some_and(|g| g > 0.0));
    assert!(v["stream_bandwidth_gbs"].as_f64().is_some_and(|g| g > 0.0));
    assert_eq!(v["sequences_per_step"], 32);
    // Both engines on the CPU: one machine, whose limits hold every named phase.
    let machines = v["machines"].as_array().expect("machines");
    assert_eq!(machines.len(), 1, "{machines:?}");
    assert_eq!(machines[0]["device"], "cpu");
    let served: Vec<&str> = machines[0]["phases"]
        .as_array()
        .expect("phases served")
        .iter()
        .map(|p| p.as_str().expect("name"))
        .collect();
    assert_eq!(served, PHASES[..6], "every phase but `other`");
    assert_eq!(v["gemm_peak_gflops"], machines[0]["gemm_peak_gflops"]);
    assert!(v["device_peak_mib"].is_null(), "no GPU");
    for phase in v["phases"].as_array().expect("phases") {
        assert!(phase["limit_s"].as_f64().is_some(), "{phase}");
    }
}
