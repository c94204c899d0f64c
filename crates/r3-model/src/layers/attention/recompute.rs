//! Masked attention whose backward recomputes the probabilities (the memory trade of
//! FlashAttention, from candle's ops): the forward is the composed attention's candle ops
//! (`attention::attend_additive`'s, in its order) run outside the graph, and the graph keeps
//! only `q`, `k`, `v`, the mask and the output. The composed form kept five score-sized
//! tensors per layer (`[B, KV, G·T, S]` each: scores, scaled, masked, shifted,
//! exponentiated) until the backward; here one is rebuilt per layer during the backward and
//! freed. Used on devices without the fused CPU op (a GPU).

use candle_core::{CustomOp3, DType, Tensor, D};

use super::narrow_product::matmul_t_of_narrow_values;
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
/// which products read 16-bit values.
pub fn attend_recomputed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    additive: &Tensor,
    scale: f64,
    groups: usize,
    narrow: NarrowOperands,
) -> Result<Tensor> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let mut op = RecomputedAttention {
        value: Precomputed::empty(),
        additive: additive.detach(),
        scale,
        groups,
        narrow,
    };
    let value = op.probs(&q.detach(), &k.detach())?.matmul(&v.detach())?;
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
    groups: usize,
    narrow: NarrowOperands,
}

impl RecomputedAttention {
    /// The probabilities `softmax(q kᵀ · scale + mask)` `[B, KV, G·T, S]`, by the forward's ops.
    fn probs(&self, q: &Tensor, k: &Tensor) -> candle_core::Result<Tensor> {
        let raw = matmul_t_of_narrow_values(q, k, self.narrow.queries_keys)?;
        probs_of_scores(raw, &self.additive, self.scale, self.groups)
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
        let grad = grad.detach().contiguous()?;
        let probs = self.probs(&q, &k)?;
        let dv = probs.t()?.matmul(&grad)?;
        let dp = matmul_t_of_narrow_values(&grad, &v, self.narrow.values_grad)?;
        let row = (&grad * out.detach())?.sum_keepdim(D::Minus1)?;
        let ds = match softmax_grad(&probs, &dp, &row)? {
            Some(ds) => ds,
            None => (probs * dp.broadcast_sub(&row)?)?,
        };
        let dq = (ds.matmul(&k)? * self.scale)?;
        let dk = (ds.t()?.matmul(&q)? * self.scale)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}
