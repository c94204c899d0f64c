//! Feed-forward blocks of the inference path: dense SwiGLU and the mixture of experts.
//!
//! MoE: router matmul for all tokens, per-token select + weigh on the host, then tokens are
//! grouped by expert and every active expert runs one matmul pair over its tokens (experts
//! in parallel). The chosen logical ids are written to the capture buffer when asked.
//!
//! bf16 mode: the SwiGLU output, each expert's output (its down projection) and the block's
//! combined output are bf16; the gate-weighted sum over the top-k experts and the shared
//! expert accumulates in f32 and is rounded once (a fused MoE kernel's reduction).

use r3_routing::ExpertPlacement;
use rayon::prelude::*;

use crate::dtype::Dtype;
use crate::error::RolloutError;
use crate::kernels::ops::{sigmoid, swiglu_rows};
use crate::model::weights::{Ffn, MoeWeights};

/// Runs a SwiGLU block on `x [m, hidden]` into a new `[m, hidden]` buffer.
pub fn ffn_forward(dtype: Dtype, f: &Ffn, x: &[f32], m: usize, parallel: bool) -> Vec<f32> {
    let mut gu = vec![0f32; m * 2 * f.inter];
    f.gate_up.forward(x, m, &mut gu, parallel);
    let mut act = vec![0f32; m * f.inter];
    swiglu_rows(&gu, f.inter, &mut act);
    dtype.round_activations(&mut act);
    let mut out = vec![0f32; m * f.down.out_features()];
    f.down.forward(&act, m, &mut out, parallel);
    out
}

/// Where captured routes go: `ids[t * stride + offset ..][..top_k]` for token `t`.
pub struct CaptureSlot<'a> {
    /// Token-major capture buffer of the whole batch.
    pub ids: &'a mut [u16],
    /// Running total of wall time spent capturing.
    pub spent: &'a mut std::time::Duration,
    /// Elements per token row (columns × top_k).
    pub stride: usize,
    /// Offset of this layer's column in a row.
    pub offset: usize,
}

/// Rows a task of the router's selection takes at least: a decode step's few rows stay on
/// one thread.
const ROUTER_ROWS_PER_TASK: usize = 64;

/// Runs a MoE block on `h [t, hidden]`; returns `[t, hidden]`.
pub fn moe_forward(
    dtype: Dtype,
    w: &MoeWeights,
    placement: Option<&ExpertPlacement>,
    h: &[f32],
    t: usize,
    capture: Option<CaptureSlot>,
) -> Result<Vec<f32>, RolloutError> {
    let hidden = w.router.in_features();
    let e = w.router.out_features();
    let mut logits = vec![0f32; t * e];
    w.router.forward(h, t, &mut logits, true);
    let router = &w.rule;
    let top_k = router.top_k;
    // Select and weigh with r3-model's router math (the same functions the trainer uses).
    let mut ids32 = vec![0u32; t * top_k];
    let mut gates = vec![0f32; t * top_k];
    // Rows side by side (each row's choice is the same whichever thread makes it).
    ids32
        .par_chunks_mut(top_k.max(1))
        .zip(gates.par_chunks_mut(top_k.max(1)))
        .zip(logits.par_chunks(e.max(1)))
        .enumerate()
        .with_min_len(ROUTER_ROWS_PER_TASK)
        .try_for_each(|(i, ((out, gates), row))| {
            router.select_row(i, row, w.score_bias.as_deref(), out)?;
            router.weigh_row(row, out, gates)
        })?;
    let ids: Vec<u16> = ids32.iter().map(|&v| v as u16).collect();
    if let Some(c) = capture {
        let start = std::time::Instant::now();
        for i in 0..t {
            c.ids[i * c.stride + c.offset..][..top_k]
                .copy_from_slice(&ids[i * top_k..(i + 1) * top_k]);
        }
        *c.spent += start.elapsed();
    }
    // Group (token, gate) by the expert that computes them.
    let n_exec = placement.map_or(w.experts.len(), |p| p.num_slots());
    let mut groups: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n_exec];
    for (j, (&id, &g)) in ids.iter().zip(&gates).enumerate() {
        let tok = j / top_k;
        let exec = match placement {
            // Replicas of a logical expert share weights; spread tokens across them so the
            // executed slot differs from the logical id while the result does not.
            Some(p) => physical_slot(p, id as usize, tok),
            None => id as usize,
        };
        groups[exec].push((tok, g));
    }
    let active: Vec<(usize, &Vec<(usize, f32)>)> = groups
        .iter()
        .enumerate()
        .filter(|(_, g)| !g.is_empty())
        .collect();
    let outputs: Vec<Vec<f32>> = active
        .par_iter()
        .map(|(ex, toks)| {
            let mut x = Vec::with_capacity(toks.len() * hidden);
            for &(tok, _) in toks.iter() {
                x.extend_from_slice(&h[tok * hidden..(tok + 1) * hidden]);
            }
            let logical = placement
                .and_then(|p| p.logical(*ex))
                .map_or(*ex, |l| l as usize);
            ffn_forward(dtype, &w.experts[logical], &x, toks.len(), false)
        })
        .collect();
    let mut out = match &w.shared {
        Some(s) => {
            let mut sh = ffn_forward(dtype, s, h, t, true);
            if let Some(gate) = &w.shared_gate {
                let mut gl = vec![0f32; t];
                gate.forward(h, t, &mut gl, false);
                for (row, gv) in sh.chunks_exact_mut(hidden).zip(&gl) {
                    let s = sigmoid(*gv);
                    row.iter_mut().for_each(|v| *v *= s);
                }
            }
            sh
        }
        None => vec![0f32; t * hidden],
    };
    for ((_, toks), y) in active.iter().zip(&outputs) {
        for (r, &(tok, g)) in toks.iter().enumerate() {
            let dst = &mut out[tok * hidden..(tok + 1) * hidden];
            for (d, v) in dst.iter_mut().zip(&y[r * hidden..(r + 1) * hidden]) {
                *d = g.mul_add(*v, *d);
            }
        }
    }
    dtype.round_activations(&mut out);
    Ok(out)
}

/// A physical slot holding logical expert `logical`, chosen round-robin by token.
fn physical_slot(p: &ExpertPlacement, logical: usize, token: usize) -> usize {
    let slots: Vec<usize> = (0..p.num_slots())
        .filter(|&s| p.logical(s) == Some(logical as u32))
        .collect();
    slots
        .get(token % slots.len().max(1))
        .copied()
        .unwrap_or(logical)
}
