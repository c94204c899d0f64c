//! The text the reward reads ends where the engines stop: at the first of the rollout's stop
//! ids (`rl::sampling::stop_ids`: the model's eos, the tokenizer's stop ids and SGLang's extra
//! turn-final added tokens such as `<|eom_id|>`), not only at the tokenizer's own.

use std::path::PathBuf;

use r3_train::rl::sampling::stop_ids;
use r3_train::ModelText;
use serde_json::json;

/// `<|eom_id|>`'s id in [`model_dir`]'s tokenizer.
const EOM: u32 = 5;
/// config.json's eos, which no tokenizer file names (the engine's own eos).
const ENGINE_EOS: u32 = 4;

/// A model directory: word-level tokenizer `a`=0, `b`=1, `</s>`=2 (its eos), `c`=3, `d`=4,
/// and `<|eom_id|>`=5 an added token that is not special (so decoding keeps its text, as it
/// keeps a plain word's).
fn model_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("r3-train-completion-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": EOM, "content": "<|eom_id|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": false}],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "a",
            "vocab": {"a": 0, "b": 1, "</s>": 2, "c": 3, "d": ENGINE_EOS}},
    });
    let files = [
        ("tokenizer.json", tok),
        ("tokenizer_config.json", json!({"eos_token": "</s>"})),
    ];
    for (name, v) in files {
        std::fs::write(dir.join(name), v.to_string()).expect("write model file");
    }
    dir
}

/// A response ending in `<|eom_id|>` (where the engines stop, as SGLang does) reads "a b",
/// not "a b <|eom_id|>" (before, only the tokenizer's `</s>` cut the text); one ending in
/// the engine's eos `d` reads "a c"; `</s>` still cuts too. Ids past a stop id (a response
/// no engine would have continued) are not read.
#[test]
fn completion_text_ends_at_the_rollouts_stop_ids() {
    let dir = model_dir();
    let text = ModelText::from_model_dir(&dir).expect("model text");
    let _ = std::fs::remove_dir_all(&dir);
    let stop = stop_ids(&[ENGINE_EOS], &text);
    let read = |ids: &[u32]| text.decode_completion(ids, &stop).expect("decode");
    assert_eq!(read(&[0, 1]), "a b");
    assert_eq!(read(&[0, 1, EOM]), "a b");
    assert_eq!(read(&[0, EOM, 1, 3]), "a");
    assert_eq!(read(&[0, 3, ENGINE_EOS]), "a c");
    assert_eq!(read(&[0, 1, 2, 3]), "a b");
}
