//! A decoding attention layer's KV cache: keys and values in buffers with room to grow,
//! read by attention as views of their filled slots.

use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};

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
    /// The dtype the buffers hold once made (None: the first append's own). A bf16 engine's
    /// keys and values are bf16 values in f32 activations; held as bf16 they take half the
    /// memory and the attention's reads, the same values.
    dtype: Option<DType>,
}

impl LayerKv {
    /// An empty cache whose buffers will hold `dtype`, whatever the appended keys' and
    /// values' dtype (converted as they are appended: nearest, ties to even).
    pub fn holding(dtype: DType) -> Self {
        LayerKv {
            dtype: Some(dtype),
            ..LayerKv::default()
        }
    }

    /// The dtype the keys and values are held in (the buffers', else the one asked of an
    /// empty cache; None for an empty cache that takes the first append's).
    pub fn dtype(&self) -> Option<DType> {
        match &self.kv {
            Some((k, _)) => Some(k.dtype()),
            None => self.dtype,
        }
    }

    /// Appends a step's `[B, KV, T, D]` keys and values (converted to the cache's dtype);
    /// returns all of them (views of the buffers' filled slots).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let held = self.dtype().unwrap_or(k.dtype());
        let (k, v) = (
            k.to_dtype(held)?.contiguous()?,
            v.to_dtype(held)?.contiguous()?,
        );
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

    /// Rows the buffers hold (at least [`LayerKv::rows`]: a removed row's place stays
    /// allocated until [`LayerKv::shrink_rows`]; 0 while empty).
    pub fn buffer_rows(&self) -> usize {
        self.kv
            .as_ref()
            .and_then(|(k, _)| k.dim(0).ok())
            .unwrap_or(0)
    }

    /// Frees the places of removed rows: new buffers of the batch's rows alone (their slots
    /// and free room copied), where the buffers hold more.
    pub fn shrink_rows(&mut self) -> Result<()> {
        if self.buffer_rows() <= self.rows {
            return Ok(());
        }
        if let Some((k, v)) = &self.kv {
            let keep = |t: &Tensor| t.narrow(0, 0, self.rows)?.force_contiguous();
            self.kv = Some((keep(k)?, keep(v)?));
            self.owned = true;
        }
        Ok(())
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
                // The whole row of the buffer, copied out first (a buffer cannot be written
                // from its own storage): that row alone (`copy` clones the whole storage).
                let moved = buf.narrow(0, last, 1)?.force_contiguous()?;
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

    /// The filled slots copied into storage of their own, one copy each, those slots alone
    /// (None while empty).
    fn copied(&self) -> Result<Option<(Tensor, Tensor)>> {
        match self.parts() {
            Some((k, v)) => Ok(Some((k.force_contiguous()?, v.force_contiguous()?))),
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
        let mut copy = LayerKv {
            dtype: self.dtype,
            ..LayerKv::default()
        };
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

    /// Keys and values of batch row `row` at filled slots `start..start + len`, `[1, KV, len,
    /// D]` each, in storage of their own holding those slots alone: a narrow (or a
    /// `contiguous` of a narrow that happens to be contiguous) would keep the whole batch's
    /// storage alive, and an index select over the row needs the row made contiguous first,
    /// a copy of all its slots for each block a prefix cache takes.
    pub fn row_slots(
        &self,
        row: usize,
        start: usize,
        len: usize,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let Some((k, v)) = self.parts() else {
            return Ok(None);
        };
        let pick = |t: &Tensor| {
            t.narrow(0, row, 1)?
                .narrow(2, start, len)?
                .force_contiguous()
        };
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

    /// Appends the rows of `other` (the same slots) after this cache's rows; refused where
    /// the two hold different dtypes (an empty cache asked to hold one takes `other`'s rows
    /// converted to it).
    pub fn append_rows(&mut self, other: &LayerKv) -> Result<()> {
        if let (Some(mine), Some(theirs)) = (self.dtype(), other.dtype()) {
            if mine != theirs && self.kv.is_some() {
                return Err(ModelError::Input(format!(
                    "joining a KV cache of {theirs:?} keys and values to one of {mine:?}"
                )));
            }
        }
        let held = self.dtype;
        match (self.parts(), other.parts()) {
            // One pass into new buffers: candle's cat reads the filled slots' strided views
            // as they lie (made contiguous first, each cache was copied once more).
            (Some((k, v)), Some((k2, v2))) => self.set_filled(
                Tensor::cat(&[&k, &k2], 0)?,
                Tensor::cat(&[&v, &v2], 0)?,
                true,
            ),
            (_, None) => Ok(()),
            (None, Some((k2, v2))) => match held {
                Some(dtype) if dtype != k2.dtype() => {
                    self.set_filled(k2.to_dtype(dtype)?, v2.to_dtype(dtype)?, true)
                }
                // `other`'s storage, possibly: held as handed over, not written into.
                _ => self.set_filled(k2.contiguous()?, v2.contiguous()?, false),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::attention::attend_additive;
    use crate::layers::attention::rows::rows_packed;
    use crate::test_util::seeded_tensor;
    use candle_core::{DType, Device};

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

    /// A cache holding bf16 converts what is appended (f32 values of bf16 come back exactly,
    /// in half the bytes), keeps its dtype through a copy, takes another cache's rows in its
    /// dtype when empty, and refuses to join rows of another dtype, naming both.
    #[test]
    fn a_cache_holds_the_dtype_it_was_asked_to() {
        let part = |seed| {
            seeded_tensor(&[1, 2, 3, 4], seed, DType::F32)
                .to_dtype(DType::BF16)
                .and_then(|t| t.to_dtype(DType::F32))
                .expect("bf16 values")
        };
        let mut narrow = LayerKv::holding(DType::BF16);
        assert_eq!(narrow.dtype(), Some(DType::BF16));
        let (k, v) = narrow.append(&part(1), &part(2)).expect("append");
        assert_eq!((k.dtype(), v.dtype()), (DType::BF16, DType::BF16));
        let wide = |t: &Tensor| t.to_dtype(DType::F32).expect("wide");
        assert_eq!(bits(&wide(&k)), bits(&part(1)));
        assert_eq!(bits(&wide(&v)), bits(&part(2)));
        assert_eq!(narrow.try_clone().expect("copy").dtype(), Some(DType::BF16));
        assert_eq!(
            LayerKv::holding(DType::F16)
                .try_clone()
                .expect("copy")
                .dtype(),
            Some(DType::F16)
        );
        let mut f32s = LayerKv::default();
        f32s.append(&part(3), &part(4)).expect("f32");
        let mut empty = LayerKv::holding(DType::BF16);
        empty.append_rows(&f32s).expect("converted");
        let (k, _) = empty.parts().expect("rows");
        assert_eq!(k.dtype(), DType::BF16);
        assert_eq!(bits(&wide(&k)), bits(&part(3)));
        let err = narrow.append_rows(&f32s).expect_err("mixed").to_string();
        assert!(err.contains("F32") && err.contains("BF16"), "{err}");
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

    /// A row's slots taken out of the cache are those slots' keys and values, in storage
    /// holding them alone (a prefix cache keeps them after the batch): with one KV head (the
    /// slots a contiguous view of the buffer) and with two, at the buffer's front and past
    /// filled slots with room behind them.
    #[test]
    fn a_rows_slots_come_out_in_storage_of_their_own() {
        for kv in [1, 2] {
            let (b, d) = (3, 4);
            let mut cache = LayerKv::default();
            let k = seeded_tensor(&[b, kv, 9, d], 1, DType::F32);
            let v = seeded_tensor(&[b, kv, 9, d], 2, DType::F32);
            cache.append(&k, &v).expect("append");
            assert!(cache.capacity() > 9, "room behind the filled slots");
            for (row, start, len) in [(1, 0, 4), (2, 5, 4), (0, 3, 1)] {
                let (got_k, got_v) = cache
                    .row_slots(row, start, len)
                    .expect("slots")
                    .expect("some");
                for (got, all) in [(&got_k, &k), (&got_v, &v)] {
                    let want = all.narrow(0, row, 1).and_then(|t| t.narrow(2, start, len));
                    assert_eq!(bits(got), bits(&want.expect("want")), "kv {kv} row {row}");
                    let (storage, layout) = got.storage_and_layout();
                    let candle_core::Storage::Cpu(cpu) = &*storage else {
                        panic!("a CPU tensor");
                    };
                    let held = cpu.as_slice::<f32>().expect("f32").len();
                    assert_eq!(
                        held,
                        kv * len * d,
                        "kv {kv}: the storage holds the slots alone"
                    );
                    assert_eq!(layout.start_offset(), 0);
                }
            }
        }
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
