//! Writes the r3-trained BPE tokenizer the r3-text tests compare with HF `tokenizers`:
//! `cargo run -p r3-text --example bpe_fixture -- OUT_DIR` (run by
//! `scripts/text-fixtures/make.py`, which then computes the Python ids).

use std::path::PathBuf;

use r3_text::{train_bpe, write_tokenizer_config, BpeTrainSpec, SpecialTokens, CHATML_TEMPLATE};

/// A small mixed corpus: English, arithmetic, code-like text, accents and CJK, so the
/// merges cover words, digits and multi-byte characters.
fn corpus() -> Vec<String> {
    let lines = [
        "The quick brown fox jumps over the lazy dog.",
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
        "How many clips did Natalia sell altogether in April and May? #### 72",
        "12+7=19; 3*(4+5)=27; 100-58=42",
        "fn main() { println!(\"hello, world\"); }",
        "Café déjà vu: naïve façade, über größe.",
        "数学题：小明有三个苹果。",
        "The answer is \\boxed{42}.",
        "  indented line with\ttabs and   spaces  ",
        "User: what is 6 times 7?\nAssistant: 6 times 7 is 42.",
    ];
    (0..20)
        .flat_map(|round| lines.iter().map(move |l| format!("{l} ({round})")))
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let out = PathBuf::from(
        std::env::args()
            .nth(1)
            .ok_or("usage: bpe_fixture OUT_DIR")?,
    );
    std::fs::create_dir_all(&out)?;
    let special_tokens: Vec<String> = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
    ]
    .map(String::from)
    .to_vec();
    let spec = BpeTrainSpec {
        vocab_size: 420,
        min_frequency: 2,
        special_tokens,
    };
    let tokenizer = train_bpe(&corpus(), &spec)?;
    tokenizer.save(out.join("tokenizer.json"), true)?;
    let special = SpecialTokens {
        eos: Some("<|im_end|>".into()),
        pad: Some("<|endoftext|>".into()),
        ..SpecialTokens::default()
    };
    write_tokenizer_config(&out, &special, Some(CHATML_TEMPLATE))?;
    println!("wrote {}", out.display());
    Ok(())
}
