//! Model directories whose files do not agree with the engine or with each other are refused
//! at start by every command that reads one (`r3 forward`, `r3 generate`, `r3 serve`,
//! `r3 train`), naming what is wrong: weights past the finite range of the engine's
//! precision (embeddings scaled past f16's 65504, accepted by an f32 engine), and a
//! tokenizer whose vocabulary does not match the model's (5 or 24 tokens beside the shipped
//! 23-token model; the same model without a tokenizer serves token ids).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use candle_core::Device;
use r3_model::{Config, Weights};
use serde_json::Value;

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("r3-model-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn shipped() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/arith-moe")
}

/// A copy of the shipped model in `dst` (its tokenizer included when `tokenizer`).
fn model_copy(dst: &Path, tokenizer: bool) {
    std::fs::create_dir_all(dst).expect("model dir");
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        if f != "tokenizer.json" || tokenizer {
            std::fs::copy(shipped().join(f), dst.join(f)).expect("copy model file");
        }
    }
}

fn r3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_r3"))
        .args(args)
        .output()
        .expect("run r3")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `r3 serve` on `model` with `extra` flags: Ok once it logs that it listens (then it is
/// killed), Err(stderr) when it exits first.
fn serve(model: &Path, extra: &[&str]) -> Result<(), String> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_r3"))
        .args(["serve", "--host", "127.0.0.1", "--port", "0", "--model"])
        .arg(model)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start r3 serve");
    let err = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let started = Instant::now();
    let mut log = String::new();
    let outcome = loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                let listening = line.contains("r3 serve listening");
                log.push_str(&line);
                log.push('\n');
                if listening {
                    break Ok(());
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break Err(log.clone()),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if started.elapsed() > Duration::from_secs(120) {
            break Err(format!("neither listening nor exited within 120 s:\n{log}"));
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    outcome
}

/// `r3 train` on `model` for one tiny step in `run_dir`, with `extra` overrides.
fn train(model: &Path, run_dir: &Path, extra: &[&str]) -> Output {
    let model_set = format!("model_dir={}", model.display());
    let run_set = format!("run_dir={}", run_dir.display());
    let mut sets = vec![
        model_set.as_str(),
        run_set.as_str(),
        "steps=1",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "algo.dynamic_sampling=false",
        "eval.size=2",
        "eval.every=1",
        "checkpoint.every=1",
    ];
    sets.extend_from_slice(extra);
    let mut args = vec!["train", "--no-progress"];
    for s in &sets {
        args.push("--set");
        args.push(s);
    }
    r3(&args)
}

/// The shipped model with its embeddings × `scale` in `dst` (tokenizer included).
fn scaled_embeddings(dst: &Path, scale: f64) {
    model_copy(dst, true);
    let cfg = Config::from_file(&dst.join("config.json")).expect("config");
    let mut map = Weights::load(dst, &cfg, &Device::Cpu)
        .expect("load")
        .into_map();
    let name = "model.embed_tokens.weight";
    let scaled = map[name].affine(scale, 0.0).expect("scale");
    map.insert(name.into(), scaled);
    Weights::from_map(map).save(dst, &cfg).expect("save");
}

/// The logits `r3 forward` prints.
fn logits(out: &Output) -> Vec<f64> {
    assert!(out.status.success(), "{}", stderr(out));
    let v: Value = serde_json::from_slice(&out.stdout).expect("forward json");
    v["logits"]
        .as_array()
        .expect("logits")
        .iter()
        .flat_map(|row| row.as_array().expect("row").iter())
        .map(|x| x.as_f64().expect("finite logit"))
        .collect()
}

#[test]
fn weights_past_the_engines_range_are_refused_by_every_command_naming_the_tensor() {
    let scratch = Scratch::new("range");
    let model = scratch.0.join("model");
    // Embedding values of about ±0.1–1 become ±1e5–1e6: past f16's 65504, fine in f32.
    scaled_embeddings(&model, 1e6);
    let m = model.to_str().expect("utf-8 path");
    let names_the_tensor = |what: &str, text: &str| {
        assert!(
            text.contains("model.embed_tokens.weight")
                && text.contains("outside the finite range of f16"),
            "{what}: {text}"
        );
    };

    let out = r3(&[
        "forward",
        "--model",
        m,
        "--input-ids",
        "1,4,13,5",
        "--dtype",
        "f16",
    ]);
    assert!(!out.status.success(), "forward --dtype f16 accepted it");
    names_the_tensor("forward", &stderr(&out));
    // f32 holds the values: the forward runs and every logit is a number.
    let accepted = logits(&r3(&["forward", "--model", m, "--input-ids", "1,4,13,5"]));
    assert_eq!(accepted.len(), 4 * 23);

    let out = r3(&[
        "generate",
        "--model",
        m,
        "--input-ids",
        "1,4",
        "--max-new-tokens",
        "2",
    ]);
    assert!(!out.status.success(), "generate (f16) accepted it");
    names_the_tensor("generate", &stderr(&out));
    let out = r3(&[
        "generate",
        "--model",
        m,
        "--input-ids",
        "1,4",
        "--max-new-tokens",
        "2",
        "--dtype",
        "f32",
    ]);
    assert!(
        out.status.success(),
        "generate --dtype f32: {}",
        stderr(&out)
    );

    let refused = serve(&model, &[]).expect_err("serve (f16) started");
    names_the_tensor("serve", &refused);
    serve(&model, &["--dtype", "f32"]).expect("serve --dtype f32 starts");

    let out = train(&model, &scratch.0.join("run-f16"), &[]);
    assert!(!out.status.success(), "train (f16 rollout) accepted it");
    names_the_tensor("train", &stderr(&out));
    let out = train(&model, &scratch.0.join("run-f32"), &["rollout.dtype=f32"]);
    assert!(
        out.status.success(),
        "train with an f32 rollout: {}",
        stderr(&out)
    );
}

/// The shipped tokenizer cut to its first `keep` tokens, or grown by `add` tokens.
fn resized_tokenizer(dir: &Path, keep: usize, add: usize) {
    let text = std::fs::read_to_string(shipped().join("tokenizer.json")).expect("tokenizer");
    let mut tok: Value = serde_json::from_str(&text).expect("json");
    let vocab = tok["model"]["vocab"].as_object_mut().expect("vocab");
    vocab.retain(|_, id| id.as_u64().is_some_and(|i| (i as usize) < keep));
    let size = vocab.len();
    for k in 0..add {
        vocab.insert(format!("extra{k}"), Value::from(size + k));
    }
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).expect("write tokenizer");
}

#[test]
fn a_tokenizer_that_does_not_fit_the_model_is_refused_by_every_command() {
    let scratch = Scratch::new("vocab");
    for (tokens, keep, add) in [(5, 5, 0), (24, 23, 1)] {
        let model = scratch.0.join(format!("model-{tokens}"));
        model_copy(&model, false);
        resized_tokenizer(&model, keep, add);
        let m = model.to_str().expect("utf-8 path");
        let expected = format!("tokenizer.json has {tokens} tokens but the model's vocabulary");
        let check = |what: &str, text: &str| {
            assert!(
                text.contains(&expected) && text.contains("vocab_size) is 23"),
                "{what} with {tokens} tokens: {text}"
            );
        };
        let out = r3(&["forward", "--model", m, "--input-ids", "1,4"]);
        assert!(!out.status.success());
        check("forward", &stderr(&out));
        let out = r3(&[
            "generate",
            "--model",
            m,
            "--input-ids",
            "1,4",
            "--max-new-tokens",
            "2",
        ]);
        assert!(!out.status.success());
        check("generate", &stderr(&out));
        check("serve", &serve(&model, &[]).expect_err("serve started"));
        let out = train(&model, &scratch.0.join(format!("run-{tokens}")), &[]);
        assert!(!out.status.success());
        check("train", &stderr(&out));
    }
    // Without a tokenizer the same model serves token ids.
    let ids_only = scratch.0.join("model-ids");
    model_copy(&ids_only, false);
    serve(&ids_only, &[]).expect("serving ids only starts");
}
