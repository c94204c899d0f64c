//! Training on a user dataset: `[data]` / `[reward]` configs resolve and are validated,
//! overlong prompts are dropped and counted (never truncated), the command reward is wired
//! into the step, a resumed dataset run continues the epoch exactly where it stopped, and the
//! LR schedule spans the steps the epochs allow.

mod common;

use std::path::{Path, PathBuf};

use common::{tiny_config, tiny_model, Scratch};
use r3_tasks::RewardKind;
use r3_train::config::{RouterReplay, TrainConfig};
use r3_train::rl::checkpoint::{list_checkpoints, read_state};
use r3_train::rl::metrics_log::is_measurement;
use r3_train::{LrDecay, Quiet, Run, Trainer};

/// Arithmetic prompts (the character tokenizer's alphabet) in verl's schema.
fn write_rows(path: &Path, prompts: &[(&str, i64)]) {
    let text: String = prompts
        .iter()
        .enumerate()
        .map(|(i, (p, a))| {
            format!(
                "{}\n",
                serde_json::json!({
                    "data_source": "test",
                    "prompt": [{"role": "user", "content": p}],
                    "reward_model": {"style": "rule", "ground_truth": a.to_string()},
                    "extra_info": {"index": i},
                })
            )
        })
        .collect();
    std::fs::write(path, text).expect("write rows");
}

fn dataset_config(dir: &Path, model: &Path, run: &str) -> TrainConfig {
    let train = dir.join("train.jsonl");
    let val = dir.join("val.jsonl");
    write_rows(
        &train,
        &[
            ("1+2=", 3),
            ("4+4=", 8),
            ("9-3=", 6),
            ("2+7=", 9),
            ("5-1=", 4),
        ],
    );
    write_rows(&val, &[("3+3=", 6), ("8-2=", 6), ("1+1=", 2)]);
    let mut cfg = tiny_config(model, &dir.join(run), RouterReplay::R3, 1);
    cfg.data.train_files = vec![train];
    cfg.data.val_files = vec![val];
    cfg.eval.size = 0;
    cfg.steps = 3;
    cfg.validate().expect("valid dataset config");
    cfg
}

fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).expect("json");
            let map = v.as_object_mut().expect("object");
            map.retain(|k, _| !is_measurement(k));
            v
        })
        .collect()
}

#[test]
fn data_and_reward_sections_resolve_from_toml() {
    let text = r#"
        [data]
        train_files = ["a.jsonl", "b.parquet"]
        val_files = ["v.jsonl"]
        prompt_key = "question"
        max_prompt_length = 64
        shuffle = false
        total_epochs = 2

        [[reward.funcs]]
        kind = "math"
        weight = 1.0

        [[reward.funcs]]
        kind = "command"
        command = ["sh", "score.sh"]
        timeout_s = 5
        weight = 0.2
    "#;
    let cfg = TrainConfig::resolve_text(text, &["data.system_prompt=Be brief.".into()])
        .expect("resolves");
    assert_eq!(
        cfg.data.train_files,
        vec![PathBuf::from("a.jsonl"), PathBuf::from("b.parquet")]
    );
    assert_eq!(cfg.data.prompt_key, "question");
    assert_eq!(cfg.data.system_prompt, "Be brief.");
    let funcs = cfg.reward.resolved_funcs();
    assert_eq!(funcs.len(), 2);
    assert_eq!(funcs[1].kind, RewardKind::Command);
    assert_eq!(funcs[1].timeout_s, 5.0);
    // The saved config reads back to the same values.
    let back = TrainConfig::from_toml_str(&cfg.to_toml_string().expect("toml")).expect("parse");
    assert_eq!(back, cfg);
    // Whole steps of `prompts_per_step` (32) in 2 epochs: 20 rows give none, 200 give 6.
    assert_eq!(cfg.total_steps(Some(10)), 0);
    assert_eq!(cfg.total_steps(Some(100)), 6);
    assert_eq!(cfg.total_steps(None), cfg.steps);
}

#[test]
fn bad_data_and_reward_settings_name_their_field() {
    let cases = [
        ("[data]\ntrain_files = [\"a.jsonl\"]\n", "data.val_files"),
        (
            "[data]\ntrain_files = [\"a.jsonl\"]\nval_files = [\"b.jsonl\"]\nprompt_key = \"\"\n",
            "data.prompt_key",
        ),
        ("[data]\nval_files = [\"b.jsonl\"]\n", "data.val_files"),
        ("[reward]\nkind = \"command\"\n", "reward.command"),
        ("[reward]\nkind = \"fuzzy\"\n", "fuzzy"),
        ("[data]\nshuffel = true\n", "shuffel"),
        ("[task]\nformat_reward = 1.0\n", "task.format_reward"),
    ];
    for (text, needle) in cases {
        let err = TrainConfig::resolve_text(text, &[]).expect_err(text);
        assert!(err.to_string().contains(needle), "{needle}: {err}");
    }
}

#[test]
fn overlong_prompts_are_dropped_and_counted() {
    let dir = Scratch::new("data-overlong");
    let model = dir.path().join("model");
    tiny_model(&model, 31);
    let mut cfg = dataset_config(dir.path(), &model, "run");
    // `<bos>` + 4 characters = 5 tokens for every row; allow 5 then 4.
    cfg.data.max_prompt_length = 5;
    let t = Trainer::new(cfg.clone()).expect("all fit");
    assert_eq!(t.prompts.filtered(), 0);
    let long = dir.path().join("long.jsonl");
    write_rows(&long, &[("12+34=", 46), ("1+2=", 3), ("100-1=", 99)]);
    cfg.data.train_files = vec![long];
    let mut t = Trainer::new(cfg.clone()).expect("one fits");
    assert_eq!(t.prompts.filtered(), 2);
    let items = t.next_prompts(3).expect("prompts");
    assert!(
        items.iter().all(|i| i.text == "1+2="),
        "only the short row is left"
    );
    let m = t.rl_step().expect("step");
    assert_eq!(m.data_filtered_prompts, Some(2));
    cfg.data.max_prompt_length = 4;
    let err = Trainer::new(cfg.clone()).expect_err("nothing fits");
    assert!(err.to_string().contains("data.max_prompt_length"), "{err}");
    // No length limit: a prompt filling the model's 64 positions is dropped too (the engine
    // would refuse it and fail the step); 63 tokens leave one to generate in.
    let fill = dir.path().join("fill.jsonl");
    let (at_63, at_64) = ("1+".repeat(30) + "1=", "1+".repeat(31) + "=");
    write_rows(&fill, &[(at_64.as_str(), 0), (at_63.as_str(), 31)]);
    cfg.data.train_files = vec![fill];
    cfg.data.max_prompt_length = 0;
    let mut t = Trainer::new(cfg).expect("one fits");
    assert_eq!(t.prompts.filtered(), 1);
    let items = t.next_prompts(2).expect("prompts");
    assert!(
        items.iter().all(|i| i.ids.len() == 63),
        "only the 63-token row"
    );
    let m = t.rl_step().expect("a step on the row that fits");
    assert_eq!(m.data_filtered_prompts, Some(1));
}

#[test]
fn the_command_reward_scores_every_rollout() {
    let dir = Scratch::new("data-command");
    let model = dir.path().join("model");
    tiny_model(&model, 32);
    let mut cfg = dataset_config(dir.path(), &model, "run");
    cfg.reward.kind = RewardKind::Command;
    cfg.reward.command = vec![
        "sh".into(),
        "-c".into(),
        "while IFS= read -r l; do echo 0.75; done".into(),
    ];
    cfg.validate().expect("valid");
    let mut t = Trainer::new(cfg.clone()).expect("trainer");
    let m = t.rl_step().expect("step");
    assert_eq!(m.reward_mean, 0.75);
    assert_eq!(m.accuracy, 0.0, "0.75 < 1 is not correct");
    cfg.reward.command = vec!["sh".into(), "-c".into(), "cat >/dev/null; echo x".into()];
    let mut t = Trainer::new(cfg).expect("trainer");
    let err = t.rl_step().expect_err("a garbage verifier stops the step");
    assert!(err.to_string().contains("score lines"), "{err}");
}

#[test]
fn a_resumed_dataset_run_continues_the_epoch() {
    let dir = Scratch::new("data-resume");
    let model = dir.path().join("model");
    tiny_model(&model, 33);
    let cfg = dataset_config(dir.path(), &model, "run");
    let run_dir = cfg.run_dir.clone();
    let mut run = Run::fresh(cfg).expect("fresh");
    run.execute(&mut Quiet).expect("run");
    let full = metrics(&run_dir);
    assert_eq!(full.len(), 3);
    // 5 rows, 2 per step: step 3 takes the last row of epoch 0 and the first of epoch 1.
    assert_eq!(full[2]["data.epoch"], 1);
    let ckpts = list_checkpoints(&run_dir).expect("list");
    let state = read_state(&ckpts[1].1).expect("state");
    let pos = state.dataset_position.expect("dataset position saved");
    assert_eq!((pos.epoch, pos.index), (0, 4));

    for step in [2, 3] {
        std::fs::remove_dir_all(run_dir.join(format!("checkpoints/step_{step}"))).expect("rm");
    }
    let mut resumed = Run::resume(&run_dir).expect("resume");
    assert_eq!(resumed.trainer.step, 1);
    resumed.execute(&mut Quiet).expect("resumed");
    assert_eq!(
        metrics(&run_dir),
        full,
        "the resumed run repeats steps 2 and 3"
    );
}

/// A run the epochs end early decays its LR over the steps it takes, not over `steps`: 5
/// rows, 2 per step, one epoch: 2 steps of a cosine schedule, the second at the floor (it
/// had stayed at 99% of the peak, the schedule spread over 100 steps).
#[test]
fn the_lr_schedule_spans_the_steps_the_epochs_allow() {
    let dir = Scratch::new("data-lr");
    let model = dir.path().join("model");
    tiny_model(&model, 34);
    let mut cfg = dataset_config(dir.path(), &model, "run");
    cfg.steps = 100;
    cfg.data.total_epochs = 1;
    cfg.optim.warmup_steps = 0;
    cfg.optim.lr_decay = LrDecay::Cosine;
    cfg.validate().expect("valid");
    let mut t = Trainer::new(cfg.clone()).expect("trainer");
    assert_eq!(t.total_steps(), 2);
    let lrs: Vec<f64> = (0..2)
        .map(|_| t.rl_step().expect("step").lr.expect("an update ran"))
        .collect();
    let peak = cfg.optim.lr;
    let want = [peak, peak * cfg.optim.min_lr_ratio];
    for (got, want) in lrs.iter().zip(want) {
        assert!((got - want).abs() < 1e-12 * peak, "{lrs:?} vs {want}");
    }
}

/// A verifier that scores its first batch alike (every group uniform) and later ones 1, 0,
/// 1, 0 (every group differs), counting its batches in `count`.
fn first_batch_uniform(count: &Path) -> Vec<String> {
    let c = count.display();
    let script = format!(
        "n=$(cat {c} 2>/dev/null || echo 0); echo $((n+1)) > {c}; i=0; \
         while IFS= read -r l; do \
         if [ \"$n\" -eq 0 ]; then echo 1; else echo $(((i + 1) % 2)); fi; i=$((i+1)); done"
    );
    vec!["sh".into(), "-c".into(), script]
}

/// DAPO's dynamic sampling with refill: the first round's groups all score alike, so the
/// step draws a second round of fresh prompts and trains on its groups; drop-only (one
/// round) keeps none and takes no optimiser step.
#[test]
fn dynamic_sampling_refills_the_groups_a_round_dropped() {
    let dir = Scratch::new("data-refill");
    let model = dir.path().join("model");
    tiny_model(&model, 35);
    let count = dir.path().join("batches");
    let mut cfg = dataset_config(dir.path(), &model, "run");
    cfg.eval.every = 1000;
    cfg.algo.dynamic_sampling = true;
    cfg.reward.kind = RewardKind::Command;
    cfg.reward.command = first_batch_uniform(&count);
    let position = |t: &Trainer| t.prompt_position().1.map(|p| (p.epoch, p.index));

    cfg.algo.sampling_rounds = 3;
    cfg.validate().expect("valid");
    let mut t = Trainer::new(cfg.clone()).expect("trainer");
    let m = t.rl_step().expect("step");
    assert_eq!(m.sampling_rounds, Some(2), "filled by the second round");
    assert_eq!(m.sampling_groups_drawn, Some(4));
    assert_eq!((m.groups_kept, m.groups_dropped), (2, 2));
    assert_eq!(m.reward_mean, 0.5, "the second round's 1, 0, 1, 0");
    assert_eq!((m.updates_applied, m.updates_skipped), (1, 0));
    assert_eq!(position(&t), Some((0, 4)), "two rounds of two prompts");
    assert_eq!(std::fs::read_to_string(&count).expect("count").trim(), "2");

    // One epoch of 5 rows is 2 steps of 2 prompts: the one row left is too few to refill
    // with, so step 1 keeps no group and the run stays within its epoch.
    std::fs::remove_file(&count).expect("reset the count");
    let mut one_epoch = cfg.clone();
    one_epoch.data.total_epochs = 1;
    let mut t = Trainer::new(one_epoch).expect("trainer");
    assert_eq!(t.total_steps(), 2);
    let m = t.rl_step().expect("step");
    assert_eq!((m.sampling_rounds, m.groups_kept), (Some(1), 0));
    assert_eq!(position(&t), Some((0, 2)));

    std::fs::remove_file(&count).expect("reset the count");
    cfg.algo.sampling_rounds = 1;
    let mut t = Trainer::new(cfg).expect("trainer");
    let m = t.rl_step().expect("step");
    assert_eq!(m.sampling_rounds, None);
    assert_eq!((m.groups_kept, m.groups_dropped), (0, 2));
    assert_eq!(
        (m.updates_applied, m.updates_skipped),
        (0, 1),
        "nothing to learn"
    );
    assert!(!m.skipped_update, "no numerical failure");
    assert_eq!(position(&t), Some((0, 2)));
}

/// verl search-R1's ground truth is an object (`{"target": [...]}`): with a `command`
/// reward the dataset loads and the verifier reads the object as the row holds it (r3
/// refused the whole file before); with a built-in rule it is an error naming file, row and
/// field.
#[test]
fn an_object_ground_truth_reaches_a_command_verifier_as_it_is() {
    let dir = Scratch::new("data-object-truth");
    let model = dir.path().join("model");
    tiny_model(&model, 36);
    let mut cfg = dataset_config(dir.path(), &model, "run");
    let train = dir.path().join("objects.jsonl");
    let rows: String = ["1+2=", "4+4="]
        .iter()
        .map(|p| {
            format!(
                "{}\n",
                serde_json::json!({
                    "prompt": [{"role": "user", "content": p}],
                    "reward_model": {"ground_truth": {"target": ["3", "three"]}},
                })
            )
        })
        .collect();
    std::fs::write(&train, rows).expect("write");
    cfg.data.train_files = vec![train];
    cfg.reward.kind = RewardKind::Command;
    cfg.reward.command = vec![
        "sh".into(),
        "-c".into(),
        r#"while IFS= read -r l; do case "$l" in *'"ground_truth":{"target":["3","three"]},'*) echo 0.5;; *) echo 0;; esac; done"#.into(),
    ];
    cfg.validate().expect("valid");
    let mut t = Trainer::new(cfg.clone()).expect("an object truth loads for a command");
    let m = t.rl_step().expect("step");
    assert_eq!(m.reward_mean, 0.5, "every line carried the object");

    cfg.reward.kind = RewardKind::Math;
    cfg.reward.command = Vec::new();
    let err = Trainer::new(cfg).expect_err("math cannot compare an object");
    let err = err.to_string();
    for want in [
        "objects.jsonl",
        "row 0",
        "reward_model.ground_truth",
        "an object",
    ] {
        assert!(err.contains(want), "{want}: {err}");
    }
}

/// `data.total_epochs` with fewer prompts than one step takes ran 0 steps and exited 0 as
/// if it had trained (verl asserts "Train dataloader is empty!"): now a config error naming
/// the field and the counts. 5 rows × 1 epoch = 5 < 8 prompts per step; 2 epochs hold 10,
/// one step (steps run across the epoch boundary).
#[test]
fn epochs_too_few_for_one_step_are_refused() {
    let dir = Scratch::new("data-empty-epochs");
    let model = dir.path().join("model");
    tiny_model(&model, 37);
    let mut cfg = dataset_config(dir.path(), &model, "run");
    cfg.rollout.prompts_per_step = 8;
    cfg.data.total_epochs = 1;
    cfg.validate().expect("valid before the rows are counted");
    let err = Trainer::new(cfg.clone())
        .expect_err("no step fits")
        .to_string();
    for want in [
        "data.total_epochs",
        "5 training prompts × 1 epochs = 5 prompts",
        "8 of one step (rollout.prompts_per_step)",
        "raise data.total_epochs to 2 or more",
    ] {
        assert!(err.contains(want), "{want}: {err}");
    }
    let err = Run::fresh(cfg.clone()).expect_err("nor a run").to_string();
    assert!(err.contains("data.total_epochs"), "{err}");
    cfg.data.total_epochs = 2;
    assert_eq!(
        Trainer::new(cfg.clone()).expect("one step").total_steps(),
        1
    );
    cfg.data.total_epochs = 0;
    assert_eq!(
        Trainer::new(cfg.clone())
            .expect("epochs as steps need")
            .total_steps(),
        cfg.steps
    );
}
