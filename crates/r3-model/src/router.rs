//! The router, one piece of math with two halves:
//! `select(scores) -> ids` and `weigh(logits, ids) -> gates`.
//!
//! Native routing is `weigh(logits, select(logits))`; replay is `weigh(logits, given)`.
//! `select` is defined on the host over plain f32 rows (ids go to the host anyway to build the
//! expert index lists, and the rollout engine calls the same function on its own rows); where
//! [`Router::selects_on_device`], `layers/moe/route_rows.rs` runs the same rule where the
//! logits are (on the CPU this very function, on a GPU kernels of the same arithmetic);
//! `weigh` exists as an autograd-safe tensor function for training and as a plain-slice
//! function for the rollout engine, with one formula per [`RouterKind`].

use candle_core::{Tensor, D};
use rayon::prelude::*;

use crate::config::{MoeConfig, RouterKind};
use crate::error::{ModelError, Result};
use crate::math::sigmoid;

/// The routing rule of one MoE config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Router {
    /// gate formula
    pub kind: RouterKind,
    /// routed experts
    pub num_experts: usize,
    /// experts per token
    pub top_k: usize,
}

/// Indices of the `k` largest values, largest first; ties go to the lower index (the order
/// a stable sort by `total_cmp`, descending, gives). One pass keeping the best `k` in
/// `out` by insertion, no allocation: a token's router row is short and this runs once per
/// token and MoE layer. Requires `k <= values.len()`, `out.len() == k`.
fn top_k_desc(values: &[f32], k: usize, out: &mut [u32]) {
    debug_assert!(k <= values.len() && out.len() == k);
    if k == 0 {
        return;
    }
    // The kept values' keys beside their indices: one integer compare per value, no
    // indirect load of the kept value (through the kept index with `total_cmp`, a 4,096-row
    // layer of 32 experts took 0.76 ms on one core here, 0.6 ms with the keys; a GPU idles
    // meanwhile, so `select_rows` also spreads the rows over the pool).
    let mut on_stack = [0i32; KEPT_ON_STACK];
    let mut on_heap = Vec::new();
    let keys: &mut [i32] = if k <= KEPT_ON_STACK {
        &mut on_stack[..k]
    } else {
        on_heap.resize(k, 0);
        &mut on_heap
    };
    let mut kept = 0usize;
    for (i, &v) in values.iter().enumerate() {
        let key = total_order_key(v);
        // Only a strictly greater value moves ahead, so ties keep the lower index first.
        if kept == k && key <= keys[k - 1] {
            continue;
        }
        let mut pos = kept.min(k - 1);
        while pos > 0 && key > keys[pos - 1] {
            keys[pos] = keys[pos - 1];
            out[pos] = out[pos - 1];
            pos -= 1;
        }
        keys[pos] = key;
        out[pos] = i as u32;
        kept = (kept + 1).min(k);
    }
}

/// Router rows per parallel task of [`Router::select_rows`].
const ROWS_PER_TASK: usize = 256;

/// The most experts per token whose keys [`top_k_desc`] keeps on the stack (more: on the
/// heap, one allocation per row).
const KEPT_ON_STACK: usize = 32;

/// `f32::total_cmp`'s order as an integer: the same bit flip `total_cmp` applies, so
/// `total_order_key(a) > total_order_key(b)` exactly when `a.total_cmp(&b)` is greater.
#[inline(always)]
fn total_order_key(v: f32) -> i32 {
    let bits = v.to_bits() as i32;
    bits ^ (((bits >> 31) as u32) >> 1) as i32
}

/// The most experts the selection on the device
/// ([`crate::layers::moe::route_rows::route_rows`]) ranks: its GPU kernel ranks a row in one
/// thread block, each thread scanning its share of the columns once per chosen expert.
pub const DEVICE_SELECT_MAX_EXPERTS: usize = 4096;

/// The most experts a token chooses that the selection on the device takes: its GPU kernel
/// keeps a row's choice in shared memory (`ROUTE_MAX_TOP_K` in `kernels.cu`).
pub const DEVICE_SELECT_MAX_TOP_K: usize = 64;

/// The most expert groups of a DeepSeek-V3 router that the selection on the device takes:
/// its GPU kernel ranks each group in a thread of its own and keeps the groups' scores in
/// shared memory (`ROUTE_MAX_GROUPS` in `kernels.cu`).
pub const DEVICE_SELECT_MAX_GROUPS: usize = 64;

impl Router {
    /// The router of a MoE config.
    pub fn new(moe: &MoeConfig) -> Self {
        Router {
            kind: moe.router,
            num_experts: moe.num_experts,
            top_k: moe.top_k,
        }
    }

    /// Selects `top_k` experts for one token from its router logits (`bias` = DeepSeek
    /// `e_score_correction_bias`, used only for selection). Writes ids, best first.
    ///
    /// Softmax routers take the top-k logits (softmax is monotone). DeepSeek-V3 ranks
    /// groups by the sum of their two best `sigmoid + bias` scores, keeps `topk_group`
    /// groups, sets the other groups' scores to −∞ and takes the top-k: HF v5's
    /// `masked_fill(~score_mask, -inf)` (transformers PR #45441), SGLang's
    /// `biased_grouped_topk_impl` and Megatron's `group_limited_topk`. A 0.0 fill (HF v4)
    /// would let a dropped group's expert beat kept scores that a negative bias pushed
    /// below 0. The config's `top_k <= topk_group · per-group` keeps every −∞ unchosen; a
    /// [`Router`] built past it takes the dropped experts last, lowest index first.
    pub fn select_row(
        &self,
        row: usize,
        logits: &[f32],
        bias: Option<&[f32]>,
        out: &mut [u32],
    ) -> Result<()> {
        let e = self.num_experts;
        if logits.len() != e || out.len() != self.top_k || bias.is_some_and(|b| b.len() != e) {
            return Err(ModelError::Input(format!(
                "router row {row}: {} logits / {} outputs for {e} experts, top-{}",
                logits.len(),
                out.len(),
                self.top_k
            )));
        }
        if let Some((expert, &value)) = logits.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(ModelError::NonFiniteScore { row, expert, value });
        }
        match self.kind {
            RouterKind::Softmax { .. } => top_k_desc(logits, self.top_k, out),
            RouterKind::GroupedSigmoid {
                n_group,
                topk_group,
                ..
            } => {
                let mut scores: Vec<f32> = logits.iter().map(|&x| sigmoid(x)).collect();
                if let Some(b) = bias {
                    for (s, &b) in scores.iter_mut().zip(b) {
                        *s += b;
                    }
                }
                let per_group = e / n_group;
                let group_scores: Vec<f32> = scores
                    .chunks(per_group)
                    .map(|g| {
                        let mut best = [0u32; 2];
                        top_k_desc(g, 2, &mut best);
                        g[best[0] as usize] + g[best[1] as usize]
                    })
                    .collect();
                let mut kept = vec![0u32; topk_group];
                top_k_desc(&group_scores, topk_group, &mut kept);
                // −∞, not 0.0: a negative bias can put `sigmoid + bias` below 0.
                let mut masked = vec![f32::NEG_INFINITY; e];
                for &g in &kept {
                    let g = g as usize;
                    masked[g * per_group..(g + 1) * per_group]
                        .copy_from_slice(&scores[g * per_group..(g + 1) * per_group]);
                }
                top_k_desc(&masked, self.top_k, out);
            }
        }
        Ok(())
    }

    /// [`Router::select_row`] over a row-major `[rows, num_experts]` buffer; returns
    /// `[rows * top_k]` ids. Rows are selected in parallel (each on its own: the ids do not
    /// depend on the pool); an error names the first bad row.
    pub fn select_rows(&self, logits: &[f32], bias: Option<&[f32]>) -> Result<Vec<u32>> {
        let e = self.num_experts;
        if e == 0 || !logits.len().is_multiple_of(e) {
            return Err(ModelError::Input(format!(
                "router logits length {} is not a multiple of {e} experts",
                logits.len()
            )));
        }
        let rows = logits.len() / e;
        let mut ids = vec![0u32; rows * self.top_k];
        // A GPU waits on this between a layer's router and its experts.
        let checked: Vec<Result<()>> = logits
            .par_chunks(e)
            .zip(ids.par_chunks_mut(self.top_k.max(1)))
            .enumerate()
            .with_min_len(ROWS_PER_TASK)
            .map(|(r, (row, out))| self.select_row(r, row, bias, out))
            .collect();
        checked.into_iter().collect::<Result<()>>()?;
        Ok(ids)
    }

    /// Gate weights for the given ids, differentiable in `logits` (`[rows, E]` f32,
    /// ids `[rows, k]` u32 → `[rows, k]`).
    ///
    /// Softmax: softmax over all experts, gather; where `norm_topk_prob` (HF's renormalised
    /// top-k, Mixtral's always) the softmax of the gathered logits instead, the same value and
    /// gradient. Grouped sigmoid: sigmoid of the gathered logits, normalise (+1e-20) iff
    /// `norm_topk_prob`, times `routed_scaling_factor`. The bias never enters the gates.
    pub fn weigh(&self, logits: &Tensor, ids: &Tensor) -> Result<Tensor> {
        match self.kind {
            // softmax(all)[ids] / Σ softmax(all)[ids] = softmax(logits[ids]) exactly, but a
            // replayed choice need not hold this router's best expert: ids whose logits lie
            // ~104 or more below the row's largest underflow f32's exp to 0, and the
            // renormalisation then gives 0 / 0 = NaN, where the gathered softmax gives the
            // true gates.
            RouterKind::Softmax {
                norm_topk_prob: true,
            } => Ok(candle_nn::ops::softmax(
                &logits.gather(ids, D::Minus1)?,
                D::Minus1,
            )?),
            RouterKind::Softmax {
                norm_topk_prob: false,
            } => {
                let probs = candle_nn::ops::softmax(logits, D::Minus1)?;
                Ok(probs.gather(ids, D::Minus1)?)
            }
            RouterKind::GroupedSigmoid {
                norm_topk_prob,
                routed_scaling_factor,
                ..
            } => {
                let gates = candle_nn::ops::sigmoid(&logits.gather(ids, D::Minus1)?)?;
                let gates = if norm_topk_prob {
                    gates.broadcast_div(&(gates.sum_keepdim(D::Minus1)? + 1e-20)?)?
                } else {
                    gates
                };
                Ok((gates * routed_scaling_factor)?)
            }
        }
    }

    /// Whether the selection on the device
    /// ([`crate::layers::moe::route_rows::route_rows`]) applies: at most
    /// [`DEVICE_SELECT_MAX_EXPERTS`] experts choosing 1 to [`DEVICE_SELECT_MAX_TOP_K`], and for
    /// DeepSeek-V3's grouped sigmoid selection at most [`DEVICE_SELECT_MAX_GROUPS`] groups of
    /// equal size, each of at least two experts (a group's score is its two best), keeping
    /// 1 to all of them.
    pub fn selects_on_device(&self) -> bool {
        let sized = self.num_experts <= DEVICE_SELECT_MAX_EXPERTS
            && (1..=DEVICE_SELECT_MAX_TOP_K.min(self.num_experts)).contains(&self.top_k);
        sized
            && match self.kind {
                RouterKind::Softmax { .. } => true,
                RouterKind::GroupedSigmoid {
                    n_group,
                    topk_group,
                    ..
                } => {
                    (1..=DEVICE_SELECT_MAX_GROUPS).contains(&n_group)
                        && self.num_experts.is_multiple_of(n_group)
                        && self.num_experts / n_group >= 2
                        && (1..=n_group).contains(&topk_group)
                }
            }
    }

    /// Plain-slice form of [`Router::weigh`] for one token: logits `[E]`, ids `[k]` → gates `[k]`.
    pub fn weigh_row(&self, logits: &[f32], ids: &[u32], out: &mut [f32]) -> Result<()> {
        if logits.len() != self.num_experts || out.len() != ids.len() {
            return Err(ModelError::Input(format!(
                "weigh_row: {} logits for {} experts, {} ids, {} outputs",
                logits.len(),
                self.num_experts,
                ids.len(),
                out.len()
            )));
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.num_experts) {
            return Err(ModelError::Input(format!(
                "expert id {bad} out of range for {} experts",
                self.num_experts
            )));
        }
        match self.kind {
            // Renormalised: the softmax of the chosen logits, as in `weigh` (a replayed choice
            // far below the row's best would otherwise give 0 / 0).
            RouterKind::Softmax {
                norm_topk_prob: true,
            } => {
                let chosen = ids.iter().map(|&i| logits[i as usize]);
                let max = chosen.clone().fold(f32::NEG_INFINITY, f32::max);
                for (o, x) in out.iter_mut().zip(chosen) {
                    *o = (x - max).exp();
                }
                let denom: f32 = out.iter().sum();
                out.iter_mut().for_each(|o| *o /= denom);
            }
            RouterKind::Softmax {
                norm_topk_prob: false,
            } => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let denom: f32 = logits.iter().map(|&x| (x - max).exp()).sum();
                for (o, &i) in out.iter_mut().zip(ids) {
                    *o = (logits[i as usize] - max).exp() / denom;
                }
            }
            RouterKind::GroupedSigmoid {
                norm_topk_prob,
                routed_scaling_factor,
                ..
            } => {
                for (o, &i) in out.iter_mut().zip(ids) {
                    *o = sigmoid(logits[i as usize]);
                }
                if norm_topk_prob {
                    let s: f32 = out.iter().sum::<f32>() + 1e-20;
                    out.iter_mut().for_each(|o| *o /= s);
                }
                let scale = routed_scaling_factor as f32;
                out.iter_mut().for_each(|o| *o *= scale);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{top_k_desc, Router};
    use crate::config::RouterKind;
    use crate::error::ModelError;

    /// The reference: a stable descending sort of the indices by `total_cmp`.
    fn sorted_top_k(values: &[f32], k: usize) -> Vec<u32> {
        let mut order: Vec<u32> = (0..values.len() as u32).collect();
        order.sort_by(|&a, &b| values[b as usize].total_cmp(&values[a as usize]));
        order.truncate(k);
        order
    }

    #[test]
    fn selection_equals_the_stable_sort_with_ties_and_signed_zeros() {
        // values from a small set so that ties are common; ±0 and ±inf included
        let pool = [
            0.5f32,
            -1.0,
            0.0,
            -0.0,
            2.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.5,
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..2000 {
            let n = 1 + (next() % 12) as usize;
            let values: Vec<f32> = (0..n).map(|_| pool[(next() % 8) as usize]).collect();
            for k in 0..=n {
                let mut out = vec![u32::MAX; k];
                top_k_desc(&values, k, &mut out);
                assert_eq!(out, sorted_top_k(&values, k), "values {values:?}, k {k}");
            }
        }
        // rows longer than the stack's 32 kept keys, k on both sides of it
        for _ in 0..50 {
            let values: Vec<f32> = (0..100).map(|_| pool[(next() % 8) as usize]).collect();
            for k in [1, 8, 31, 32, 33, 64, 100] {
                let mut out = vec![u32::MAX; k];
                top_k_desc(&values, k, &mut out);
                assert_eq!(out, sorted_top_k(&values, k), "k {k}");
            }
        }
    }

    /// Group-limited routing never leaves the kept groups, even where a negative bias puts
    /// kept scores below 0 (the review's case, worked out by hand): 16 experts in 4 groups,
    /// 2 kept, top-4, every logit 0 (sigmoid 0.5), bias (+.6, −.6, −.6, −.6 | +.6, −.6, −.6,
    /// −.6 | −.9 × 8). Scores: 1.1 for experts 0 and 4, −0.1 for the other six of groups 0
    /// and 1, −0.4 in groups 2 and 3; group scores (two best) 1.0, 1.0, −0.8, −0.8, so groups
    /// 0 and 1 are kept. HF v5 / SGLang / Megatron (−∞ fill) then choose 0 and 4 and the two
    /// lowest of the tied −0.1s, 1 and 2; a 0.0 fill (HF v4) would choose the dropped group
    /// 2's experts 8 and 9 (0 > −0.1) instead.
    #[test]
    fn grouped_selection_stays_inside_the_kept_groups() {
        let router = Router {
            kind: RouterKind::GroupedSigmoid {
                n_group: 4,
                topk_group: 2,
                norm_topk_prob: true,
                routed_scaling_factor: 2.5,
            },
            num_experts: 16,
            top_k: 4,
        };
        let logits = [0.0f32; 16];
        let mut bias = vec![-0.9f32; 16];
        bias[..8].copy_from_slice(&[0.6, -0.6, -0.6, -0.6, 0.6, -0.6, -0.6, -0.6]);
        let mut ids = [u32::MAX; 4];
        router
            .select_row(0, &logits, Some(&bias), &mut ids)
            .expect("select");
        // Best first: the two 1.1s, then the tied −0.1s from the lowest index.
        assert_eq!(ids, [0, 4, 1, 2]);
        // Equal gates over the four (all sigmoid(0)), summing to the scaling factor.
        let mut gates = [0f32; 4];
        router.weigh_row(&logits, &ids, &mut gates).expect("weigh");
        for g in gates {
            assert!((g - 0.625).abs() < 1e-6, "{gates:?}");
        }
    }

    /// The parallel rows select exactly what one row at a time selects; the first bad row is
    /// the one an error names.
    #[test]
    fn rows_in_parallel_equal_one_row_at_a_time() {
        let router = Router {
            kind: RouterKind::Softmax {
                norm_topk_prob: true,
            },
            num_experts: 16,
            top_k: 4,
        };
        let mut state = 7u64;
        let mut logits: Vec<f32> = (0..3000 * 16)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                // a coarse grid: ties are common
                ((state >> 60) as f32) * 0.25 - 2.0
            })
            .collect();
        let ids = router.select_rows(&logits, None).expect("rows");
        for (r, row) in logits.chunks(16).enumerate() {
            let mut one = [0u32; 4];
            router.select_row(r, row, None, &mut one).expect("row");
            assert_eq!(&ids[r * 4..r * 4 + 4], &one, "row {r}");
        }
        logits[2900 * 16 + 3] = f32::NAN;
        logits[1700 * 16 + 5] = f32::INFINITY;
        let err = router.select_rows(&logits, None).expect_err("non-finite");
        assert!(
            matches!(
                err,
                ModelError::NonFiniteScore {
                    row: 1700,
                    expert: 5,
                    ..
                }
            ),
            "{err}"
        );
    }
}
