//! The character tokenizer: ids, round trips, HF tokenizer.json save/load, errors.

use r3_tasks::{
    ArithmeticTask, CharTokenizer, Difficulty, TaskError, ALPHABET, BOS_ID, EOS_ID, PAD_ID,
};
use r3_test_support::Scratch;

#[test]
fn ids_are_specials_then_alphabet_in_order() {
    let tok = CharTokenizer::new().expect("build");
    assert_eq!((PAD_ID, BOS_ID, EOS_ID), (0, 1, 2));
    assert_eq!(tok.vocab_size(), 3 + ALPHABET.chars().count());
    assert!(tok.vocab_size() < 64);
    // Independent truth: id = 3 + index of the character in ALPHABET.
    let text = "12+7*3=7*3=21;12+21=33#33 (x)\n".replace('x', "9");
    let want: Vec<u32> = text
        .chars()
        .map(|c| 3 + ALPHABET.chars().position(|a| a == c).expect("in alphabet") as u32)
        .collect();
    assert_eq!(tok.encode(&text).expect("encode"), want);
    assert_eq!(tok.encode("").expect("empty"), Vec::<u32>::new());
}

#[test]
fn round_trips_generated_problems() {
    let tok = CharTokenizer::new().expect("build");
    for level in 1..=5 {
        let task = ArithmeticTask::new(Difficulty::level(level).expect("preset"), 50, level as u64)
            .expect("task");
        for p in task.eval_set() {
            let text = p.full_text();
            let ids = tok.encode(&text).expect("encode");
            assert_eq!(ids.len(), text.chars().count(), "one token per char");
            assert_eq!(tok.decode(&ids).expect("decode"), text);
        }
    }
}

#[test]
fn specials_decode_to_nothing_and_completion_stops_at_eos() {
    let tok = CharTokenizer::new().expect("build");
    let mut ids = tok.encode_prompt("1+2=").expect("prompt");
    assert_eq!(ids[0], BOS_ID);
    ids.extend(tok.encode("1+2=3#3").expect("encode"));
    assert_eq!(tok.decode(&ids).expect("decode"), "1+2=1+2=3#3");
    let mut completion = tok.encode("1+2=3#3").expect("encode");
    completion.push(EOS_ID);
    completion.extend(tok.encode("99").expect("encode"));
    completion.push(PAD_ID);
    assert_eq!(
        tok.decode_completion(&completion).expect("decode"),
        "1+2=3#3"
    );
    assert_eq!(tok.decode_completion(&[EOS_ID]).expect("decode"), "");
}

#[test]
fn unknown_characters_and_ids_are_named() {
    let tok = CharTokenizer::new().expect("build");
    match tok.encode("1+a") {
        Err(TaskError::UnknownChar { ch, index, .. }) => assert_eq!((ch, index), ('a', 2)),
        other => panic!("expected UnknownChar, got {other:?}"),
    }
    assert!(matches!(
        tok.encode("<pad>"),
        Err(TaskError::UnknownChar { ch: '<', .. })
    ));
    let size = tok.vocab_size() as u32;
    match tok.decode(&[3, size]) {
        Err(TaskError::UnknownTokenId { id, .. }) => assert_eq!(id, size),
        other => panic!("expected UnknownTokenId, got {other:?}"),
    }
}

#[test]
fn saves_and_loads_hf_tokenizer_json() {
    let dir = Scratch::new("tasks-save");
    let path = dir.join("tokenizer.json");
    let tok = CharTokenizer::new().expect("build");
    tok.save(&path).expect("save");
    let loaded = CharTokenizer::from_file(&path).expect("load");
    let text = "345*2=690;1+690=691#691";
    assert_eq!(
        loaded.encode(text).expect("encode"),
        tok.encode(text).expect("encode")
    );
    assert_eq!(
        loaded.decode(&tok.encode(text).expect("e")).expect("d"),
        text
    );

    // The file is the standard HF layout: a BPE model with the vocab, specials as added tokens.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    assert_eq!(json["model"]["type"], "BPE");
    assert_eq!(json["model"]["vocab"]["#"], 3 + 17);
    assert_eq!(json["decoder"]["type"], "Fuse");
    let added = json["added_tokens"].as_array().expect("added_tokens");
    let specials: Vec<(String, u64)> = added
        .iter()
        .map(|t| {
            assert_eq!(t["special"], true);
            (
                t["content"].as_str().expect("content").to_string(),
                t["id"].as_u64().expect("id"),
            )
        })
        .collect();
    assert_eq!(
        specials,
        vec![
            ("<pad>".to_string(), 0),
            ("<bos>".to_string(), 1),
            ("<eos>".to_string(), 2)
        ]
    );
}

#[test]
fn loading_a_different_vocabulary_is_an_error() {
    let dir = Scratch::new("tasks-mismatch");
    let path = dir.join("tokenizer.json");
    CharTokenizer::new()
        .expect("build")
        .save(&path)
        .expect("save");
    let text = std::fs::read_to_string(&path).expect("read");
    let mut json: serde_json::Value = serde_json::from_str(&text).expect("json");
    // Swap the ids of "0" and "1".
    json["model"]["vocab"]["0"] = 4.into();
    json["model"]["vocab"]["1"] = 3.into();
    std::fs::write(&path, serde_json::to_string(&json).expect("ser")).expect("write");
    match CharTokenizer::from_file(&path) {
        Err(TaskError::TokenizerMismatch { reason, .. }) => {
            assert!(reason.contains("\"0\""), "{reason}")
        }
        other => panic!("expected TokenizerMismatch, got {other:?}"),
    }
    // Not a tokenizer at all: a read error that keeps the parser's error as its source.
    std::fs::write(&path, "{not json").expect("write");
    match CharTokenizer::from_file(&path) {
        Err(e @ TaskError::TokenizerRead { .. }) => {
            assert!(std::error::Error::source(&e).is_some(), "{e}")
        }
        other => panic!("expected TokenizerRead, got {other:?}"),
    }
}
