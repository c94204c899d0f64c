//! Grouped-query self-attention (Qwen/Mixtral/OLMoE flavours): `GqaAttention`, and the
//! split of an attention layer that a batch sharing prefixes runs (`SlotRows`,
//! `RowAttention`).

use std::sync::Arc;

use candle_core::Tensor;

use super::attend::{attend, heads_to_tokens};
use super::cache_mask::CacheMask;
use super::kv::LayerKv;
use super::mask::AttentionMask;
use super::recompute::NarrowOperands;
use super::rope::{PositionTables, RopeTables, Rotary};
use super::score_tiles::ScoreTiles;
use super::tiles::attend_cached;
use crate::config::{AttentionConfig, Config, QkNorm};
use crate::error::{ModelError, Result};
use crate::layers::gather_rows::GatherRows;
use crate::layers::linear::Linear;
use crate::layers::norm::RmsNorm;
use crate::layers::recomputed_segment::recomputed_segment;
use crate::precision::{Precision, WeightGradients};
use crate::weights::Weights;

/// Where the computed rows of a batch whose sequences share prefixes lie in its padded
/// `[B, T]` layout: attention gathers its operands into the slots and its output back.
#[derive(Debug, Clone)]
pub struct SlotRows {
    /// `[B·T]` slots ← computed rows (a shared row into every slot that holds it).
    spread: GatherRows,
    /// `[N]` computed rows ← the slot each is computed at.
    take: GatherRows,
    /// `(B, T)`.
    batch: (usize, usize),
}

impl SlotRows {
    /// From each slot's computed row (`row_of_slot`, `B·T` of them), each row's slot
    /// (`slot_of_row`, `rows` of them) and the sequences' `lengths` (`B`: slots past a
    /// sequence's length are padding); an index past its range is an error.
    ///
    /// Padding slots are left out of the spread's backward: a padding query's output is
    /// never taken and a padding key is masked for every query, so their gradients are
    /// zero, and since they all copy one row, summing them made that row's gradient a sum
    /// over every padding slot of the batch (on a GPU, one block's serial loop).
    pub fn new(
        row_of_slot: Vec<u32>,
        slot_of_row: Vec<u32>,
        lengths: &[usize],
        (b, t): (usize, usize),
    ) -> Result<Self> {
        if row_of_slot.len() != b * t || lengths.len() != b {
            return Err(ModelError::Input(format!(
                "shared rows: {} slots and {} lengths for a batch of {b} x {t}",
                row_of_slot.len(),
                lengths.len()
            )));
        }
        let rows = slot_of_row.len();
        let padding = (0..b * t).map(|s| s % t >= lengths[s / t]).collect();
        Ok(SlotRows {
            spread: GatherRows::new(row_of_slot, rows, rows)?.with_unread_outputs(padding)?,
            take: GatherRows::new(slot_of_row, b * t, b * t)?,
            batch: (b, t),
        })
    }

    /// `layer`'s attention over computed rows `x` `[N, H]` of a batch whose sequences share
    /// prefixes: the token-wise projections run once per row, their outputs are gathered
    /// into the padded `[B, T]` layout the rotation, mask and attention read, and each row
    /// takes the attention output of the slot it is computed at → `[N, H]`.
    pub(crate) fn attend(
        &self,
        layer: &impl RowAttention,
        x: &Tensor,
        rope: &RopeTables,
        mask: &AttentionMask,
    ) -> Result<Tensor> {
        let (a, b, c) = layer.project_tokens(x)?;
        let parts = (
            self.spread.apply(&a)?,
            self.spread.apply(&b)?,
            self.spread.apply(&c)?,
        );
        let (q, k, v) = layer.to_heads(parts, self.batch, rope)?;
        let out = layer.attend_heads(&q, &k, &v, mask)?;
        let (bs, t) = self.batch;
        layer.output(&self.take.apply(&out.reshape((bs * t, ()))?)?)
    }
}

/// An attention layer split where a batch sharing prefixes splits it ([`SlotRows::attend`]):
/// the token-wise projections, the heads of the padded layout, attention, and the output
/// projection.
pub(crate) trait RowAttention {
    /// Three token-wise projections of `x` `[.., H]` (whatever the layer's heads are built
    /// from).
    fn project_tokens(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)>;
    /// The projections of a `[B, T]` batch (any shape holding its `B·T` tokens in order) →
    /// rotated queries, keys and values in the layout [`RowAttention::attend_heads`] reads.
    fn to_heads(
        &self,
        parts: (Tensor, Tensor, Tensor),
        batch: (usize, usize),
        rope: &impl Rotary,
    ) -> Result<(Tensor, Tensor, Tensor)>;
    /// Attention of the heads under `mask` → `[B, T, heads · value dim]`.
    fn attend_heads(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &AttentionMask,
    ) -> Result<Tensor>;
    /// The output projection of attention's rows.
    fn output(&self, x: &Tensor) -> Result<Tensor>;

    /// The rotated queries, keys and values of `x` `[B, T, H]`.
    fn project(&self, x: &Tensor, rope: &impl Rotary) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let parts = self.project_tokens(x)?;
        self.to_heads(parts, (b, t), rope)
    }

    /// The layer over a padded batch: `[B, T, H]` → `[B, T, H]`.
    fn attend_padded(&self, x: &Tensor, rope: &RopeTables, mask: &AttentionMask) -> Result<Tensor> {
        let (q, k, v) = self.project(x, rope)?;
        let out = self.attend_heads(&q, &k, &v, mask)?;
        self.output(&out)
    }
}

impl RowAttention for GqaAttention {
    /// The token-wise part of [`RowAttention::project`]: the projections of `x` (`[.., H]`),
    /// normed and then clipped where the architecture says.
    fn project_tokens(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (mut q, mut k, mut v) =
            match Linear::forward_sharing_input(&[&self.q_proj, &self.k_proj, &self.v_proj], x)?
                .as_slice()
            {
                [q, k, v] => (q.clone(), k.clone(), v.clone()),
                _ => {
                    return Err(ModelError::Input(
                        "q, k and v projections gave other than three outputs".into(),
                    ))
                }
            };
        // HF `OlmoeAttention.forward`: q = q_norm(q_proj(x)), k = k_norm(k_proj(x)), then
        // q, k and v clamped — the norm first, so the clamp bounds what attention reads.
        if let (QkNorm::Full, Some(qn), Some(kn)) = (self.qk_norm, &self.q_norm, &self.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        if let Some(c) = self.clip_qkv {
            q = q.clamp(-c, c)?;
            k = k.clamp(-c, c)?;
            v = v.clamp(-c, c)?;
        }
        Ok((q, k, v))
    }

    /// Projected `q`, `k`, `v` of a `[B, T]` batch (any shape holding its `B·T` tokens in
    /// order) → rotated queries `[B, KV, G·T, D]`, rotated keys and values `[B, KV, T, D]`.
    fn to_heads(
        &self,
        (q, k, v): (Tensor, Tensor, Tensor),
        (b, t): (usize, usize),
        rope: &impl Rotary,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (q_norm, k_norm) = match (self.qk_norm, &self.q_norm, &self.k_norm) {
            (QkNorm::PerHead, Some(qn), Some(kn)) => (Some(qn), Some(kn)),
            _ => (None, None),
        };
        let heads = |x: &Tensor, heads: usize, norm: Option<&RmsNorm>| {
            let heads = RotatedHeads {
                dims: (b, t, heads, hd),
                precision: self.precision,
            };
            match self.recompute_heads {
                true => heads.recomputed(x, norm, rope),
                false => heads.chain(x, norm, rope),
            }
        };
        let q = heads(&q, nh, q_norm)?;
        let k = heads(&k, nkv, k_norm)?;
        let v = v.reshape((b, t, nkv, hd))?.transpose(1, 2)?;
        let groups = nh / nkv;
        let q = q.reshape((b, nkv, groups * t, hd))?;
        Ok((q, k, v))
    }

    /// [`attend`] over this layer's rotated heads, its products reading their 16-bit
    /// operands as such where the precision rounds them.
    fn attend_heads(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &AttentionMask,
    ) -> Result<Tensor> {
        let groups = self.num_heads / self.num_kv_heads;
        // At a 16-bit precision q and k are rounded by the rotation, v by its projection
        // (unless clipped after it), and the output's gradient by the output projection's
        // input rounding: their products may read them as 16-bit values.
        let narrow_dtype = self.precision.narrow_dtype();
        let narrow = NarrowOperands {
            queries_keys: narrow_dtype,
            values_grad: narrow_dtype.filter(|_| self.clip_qkv.is_none()),
        };
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        attend(q, k, v, mask, scale, groups, narrow, self.score_tiles)
    }

    fn output(&self, x: &Tensor) -> Result<Tensor> {
        self.o_proj.forward(x)
    }
}

/// A projection's output as rotated heads: `[B, T, heads, D]` (any shape holding `B·T`
/// tokens in order) normed per head where the architecture says, transposed to `[B, heads,
/// T, D]`, rotated, rounded at the layer's precision.
#[derive(Debug, Clone, Copy)]
struct RotatedHeads {
    dims: (usize, usize, usize, usize),
    precision: Precision,
}

impl RotatedHeads {
    /// The heads of `x`, in a differentiated forward as one op that runs the chain again in
    /// its backward ([`recomputed_segment`]): the graph keeps `x` (and the norm's scale)
    /// alone, where the chain kept the normed heads, their transposed copy (on a GPU) and
    /// the unrounded rotation too (≈ 0.2 GB a layer for q and k on the 30B-A3B shape at 8 ×
    /// 512 tokens). The same values and gradients bit for bit, for the chain's forward once
    /// more in the backward.
    fn recomputed(self, x: &Tensor, norm: Option<&RmsNorm>, rope: &impl Rotary) -> Result<Tensor> {
        let tracked = x.track_op() || norm.is_some_and(|n| n.weight().track_op());
        if !tracked {
            return self.chain(x, norm, rope);
        }
        let rope = rope.clone();
        match norm {
            Some(norm) => {
                let (norm, scale) = (norm.clone(), norm.weight().clone());
                recomputed_segment(
                    &[x, &scale],
                    Arc::new(move |t: &[Tensor]| {
                        self.chain(&t[0], Some(&norm.with_weight(t[1].clone())), &rope)
                    }),
                )
            }
            None => recomputed_segment(
                &[x],
                Arc::new(move |t: &[Tensor]| self.chain(&t[0], None, &rope)),
            ),
        }
    }

    /// The ops themselves.
    fn chain(self, x: &Tensor, norm: Option<&RmsNorm>, rope: &impl Rotary) -> Result<Tensor> {
        let mut x = x.reshape(self.dims)?;
        if let Some(norm) = norm {
            x = norm.forward(&x)?;
        }
        rope.rotate_rounded(&x.transpose(1, 2)?, self.precision)
    }
}

/// GQA self-attention with optional qkv bias, q/k norm and qkv clipping.
#[derive(Debug, Clone)]
pub struct GqaAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    qk_norm: QkNorm,
    clip_qkv: Option<f64>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    precision: Precision,
    /// A differentiated forward's q and k from the projections to the rotated heads as one
    /// op each, run again in the backward ([`RotatedHeads`]).
    recompute_heads: bool,
    /// How many scores one product of a differentiated forward's attention may hold.
    score_tiles: ScoreTiles,
}

impl GqaAttention {
    /// Builds layer `prefix` (`model.layers.{i}.self_attn`).
    pub fn new(cfg: &Config, weights: &Weights, prefix: &str) -> Result<Self> {
        let AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            qkv_bias,
            qk_norm,
            clip_qkv,
            ..
        } = &cfg.attention
        else {
            return Err(ModelError::InvalidConfig(
                "GQA attention built for an MLA config".into(),
            ));
        };
        let norm =
            |name: &str| RmsNorm::new(weights, &format!("{prefix}.{name}"), cfg.rms_norm_eps);
        let (q_norm, k_norm) = match qk_norm {
            QkNorm::None => (None, None),
            _ => (Some(norm("q_norm")?), Some(norm("k_norm")?)),
        };
        Ok(GqaAttention {
            q_proj: Linear::new(weights, &format!("{prefix}.q_proj"), *qkv_bias)?,
            k_proj: Linear::new(weights, &format!("{prefix}.k_proj"), *qkv_bias)?,
            v_proj: Linear::new(weights, &format!("{prefix}.v_proj"), *qkv_bias)?,
            o_proj: Linear::new(weights, &format!("{prefix}.o_proj"), false)?,
            q_norm,
            k_norm,
            qk_norm: *qk_norm,
            clip_qkv: *clip_qkv,
            num_heads: cfg.num_attention_heads,
            num_kv_heads: *num_kv_heads,
            head_dim: *head_dim,
            precision: Precision::F32,
            recompute_heads: false,
            score_tiles: ScoreTiles::DEFAULT,
        })
    }

    /// Bounds the scores one product of the attention holds on devices without the CPU's
    /// fused op (its query rows then attended in blocks, forward and backward).
    pub fn set_score_tiles(&mut self, tiles: ScoreTiles) {
        self.score_tiles = tiles;
    }

    /// Runs a differentiated forward's q and k heads (the per-head norm, the rotation and
    /// its rounding) again in the backward, the graph keeping only the projections' outputs
    /// (selective recomputation: the same gradients, less memory, a little more time).
    pub fn set_recompute_heads(&mut self, on: bool) {
        self.recompute_heads = on;
    }

    /// Sets the precision of the projections and q/k norms; bf16 also rounds the rotated q
    /// and k (what a bf16 engine's KV cache holds).
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
        for l in [
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
        ] {
            l.set_precision(precision);
        }
        for n in [&mut self.q_norm, &mut self.k_norm].into_iter().flatten() {
            n.set_precision(precision);
        }
    }

    /// Sets the dtype a 16-bit forward hands the projections' gradients back in.
    pub fn set_weight_gradients(&mut self, grads: WeightGradients) {
        for l in [
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
        ] {
            l.set_weight_gradients(grads);
        }
    }

    /// `[B, T, H]` → `[B, T, H]`.
    pub fn forward(&self, x: &Tensor, rope: &RopeTables, mask: &AttentionMask) -> Result<Tensor> {
        self.attend_padded(x, rope, mask)
    }

    /// One step over a KV cache: `x` `[B, T, H]` at the positions `rope` rotates with,
    /// its keys and values appended to `cache`, the queries attending over every cached
    /// slot under `mask` (the decode kernel, or the query tiles `tiles` allows) → `[B, T,
    /// H]`.
    pub fn forward_cached(
        &self,
        x: &Tensor,
        rope: &PositionTables,
        cache: &mut LayerKv,
        mask: &CacheMask<'_>,
        tiles: ScoreTiles,
    ) -> Result<Tensor> {
        let t = x.dim(1)?;
        let (q, k, v) = self.project(x, rope)?;
        let (k, v) = cache.append(&k, &v)?;
        let hd = self.head_dim;
        let groups = self.num_heads / self.num_kv_heads;
        let scale = 1.0 / (hd as f64).sqrt();
        let out = attend_cached(&q, &k, &v, mask, scale, groups, tiles)?;
        self.o_proj.forward(&heads_to_tokens(&out, t)?)
    }
}
