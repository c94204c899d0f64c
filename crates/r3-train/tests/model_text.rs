//! The trainer's text side read through r3-text: on the shipped character model it gives the
//! ids, stop ids and decoded completions r3's character tokenizer gives (so the built-in run
//! is unchanged), refuses text it cannot spell, and a checkpoint copy reads back the same.

use std::path::{Path, PathBuf};

use r3_tasks::{ArithmeticTask, CharTokenizer, Difficulty, EOS_ID};
use r3_train::ModelText;

fn arith_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/arith-moe")
}

#[test]
fn the_character_model_encodes_and_decodes_as_the_character_tokenizer() {
    let text = ModelText::from_model_dir(&arith_model()).expect("model text");
    let chars = CharTokenizer::from_file(&arith_model().join("tokenizer.json")).expect("chars");
    assert_eq!(text.vocab_size(), chars.vocab_size());
    assert!(text.template().is_none());
    assert_eq!(text.stop_ids(), &[EOS_ID]);
    let task = ArithmeticTask::new(Difficulty::level(3).expect("level"), 50, 7).expect("task");
    for p in task.eval_set() {
        assert_eq!(
            text.encode_plain(&p.prompt).expect("encode"),
            chars.encode_prompt(&p.prompt).expect("encode")
        );
        let mut answer = chars.encode(&p.solution).expect("answer");
        answer.extend([EOS_ID, 5, 6]);
        assert_eq!(
            text.decode_completion(&answer, text.stop_ids())
                .expect("decode"),
            chars.decode_completion(&answer).expect("decode")
        );
    }
}

#[test]
fn text_outside_the_vocabulary_is_refused_not_dropped() {
    let text = ModelText::from_model_dir(&arith_model()).expect("model text");
    let err = text.encode_plain("12+x=3").expect_err("x is not a token");
    let msg = err.to_string();
    assert!(
        msg.contains("'x'") && msg.contains("character 3 ") && msg.contains("alphabet"),
        "{msg}"
    );
}

#[test]
fn a_saved_copy_reads_back_the_same_text_side() {
    let text = ModelText::from_model_dir(&arith_model()).expect("model text");
    let dir = std::env::temp_dir().join(format!("r3-model-text-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    text.save(&dir).expect("save");
    std::fs::copy(arith_model().join("config.json"), dir.join("config.json")).expect("config");
    let back = ModelText::from_model_dir(&dir).expect("reload");
    let s = "(3+4)*5=";
    assert_eq!(
        back.encode_plain(s).expect("a"),
        text.encode_plain(s).expect("b")
    );
    assert_eq!(back.stop_ids(), text.stop_ids());
    std::fs::remove_dir_all(&dir).ok();
}
