//! The peak resident memory of one update against its token budget and its batch: loads a
//! model, builds a batch of `N` synthetic prompt+response sequences of gsm8k-style lengths
//! (prompts 60–140 tokens, responses 20–160, from a fixed LCG: the same `N` gives the same
//! batch), runs one single mini-step update (`update_minibatch` with the default config's
//! loss settings, routes recorded as without replay) with `B` tokens per micro-batch, and
//! prints one JSON line with the resident set before and the high-water mark during the
//! update (Linux `/proc/self/status`).
//!
//! One setting per process, so each peak is its own:
//! `cargo run -p r3-train --example micro_batch_memory -- models/gsm8k-moe 256 4096`
//! (`checkpointing` after them turns on `algo.gradient_checkpointing`, `warm` measures a
//! second update, the optimiser's moments already written as in a run's later steps,
//! `head-chunk=N` sets
//! `algo.head_chunk_tokens`, `bf16` trains in bf16 with f32 masters and `bf16-masters` in
//! bf16 with the weights held in bf16, `train.master_weights = "bf16"`, and `bf16-moments`
//! keeps AdamW's moments in bf16, `optim.moments_dtype = "bf16"`, and `bf16-sums` sums the
//! bf16 weights' gradients over the micro-batches in bf16, `train.grad_accum_dtype =
//! "bf16"`, and `selective` runs the attention's q and k heads again in the backward,
//! `algo.selective_recompute`; `mid` for the model
//! directory is `r3 bench train`'s mid-size config with seeded random weights, vocabulary
//! 32,000)
//!
//! Measured 2026-11-26 on models/gsm8k-moe (dev profile, shared 2-core machine), peak over
//! the resident set before the update: at a budget of 4096 tokens, 32 / 128 / 256 sequences
//! → 285 / 303 / 313 MiB; at 256 sequences, budget 2048 / 4096 / 8192 / 16384 → 172 / 313 /
//! 598 / 1161 MiB; without a budget (one forward) 32 / 128 / 256 → 642 / 2436 / 5059 MiB.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Tensor};
use r3_model::{Precision, Routing};
use r3_train::policy::precision::MasterWeights;
use r3_train::policy::{ResponseBatch, TrainablePolicy};
use r3_train::rl::memory::{read_memory, reset_peak};
use r3_train::rl::micro_batches::{pack_micro_batches, sequence_lens};
use r3_train::rl::minibatch::{update_minibatch, MiniBatch, UpdateSettings};
use r3_train::rl::step::update_settings;
use r3_train::{decay_matrices_only, AdamW, AdamWParams, TrainConfig};

/// `n` sequences of gsm8k-style lengths over a `vocab`-token vocabulary (ids ≥ 3).
fn synthetic_batch(n: usize, vocab: u32) -> Result<ResponseBatch, Box<dyn std::error::Error>> {
    let mut x: u64 = 0x5eed;
    let mut next = move |m: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    let mut sequences = Vec::with_capacity(n);
    let mut prompt_lens = Vec::with_capacity(n);
    for _ in 0..n {
        let prompt = 60 + next(81) as usize;
        let response = 20 + next(141) as usize;
        let seq = (0..prompt + response)
            .map(|_| 3 + next(u64::from(vocab - 3)) as u32)
            .collect();
        sequences.push(seq);
        prompt_lens.push(prompt);
    }
    Ok(ResponseBatch::new(sequences, prompt_lens)?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: micro_batch_memory MODEL_DIR|mid SEQUENCES TOKEN_BUDGET [checkpointing] \
                 [warm] [head-chunk=TOKENS] [bf16|bf16-masters] [bf16-moments] [bf16-sums] \
                 [selective]";
    let [model, n, budget, flags @ ..] = args.as_slice() else {
        return Err(usage.into());
    };
    let mut checkpointing = false;
    let mut warm = false;
    let mut head_chunk = 0usize;
    let (mut precision, mut masters) = (Precision::F32, MasterWeights::F32);
    let mut moments = DType::F32;
    let mut bf16_sums = false;
    let mut selective = false;
    for flag in flags {
        match flag.split_once('=') {
            None if flag == "checkpointing" => checkpointing = true,
            None if flag == "bf16" => precision = Precision::Bf16 { router_f32: false },
            None if flag == "bf16-moments" => moments = DType::BF16,
            None if flag == "bf16-sums" => bf16_sums = true,
            None if flag == "selective" => selective = true,
            None if flag == "bf16-masters" => {
                precision = Precision::Bf16 { router_f32: false };
                masters = MasterWeights::Bf16;
            }
            None if flag == "warm" => warm = true,
            Some(("head-chunk", tokens)) => {
                head_chunk = tokens
                    .parse()
                    .map_err(|e| format!("head-chunk {tokens:?}: {e}"))?
            }
            _ => return Err(format!("{flag:?}: {usage}").into()),
        }
    }
    let n: usize = n.parse().map_err(|e| format!("SEQUENCES {n:?}: {e}"))?;
    let budget: usize = budget
        .parse()
        .map_err(|e| format!("TOKEN_BUDGET {budget:?}: {e}"))?;
    // `mid`: `r3 bench train`'s mid-size config (vocabulary 32,000) with seeded random
    // weights, where the logits are a large part of an update's memory.
    let policy = match model.as_str() {
        "mid" => {
            let cfg = r3_model::presets::mid_size_bench_config()?;
            // `r3 bench train`'s initialisation.
            let mut init = r3_model::RandomInit::new(0);
            init.std = 0.02;
            init.router_std = 0.02;
            init.norm_jitter = 0.0;
            let weights = r3_model::Weights::random(&cfg, &init, &candle_core::Device::Cpu)?;
            let weights = match masters {
                MasterWeights::Bf16 => weights.narrow_for_training(&cfg, DType::BF16, true)?,
                MasterWeights::F32 => weights,
            };
            let mut policy = TrainablePolicy::new(cfg, weights)?;
            policy.set_precision(precision);
            policy
        }
        dir => TrainablePolicy::load_for_training(
            &PathBuf::from(dir),
            &candle_core::Device::Cpu,
            precision,
            masters,
        )?,
    };
    let vocab = policy.config().vocab_size as u32;
    let batch = synthetic_batch(n, vocab)?;
    let device = policy.device();
    let width = batch.width();
    let rollout_logp = Tensor::zeros((n, width), candle_core::DType::F32, &device)?;
    let mut opt = AdamW::new(
        policy.vars().to_vec(),
        AdamWParams::default(),
        decay_matrices_only,
    )?;
    if bf16_sums && masters != MasterWeights::Bf16 {
        return Err("bf16-sums sums bf16 weights' gradients: it needs bf16-masters".into());
    }
    // Each tensor's update staged alone (`optim.update_staging = "tensor_by_tensor"`): the
    // whole-model staging (12 bytes a parameter) would set the peak of a large model's
    // update, above what its forward and backward hold.
    opt.set_staging(r3_train::UpdateStaging::TensorByTensor);
    opt.set_moment_dtype(moments)?;
    let mb = MiniBatch {
        batch: &batch,
        old_logp: None,
        rollout_logp,
        advantages: (0..n)
            .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
            .collect(),
        row_weight: None,
        routing: Routing::Record,
    };
    // The default config's loss and optimiser settings, with the budget under test.
    let settings = UpdateSettings {
        max_tokens_per_micro_batch: budget,
        gradient_checkpointing: checkpointing,
        selective_recompute: selective,
        share_prefixes: false,
        head_chunk_tokens: head_chunk,
        narrow_gradients: false,
        bf16_gradient_sums: bf16_sums,
        lr: 1e-4,
        ..update_settings(&TrainConfig::default())?
    };
    let lens = sequence_lens(&batch);
    let parts = pack_micro_batches(&lens, budget);
    if warm {
        // A step of a run past its first: the optimiser's moments already written.
        update_minibatch(&policy, &mut opt, &mb, &settings)?;
    }
    let base = read_memory().ok_or("no /proc/self/status")?;
    let reset = reset_peak();
    let started = Instant::now();
    let r = update_minibatch(&policy, &mut opt, &mb, &settings)?;
    let seconds = started.elapsed().as_secs_f64();
    let after = read_memory().ok_or("no /proc/self/status")?;
    println!(
        "{{\"sequences\": {n}, \"tokens\": {}, \"padded_tokens\": {}, \"budget\": {budget}, \"checkpointing\": {checkpointing}, \"warm\": {warm}, \"head_chunk\": {head_chunk}, \"precision\": \"{precision:?}\", \"masters\": \"{masters:?}\", \"moments\": \"{moments:?}\", \"bf16_sums\": {bf16_sums}, \"selective\": {selective}, \
         \"micro_batches\": {}, \"rss_before_mib\": {:.0}, \"update_peak_mib\": {:.0}, \
         \"peak_over_base_mib\": {:.0}, \"rss_after_mib\": {:.0}, \"peak_reset\": {reset}, \"applied\": {}, \
         \"seconds\": {seconds:.2}}}",
        lens.iter().sum::<usize>(),
        parts
            .iter()
            .map(|p| p.len() * p.iter().map(|&i| lens[i]).max().unwrap_or(0))
            .sum::<usize>(),
        parts.len(),
        base.rss_mib,
        after.peak_mib,
        after.peak_mib - base.rss_mib,
        after.rss_mib,
        r.outcome.applied(),
    );
    Ok(())
}
