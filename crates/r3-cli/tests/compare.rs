//! `r3 compare` end to end on a tiny random MoE model: two replay modes × one setting, two RL
//! steps each, run in-process by the binary; checks one run directory per variant with the
//! right resolved config, one metrics line per step, and the results table with one row per
//! run and the crash rule.

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::Device;
use r3_model::{Config, RandomInit, Weights};
use r3_tasks::CharTokenizer;
use r3_train::pretrain_config::{ModelShape, PretrainConfig};
use serde_json::Value;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("r3-compare-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A tiny random Qwen3-MoE-style model with r3's tokenizer (2 layers, 4 experts, top-2).
fn tiny_model(dir: &Path) {
    let pcfg = PretrainConfig {
        model: ModelShape {
            hidden_size: 32,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 16,
            num_experts: 4,
            num_experts_per_tok: 2,
            moe_intermediate_size: 32,
            max_position_embeddings: 64,
            rope_theta: 10000.0,
            init_std: 0.1,
            router_init_std: 0.3,
        },
        ..PretrainConfig::default()
    };
    let tokenizer = CharTokenizer::new().expect("tokenizer");
    let cfg = Config::from_value(pcfg.hf_config(tokenizer.vocab_size())).expect("config");
    let weights = Weights::random(&cfg, &RandomInit::new(3), &Device::Cpu).expect("weights");
    weights.save(dir, &cfg).expect("save model");
    tokenizer
        .save(&dir.join("tokenizer.json"))
        .expect("save tokenizer");
}

#[test]
fn compare_two_modes_two_steps_writes_runs_and_table() {
    let root = scratch("e2e");
    let model = root.join("model");
    tiny_model(&model);
    let out = root.join("out");
    let set = |kv: &str| ["--set".to_string(), kv.to_string()];
    let mut args: Vec<String> = vec![
        "--log".into(),
        "warn".into(),
        "compare".into(),
        "--steps".into(),
        "2".into(),
        "--eval-every".into(),
        "1".into(),
        "--modes".into(),
        "disabled,R3".into(),
        "--settings".into(),
        "single".into(),
        "--seed".into(),
        "11".into(),
        "--no-progress".into(),
        "--out".into(),
        out.display().to_string(),
    ];
    for kv in [
        format!("model_dir={}", model.display()),
        "task.difficulty=1".into(),
        "rollout.prompts_per_step=2".into(),
        "rollout.group_size=2".into(),
        "rollout.max_new_tokens=6".into(),
        "algo.dynamic_sampling=false".into(),
        "eval.size=4".into(),
        "checkpoint.every=0".into(),
    ] {
        args.extend(set(&kv));
    }
    let run = Command::new(env!("CARGO_BIN_EXE_r3"))
        .args(&args)
        .output()
        .expect("run r3");
    assert!(
        run.status.success(),
        "r3 compare failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );

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
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(stdout.contains("| single-R3"), "stdout: {stdout}");

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
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn compare_rejects_unknown_mode() {
    let out = scratch("bad-mode");
    let run = Command::new(env!("CARGO_BIN_EXE_r3"))
        .args(["compare", "--modes", "R4", "--out"])
        .arg(&out)
        .output()
        .expect("run r3");
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("unknown replay mode \"r4\""), "stderr: {err}");
    let _ = std::fs::remove_dir_all(&out);
}
