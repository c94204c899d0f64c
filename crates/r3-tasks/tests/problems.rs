//! Problem generation, solving and the eval/train split, checked against an independent
//! evaluator and hand-computed solutions.

use r3_tasks::{ArithmeticTask, Difficulty, Expression, Op, Problem, TaskError, MAX_LEVEL};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Independent evaluator of `a op b op c ...` with `*` before `+`/`-` (two-level descent).
fn eval_expr(s: &str) -> i64 {
    let mut terms: Vec<(char, i64)> = Vec::new();
    let mut sign = '+';
    let mut product: Option<i64> = None;
    let mut num = String::new();
    let flush = |num: &mut String, product: &mut Option<i64>| {
        let v: i64 = num.parse().expect("number");
        num.clear();
        *product = Some(product.map_or(v, |p| p * v));
    };
    for c in s.chars() {
        match c {
            '0'..='9' => num.push(c),
            '*' => flush(&mut num, &mut product),
            '+' | '-' => {
                flush(&mut num, &mut product);
                terms.push((sign, product.take().expect("term")));
                sign = c;
            }
            _ => panic!("unexpected {c}"),
        }
    }
    flush(&mut num, &mut product);
    terms.push((sign, product.expect("term")));
    terms
        .iter()
        .map(|&(s, v)| if s == '+' { v } else { -v })
        .sum()
}

/// Checks every `a op b=c` step of a solution and returns the answer after `#`.
fn check_steps(solution: &str) -> i64 {
    let (steps, answer) = solution.split_once('#').expect("has #");
    for step in steps.split(';') {
        let (lhs, rhs) = step.split_once('=').expect("step has =");
        let result: i64 = rhs.parse().expect("step result");
        assert_eq!(eval_expr(lhs), result, "step {step}");
    }
    answer.parse().expect("answer")
}

#[test]
fn hand_written_solution_format() {
    // 12+7*3-4: 7*3=21 first, then 12+21=33, then 33-4=29.
    let expr = Expression {
        operands: vec![12, 7, 3, 4],
        ops: vec![Op::Add, Op::Mul, Op::Sub],
    };
    let p = Problem::from_expression(&expr).expect("no overflow");
    assert_eq!(p.prompt, "12+7*3-4=");
    assert_eq!(p.solution, "7*3=21;12+21=33;33-4=29#29");
    assert_eq!(p.answer, 29);
    // 2*3*4-5: leftmost * first: 2*3=6, 6*4=24, 24-5=19.
    let expr = Expression {
        operands: vec![2, 3, 4, 5],
        ops: vec![Op::Mul, Op::Mul, Op::Sub],
    };
    let p = Problem::from_expression(&expr).expect("no overflow");
    assert_eq!(p.solution, "2*3=6;6*4=24;24-5=19#19");
    // 3-7 with negatives allowed: written with a leading minus.
    let expr = Expression {
        operands: vec![3, 7],
        ops: vec![Op::Sub],
    };
    let p = Problem::from_expression(&expr).expect("no overflow");
    assert_eq!(p.solution, "3-7=-4#-4");
    assert_eq!(p.answer, -4);
}

#[test]
fn generated_problems_are_correct_and_within_difficulty() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for level in 1..=MAX_LEVEL {
        let d = Difficulty::level(level).expect("preset");
        for _ in 0..300 {
            let p = Problem::generate(&d, &mut rng).expect("generate");
            let expr = p.prompt.strip_suffix('=').expect("prompt ends with =");
            assert_eq!(eval_expr(expr), p.answer, "{p:?}");
            assert_eq!(check_steps(&p.solution), p.answer, "{p:?}");
            let n_ops = expr.chars().filter(|c| "+-*".contains(*c)).count();
            assert!(
                (d.min_operands..=d.max_operands).contains(&(n_ops + 1)),
                "{p:?}"
            );
            assert_eq!(
                p.solution.split(';').count(),
                n_ops,
                "one step per operator"
            );
            for num in expr.split(['+', '-', '*']) {
                assert!(num.len() as u32 <= d.max_digits, "{p:?}");
            }
            // Negatives are off in all presets: no '-' directly after '=' or '#'.
            assert!(
                !p.solution.contains("=-") && !p.solution.contains("#-"),
                "{p:?}"
            );
            if level == 1 {
                assert!(!expr.contains('*'), "level 1 has no *: {p:?}");
            }
        }
    }
}

#[test]
fn same_seed_same_problems_different_seed_different() {
    let d = Difficulty::level(3).expect("preset");
    let draw = |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..20)
            .map(|_| Problem::generate(&d, &mut rng).expect("generate"))
            .collect::<Vec<_>>()
    };
    assert_eq!(draw(1), draw(1));
    assert_ne!(draw(1), draw(2));
}

#[test]
fn eval_set_is_fixed_distinct_and_disjoint_from_training() {
    let d = Difficulty::level(1).expect("preset");
    let task = ArithmeticTask::new(d.clone(), 300, 11).expect("task");
    let again = ArithmeticTask::new(d, 300, 11).expect("task");
    assert_eq!(task.eval_set(), again.eval_set());
    assert_eq!(task.eval_set().len(), 300);
    let distinct: std::collections::HashSet<_> =
        task.eval_set().iter().map(|p| &p.prompt).collect();
    assert_eq!(distinct.len(), 300);
    let mut stream = task.train_stream(11); // same seed as eval: filtering must still hold
    let train = stream.take_problems(5000).expect("train");
    assert!(train.iter().all(|p| !task.is_eval_prompt(&p.prompt)));
    // The stream is reproducible from its seed.
    let mut again = task.train_stream(11);
    assert_eq!(
        again.take_problems(50).expect("train"),
        train[..50].to_vec()
    );
}

#[test]
fn train_stream_resumes_from_word_pos() {
    let task = ArithmeticTask::new(Difficulty::level(2).expect("preset"), 10, 0).expect("task");
    let mut a = task.train_stream(5);
    a.take_problems(17).expect("train");
    let pos = a.word_pos();
    let next = a.take_problems(5).expect("train");
    let mut b = task.train_stream(5);
    b.set_word_pos(pos);
    assert_eq!(b.take_problems(5).expect("train"), next);
}

fn tiny() -> Difficulty {
    // Space: 10 x 10 one-digit additions = 100 problems.
    Difficulty {
        min_operands: 2,
        max_operands: 2,
        max_digits: 1,
        max_mul_digits: 1,
        ops: vec![Op::Add],
        allow_negative: false,
    }
}

#[test]
fn too_large_eval_set_is_an_error() {
    match ArithmeticTask::new(tiny(), 101, 0) {
        Err(TaskError::EvalSetTooLarge { wanted, got, .. }) => {
            assert_eq!(wanted, 101);
            assert_eq!(got, 100);
        }
        other => panic!("expected EvalSetTooLarge, got {other:?}"),
    }
}

#[test]
fn eval_set_covering_the_space_blocks_training() {
    let task = ArithmeticTask::new(tiny(), 100, 0).expect("all 100 problems");
    let mut stream = task.train_stream(0);
    assert!(matches!(
        stream.next_problem(),
        Err(TaskError::TrainSpaceExhausted { .. })
    ));
}

#[test]
fn bad_difficulties_are_rejected() {
    assert!(matches!(
        Difficulty::level(0),
        Err(TaskError::UnknownLevel { level: 0, .. })
    ));
    assert!(matches!(
        Difficulty::level(MAX_LEVEL + 1),
        Err(TaskError::UnknownLevel { .. })
    ));
    for bad in [
        Difficulty {
            min_operands: 1,
            ..tiny()
        },
        Difficulty {
            max_operands: 1,
            ..tiny()
        },
        Difficulty {
            max_digits: 0,
            ..tiny()
        },
        Difficulty {
            max_mul_digits: 2,
            ..tiny()
        },
        Difficulty {
            ops: vec![],
            ..tiny()
        },
    ] {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert!(
            matches!(
                Problem::generate(&bad, &mut rng),
                Err(TaskError::InvalidDifficulty(_))
            ),
            "{bad:?}"
        );
    }
}

#[test]
fn negatives_allowed_produce_negative_answers() {
    let d = Difficulty {
        allow_negative: true,
        ops: vec![Op::Sub],
        ..Difficulty::level(1).expect("preset")
    };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let ps: Vec<_> = (0..200)
        .map(|_| Problem::generate(&d, &mut rng).expect("generate"))
        .collect();
    assert!(ps.iter().any(|p| p.answer < 0));
    for p in &ps {
        let expr = p.prompt.strip_suffix('=').expect("prompt");
        assert_eq!(eval_expr(expr), p.answer);
        assert!(p.solution.ends_with(&format!("#{}", p.answer)));
    }
}
