//! r3-text against HF oracles: token ids, decodes and rendered chats computed by Python
//! `tokenizers` and transformers' `apply_chat_template` (fixtures from
//! `scripts/text-fixtures/make.py`).

use std::path::{Path, PathBuf};

use r3_text::{ChatMessage, ChatTemplate, RenderOptions, TextTokenizer};
use serde::Deserialize;

#[derive(Deserialize)]
struct Expected {
    tokenizers: Vec<TokenizerCases>,
    templates: Vec<TemplateCases>,
}

#[derive(Deserialize)]
struct TokenizerCases {
    name: String,
    cases: Vec<TokenizerCase>,
}

#[derive(Deserialize)]
struct TokenizerCase {
    text: String,
    ids: Vec<u32>,
    decoded: String,
    decoded_skip_special: String,
    ids_with_special_tokens: Option<Vec<u32>>,
}

#[derive(Deserialize)]
struct TemplateCases {
    name: String,
    cases: Vec<TemplateCase>,
}

#[derive(Deserialize)]
struct TemplateCase {
    conversation: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    kwargs: serde_json::Map<String, serde_json::Value>,
    text: String,
    ids: Option<Vec<u32>>,
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn expected() -> Expected {
    let path = fixtures().join("expected.json");
    let text = std::fs::read_to_string(&path).expect("expected.json is in the repo");
    serde_json::from_str(&text).expect("expected.json parses")
}

/// Where a fixture's tokenizer.json lives; `None` (with the reason printed) when it is not
/// on this machine.
fn tokenizer_dir(name: &str) -> Option<PathBuf> {
    let dir = match name {
        "r3-bpe" => fixtures().join("r3-bpe"),
        "qwen3-style" => fixtures().join("qwen3-style"),
        "char" => workspace().join("models/arith-moe"),
        // 6 MB: installed by scripts/text-fixtures/make.py, not kept in the repo.
        "deepseek-v3" => workspace().join("target/text-fixtures/deepseek-v3"),
        other => panic!("unknown fixture {other}"),
    };
    if dir.join("tokenizer.json").is_file() {
        Some(dir)
    } else {
        println!(
            "SKIP {name}: {} is absent (run scripts/text-fixtures/make.py)",
            dir.join("tokenizer.json").display()
        );
        None
    }
}

/// Where a template fixture's tokenizer_config.json lives (always in the repo).
fn template_dir(name: &str) -> PathBuf {
    match name {
        "deepseek-v3" => fixtures().join("deepseek-v3-style"),
        other => fixtures().join(other),
    }
}

#[test]
fn token_ids_and_decodes_equal_hf_tokenizers() {
    let mut checked = 0;
    for group in expected().tokenizers {
        let Some(dir) = tokenizer_dir(&group.name) else {
            continue;
        };
        let tok = TextTokenizer::from_model_dir(&dir).expect("tokenizer loads");
        for case in &group.cases {
            let what = format!("{} {:?}", group.name, case.text);
            let ids = tok.encode(&case.text, false).expect("encode");
            assert_eq!(ids, case.ids, "ids of {what}");
            if let Some(want) = &case.ids_with_special_tokens {
                let got = tok.encode(&case.text, true).expect("encode");
                assert_eq!(&got, want, "ids with special tokens of {what}");
            }
            assert_eq!(
                tok.decode(&ids, false).expect("decode"),
                case.decoded,
                "decode of {what}"
            );
            assert_eq!(
                tok.decode(&ids, true).expect("decode"),
                case.decoded_skip_special,
                "decode (skip special) of {what}"
            );
            checked += 1;
        }
    }
    // r3-bpe and char are in the repo, so at least their cases always run.
    assert!(checked >= 14, "only {checked} cases checked");
}

#[test]
fn rendered_chats_and_ids_equal_transformers_apply_chat_template() {
    let mut rendered = 0;
    for group in expected().templates {
        let template = ChatTemplate::from_model_dir(&template_dir(&group.name))
            .expect("template loads")
            .expect("fixture has a template");
        let tok = tokenizer_dir(&group.name)
            .map(|d| TextTokenizer::from_model_dir(&d).expect("tokenizer loads"));
        for case in &group.cases {
            let opts = RenderOptions {
                add_generation_prompt: case.add_generation_prompt,
                kwargs: case.kwargs.clone(),
                ..RenderOptions::default()
            };
            let what = format!(
                "{} / {} / gen={} / {:?}",
                group.name, case.conversation, case.add_generation_prompt, case.kwargs
            );
            let text = template.render(&case.messages, &opts).expect("render");
            assert_eq!(text, case.text, "text of {what}");
            if let (Some(tok), Some(want)) = (&tok, &case.ids) {
                assert_eq!(
                    &tok.encode(&text, false).expect("encode"),
                    want,
                    "ids of {what}"
                );
            }
            rendered += 1;
        }
    }
    assert!(rendered >= 32, "only {rendered} renders checked");
}
