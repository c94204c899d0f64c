//! Attention over a KV cache in tiles of queries (their bound: `score_tiles.rs`). A step's
//! scores hold `batch · heads · time · slots` elements: a long prompt's prefill over its
//! own slots, or a large batch decoding at long context, would hold gigabytes in one
//! layer's product and its softmax.
//! Cut into tiles of sequences, then of query positions, each product holds at most what
//! [`ScoreTiles`] allows; every query row's scores, softmax and weighted sum are what the
//! whole product computes for it, so a tile changes which rows one GEMM computes together,
//! not the arithmetic of a row.

use candle_core::Tensor;

use super::attend::attend_additive;
use super::cache_mask::CacheMask;
use super::rows::attend_rows;
use super::score_tiles::ScoreTiles;
use crate::error::Result;

/// A step's attention over a KV cache (`q` `[B, KV, G·T, Dq]` rows ordered group then time,
/// `k` `[B, KV, S, Dq]`, `v` `[B, KV, S, Dv]`) under `mask` → `[B, KV, G·T, Dv]`: on a GPU
/// with the mask given as runs of seen slots, the decode kernel where it takes the step
/// (`rows.rs`: one launch, no mask, no scores); else the composed attention over the
/// additive mask in the tiles `tiles` gives ([`attend_tiled`]).
pub fn attend_cached(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &CacheMask<'_>,
    scale: f64,
    groups: usize,
    tiles: ScoreTiles,
) -> Result<Tensor> {
    if let Some(seen) = mask.seen() {
        if let Some(out) = attend_rows(q, k, v, seen, scale, groups)? {
            return Ok(out);
        }
    }
    attend_tiled(q, k, v, mask.additive()?, scale, groups, tiles)
}

/// [`attend_additive`] (`q` `[B, KV, G·T, Dq]` rows ordered group then time, `k` `[B, KV,
/// S, Dq]`, `v` `[B, KV, S, Dv]`, `additive` `[B, 1, 1, T, S]`) → `[B, KV, G·T, Dv]`, its
/// queries cut into the tiles `tiles` gives and each tile attended on its own.
pub fn attend_tiled(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    additive: &Tensor,
    scale: f64,
    groups: usize,
    tiles: ScoreTiles,
) -> Result<Tensor> {
    let (b, kv, gt, dq) = q.dims4()?;
    let (s, dv) = (k.dim(2)?, v.dim(3)?);
    let groups = groups.max(1);
    let t = gt / groups;
    let tile = tiles.tile(b, kv * groups, t, s);
    // A mask of one row broadcast over the batch is read as it is by every tile.
    let mask_rows = additive.dim(0)?;
    if tile.rows >= b && tile.times >= t {
        return attend_additive(q, k, v, additive, scale, groups);
    }
    let mut outs = Vec::with_capacity(b.div_ceil(tile.rows));
    for b0 in (0..b).step_by(tile.rows) {
        let rows = tile.rows.min(b - b0);
        let (q, k, v) = (
            q.narrow(0, b0, rows)?,
            k.narrow(0, b0, rows)?,
            v.narrow(0, b0, rows)?,
        );
        let mask = match mask_rows == b {
            true => additive.narrow(0, b0, rows)?,
            false => additive.clone(),
        };
        if tile.times >= t {
            outs.push(attend_additive(&q, &k, &v, &mask, scale, groups)?);
            continue;
        }
        // Each tile takes the same positions of every group's queries. A 16-bit cache's keys
        // and values are widened once for all of them (tiles of positions are a long
        // prefill's, which the composed GEMMs run).
        let q = q.contiguous()?.reshape((rows, kv, groups, t, dq))?;
        let (k, v) = match k.dtype() == q.dtype() {
            true => (k, v),
            false => (k.to_dtype(q.dtype())?, v.to_dtype(q.dtype())?),
        };
        let mut parts = Vec::with_capacity(t.div_ceil(tile.times));
        for t0 in (0..t).step_by(tile.times) {
            let times = tile.times.min(t - t0);
            let q =
                q.narrow(3, t0, times)?
                    .contiguous()?
                    .reshape((rows, kv, groups * times, dq))?;
            // A mask of one query row broadcast over the step's is read whole by each tile.
            let mask = match mask.dim(3)? == t {
                true => mask.narrow(3, t0, times)?,
                false => mask.clone(),
            };
            let out = attend_additive(&q, &k, &v, &mask, scale, groups)?;
            parts.push(out.reshape((rows, kv, groups, times, dv))?);
        }
        outs.push(Tensor::cat(&parts, 3)?.reshape((rows, kv, gt, dv))?);
    }
    Ok(Tensor::cat(&outs, 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::attention::AttentionMask;
    use crate::test_util::seeded_tensor;
    use candle_core::{DType, Device};
    use r3_test_support::bits;

    /// Every tiling gives the whole product's output bit for bit on the CPU (grouped
    /// queries, left padding, a prefill over cached slots, a mask broadcast over the queries,
    /// one broadcast over the batch).
    #[test]
    fn tiles_give_the_whole_products_bits() {
        let (b, kv, groups, t, cached, d) = (3, 2, 3, 7, 4, 8);
        let s = cached + t;
        let q = seeded_tensor(&[b, kv, groups * t, d], 1, DType::F32);
        let k = seeded_tensor(&[b, kv, s, d], 2, DType::F32);
        let v = seeded_tensor(&[b, kv, s, d + 2], 3, DType::F32);
        // Causal over the cached slots, each row's first `pad` slots masked out.
        let mut host = Vec::new();
        for pad in [0, 2, 5] {
            for i in 0..t {
                host.extend((0..s).map(|j| match j >= pad && j <= cached + i {
                    true => 0.0,
                    false => f32::NEG_INFINITY,
                }));
            }
        }
        let mask = Tensor::from_vec(host, (b, 1, 1, t, s), &Device::Cpu).expect("mask");
        let want = attend_additive(&q, &k, &v, &mask, 0.3, groups).expect("whole");
        let heads = kv * groups;
        for max in [
            1,
            heads * s * 2,
            heads * s * t,
            heads * s * t * 2 + 5,
            usize::MAX,
        ] {
            let tiles = ScoreTiles::at_most(max);
            let got = attend_tiled(&q, &k, &v, &mask, 0.3, groups, tiles).expect("tiled");
            assert_eq!(got.dims(), want.dims());
            assert_eq!(
                bits(&got),
                bits(&want),
                "at most {max}: {:?}",
                tiles.tile(b, heads, t, s)
            );
        }
        // One mask row for every query of each sequence (its first two slots hidden).
        let row: Vec<f32> = (0..b * s)
            .map(|i| match i % s < 2 {
                true => f32::NEG_INFINITY,
                false => 0.0,
            })
            .collect();
        let row = Tensor::from_vec(row, (b, 1, 1, 1, s), &Device::Cpu).expect("mask row");
        let want = attend_additive(&q, &k, &v, &row, 0.3, groups).expect("whole");
        let got =
            attend_tiled(&q, &k, &v, &row, 0.3, groups, ScoreTiles::at_most(1)).expect("tiled");
        assert_eq!(
            bits(&got),
            bits(&want),
            "a mask row broadcast over the queries"
        );
        // One mask row for every sequence.
        let shared = AttentionMask::new(&[t; 3], t, None, &Device::Cpu).expect("mask");
        let (k, v) = (k.narrow(2, 0, t).expect("k"), v.narrow(2, 0, t).expect("v"));
        let one = shared.additive().narrow(0, 0, 1).expect("one row");
        let want = attend_additive(&q, &k, &v, &one, 0.3, groups).expect("whole");
        let got =
            attend_tiled(&q, &k, &v, &one, 0.3, groups, ScoreTiles::at_most(1)).expect("tiled");
        assert_eq!(bits(&got), bits(&want));
    }
}
