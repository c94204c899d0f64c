//! The stop ids every r3 side shares (`model_stop_ids`): the model's eos, the tokenizer's eos
//! and SGLang's extra turn-final tokens only where the tokenizer has them as added tokens.

use r3_text::{model_stop_ids, SpecialTokens, TextTokenizer};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

/// A word-level tokenizer: `a`=0, `b`=1, `</s>`=2, and `<|ifm|im_end|>`=3 as a plain
/// vocabulary word; added tokens `<|eom_id|>`=4 and `<|content_model_end_sampling|>`=5.
fn tokenizer() -> TextTokenizer {
    let added = |id: u32, content: &str| -> Value {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added(4, "<|eom_id|>"), added(5, "<|content_model_end_sampling|>")],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "a",
            "vocab": {"a": 0, "b": 1, "</s>": 2, "<|ifm|im_end|>": 3}},
    });
    let inner = Tokenizer::from_bytes(tok.to_string()).expect("tokenizer builds");
    let special = SpecialTokens {
        eos: Some("</s>".into()),
        ..SpecialTokens::default()
    };
    TextTokenizer::from_tokenizer(inner, special).expect("special tokens resolve")
}

#[test]
fn added_turn_final_tokens_stop_a_plain_word_of_the_same_text_does_not() {
    let tok = tokenizer();
    assert_eq!(tok.additional_stop_ids(), vec![4, 5]);
    // Model eos 7 first, then the tokenizer's eos 2, then the added tokens; 2 is not repeated.
    assert_eq!(model_stop_ids(&[7, 2], Some(&tok)), vec![7, 2, 4, 5]);
    assert_eq!(model_stop_ids(&[7], None), vec![7]);
}
