//! The report end to end on synthetic run directories written here, with hand-computed
//! crash steps and best scores.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use base64::Engine;
use r3_analysis::plot::Canvas;
use r3_analysis::report::{
    build_report, CrashRule, ReportError, ReportOptions, ReportOutput, DEFAULT_KL_THRESHOLD,
    DEFAULT_SMOOTHING,
};

/// A fresh directory under cargo's per-target temp dir.
fn fresh_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("report-e2e-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The report over `runs` into `out` with the crash threshold `kl_threshold`.
fn report(runs: &[PathBuf], out: &Path, kl_threshold: f64) -> Result<ReportOutput, ReportError> {
    let opts = ReportOptions {
        out_dir: out.to_path_buf(),
        crash_rule: CrashRule { kl_threshold },
        canvas: Canvas::default(),
        smoothing: DEFAULT_SMOOTHING,
    };
    build_report(runs, &opts)
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// No replay, PPO: k3 KL grows 10 % a step from 1e-3, so it first exceeds 1e-2 at step 25
/// (1.1^24 = 9.85, 1.1^25 = 10.83). Eval collapses at step 40 (0.15 < 0.5 × 0.4).
fn grpo_run(root: &Path) -> PathBuf {
    let dir = root.join("grpo");
    write(
        &dir.join("config.toml"),
        "seed = 7\n[train]\nreplay_mode = \"disabled\"\nloss = \"ppo\"\n",
    );
    let evals = [
        (0, 0.1),
        (10, 0.3),
        (20, 0.4),
        (30, 0.35),
        (40, 0.15),
        (50, 0.1),
    ];
    let mut text = String::new();
    for step in 0..60u32 {
        let kl = 1e-3 * 1.1f64.powi(step as i32);
        let eval = evals
            .iter()
            .find(|(s, _)| *s == step)
            .map_or(String::new(), |(_, a)| format!(", \"eval_accuracy\": {a}"));
        writeln!(
            text,
            "{{\"step\": {step}, \"replay_mode\": \"disabled\", \"loss\": \"ppo\", \
             \"mismatch.k3_kl\": {kl}, \"mismatch.f_tau2\": {}, \"reward_mean\": {}, \
             \"grad_norm\": {}, \"entropy\": 0.8, \"response_len_mean\": {}{eval}}}",
            kl * 5.0,
            0.01 * f64::from(step),
            1.0 + f64::from(step),
            100 + step
        )
        .unwrap();
    }
    write(&dir.join("metrics.jsonl"), &text);
    dir
}

/// R3, PPO: flat k3 KL 5e-4, evals only in eval.jsonl rising to 0.6 at step 50; nulls and
/// unknown keys sprinkled in.
fn r3_run(root: &Path) -> PathBuf {
    let dir = root.join("r3");
    write(
        &dir.join("config.toml"),
        "replay_mode = \"R3\"\n[loss]\nkind = \"ppo\"\n",
    );
    let mut text = String::new();
    for step in 0..60u32 {
        let grad = if step == 7 {
            "null".to_string()
        } else {
            "0.5".to_string()
        };
        writeln!(
            text,
            "{{\"step\": {step}, \"mismatch.k3_kl\": 5e-4, \"mismatch.f_tau2\": 1e-5, \
             \"reward_mean\": {}, \"grad_norm\": {grad}, \"something.new\": [1, 2]}}",
            0.4 + 0.005 * f64::from(step)
        )
        .unwrap();
    }
    write(&dir.join("metrics.jsonl"), &text);
    let mut eval = String::new();
    for (step, acc) in [
        (0, 0.1),
        (10, 0.3),
        (20, 0.45),
        (30, 0.5),
        (40, 0.55),
        (50, 0.6),
    ] {
        writeln!(
            eval,
            "{{\"step\": {step}, \"eval_accuracy\": {acc}, \"n\": 64}}"
        )
        .unwrap();
    }
    write(&dir.join("eval.jsonl"), &eval);
    dir
}

/// R2, no config.toml, no eval, no mismatch metrics at all.
fn r2_run(root: &Path) -> PathBuf {
    let dir = root.join("r2");
    let text: String = (0..5)
        .map(|s| format!("{{\"step\": {s}, \"replay_mode\": \"R2\", \"mismatch.k3_kl\": null, \"reward_mean\": 0.3}}\n"))
        .collect();
    write(&dir.join("metrics.jsonl"), &text);
    dir
}

#[test]
fn report_over_three_synthetic_runs() {
    let root = fresh_dir("three");
    let runs = [grpo_run(&root), r3_run(&root), r2_run(&root)];
    let out = root.join("out");
    let written = report(&runs, &out, DEFAULT_KL_THRESHOLD).unwrap();
    let html_path = out.join("report.html");
    assert_eq!(written.html, html_path);

    // Table: hand-computed crash steps and best scores.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let rows = json["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0]["run"], "grpo");
    assert_eq!(rows[0]["setting"], "no replay · ppo");
    assert_eq!(rows[0]["crash_step"], 25);
    assert_eq!(rows[0]["scores"][0]["value"], 0.4);
    assert_eq!(rows[0]["scores"][0]["step"], 20);
    assert_eq!(rows[1]["setting"], "R3 · ppo");
    assert!(rows[1]["crash_step"].is_null());
    assert_eq!(rows[1]["scores"][0]["value"], 0.6);
    assert_eq!(rows[1]["scores"][0]["step"], 50);
    assert_eq!(rows[2]["setting"], "R2");
    assert!(rows[2]["scores"][0].is_null());
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(
        md.contains("| grpo | no replay · ppo | 40.00 (20) | 10.00 (50) | 25 |"),
        "{md}"
    );
    assert!(
        md.contains("| r3 | R3 · ppo | 60.00 (50) | 60.00 (50) | — |"),
        "{md}"
    );
    assert_eq!(rows[0]["final_score"]["value"], 0.1);
    assert!(rows[2]["final_score"].is_null());

    // Page: self-contained, rule stated, every figure embedded, and the embedded k3 KL image
    // is byte-for-byte the PNG written beside it.
    let html = std::fs::read_to_string(&html_path).unwrap();
    assert!(html.contains("Crash rule"));
    assert!(html.contains("exceeds 1e-2"));
    assert!(
        !html.contains("src=\"http") && !html.contains("<link"),
        "external resource"
    );
    let images: Vec<&str> = html
        .split("src=\"data:image/png;base64,")
        .skip(1)
        .map(|s| &s[..s.find('"').unwrap()])
        .collect();
    assert_eq!(images.len(), 7, "7 figures expected");
    let first = base64::engine::general_purpose::STANDARD
        .decode(images[0])
        .unwrap();
    assert_eq!(first, std::fs::read(out.join("k3_kl.png")).unwrap());
    for f in [
        "k3_kl",
        "f_tau2",
        "reward",
        "eval_accuracy",
        "grad_norm",
        "entropy",
        "response_len",
    ] {
        let png = std::fs::read(out.join(format!("{f}.png"))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{f}.png");
    }
    // Summary row of the crashed run names the step and cause.
    assert!(html.contains("<td>25 <small>(k3 KL"), "crash cell missing");
}

#[test]
fn kl_threshold_changes_the_crash_step() {
    let root = fresh_dir("threshold");
    let run = grpo_run(&root);
    let out = root.join("out");
    // 1.1^s > 5 first at s = 17 (1.1^16 = 4.59, 1.1^17 = 5.05).
    let runs = [run];
    report(&runs, &out, 5e-3).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["rows"][0]["crash_step"], 17);
    // With a threshold nothing reaches, the eval collapse at step 40 is the crash.
    report(&runs, &out, 1.0).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["rows"][0]["crash_step"], 40);
}

#[test]
fn malformed_metrics_line_is_an_error_naming_file_and_line() {
    let root = fresh_dir("malformed");
    let dir = root.join("bad");
    write(
        &dir.join("metrics.jsonl"),
        "{\"step\": 0}\n{\"step\": 1}\n{\"step\": 2, \"reward_mean\": }\n",
    );
    let err = report(&[dir], &root.join("out"), DEFAULT_KL_THRESHOLD)
        .unwrap_err()
        .to_string();
    assert!(err.contains("bad/metrics.jsonl:3:"), "{err}");
    assert!(err.contains("not valid JSON"), "{err}");
    // A missing run directory is named too.
    let missing = root.join("nope");
    let err = report(&[missing], &root.join("out"), DEFAULT_KL_THRESHOLD)
        .unwrap_err()
        .to_string();
    assert!(err.contains("nope/metrics.jsonl"), "{err}");
}
