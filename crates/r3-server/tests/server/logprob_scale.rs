//! The output log-probs `/generate` reports over the real engine, against hand-computed
//! truth: at temperature 0.5 they are `log softmax(z / 0.5)[token]` (SGLang's default, the
//! distribution the token was drawn from), with `ServerConfig::return_original_logprob`
//! (`r3 serve --return-original-logprob`, SGLang's `SGLANG_RETURN_ORIGINAL_LOGPROB`)
//! `log softmax(z)[token]`, the same tokens either way; top log-probs follow the same
//! distribution and prompt log-probs stay raw under both. The truth is the teacher-forced
//! sequence's whole raw rows, which the engine's prompt log-probs give (every one of the
//! fixture's 256 tokens as an alternative), rescaled in f64.

use r3_rollout::{GenerateRequest, SamplingParams};
use r3_server::{build_app, ServerConfig};
use serde_json::{json, Value};

use crate::engine::{engine, MODEL};
use crate::support::{fixture, ids, TestServer};

/// The sampling temperature of the requests.
const T: f64 = 0.5;

fn server(return_original_logprob: bool) -> TestServer {
    let config = ServerConfig {
        return_original_logprob,
        ..ServerConfig::default()
    };
    TestServer::start(build_app(engine(&fixture(MODEL)), None, config).expect("app builds"))
}

/// The `[logprob, id, text]` entries of `field` as (id, log-prob).
fn entries(v: &Value) -> Vec<(u32, f64)> {
    v.as_array()
        .expect("log-prob entries")
        .iter()
        .map(|e| {
            (
                e[1].as_u64().expect("id") as u32,
                e[0].as_f64().expect("log-prob"),
            )
        })
        .collect()
}

/// The raw `log softmax(z)` row that scores each of the `n` tokens after `prompt` in
/// `sequence`, all 256 entries, from the engine's prompt log-probs.
fn raw_rows(sequence: &[u32], prompt: usize) -> Vec<Vec<f64>> {
    let vocab = 256;
    let sampling = SamplingParams {
        prompt_logprobs_from: Some(prompt - 1),
        top_logprobs: vocab,
        ..SamplingParams::greedy(1)
    };
    let mut e = engine(&fixture(MODEL));
    let r = e
        .generate(vec![GenerateRequest::new(sequence.to_vec(), sampling)])
        .expect("teacher-forced")
        .remove(0);
    let p = r.prompt_logprobs.expect("prompt log-probs");
    p.top_logprobs
        .iter()
        .map(|top| {
            assert_eq!(top.len(), vocab, "every token as an alternative");
            let mut row = vec![f64::NAN; vocab];
            for &(id, lp) in top {
                row[id as usize] = f64::from(lp);
            }
            row
        })
        .collect()
}

/// `log softmax(r / t)[token]` of a raw log-softmax row `r` (= `log softmax(z / t)`).
fn at_temperature(row: &[f64], t: f64, token: u32) -> f64 {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = row.iter().map(|&v| ((v - max) / t).exp()).sum();
    (row[token as usize] - max) / t - sum.ln()
}

/// `/generate` at temperature 0.5 reports the tempered log-probs by default and the raw ones
/// with the server flag; top log-probs alike; the prompt's stay raw; tokens are the same.
#[test]
fn generate_reports_tempered_logprobs_unless_the_server_returns_original_ones() {
    let prompt: Vec<u32> = vec![3, 17, 42, 99, 7, 11];
    let body = json!({
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 6, "temperature": T, "seed": 9, "ignore_eos": true},
        "return_logprob": true,
        "top_logprobs_num": 3,
        "logprob_start_len": 3,
    });
    let mut tokens = Vec::new();
    for original in [false, true] {
        let s = server(original);
        let r = s.post("/generate", &body);
        assert_eq!(r.status, 200, "{}", r.text);
        let output = ids(&r.body["output_ids"]);
        let meta = &r.body["meta_info"];
        let mut sequence = prompt.clone();
        sequence.extend(&output);
        let rows = raw_rows(&sequence, prompt.len());
        let t = if original { 1.0 } else { T };
        let lps = entries(&meta["output_token_logprobs"]);
        assert_eq!(lps.len(), output.len());
        let mut apart = 0;
        for (p, ((id, lp), row)) in lps.iter().zip(&rows).enumerate() {
            assert_eq!(*id, output[p]);
            let want = at_temperature(row, t, *id);
            assert!(
                (lp - want).abs() < 2e-4,
                "original {original}, position {p}: {lp} against {want}"
            );
            apart += usize::from((at_temperature(row, T, *id) - row[*id as usize]).abs() > 0.01);
        }
        assert!(apart >= 3, "only {apart} positions tell T apart from 1");
        let tops = meta["output_top_logprobs"]
            .as_array()
            .expect("top log-probs");
        for (p, (top, row)) in tops.iter().zip(&rows).enumerate() {
            for (id, lp) in entries(top) {
                let want = at_temperature(row, t, id);
                assert!(
                    (lp - want).abs() < 2e-4,
                    "original {original}, position {p}, top {id}: {lp} against {want}"
                );
            }
        }
        // Prompt log-probs: raw under both (the first entry, at position 3, is null).
        let input = meta["input_token_logprobs"]
            .as_array()
            .expect("input log-probs");
        let prompt_rows = raw_rows(&prompt, 4);
        for (k, e) in input.iter().skip(1).enumerate() {
            let lp = e[0].as_f64().expect("a prompt log-prob");
            let want = prompt_rows[k][prompt[4 + k] as usize];
            assert!(
                (lp - want).abs() < 1e-4,
                "prompt position {}: {lp} vs {want}",
                4 + k
            );
        }
        let info = s.get("/get_server_info");
        assert_eq!(info.body["return_original_logprob"], json!(original));
        tokens.push(output);
    }
    assert_eq!(tokens[0], tokens[1], "the flag moved the tokens");
}
