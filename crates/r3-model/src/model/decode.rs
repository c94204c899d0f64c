//! Incremental decoding: the model run one step at a time over a KV cache of device
//! tensors, the rollout engine's device path (any candle device, CUDA included).
//!
//! A step feeds a `[B, T]` block of tokens (a prefill has `T ≥ 1`, a decode step `T = 1`),
//! each sequence at its own positions, and attends over every cached slot under a mask the
//! caller gives (it knows which slots of its padded batch are padding): additive values, or
//! each query row's runs of seen slots, from which the mask is built on the device
//! ([`StepMask`]). The layers are the training forward's own: the same weights, precision
//! rounding points and router; only the RoPE positions and the attention over cached slots
//! differ. A step's MoE layers
//! plan their experts on the host (each layer's chosen ids read back there) or, for a few
//! rows, run them on the device without the host ([`StepRouting`]), the routes then copied
//! once at the step's end.

use candle_core::{DType, Shape, Tensor};

pub use super::step_mask::{SeenSlots, StepMask};
use super::{routed_rows, Attention, Model, MoeRecord};
use crate::error::{ModelError, Result};
use crate::layers::attention::LayerKv;
pub use crate::layers::attention::ScoreTiles;
use crate::layers::moe::{DeviceRoutes, Gates, MoeBlock};

/// Keys and values of every attention layer for a batch of sequences, each `[B, KV, S, D]`
/// on the model's device (`S` = slots fed so far, the same for every sequence). Not `Clone`:
/// its layers write each step's keys in place into room their buffers keep.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    slots: usize,
}

impl KvCache {
    /// Slots fed so far (the keys the next step attends over, before its own).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// A copy in storage of its own: the two caches can then take different steps (a clone
    /// sharing the buffers would write both into the same free slots).
    pub fn try_clone(&self) -> Result<KvCache> {
        Ok(KvCache {
            layers: self
                .layers
                .iter()
                .map(LayerKv::try_clone)
                .collect::<Result<_>>()?,
            slots: self.slots,
        })
    }

    /// Keeps only batch rows `rows`, in that order (finished sequences leave the batch).
    pub fn keep_rows(&mut self, rows: &[u32]) -> Result<()> {
        let Some(device) = self.device() else {
            return Ok(());
        };
        let index = Tensor::from_slice(rows, rows.len(), &device)?;
        for layer in &mut self.layers {
            layer.keep_rows(&index)?;
        }
        Ok(())
    }

    /// Removes batch row `row` by moving the last row into its place, as `Vec::swap_remove`
    /// does (the caller's rows must follow): one row of each layer copied, not the batch.
    pub fn swap_remove_row(&mut self, row: usize) -> Result<()> {
        for layer in &mut self.layers {
            layer.swap_remove_row(row)?;
        }
        Ok(())
    }

    /// Rows the layers' buffers hold, removed rows' places included (see
    /// [`LayerKv::buffer_rows`]).
    pub fn buffer_rows(&self) -> usize {
        self.layers.first().map_or(0, LayerKv::buffer_rows)
    }

    /// Frees every layer's places of removed rows ([`LayerKv::shrink_rows`]).
    pub fn shrink_rows(&mut self) -> Result<()> {
        for layer in &mut self.layers {
            layer.shrink_rows()?;
        }
        Ok(())
    }

    /// Puts `n` empty slots in front of every row (a batch that joins a longer one is
    /// left-padded to its slot count); the caller's masks must hide them.
    pub fn pad_front(&mut self, n: usize) -> Result<()> {
        for layer in &mut self.layers {
            layer.pad_front(n)?;
        }
        self.slots += n;
        Ok(())
    }

    /// Drops the first `n` slots of every row (slots no remaining row can see).
    pub fn drop_front(&mut self, n: usize) -> Result<()> {
        if n > self.slots {
            return Err(ModelError::Input(format!(
                "dropping {n} slots of a KV cache holding {}",
                self.slots
            )));
        }
        for layer in &mut self.layers {
            layer.drop_front(n)?;
        }
        self.slots -= n;
        Ok(())
    }

    /// Appends the rows of `other` after this cache's rows (a prefilled batch joining a
    /// running one); both must hold the same slots and layers.
    pub fn append_rows(&mut self, other: &KvCache) -> Result<()> {
        if other.slots != self.slots || other.layers.len() != self.layers.len() {
            return Err(ModelError::Input(format!(
                "joining a KV cache of {} layers × {} slots to one of {} × {}",
                other.layers.len(),
                other.slots,
                self.layers.len(),
                self.slots
            )));
        }
        for (mine, theirs) in self.layers.iter_mut().zip(&other.layers) {
            mine.append_rows(theirs)?;
        }
        Ok(())
    }

    /// Rows of the batch (0 while empty).
    pub fn rows(&self) -> Result<usize> {
        Ok(self.layers.first().map_or(0, LayerKv::rows))
    }

    /// Slots `start..start + len` of batch row `row`, every layer, copied into storage of
    /// their own (a prefix cache keeps them after the batch is gone).
    pub fn row_slots(&self, row: usize, start: usize, len: usize) -> Result<RowKv> {
        let rows = self.rows()?;
        if len == 0 || start + len > self.slots || row >= rows {
            return Err(ModelError::Input(format!(
                "slots {start}..{} of row {row} asked of a KV cache of {rows} rows × {} slots",
                start + len,
                self.slots
            )));
        }
        if self.device().is_none() {
            return Err(ModelError::Input("slots asked of an empty KV cache".into()));
        }
        let layers = self
            .layers
            .iter()
            .map(|layer| {
                layer.row_slots(row, start, len)?.ok_or_else(|| {
                    ModelError::Input("a layer of the KV cache holds no slots".into())
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RowKv { layers, slots: len })
    }

    /// Reorders the slots of every row: `order` (`[rows · slots]`, row-major) holds, for
    /// row `b` and slot `j`, the slot of row `b` whose keys and values move to `j` (the
    /// device engine closes the gap a cached prefix leaves before its uncached tail).
    pub fn permute_slots(&mut self, order: &[u32]) -> Result<()> {
        let rows = self.rows()?;
        let s = self.slots;
        if order.len() != rows * s {
            return Err(ModelError::Input(format!(
                "a slot order of {} entries for a KV cache of {rows} rows × {s} slots",
                order.len()
            )));
        }
        if let Some(&bad) = order.iter().find(|&&o| o as usize >= s) {
            return Err(ModelError::Input(format!(
                "slot {bad} in a slot order of a KV cache holding {s}"
            )));
        }
        let Some(device) = self.device() else {
            return Ok(());
        };
        let global: Vec<u32> = order
            .iter()
            .enumerate()
            .map(|(i, &o)| ((i / s) * s) as u32 + o)
            .collect();
        let index = Tensor::from_slice(&global, global.len(), &device)?;
        for layer in &mut self.layers {
            layer.permute_slots(&index)?;
        }
        Ok(())
    }

    fn device(&self) -> Option<candle_core::Device> {
        self.layers.iter().find_map(LayerKv::device)
    }
}

/// One sequence's keys and values over a run of slots in every attention layer,
/// `[1, KV, n, D]` tensors on the model's device with storage of their own: what a prefix
/// cache keeps of a sequence and puts back in front of a new one.
#[derive(Debug, Clone)]
pub struct RowKv {
    layers: Vec<(Tensor, Tensor)>,
    slots: usize,
}

impl RowKv {
    /// Slots held.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes of device memory the keys and values take.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }

    /// `parts` one after another along the slots (blocks of a cached prefix joined).
    pub fn concat(parts: &[&RowKv]) -> Result<RowKv> {
        let Some(first) = parts.first() else {
            return Err(ModelError::Input("joining no KV slots".into()));
        };
        if let Some(other) = parts.iter().find(|p| p.layers.len() != first.layers.len()) {
            return Err(ModelError::Input(format!(
                "joining KV slots of {} layers to slots of {}",
                other.layers.len(),
                first.layers.len()
            )));
        }
        if parts.len() == 1 {
            return Ok((*first).clone());
        }
        let layers = (0..first.layers.len())
            .map(|l| {
                let ks: Vec<&Tensor> = parts.iter().map(|p| &p.layers[l].0).collect();
                let vs: Vec<&Tensor> = parts.iter().map(|p| &p.layers[l].1).collect();
                Ok((Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RowKv {
            layers,
            slots: parts.iter().map(|p| p.slots).sum(),
        })
    }
}

/// One step's input, host slices laid out row-major.
#[derive(Debug, Clone, Copy)]
pub struct Step<'a> {
    /// `[batch, time]` token ids (padding slots hold any valid id).
    pub tokens: &'a [u32],
    /// `[batch, time]` RoPE position of each fed slot.
    pub positions: &'a [u32],
    /// Which cached and fed slots each query sees: `[batch, time, slots + time]` additive
    /// values, or each query row's seen slots (the mask then built on the device).
    pub mask: StepMask<'a>,
    /// Sequences.
    pub batch: usize,
    /// Slots fed per sequence.
    pub time: usize,
    /// Return the logits of every fed slot, not only the last (prompt log-probs).
    pub all_logits: bool,
    /// Where the MoE layers choose their experts.
    pub routing: StepRouting,
    /// The most attention scores one layer's product holds at once: the queries are cut
    /// into tiles that fit ([`ScoreTiles::WHOLE`]: one product a layer).
    pub score_tiles: ScoreTiles,
}

/// Where a step's MoE layers choose their experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StepRouting {
    /// Planned on the host (the host waits for the device once a layer): each layer's ids
    /// read back there (chosen where the logits are where the router selects on the device,
    /// else from the logits copied to the host), the experts' GEMMs planned from them; every
    /// router kind, any number of rows, the experts' weights read in place.
    #[default]
    Host,
    /// On the device ([`Model::routes_on_device`] models only): each layer's top-k, gates and
    /// experts without the host, the routes copied once at the end of the step. Each
    /// (row, slot) reads its expert's weights, even where rows share one, so this is for
    /// steps of a few rows.
    Device,
}

/// What one step computed.
#[derive(Debug)]
pub struct StepOutput {
    /// `[batch, rows, vocab]` logits on the device: of every fed slot (`rows = time`) with
    /// `all_logits`, else of each sequence's last fed slot (`rows = 1`).
    pub logits: Tensor,
    /// Per MoE layer (in layer order, the route table's columns): the `[batch · time ·
    /// top_k]` experts the router chose at every fed slot, best first, on the host (routed
    /// on the host they are there already; routed on the device, copied in one go).
    pub routes: Vec<Vec<u32>>,
    /// Wall time the host waited for the device: routed on the host, for each MoE layer's
    /// router logits (on a GPU the work queued before each copy, then the copy); routed on
    /// the device, for the one copy of the step's routes.
    pub device_wait: std::time::Duration,
}

impl Model {
    /// An empty KV cache for this model, its keys and values held in the activations'
    /// dtype.
    pub fn kv_cache(&self) -> KvCache {
        KvCache {
            layers: self.layers.iter().map(|_| LayerKv::default()).collect(),
            slots: 0,
        }
    }

    /// An empty KV cache for this model holding its keys and values in `dtype` (a bf16
    /// forward's are bf16 values: [`crate::Precision::kv_dtype`] holds them exactly).
    pub fn kv_cache_holding(&self, dtype: DType) -> KvCache {
        KvCache {
            layers: self
                .layers
                .iter()
                .map(|_| LayerKv::holding(dtype))
                .collect(),
            slots: 0,
        }
    }

    /// A batch cache whose row `b` holds `rows[b]`'s slots right-aligned to the longest
    /// (zero slots in front, which the caller's masks hide) or, for `None`, zero slots only:
    /// the device engine's prefill batch of requests with and without a cached prefix. The
    /// cache holds `dtype` (the rows' keys and values converted where they hold another).
    pub fn kv_cache_from(&self, rows: &[Option<&RowKv>], dtype: DType) -> Result<KvCache> {
        let slots = rows.iter().flatten().map(|r| r.slots).max().unwrap_or(0);
        let Some(template) = rows.iter().flatten().find(|r| r.slots > 0) else {
            return Ok(self.kv_cache_holding(dtype));
        };
        if let Some(other) = rows
            .iter()
            .flatten()
            .find(|r| r.layers.len() != self.layers.len())
        {
            return Err(ModelError::Input(format!(
                "KV slots of {} layers for a model of {}",
                other.layers.len(),
                self.layers.len()
            )));
        }
        let front = |t: &Tensor, n: usize, have: Option<&Tensor>| -> Result<Tensor> {
            let (_, h, _, d) = t.dims4()?;
            let zeros = Tensor::zeros((1, h, n, d), t.dtype(), t.device())?;
            Ok(match have {
                Some(x) if n == 0 => x.clone(),
                Some(x) => Tensor::cat(&[&zeros, x], 2)?,
                None => zeros,
            })
        };
        let layers = (0..self.layers.len())
            .map(|l| {
                let (tk, tv) = &template.layers[l];
                let mut ks = Vec::with_capacity(rows.len());
                let mut vs = Vec::with_capacity(rows.len());
                for row in rows {
                    let have = row.map(|r| &r.layers[l]);
                    let n = slots - row.map_or(0, |r| r.slots);
                    ks.push(front(tk, n, have.map(|(k, _)| k))?);
                    vs.push(front(tv, n, have.map(|(_, v)| v))?);
                }
                LayerKv::from_parts(
                    Tensor::cat(&ks, 0)?.to_dtype(dtype)?.contiguous()?,
                    Tensor::cat(&vs, 0)?.to_dtype(dtype)?.contiguous()?,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache { layers, slots })
    }

    /// Runs one step (native routing) over `cache`, appending the step's keys and values.
    pub fn forward_step(&self, step: &Step<'_>, cache: &mut KvCache) -> Result<StepOutput> {
        let cfg = &self.cfg;
        let device = self.embed.device();
        // The activations' dtype (a bf16 embedding table gives f32 rows).
        let dtype = crate::layers::embedding_rows::rows_dtype(self.embed.dtype());
        let (b, t) = (step.batch, step.time);
        let s = cache.slots + t;
        if b == 0 || t == 0 {
            return Err(ModelError::Input("a decode step needs tokens".into()));
        }
        if step.tokens.len() != b * t || step.positions.len() != b * t {
            return Err(ModelError::Input(format!(
                "decode step of {b}×{t} over {} cached slots got {} tokens and {} positions",
                cache.slots,
                step.tokens.len(),
                step.positions.len(),
            )));
        }
        if cache.layers.len() != self.layers.len() {
            return Err(ModelError::Input(format!(
                "KV cache of {} layers for a model of {}",
                cache.layers.len(),
                self.layers.len()
            )));
        }
        if let Some((n, &id)) = step
            .tokens
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= cfg.vocab_size)
        {
            return Err(ModelError::Input(format!(
                "token id {id} at slot {n} of the step is outside the vocabulary of {}",
                cfg.vocab_size
            )));
        }
        let rope = self.rope.tables_at(step.positions, b, t, device, dtype)?;
        let mask = step.mask.cache_mask((b, t, s), device, dtype)?;
        let rows = routed_rows(&vec![t; b], t);
        let ids = Tensor::from_slice(step.tokens, b * t, device)?;
        let mut x = self.embed_tokens(
            &ids,
            step.tokens,
            &Shape::from((b, t, self.cfg.hidden_size)),
        )?;
        let on_device =
            match step.routing {
                StepRouting::Host => false,
                StepRouting::Device if self.routes_on_device() => true,
                StepRouting::Device => return Err(ModelError::Input(
                    "a step routed on the device, for a model whose routers choose on the host \
                     (more experts, a larger top-k or expert groups other than the device's \
                     selection takes: Router::selects_on_device)"
                        .into(),
                )),
            };
        let mut moe = MoeRecord::default();
        let mut on_device_layers = Vec::new();
        for (i, (layer, kv)) in self.layers.iter().zip(&mut cache.layers).enumerate() {
            let normed = layer.input_norm.forward(&x)?;
            let attn = match &layer.attention {
                Attention::Gqa(a) => {
                    a.forward_cached(&normed, &rope, kv, &mask, step.score_tiles)?
                }
                Attention::Mla(a) => {
                    a.forward_cached(&normed, &rope, kv, &mask, step.score_tiles)?
                }
            };
            let h = self.precision.add_rounded(&x, &attn)?;
            x = if on_device {
                self.feed_forward_with(layer, h, |block, normed| {
                    let (output, routes) = block.forward_routed_on_device(normed)?;
                    on_device_layers.push((block, routes));
                    Ok(output)
                })?
            } else {
                // A step of the rollout engine: nothing differentiates it, and its gates are
                // weighed on the host from the logits the selection read (one upload a
                // layer).
                self.feed_forward(i, layer, h, &rows, None, Gates::HostWhenUntracked, &mut moe)?
            };
        }
        if on_device {
            let waiting = std::time::Instant::now();
            moe.used = routes_to_host(&on_device_layers)?;
            moe.device_wait += waiting.elapsed();
        }
        cache.slots = s;
        let rows = if step.all_logits {
            x
        } else {
            x.narrow(1, t - 1, 1)?
        };
        let logits = self.lm_head.forward(&self.norm.forward(&rows)?)?;
        Ok(StepOutput {
            logits,
            routes: moe.used,
            device_wait: moe.device_wait,
        })
    }
}

/// The routes of a step's device-routed MoE layers, per layer on the host: one copy of all
/// their records (ids and finiteness flags side by side: the host's one wait of the step),
/// then a check that every layer's router logits were finite (a flag a row; a flagged layer
/// is checked again on the host, whose selection names the row and expert).
fn routes_to_host(layers: &[(&MoeBlock, DeviceRoutes)]) -> Result<Vec<Vec<u32>>> {
    if layers.is_empty() {
        return Ok(Vec::new());
    }
    let records: Vec<&Tensor> = layers.iter().map(|(_, r)| &r.record).collect();
    // One layer's record is a view of its op's output (cat of one is that view) holding more
    // than half its buffer: the vendored candle copies that whole buffer (the gates too).
    let all = Tensor::cat(&records, 0)?.to_vec1::<f32>()?;
    let mut routes = Vec::with_capacity(layers.len());
    let mut at = 0;
    for (block, routed) in layers {
        let (rows, _) = routed.logits.dims2()?;
        let len = routed.record.elem_count();
        let record = all.get(at..at + len).ok_or_else(|| {
            ModelError::Input(format!(
                "routes copied from the device: {} values, a layer's record past them",
                all.len()
            ))
        })?;
        at += len;
        let (ids, flags) = record.split_at(len.saturating_sub(rows));
        if flags.iter().any(|&f| f != 1.0) {
            block.check_logits_on_host(&routed.logits)?;
            return Err(ModelError::Input(
                "the device flagged router logits that the host finds finite".into(),
            ));
        }
        // Expert ids below 2^24 are exact in f32 (`Router::selects_on_device` caps them).
        routes.push(ids.iter().map(|&id| id as u32).collect());
    }
    Ok(routes)
}
