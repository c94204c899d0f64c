//! Dataset rewards: a table of tricky answers per kind, weighted combinations, and the
//! external command verifier fed JSONL on stdin — including verifiers that crash, hang,
//! print garbage or the wrong number of lines, all of which must be errors, never zeros.

use std::time::{Duration, Instant};

use r3_tasks::reward::answers::{arith_reward, exact_reward, math_reward};
use r3_tasks::{
    CommandReward, Reward, RewardFuncSpec, RewardInput, RewardKind, RewardSpec, TaskError,
};
use serde_json::Value;

#[test]
fn math_reward_table() {
    let cases = [
        ("... so she pays 18 dollars.\n#### 18", "18", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("The total is 1,234.", "1234", 1.0),
        ("#### 18.0", "18", 1.0),
        ("#### 18", "18.00", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("#### 3/4", "0.75", 1.0),
        ("I get 3/4", "4", 1.0), // the last-number fallback reads the last integer
        ("#### $1,000.00", "1000", 1.0),
        ("#### -5", "-5", 1.0),
        ("\\boxed{7} (not 8)", "7", 1.0),
        ("#### 72\nChecking: 3 + 5 = 8", "72", 1.0),
        ("#### 17", "18", 0.0),
        ("18 apples, then 19", "18", 0.0),
        ("no number here", "18", 0.0),
        ("", "0", 0.0),
        ("#### 12,34", "1234", 0.0),
    ];
    for (response, truth, want) in cases {
        assert_eq!(
            math_reward(response, truth),
            want,
            "{response:?} vs {truth:?}"
        );
    }
}

#[test]
fn exact_reward_table() {
    let cases = [
        ("yes", "yes", 1.0),
        ("  yes\n", "yes", 1.0),
        ("yes", " yes ", 1.0),
        ("Yes", "yes", 0.0),
        ("yes.", "yes", 0.0),
        ("18.0", "18", 0.0),
        ("", "", 1.0),
    ];
    for (response, truth, want) in cases {
        assert_eq!(
            exact_reward(response, truth),
            want,
            "{response:?} vs {truth:?}"
        );
    }
}

#[test]
fn arith_reward_table_matches_the_builtin_rule() {
    let cases = [
        ("7*3=21;12+21=33#33", "33", 1.0),
        ("#-4", "-4", 1.0),
        ("#34", "33", 0.25),
        ("33", "33", 0.0),
        ("#33", " 33 ", 1.0),
    ];
    for (response, truth, want) in cases {
        let got = arith_reward(response, truth, 0.25, 0).expect("integer truth");
        assert_eq!(got, want, "{response:?} vs {truth:?}");
    }
    let err = arith_reward("#3", "3.5", 0.0, 4).expect_err("non-integer truth");
    assert!(matches!(err, TaskError::RewardRow { row: 4, .. }), "{err}");
}

/// An input whose ground truth is the JSON string `truth` (leaked: it lives for the test).
fn input<'a>(response: &'a str, truth: &str, extra: &'a Value) -> RewardInput<'a> {
    RewardInput {
        prompt: "Q?",
        response,
        ground_truth: Box::leak(Box::new(Value::String(truth.into()))),
        data_source: "test",
        extra_info: extra,
    }
}

#[test]
fn weighted_functions_sum_and_the_first_decides_correctness() {
    let spec = RewardSpec {
        funcs: vec![
            RewardFuncSpec {
                kind: RewardKind::Math,
                weight: 1.0,
                ..RewardFuncSpec::default()
            },
            RewardFuncSpec {
                kind: RewardKind::Exact,
                weight: 0.5,
                ..RewardFuncSpec::default()
            },
        ],
        ..RewardSpec::default()
    };
    let reward = Reward::from_spec(&spec, 0.0);
    let extra = Value::Null;
    let scores = reward
        .score_batch(&[
            input("12", "12", &extra),
            input("it is 12", "12", &extra),
            input("13", "12", &extra),
        ])
        .expect("scores");
    let got: Vec<(f32, bool)> = scores.iter().map(|s| (s.reward, s.correct)).collect();
    assert_eq!(got, vec![(1.5, true), (1.0, true), (0.0, false)]);
}

#[test]
fn the_default_spec_is_the_arith_rule() {
    let reward = Reward::from_spec(&RewardSpec::default(), 0.1);
    let extra = Value::Null;
    let scores = reward
        .score_batch(&[input("1+2=3#3", "3", &extra), input("#4", "3", &extra)])
        .expect("scores");
    assert_eq!((scores[0].reward, scores[0].correct), (1.0, true));
    assert_eq!((scores[1].reward, scores[1].correct), (0.1, false));
}

fn sh(script: &str, timeout_ms: u64) -> CommandReward {
    CommandReward {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        timeout: Duration::from_millis(timeout_ms),
    }
}

#[test]
fn command_reward_reads_one_json_object_per_line_and_one_score_back() {
    let extra = serde_json::json!({"index": 3});
    let inputs = [
        input("7", "7", &extra),
        input(
            "a longer response, with \"quotes\"\nand a newline",
            "8",
            &extra,
        ),
    ];
    // The verifier answers each line's byte length: proves it got exactly one JSON object
    // per line, as serde_json writes it.
    let lengths = sh(
        "while IFS= read -r l; do printf '%s\\n' \"${#l}\"; done",
        10_000,
    )
    .score_batch(&inputs)
    .expect("lengths");
    let want: Vec<f32> = inputs
        .iter()
        .map(|i| serde_json::to_string(i).expect("json").len() as f32)
        .collect();
    assert_eq!(lengths, want);
    // And it sees the fields by name.
    let judged = sh(
        r#"while IFS= read -r l; do case "$l" in *'"response":"7","ground_truth":"7"'*'"index":3'*) echo 1;; *) echo 0.25;; esac; done"#,
        10_000,
    )
    .score_batch(&inputs)
    .expect("judged");
    assert_eq!(judged, vec![1.0, 0.25]);
}

fn command_error(script: &str, rows: usize, timeout_ms: u64) -> String {
    let extra = Value::Null;
    let inputs: Vec<RewardInput<'_>> = (0..rows).map(|_| input("1", "1", &extra)).collect();
    match sh(script, timeout_ms).score_batch(&inputs) {
        Ok(scores) => panic!("{script:?} gave scores {scores:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_crashing_verifier_is_an_error_with_its_stderr() {
    let msg = command_error("cat >/dev/null; echo 1; echo boom >&2; exit 3", 2, 10_000);
    assert!(msg.contains("exited") && msg.contains("boom"), "{msg}");
}

#[test]
fn a_hanging_verifier_is_killed_at_the_timeout() {
    let t = Instant::now();
    let msg = command_error("sleep 30", 2, 300);
    assert!(msg.contains("timeout"), "{msg}");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "returned after the timeout"
    );
}

#[test]
fn garbage_or_non_finite_scores_name_the_row() {
    let msg = command_error("cat >/dev/null; echo 1; echo banana; echo 0", 3, 10_000);
    assert!(
        msg.contains("batch row 1") && msg.contains("banana"),
        "{msg}"
    );
    let msg = command_error("cat >/dev/null; echo NaN", 1, 10_000);
    assert!(
        msg.contains("batch row 0") && msg.contains("finite"),
        "{msg}"
    );
    let msg = command_error("cat >/dev/null; echo", 1, 10_000);
    assert!(msg.contains("0 score lines for 1 rows"), "{msg}");
}

#[test]
fn a_wrong_line_count_is_an_error() {
    let msg = command_error("cat >/dev/null; echo 1", 3, 10_000);
    assert!(msg.contains("1 score lines for 3 rows"), "{msg}");
    let msg = command_error("cat >/dev/null; echo 1; echo 1; echo 1", 2, 10_000);
    assert!(msg.contains("3 score lines for 2 rows"), "{msg}");
}

#[test]
fn a_missing_program_is_an_error() {
    let extra = Value::Null;
    let c = CommandReward {
        argv: vec!["/nonexistent/r3-verifier".into()],
        timeout: Duration::from_secs(5),
    };
    let err = c
        .score_batch(&[input("1", "1", &extra)])
        .expect_err("missing program");
    assert!(err.to_string().contains("cannot start"), "{err}");
}

#[test]
fn command_specs_need_a_command_and_a_timeout() {
    let spec = RewardSpec {
        kind: RewardKind::Command,
        ..RewardSpec::default()
    };
    let (field, _) = spec.validate().expect_err("no command");
    assert_eq!(field, "reward.command");
    let spec = RewardSpec {
        kind: RewardKind::Command,
        command: vec!["sh".into()],
        timeout_s: 0.0,
        ..RewardSpec::default()
    };
    let (field, _) = spec.validate().expect_err("zero timeout");
    assert_eq!(field, "reward.timeout_s");
}

#[test]
fn scores_beyond_f32_are_errors_naming_the_line() {
    let msg = command_error("cat >/dev/null; echo 0; echo 1e39", 2, 10_000);
    assert!(
        msg.contains("batch row 1") && msg.contains("output line 2") && msg.contains("f32"),
        "{msg}"
    );
    let msg = command_error("cat >/dev/null; echo -1e39", 1, 10_000);
    assert!(msg.contains("f32") && msg.contains("-1e39"), "{msg}");
    // f32's largest finite values still pass.
    let extra = Value::Null;
    let got = sh("cat >/dev/null; echo 3.4e38; echo -3.4e38", 10_000)
        .score_batch(&[input("1", "1", &extra), input("1", "1", &extra)])
        .expect("scores in range");
    assert_eq!(got, vec![3.4e38f32, -3.4e38f32]);
}

#[test]
fn huge_timeouts_are_refused_by_name_and_never_panic() {
    let command = |timeout_s: f64| RewardSpec {
        kind: RewardKind::Command,
        command: vec!["sh".into(), "-c".into(), "cat >/dev/null; echo 1".into()],
        timeout_s,
        ..RewardSpec::default()
    };
    assert!(command(r3_tasks::reward::spec::MAX_TIMEOUT_S)
        .validate()
        .is_ok());
    for timeout_s in [1e7 + 1.0, 1e20, f64::MAX] {
        let (field, reason) = command(timeout_s).validate().expect_err("huge timeout");
        assert_eq!(field, "reward.timeout_s", "{timeout_s}");
        assert!(reason.contains("more than"), "{reason}");
    }
    let listed = RewardSpec {
        funcs: vec![
            RewardFuncSpec::default(),
            RewardFuncSpec {
                kind: RewardKind::Command,
                command: vec!["sh".into()],
                timeout_s: 1e20,
                ..RewardFuncSpec::default()
            },
        ],
        ..RewardSpec::default()
    };
    let (field, _) = listed.validate().expect_err("huge timeout in funcs");
    assert_eq!(field, "reward.funcs[1].timeout_s");
    // A spec that skipped validation still builds (the timeout saturates) and scores.
    let extra = Value::Null;
    let scores = Reward::from_spec(&command(1e20), 0.0)
        .score_batch(&[input("1", "1", &extra)])
        .expect("scores");
    assert_eq!(scores[0].reward, 1.0);
}

/// A command verifier reads the ground truth as the dataset holds it, as verl's reward
/// manager passes it to `compute_score`: an object as that object (verl search-R1's
/// `{"target": [...]}`), a number as a number (r3 sent `"5"` before), a string as a string.
#[test]
fn a_command_verifier_reads_the_ground_truth_as_the_dataset_holds_it() {
    let extra = Value::Null;
    let truths = [
        serde_json::json!({"target": ["Paris", "paris"]}),
        serde_json::json!(5),
        serde_json::json!("5"),
        serde_json::json!(3.0),
    ];
    let inputs: Vec<RewardInput<'_>> = truths
        .iter()
        .map(|t| RewardInput {
            prompt: "Q?",
            response: "Paris",
            ground_truth: t,
            data_source: "search",
            extra_info: &extra,
        })
        .collect();
    let script = r#"while IFS= read -r l; do case "$l" in
        *'"ground_truth":{"target":["Paris","paris"]},"data_source"'*) echo 1;;
        *'"ground_truth":5,"data_source"'*) echo 2;;
        *'"ground_truth":"5","data_source"'*) echo 3;;
        *'"ground_truth":3.0,"data_source"'*) echo 4;;
        *) echo 0;; esac; done"#;
    let got = sh(script, 10_000).score_batch(&inputs).expect("scores");
    assert_eq!(got, vec![1.0, 2.0, 3.0, 4.0]);
    // A built-in rule cannot compare an object: an error naming the batch row, never a 0.
    let spec = RewardSpec {
        kind: RewardKind::Math,
        ..RewardSpec::default()
    };
    let err = Reward::from_spec(&spec, 0.0)
        .score_batch(&inputs)
        .expect_err("an object for math")
        .to_string();
    assert!(
        err.contains("batch row 0") && err.contains("an object"),
        "{err}"
    );
    let scores = Reward::from_spec(&spec, 0.0)
        .score_batch(&inputs[1..])
        .expect("numbers and strings");
    let got: Vec<f32> = scores.iter().map(|s| s.reward).collect();
    assert_eq!(got, vec![0.0, 0.0, 0.0], "\"Paris\" is no 5");
}

#[test]
fn only_command_verifiers_take_any_ground_truth() {
    use r3_tasks::GroundTruthUse;
    let command = RewardFuncSpec {
        kind: RewardKind::Command,
        command: vec!["true".into()],
        ..RewardFuncSpec::default()
    };
    let spec = |funcs: Vec<RewardFuncSpec>| RewardSpec {
        funcs,
        ..RewardSpec::default()
    };
    assert_eq!(
        RewardSpec::default().ground_truth_use(),
        GroundTruthUse::Text(RewardKind::Arith)
    );
    assert_eq!(
        spec(vec![command.clone()]).ground_truth_use(),
        GroundTruthUse::Any
    );
    let exact = RewardFuncSpec {
        kind: RewardKind::Exact,
        ..RewardFuncSpec::default()
    };
    assert_eq!(
        spec(vec![command, exact]).ground_truth_use(),
        GroundTruthUse::Text(RewardKind::Exact)
    );
}
