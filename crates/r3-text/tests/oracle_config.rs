//! r3-text against transformers on model directories whose `tokenizer_config.json` (and
//! `tokenizer.json`) exercise what transformers 5.25's `AutoTokenizer.from_pretrained` and
//! `apply_chat_template` read beyond the plain tokenizer: `add_bos_token` / `add_eos_token`
//! with and without a post-processor, `split_special_tokens`, `added_tokens_decoder` flags,
//! special-token fields naming added or vocabulary tokens, null message fields, reasoning
//! aliases, `{% generation %}`, the special-token template variables, and jinja2's printing
//! of floats, whitespace and tests. The expected values are `config_tokenizers` and
//! `config_renders` of `tests/fixtures/expected.json`, computed by
//! `scripts/text-fixtures/make.py` with transformers 5.25.0; each directory is rebuilt here
//! exactly as that script builds it.

use std::path::{Path, PathBuf};

use r3_text::{ChatMessage, ChatTemplate, RenderOptions, TextTokenizer};
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
struct Expected {
    versions: Versions,
    config_tokenizers: Vec<TokenizerDir>,
    config_renders: Vec<RenderCase>,
}

#[derive(Deserialize)]
struct Versions {
    transformers: String,
}

#[derive(Deserialize)]
struct TokenizerDir {
    name: String,
    added_tokens: Vec<Value>,
    post_processor: Value,
    tokenizer_config: Value,
    config_json: Option<Value>,
    encode: Vec<EncodeCase>,
    decode: Vec<DecodeCase>,
}

#[derive(Deserialize)]
struct EncodeCase {
    text: String,
    add_special_tokens: bool,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct DecodeCase {
    ids: Vec<u32>,
    skip_special_tokens: bool,
    text: String,
}

#[derive(Deserialize)]
struct RenderCase {
    name: String,
    tokenizer_config: Value,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    kwargs: serde_json::Map<String, Value>,
    text: Option<String>,
    error: Option<String>,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn expected() -> Expected {
    let path = fixtures().join("expected.json");
    let text = std::fs::read_to_string(&path).expect("expected.json is in the repo");
    serde_json::from_str(&text).expect("expected.json parses")
}

/// The directory make.py's `config_dir` writes: r3-bpe's tokenizer.json with `added_tokens`
/// appended and `post_processor` set, and the given config files.
fn config_dir(
    name: &str,
    added_tokens: &[Value],
    post_processor: &Value,
    tokenizer_config: &Value,
    config_json: Option<&Value>,
) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "r3-text-oracle-config-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let text = std::fs::read_to_string(fixtures().join("r3-bpe/tokenizer.json")).expect("r3-bpe");
    let mut tok: Value = serde_json::from_str(&text).expect("tokenizer.json");
    tok["added_tokens"]
        .as_array_mut()
        .expect("added_tokens")
        .extend(added_tokens.iter().cloned());
    tok["post_processor"] = post_processor.clone();
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).expect("write");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .expect("write");
    if let Some(cfg) = config_json {
        std::fs::write(dir.join("config.json"), cfg.to_string()).expect("write");
    }
    dir
}

#[test]
fn fixtures_come_from_transformers_5_25() {
    assert_eq!(expected().versions.transformers, "5.25.0");
}

/// Fails listing every mismatch, so one run shows all that differ.
fn assert_none_differ(differ: &[String], checked: usize, at_least: usize) {
    assert!(
        differ.is_empty(),
        "{} of {checked} differ from transformers:\n{}",
        differ.len(),
        differ.join("\n")
    );
    assert!(checked >= at_least, "only {checked} cases checked");
}

#[test]
fn config_fields_give_transformers_ids_and_decodes() {
    let mut checked = 0;
    let mut differ = Vec::new();
    for case in expected().config_tokenizers {
        let dir = config_dir(
            &case.name,
            &case.added_tokens,
            &case.post_processor,
            &case.tokenizer_config,
            case.config_json.as_ref(),
        );
        let tok = TextTokenizer::from_model_dir(&dir).expect("tokenizer loads");
        for e in &case.encode {
            let got = tok.encode(&e.text, e.add_special_tokens).expect("encode");
            if got != e.ids {
                differ.push(format!(
                    "{}: encode {:?} add_special_tokens={}: r3 {got:?}, transformers {:?}",
                    case.name, e.text, e.add_special_tokens, e.ids
                ));
            }
            checked += 1;
        }
        for d in &case.decode {
            let got = tok.decode(&d.ids, d.skip_special_tokens).expect("decode");
            if got != d.text {
                differ.push(format!(
                    "{}: decode {:?} skip_special_tokens={}: r3 {got:?}, transformers {:?}",
                    case.name, d.ids, d.skip_special_tokens, d.text
                ));
            }
            checked += 1;
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert_none_differ(&differ, checked, 400);
}

#[test]
fn renders_equal_transformers_apply_chat_template() {
    let mut checked = 0;
    let mut differ = Vec::new();
    for case in expected().config_renders {
        let dir = config_dir(
            &format!("render-{}", case.name),
            &[],
            &Value::Null,
            &case.tokenizer_config,
            None,
        );
        let opts = RenderOptions {
            add_generation_prompt: case.add_generation_prompt,
            kwargs: case.kwargs.clone(),
            ..RenderOptions::default()
        };
        let got = ChatTemplate::from_model_dir(&dir)
            .map(|t| t.expect("the config has a template"))
            .and_then(|t| t.render(&case.messages, &opts))
            .map_err(|e| format!("{e:#}"));
        match (&case.text, &case.error, got) {
            (Some(want), None, Ok(got)) if &got == want => {}
            (None, Some(_), Err(_)) => {}
            (want, error, got) => differ.push(format!(
                "{}: r3 {got:?}, transformers {:?}",
                case.name,
                want.as_ref().ok_or(error)
            )),
        }
        checked += 1;
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert_none_differ(&differ, checked, 20);
}

/// Where r3 departs from transformers on purpose: a special token the vocabulary lacks is
/// not given a new id (transformers would add it past the vocabulary, where the model has no
/// row for it). A missing `bos_token` is refused by name; a missing `mask_token` is left out,
/// the vocabulary as it was.
#[test]
fn special_tokens_missing_from_the_vocabulary_get_no_new_id() {
    let cfg = serde_json::json!({"bos_token": "<nope>", "eos_token": "<|im_end|>"});
    let dir = config_dir("missing-bos", &[], &Value::Null, &cfg, None);
    match TextTokenizer::from_model_dir(&dir) {
        Err(r3_text::TextError::UnknownSpecialToken { field, token }) => {
            assert_eq!((field, token.as_str()), ("bos_token", "<nope>"));
        }
        other => panic!("expected UnknownSpecialToken, got {other:?}"),
    }
    let cfg = serde_json::json!({"eos_token": "<|im_end|>", "mask_token": "<nope>"});
    let dir = config_dir("missing-mask", &[], &Value::Null, &cfg, None);
    let tok = TextTokenizer::from_model_dir(&dir).expect("loads");
    let plain = config_dir("plain", &[], &Value::Null, &serde_json::json!({}), None);
    let plain = TextTokenizer::from_model_dir(&plain).expect("loads");
    assert_eq!(tok.vocab_size(), plain.vocab_size());
    assert_eq!(tok.token_id("<nope>"), None);
}
