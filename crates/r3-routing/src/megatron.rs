//! Megatron-Core's split of a model and of a batch across ranks, as plain arithmetic, so that
//! a training engine built on Megatron can be handed exactly the routes its local routers
//! replay. [`PipelineSplit`] gives the transformer layers a pipeline stage (and virtual stage)
//! builds — the numbers of Megatron's `get_num_layers_to_build` and
//! `get_transformer_layer_offset`, from the even / uneven split or from a custom
//! [`PipelineLayout`] (`pipeline_model_parallel_layout`); [`rank_tokens`] gives the tokens of
//! a batch one sequence-parallel × context-parallel rank's routers see, in the order they see
//! them (Megatron's zigzag context-parallel split, or slime's contiguous one, then the
//! sequence-parallel split of the first dimension); [`replay_ids`] gathers a rank's replay ids
//! from route tables.
//! Megatron's `RouterReplay` itself does none of this slicing: the caller must.

use std::ops::Range;

use crate::{DecodeLimits, RouteError, RouteTable};

/// The most tokens one micro-batch may hold once padded (67,108,864): far above any real
/// micro-batch, low enough that a mistyped length is refused before its token list is
/// built.
pub const MAX_BATCH_TOKENS: usize = 1 << 26;

/// How Megatron divides `num_layers` transformer layers over `pp_size` pipeline stages and,
/// optionally, `vp_size` virtual stages (model chunks) per stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineSplit {
    /// Transformer layers of the model (`TransformerConfig.num_layers`).
    pub num_layers: usize,
    /// Pipeline stages (`pipeline_model_parallel_size`).
    pub pp_size: usize,
    /// Model chunks per stage (`virtual_pipeline_model_parallel_size`), if interleaved.
    pub vp_size: Option<usize>,
    /// `num_layers_in_first_pipeline_stage` (uneven pipeline).
    pub first_stage_layers: Option<usize>,
    /// `num_layers_in_last_pipeline_stage` (uneven pipeline).
    pub last_stage_layers: Option<usize>,
    /// `account_for_embedding_in_pipeline_split`: the embedding counts as one layer.
    pub account_for_embedding: bool,
    /// `account_for_loss_in_pipeline_split`: the loss counts as one layer.
    pub account_for_loss: bool,
    /// `pipeline_model_parallel_layout`: a custom layout of the layers over the pipeline and
    /// virtual stages, which then decides the split alone (Megatron refuses it together with
    /// the uneven-stage and embedding / loss fields, and so does r3).
    pub layout: Option<PipelineLayout>,
}

/// One entry of Megatron's `pipeline_model_parallel_layout` (its `LayerType`s; the encoder
/// type, which Megatron's flexible layout does not implement, is refused when parsed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayoutLayer {
    /// `E` / `embedding`.
    Embedding,
    /// `t` / `decoder`: a transformer layer (the only kind that builds a router).
    Decoder,
    /// `m` / `mtp`: a multi-token-prediction layer.
    Mtp,
    /// `L` / `loss`.
    Loss,
}

impl LayoutLayer {
    /// Megatron's `LayerType` member name.
    pub fn name(self) -> &'static str {
        match self {
            LayoutLayer::Embedding => "embedding",
            LayoutLayer::Decoder => "decoder",
            LayoutLayer::Mtp => "mtp",
            LayoutLayer::Loss => "loss",
        }
    }

    /// A `LayerType` member name as Megatron's list form takes it (stripped, any case).
    pub fn from_name(name: &str) -> Result<Self, RouteError> {
        match name.trim().to_lowercase().as_str() {
            "embedding" => Ok(LayoutLayer::Embedding),
            "decoder" => Ok(LayoutLayer::Decoder),
            "mtp" => Ok(LayoutLayer::Mtp),
            "loss" => Ok(LayoutLayer::Loss),
            "encoder" => Err(arg(
                "encoder layers are not supported by Megatron's flexible pipeline layout (it \
                 raises NotImplementedError)"
                    .to_string(),
            )),
            _ => Err(arg(format!(
                "{name:?} is not a layer type (embedding, decoder, mtp, loss)"
            ))),
        }
    }

    fn from_char(c: char) -> Option<Self> {
        match c {
            'E' => Some(LayoutLayer::Embedding),
            't' => Some(LayoutLayer::Decoder),
            'm' => Some(LayoutLayer::Mtp),
            'L' => Some(LayoutLayer::Loss),
            _ => None,
        }
    }
}

/// Megatron-Core's custom pipeline layout (`PipelineParallelLayerLayout`,
/// `megatron/core/transformer/pipeline_parallel_layer_layout.py`): the layers of each
/// pipeline stage in Megatron's flat order — stage `vp_stage · pp_size + pp_rank` is the
/// model chunk `vp_stage` of pipeline rank `pp_rank`, and the decoder layers are numbered in
/// that order. The split it gives is read by [`PipelineSplit`] (with `layout` set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineLayout {
    stages: Vec<Vec<LayoutLayer>>,
}

/// The most characters a layout string may hold once its repetitions are unrolled (far above
/// a model of [`DecodeLimits::MAX_LAYERS`] layers), so a mistyped count is refused before a
/// huge string is built.
pub const MAX_LAYOUT_CHARS: usize = 1 << 16;

/// Appends `piece` `times` times to `out`, refused past [`MAX_LAYOUT_CHARS`].
fn repeat_into(out: &mut Vec<char>, piece: &[char], times: &str) -> Result<(), RouteError> {
    let too_long = || {
        arg(format!(
            "pipeline_layout: unrolling {:?}*{times} passes the {MAX_LAYOUT_CHARS} characters \
             a layout may hold",
            piece.iter().collect::<String>()
        ))
    };
    let n: usize = times.parse().map_err(|_| too_long())?;
    let total = piece
        .len()
        .checked_mul(n)
        .and_then(|k| k.checked_add(out.len()))
        .filter(|&k| k <= MAX_LAYOUT_CHARS)
        .ok_or_else(too_long)?;
    out.reserve(total - out.len());
    for _ in 0..n {
        out.extend_from_slice(piece);
    }
    Ok(())
}

/// The ASCII digits of `s` from `at` on: their end (`at` when there are none).
fn digits_end(s: &[char], at: usize) -> usize {
    at + s[at.min(s.len())..]
        .iter()
        .take_while(|c| c.is_ascii_digit())
        .count()
}

impl PipelineLayout {
    /// Parses Megatron's string form (`--pipeline-model-parallel-layout`, e.g.
    /// `"Et*3|(tt|)*29,m|L"`) as `PipelineParallelLayerLayout.parse_str_to_list` does: commas
    /// dropped, `(...)*n` then `x*n` unrolled (the same two left-to-right substitutions as
    /// its regular expressions `\(([^)]+)\)\*(\d+)` and `(.)\*(\d+)`), stages split at `|`,
    /// `E` embedding, `t` decoder, `m` MTP, `L` loss.
    pub fn parse(text: &str) -> Result<Self, RouteError> {
        if text.len() > MAX_LAYOUT_CHARS {
            return Err(arg(format!(
                "pipeline_layout has {} bytes, more than the {MAX_LAYOUT_CHARS} a layout may hold",
                text.len()
            )));
        }
        let s: Vec<char> = text.chars().filter(|&c| c != ',').collect();
        // `\(([^)]+)\)\*(\d+)`: the group runs to the first `)` (it may hold `(`). The next
        // `)` from each position is found once, so many `(` cost no quadratic rescans; digits
        // are read only where a match can follow, and a match moves past them.
        let mut next_close = vec![None; s.len() + 1];
        for i in (0..s.len()).rev() {
            next_close[i] = if s[i] == ')' {
                Some(i)
            } else {
                next_close[i + 1]
            };
        }
        let mut once = Vec::with_capacity(s.len());
        let mut i = 0;
        while i < s.len() {
            if let (true, Some(close)) = (s[i] == '(', next_close[i + 1]) {
                if close > i + 1 && s.get(close + 1) == Some(&'*') {
                    let end = digits_end(&s, close + 2);
                    if end > close + 2 {
                        let times: String = s[close + 2..end].iter().collect();
                        repeat_into(&mut once, &s[i + 1..close], &times)?;
                        i = end;
                        continue;
                    }
                }
            }
            once.push(s[i]);
            i += 1;
        }
        // `(.)\*(\d+)`: any character but a newline, repeated.
        let mut flat = Vec::with_capacity(once.len());
        let mut i = 0;
        while i < once.len() {
            let repeat = once[i] != '\n' && once.get(i + 1) == Some(&'*');
            let end = if repeat {
                digits_end(&once, i + 2)
            } else {
                i + 2
            };
            if end > i + 2 {
                let times: String = once[i + 2..end].iter().collect();
                repeat_into(&mut flat, &once[i..=i], &times)?;
                i = end;
                continue;
            }
            if flat.len() >= MAX_LAYOUT_CHARS {
                return Err(arg(format!(
                    "pipeline_layout passes the {MAX_LAYOUT_CHARS} characters a layout may hold"
                )));
            }
            flat.push(once[i]);
            i += 1;
        }
        let stages = flat
            .split(|&c| c == '|')
            .map(|stage| {
                stage
                    .iter()
                    .map(|&c| {
                        LayoutLayer::from_char(c).ok_or_else(|| {
                            arg(format!(
                                "pipeline_layout {text:?}: invalid layer character {c:?} (known: \
                                 E embedding, t decoder, m mtp, L loss; | between stages, \
                                 (...)*n and x*n repeat)"
                            ))
                        })
                    })
                    .collect()
            })
            .collect::<Result<Vec<Vec<_>>, _>>()?;
        Ok(PipelineLayout { stages })
    }

    /// The list form (`pipeline_model_parallel_layout` as a list of stages, each a list of
    /// `LayerType` names), in Megatron's flat stage order.
    pub fn from_stages(stages: Vec<Vec<LayoutLayer>>) -> Self {
        PipelineLayout { stages }
    }

    /// The stages in Megatron's flat order (`vp_stage · pp_size + pp_rank`).
    pub fn stages(&self) -> &[Vec<LayoutLayer>] {
        &self.stages
    }

    fn decoders(stage: &[LayoutLayer]) -> usize {
        stage.iter().filter(|&&l| l == LayoutLayer::Decoder).count()
    }

    /// Checks the layout against the model and the pipeline as Megatron's
    /// `TransformerConfig.__post_init__` and `validate_layer_layout` do (the stages a
    /// multiple of `pp_size`; the embedding first and the loss last, each exactly once;
    /// `num_layers` decoder layers, all before any MTP layer). Returns the virtual-pipeline
    /// size it implies. The MTP placement rules that need `mtp_num_layers` are Megatron's to
    /// check: r3 replays no MTP router.
    fn check(&self, num_layers: usize, pp_size: usize) -> Result<usize, RouteError> {
        let n = self.stages.len();
        if !n.is_multiple_of(pp_size) {
            return Err(arg(format!(
                "pipeline_layout has {n} stages, not a multiple of pp_size {pp_size}"
            )));
        }
        let flat: Vec<LayoutLayer> = self.stages.concat();
        let count = |l: LayoutLayer| flat.iter().filter(|&&x| x == l).count();
        if flat.first() != Some(&LayoutLayer::Embedding)
            || count(LayoutLayer::Embedding) != 1
            || flat.last() != Some(&LayoutLayer::Loss)
            || count(LayoutLayer::Loss) != 1
        {
            return Err(arg(
                "pipeline_layout must start with the embedding (E) and end with the loss (L), \
                 each exactly once (Megatron's validate_layer_layout)"
                    .to_string(),
            ));
        }
        let decoders = count(LayoutLayer::Decoder);
        if decoders != num_layers {
            return Err(arg(format!(
                "pipeline_layout holds {decoders} decoder layers (t), but num_layers is \
                 {num_layers}"
            )));
        }
        if let Some(first_mtp) = flat.iter().position(|&l| l == LayoutLayer::Mtp) {
            if flat[first_mtp..].contains(&LayoutLayer::Decoder) {
                return Err(arg(
                    "pipeline_layout places a decoder layer after an MTP layer (Megatron needs \
                     every decoder layer first)"
                        .to_string(),
                ));
            }
        }
        Ok(n / pp_size)
    }
}

fn arg(msg: String) -> RouteError {
    RouteError::Argument(msg)
}

fn divide(what: &str, num: usize, den: usize) -> Result<usize, RouteError> {
    if den == 0 || !num.is_multiple_of(den) {
        return Err(arg(format!("{what}: {num} is not divisible by {den}")));
    }
    Ok(num / den)
}

impl PipelineSplit {
    /// An even split of `num_layers` over `pp_size` stages, no virtual stages.
    pub fn new(num_layers: usize, pp_size: usize) -> Self {
        PipelineSplit {
            num_layers,
            pp_size,
            vp_size: None,
            first_stage_layers: None,
            last_stage_layers: None,
            account_for_embedding: false,
            account_for_loss: false,
            layout: None,
        }
    }

    /// Sets the number of virtual stages per pipeline stage.
    pub fn with_vp_size(mut self, vp_size: Option<usize>) -> Self {
        self.vp_size = vp_size;
        self
    }

    /// Sets a custom layout (`pipeline_model_parallel_layout`).
    pub fn with_layout(mut self, layout: Option<PipelineLayout>) -> Self {
        self.layout = layout;
        self
    }

    /// With a custom layout: the layout checked against the other fields (as
    /// `TransformerConfig.__post_init__` checks them), and the virtual-pipeline size it
    /// implies.
    fn checked_layout(&self) -> Result<Option<(&PipelineLayout, usize)>, RouteError> {
        let Some(layout) = &self.layout else {
            return Ok(None);
        };
        DecodeLimits::check_layers("num_layers", self.num_layers)?;
        if self.pp_size == 0 {
            return Err(arg("pp_size must be >= 1".to_string()));
        }
        if self.is_uneven() || self.account_for_embedding || self.account_for_loss {
            return Err(arg(
                "pipeline_layout cannot be set with the other pipeline layout arguments \
                 (first_stage_layers, last_stage_layers, account_for_embedding, \
                 account_for_loss), as in Megatron"
                    .to_string(),
            ));
        }
        let vp = layout.check(self.num_layers, self.pp_size)?;
        match self.vp_size {
            Some(v) if v != vp => Err(arg(format!(
                "vp_size {v} conflicts with pipeline_layout, whose {} stages over pp_size {} \
                 make {vp} virtual stages",
                layout.stages.len(),
                self.pp_size
            ))),
            _ if vp > 1 && self.pp_size == 1 => Err(arg(format!(
                "pipeline_layout gives pp_size 1 {vp} virtual stages; Megatron interleaves only \
                 across stages (pp_size > 1)"
            ))),
            _ => Ok(Some((layout, vp))),
        }
    }

    /// The layout's chunk (`pp_rank`, `vp_stage`) as (offset, layers): Megatron's
    /// `PipelineParallelLayerLayout.get_layer_offset` and `get_num_layers_to_build` — the
    /// decoder layers of every stage before `vp_stage · pp_size + pp_rank` in the flat order,
    /// and of that stage.
    fn layout_chunk(
        &self,
        layout: &PipelineLayout,
        vp: usize,
        pp_rank: usize,
        vp_stage: Option<usize>,
    ) -> Result<(usize, usize), RouteError> {
        if pp_rank >= self.pp_size {
            return Err(RouteError::OutOfRange {
                what: "pp_rank",
                index: pp_rank,
                len: self.pp_size,
            });
        }
        let vp_stage = match vp_stage {
            Some(s) if s >= vp => {
                return Err(RouteError::OutOfRange {
                    what: "vp_stage",
                    index: s,
                    len: vp,
                })
            }
            Some(s) => s,
            None if vp > 1 => {
                return Err(arg(format!(
                    "vp_stage is required with pipeline_layout's {vp} virtual stages (one model \
                     chunk at a time)"
                )))
            }
            None => 0,
        };
        let at = vp_stage * self.pp_size + pp_rank;
        let offset = layout.stages[..at]
            .iter()
            .map(|s| PipelineLayout::decoders(s))
            .sum();
        Ok((offset, PipelineLayout::decoders(&layout.stages[at])))
    }

    /// The virtual-pipeline size that takes effect: Megatron interleaves only with pp > 1.
    fn effective_vp(&self) -> Option<usize> {
        self.vp_size.filter(|_| self.pp_size > 1)
    }

    /// Checks the ranks against the sizes; returns the virtual stage to compute with.
    fn check_ranks(&self, pp_rank: usize, vp_stage: Option<usize>) -> Result<usize, RouteError> {
        DecodeLimits::check_layers("num_layers", self.num_layers)?;
        if self.pp_size == 0 {
            return Err(arg("pp_size must be >= 1".to_string()));
        }
        if pp_rank >= self.pp_size {
            return Err(RouteError::OutOfRange {
                what: "pp_rank",
                index: pp_rank,
                len: self.pp_size,
            });
        }
        match (self.vp_size, vp_stage) {
            (Some(0), _) => Err(arg("vp_size must be >= 1".to_string())),
            (Some(v), _) if v > 1 && self.pp_size == 1 => Err(arg(format!(
                "vp_size {v} needs pp_size > 1 (Megatron interleaves only across stages)"
            ))),
            (Some(v), Some(s)) if s >= v => Err(RouteError::OutOfRange {
                what: "vp_stage",
                index: s,
                len: v,
            }),
            (Some(v), None) if v > 1 => Err(arg(format!(
                "vp_stage is required with vp_size {v} (one model chunk at a time)"
            ))),
            (None, Some(s)) if s > 0 => Err(arg(format!("vp_stage {s} given without vp_size"))),
            (_, s) => Ok(s.unwrap_or(0)),
        }
    }

    /// The layers an even split divides: the transformer layers, plus one each for the
    /// embedding and the loss when they are accounted in the split.
    fn split_layers(&self) -> usize {
        self.num_layers
            + usize::from(self.account_for_embedding)
            + usize::from(self.account_for_loss)
    }

    fn is_uneven(&self) -> bool {
        self.first_stage_layers.is_some() || self.last_stage_layers.is_some()
    }

    /// Layers of the middle stages of an uneven split and how many stages share them.
    fn uneven_middle(&self) -> Result<(usize, usize), RouteError> {
        if self.account_for_embedding || self.account_for_loss {
            return Err(arg(
                "an uneven pipeline (first/last stage layers) cannot also account for the \
                 embedding or loss in the split"
                    .to_string(),
            ));
        }
        let first = self.first_stage_layers.unwrap_or(0);
        let last = self.last_stage_layers.unwrap_or(0);
        let middle = self
            .num_layers
            .checked_sub(first)
            .and_then(|n| n.checked_sub(last))
            .ok_or_else(|| {
                arg(format!(
                    "first ({first}) + last ({last}) stage layers exceed num_layers {}",
                    self.num_layers
                ))
            })?;
        let uneven_stages = usize::from(self.first_stage_layers.is_some())
            + usize::from(self.last_stage_layers.is_some());
        let stages = self.pp_size.saturating_sub(uneven_stages);
        if stages == 0 && middle > 0 {
            return Err(arg(format!(
                "{middle} layers are left for no middle stage (first + last stage layers must \
                 equal num_layers {})",
                self.num_layers
            )));
        }
        Ok((middle, stages))
    }

    /// Layers the chunk (`pp_rank`, `vp_stage`) builds (Megatron's `get_num_layers_to_build`).
    pub fn num_layers_to_build(
        &self,
        pp_rank: usize,
        vp_stage: Option<usize>,
    ) -> Result<usize, RouteError> {
        if let Some((layout, vp)) = self.checked_layout()? {
            return Ok(self.layout_chunk(layout, vp, pp_rank, vp_stage)?.1);
        }
        let vp_stage = self.check_ranks(pp_rank, vp_stage)?;
        let (first_pp, last_pp) = (pp_rank == 0, pp_rank + 1 == self.pp_size);
        let per_stage = if self.is_uneven() {
            let (middle, stages) = self.uneven_middle()?;
            let mut per = if stages > 0 {
                divide("middle-stage layers over middle stages", middle, stages)?
            } else {
                0
            };
            if let (true, Some(n)) = (first_pp, self.first_stage_layers) {
                per = n;
            }
            if let (true, Some(n)) = (last_pp, self.last_stage_layers) {
                per = n;
            }
            per
        } else {
            divide(
                "layers over pipeline stages",
                self.split_layers(),
                self.pp_size,
            )?
        };
        let vp = self.effective_vp();
        let mut build = match vp {
            Some(v) => divide("stage layers over virtual stages", per_stage, v)?,
            None => per_stage,
        };
        let vp_size = vp.unwrap_or(1);
        let drop = |build: usize, what: &str| {
            build.checked_sub(1).ok_or_else(|| {
                arg(format!(
                    "no transformer layer is left in the {what} virtual stage for the {what} \
                     layer it also holds"
                ))
            })
        };
        if self.account_for_embedding && first_pp && vp_stage == 0 {
            build = drop(build, "first")?;
        }
        if self.account_for_loss && last_pp && vp_stage + 1 == vp_size {
            build = drop(build, "last")?;
        }
        Ok(build)
    }

    /// Global index of the first layer of chunk (`pp_rank`, `vp_stage`) (Megatron's
    /// `get_transformer_layer_offset`).
    pub fn layer_offset(
        &self,
        pp_rank: usize,
        vp_stage: Option<usize>,
    ) -> Result<usize, RouteError> {
        if let Some((layout, vp)) = self.checked_layout()? {
            return Ok(self.layout_chunk(layout, vp, pp_rank, vp_stage)?.0);
        }
        let vp_stage = self.check_ranks(pp_rank, vp_stage)?;
        if self.pp_size == 1 {
            return Ok(0);
        }
        let vp = self.effective_vp();
        if self.is_uneven() {
            let (middle, stages) = self.uneven_middle()?;
            let first = self.first_stage_layers.unwrap_or(0);
            let last = self.last_stage_layers.unwrap_or(0);
            // The rank among the middle stages (pp_rank 0 is a middle stage when the first
            // stage is not uneven; with an uneven first stage, pp_rank 0 never reads it).
            let middle_rank =
                pp_rank.saturating_sub(usize::from(self.first_stage_layers.is_some()));
            let per_stage = |layers: usize| layers.checked_div(stages).unwrap_or(0);
            return Ok(match vp {
                Some(v) => {
                    let (f, m, l) = (first / v, middle / v, last / v);
                    let chunk = vp_stage * (f + m + l);
                    if pp_rank == 0 {
                        chunk
                    } else {
                        chunk + f + middle_rank * per_stage(m)
                    }
                }
                None if pp_rank == 0 => 0,
                None => middle_rank * per_stage(middle) + first,
            });
        }
        let n = self.split_layers();
        let per_stage = n / self.pp_size;
        let offset = match vp {
            Some(v) => vp_stage * (n / v) + pp_rank * (per_stage / v),
            None => pp_rank * per_stage,
        };
        let holds_embedding = pp_rank == 0 && vp_stage == 0;
        if self.account_for_embedding && !holds_embedding {
            return offset
                .checked_sub(1)
                .ok_or_else(|| arg("layer offset below 0".to_string()));
        }
        Ok(offset)
    }

    /// The global layers of chunk (`pp_rank`, `vp_stage`), checked to lie in the model.
    pub fn chunk_layers(
        &self,
        pp_rank: usize,
        vp_stage: Option<usize>,
    ) -> Result<Range<usize>, RouteError> {
        let offset = self.layer_offset(pp_rank, vp_stage)?;
        let end = offset + self.num_layers_to_build(pp_rank, vp_stage)?;
        if end > self.num_layers {
            return Err(RouteError::LayerOutOfRange {
                what: "pipeline chunk end",
                layer: end,
                num_layers: self.num_layers,
            });
        }
        Ok(offset..end)
    }

    /// The global layers a pipeline rank builds, in Megatron's construction order: with
    /// virtual stages and `vp_stage` None, every model chunk of the rank in turn (the order
    /// of `RouterReplay.global_router_replay_instances`); otherwise the one chunk.
    pub fn local_layers(
        &self,
        pp_rank: usize,
        vp_stage: Option<usize>,
    ) -> Result<Vec<usize>, RouteError> {
        let chunks = match self.checked_layout()? {
            Some((_, vp)) => Some(vp),
            None => self.effective_vp(),
        };
        match (chunks, vp_stage) {
            (Some(v), None) if v > 1 => {
                let mut out = Vec::new();
                for s in 0..v {
                    out.extend(self.chunk_layers(pp_rank, Some(s))?);
                }
                Ok(out)
            }
            _ => Ok(self.chunk_layers(pp_rank, vp_stage)?.collect()),
        }
    }
}

/// How sequences are laid out in a micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Packing {
    /// Packed (THD): sequences one after another, each padded to the split's alignment; the
    /// context-parallel split is per sequence.
    Thd,
    /// Padded batch (BSHD): every sequence padded to one length; Megatron's hidden states are
    /// `[seq, batch, hidden]`, so the routers see tokens position-major.
    Bshd,
    /// Packed (THD) with a contiguous context-parallel split of the whole packed stream:
    /// sequences one after another, not padded one by one; the stream (with any trailing
    /// padding) cut into `cp` equal contiguous parts, rank `r` keeping part `r`, then split
    /// over sequence parallelism. slime's `--allgather-cp` layout (DSA attention models):
    /// `get_batch` does `tokens = torch.cat(tokens)`, pads to a multiple of
    /// `cp · tp · data_pad_size_multiplier`, then `tokens.chunk(cp_size)[cp_rank]`.
    ThdContiguousCp,
}

impl Packing {
    /// Parses `"thd"`, `"bshd"` or `"thd_contiguous_cp"`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "thd" => Some(Packing::Thd),
            "bshd" => Some(Packing::Bshd),
            "thd_contiguous_cp" => Some(Packing::ThdContiguousCp),
            _ => None,
        }
    }
}

/// One rank's place in the sequence-parallel (the tensor-parallel group when
/// `sequence_parallel` is on) and context-parallel groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenSplit {
    /// Sequence-parallel ranks (1 = no sequence parallelism).
    pub sp_size: usize,
    /// This rank's sequence-parallel rank.
    pub sp_rank: usize,
    /// Context-parallel ranks (1 = none).
    pub cp_size: usize,
    /// This rank's context-parallel rank.
    pub cp_rank: usize,
}

impl TokenSplit {
    /// No sequence or context parallelism.
    pub fn single() -> Self {
        TokenSplit {
            sp_size: 1,
            sp_rank: 0,
            cp_size: 1,
            cp_rank: 0,
        }
    }

    fn check(&self) -> Result<(), RouteError> {
        for (what, size, rank) in [
            ("sp_rank", self.sp_size, self.sp_rank),
            ("cp_rank", self.cp_size, self.cp_rank),
        ] {
            if size == 0 {
                return Err(arg(format!("the group of {what} must have size >= 1")));
            }
            if rank >= size {
                return Err(RouteError::OutOfRange {
                    what,
                    index: rank,
                    len: size,
                });
            }
        }
        // 2·cp·sp (what `cp_multiple` and `alignment` compute) must fit a micro-batch.
        let cp_chunks = if self.cp_size > 1 {
            self.cp_size.checked_mul(2)
        } else {
            Some(1)
        };
        cp_chunks
            .and_then(|c| c.checked_mul(self.sp_size))
            .filter(|&a| a <= MAX_BATCH_TOKENS)
            .ok_or_else(|| {
                arg(format!(
                    "sp {} x cp {}: the alignment exceeds the {MAX_BATCH_TOKENS} tokens a \
                     micro-batch may hold",
                    self.sp_size, self.cp_size
                ))
            })?;
        Ok(())
    }

    /// The length every sequence is padded to a multiple of: `2 · cp · sp` with context
    /// parallelism (two zigzag chunks per rank, each split over sequence parallelism),
    /// `sp` without (saturating; [`rank_tokens`] refuses sizes whose alignment overflows).
    pub fn alignment(&self) -> usize {
        if self.cp_size > 1 {
            self.cp_size.saturating_mul(2).saturating_mul(self.sp_size)
        } else {
            self.sp_size
        }
    }

    /// The multiple one sequence's padded length must be for the context-parallel split:
    /// `2 · cp` chunks (1 without context parallelism).
    fn cp_multiple(&self) -> usize {
        if self.cp_size > 1 {
            2 * self.cp_size
        } else {
            1
        }
    }

    /// The positions of a padded length this rank's context-parallel split keeps: zigzag
    /// chunks `cp_rank` and `2·cp − 1 − cp_rank` of `2·cp` equal chunks.
    fn cp_positions(&self, padded: usize) -> std::iter::Chain<Range<usize>, Range<usize>> {
        if self.cp_size == 1 {
            return (0..padded).chain(0..0);
        }
        let chunk = padded / self.cp_multiple();
        let (a, b) = (self.cp_rank, 2 * self.cp_size - 1 - self.cp_rank);
        (a * chunk..(a + 1) * chunk).chain(b * chunk..(b + 1) * chunk)
    }

    /// The sequence-parallel share of `n` local items: rank `sp_rank` of `sp_size` equal
    /// contiguous parts (Megatron's split along the first dimension, which needs `n`
    /// divisible by `sp_size`; `what` names the items when it is not).
    fn sp_range(&self, n: usize, what: &str) -> Result<Range<usize>, RouteError> {
        if !n.is_multiple_of(self.sp_size) {
            return Err(arg(format!(
                "{what}: the rank's {n} tokens do not split evenly over sp {} (Megatron's \
                 sequence-parallel split needs a multiple)",
                self.sp_size
            )));
        }
        let part = n / self.sp_size;
        Ok(self.sp_rank * part..(self.sp_rank + 1) * part)
    }
}

/// One token a rank's routers see: a position of a sequence, or padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenSlot {
    /// Position `pos` of sequence `seq`.
    Token {
        /// Index of the sequence in the batch.
        seq: usize,
        /// Position in the sequence.
        pos: usize,
    },
    /// Alignment padding.
    Pad,
}

/// How far the sequences of a micro-batch are padded: inferred from the split, or as the
/// caller's data loader padded them (then checked against the sequences and the split).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Padding<'a> {
    /// `thd`: each sequence to the next multiple of [`TokenSplit::alignment`]; `bshd`: the
    /// batch to the next multiple at or above its longest sequence.
    #[default]
    Aligned,
    /// `thd` only: the padded sequences' cumulative offsets, Megatron's `cu_seqlens_padded`
    /// (`PackedSeqParams.cu_seqlens_q_padded`): one more entry than sequences, from 0.
    CuSeqlens(&'a [usize]),
    /// `thd` only: offsets as [`Padding::CuSeqlens`] that may end with one more entry, a
    /// padding-only segment past the last sequence — slime's `cu_seqlens`, whose data
    /// loader pads each context-parallel rank's packed tokens after the zigzag split and
    /// records that tail as a pseudo-sequence. Its tokens are padding on every rank, an equal
    /// share (`tail / cp`) of each. A separate variant, so that a caller whose offsets have
    /// no tail (verl) still has a missing table refused rather than read as padding.
    CuSeqlensWithTail(&'a [usize]),
    /// `bshd` only: the padded batch's sequence length.
    SeqLen(usize),
}

/// `n` rounded up to a multiple of `to` (≥ 1), refused past [`MAX_BATCH_TOKENS`].
fn round_up(n: usize, to: usize, what: impl Fn() -> String) -> Result<usize, RouteError> {
    n.div_ceil(to)
        .checked_mul(to)
        .filter(|&p| p <= MAX_BATCH_TOKENS)
        .ok_or_else(|| {
            arg(format!(
                "{}: {n} tokens padded to a multiple of {to} exceed the {MAX_BATCH_TOKENS} \
                 tokens a micro-batch may hold",
                what()
            ))
        })
}

/// A thd batch's padded lengths: each sequence's, and the padding-only tail's (0 without).
struct ThdPadded {
    seqs: Vec<usize>,
    tail: usize,
}

/// The offsets of `cu_seqlens_padded` checked as a whole: from 0, never decreasing, one more
/// entry than `n` sequences (or two more when `tail_allowed`). Returns the padding-only
/// tail's length (0 without one).
fn check_cu_seqlens(cu: &[usize], n: usize, tail_allowed: bool) -> Result<usize, RouteError> {
    let with_tail = tail_allowed && cu.len() == n + 2;
    if cu.len() != n + 1 && !with_tail {
        let also = if tail_allowed {
            format!(" (or {} with a trailing padding segment)", n + 2)
        } else {
            String::new()
        };
        return Err(arg(format!(
            "cu_seqlens_padded has {} entries; {n} sequences need {}{also}",
            cu.len(),
            n + 1
        )));
    }
    if cu[0] != 0 {
        return Err(arg(format!("cu_seqlens_padded starts at {}, not 0", cu[0])));
    }
    if let Some(i) = cu.windows(2).position(|w| w[1] < w[0]) {
        return Err(arg(format!(
            "cu_seqlens_padded decreases at sequence {i}: {} then {}",
            cu[i],
            cu[i + 1]
        )));
    }
    Ok(if with_tail { cu[n + 1] - cu[n] } else { 0 })
}

/// The padded length of each packed (`thd`) sequence and of a trailing padding segment.
/// With `zigzag` (`thd`) each sequence is split over context parallelism on its own, so it
/// must be a multiple of `2·cp` and the tail of `cp`; without (`thd_contiguous_cp`) the
/// stream is split as a whole: the inferred padding leaves the sequences as they are and
/// pads the stream at its end to a multiple of `cp · sp`.
fn thd_padded(
    seq_lens: &[usize],
    split: &TokenSplit,
    padding: Padding<'_>,
    zigzag: bool,
) -> Result<ThdPadded, RouteError> {
    let (cu, tail) = match padding {
        Padding::Aligned => (None, 0),
        Padding::CuSeqlens(cu) => (Some(cu), check_cu_seqlens(cu, seq_lens.len(), false)?),
        Padding::CuSeqlensWithTail(cu) => (Some(cu), check_cu_seqlens(cu, seq_lens.len(), true)?),
        Padding::SeqLen(_) => {
            return Err(arg(
                "padded_len is for bshd batches; packed (thd) sequences take \
                 cu_seqlens_padded"
                    .to_string(),
            ))
        }
    };
    // The tail is padding on every rank: only its share per context-parallel rank counts,
    // so it needs to split evenly over cp, not into 2·cp zigzag chunks.
    if zigzag && !tail.is_multiple_of(split.cp_size) {
        return Err(arg(format!(
            "cu_seqlens_padded's trailing padding segment has {tail} tokens, not a multiple \
             of cp = {} (each context-parallel rank holds an equal share)",
            split.cp_size
        )));
    }
    if tail > MAX_BATCH_TOKENS {
        return Err(arg(format!(
            "cu_seqlens_padded's trailing padding segment ({tail} tokens) exceeds the \
             {MAX_BATCH_TOKENS} tokens a micro-batch may hold"
        )));
    }
    let mut total = tail;
    let mut out = Vec::with_capacity(seq_lens.len());
    for (seq, &n) in seq_lens.iter().enumerate() {
        let padded = match cu {
            None if !zigzag => n,
            None => round_up(n, split.alignment(), || format!("sequence {seq}"))?,
            Some(cu) => {
                let padded = cu[seq + 1] - cu[seq];
                if padded < n {
                    return Err(arg(format!(
                        "cu_seqlens_padded gives sequence {seq} {padded} tokens, fewer than \
                         its {n} tokens"
                    )));
                }
                if zigzag && !padded.is_multiple_of(split.cp_multiple()) {
                    return Err(arg(format!(
                        "cu_seqlens_padded gives sequence {seq} {padded} tokens, not a \
                         multiple of 2·cp = {} (the context-parallel zigzag split)",
                        split.cp_multiple()
                    )));
                }
                padded
            }
        };
        total = total
            .checked_add(padded)
            .filter(|&t| t <= MAX_BATCH_TOKENS)
            .ok_or_else(|| {
                arg(format!(
                    "the padded sequences exceed the {MAX_BATCH_TOKENS} tokens a micro-batch \
                     may hold (at sequence {seq})"
                ))
            })?;
        out.push(padded);
    }
    if !zigzag && cu.is_none() {
        // The stream padded at its end so that every cp × sp rank holds an equal share.
        let stream = split.cp_size.saturating_mul(split.sp_size);
        let padded = round_up(total, stream, || "the packed sequences".to_string())?;
        return Ok(ThdPadded {
            seqs: out,
            tail: padded - total,
        });
    }
    Ok(ThdPadded { seqs: out, tail })
}

/// The padded sequence length of a `bshd` batch.
fn bshd_padded(
    seq_lens: &[usize],
    split: &TokenSplit,
    padding: Padding<'_>,
) -> Result<usize, RouteError> {
    let (longest_seq, longest) = seq_lens
        .iter()
        .copied()
        .enumerate()
        .max_by_key(|&(_, n)| n)
        .unwrap_or((0, 0));
    let padded =
        match padding {
            Padding::Aligned => round_up(longest, split.alignment(), || {
                format!("the longest sequence ({longest_seq})")
            })?,
            Padding::SeqLen(padded) => {
                if padded < longest {
                    return Err(arg(format!(
                        "padded_len {padded} is shorter than sequence {longest_seq}'s {longest} \
                     tokens"
                    )));
                }
                if !padded.is_multiple_of(split.cp_multiple())
                    || !(padded / split.cp_size).is_multiple_of(split.sp_size)
                {
                    return Err(arg(format!(
                        "padded_len {padded} does not split: it must be a multiple of 2·cp = {} \
                     and its share of each context-parallel rank a multiple of sp {}",
                        split.cp_multiple(),
                        split.sp_size
                    )));
                }
                padded
            }
            Padding::CuSeqlens(_) | Padding::CuSeqlensWithTail(_) => return Err(arg(
                "cu_seqlens_padded is for packed (thd) sequences; a bshd batch takes padded_len"
                    .to_string(),
            )),
        };
    padded
        .checked_mul(seq_lens.len())
        .filter(|&t| t <= MAX_BATCH_TOKENS)
        .ok_or_else(|| {
            arg(format!(
                "{} sequences of {padded} padded tokens exceed the {MAX_BATCH_TOKENS} tokens a \
                 micro-batch may hold",
                seq_lens.len()
            ))
        })?;
    Ok(padded)
}

/// The tokens one rank's routers see for a batch of sequences of `seq_lens` tokens, padded
/// as `padding` says, in the order the routers see them (see [`Packing`] and
/// [`TokenSplit`]). Sizes past [`MAX_BATCH_TOKENS`], padding shorter than a sequence or
/// lengths the split cannot divide are refused by name.
pub fn rank_tokens(
    seq_lens: &[usize],
    packing: Packing,
    split: TokenSplit,
    padding: Padding<'_>,
) -> Result<Vec<TokenSlot>, RouteError> {
    split.check()?;
    let slot = |seq: usize, pos: usize| {
        if pos < seq_lens[seq] {
            TokenSlot::Token { seq, pos }
        } else {
            TokenSlot::Pad
        }
    };
    match packing {
        Packing::Thd => {
            let padded = thd_padded(seq_lens, &split, padding, true)?;
            let what = || match padding {
                Padding::CuSeqlens(_) | Padding::CuSeqlensWithTail(_) => "cu_seqlens_padded",
                _ => "packed sequences",
            };
            let tail = padded.tail / split.cp_size;
            let local_len = padded.seqs.iter().map(|p| p / split.cp_size).sum::<usize>() + tail;
            let mine = split.sp_range(local_len, what())?;
            let mut local = Vec::with_capacity(mine.len());
            let mut at = 0usize;
            for (seq, &p) in padded.seqs.iter().enumerate() {
                for pos in split.cp_positions(p) {
                    if mine.contains(&at) {
                        local.push(slot(seq, pos));
                    }
                    at += 1;
                }
            }
            // The tail follows the sequences on every context-parallel rank (slime pads
            // each rank's packed tokens after the zigzag split): all padding.
            let tail_mine = mine.start.max(at)..mine.end.min(at + tail);
            local.extend(tail_mine.map(|_| TokenSlot::Pad));
            Ok(local)
        }
        Packing::ThdContiguousCp => {
            let padded = thd_padded(seq_lens, &split, padding, false)?;
            let total = padded.seqs.iter().sum::<usize>() + padded.tail;
            let what = match padding {
                Padding::CuSeqlens(_) | Padding::CuSeqlensWithTail(_) => "cu_seqlens_padded",
                _ => "packed sequences",
            };
            if !total.is_multiple_of(split.cp_size) {
                return Err(arg(format!(
                    "{what}: the packed stream's {total} tokens do not split evenly over cp {} \
                     (the contiguous context-parallel split needs a multiple)",
                    split.cp_size
                )));
            }
            let part = total / split.cp_size;
            let local = split.sp_range(part, what)?;
            // This rank's tokens as positions of the whole stream.
            let base = split.cp_rank * part;
            let mine = base + local.start..base + local.end;
            let mut out = Vec::with_capacity(mine.len());
            let mut at = 0usize;
            for (seq, &p) in padded.seqs.iter().enumerate() {
                let (from, to) = (mine.start.max(at), mine.end.min(at + p));
                out.extend((from..to).map(|g| slot(seq, g - at)));
                at += p;
            }
            out.resize(mine.len(), TokenSlot::Pad);
            Ok(out)
        }
        Packing::Bshd => {
            let padded = bshd_padded(seq_lens, &split, padding)?;
            let positions: Vec<usize> = split.cp_positions(padded).collect();
            let mine = &positions[split.sp_range(positions.len(), "padded_len")?];
            let mut out = Vec::with_capacity(mine.len() * seq_lens.len());
            for &p in mine {
                out.extend((0..seq_lens.len()).map(|seq| slot(seq, p)));
            }
            Ok(out)
        }
    }
}

/// A rank's replay ids, router-major: `ids[r · num_tokens · top_k ..]` are the
/// `[num_tokens, top_k]` ids of router `r`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayIds {
    /// Flat `[routers, num_tokens, top_k]` logical expert ids.
    pub ids: Vec<i64>,
    /// Routers (local MoE layers).
    pub num_routers: usize,
    /// Tokens the rank's routers see.
    pub num_tokens: usize,
    /// Experts per token.
    pub top_k: usize,
}

/// Gathers the ids the routers of `router_layers` (global MoE layers, in construction order)
/// replay on one rank, the sequences padded as `padding` says. Sequence `i` is
/// `tables[i].num_tokens() + 1` tokens long: its routes must start at position 0 and every
/// cell of every router layer must be present, else the error names the sequence, token and
/// layer.
///
/// The sequence's last token (never fed to the rollout engine, so never routed) and padding
/// replay filler ids no loss reads: the `t`-th token of the rank, if it is one of them, replays
/// experts `(t · top_k + j) mod num_experts` for `j` in `0..top_k` — distinct within the row,
/// and spread over all experts rather than piled on experts `0..top_k`, so that Megatron's
/// load-balancing loss and expert capacity see about as much filler on every expert.
pub fn replay_ids(
    tables: &[&RouteTable],
    router_layers: &[usize],
    packing: Packing,
    split: TokenSplit,
    padding: Padding<'_>,
) -> Result<ReplayIds, RouteError> {
    replay_ids_with_lens(tables, None, router_layers, packing, split, padding)
}

/// [`replay_ids`] for sequences that may run past their routes: sequence `i` is
/// `seq_lens[i]` tokens long (at least `tables[i].num_tokens() + 1`), and its tokens past the
/// routed rows replay the filler like its last token. Meant for tokens a rollout engine was
/// never fed (verl's multi-turn rollouts can end with a user turn appended after the engine's
/// last call), which carry no loss. With `None` each sequence is `num_tokens() + 1` long, as
/// in [`replay_ids`].
pub fn replay_ids_with_lens(
    tables: &[&RouteTable],
    seq_lens: Option<&[usize]>,
    router_layers: &[usize],
    packing: Packing,
    split: TokenSplit,
    padding: Padding<'_>,
) -> Result<ReplayIds, RouteError> {
    let first = tables
        .first()
        .ok_or_else(|| arg("no route tables given".to_string()))?;
    let top_k = first.top_k();
    let mut columns = Vec::with_capacity(tables.len());
    for (i, t) in tables.iter().enumerate() {
        let in_seq = |e: RouteError| arg(format!("sequence {i}: {e}"));
        first.check_same_shape(t).map_err(in_seq)?;
        if t.start_pos() != 0 {
            return Err(in_seq(RouteError::Misaligned {
                what: "routes",
                rows: t.start_pos()..t.end_pos(),
                against: 0..t.end_pos(),
                rule: "replay needs every fed position from 0 (capture the prompt's routes too)",
            }));
        }
        let cols: Vec<usize> = router_layers
            .iter()
            .map(|&layer| {
                t.column_of_layer(layer).ok_or_else(|| {
                    in_seq(RouteError::Layout(format!(
                        "the table has no column for MoE layer {layer} (its layers: {:?})",
                        t.layers()
                    )))
                })
            })
            .collect::<Result<_, _>>()?;
        for &c in &cols {
            if let Some(tok) = (0..t.num_tokens()).find(|&tok| !t.is_present(tok, c)) {
                return Err(in_seq(RouteError::MissingRoute {
                    token: tok,
                    layer: t.layers()[c],
                }));
            }
        }
        columns.push(cols);
    }
    let seq_lens: Vec<usize> = match seq_lens {
        None => tables.iter().map(|t| t.num_tokens() + 1).collect(),
        Some(lens) => {
            if lens.len() != tables.len() {
                return Err(RouteError::length("seq_lens", tables.len(), lens.len()));
            }
            for (i, (&n, t)) in lens.iter().zip(tables).enumerate() {
                if n <= t.num_tokens() {
                    return Err(arg(format!(
                        "seq_lens[{i}] = {n} is shorter than sequence {i}'s {} routed rows + 1 \
                         (its last token)",
                        t.num_tokens()
                    )));
                }
            }
            lens.to_vec()
        }
    };
    let slots = rank_tokens(&seq_lens, packing, split, padding)?;
    let (routers, n) = (router_layers.len(), slots.len());
    let num_experts = first.num_experts();
    let mut ids = vec![0i64; DecodeLimits::id_count(n, routers, top_k)?];
    for r in 0..routers {
        let out = &mut ids[r * n * top_k..(r + 1) * n * top_k];
        for (t, (cell, slot)) in out.chunks_exact_mut(top_k).zip(&slots).enumerate() {
            let routed = match *slot {
                TokenSlot::Token { seq, pos } if pos < tables[seq].num_tokens() => Some((seq, pos)),
                _ => None,
            };
            for (k, v) in cell.iter_mut().enumerate() {
                *v = match routed {
                    Some((seq, pos)) => tables[seq]
                        .expert_at(pos, columns[seq][r], k)
                        .map_or(0, i64::from),
                    None => ((t * top_k + k) % num_experts) as i64,
                };
            }
        }
    }
    Ok(ReplayIds {
        ids,
        num_routers: routers,
        num_tokens: n,
        top_k,
    })
}
