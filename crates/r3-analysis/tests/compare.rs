//! The replay-mode comparison end to end on a tiny random MoE model: two replay modes × one
//! setting, two RL steps each, run in-process through the library; checks one run directory per variant with the
//! right resolved config, one metrics line per step, and the results table with one row per
//! run and the crash rule.

use std::path::Path;

use r3_analysis::compare::{plan, run_compare, Setting};
use r3_analysis::report::{CrashRule, DEFAULT_KL_THRESHOLD};
use r3_test_support::{tiny_model, Scratch};
use r3_train::config::TrainConfig;
use r3_train::{Quiet, RouterReplay};
use serde_json::Value;

/// `run_compare` with quiet runs.
fn compare(
    base: &TrainConfig,
    variants: &[r3_analysis::compare::Variant],
    seeds: &[u64],
    out: &Path,
) -> Result<r3_analysis::compare::CompareSummary, r3_analysis::AnalysisError> {
    let rule = CrashRule {
        kl_threshold: DEFAULT_KL_THRESHOLD,
    };
    run_compare(
        base,
        variants,
        seeds,
        out,
        rule,
        "compare test".into(),
        &mut |_, _| Box::new(Quiet),
    )
}

/// r3's shipped default experiment, the base of every `r3 compare`.
const DEFAULT_CONFIG: &str = include_str!("../../../configs/default.toml");

#[test]
fn compare_two_modes_two_steps_writes_runs_and_table() {
    let root = Scratch::new("compare-e2e");
    let model = root.join("model");
    tiny_model(&model, 3);
    let out = root.join("out");
    let overrides: Vec<String> = vec![
        format!("model_dir={}", model.display()),
        "task.difficulty=1".into(),
        "rollout.prompts_per_step=2".into(),
        "rollout.group_size=2".into(),
        "rollout.max_new_tokens=6".into(),
        "algo.dynamic_sampling=false".into(),
        "eval.size=4".into(),
        "checkpoint.every=0".into(),
    ];
    let mut base = TrainConfig::resolve_text(DEFAULT_CONFIG, &overrides).expect("config");
    base.steps = 2;
    base.eval.every = 1;
    base.seed = 11;
    base.validate().expect("valid config");
    let modes = [RouterReplay::Disabled, RouterReplay::R3];
    let variants = plan(&[Setting::Single], &modes, false, false);
    let summary = compare(&base, &variants, &[11], &out).expect("compare");
    assert_eq!(summary.table_md, out.join("results.md"));

    for (name, mode) in [("single-disabled", "disabled"), ("single-R3", "R3")] {
        let dir = out.join("runs").join(name);
        let cfg: toml::Table = std::fs::read_to_string(dir.join("config.toml"))
            .expect("config.toml")
            .parse()
            .expect("toml");
        assert_eq!(
            cfg["seed"].as_integer(),
            Some(11),
            "{name}: same seed for every run"
        );
        assert_eq!(cfg["steps"].as_integer(), Some(2));
        assert_eq!(cfg["algo"]["router_replay"].as_str(), Some(mode));
        assert_eq!(cfg["algo"]["mini_batches"].as_integer(), Some(1));
        let lines = std::fs::read_to_string(dir.join("metrics.jsonl")).expect("metrics");
        let steps: Vec<u64> = lines
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).expect("metrics line");
                v["step"].as_u64().expect("step")
            })
            .collect();
        assert_eq!(steps, vec![1, 2], "{name}");
    }

    let table = std::fs::read_to_string(out.join("results.md")).expect("results.md");
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.starts_with("| single-"))
        .collect();
    assert_eq!(rows.len(), 2, "table:\n{table}");
    assert!(table.contains("Crash rule:"), "table:\n{table}");

    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("results.json")).expect("results.json"),
    )
    .expect("json");
    assert_eq!(json["rows"].as_array().map(Vec::len), Some(2));
    let summary: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("compare.json")).expect("compare.json"),
    )
    .expect("json");
    for r in summary["runs"].as_array().expect("runs") {
        assert!(r["error"].is_null(), "run failed: {r}");
        assert_eq!(r["steps_run"], 2);
    }
    assert!(out.join("report").join("report.html").is_file());

    // The same call again takes the finished runs up: nothing is rerun and the table is the
    // same; a different config in the same --out is refused, naming the run directory.
    let again = compare(&base, &variants, &[11], &out).expect("compare again");
    assert!(again
        .runs
        .iter()
        .all(|r| r.steps_run == 0 && r.error.is_none()));
    assert_eq!(
        std::fs::read_to_string(out.join("results.md")).expect("results.md"),
        table
    );
    let mut other = base.clone();
    other.optim.lr *= 2.0;
    let refused =
        compare(&other, &variants, &[11], &out).expect_err("another config in the same --out");
    assert!(refused.to_string().contains("single-disabled"), "{refused}");

    // Several seeds: one run per variant and seed, named with the seed, each with its seed.
    let seeded = root.join("seeded");
    let one = plan(&[Setting::Single], &[RouterReplay::R3], false, false);
    let summary = compare(&base, &one, &[3, 4], &seeded).expect("compare seeds");
    assert_eq!(summary.seeds, vec![3, 4]);
    for seed in [3, 4] {
        let dir = seeded.join("runs").join(format!("single-R3-s{seed}"));
        let cfg: toml::Table = std::fs::read_to_string(dir.join("config.toml"))
            .expect("config.toml")
            .parse()
            .expect("toml");
        assert_eq!(cfg["seed"].as_integer(), Some(seed));
    }
    let table = std::fs::read_to_string(seeded.join("results.md")).expect("results.md");
    assert!(
        table.contains("| single-R3-s3 |") && table.contains("| single-R3-s4 |"),
        "{table}"
    );
}
