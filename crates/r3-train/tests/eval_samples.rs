//! Held-out evaluation with k samples per prompt on the shipped arithmetic model: the same
//! config and seed give the same numbers on 1 or 2 threads; the estimators hang together
//! (pass@1 = mean@k ≤ pass@2 ≤ pass@k, prompt scores in steps of 1/k); and a run writes them
//! to `eval.jsonl` with the evaluation's cost in the step's time split.

mod common;

use std::path::{Path, PathBuf};

use common::{tiny_config, Scratch};
use r3_train::config::RouterReplay;
use r3_train::rl::evaluation::EvalResult;
use r3_train::rl::metrics_log::read_eval_lines;
use r3_train::{Quiet, Run, TrainConfig, Trainer};

fn arith_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/arith-moe")
}

fn config(run_dir: &Path) -> TrainConfig {
    let mut cfg = tiny_config(&arith_model(), run_dir, RouterReplay::R3, 1);
    cfg.task.difficulty = 2;
    cfg.rollout.max_new_tokens = 40;
    cfg.eval.size = 24;
    cfg.eval.samples_per_prompt = 4;
    cfg.eval.temperature = 1.0;
    cfg.eval.bootstrap_resamples = 200;
    cfg.validate().expect("valid config");
    cfg
}

fn evaluate_on(cfg: &TrainConfig, threads: usize) -> EvalResult {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    pool.install(|| {
        let mut t = Trainer::new(cfg.clone()).expect("trainer");
        t.evaluate().expect("evaluation")
    })
}

#[test]
fn k_samples_per_prompt_same_numbers_on_one_and_two_threads() {
    let dir = Scratch::new("eval-k-threads");
    let cfg = config(&dir.path().join("run"));
    let one = evaluate_on(&cfg, 1);
    let two = evaluate_on(&cfg, 2);
    assert_eq!(one, two, "1 and 2 threads disagree");
    assert_eq!((one.n, one.samples_per_prompt), (24, 4));
    // The trained model solves some samples and misses others: the numbers say something.
    assert!(
        one.accuracy > 0.0 && one.accuracy < 1.0,
        "accuracy {}",
        one.accuracy
    );
    assert_eq!(one.prompt_scores.len(), 24);
    for s in &one.prompt_scores {
        assert_eq!(
            (s * 4.0).fract(),
            0.0,
            "a prompt score is a count over 4: {s}"
        );
    }
    let mean = one.prompt_scores.iter().sum::<f64>() / 24.0;
    assert!((one.accuracy - mean).abs() < 1e-12);
    assert!(one.accuracy_stderr > 0.0);
    assert_eq!(one.sources.len(), 1);
    let s = &one.sources[0].summary;
    assert_eq!(one.sources[0].data_source, "arith");
    let pass: Vec<f64> = s.pass_at_k.iter().map(|p| p.estimate.value).collect();
    assert_eq!(
        s.pass_at_k.iter().map(|p| p.k).collect::<Vec<_>>(),
        [1, 2, 4]
    );
    assert!((pass[0] - one.accuracy).abs() < 1e-12, "pass@1 is mean@k");
    assert!(pass[0] <= pass[1] && pass[1] <= pass[2], "{pass:?}");
    let maj = s.maj_at_k.expect("arith answers vote");
    let boot = maj.bootstrap.expect("bootstrap interval");
    assert!(boot.low <= maj.estimate.value && maj.estimate.value <= boot.high);
    // A different eval seed draws different samples.
    let mut other = cfg.clone();
    other.eval.seed += 1;
    assert_ne!(evaluate_on(&other, 2).prompt_scores, one.prompt_scores);
}

#[test]
fn a_run_logs_k_sample_estimates_and_their_cost() {
    let dir = Scratch::new("eval-k-run");
    let mut cfg = config(&dir.path().join("run"));
    cfg.steps = 1;
    cfg.checkpoint.every = 0;
    let mut run = Run::fresh(cfg).expect("run");
    run.execute(&mut Quiet).expect("execute");
    let lines = read_eval_lines(&dir.path().join("run/eval.jsonl")).expect("eval.jsonl");
    assert_eq!(lines.iter().map(|l| l.step).collect::<Vec<_>>(), [0, 1]);
    for l in &lines {
        assert_eq!(l.samples_per_prompt, Some(4));
        assert_eq!(l.prompt_scores.len(), 24);
        assert!(l.eval_accuracy_stderr.is_some_and(|e| e > 0.0));
        assert_eq!(l.sources.len(), 1);
        assert!(l.prompts_digest.is_some());
    }
    assert_eq!(lines[0].prompts_digest, lines[1].prompts_digest);
    let metrics = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).expect("metrics");
    let step: serde_json::Value =
        serde_json::from_str(metrics.lines().next().expect("a line")).expect("json");
    assert!(
        step["time.eval_s"].as_f64().is_some_and(|s| s > 0.0),
        "{step}"
    );
}

#[test]
fn several_samples_need_a_temperature() {
    let dir = Scratch::new("eval-k-greedy");
    let mut cfg = config(&dir.path().join("run"));
    cfg.eval.temperature = 0.0;
    let err = cfg.validate().expect_err("greedy k > 1 is refused");
    assert!(err.to_string().contains("eval.samples_per_prompt"), "{err}");
    cfg.eval.samples_per_prompt = 0;
    cfg.eval.temperature = 1.0;
    assert!(cfg.validate().is_err());
}
