//! Grouped-query self-attention (Qwen/Mixtral/OLMoE flavours) and the masked softmax
//! attention core shared with MLA.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::attention_op::{visible_key_ends, MaskedAttention};
use super::attention_recompute::attend_recomputed;
use super::attention_softmax::attention_probs;
use super::linear::Linear;
use super::norm::RmsNorm;
use super::rope::{PositionTables, RopeTables, Rotary};
use crate::config::{AttentionConfig, Config, QkNorm};
use crate::error::{ModelError, Result};
use crate::precision::Precision;
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
        })
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
        })
    }
}

/// `softmax(q kᵀ · scale + mask) v` with `q` `[B, KV, G·T, Dq]` (G query heads per
/// key/value head, stacked), `k` `[B, KV, T, Dq]`, `v` `[B, KV, T, Dv]` → `[B, T, KV·G·Dv]`
/// (each position's heads side by side, head `kv·G + g`: what the output projection reads).
/// On CPU in f32/f64 one fused op with its own backward ([`MaskedAttention`], which reads `v`
/// through its strides and writes this layout directly); elsewhere candle's composed ops in
/// an op that recomputes the probabilities in its backward ([`attend_recomputed`]: the graph
/// keeps no score-sized tensor), then [`heads_to_tokens`].
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    scale: f64,
    groups: usize,
) -> Result<Tensor> {
    if q.device().is_cpu() && matches!(q.dtype(), DType::F32 | DType::F64) {
        let op = MaskedAttention::new(mask.host.clone(), mask.key_ends.clone(), scale, groups);
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
        &attend_recomputed(q, k, v, &mask.additive, scale, groups)?,
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
    let probs = attention_probs(&q.contiguous()?, &k.contiguous()?, additive, scale, groups)?;
    Ok(probs.matmul(&v.contiguous()?)?)
}

/// One attention layer's keys and values of the positions fed so far, `[B, KV, S, D]`
/// device tensors (a padded batch: every sequence holds `S` slots).
#[derive(Debug, Clone, Default)]
pub struct LayerKv {
    kv: Option<(Tensor, Tensor)>,
}

impl LayerKv {
    /// Appends a step's `[B, KV, T, D]` keys and values; returns all of them.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        // Contiguous parts keep the cache contiguous (candle concatenates strided tensors
        // into a strided result, which `keep_rows`' index select refuses).
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        let (k, v) = match self.kv.take() {
            None => (k, v),
            Some((k0, v0)) => (Tensor::cat(&[&k0, &k], 2)?, Tensor::cat(&[&v0, &v], 2)?),
        };
        self.kv = Some((k.clone(), v.clone()));
        Ok((k, v))
    }

    /// The device of the cached tensors (None while empty).
    pub fn device(&self) -> Option<Device> {
        self.kv.as_ref().map(|(k, _)| k.device().clone())
    }

    /// Keeps only the batch rows `rows` (a u32 index tensor), in that order.
    pub fn keep_rows(&mut self, rows: &Tensor) -> Result<()> {
        if let Some((k, v)) = self.kv.take() {
            self.kv = Some((k.index_select(rows, 0)?, v.index_select(rows, 0)?));
        }
        Ok(())
    }

    /// Puts `n` zero slots in front of every row's keys and values (`S` grows by `n`); the
    /// caller's mask must hide them.
    pub fn pad_front(&mut self, n: usize) -> Result<()> {
        let Some((k, v)) = self.kv.as_mut().filter(|_| n > 0) else {
            return Ok(());
        };
        for t in [k, v] {
            let (b, h, _, d) = t.dims4()?;
            let zeros = Tensor::zeros((b, h, n, d), t.dtype(), t.device())?;
            *t = Tensor::cat(&[&zeros, &*t], 2)?;
        }
        Ok(())
    }

    /// Drops the first `n` slots of every row (`S` shrinks by `n`).
    pub fn drop_front(&mut self, n: usize) -> Result<()> {
        let Some((k, v)) = self.kv.as_mut().filter(|_| n > 0) else {
            return Ok(());
        };
        for t in [k, v] {
            let s = t.dim(2)?;
            *t = t.narrow(2, n, s - n)?.contiguous()?;
        }
        Ok(())
    }

    /// A layer cache holding `k` and `v` (`[B, KV, S, D]` each, contiguous).
    pub fn from_parts(k: Tensor, v: Tensor) -> Self {
        LayerKv { kv: Some((k, v)) }
    }

    /// The cached keys and values (None while empty).
    pub fn parts(&self) -> Option<(&Tensor, &Tensor)> {
        self.kv.as_ref().map(|(k, v)| (k, v))
    }

    /// Keys and values of batch row `row` at slots `index` (a u32 tensor), `[1, KV, n, D]`
    /// each, in storage of their own: an index select always copies, where a narrow (or a
    /// `contiguous` of a narrow that happens to be contiguous) would keep the whole batch's
    /// storage alive.
    pub fn row_slots(&self, row: usize, index: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        let Some((k, v)) = &self.kv else {
            return Ok(None);
        };
        let pick = |t: &Tensor| t.narrow(0, row, 1)?.contiguous()?.index_select(index, 2);
        Ok(Some((pick(k)?, pick(v)?)))
    }

    /// Reorders every row's slots: `index` (u32, `[B · S]`) holds, for row `b` and slot `j`,
    /// `b · S + s` where `s` is the slot of row `b` that moves to `j`.
    pub fn permute_slots(&mut self, index: &Tensor) -> Result<()> {
        let Some((k, v)) = self.kv.as_mut() else {
            return Ok(());
        };
        for t in [k, v] {
            let (b, h, s, d) = t.dims4()?;
            // Slots next to rows, so one index select over `[B · S, KV, D]` moves them all.
            let flat = t.transpose(1, 2)?.contiguous()?.reshape((b * s, h, d))?;
            *t = flat
                .index_select(index, 0)?
                .reshape((b, s, h, d))?
                .transpose(1, 2)?
                .contiguous()?;
        }
        Ok(())
    }

    /// Appends the rows of `other` (the same slots) after this cache's rows.
    pub fn append_rows(&mut self, other: &LayerKv) -> Result<()> {
        self.kv = match (self.kv.take(), &other.kv) {
            (Some((k, v)), Some((k2, v2))) => {
                Some((Tensor::cat(&[&k, k2], 0)?, Tensor::cat(&[&v, v2], 0)?))
            }
            (mine, None) => mine,
            (None, Some(theirs)) => Some(theirs.clone()),
        };
        Ok(())
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
        })
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

    /// `[B, T, H]` → `[B, T, H]`.
    pub fn forward(&self, x: &Tensor, rope: &RopeTables, mask: &AttentionMask) -> Result<Tensor> {
        let (q, k, v) = self.project(x, rope)?;
        let hd = self.head_dim;
        let groups = self.num_heads / self.num_kv_heads;
        let out = attend(&q, &k, &v, mask, 1.0 / (hd as f64).sqrt(), groups)?;
        self.o_proj.forward(&out)
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

    /// Rotated queries `[B, KV, G·T, D]` (G query heads per key/value head, stacked),
    /// rotated keys and values `[B, KV, T, D]` of `x` `[B, T, H]`.
    fn project(&self, x: &Tensor, rope: &impl Rotary) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let mut q = self.q_proj.forward(x)?;
        let mut k = self.k_proj.forward(x)?;
        let mut v = self.v_proj.forward(x)?;
        if let Some(c) = self.clip_qkv {
            q = q.clamp(-c, c)?;
            k = k.clamp(-c, c)?;
            v = v.clamp(-c, c)?;
        }
        if let (QkNorm::Full, Some(qn), Some(kn)) = (self.qk_norm, &self.q_norm, &self.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let mut q = q.reshape((b, t, nh, hd))?;
        let mut k = k.reshape((b, t, nkv, hd))?;
        if let (QkNorm::PerHead, Some(qn), Some(kn)) = (self.qk_norm, &self.q_norm, &self.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let q = self.precision.round(&rope.rotate(&q.transpose(1, 2)?)?)?;
        let k = self.precision.round(&rope.rotate(&k.transpose(1, 2)?)?)?;
        let v = v.reshape((b, t, nkv, hd))?.transpose(1, 2)?;
        let groups = nh / nkv;
        let q = q.reshape((b, nkv, groups * t, hd))?;
        Ok((q, k, v))
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
                let got = attend_recomputed(&q, &k, &v, mask.additive(), scale, groups)
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
}
