//! `r3 data generate` and `r3 data show` from the command line: the generated files load to
//! the same rows in both formats, and `show` prints one JSON object per row with the
//! rendered prompt, its token ids (or why they could not be made) and the reward of the
//! given response.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use r3_tasks::dataset::load_file;
use r3_tasks::reward::answers::math_reward;
use r3_test_support::Scratch;

fn r3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_r3"))
        .args(args)
        .output()
        .expect("run r3")
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn arith_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/arith-moe")
}

#[test]
fn generate_writes_jsonl_and_parquet_twins() {
    let out = Scratch::new("cli-data-generate");
    let o = r3(&[
        "data",
        "generate",
        "--out",
        path(&out),
        "--train",
        "30",
        "--val",
        "6",
        "--seed",
        "3",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for split in ["train", "val"] {
        let j = load_file(&out.join(format!("{split}.jsonl")), "prompt").expect("jsonl");
        let p = load_file(&out.join(format!("{split}.parquet")), "prompt").expect("parquet");
        assert_eq!(j, p, "{split}");
        assert_eq!(j.len(), if split == "train" { 30 } else { 6 });
    }
}

#[test]
fn show_prints_prompt_ids_truth_and_reward() {
    let out = Scratch::new("cli-data-show");
    let gen = r3(&[
        "data",
        "generate",
        "--out",
        path(&out),
        "--train",
        "5",
        "--val",
        "2",
        "--seed",
        "1",
    ]);
    assert!(
        gen.status.success(),
        "{}",
        String::from_utf8_lossy(&gen.stderr)
    );
    let config = out.join("show.toml");
    std::fs::write(
        &config,
        format!(
            "model_dir = {:?}\n[data]\ntrain_files = [{:?}]\nval_files = [{:?}]\n[reward]\nkind = \"math\"\n",
            path(&arith_model()),
            path(&out.join("train.parquet")),
            path(&out.join("val.jsonl")),
        ),
    )
    .expect("config");
    let o = r3(&[
        "data",
        "show",
        "--config",
        path(&config),
        "--n",
        "2",
        "--response",
        "#### 42",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(lines.len(), 2);
    for line in &lines {
        let truth = line["ground_truth"].as_str().expect("truth");
        assert_eq!(line["reward"], f64::from(math_reward("#### 42", truth)));
        assert!(line["prompt_text"].as_str().expect("text").contains("####"));
        // The character tokenizer cannot spell words: the ids are missing and the reason given.
        assert!(line["token_ids"].is_null());
        assert!(line["encode_error"]
            .as_str()
            .expect("why")
            .contains("alphabet"));
    }

    // The built-in task: ids start with <bos> (1) and the arith reward judges `#N`.
    let o = r3(&[
        "data",
        "show",
        "--n",
        "1",
        "--set",
        &format!("model_dir={}", path(&arith_model())),
        "--response",
        "#7",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let line: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).trim()).expect("json");
    assert_eq!(line["token_ids"][0], 1);
    let truth: i64 = line["ground_truth"]
        .as_str()
        .expect("truth")
        .parse()
        .expect("int");
    assert_eq!(line["correct"], truth == 7);
}

/// `show` marks the rows training drops as too long (`kept: false`) with the limit they
/// pass; it printed them like any other row before. The character tokenizer spells
/// `<bos>` + one id per character: `1+2=` is 5 tokens, `12+34=` 7.
#[test]
fn show_marks_rows_training_drops_as_too_long() {
    let out = Scratch::new("cli-data-show-kept");
    let rows = out.join("rows.jsonl");
    let row = |p: &str, a: i64| {
        serde_json::json!({
            "prompt": [{"role": "user", "content": p}],
            "reward_model": {"ground_truth": a.to_string()},
        })
        .to_string()
    };
    std::fs::write(
        &rows,
        format!("{}\n{}\n", row("1+2=", 3), row("12+34=", 46)),
    )
    .expect("rows");
    let config = out.join("show.toml");
    std::fs::write(
        &config,
        format!(
            "model_dir = {:?}\n[data]\ntrain_files = [{:?}]\nval_files = [{:?}]\nmax_prompt_length = 5\n",
            path(&arith_model()),
            path(&rows),
            path(&rows),
        ),
    )
    .expect("config");
    let o = r3(&["data", "show", "--config", path(&config), "--n", "2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    let got: Vec<_> = lines
        .iter()
        .map(|l| {
            (
                l["num_tokens"].clone(),
                l["kept"].clone(),
                l["prompt_limit"].clone(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (5.into(), true.into(), 5.into()),
            (7.into(), false.into(), 5.into())
        ]
    );
}
