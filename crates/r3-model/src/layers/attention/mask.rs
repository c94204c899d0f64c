//! The additive attention mask of a right-padded batch: causal, key padding, an optional
//! sliding window, on the device and on the host (the CPU op's query blocks).

use std::sync::Arc;

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::masked_op::visible_key_ends;
use crate::error::Result;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
