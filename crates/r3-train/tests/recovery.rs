//! Recovery from a kill or a damaged run directory: every checkpoint carries a manifest of
//! sha256 sums, a resume falls back past a damaged newest checkpoint to the newest one that
//! verifies, and the base evaluation is logged even when the kill came before it.

mod common;

use std::path::Path;

use common::{tiny_config, tiny_model, Scratch};
use r3_train::config::RouterReplay;
use r3_train::rl::checkpoint::verified_checkpoint;
use r3_train::rl::manifest::{file_sha256, Manifest, MANIFEST_FILE};
use r3_train::{Quiet, Run, TrainError};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read dir") {
        let entry = entry.expect("entry");
        let dest = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &dest);
        } else {
            std::fs::copy(entry.path(), &dest).expect("copy");
        }
    }
}

fn eval_steps(run_dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(run_dir.join("eval.jsonl"))
        .expect("eval log")
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).expect("json")["step"]
                .as_u64()
                .expect("step")
        })
        .collect()
}

#[test]
fn the_manifest_lists_every_checkpoint_file_with_its_sha256() {
    let dir = Scratch::new("manifest");
    let model = dir.path().join("model");
    tiny_model(&model, 51);
    let run_dir = dir.path().join("run");
    let mut cfg = tiny_config(&model, &run_dir, RouterReplay::R3, 1);
    cfg.steps = 1;
    Run::fresh(cfg)
        .expect("run")
        .execute(&mut Quiet)
        .expect("execute");
    let ckpt = run_dir.join("checkpoints/step_1");
    let text = std::fs::read_to_string(ckpt.join(MANIFEST_FILE)).expect("manifest");
    let manifest: Manifest = serde_json::from_str(&text).expect("parses");
    let mut files: Vec<String> = std::fs::read_dir(&ckpt)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
        .filter(|n| n != MANIFEST_FILE)
        .collect();
    files.sort();
    assert_eq!(manifest.sha256.keys().cloned().collect::<Vec<_>>(), files);
    // The sum of the empty input, by the standard, checks the hash itself.
    let empty = dir.path().join("empty");
    std::fs::write(&empty, b"").expect("write");
    assert_eq!(
        file_sha256(&empty).expect("hash"),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    for (name, sum) in &manifest.sha256 {
        assert_eq!(&file_sha256(&ckpt.join(name)).expect("hash"), sum, "{name}");
    }
}

/// Damage done to the newest checkpoint of a copy of a finished run.
type Damage = fn(&Path);

fn flip_weight_byte(ckpt: &Path) {
    let path = ckpt.join("model.safetensors");
    let mut bytes = std::fs::read(&path).expect("read");
    let i = bytes.len() - 5;
    bytes[i] ^= 0x01;
    std::fs::write(&path, bytes).expect("write");
}

fn edit_trainer_state(ckpt: &Path) {
    let path = ckpt.join("trainer_state.json");
    let text = std::fs::read_to_string(&path).expect("read");
    let mut v: serde_json::Value = serde_json::from_str(&text).expect("json");
    v["optimizer_steps"] = serde_json::json!(99);
    std::fs::write(&path, serde_json::to_string_pretty(&v).expect("json")).expect("write");
}

fn remove_manifest(ckpt: &Path) {
    std::fs::remove_file(ckpt.join(MANIFEST_FILE)).expect("rm");
}

#[test]
fn a_damaged_newest_checkpoint_falls_back_to_the_previous_one() {
    let dir = Scratch::new("fallback");
    let model = dir.path().join("model");
    tiny_model(&model, 52);
    let run_dir = dir.path().join("run");
    let mut cfg = tiny_config(&model, &run_dir, RouterReplay::R3, 1);
    cfg.steps = 3;
    let full = Run::fresh(cfg)
        .expect("run")
        .execute(&mut Quiet)
        .expect("uninterrupted");
    let damages: [(&str, Damage, &str); 3] = [
        ("flipped weight byte", flip_weight_byte, "model.safetensors"),
        (
            "edited trainer state",
            edit_trainer_state,
            "trainer_state.json",
        ),
        ("missing manifest", remove_manifest, "manifest"),
    ];
    for (what, damage, named) in damages {
        let copy = dir.path().join(what.replace(' ', "-"));
        copy_dir(&run_dir, &copy);
        damage(&copy.join("checkpoints/step_3"));
        let chosen = verified_checkpoint(&copy)
            .expect("verify")
            .expect("a checkpoint");
        assert_eq!(chosen.state.step, 2, "{what}");
        assert_eq!(chosen.skipped.len(), 1, "{what}");
        assert!(chosen.skipped[0].0.ends_with("step_3"), "{what}");
        assert!(
            chosen.skipped[0].1.contains(named),
            "{what}: the reason names the problem: {}",
            chosen.skipped[0].1
        );
        let mut resumed = Run::resume(&copy).expect("resume");
        assert_eq!(resumed.trainer.step, 2, "{what}");
        let summary = resumed.execute(&mut Quiet).expect("resumed run");
        assert_eq!(summary.steps_run, 1, "{what}");
        assert_eq!(summary.eval_first, full.eval_first, "{what}: the base eval");
        assert_eq!(eval_steps(&copy), [0, 1, 2, 3], "{what}");
    }
    // With every checkpoint damaged the resume is an error naming each reason.
    let copy = dir.path().join("all-damaged");
    copy_dir(&run_dir, &copy);
    for step in 1..=3 {
        remove_manifest(&copy.join(format!("checkpoints/step_{step}")));
    }
    match verified_checkpoint(&copy) {
        Err(TrainError::NoVerifiedCheckpoint { reasons, .. }) => {
            assert_eq!(reasons.matches("no manifest.json").count(), 3, "{reasons}")
        }
        other => panic!("expected no usable checkpoint, got {other:?}"),
    }
}

#[test]
fn a_kill_before_the_base_evaluation_is_logged_gets_it_on_resume() {
    let dir = Scratch::new("kill-before-eval");
    let model = dir.path().join("model");
    tiny_model(&model, 53);
    let mut cfg = tiny_config(&model, &dir.path().join("whole"), RouterReplay::R3, 1);
    cfg.steps = 2;
    let whole = Run::fresh(cfg.clone())
        .expect("run")
        .execute(&mut Quiet)
        .expect("uninterrupted");
    assert_eq!(whole.eval_first.map(|e| e.0), Some(0));

    // Killed after the run directory was set up, before the base evaluation was logged.
    let killed = dir.path().join("killed");
    cfg.run_dir = killed.clone();
    drop(Run::fresh(cfg).expect("set up"));
    assert!(!killed.join("eval.jsonl").exists() || eval_steps(&killed).is_empty());
    let summary = Run::resume(&killed)
        .expect("resume")
        .execute(&mut Quiet)
        .expect("resumed run");
    assert_eq!(eval_steps(&killed), [0, 1, 2]);
    assert_eq!(summary.eval_first, whole.eval_first);
    assert_eq!(summary.evals, whole.evals);
}
