//! Masked attention whose backward recomputes the probabilities (the memory trade of
//! FlashAttention, from candle's ops): the forward is the composed attention's candle ops
//! (`attention::attend_additive`'s, in its order) run outside the graph, and the graph keeps
//! only `q`, `k`, `v`, the mask and the output. The composed form kept five score-sized
//! tensors per layer (`[B, KV, G·T, S]` each: scores, scaled, masked, shifted,
//! exponentiated) until the backward; here one is rebuilt per layer during the backward and
//! freed. Used on devices without the fused CPU op (a GPU).
//!
//! Both passes run in blocks of query rows whose scores [`ScoreTiles`] bounds (whole groups,
//! or runs of one group's positions): a long sequence's `[B, KV, G·T, T]` scores would
//! otherwise be gigabytes per layer, four score-sized tensors at once in the backward. A
//! block's rows compute what the whole product computes for them; the keys' and values'
//! gradients are the blocks' sums.

use candle_core::{CustomOp3, DType, Tensor, D};

use super::narrow_product::matmul_t_of_narrow_values;
use super::score_tiles::{RowBlock, ScoreTiles};
use super::softmax::{probs_of_scores, softmax_grad};
use crate::error::Result;
use crate::layers::precomputed::{precomputed_fwd, Precomputed};

/// The 16-bit float whose values the attention's operands hold where a 16-bit forward
/// rounds them, so that their products may be 16-bit GEMMs on a GPU
/// (`layers/attention/narrow_product.rs`: the same products, exact in f32). None: f32 GEMMs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NarrowOperands {
    /// `q` and `k` (rounded by the rotation): the scores `q kᵀ`, forward and backward.
    pub queries_keys: Option<DType>,
    /// `v` (a rounded projection, not clipped after) and the output's gradient (rounded by
    /// the output projection's input rounding): `dP = dO vᵀ` in the backward.
    pub values_grad: Option<DType>,
}

/// `softmax(q kᵀ · scale + additive) v` with `q` `[B, KV, G·T, Dq]`, `k` `[B, KV, S, Dq]`,
/// `v` `[B, KV, S, Dv]` and `additive` broadcastable to `[B, KV, G, T, S]`, differentiable
/// in `q`, `k` and `v`, keeping only those (and the mask) for its backward; `narrow` says
/// which products read 16-bit values, `tiles` how many scores one product may hold.
#[allow(clippy::too_many_arguments)]
pub fn attend_recomputed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    additive: &Tensor,
    scale: f64,
    groups: usize,
    narrow: NarrowOperands,
    tiles: ScoreTiles,
) -> Result<Tensor> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (b, kv, gt, _) = q.dims4()?;
    let groups = groups.max(1);
    if gt % groups != 0 {
        return Err(crate::error::ModelError::Input(format!(
            "attention: {gt} query rows of a key/value head are not {groups} groups' worth"
        )));
    }
    let mut op = RecomputedAttention {
        value: Precomputed::empty(),
        additive: additive.detach(),
        scale,
        narrow,
        blocks: tiles.row_blocks(b * kv, groups, gt / groups, k.dim(2)?),
    };
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let parts = op
        .blocks
        .iter()
        .map(|block| op.probs(&rows_of(&qd, block)?, &kd, block)?.matmul(&vd))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let value = Tensor::cat(&parts, 2)?;
    if !q.track_op() && !k.track_op() && !v.track_op() {
        // Nothing to differentiate (inference): the value, without the op's copy of it.
        return Ok(value);
    }
    op.value = Precomputed::new(value);
    Ok(q.apply_op3(&k, &v, op)?)
}

/// The op: its value precomputed, its backward from `q`, `k`, `v` and the mask.
#[derive(Debug)]
struct RecomputedAttention {
    value: Precomputed,
    additive: Tensor,
    scale: f64,
    narrow: NarrowOperands,
    /// The query rows' blocks, in row order.
    blocks: Vec<RowBlock>,
}

/// `block`'s rows of `t` `[B, KV, G·T, ·]`, contiguous.
fn rows_of(t: &Tensor, block: &RowBlock) -> candle_core::Result<Tensor> {
    t.narrow(2, block.first, block.rows)?.contiguous()
}

impl RecomputedAttention {
    /// The probabilities `softmax(q kᵀ · scale + mask)` of `block`'s rows `q` `[B, KV, rows,
    /// Dq]`, by the forward's ops.
    fn probs(&self, q: &Tensor, k: &Tensor, block: &RowBlock) -> candle_core::Result<Tensor> {
        let raw = matmul_t_of_narrow_values(q, k, self.narrow.queries_keys)?;
        // The block's positions of a mask with a row per position (one row is every
        // position's).
        let mask = match self.additive.dim(3)? > 1 && block.times < self.additive.dim(3)? {
            true => self.additive.narrow(3, block.first_time, block.times)?,
            false => self.additive.clone(),
        };
        probs_of_scores(raw, &mask, self.scale, block.groups)
    }
}

impl CustomOp3 for RecomputedAttention {
    fn name(&self) -> &'static str {
        "attention-recomputed"
    }

    precomputed_fwd!(3);

    /// With `P` the probabilities and `O = P v`: `dv = Pᵀ dO`, `dP = dO vᵀ`,
    /// `dS = P ⊙ (dP − rowsum(dO ⊙ O))`, `dq = dS k · scale`, `dk = dSᵀ q · scale`
    /// (masked entries have `P = 0`, so no gradient).
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (q, k, v) = (q.detach(), k.detach(), v.detach());
        let (grad, out) = (grad.detach().contiguous()?, out.detach());
        let (mut dq, mut dk, mut dv) = (Vec::with_capacity(self.blocks.len()), None, None);
        // Keys' and values' gradients summed over the blocks in row order, in f32 where the
        // operands are 16-bit (one block: its part as it is).
        let dtype = q.dtype();
        let sum_dtype = match dtype {
            DType::F16 | DType::BF16 if self.blocks.len() > 1 => DType::F32,
            other => other,
        };
        let add = |sum: Option<Tensor>, part: Tensor| match sum {
            Some(sum) => sum + part.to_dtype(sum_dtype)?,
            None => part.to_dtype(sum_dtype),
        };
        for block in &self.blocks {
            let (q_rows, grad) = (rows_of(&q, block)?, rows_of(&grad, block)?);
            let probs = self.probs(&q_rows, &k, block)?;
            dv = Some(add(dv, probs.t()?.matmul(&grad)?)?);
            let dp = matmul_t_of_narrow_values(&grad, &v, self.narrow.values_grad)?;
            let row = (&grad * rows_of(&out, block)?)?.sum_keepdim(D::Minus1)?;
            let ds = match softmax_grad(&probs, &dp, &row)? {
                Some(ds) => ds,
                None => (probs * dp.broadcast_sub(&row)?)?,
            };
            dq.push((ds.matmul(&k)? * self.scale)?);
            dk = Some(add(dk, (ds.t()?.matmul(&q_rows)? * self.scale)?)?);
        }
        let narrow = |sum: Option<Tensor>| sum.map(|t| t.to_dtype(dtype)).transpose();
        Ok((Some(Tensor::cat(&dq, 2)?), narrow(dk)?, narrow(dv)?))
    }
}
