//! The stop ids the trainer sends its rollout fleet are the ids an r3 (or SGLang) worker stops
//! at: with `<|eom_id|>` an added token of the tokenizer, both sides hold it, so a worker's
//! `stop` reply ending in it is one the fleet asked for.

use std::path::PathBuf;

use r3_server::generation::model_stop_ids;
use r3_server::TextCodec;
use r3_train::rl::sampling::stop_ids;
use r3_train::ModelText;
use serde_json::{json, Value};

/// `<|eom_id|>`'s id in [`model_dir`]'s tokenizer.
const EOM: u32 = 4;

/// A model directory: word-level tokenizer `a`=0, `b`=1, `</s>`=2 (its eos), `<|eot_id|>`=3,
/// and `<|eom_id|>`=4 as an added token; config.json's eos 3, generation_config.json's 2 and 3.
fn model_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("r3-train-stop-ids-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let added = |id: u32, content: &str| -> Value {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added(3, "<|eot_id|>"), added(EOM, "<|eom_id|>")],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "a",
            "vocab": {"a": 0, "b": 1, "</s>": 2, "<|eot_id|>": 3}},
    });
    let files = [
        ("tokenizer.json", tok),
        ("tokenizer_config.json", json!({"eos_token": "</s>"})),
        ("config.json", json!({"eos_token_id": 3})),
        ("generation_config.json", json!({"eos_token_id": [2, 3]})),
    ];
    for (name, v) in files {
        std::fs::write(dir.join(name), v.to_string()).expect("write model file");
    }
    dir
}

#[test]
fn the_trainer_asks_for_every_id_the_server_stops_at() {
    let dir = model_dir();
    let text = ModelText::from_model_dir(&dir).expect("model text");
    let codec = TextCodec::from_model_dir(&dir)
        .expect("codec")
        .expect("a tokenizer");
    let _ = std::fs::remove_dir_all(&dir);
    // The engine's eos is config.json's (3); the server adds generation_config.json's.
    let mut trainer = stop_ids(&[3], &text);
    let mut server = model_stop_ids(&[3], &[2, 3], Some(codec.tokenizer()));
    trainer.sort_unstable();
    server.sort_unstable();
    assert_eq!(trainer, vec![2, 3, EOM]);
    assert_eq!(server, trainer);
}
