//! The routed experts' matmuls of one decode step of the mid bench config, timed with their
//! weights streamed from memory (256 distinct experts: 32 experts × 8 layers, 384 MB in f16)
//! and with two experts' weights reused (held in cache): how much of a decode step's expert
//! time is waiting for memory.
//!
//! ```text
//! cargo run --release -p r3-rollout --example expert_stream
//! ```
//! Prints, per rows an expert (4, 8, 12, 16, 32: batch 32 / 64 / 96 / 128 / 256 at top-4 of 32), the
//! best of five runs on the rayon pool, its FLOP rate and the weight bytes per second.

use r3_rollout::kernels::linear::Linear;
use r3_rollout::model::moe::ffn_forward;
use r3_rollout::model::weights::Ffn;
use r3_rollout::{Dtype, RolloutError};
use rayon::prelude::*;
use std::time::Instant;

const HIDDEN: usize = 512;
const INTER: usize = 512;
const EXPERTS: usize = 256;

fn main() -> Result<(), RolloutError> {
    let values = |n: usize, k: usize, seed: usize| -> Vec<f32> {
        (0..n * k)
            .map(|i| (((i + seed) * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect()
    };
    let experts = (0..EXPERTS)
        .map(|e| {
            Ok(Ffn {
                gate_up: Linear::new(
                    "gate_up",
                    values(2 * INTER, HIDDEN, e),
                    2 * INTER,
                    HIDDEN,
                    None,
                    Dtype::F16,
                )?,
                down: Linear::new(
                    "down",
                    values(HIDDEN, INTER, e + 1),
                    HIDDEN,
                    INTER,
                    None,
                    Dtype::F16,
                )?,
                inter: INTER,
            })
        })
        .collect::<Result<Vec<Ffn>, RolloutError>>()?;
    for rows in [4usize, 8, 12, 16, 32] {
        let x: Vec<f32> = (0..rows * HIDDEN)
            .map(|i| ((i * 31) % 100) as f32 / 100.0)
            .collect();
        let flops = 2.0 * (rows * 3 * INTER * HIDDEN * EXPERTS) as f64;
        let bytes = (3 * INTER * HIDDEN * 2 * EXPERTS) as f64;
        for streamed in [true, false] {
            let mut best = f64::MAX;
            for _ in 0..5 {
                let start = Instant::now();
                let outputs: Vec<Vec<f32>> = (0..EXPERTS)
                    .into_par_iter()
                    .map(|e| {
                        let expert = &experts[if streamed { e } else { e % 2 }];
                        ffn_forward(Dtype::F16, expert, &x, rows, false)
                    })
                    .collect();
                best = best.min(start.elapsed().as_secs_f64());
                std::hint::black_box(outputs);
            }
            println!(
                "{rows:3} rows an expert, weights {}: {:7.2} ms  {:6.1} GFLOP/s  {:5.1} GB/s of weights",
                if streamed { "streamed" } else { "cached  " },
                best * 1e3,
                flops / best / 1e9,
                bytes / best / 1e9
            );
        }
    }
    Ok(())
}
