//! The device engine (`cpu-candle` here) under staggered arrivals: request `i` arrives
//! `i · gap` after the start; with continuous admission it joins the running batch at the
//! next step, with draining (the engine's former scheduling, emulated by submitting arrived
//! requests only while the engine is idle) it waits for the batch to finish. Prints the
//! time until the last request finished, the mean latency (arrival to finish) and generated
//! tokens/s of each, and checks that both gave every request the same tokens and routes.
//!
//! `cargo run -p r3-rollout --example staggered_arrivals -- [requests] [gap_ms]
//! [prompt_len] [new_tokens] [repeats] [hidden]` (defaults 16, 20, 16, 128, 3, 128: the two
//! schedules alternate, medians reported); a qwen3_moe-shaped model of 4 layers, 8 experts
//! (2 per token), the given hidden size, random weights (seed 0), greedy decoding.

use std::collections::{HashMap, VecDeque};
use std::error::Error;
use std::time::{Duration, Instant};

use r3_model::weights::{RandomInit, Weights};
use r3_model::Config;
use r3_rollout::{
    DeviceEngine, DeviceEngineConfig, GenerateRequest, GenerateResult, SamplingParams,
};

/// Positional argument `n` as a number, or `default` when absent.
fn arg(n: usize, name: &str, default: usize) -> Result<usize, Box<dyn Error>> {
    match std::env::args().nth(n) {
        None => Ok(default),
        Some(text) => text
            .parse()
            .map_err(|e| format!("argument {n} ({name}) `{text}` is not a count: {e}").into()),
    }
}

/// What one run measured.
struct Run {
    results: Vec<GenerateResult>,
    makespan: Duration,
    mean_latency: Duration,
}

/// Feeds `reqs` to `engine` as they arrive (`gap` apart), admitting them at once
/// (`admit`) or only while the engine is idle; results in input order.
fn run(
    engine: &mut DeviceEngine,
    reqs: &[GenerateRequest],
    gap: Duration,
    admit: bool,
) -> Result<Run, Box<dyn Error>> {
    let start = Instant::now();
    let mut pending: VecDeque<usize> = (0..reqs.len()).collect();
    let mut arrived: Vec<usize> = Vec::new();
    let mut index_of = HashMap::new();
    let mut finished: HashMap<usize, (GenerateResult, Duration)> = HashMap::new();
    while finished.len() < reqs.len() {
        let now = start.elapsed();
        while pending.front().is_some_and(|&i| gap * i as u32 <= now) {
            arrived.extend(pending.pop_front());
        }
        if admit || !engine.has_work() {
            for i in arrived.drain(..) {
                index_of.insert(engine.submit(reqs[i].clone())?, i);
            }
        }
        if engine.has_work() {
            for r in engine.step()? {
                let i = index_of[&r.id];
                finished.insert(i, (r, start.elapsed()));
            }
        } else if let Some(&next) = pending.front() {
            std::thread::sleep((gap * next as u32).saturating_sub(start.elapsed()));
        }
    }
    let mut results = Vec::new();
    let mut latency = Duration::ZERO;
    let mut makespan = Duration::ZERO;
    for i in 0..reqs.len() {
        let (r, at) = finished.remove(&i).ok_or("a request never finished")?;
        latency += at - gap * i as u32;
        makespan = makespan.max(at);
        results.push(r);
    }
    Ok(Run {
        results,
        makespan,
        mean_latency: latency / reqs.len() as u32,
    })
}

fn main() -> Result<(), Box<dyn Error>> {
    let n = arg(1, "requests", 16)?;
    let gap = Duration::from_millis(arg(2, "gap_ms", 20)? as u64);
    let prompt_len = arg(3, "prompt_len", 16)?;
    let new_tokens = arg(4, "new_tokens", 128)?;
    let repeats = arg(5, "repeats", 3)?.max(1);
    let hidden = arg(6, "hidden", 128)?;
    let cfg = Config::from_value(serde_json::json!({
        "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": hidden,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": hidden / 4, "intermediate_size": 2 * hidden,
        "moe_intermediate_size": hidden / 2, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "tie_word_embeddings": false,
    }))?;
    let tensors = Weights::random(&cfg, &RandomInit::new(0), &candle_core::Device::Cpu)?.into_map();
    let mut engine = DeviceEngine::new(cfg.clone(), &tensors, DeviceEngineConfig::default())?;
    let reqs: Vec<GenerateRequest> = (0..n)
        .map(|i| {
            let prompt = (0..prompt_len)
                .map(|p| ((i * 131 + p * 17 + 3) % cfg.vocab_size) as u32)
                .collect();
            GenerateRequest::new(prompt, SamplingParams::greedy(new_tokens))
        })
        .collect();
    // One untimed warm-up of both paths.
    run(&mut engine, &reqs[..n.min(2)], Duration::ZERO, true)?;
    println!(
        "device engine on cpu-candle, hidden {hidden}, {n} requests arriving {} ms apart, \
         {prompt_len} prompt + {new_tokens} new tokens each, greedy",
        gap.as_millis()
    );
    // Alternate the two, `repeats` times each, and report medians: the machine is shared.
    let mut runs: [Vec<Run>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..repeats {
        for (mode, admit) in [(0, false), (1, true)] {
            runs[mode].push(run(&mut engine, &reqs, gap, admit)?);
        }
    }
    let median = |mut v: Vec<f64>| -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut medians = Vec::new();
    for (name, mode) in [("draining", &runs[0]), ("continuous admission", &runs[1])] {
        let makespan = median(mode.iter().map(|r| r.makespan.as_secs_f64()).collect());
        let latency = median(mode.iter().map(|r| r.mean_latency.as_secs_f64()).collect());
        println!(
            "{name:>20}: last finished at {makespan:.3} s, mean latency {latency:.3} s, \
             {:.1} generated tokens/s (medians of {repeats})",
            (n * new_tokens) as f64 / makespan
        );
        medians.push((makespan, latency));
    }
    for (drained, admitted) in runs[0].iter().zip(&runs[1]) {
        for (i, (a, b)) in drained.results.iter().zip(&admitted.results).enumerate() {
            if a.output_ids != b.output_ids || a.routes != b.routes {
                return Err(
                    format!("request {i}: tokens or routes depend on the scheduling").into(),
                );
            }
        }
    }
    println!(
        "same tokens and routes for every request in every run; with admission the last \
         request finished {:.2}× sooner and the mean latency was {:.2}× lower",
        medians[0].0 / medians[1].0,
        medians[0].1 / medians[1].1
    );
    Ok(())
}
