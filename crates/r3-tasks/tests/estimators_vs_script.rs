//! r3's estimators and math reward against an independent computation: the numbers
//! `scripts/eval_avg_at_k.py` (its own `score` and `statistics`), `math.comb` and verl's
//! `calc_maj_val` (samples without an answer voting `"[INVALID]"`, as verl's math reward
//! has them) give on the same completions (`fixtures/eval_estimates.json`, written by
//! `fixtures/make_eval_estimates.py`; some prompts there leave most samples without an
//! answer, so a rule that dropped those votes would disagree).

use std::path::Path;

use r3_tasks::estimators::{paired_difference, summarise, PromptOutcome, SummaryOptions};
use r3_tasks::{Reward, RewardInput, RewardKind, RewardSpec};
use serde_json::Value;

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/eval_estimates.json");
    let text = std::fs::read_to_string(&path).expect("fixture");
    serde_json::from_str(&text).expect("fixture JSON")
}

fn close(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() < 1e-12, "{what}: r3 {a} vs script {b}");
}

/// The outcomes of one model's completions under the `math` reward.
fn outcomes(samples: &Value, truths: &[String]) -> Vec<PromptOutcome> {
    let reward = Reward::from_spec(
        &RewardSpec {
            kind: RewardKind::Math,
            ..RewardSpec::default()
        },
        0.0,
    );
    let extra = Value::Null;
    samples
        .as_array()
        .expect("prompts")
        .iter()
        .zip(truths)
        .map(|(texts, truth)| {
            let truth = Value::String(truth.clone());
            let texts: Vec<&str> = texts
                .as_array()
                .expect("samples")
                .iter()
                .map(|t| t.as_str().expect("text"))
                .collect();
            let inputs: Vec<RewardInput<'_>> = texts
                .iter()
                .map(|t| RewardInput {
                    prompt: "",
                    response: t,
                    ground_truth: &truth,
                    data_source: "gsm8k",
                    extra_info: &extra,
                })
                .collect();
            let scores = reward.score_batch(&inputs).expect("scores");
            PromptOutcome {
                correct: scores.iter().map(|s| s.correct).collect(),
                answers: reward.vote_keys(&inputs),
            }
        })
        .collect()
}

#[test]
fn mean_pass_and_majority_match_the_script() {
    let f = fixture();
    let truths: Vec<String> = f["ground_truths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    let options = SummaryOptions {
        bootstrap_resamples: 0,
        bootstrap_seed: 0,
    };
    let mut per_model = Vec::new();
    for (samples, expected) in [("model_a", "expected_a"), ("model_b", "expected_b")] {
        let o = outcomes(&f[samples], &truths);
        let s = summarise(&o, options).expect("summary");
        let e = &f[expected];
        assert_eq!(s.samples_per_prompt, 8);
        close(s.mean_at_k.value, e["avg_at_k"].as_f64().unwrap(), "avg@8");
        close(s.mean_at_k.stderr, e["stderr"].as_f64().unwrap(), "stderr");
        for p in &s.pass_at_k {
            let want = e["pass_at_k"][p.k.to_string()].as_f64().unwrap();
            close(p.estimate.value, want, &format!("pass@{}", p.k));
        }
        let maj = s.maj_at_k.expect("math answers vote");
        close(maj.estimate.value, e["maj_at_k"].as_f64().unwrap(), "maj@8");
        let scores = r3_tasks::estimators::prompt_scores(&o);
        for (i, (r, p)) in scores
            .iter()
            .zip(e["prompt_scores"].as_array().unwrap())
            .enumerate()
        {
            close(*r, p.as_f64().unwrap(), &format!("prompt {i}"));
        }
        per_model.push(scores);
    }
    let d = paired_difference(&per_model[1], &per_model[0]).unwrap();
    let e = &f["paired_b_minus_a"];
    close(d.mean, e["mean"].as_f64().unwrap(), "paired mean");
    close(d.stderr, e["stderr"].as_f64().unwrap(), "paired stderr");
}
