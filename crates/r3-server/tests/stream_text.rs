//! Streamed text (src/stream_text.rs) against the whole output decoded at once, over real
//! decoders: the byte-level BPE of `models/gsm8k-moe` (Qwen / DeepSeek style: a character's
//! UTF-8 bytes split across tokens, random ids giving invalid UTF-8 too) and a Llama-style
//! metaspace BPE with byte fallback (`<0xE4>` tokens). The pieces must concatenate to the
//! non-streamed text, leave as soon as they are final, and cost a bounded window of decoded
//! tokens per step, not the whole output so far.

use std::path::Path;

use r3_server::stream_text::StreamedText;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use tokenizers::Tokenizer;

/// The byte-level BPE tokenizer checked in with the gsm8k model (512 ids, 3 special).
fn byte_level() -> Tokenizer {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/gsm8k-moe/tokenizer.json");
    Tokenizer::from_file(&path).expect("models/gsm8k-moe/tokenizer.json loads")
}

/// A Llama-style tokenizer: metaspace normalizer, BPE with byte fallback for every character
/// not in its small vocabulary, and Llama's decoder chain (`▁` to space, byte fallback,
/// fuse, strip one leading space).
fn byte_fallback() -> Tokenizer {
    let mut vocab = serde_json::Map::new();
    vocab.insert("<unk>".into(), json!(0));
    for b in 0..=255u32 {
        vocab.insert(format!("<0x{b:02X}>"), json!(b + 1));
    }
    let pieces = [
        "▁", "a", "b", "c", "e", "h", "t", "é", "▁t", "th", "▁th", "▁the", "he",
    ];
    for (i, p) in pieces.iter().enumerate() {
        vocab.insert((*p).into(), json!(257 + i));
    }
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "<unk>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null, "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true, "vocab": vocab,
                  "merges": ["▁ t", "t h", "▁t h", "▁th e", "h e"]},
    });
    tok.to_string()
        .parse()
        .expect("the byte-fallback tokenizer builds")
}

/// What streaming one output gave.
struct Streamed {
    /// The pieces, concatenated.
    text: String,
    /// The pieces themselves.
    pieces: Vec<String>,
    /// Most tokens decoded in one step.
    max_decoded: usize,
    /// Tokens decoded over the whole stream.
    total_decoded: usize,
}

/// Streams `ids` through [`StreamedText`] in steps of 1 to `most_per_step` tokens (as the
/// worker sends them), counting the tokens every decode call is given.
fn stream(
    tok: &Tokenizer,
    ids: &[u32],
    skip_special: bool,
    most_per_step: usize,
    rng: &mut ChaCha8Rng,
) -> Streamed {
    let mut s = StreamedText::new(1);
    let mut out = Streamed {
        text: String::new(),
        pieces: Vec::new(),
        max_decoded: 0,
        total_decoded: 0,
    };
    let mut at = 0;
    while at < ids.len() {
        let step = rng.random_range(1..=most_per_step).min(ids.len() - at);
        let mut decoded = 0;
        let mut decode = |window: &[u32]| {
            decoded += window.len();
            tok.decode(window, skip_special).ok()
        };
        if let Some(piece) = s.advance(0, &ids[at..at + step], 0, &mut decode) {
            out.text.push_str(&piece);
            out.pieces.push(piece);
        }
        out.max_decoded = out.max_decoded.max(decoded);
        out.total_decoded += decoded;
        at += step;
    }
    out
}

/// Checks one streamed output against the whole decode: the pieces are its prefix, and what
/// is left for the final chunk is only a character not complete yet (or nothing).
fn check_prefix(full: &str, streamed: &Streamed, what: &str) {
    let rest = full
        .strip_prefix(streamed.text.as_str())
        .unwrap_or_else(|| {
            panic!(
                "{what}: the streamed text {:?} is not a prefix of the full text {full:?}",
                streamed.text
            )
        });
    assert!(
        rest.is_empty() || rest.ends_with(char::REPLACEMENT_CHARACTER),
        "{what}: {rest:?} was final but held back"
    );
}

/// Random text with multi-byte characters (2, 3 and 4 UTF-8 bytes) among ASCII words.
fn random_text(rng: &mut ChaCha8Rng) -> String {
    const PARTS: &[&str] = &[
        "a", "b", "the", " ", " ", "th", "é", "中", "文", "😀", "ß", "\n", "x=1", "ü", "ñ", "→",
        "🎉", "e",
    ];
    let n = rng.random_range(1..60);
    (0..n)
        .map(|_| PARTS[rng.random_range(0..PARTS.len())])
        .collect()
}

#[test]
fn random_byte_level_outputs_stream_their_whole_decode() {
    let tok = byte_level();
    let vocab = tok.get_vocab_size(true) as u32;
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for case in 0..400 {
        let len = rng.random_range(1..300);
        let ids: Vec<u32> = (0..len).map(|_| rng.random_range(0..vocab)).collect();
        let skip = rng.random_bool(0.5);
        let full = tok.decode(&ids, skip).expect("decodes");
        let streamed = stream(&tok, &ids, skip, 3, &mut rng);
        check_prefix(&full, &streamed, &format!("case {case} ({ids:?})"));
    }
}

#[test]
fn multibyte_text_streams_whole_characters_with_both_decoders() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (name, tok) in [
        ("byte-level", byte_level()),
        ("byte-fallback", byte_fallback()),
    ] {
        let mut split_characters = 0;
        for case in 0..300 {
            let text = random_text(&mut rng);
            let ids = tok
                .encode(text.as_str(), false)
                .expect("encodes")
                .get_ids()
                .to_vec();
            let full = tok.decode(&ids, true).expect("decodes");
            let streamed = stream(&tok, &ids, true, 2, &mut rng);
            assert_eq!(
                streamed.text, full,
                "{name} case {case}: {text:?} as {ids:?}"
            );
            for piece in &streamed.pieces {
                assert!(
                    !piece.contains(char::REPLACEMENT_CHARACTER),
                    "{name} case {case}: piece {piece:?} has a broken character"
                );
            }
            // Tokens that are not whole characters: the case the window must wait out.
            split_characters += ids
                .iter()
                .filter(|&&id| {
                    tok.decode(&[id], true)
                        .is_ok_and(|t| t.contains(char::REPLACEMENT_CHARACTER))
                })
                .count();
        }
        assert!(
            split_characters > 100,
            "{name}: too few split characters ({split_characters}) to test"
        );
    }
}

/// The old streamer decoded the whole output at every step: the step at token L decoded L
/// tokens, O(L²) over an output. Each step now decodes a window of the last piece's tokens
/// and those still waiting.
#[test]
fn each_step_decodes_a_bounded_window() {
    let tok = byte_level();
    let vocab = tok.get_vocab_size(true) as u32;
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut text_ids = Vec::new();
    while text_ids.len() < 4000 {
        let text = random_text(&mut rng);
        text_ids.extend_from_slice(tok.encode(text.as_str(), false).expect("encodes").get_ids());
    }
    let random_ids: Vec<u32> = (0..4000).map(|_| rng.random_range(0..vocab)).collect();
    for (name, ids) in [("text", text_ids), ("random ids", random_ids)] {
        let len = ids.len();
        let streamed = stream(&tok, &ids, true, 1, &mut rng);
        check_prefix(&tok.decode(&ids, true).expect("decodes"), &streamed, name);
        assert!(
            streamed.max_decoded <= 24,
            "{name}: one step decoded {} tokens of a {len}-token output",
            streamed.max_decoded
        );
        assert!(
            streamed.total_decoded <= 8 * len,
            "{name}: streaming {len} tokens decoded {} tokens",
            streamed.total_decoded
        );
    }
}
