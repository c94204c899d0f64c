//! Grouped-query self-attention (Qwen/Mixtral/OLMoE flavours) and the masked softmax
//! attention core shared with MLA.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::attention_op::{visible_key_ends, MaskedAttention};
use super::attention_recompute::{attend_recomputed, NarrowOperands};
use super::attention_rows::{attend_rows, rows_packed};
use super::attention_softmax::attention_probs;
use super::gather_rows::GatherRows;
use super::linear::Linear;
use super::norm::RmsNorm;
use super::recomputed_segment::recomputed_segment;
use super::rope::{PositionTables, RopeTables, Rotary};
use crate::config::{AttentionConfig, Config, QkNorm};
use crate::error::{ModelError, Result};
use crate::precision::{Precision, WeightGradients};
use crate::weights::Weights;

/// Mask rows a task of [`AttentionMask::new`] writes at least.
const MASK_ROWS_PER_TASK: usize = 64;

/// Additive causal + key-padding (+ sliding window) mask, `[B, 1, 1, T, T]`.
#[derive(Debug, Clone)]
pub struct AttentionMask {
    additive: Tensor,
    /// The same values on the host, `[B, T, T]`, for the fused CPU attention op.
    pub(crate) host: Arc<Vec<f32>>,
    /// One past each query row's last visible key, `[B, T]` (the op's query blocks).
    pub(crate) key_ends: Arc<Vec<usize>>,
    /// Per sequence, the first query position whose output anyone reads (`[B]`), where a
    /// batch sharing prefixes reads the positions before it from another sequence.
    pub(crate) query_from: Option<Arc<Vec<usize>>>,
}

impl AttentionMask {
    /// Mask for right-padded sequences of the given lengths: a real query `i` sees key `j`
    /// iff `j <= i` and (with a window `w`) `i - j < w`; a padding query sees key 0 only.
    pub fn new(
        lengths: &[usize],
        seq_len: usize,
        window: Option<usize>,
        device: &Device,
    ) -> Result<Self> {
        let mut data = vec![f32::NEG_INFINITY; lengths.len() * seq_len * seq_len];
        // Query rows side by side (a micro-batch's mask is ~1 M values, built while the
        // other threads wait); each row is the same whichever thread writes it.
        data.par_chunks_mut(seq_len.max(1))
            .enumerate()
            .with_min_len(MASK_ROWS_PER_TASK)
            .for_each(|(r, row)| {
                let (b, i) = (r / seq_len, r % seq_len);
                // Padding queries look at the first token only, so that no row is fully
                // masked (a NaN row would poison later layers through 0·NaN).
                let visible = match i >= lengths[b] {
                    true => 0..1,
                    false => window.map_or(0, |w| (i + 1).saturating_sub(w))..i + 1,
                };
                row[visible].fill(0.0);
            });
        let additive = Tensor::from_slice(&data, (lengths.len(), 1, 1, seq_len, seq_len), device)?;
        Ok(AttentionMask {
            additive,
            key_ends: Arc::new(visible_key_ends(&data, seq_len)),
            host: Arc::new(data),
            query_from: None,
        })
    }

    /// This mask, telling attention that sequence `b`'s outputs are read from position
    /// `from[b]` on only (the positions before it shared with another sequence): the CPU
    /// op skips the queries before it (outputs zero, no gradient), the other paths compute
    /// them anyway.
    pub fn reading_queries_from(mut self, from: Vec<usize>) -> Self {
        self.query_from = Some(Arc::new(from));
        self
    }

    /// The additive mask, `[B, 1, 1, T, T]` (0 where visible, −∞ where not).
    pub fn additive(&self) -> &Tensor {
        &self.additive
    }

    /// The same mask in another float dtype.
    pub fn to_dtype(&self, dtype: candle_core::DType) -> Result<Self> {
        Ok(AttentionMask {
            additive: self.additive.to_dtype(dtype)?,
            host: self.host.clone(),
            key_ends: self.key_ends.clone(),
            query_from: self.query_from.clone(),
        })
    }
}

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
    /// From each slot's computed row (`row_of_slot`, `B·T` of them) and each row's slot
    /// (`slot_of_row`, `rows` of them); an index past its range is an error.
    pub fn new(
        row_of_slot: Vec<u32>,
        slot_of_row: Vec<u32>,
        (b, t): (usize, usize),
    ) -> Result<Self> {
        if row_of_slot.len() != b * t {
            return Err(ModelError::Input(format!(
                "shared rows: {} slots for a batch of {b} x {t}",
                row_of_slot.len()
            )));
        }
        let rows = slot_of_row.len();
        Ok(SlotRows {
            spread: GatherRows::new(row_of_slot, rows, rows)?,
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
    /// clipped and normed where the architecture says.
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
        if let Some(c) = self.clip_qkv {
            q = q.clamp(-c, c)?;
            k = k.clamp(-c, c)?;
            v = v.clamp(-c, c)?;
        }
        if let (QkNorm::Full, Some(qn), Some(kn)) = (self.qk_norm, &self.q_norm, &self.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
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
        attend(q, k, v, mask, scale, groups, narrow)
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

/// `softmax(q kᵀ · scale + mask) v` with `q` `[B, KV, G·T, Dq]` (G query heads per
/// key/value head, stacked), `k` `[B, KV, T, Dq]`, `v` `[B, KV, T, Dv]` → `[B, T, KV·G·Dv]`
/// (each position's heads side by side, head `kv·G + g`: what the output projection reads).
/// On CPU in f32/f64 one fused op with its own backward ([`MaskedAttention`], which reads `v`
/// through its strides and writes this layout directly); elsewhere candle's composed ops in
/// an op that recomputes the probabilities in its backward ([`attend_recomputed`]: the graph
/// keeps no score-sized tensor; its products 16-bit GEMMs where `narrow` says the operands
/// hold 16-bit values), then [`heads_to_tokens`].
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    scale: f64,
    groups: usize,
    narrow: NarrowOperands,
) -> Result<Tensor> {
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
        &attend_recomputed(q, k, v, &mask.additive, scale, groups, narrow)?,
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
    heads_to_tokens(&attend_additive(q, k, v, &mask.additive, scale, groups)?, t)
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
    // On a GPU with nothing differentiated, one kernel per step (`attend_rows`) where the
    // composed form launches three.
    if let Some(out) = attend_rows(q, k, v, additive, scale)? {
        return Ok(out);
    }
    // A KV cache's keys and values are views of longer buffers, which the matmuls read as
    // they are; anything else is made contiguous.
    let probs = attention_probs(&q.contiguous()?, &packed(k)?, additive, scale, groups)?;
    Ok(probs.matmul(&packed(v)?)?)
}

/// `t` itself where [`rows_packed`], else a contiguous copy.
fn packed(t: &Tensor) -> Result<Tensor> {
    Ok(if rows_packed(t.layout()) {
        t.clone()
    } else {
        t.contiguous()?
    })
}

/// Slots a [`LayerKv`] buffer holds once it must hold `needed`: room for an eighth more (at
/// least 16 slots), so appending a token copies the cache once every `needed / 8` steps
/// instead of at every step.
pub fn kv_capacity_for(needed: usize) -> usize {
    needed + (needed / 8).max(16)
}

/// One attention layer's keys and values of the positions fed so far, `[B, KV, S, D]`
/// device tensors (a padded batch: every sequence holds `S` slots).
///
/// They live in `[B', KV, capacity, D]` buffers (`B' ≥ B`): rows `0..B` are the batch's,
/// slots `start..start + S` are filled. A step's keys and values are written in place after
/// them and attention reads the filled slots as a view (its matmuls take the buffer's
/// strides); dropping slots from the front moves `start`, and a finished row is replaced by
/// the batch's last row (one row copied, rows `B..B'` left unused). Concatenating, and
/// selecting the kept rows, had copied the whole cache at every step and at every finished
/// row — twice the bytes the attention itself reads, growing with the context. Not `Clone`:
/// two caches sharing a buffer would write over each other's free slots.
#[derive(Debug, Default)]
pub struct LayerKv {
    kv: Option<(Tensor, Tensor)>,
    start: usize,
    len: usize,
    rows: usize,
    /// The buffers are this cache's alone (it made them), so it may write into them; held
    /// tensors a caller handed over may share storage with others (a prefix cache's blocks).
    owned: bool,
}

impl LayerKv {
    /// Appends a step's `[B, KV, T, D]` keys and values; returns all of them (views of the
    /// buffers' filled slots).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        let (t, rows) = (k.dim(2)?, k.dim(0)?);
        if v.dim(2)? != t || v.dim(0)? != rows || (self.kv.is_some() && self.rows != rows) {
            return Err(ModelError::Input(format!(
                "appending keys {:?} and values {:?} to a KV cache of {} rows × {} slots",
                k.dims(),
                v.dims(),
                self.rows,
                self.len
            )));
        }
        let fits = self.owned && self.start + self.len + t <= self.capacity();
        if !fits {
            // Out of room (or empty): new buffers with headroom, the filled slots copied to
            // their front in the same pass (candle's cat reads the strided views as they are).
            let capacity = kv_capacity_for(self.len + t);
            let filled = self.parts();
            let grow = |part: &Tensor, old: Option<&Tensor>| -> Result<Tensor> {
                let (b, h, _, d) = part.dims4()?;
                let room = |slots| Tensor::zeros((b, h, slots, d), part.dtype(), part.device());
                Ok(match old {
                    Some(old) => Tensor::cat(&[old, &room(capacity - self.len)?], 2)?,
                    None => room(capacity)?,
                })
            };
            let (ok, ov) = match &filled {
                Some((a, b)) => (Some(a), Some(b)),
                None => (None, None),
            };
            self.kv = Some((grow(&k, ok)?, grow(&v, ov)?));
            (self.start, self.rows, self.owned) = (0, rows, true);
        }
        let at = self.start + self.len;
        if let Some((kb, vb)) = &self.kv {
            kb.narrow(0, 0, rows)?.slice_set(&k, 2, at)?;
            vb.narrow(0, 0, rows)?.slice_set(&v, 2, at)?;
        }
        self.len += t;
        self.parts()
            .ok_or_else(|| ModelError::Input("a KV cache lost its buffers".into()))
    }

    /// The device of the cached tensors (None while empty).
    pub fn device(&self) -> Option<Device> {
        self.kv.as_ref().map(|(k, _)| k.device().clone())
    }

    /// Slots held (`S`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no slot is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Slots the buffers hold room for (dropped front slots, `S` and the free slots after).
    pub fn capacity(&self) -> usize {
        self.kv
            .as_ref()
            .and_then(|(k, _)| k.dim(2).ok())
            .unwrap_or(0)
    }

    /// Rows of the batch (0 while empty).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Keeps only the batch rows `rows` (a u32 index tensor), in that order.
    pub fn keep_rows(&mut self, rows: &Tensor) -> Result<()> {
        if let Some((k, v)) = self.filled()? {
            self.set_filled(k.index_select(rows, 0)?, v.index_select(rows, 0)?, true)?;
        }
        Ok(())
    }

    /// Makes the buffers this cache's own (a copy of the filled slots where they were handed
    /// over), before it writes into them.
    fn own(&mut self) -> Result<()> {
        if !self.owned {
            if let Some((k, v)) = self.copied()? {
                self.set_filled(k, v, true)?;
            }
        }
        Ok(())
    }

    /// Removes batch row `row` by moving the last row into its place (`Vec::swap_remove`'s
    /// order): one row copied, not the batch.
    pub fn swap_remove_row(&mut self, row: usize) -> Result<()> {
        if self.kv.is_none() {
            // Nothing fed yet: no row to move.
            return Ok(());
        }
        if row >= self.rows {
            return Err(ModelError::Input(format!(
                "removing row {row} of a KV cache of {} rows",
                self.rows
            )));
        }
        let last = self.rows - 1;
        if row < last {
            self.own()?;
        }
        if let (Some((k, v)), true) = (&self.kv, row < last) {
            for buf in [k, v] {
                // The whole row of the buffer (contiguous), copied out first: a buffer
                // cannot be written from its own storage.
                let moved = buf.narrow(0, last, 1)?.copy()?;
                buf.slice_set(&moved, 0, row)?;
            }
        }
        self.rows = last;
        Ok(())
    }

    /// The filled slots of both buffers as contiguous tensors (None while empty); where a
    /// view is contiguous already, the buffer's own storage.
    fn filled(&self) -> Result<Option<(Tensor, Tensor)>> {
        match self.parts() {
            Some((k, v)) => Ok(Some((k.contiguous()?, v.contiguous()?))),
            None => Ok(None),
        }
    }

    /// The filled slots copied into storage of their own, one copy each (None while empty).
    fn copied(&self) -> Result<Option<(Tensor, Tensor)>> {
        let copy = |t: Tensor| {
            if t.is_contiguous() {
                t.copy()
            } else {
                t.contiguous()
            }
        };
        match self.parts() {
            Some((k, v)) => Ok(Some((copy(k)?, copy(v)?))),
            None => Ok(None),
        }
    }

    /// Puts `n` zero slots in front of every row's keys and values (`S` grows by `n`); the
    /// caller's mask must hide them.
    pub fn pad_front(&mut self, n: usize) -> Result<()> {
        let Some((kb, vb)) = self.kv.as_ref().filter(|_| n > 0) else {
            return Ok(());
        };
        if self.start >= n && self.owned {
            // Room in front (slots dropped earlier): zero it and take it back.
            for buf in [kb, vb] {
                let (_, h, _, d) = buf.dims4()?;
                let zeros = Tensor::zeros((self.rows, h, n, d), buf.dtype(), buf.device())?;
                buf.narrow(0, 0, self.rows)?
                    .slice_set(&zeros, 2, self.start - n)?;
            }
            self.start -= n;
            self.len += n;
            return Ok(());
        }
        // The views go into the cat as they are (one copy).
        let Some((k, v)) = self.parts() else {
            return Ok(());
        };
        let pad = |t: &Tensor| -> Result<Tensor> {
            let (b, h, _, d) = t.dims4()?;
            let zeros = Tensor::zeros((b, h, n, d), t.dtype(), t.device())?;
            Ok(Tensor::cat(&[&zeros, t], 2)?)
        };
        self.set_filled(pad(&k)?, pad(&v)?, true)
    }

    /// Drops the first `n` slots of every row (`S` shrinks by `n`; nothing is copied).
    pub fn drop_front(&mut self, n: usize) -> Result<()> {
        if n > self.len {
            return Err(ModelError::Input(format!(
                "dropping {n} slots of a layer's KV cache holding {}",
                self.len
            )));
        }
        self.start += n;
        self.len -= n;
        Ok(())
    }

    /// A copy in storage of its own (the filled slots only).
    pub fn try_clone(&self) -> Result<LayerKv> {
        let mut copy = LayerKv::default();
        if let Some((k, v)) = self.copied()? {
            copy.set_filled(k, v, true)?;
        }
        Ok(copy)
    }

    /// Holds `k` and `v` (`[B, KV, S, D]`, contiguous) as the filled slots, with no room
    /// around them (the next append makes its own); `owned` where they were made here.
    fn set_filled(&mut self, k: Tensor, v: Tensor, owned: bool) -> Result<()> {
        (self.start, self.len, self.rows) = (0, k.dim(2)?, k.dim(0)?);
        (self.kv, self.owned) = (Some((k, v)), owned);
        Ok(())
    }

    /// A layer cache holding `k` and `v` (`[B, KV, S, D]` each, contiguous).
    pub fn from_parts(k: Tensor, v: Tensor) -> Result<Self> {
        let mut layer = LayerKv::default();
        layer.set_filled(k, v, false)?;
        Ok(layer)
    }

    /// The filled slots' keys and values, views of the buffers (None while empty).
    pub fn parts(&self) -> Option<(Tensor, Tensor)> {
        let (k, v) = self.kv.as_ref()?;
        let view = |t: &Tensor| t.narrow(0, 0, self.rows)?.narrow(2, self.start, self.len);
        Some((view(k).ok()?, view(v).ok()?))
    }

    /// Keys and values of batch row `row` at filled slots `index` (a u32 tensor),
    /// `[1, KV, n, D]` each, in storage of their own: an index select always copies, where a
    /// narrow (or a `contiguous` of a narrow that happens to be contiguous) would keep the
    /// whole batch's storage alive.
    pub fn row_slots(&self, row: usize, index: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        let Some((k, v)) = self.parts() else {
            return Ok(None);
        };
        let pick = |t: &Tensor| t.narrow(0, row, 1)?.contiguous()?.index_select(index, 2);
        Ok(Some((pick(&k)?, pick(&v)?)))
    }

    /// Reorders every row's slots: `index` (u32, `[B · S]`) holds, for row `b` and slot `j`,
    /// `b · S + s` where `s` is the slot of row `b` that moves to `j`.
    pub fn permute_slots(&mut self, index: &Tensor) -> Result<()> {
        let Some((k, v)) = self.parts() else {
            return Ok(());
        };
        let permute = |t: &Tensor| -> Result<Tensor> {
            let (b, h, s, d) = t.dims4()?;
            // Slots next to rows, so one index select over `[B · S, KV, D]` moves them all.
            let flat = t.transpose(1, 2)?.contiguous()?.reshape((b * s, h, d))?;
            Ok(flat
                .index_select(index, 0)?
                .reshape((b, s, h, d))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        self.set_filled(permute(&k)?, permute(&v)?, true)
    }

    /// Appends the rows of `other` (the same slots) after this cache's rows.
    pub fn append_rows(&mut self, other: &LayerKv) -> Result<()> {
        match (self.filled()?, other.filled()?) {
            (Some((k, v)), Some((k2, v2))) => self.set_filled(
                Tensor::cat(&[&k, &k2], 0)?,
                Tensor::cat(&[&v, &v2], 0)?,
                true,
            ),
            (_, None) => Ok(()),
            // `other`'s storage, possibly: held as handed over, not written into.
            (None, Some((k2, v2))) => self.set_filled(k2, v2, false),
        }
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
        })
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
    /// slot under `additive` (`[B, 1, 1, T, S]`) → `[B, T, H]`.
    pub fn forward_cached(
        &self,
        x: &Tensor,
        rope: &PositionTables,
        cache: &mut LayerKv,
        additive: &Tensor,
    ) -> Result<Tensor> {
        let t = x.dim(1)?;
        let (q, k, v) = self.project(x, rope)?;
        let (k, v) = cache.append(&k, &v)?;
        let hd = self.head_dim;
        let groups = self.num_heads / self.num_kv_heads;
        let out = attend_additive(&q, &k, &v, additive, 1.0 / (hd as f64).sqrt(), groups)?;
        self.o_proj.forward(&heads_to_tokens(&out, t)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::{DType, Device, Var};

    /// Every mask value is the definition's: a real query `i` sees keys `j ≤ i` within the
    /// window, a padding query key 0 alone (0 where visible, −∞ where not), and the key ends
    /// are one past each row's last visible key; with lengths at, under and (never) past the
    /// padded width, windows of 0, 1, 3 and none, and rows enough for several tasks.
    #[test]
    fn mask_values_follow_the_definition() {
        for (lengths, t) in [
            (vec![5usize, 2, 0], 5usize),
            (vec![70, 131, 1], 131),
            (vec![1], 1),
        ] {
            for window in [None, Some(0), Some(1), Some(3)] {
                let mask = AttentionMask::new(&lengths, t, window, &Device::Cpu).expect("mask");
                for (b, &len) in lengths.iter().enumerate() {
                    for i in 0..t {
                        let row = &mask.host[(b * t + i) * t..][..t];
                        for (j, &m) in row.iter().enumerate() {
                            let visible = if i >= len {
                                j == 0
                            } else {
                                j <= i && window.is_none_or(|w| i - j < w)
                            };
                            let want = if visible { 0.0 } else { f32::NEG_INFINITY };
                            assert_eq!(
                                m, want,
                                "lengths {lengths:?}, window {window:?}, ({b}, {i}, {j})"
                            );
                        }
                        let end = row.iter().rposition(|&m| m == 0.0).map_or(0, |l| l + 1);
                        assert_eq!(mask.key_ends[b * t + i], end, "key end of ({b}, {i})");
                    }
                }
            }
        }
    }

    /// The forward equals the composed ops bit for bit; the gradients of `q`, `k`, `v` equal
    /// the composed ops' backward (f64: 1e-12; f32: 1e-5), with padding, a sliding window and
    /// grouped queries.
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
                let got = attend_recomputed(
                    &q,
                    &k,
                    &v,
                    mask.additive(),
                    scale,
                    groups,
                    NarrowOperands::default(),
                )
                .expect("recomputed");
                assert_eq!(
                    max_abs_diff(&got, &want),
                    0.0,
                    "{dtype:?} {window:?} forward"
                );
                let grads = |y: &Tensor| {
                    let g = (y * &probe)
                        .and_then(|l| l.sum_all())
                        .and_then(|l| l.backward())
                        .expect("backward");
                    [&q, &k, &v].map(|x| g.get(x).expect("grad").clone())
                };
                let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
                for (name, (gw, gg)) in ["q", "k", "v"]
                    .iter()
                    .zip(grads(&want).iter().zip(grads(&got).iter()))
                {
                    let err = max_abs_diff(gw, gg);
                    assert!(err < tol, "{dtype:?} {window:?} d{name}: {err}");
                }
            }
        }
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("values")
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    fn cat2(a: &Tensor, b: &Tensor) -> Tensor {
        Tensor::cat(&[a, b], 2).expect("cat")
    }

    /// A layer's cache read back after every append (a chunk, then one slot at a time past
    /// several regrowths, then a chunk again) equals the concatenation of everything
    /// appended, bit for bit; its buffers regrow only when full (7 times over 107 slots, not
    /// at each of the 97 appends), and the views it returns are strided ones of a longer
    /// buffer, which attention reads in place.
    #[test]
    fn a_layer_cache_reads_back_what_was_appended() {
        let (b, kv, d) = (2, 3, 4);
        let mut cache = LayerKv::default();
        let (mut want_k, mut want_v): (Option<Tensor>, Option<Tensor>) = (None, None);
        let (mut regrowths, mut capacity, mut strided) = (0, 0, 0);
        let sizes = std::iter::once(5)
            .chain(std::iter::repeat_n(1, 95))
            .chain([7]);
        for (i, t) in sizes.enumerate() {
            let k = seeded_tensor(&[b, kv, t, d], 2 * i as u64 + 1, DType::F32);
            let v = seeded_tensor(&[b, kv, t, d + 1], 2 * i as u64 + 2, DType::F32);
            let (got_k, got_v) = cache.append(&k, &v).expect("append");
            let wk = want_k.map_or(k.clone(), |w| cat2(&w, &k));
            let wv = want_v.map_or(v.clone(), |w| cat2(&w, &v));
            assert_eq!(bits(&got_k), bits(&wk), "keys after append {i}");
            assert_eq!(bits(&got_v), bits(&wv), "values after append {i}");
            assert_eq!(cache.len(), wk.dim(2).expect("slots"));
            assert!(cache.capacity() >= cache.len());
            if cache.capacity() != capacity {
                (regrowths, capacity) = (regrowths + 1, cache.capacity());
            }
            strided += usize::from(!got_k.is_contiguous() && rows_packed(got_k.layout()));
            (want_k, want_v) = (Some(wk), Some(wv));
        }
        assert_eq!(cache.len(), 107);
        assert_eq!(regrowths, 7, "the buffers regrew {regrowths} times");
        assert!(
            strided > 90,
            "{strided} of 97 reads were views of a longer buffer"
        );
    }

    /// Attention over a cache's strided view gives the bits attention over its contiguous
    /// copy gives (the matmuls read the buffer in place, with the same arithmetic), under a
    /// mask that hides some slots, with grouped queries.
    #[test]
    fn attention_reads_a_cache_view_as_its_contiguous_copy() {
        let (b, kv, groups, d) = (2, 2, 3, 8);
        let mut cache = LayerKv::default();
        cache
            .append(
                &seeded_tensor(&[b, kv, 9, d], 1, DType::F32),
                &seeded_tensor(&[b, kv, 9, d], 2, DType::F32),
            )
            .expect("prefill");
        for step in 0..3u64 {
            let (k, v) = cache
                .append(
                    &seeded_tensor(&[b, kv, 1, d], 10 + 2 * step, DType::F32),
                    &seeded_tensor(&[b, kv, 1, d], 11 + 2 * step, DType::F32),
                )
                .expect("step");
            assert!(
                !k.is_contiguous() && !v.is_contiguous(),
                "views of a longer buffer"
            );
            let s = k.dim(2).expect("slots");
            let mask: Vec<f32> = (0..b * s)
                .map(|i| if i % 4 == 1 { f32::NEG_INFINITY } else { 0.0 })
                .collect();
            let mask = Tensor::from_vec(mask, (b, 1, 1, 1, s), &Device::Cpu).expect("mask");
            let q = seeded_tensor(&[b, kv, groups, d], 20 + step, DType::F32);
            let scale = 1.0 / (d as f64).sqrt();
            let got = attend_additive(&q, &k, &v, &mask, scale, groups).expect("view");
            let want = attend_additive(
                &q,
                &k.copy().expect("copy"),
                &v.copy().expect("copy"),
                &mask,
                scale,
                groups,
            )
            .expect("copy");
            assert_eq!(bits(&got), bits(&want), "step {step}");
        }
    }

    /// Every reshaping of a cache (rows kept, slots padded in front or dropped, slots
    /// permuted, another cache's rows appended, a copy taken) leaves the views the same
    /// operation gives on the concatenated tensors, and appends after it still read back
    /// right; a copy and its original take different steps without touching each other.
    #[test]
    fn reshaping_a_cache_keeps_its_slots() {
        let (b, kv, d) = (3, 2, 4);
        let grown = |seed: u64| {
            let mut cache = LayerKv::default();
            let mut want = Vec::new();
            for (i, t) in [4usize, 1, 1].into_iter().enumerate() {
                let k = seeded_tensor(&[b, kv, t, d], seed + 2 * i as u64, DType::F32);
                let v = seeded_tensor(&[b, kv, t, d], seed + 2 * i as u64 + 1, DType::F32);
                cache.append(&k, &v).expect("append");
                want.push((k, v));
            }
            let ks: Vec<&Tensor> = want.iter().map(|(k, _)| k).collect();
            let vs: Vec<&Tensor> = want.iter().map(|(_, v)| v).collect();
            let want = (
                Tensor::cat(&ks, 2).expect("k"),
                Tensor::cat(&vs, 2).expect("v"),
            );
            (cache, want)
        };
        let check = |cache: &LayerKv, want: &(Tensor, Tensor), what: &str| {
            let (k, v) = cache.parts().expect("parts");
            assert_eq!(bits(&k), bits(&want.0), "{what}: keys");
            assert_eq!(bits(&v), bits(&want.1), "{what}: values");
            assert_eq!(cache.len(), want.0.dim(2).expect("slots"), "{what}: slots");
        };
        let each =
            |want: &(Tensor, Tensor), f: &dyn Fn(&Tensor) -> Tensor| (f(&want.0), f(&want.1));
        // After the reshaping, one more slot appended to both the cache and the reference.
        let then_append = |mut cache: LayerKv, want: (Tensor, Tensor), what: &str| {
            check(&cache, &want, what);
            let rows = want.0.dim(0).expect("rows");
            let k = seeded_tensor(&[rows, kv, 1, d], 90, DType::F32);
            let v = seeded_tensor(&[rows, kv, 1, d], 91, DType::F32);
            cache.append(&k, &v).expect("append");
            check(
                &cache,
                &(cat2(&want.0, &k), cat2(&want.1, &v)),
                &format!("{what}, then a step"),
            );
        };

        let (mut cache, want) = grown(1);
        let rows = Tensor::new(&[2u32, 0], &Device::Cpu).expect("rows");
        cache.keep_rows(&rows).expect("keep");
        let kept = each(&want, &|t| t.index_select(&rows, 0).expect("select"));
        then_append(cache, kept, "rows kept");

        let (mut cache, want) = grown(2);
        cache.pad_front(3).expect("pad");
        let padded = each(&want, &|t| {
            cat2(
                &Tensor::zeros((b, kv, 3, d), DType::F32, &Device::Cpu).expect("zeros"),
                t,
            )
        });
        then_append(cache, padded, "padded in front");

        let (mut cache, want) = grown(3);
        cache.drop_front(2).expect("drop");
        let dropped = each(&want, &|t| t.narrow(2, 2, 4).expect("narrow"));
        then_append(cache, dropped, "front dropped");
        let (mut cache, _) = grown(3);
        assert!(cache.drop_front(7).is_err(), "more slots dropped than held");

        // A finished row replaced by the last (one row copied), the last row removed, and
        // front slots dropped then taken back as zeros in place.
        let (mut cache, want) = grown(8);
        cache.swap_remove_row(0).expect("swap remove");
        let order = Tensor::new(&[2u32, 1], &Device::Cpu).expect("order");
        let swapped = each(&want, &|t| t.index_select(&order, 0).expect("select"));
        check(&cache, &swapped, "the first row swap-removed");
        cache.swap_remove_row(1).expect("last removed");
        let first = each(&swapped, &|t| t.narrow(0, 0, 1).expect("row"));
        then_append(cache, first, "then the last row removed");
        assert!(
            grown(8).0.swap_remove_row(3).is_err(),
            "a row past the batch"
        );
        let (mut cache, want) = grown(9);
        cache.drop_front(2).expect("drop");
        cache.pad_front(1).expect("pad in place");
        let repadded = each(&want, &|t| {
            let kept = t.narrow(2, 2, 4).expect("narrow");
            cat2(
                &Tensor::zeros((b, kv, 1, d), DType::F32, &Device::Cpu).expect("zeros"),
                &kept,
            )
        });
        then_append(cache, repadded, "front dropped, then padded in place");

        // Buffers handed over (a prefix cache's blocks) are never written into: removing a
        // row and padding after a drop leave the caller's tensors as they were.
        let k0 = seeded_tensor(&[b, kv, 5, d], 60, DType::F32);
        let v0 = seeded_tensor(&[b, kv, 5, d], 61, DType::F32);
        let (k_bits, v_bits) = (bits(&k0), bits(&v0));
        let handed = || LayerKv::from_parts(k0.clone(), v0.clone()).expect("handed over");
        handed().swap_remove_row(0).expect("swap remove");
        let mut cache = handed();
        cache.drop_front(1).expect("drop");
        cache.pad_front(1).expect("pad");
        let mut joined = LayerKv::default();
        joined
            .append_rows(&LayerKv::from_parts(k0.clone(), v0.clone()).expect("other"))
            .expect("join an empty cache");
        joined.swap_remove_row(1).expect("swap remove");
        assert_eq!(
            (bits(&k0), bits(&v0)),
            (k_bits, v_bits),
            "handed-over tensors"
        );

        let (mut cache, want) = grown(4);
        let s = 6;
        let order: Vec<u32> = (0..b * s)
            .map(|i| ((i / s) * s + (s - 1 - i % s)) as u32)
            .collect();
        cache
            .permute_slots(&Tensor::new(order.as_slice(), &Device::Cpu).expect("order"))
            .expect("permute");
        let reversed: Vec<u32> = (0..s as u32).rev().collect();
        let reversed = Tensor::new(reversed.as_slice(), &Device::Cpu).expect("reversed");
        let permuted = each(&want, &|t| t.index_select(&reversed, 2).expect("select"));
        then_append(cache, permuted, "slots permuted");

        let (mut cache, want) = grown(5);
        let (other, theirs) = grown(6);
        cache.append_rows(&other).expect("join");
        let joined = (
            Tensor::cat(&[&want.0, &theirs.0], 0).expect("k"),
            Tensor::cat(&[&want.1, &theirs.1], 0).expect("v"),
        );
        then_append(cache, joined, "rows appended");
        check(&other, &theirs, "the appended cache itself");

        // The original steps first, then the copy: a copy sharing the buffers would write its
        // step into the slot the original's view has just read back.
        let (mut cache, want) = grown(7);
        let copy = cache.try_clone().expect("copy");
        let k = seeded_tensor(&[b, kv, 1, d], 70, DType::F32);
        let v = seeded_tensor(&[b, kv, 1, d], 71, DType::F32);
        cache.append(&k, &v).expect("append");
        let stepped = (cat2(&want.0, &k), cat2(&want.1, &v));
        check(&cache, &stepped, "the original after a step");
        then_append(copy, want, "a copy");
        check(&cache, &stepped, "the original after its copy took a step");
    }
}
