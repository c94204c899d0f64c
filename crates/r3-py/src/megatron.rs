//! Megatron-Core's layer and token split (r3-routing's `megatron` module) for the Python
//! adapter `r3.megatron`, which turns the ids into torch tensors and hands them to
//! `RouterReplay`.

use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};
use r3_routing::megatron::{
    self as split, LayoutLayer, Packing, Padding, PipelineLayout, PipelineSplit, TokenSlot,
    TokenSplit,
};

use crate::args;
use crate::arrays::to_numpy;
use crate::table::PyRouteTable;
use crate::{arg_err, route_err};

/// Megatron's split of the transformer layers over pipeline (and virtual) stages.
#[pyclass(name = "PipelineSplit", module = "r3.megatron", frozen)]
pub struct PyPipelineSplit {
    split: PipelineSplit,
}

/// A layer type of Megatron's list form: a `LayerType` member (its `.name`) or the name.
fn layout_layer(item: &Bound<'_, PyAny>, at: &str) -> PyResult<LayoutLayer> {
    let name: String = if item.is_instance_of::<PyString>() {
        item.extract()?
    } else {
        match item.getattr("name").and_then(|n| n.extract::<String>()) {
            Ok(name) => name,
            Err(_) => {
                return Err(arg_err(format!(
                    "{at} must be a LayerType or its name, got {}",
                    item.get_type().name()?
                )))
            }
        }
    };
    LayoutLayer::from_name(&name).map_err(|e| match e {
        r3_routing::RouteError::Argument(why) => arg_err(format!("{at}: {why}")),
        other => route_err(other),
    })
}

/// `items` as a list or tuple (Megatron's list form holds lists; a str is refused, not read
/// as its characters).
fn list_items<'py>(items: &Bound<'py, PyAny>, at: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if items.is_instance_of::<PyList>() || items.is_instance_of::<PyTuple>() {
        return items.extract();
    }
    Err(arg_err(format!(
        "{at} must be a list, got {}",
        items.get_type().name()?
    )))
}

/// The argument `pipeline_layout`: Megatron's string form (`--pipeline-model-parallel-layout`),
/// its list form (stages of `LayerType` names or members, in Megatron's flat order), or the
/// `PipelineParallelLayerLayout` `TransformerConfig` turns either into (read from its parsed
/// `.layout[pp_rank][vp_stage]`; its `pipeline_model_parallel_size` is returned, to be
/// checked against the split's).
fn pipeline_layout_arg(
    obj: &Bound<'_, PyAny>,
) -> PyResult<Option<(PipelineLayout, Option<usize>)>> {
    if obj.is_none() {
        return Ok(None);
    }
    if obj.is_instance_of::<PyString>() {
        let text: String = obj.extract()?;
        return PipelineLayout::parse(&text)
            .map(|l| Some((l, None)))
            .map_err(route_err);
    }
    if obj.hasattr("layout")? && obj.hasattr("pipeline_model_parallel_size")? {
        let pp: usize = args::Counts::extract_named(
            &obj.getattr("pipeline_model_parallel_size")?,
            "pipeline_layout.pipeline_model_parallel_size",
        )?;
        let ranks = list_items(&obj.getattr("layout")?, "pipeline_layout.layout")?;
        if ranks.len() != pp {
            return Err(arg_err(format!(
                "pipeline_layout.layout has {} pipeline ranks, but its \
                 pipeline_model_parallel_size is {pp}",
                ranks.len()
            )));
        }
        let mut chunks = Vec::with_capacity(pp);
        for (p, rank) in ranks.iter().enumerate() {
            let at = format!("pipeline_layout.layout[{p}]");
            let mut stages = Vec::new();
            for (v, stage) in list_items(rank, &at)?.iter().enumerate() {
                let at = format!("{at}[{v}]");
                let layers = list_items(stage, &at)?
                    .iter()
                    .enumerate()
                    .map(|(i, item)| layout_layer(item, &format!("{at}[{i}]")))
                    .collect::<PyResult<Vec<_>>>()?;
                stages.push(layers);
            }
            chunks.push(stages);
        }
        let vp = chunks.first().map_or(0, Vec::len);
        if chunks.iter().any(|c| c.len() != vp) {
            return Err(arg_err(
                "pipeline_layout.layout: the pipeline ranks hold different numbers of virtual \
                 stages",
            ));
        }
        // Megatron's flat order: stage vp_stage * pp + pp_rank is layout[pp_rank][vp_stage].
        let mut flat = Vec::with_capacity(pp * vp);
        for v in 0..vp {
            for rank in &chunks {
                flat.push(rank[v].clone());
            }
        }
        return Ok(Some((PipelineLayout::from_stages(flat), Some(pp))));
    }
    let stages = list_items(obj, "pipeline_layout")?;
    let mut flat = Vec::with_capacity(stages.len());
    for (s, stage) in stages.iter().enumerate() {
        let at = format!("pipeline_layout[{s}]");
        let layers = list_items(stage, &at)?
            .iter()
            .enumerate()
            .map(|(i, item)| layout_layer(item, &format!("{at}[{i}]")))
            .collect::<PyResult<Vec<_>>>()?;
        flat.push(layers);
    }
    Ok(Some((PipelineLayout::from_stages(flat), None)))
}

#[pymethods]
impl PyPipelineSplit {
    /// The fields of `TransformerConfig` that decide the split; `pipeline_layout` is
    /// `pipeline_model_parallel_layout` (see [`pipeline_layout_arg`]).
    #[new]
    #[pyo3(signature = (num_layers, pp_size = 1, *, vp_size = None, first_stage_layers = None,
        last_stage_layers = None, account_for_embedding = false, account_for_loss = false,
        pipeline_layout = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        #[pyo3(from_py_with = args::num_layers)] num_layers: usize,
        #[pyo3(from_py_with = args::pp_size)] pp_size: usize,
        #[pyo3(from_py_with = args::vp_size)] vp_size: Option<usize>,
        #[pyo3(from_py_with = args::first_stage_layers)] first_stage_layers: Option<usize>,
        #[pyo3(from_py_with = args::last_stage_layers)] last_stage_layers: Option<usize>,
        account_for_embedding: bool,
        account_for_loss: bool,
        #[pyo3(from_py_with = pipeline_layout_arg)] pipeline_layout: Option<(
            PipelineLayout,
            Option<usize>,
        )>,
    ) -> PyResult<Self> {
        let layout = match pipeline_layout {
            Some((_, Some(built_for))) if built_for != pp_size => {
                return Err(arg_err(format!(
                    "pipeline_layout was built for pipeline_model_parallel_size {built_for}, \
                     but pp_size is {pp_size}"
                )))
            }
            Some((layout, _)) => Some(layout),
            None => None,
        };
        Ok(PyPipelineSplit {
            split: PipelineSplit {
                num_layers,
                pp_size,
                vp_size,
                first_stage_layers,
                last_stage_layers,
                account_for_embedding,
                account_for_loss,
                layout,
            },
        })
    }

    /// The custom layout's stages in Megatron's flat order (stage `vp_stage * pp_size +
    /// pp_rank`), as `LayerType` names; None without one.
    #[getter]
    fn pipeline_layout(&self) -> Option<Vec<Vec<&'static str>>> {
        self.split.layout.as_ref().map(|l| {
            l.stages()
                .iter()
                .map(|stage| stage.iter().map(|layer| layer.name()).collect())
                .collect()
        })
    }

    /// Megatron's `get_transformer_layer_offset(config, vp_stage, pp_rank)`.
    #[pyo3(signature = (pp_rank, vp_stage = None))]
    fn layer_offset(
        &self,
        #[pyo3(from_py_with = args::pp_rank)] pp_rank: usize,
        #[pyo3(from_py_with = args::vp_stage)] vp_stage: Option<usize>,
    ) -> PyResult<usize> {
        self.split
            .layer_offset(pp_rank, vp_stage)
            .map_err(route_err)
    }

    /// Megatron's `get_num_layers_to_build(config, vp_stage, pp_rank)`.
    #[pyo3(signature = (pp_rank, vp_stage = None))]
    fn num_layers_to_build(
        &self,
        #[pyo3(from_py_with = args::pp_rank)] pp_rank: usize,
        #[pyo3(from_py_with = args::vp_stage)] vp_stage: Option<usize>,
    ) -> PyResult<usize> {
        self.split
            .num_layers_to_build(pp_rank, vp_stage)
            .map_err(route_err)
    }

    /// Global layers of the rank in construction order (every model chunk when `vp_stage`
    /// is None).
    #[pyo3(signature = (pp_rank, vp_stage = None))]
    fn local_layers(
        &self,
        #[pyo3(from_py_with = args::pp_rank)] pp_rank: usize,
        #[pyo3(from_py_with = args::vp_stage)] vp_stage: Option<usize>,
    ) -> PyResult<Vec<usize>> {
        self.split
            .local_layers(pp_rank, vp_stage)
            .map_err(route_err)
    }
}

fn token_split(
    packing: &str,
    sp: (usize, usize),
    cp: (usize, usize),
) -> PyResult<(Packing, TokenSplit)> {
    let packing = Packing::parse(packing).ok_or_else(|| {
        arg_err(format!(
            "unknown packing {packing:?} (thd, bshd or thd_contiguous_cp)"
        ))
    })?;
    Ok((
        packing,
        TokenSplit {
            sp_size: sp.0,
            sp_rank: sp.1,
            cp_size: cp.0,
            cp_rank: cp.1,
        },
    ))
}

/// The padding a caller gave: `cu_seqlens_padded` (thd; with `trailing_padding`, it may end
/// with a padding-only segment) or `padded_len` (bshd), at most one.
fn padding<'a>(
    cu_seqlens_padded: Option<&'a [usize]>,
    trailing_padding: bool,
    padded_len: Option<usize>,
) -> PyResult<Padding<'a>> {
    match (cu_seqlens_padded, padded_len) {
        (None, _) if trailing_padding => Err(arg_err(
            "trailing_padding describes cu_seqlens_padded, which is not given",
        )),
        (None, None) => Ok(Padding::Aligned),
        (Some(cu), None) if trailing_padding => Ok(Padding::CuSeqlensWithTail(cu)),
        (Some(cu), None) => Ok(Padding::CuSeqlens(cu)),
        (None, Some(n)) => Ok(Padding::SeqLen(n)),
        (Some(_), Some(_)) => Err(arg_err(
            "give cu_seqlens_padded (thd) or padded_len (bshd), not both",
        )),
    }
}

/// The (sequence, position) of every token the rank's routers see, int64 `[tokens, 2]`,
/// `(-1, -1)` for padding. `sp` and `cp` are `(size, rank)`; `cu_seqlens_padded` (thd) or
/// `padded_len` (bshd) give the caller's padding instead of the inferred one;
/// `trailing_padding` lets `cu_seqlens_padded` end with a padding-only segment (slime's).
#[pyfunction]
#[pyo3(signature = (seq_lens, packing = "thd", sp = (1, 0), cp = (1, 0), *,
    cu_seqlens_padded = None, padded_len = None, trailing_padding = false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn rank_tokens<'py>(
    py: Python<'py>,
    #[pyo3(from_py_with = args::seq_lens)] seq_lens: Vec<usize>,
    packing: &str,
    #[pyo3(from_py_with = args::sp)] sp: (usize, usize),
    #[pyo3(from_py_with = args::cp)] cp: (usize, usize),
    #[pyo3(from_py_with = args::cu_seqlens_padded)] cu_seqlens_padded: Option<Vec<usize>>,
    #[pyo3(from_py_with = args::padded_len)] padded_len: Option<usize>,
    trailing_padding: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let (packing, ts) = token_split(packing, sp, cp)?;
    let pad = padding(cu_seqlens_padded.as_deref(), trailing_padding, padded_len)?;
    // Pure Rust over copied arguments: other Python threads go on meanwhile.
    let out = py
        .allow_threads(|| {
            split::rank_tokens(&seq_lens, packing, ts, pad).map(|slots| {
                let mut out = Vec::with_capacity(slots.len() * 2);
                for s in &slots {
                    match *s {
                        TokenSlot::Token { seq, pos } => out.extend([seq as i64, pos as i64]),
                        TokenSlot::Pad => out.extend([-1, -1]),
                    }
                }
                out
            })
        })
        .map_err(route_err)?;
    let rows = out.len() / 2;
    to_numpy(py, out, &[rows, 2])
}

/// Replay ids int64 `[routers, tokens, top_k]` for the routers of `router_layers` on one
/// rank (see r3-routing's `megatron::replay_ids_with_lens`), padded as [`rank_tokens`] pads.
/// `seq_lens` (default: each table's rows + 1) may run past a table's routes, whose extra
/// tokens replay filler; `num_tokens`, the tokens the rank's routers see, is checked against
/// the count the tables and padding give.
#[pyfunction]
#[pyo3(signature = (tables, router_layers, packing = "thd", sp = (1, 0), cp = (1, 0), *,
    cu_seqlens_padded = None, padded_len = None, trailing_padding = false, seq_lens = None,
    num_tokens = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn replay_ids<'py>(
    py: Python<'py>,
    tables: Vec<PyRef<'py, PyRouteTable>>,
    #[pyo3(from_py_with = args::router_layers)] router_layers: Vec<usize>,
    packing: &str,
    #[pyo3(from_py_with = args::sp)] sp: (usize, usize),
    #[pyo3(from_py_with = args::cp)] cp: (usize, usize),
    #[pyo3(from_py_with = args::cu_seqlens_padded)] cu_seqlens_padded: Option<Vec<usize>>,
    #[pyo3(from_py_with = args::padded_len)] padded_len: Option<usize>,
    trailing_padding: bool,
    #[pyo3(from_py_with = args::seq_lens)] seq_lens: Option<Vec<usize>>,
    #[pyo3(from_py_with = args::num_tokens)] num_tokens: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let (packing, ts) = token_split(packing, sp, cp)?;
    let pad = padding(cu_seqlens_padded.as_deref(), trailing_padding, padded_len)?;
    let refs: Vec<&r3_routing::RouteTable> = tables.iter().map(|t| &t.table).collect();
    // The tables are frozen (immutable) and kept alive by `tables`: the gather runs without
    // the GIL.
    let r = py
        .allow_threads(|| {
            split::replay_ids_with_lens(
                &refs,
                seq_lens.as_deref(),
                &router_layers,
                packing,
                ts,
                pad,
            )
        })
        .map_err(route_err)?;
    // Megatron's replay gathers and scatters these rows against the router's scores, which
    // accept fewer index rows than tokens: a short replay would leave the rest of the
    // rank's tokens routed to no expert, without an error. So the count is checked here.
    if let Some(n) = num_tokens {
        if n != r.num_tokens {
            return Err(arg_err(format!(
                "num_tokens: the rank's routers see {n} tokens, but the tables and padding \
                 give {} (pass the data loader's own padding: cu_seqlens_padded for thd, \
                 padded_len for bshd)",
                r.num_tokens
            )));
        }
    }
    to_numpy(py, r.ids, &[r.num_routers, r.num_tokens, r.top_k])
}
