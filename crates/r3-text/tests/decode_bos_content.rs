//! Three behaviours of r3-text checked against what HF does: decoding ids a padded model
//! vocabulary can sample (HF `tokenizers` skips ids it has no token for), the bos id
//! (transformers takes it from `tokenizer_config.json` only) and a message whose content is
//! null (transformers ≥ 5.24 drops the key, so templates see it undefined).

use std::path::{Path, PathBuf};

use r3_text::{ChatMessage, ChatTemplate, RenderOptions, SpecialTokens, TextError, TextTokenizer};

fn qwen3_style() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-style")
}

/// A scratch copy of the qwen3-style fixture's tokenizer.json with the given JSON files.
fn model_dir(tag: &str, files: &[(&str, serde_json::Value)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("r3-text-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    std::fs::copy(
        qwen3_style().join("tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .expect("copy tokenizer.json");
    for (name, value) in files {
        std::fs::write(dir.join(name), value.to_string()).expect("write json");
    }
    dir
}

#[test]
fn ids_of_a_padded_vocabulary_decode_as_hf_tokenizers_decodes_them() {
    let mut tok = TextTokenizer::from_model_dir(&qwen3_style()).expect("tokenizer");
    let size = tok.vocab_size() as u32;
    let model_vocab = (size as usize).div_ceil(64) * 64 + 64;
    let mut ids = tok.encode("Hello, world!", false).expect("encode");
    ids.insert(2, size);
    ids.push(model_vocab as u32 - 1);
    // HF tokenizers' own decode (the Rust core of the Python package) skips the ids it has
    // no token for.
    let hf = tok.inner().decode(&ids, false).expect("hf decode");
    assert_eq!(hf, "Hello, world!");
    assert_eq!(tok.decode(&ids, false).expect("decode"), hf);
    assert_eq!(tok.decode(&ids, true).expect("decode"), hf);
    // Once the model's vocabulary is known, ids it cannot have produced are refused.
    tok.fit_model(model_vocab)
        .expect("padded to a multiple of 64");
    assert_eq!(tok.model_vocab(), Some(model_vocab));
    assert_eq!(tok.decode(&ids, false).expect("decode"), hf);
    ids.push(model_vocab as u32);
    match tok.decode(&ids, false) {
        Err(TextError::UnknownTokenId { id, size }) => {
            assert_eq!((id as usize, size), (model_vocab, model_vocab));
        }
        other => panic!("expected UnknownTokenId, got {other:?}"),
    }
    // A model that is not padded to a multiple of 64 does not fit.
    assert!(tok.fit_model(size as usize + 1).is_err());
}

#[test]
fn bos_comes_from_the_tokenizer_config_as_in_transformers() {
    // transformers 5.25 on these directories: AutoTokenizer.from_pretrained(dir).bos_token_id
    // is None when tokenizer_config.json says `"bos_token": null` (Qwen) or says nothing
    // about bos, whatever config.json / generation_config.json give as bos_token_id.
    let model_cfgs = [
        (
            "config.json",
            serde_json::json!({"bos_token_id": 3, "eos_token_id": 4}),
        ),
        (
            "generation_config.json",
            serde_json::json!({"bos_token_id": 3}),
        ),
    ];
    let qwen_cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(qwen3_style().join("tokenizer_config.json")).expect("read"),
    )
    .expect("json");
    assert!(qwen_cfg["bos_token"].is_null());
    let mut without_bos = qwen_cfg.clone();
    without_bos
        .as_object_mut()
        .expect("object")
        .remove("bos_token");
    let mut with_bos = qwen_cfg.clone();
    with_bos["bos_token"] = "<|im_start|>".into();
    for (tag, cfg, want) in [
        ("null", qwen_cfg, None),
        ("absent", without_bos, None),
        ("set", with_bos, Some(1)),
    ] {
        let mut files = model_cfgs.to_vec();
        files.push(("tokenizer_config.json", cfg));
        let tok = TextTokenizer::from_model_dir(&model_dir(&format!("bos-{tag}"), &files))
            .expect("tokenizer");
        assert_eq!(tok.bos_id(), want, "bos_token {tag}");
        // Untemplated text gets no bos from config.json either.
        assert_eq!(
            tok.encode("hi", true).expect("encode"),
            tok.encode("hi", false).expect("encode")
        );
        assert!(
            tok.eos_ids().contains(&4),
            "eos ids still read from config.json"
        );
    }
    // A bare tokenizer.json (no tokenizer_config.json: r3's own character model) keeps the
    // model configs' bos_token_id, as before.
    let bare =
        TextTokenizer::from_model_dir(&model_dir("bos-bare", &model_cfgs)).expect("tokenizer");
    assert_eq!(bare.bos_id(), Some(3));
}

#[test]
fn null_content_is_dropped_as_transformers_drops_it() {
    // transformers 5.25.0's tok.apply_chat_template([{"role": "assistant", "content": None,
    // "tool_calls": []}, {"role": "user", "content": ""}], chat_template=<this template>,
    // tokenize=False) returns "[][]": its `_normalize_chat_messages` (5.24 on) drops the
    // None-valued key, and an undefined `content` is not `none` (5.23 and older gave "N[]").
    let template = ChatTemplate::new(
        "{% for m in messages %}{% if m.content is none %}N{% else %}[{{ m.content }}]{% endif %}{% endfor %}",
        SpecialTokens::default(),
    )
    .expect("template");
    let messages: Vec<ChatMessage> = serde_json::from_value(serde_json::json!([
        {"role": "assistant", "content": null, "tool_calls": []},
        {"role": "user", "content": ""},
    ]))
    .expect("messages");
    assert_eq!(messages[0].content, None);
    assert_eq!(messages[1].content.as_deref(), Some(""));
    let text = template
        .render(&messages, &RenderOptions::default())
        .expect("render");
    assert_eq!(text, "[][]");
    // The message writes back as it came.
    assert_eq!(
        serde_json::to_value(&messages[0]).expect("json"),
        serde_json::json!({"role": "assistant", "content": null, "tool_calls": []})
    );
}
