//! Decode-step paged attention on a GRPO-shaped batch: groups of sequences sharing their
//! prompt's full KV blocks (as the prefix cache hands them out), each with its own blocks
//! for the rest, one query token per sequence, every layer of a model's geometry (16-token
//! blocks).
//!
//! ```text
//! cargo run --release -p r3-rollout --example attention_speed -- [GROUPS GROUP PROMPT GENERATED [PARALLEL [DTYPE [GEOMETRY [CACHE]]]]]
//! ```
//! Defaults: 32 groups of 8, a 63-token prompt, 34 generated tokens (gsm8k-style's mean
//! point of a rollout), parallel 1 (rayon; 0 = the calling thread alone), the cache in f32
//! (`f16` / `bf16`: the f16 and bf16 engines' caches), the gsm8k-moe geometry (4 heads over
//! 2 key/value heads of width 24, 4 layers; `mid`: the mid bench config's 8 heads over 4 of
//! width 64, 8 layers), the context left in the caches between layers (`warm`; `cold`: 64 MB
//! read on the rayon pool before each layer, as a decode step's expert weights stream
//! through the caches between two attention layers, and only the attention timed). Prints the
//! best of five runs' time per decode step.

use r3_rollout::kernels::attention::{paged_attention, AttnShape, SeqSpan};
use r3_rollout::{Dtype, KvBlockRef, KvLayout, KvPool};
use rayon::prelude::*;
use std::time::Instant;

/// Token positions per KV block.
const BLOCK: usize = 16;

/// Attention geometry of one model: (query heads, key/value heads, head width, layers).
#[derive(Clone, Copy)]
struct Geometry {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    layers: usize,
}

fn main() -> Result<(), String> {
    let given: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: usize| -> Result<usize, String> {
        given.get(i).map_or(Ok(default), |a| {
            a.parse()
                .map_err(|_| format!("argument {} ({a:?}) is not a count", i + 1))
        })
    };
    let (groups, group, prompt, generated) = (arg(0, 32)?, arg(1, 8)?, arg(2, 63)?, arg(3, 34)?);
    let parallel = arg(4, 1)? != 0;
    let dtype = match given.get(5).map(String::as_str) {
        None | Some("f32") => Dtype::F32,
        Some("f16") => Dtype::F16,
        Some("bf16") => Dtype::Bf16,
        Some(other) => return Err(format!("argument 6 ({other:?}) is not f32, f16 or bf16")),
    };
    let geometry = match given.get(6).map(String::as_str) {
        None | Some("gsm8k") => Geometry {
            heads: 4,
            kv_heads: 2,
            head_dim: 24,
            layers: 4,
        },
        Some("mid") => Geometry {
            heads: 8,
            kv_heads: 4,
            head_dim: 64,
            layers: 8,
        },
        Some(other) => return Err(format!("argument 7 ({other:?}) is not gsm8k or mid")),
    };
    let Geometry {
        heads,
        kv_heads,
        head_dim,
        layers,
    } = geometry;
    let layout = KvLayout {
        num_layers: layers,
        k_dim: kv_heads * head_dim,
        v_dim: kv_heads * head_dim,
        block_size: BLOCK,
    };
    let context = prompt + generated + 1;
    let blocks_per_seq = context.div_ceil(BLOCK);
    let shared = (prompt / BLOCK).min(blocks_per_seq);
    let total_blocks = groups * (shared + group * (blocks_per_seq - shared));
    let mut pool = KvPool::new(layout, total_blocks.max(1), dtype).map_err(|e| e.to_string())?;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut draw = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let row: Vec<f32> = (0..2 * kv_heads * head_dim).map(|_| draw()).collect();
    let (k, v) = row.split_at(kv_heads * head_dim);
    let filled = |pool: &mut KvPool| -> Result<KvBlockRef, String> {
        let block = pool.allocate().ok_or("the pool ran out of blocks")?;
        for layer in 0..layers {
            for slot in 0..BLOCK {
                pool.write(block.id(), layer, slot, k, v);
            }
        }
        Ok(block)
    };
    let mut held = Vec::new();
    let mut spans = Vec::new();
    for _ in 0..groups {
        let prefix = (0..shared)
            .map(|_| filled(&mut pool))
            .collect::<Result<Vec<_>, _>>()?;
        for _ in 0..group {
            let mut blocks: Vec<_> = prefix.iter().map(|b| b.id()).collect();
            for _ in shared..blocks_per_seq {
                let block = filled(&mut pool)?;
                blocks.push(block.id());
                held.push(block);
            }
            spans.push(SeqSpan {
                first_token: spans.len(),
                num_tokens: 1,
                start_pos: context - 1,
                blocks,
            });
        }
        held.extend(prefix);
    }
    let rows = spans.len();
    let q: Vec<f32> = (0..rows * heads * head_dim).map(|_| draw()).collect();
    let mut out = vec![0f32; rows * heads * head_dim];
    let shape = AttnShape {
        num_heads: heads,
        num_kv_heads: kv_heads,
        qk_dim: head_dim,
        v_dim: head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
        window: None,
    };
    let flush = match given.get(7).map(String::as_str) {
        None | Some("warm") => false,
        Some("cold") => true,
        Some(other) => return Err(format!("argument 8 ({other:?}) is not warm or cold")),
    };
    let junk: Vec<u64> = vec![1; if flush { 8 << 20 } else { 0 }];
    let iters = if flush { 40 } else { 200 };
    let mut best = f64::MAX;
    let mut sink = 0u64;
    for _ in 0..5 {
        let mut spent = 0.0;
        for _ in 0..iters {
            for layer in 0..layers {
                if flush {
                    sink = sink.wrapping_add(
                        junk.par_chunks(1 << 16)
                            .map(|c| c.iter().sum::<u64>())
                            .sum::<u64>(),
                    );
                }
                let started = Instant::now();
                paged_attention(&pool, layer, &spans, &q, &mut out, shape, parallel);
                spent += started.elapsed().as_secs_f64();
            }
        }
        best = best.min(spent / iters as f64);
    }
    std::hint::black_box(sink);
    let scores = rows * layers * heads * context;
    println!(
        "{rows} rows, context {context}, parallel {parallel}, {dtype} cache: {:.3} ms per decode step ({layers} layers), {:.2} ns per (key, head); checksum {}",
        best * 1e3,
        best * 1e9 / scores as f64,
        out.iter().sum::<f32>()
    );
    Ok(())
}
