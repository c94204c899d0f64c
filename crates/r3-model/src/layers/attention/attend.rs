//! The masked softmax attention core shared by GQA and MLA: `softmax(q kᵀ · scale + mask) v`
//! over grouped query heads, through the CPU's fused op or composed ops elsewhere.

use candle_core::{DType, Tensor};

use super::mask::AttentionMask;
use super::masked_op::MaskedAttention;
use super::recompute::{attend_recomputed, NarrowOperands};
use super::rows::rows_packed;
use super::score_tiles::ScoreTiles;
use super::softmax::attention_probs;
use crate::error::{ModelError, Result};

/// `softmax(q kᵀ · scale + mask) v` with `q` `[B, KV, G·T, Dq]` (G query heads per
/// key/value head, stacked), `k` `[B, KV, T, Dq]`, `v` `[B, KV, T, Dv]` → `[B, T, KV·G·Dv]`
/// (each position's heads side by side, head `kv·G + g`: what the output projection reads).
/// On CPU in f32/f64 one fused op with its own backward ([`MaskedAttention`], which reads `v`
/// through its strides and writes this layout directly); elsewhere candle's composed ops in
/// an op that recomputes the probabilities in its backward ([`attend_recomputed`]: the graph
/// keeps no score-sized tensor; its products 16-bit GEMMs where `narrow` says the operands
/// hold 16-bit values; both passes in blocks of query rows whose scores `tiles` bounds),
/// then [`heads_to_tokens`].
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    scale: f64,
    groups: usize,
    narrow: NarrowOperands,
    tiles: ScoreTiles,
) -> Result<Tensor> {
    // Other devices add the mask to the scores as an operand of `q`'s dtype; the CPU's op
    // reads its f32 host copy and would pass anything. Refused everywhere alike.
    if mask.additive().dtype() != q.dtype() {
        return Err(ModelError::Input(format!(
            "attention: a {:?} mask for {:?} queries (build it in the activations' dtype)",
            mask.additive().dtype(),
            q.dtype()
        )));
    }
    if q.device().is_cpu() && matches!(q.dtype(), DType::F32 | DType::F64) {
        let op = MaskedAttention::new(mask.host.clone(), mask.key_ends.clone(), scale, groups)
            .reading_queries_from(mask.query_from.clone());
        // The op reads rows of contiguous values through any other strides.
        let v = if v.stride().last() == Some(&1) {
            v.clone()
        } else {
            v.contiguous()?
        };
        return Ok(q.contiguous()?.apply_op3(&k.contiguous()?, &v, op)?);
    }
    let t = k.dim(2)?;
    heads_to_tokens(
        &attend_recomputed(q, k, v, mask.additive(), scale, groups, narrow, tiles)?,
        t,
    )
}

/// [`attend`] from candle's composed ops (other devices and dtypes, and the reference the
/// fused op is tested against).
pub fn attend_composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    scale: f64,
    groups: usize,
) -> Result<Tensor> {
    let t = k.dim(2)?;
    heads_to_tokens(
        &attend_additive(q, k, v, mask.additive(), scale, groups)?,
        t,
    )
}

/// An attention output `[B, KV, G·T, D]` (query heads stacked per key/value head) as
/// `[B, T, KV·G·D]`, each position's heads side by side (head `kv·G + g`).
pub fn heads_to_tokens(out: &Tensor, t: usize) -> Result<Tensor> {
    let (b, kv, rows, d) = out.dims4()?;
    let heads = kv * (rows / t.max(1));
    Ok(out
        .reshape((b, heads, t, d))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((b, t, heads * d))?)
}

/// [`attend_composed`] with `S` keys (`k` `[B, KV, S, Dq]`, `v` `[B, KV, S, Dv]`, a step
/// over a KV cache has `S ≥ T`) and an additive mask broadcastable to `[B, 1, 1, T, S]`.
pub fn attend_additive(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    additive: &Tensor,
    scale: f64,
    groups: usize,
) -> Result<Tensor> {
    // A KV cache's keys and values are views of longer buffers, which the matmuls read as
    // they are; anything else is made contiguous, and a 16-bit cache's widened to the
    // queries' dtype (exactly: its values are the activations' own, rounded where they were
    // made).
    let (k, v) = (packed(k, q.dtype())?, packed(v, q.dtype())?);
    let probs = attention_probs(&q.contiguous()?, &k, additive, scale, groups)?;
    Ok(probs.matmul(&v)?)
}

/// `t` itself where [`rows_packed`] in `dtype`, else a contiguous copy in `dtype`.
fn packed(t: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(if t.dtype() != dtype {
        t.to_dtype(dtype)?.contiguous()?
    } else if rows_packed(t.layout()) {
        t.clone()
    } else {
        t.contiguous()?
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::{Device, Var};

    /// Query rows that are not a whole number of groups are refused, naming the counts.
    #[test]
    fn query_rows_of_a_partial_group_are_refused() {
        let q = seeded_tensor(&[1, 1, 7, 4], 1, DType::F32);
        let k = seeded_tensor(&[1, 1, 3, 4], 2, DType::F32);
        let mask = Tensor::zeros((1, 1, 1, 3, 3), DType::F32, &Device::Cpu).expect("mask");
        let err = attend_recomputed(
            &q,
            &k,
            &k,
            &mask,
            0.5,
            2,
            NarrowOperands::default(),
            ScoreTiles::DEFAULT,
        )
        .expect_err("7 rows, 2 groups")
        .to_string();
        assert!(
            err.contains("7 query rows") && err.contains("2 groups"),
            "{err}"
        );
    }

    /// The forward equals the composed ops bit for bit; the gradients of `q`, `k`, `v` equal
    /// the composed ops' backward (f64: 1e-12; f32: 1e-5), with padding, a sliding window and
    /// grouped queries; whole, and in blocks of two groups, of two positions and of one row.
    #[test]
    fn equals_the_composed_ops_forward_and_backward() {
        let (b, kv, groups, t, d) = (2, 2, 3, 7, 5);
        let lengths = [7, 4];
        for dtype in [DType::F64, DType::F32] {
            for window in [None, Some(3)] {
                let mask = AttentionMask::new(&lengths, t, window, &Device::Cpu)
                    .and_then(|m| m.to_dtype(dtype))
                    .expect("mask");
                let q =
                    Var::from_tensor(&seeded_tensor(&[b, kv, groups * t, d], 1, dtype)).expect("q");
                let k = Var::from_tensor(&seeded_tensor(&[b, kv, t, d], 2, dtype)).expect("k");
                let v = Var::from_tensor(&seeded_tensor(&[b, kv, t, d + 1], 3, dtype)).expect("v");
                let probe = seeded_tensor(&[b, kv, groups * t, d + 1], 4, dtype);
                let scale = 1.0 / (d as f64).sqrt();
                let want =
                    attend_additive(&q, &k, &v, mask.additive(), scale, groups).expect("composed");
                let grads = |y: &Tensor| {
                    let g = (y * &probe)
                        .and_then(|l| l.sum_all())
                        .and_then(|l| l.backward())
                        .expect("backward");
                    [&q, &k, &v].map(|x| g.get(x).expect("grad").clone())
                };
                let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
                let want_grads = grads(&want);
                // Whole, two groups a block, two positions a block, one row a block.
                let row = b * kv * t;
                for max in [usize::MAX, 2 * t * row, 2 * row, 1] {
                    let tiles = ScoreTiles::at_most(max);
                    let got = attend_recomputed(
                        &q,
                        &k,
                        &v,
                        mask.additive(),
                        scale,
                        groups,
                        NarrowOperands::default(),
                        tiles,
                    )
                    .expect("recomputed");
                    assert_eq!(
                        max_abs_diff(&got, &want),
                        0.0,
                        "{dtype:?} {window:?} at most {max}: forward"
                    );
                    for (name, (gw, gg)) in ["q", "k", "v"]
                        .iter()
                        .zip(want_grads.iter().zip(grads(&got).iter()))
                    {
                        let err = max_abs_diff(gw, gg);
                        assert!(
                            err < tol,
                            "{dtype:?} {window:?} at most {max}: d{name}: {err}"
                        );
                    }
                }
            }
        }
    }
}
