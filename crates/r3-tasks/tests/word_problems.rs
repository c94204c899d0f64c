//! The GSM8K-format generator: every solution's arithmetic checks out (each `<<a op b=c>>`
//! recomputed independently), ends in `#### answer`, the math reward accepts the solution and
//! rejects an off-by-one; splits are seeded and disjoint; Parquet written by r3 reads back to
//! the same rows as its JSONL.

use std::collections::HashSet;
use std::path::Path;

use r3_tasks::dataset::jsonl::{parse_jsonl, to_jsonl};
use r3_tasks::dataset::{load_file, write_parquet};
use r3_tasks::reward::answers::math_reward;
use r3_tasks::{gsm8k_style_splits, WordProblem};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Recomputes every `<<a op b=c>>` annotation; returns the last result.
fn check_annotations(solution: &str) -> i64 {
    let mut last = None;
    let mut rest = solution;
    while let Some(start) = rest.find("<<") {
        let end = rest[start..].find(">>").expect("closed annotation") + start;
        let expr = &rest[start + 2..end];
        let (lhs, result) = expr.split_once('=').expect("a = in the annotation");
        let op_pos = lhs.find(['+', '-', '*', '/']).expect("an operator");
        let a: i64 = lhs[..op_pos].parse().expect("a");
        let b: i64 = lhs[op_pos + 1..].parse().expect("b");
        let c: i64 = result.parse().expect("c");
        let want = match &lhs[op_pos..op_pos + 1] {
            "+" => a + b,
            "-" => a - b,
            "*" => a * b,
            _ => {
                assert_eq!(a % b, 0, "{expr}: division must be exact");
                a / b
            }
        };
        assert_eq!(c, want, "{expr} in {solution}");
        // The result is also written right after the annotation, as GSM8K does.
        assert!(rest[end + 2..].starts_with(&c.to_string()), "{solution}");
        last = Some(c);
        rest = &rest[end + 2..];
    }
    last.expect("at least one step")
}

#[test]
fn solutions_are_correct_and_end_in_the_answer() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut questions = HashSet::new();
    for _ in 0..500 {
        let p = WordProblem::generate(&mut rng);
        let last = check_annotations(&p.solution);
        assert_eq!(last, p.answer, "{}", p.solution);
        assert!(p.answer >= 0, "{}", p.question);
        assert!(p.solution.ends_with(&format!("\n#### {}", p.answer)));
        assert!(
            p.solution.lines().count() >= 3,
            "several steps: {}",
            p.solution
        );
        assert_eq!(math_reward(&p.solution, &p.answer.to_string()), 1.0);
        assert_eq!(
            math_reward(&format!("#### {}", p.answer + 1), &p.answer.to_string()),
            0.0
        );
        questions.insert(p.question);
    }
    assert!(
        questions.len() > 450,
        "varied: {} distinct",
        questions.len()
    );
}

#[test]
fn splits_are_seeded_and_disjoint() {
    let (train, val) = gsm8k_style_splits(300, 50, 5).expect("splits");
    assert_eq!((train.len(), val.len()), (300, 50));
    let again = gsm8k_style_splits(300, 50, 5).expect("splits");
    assert_eq!((train.clone(), val.clone()), again);
    let q = |r: &r3_tasks::DatasetRow| r.prompt.plain_text();
    let val_q: HashSet<String> = val.iter().map(q).collect();
    assert!(train.iter().all(|r| !val_q.contains(&q(r))));
    assert_eq!(train[3].extra_info["index"], 3);
    assert_eq!(val[0].extra_info["split"], "test");
    assert_ne!(gsm8k_style_splits(300, 50, 6).expect("other seed").0, train);
}

#[test]
fn written_parquet_reads_back_to_the_jsonl_rows() {
    let (train, _) = gsm8k_style_splits(40, 0, 1).expect("rows");
    let dir = std::env::temp_dir().join(format!("r3-wp-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("train.parquet");
    write_parquet(&path, &train, "prompt").expect("write");
    let back = load_file(&path, "prompt").expect("read");
    let via_jsonl =
        parse_jsonl(&to_jsonl(&train, "prompt"), Path::new("m.jsonl"), "prompt").expect("jsonl");
    assert_eq!(back, via_jsonl);
    assert_eq!(back, train);
    std::fs::remove_dir_all(&dir).expect("cleanup");
}
