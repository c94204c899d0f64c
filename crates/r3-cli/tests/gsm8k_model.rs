//! The shipped word-problem model `models/gsm8k-moe` with `configs/gsm8k-style.toml`: the
//! trainer builds from them (model, BPE tokenizer, chat template, dataset), and `r3 data
//! show` prints prompts rendered with the ChatML template whose ids decode back to the text.

use std::path::{Path, PathBuf};
use std::process::Command;

use r3_tasks::reward::answers::math_reward;
use r3_text::TextTokenizer;
use r3_train::{TrainConfig, Trainer};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn the_shipped_model_and_config_load_into_a_trainer() {
    let root = root();
    let overrides = [
        format!("model_dir={}", root.join("models/gsm8k-moe").display()),
        format!(
            "data.train_files=[{:?}]",
            root.join("data/gsm8k-style/train.parquet")
        ),
        format!(
            "data.val_files=[{:?}]",
            root.join("data/gsm8k-style/val.parquet")
        ),
        format!(
            "run_dir={:?}",
            std::env::temp_dir().join(format!("r3-gsm8k-load-{}", std::process::id()))
        ),
    ];
    let cfg = TrainConfig::resolve(Some(&root.join("configs/gsm8k-style.toml")), &overrides)
        .expect("config resolves");
    assert!(cfg.data.apply_chat_template);
    let trainer = Trainer::new(cfg).expect("trainer builds");
    let text = &trainer.tokenizer;
    assert!(text.template().is_some(), "the model ships a chat template");
    let end = text.tokenizer().token_id("<|im_end|>").expect("<|im_end|>");
    assert!(
        text.stop_ids().contains(&end),
        "generation stops at <|im_end|>"
    );
    let items = trainer.prompts.eval_items(text).expect("eval prompts");
    assert!(!items.is_empty());
    for item in &items {
        assert!(
            item.text.ends_with("<|im_start|>assistant\n"),
            "{}",
            item.text
        );
        let back = text.tokenizer().decode(&item.ids, false).expect("decode");
        assert_eq!(back, item.text, "prompt ids round trip");
    }
}

#[test]
fn data_show_renders_the_chat_template_with_ids_that_round_trip() {
    let root = root();
    let out = Command::new(env!("CARGO_BIN_EXE_r3"))
        .current_dir(&root)
        .args([
            "data",
            "show",
            "--config",
            "configs/gsm8k-style.toml",
            "--n",
            "3",
            "--response",
            "#### 42",
        ])
        .output()
        .expect("run r3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tok = TextTokenizer::from_model_dir(&root.join("models/gsm8k-moe")).expect("tokenizer");
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(lines.len(), 3);
    for line in &lines {
        let text = line["prompt_text"].as_str().expect("text");
        assert!(text.starts_with("<|im_start|>user\n"), "{text}");
        assert!(
            text.ends_with("<|im_end|>\n<|im_start|>assistant\n"),
            "{text}"
        );
        let ids: Vec<u32> = line["token_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        assert_eq!(ids, tok.encode(text, false).expect("encode"));
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
        let truth = line["ground_truth"].as_str().expect("truth");
        assert_eq!(line["reward"], f64::from(math_reward("#### 42", truth)));
    }
}
