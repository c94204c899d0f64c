"""Megatron-Core adapter: the replay ids of one rank's local routers.

Megatron-Core's ``RouterReplay`` (``megatron/core/transformer/moe/router_replay.py``) keeps one
instance per locally built ``TopKRouter`` in construction order and takes one int64
``[num_tokens, top_k]`` tensor per instance; it does no pipeline, virtual-pipeline,
sequence-parallel or context-parallel slicing. :func:`replay_data` does that slicing
(computed by r3-routing: :class:`PipelineSplit` mirrors ``get_num_layers_to_build`` and
``get_transformer_layer_offset``, or a custom ``pipeline_model_parallel_layout``; the token
order is Megatron's zigzag context-parallel split followed by the sequence-parallel split of
the first dimension), :func:`set_replay` hands the result to ``RouterReplay`` with an action
(under virtual pipelining, to one model chunk's routers at a time), and :func:`clear_replay`
drops what was handed once a step is done.

Sequence ``i`` is ``tables[i].num_rows + 1`` tokens long (a rollout engine routes every token
but the last). Its last token and padding replay filler ids no loss reads, spread over the
experts (the rank's ``t``-th token replays ``(t * top_k + j) % num_experts``, ``j < top_k``);
every other cell must be present, else :class:`r3.RouteError` names the sequence, token and
layer. Padding is inferred from the split unless the caller gives its own
(``cu_seqlens_padded`` for ``thd``, ``padded_len`` for ``bshd``), which is then checked.

Megatron's replay accepts fewer id rows than the router has tokens (``gather`` / ``scatter``
only need the index no longer) and routes the rest to no expert, silently: give
``num_tokens`` (the tokens the rank's routers see) and the count is checked. Frameworks pad
otherwise than the inferred padding: verl pads every packed sequence to ``tp`` even without
sequence parallelism (pass its ``cu_seqlens_padded``); slime pads each context-parallel rank's
tokens at the end (pass its ``packed_seq_params.cu_seqlens_q`` with
``trailing_padding=True``; with slime's ``--allgather-cp``, also
``packing="thd_contiguous_cp"``).

torch is imported by :func:`replay_data`, megatron.core by :func:`set_replay`; neither is
needed to import this module.
"""

from typing import List, Optional, Sequence, Tuple

from r3._r3 import LayerLayout, PipelineSplit, RouteError, RouteTable, rank_tokens, replay_ids

__all__ = [
    "PipelineSplit",
    "check_replay_config",
    "clear_replay",
    "pipeline_from_config",
    "rank_tokens",
    "replay_arrays",
    "replay_data",
    "router_layers",
    "set_replay",
]

_PIPELINE_KEYS = (
    "pp_rank",
    "pp_size",
    "vp_size",
    "first_stage_layers",
    "last_stage_layers",
    "account_for_embedding",
    "account_for_loss",
    "pipeline_layout",
)

# The pipeline keywords of :func:`router_layers` and the TransformerConfig fields they
# mirror, which set_replay reads from its config.
_CONFIG_PIPELINE_FIELDS = (
    ("pp_size", "pipeline_model_parallel_size"),
    ("vp_size", "virtual_pipeline_model_parallel_size"),
    ("first_stage_layers", "num_layers_in_first_pipeline_stage"),
    ("last_stage_layers", "num_layers_in_last_pipeline_stage"),
    ("account_for_embedding", "account_for_embedding_in_pipeline_split"),
    ("account_for_loss", "account_for_loss_in_pipeline_split"),
    ("pipeline_layout", "pipeline_model_parallel_layout"),
)


def router_layers(
    layout: LayerLayout,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    vp_stage: Optional[int] = None,
    vp_size: Optional[int] = None,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
    pipeline_layout=None,
) -> List[int]:
    """Global MoE layers whose routers this pipeline rank builds, in construction order
    (every model chunk in turn when the pipeline has virtual stages and ``vp_stage`` is
    None). ``pipeline_layout`` is Megatron's ``pipeline_model_parallel_layout`` (its string
    form such as ``"Et|tt|tt|tL"``, its list form, or the ``PipelineParallelLayerLayout`` a
    ``TransformerConfig`` holds), which then decides the split alone; its virtual stages
    need no ``vp_size``."""
    split = PipelineSplit(
        layout.num_hidden_layers,
        pp_size,
        vp_size=vp_size,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        account_for_embedding=account_for_embedding,
        account_for_loss=account_for_loss,
        pipeline_layout=pipeline_layout,
    )
    return [layer for layer in split.local_layers(pp_rank, vp_stage) if layout.is_moe(layer)]


def _count(value: int, name: str) -> int:
    """``value`` as an int, refused by name when negative (not the ``OverflowError`` the
    compiled core's unsigned arguments would raise)."""
    value = int(value)
    if value < 0:
        raise RouteError(f"{name} must be a non-negative integer, got {value}")
    return value


def _group(pair: Optional[Tuple[int, int]], name: str) -> Tuple[int, int]:
    if pair is None:
        return (1, 0)
    try:
        size, rank = pair
        size, rank = int(size), int(rank)
    except (TypeError, ValueError):
        raise RouteError(f"{name} must be a (size, rank) pair or None, got {pair!r}") from None
    return (_count(size, f"{name}[0]"), _count(rank, f"{name}[1]"))


def _ints(values, name: str) -> Optional[List[int]]:
    """``values`` (a list, numpy array or torch tensor of ints) as a list of non-negative
    ints, or None."""
    if values is None:
        return None
    if hasattr(values, "tolist"):  # numpy arrays and torch tensors (on any device)
        values = values.tolist()
    try:
        values = [int(v) for v in values]
    except (TypeError, ValueError):
        raise RouteError(f"{name} must be a sequence of ints, got {values!r}") from None
    return [_count(v, f"{name}[{i}]") for i, v in enumerate(values)]


# Megatron-Core routes without consulting RouterReplay under these settings
# (moe_utils.topk_routing_with_score_function returns the fused kernel's choice before
# get_replay_topk is reached; TopKRouter.routing calls sinkhorn_load_balancing or
# quantile_balancing instead of topk_routing_with_score_function), so replay would be off
# without an error.
_BYPASSING_ROUTING_TYPES = ("sinkhorn", "quantile_balancing")


def _transformer_config(config):
    """``config`` itself when it is a ``TransformerConfig``, else the one it holds as
    ``.config`` (a router, a model); None when neither."""
    if hasattr(config, "moe_enable_routing_replay"):
        return config
    held = getattr(config, "config", None)
    return held if hasattr(held, "moe_enable_routing_replay") else None


def _same_pipeline_field(key: str, given, from_config, num_layers: int, pp_size: int) -> bool:
    if key == "vp_size":
        # Megatron leaves it None without interleaving; 1 says the same.
        return (given or 1) == (from_config or 1)
    if key == "pipeline_layout":
        if given is None or from_config is None:
            return given is from_config

        # Either form (string, list, Megatron's object) as the stages r3 parsed from it.
        def stages(value):
            return PipelineSplit(num_layers, pp_size, pipeline_layout=value).pipeline_layout

        return stages(given) == stages(from_config)
    return given == from_config


def pipeline_from_config(config, num_layers: int, given: Optional[dict] = None) -> dict:
    """The pipeline keywords of :func:`router_layers` (``pp_size``, ``vp_size``,
    ``first_stage_layers``, ``last_stage_layers``, ``account_for_embedding``,
    ``account_for_loss``, ``pipeline_layout``) read from Megatron-Core's
    ``TransformerConfig`` (or a router or model holding it as ``.config``), merged with
    ``given``: a keyword in ``given`` that differs from the config raises
    :class:`r3.RouteError` naming both (``pp_rank`` and ``vp_stage`` are the caller's: the
    config holds neither). ``num_layers`` (the model's) is only used to compare layouts."""
    cfg = _transformer_config(config)
    if cfg is None:
        raise RouteError(
            f"config: expected Megatron-Core's TransformerConfig or a module holding one as "
            f".config, got {type(config).__name__}"
        )
    out = dict(given or {})
    pp_size = getattr(cfg, "pipeline_model_parallel_size", 1)
    for key, field in _CONFIG_PIPELINE_FIELDS:
        if not hasattr(cfg, field):
            continue
        value = getattr(cfg, field)
        if key not in out:
            out[key] = value
        elif not _same_pipeline_field(key, out[key], value, num_layers, pp_size):
            raise RouteError(f"{key}={out[key]!r} differs from the config's {field}={value!r}")
    return out


def check_replay_config(config) -> None:
    """Raises :class:`r3.RouteError` naming the setting when Megatron-Core's routers would
    not replay under ``config`` (a ``TransformerConfig``, or a module holding one as
    ``.config``: a ``TopKRouter``, a model): ``moe_enable_routing_replay`` off (no
    ``RouterReplay`` is built), ``moe_router_fusion`` on (the fused top-k kernel chooses the
    experts and never reads the replay ids), or ``moe_router_load_balancing_type``
    ``"sinkhorn"`` / ``"quantile_balancing"`` (routings that bypass the replay)."""
    cfg = _transformer_config(config)
    if cfg is None:
        raise RouteError(
            f"config: expected Megatron-Core's TransformerConfig or a module holding one as "
            f".config, got {type(config).__name__}"
        )
    if not cfg.moe_enable_routing_replay:
        raise RouteError(
            "moe_enable_routing_replay is False: Megatron-Core builds no RouterReplay, nothing "
            "would replay"
        )
    if getattr(cfg, "moe_router_fusion", False):
        raise RouteError(
            "moe_router_fusion is True: Megatron-Core's fused top-k kernel chooses the experts "
            "and never reads RouterReplay's ids (routing would be free); turn it off to replay"
        )
    routing_type = getattr(cfg, "moe_router_load_balancing_type", None)
    if isinstance(routing_type, str) and routing_type in _BYPASSING_ROUTING_TYPES:
        raise RouteError(
            f"moe_router_load_balancing_type is {routing_type!r}: Megatron-Core's "
            f"{routing_type} routing never reads RouterReplay's ids (routing would be free)"
        )


def replay_arrays(
    tables: Sequence[RouteTable],
    layout: LayerLayout,
    *,
    tp_sp: Optional[Tuple[int, int]] = None,
    cp: Optional[Tuple[int, int]] = None,
    packing: str = "thd",
    cu_seqlens_padded=None,
    trailing_padding: bool = False,
    padded_len: Optional[int] = None,
    seq_lens=None,
    num_tokens: Optional[int] = None,
    **pipeline,
):
    """:func:`replay_data` as one numpy int64 array ``[routers, tokens, top_k]`` (no torch);
    ``pipeline`` takes the keywords of :func:`router_layers`."""
    layers = router_layers(layout, **pipeline)
    return replay_ids(
        list(tables),
        layers,
        packing,
        _group(tp_sp, "tp_sp"),
        _group(cp, "cp"),
        cu_seqlens_padded=_ints(cu_seqlens_padded, "cu_seqlens_padded"),
        padded_len=padded_len,
        trailing_padding=trailing_padding,
        seq_lens=_ints(seq_lens, "seq_lens"),
        num_tokens=num_tokens,
    )


def replay_data(
    tables: Sequence[RouteTable],
    layout: LayerLayout,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    vp_stage: Optional[int] = None,
    vp_size: Optional[int] = None,
    tp_sp: Optional[Tuple[int, int]] = None,
    cp: Optional[Tuple[int, int]] = None,
    packing: str = "thd",
    cu_seqlens_padded=None,
    trailing_padding: bool = False,
    padded_len: Optional[int] = None,
    seq_lens=None,
    num_tokens: Optional[int] = None,
    device=None,
    **split,
):
    """The int64 ``torch.Tensor`` ``[tokens, top_k]`` of each local router of this rank, in
    Megatron's construction order, for the micro-batch of sequences ``tables``: with
    ``vp_stage`` the routers of that model chunk only, without it those of every chunk.

    ``tp_sp``: ``(tensor-parallel size, rank)`` when sequence parallelism is on; ``cp``:
    ``(context-parallel size, rank)``; ``packing``: ``"thd"`` (packed sequences, each padded
    to the split's alignment) or ``"bshd"`` (one padded batch, position-major). The padding
    is inferred unless given: ``cu_seqlens_padded`` (``thd``; the padded cumulative offsets
    of ``PackedSeqParams``, one more than ``tables``, from 0 — verl's ``cu_seqlens_padded``,
    which verl pads to ``tp`` even without sequence parallelism, so always pass it; with
    ``trailing_padding=True`` one more entry may close a padding-only segment, as in slime's
    ``packed_seq_params.cu_seqlens_q``) or ``padded_len`` (``bshd``; the batch's padded
    sequence length), checked against the tables and the split. ``seq_lens``: each
    sequence's tokens when they run past its table's rows + 1 (tokens never fed to the
    rollout engine, which replay filler: see :func:`r3.verl.seq_lens`). ``num_tokens``: the
    tokens this rank's routers see (``cu_seqlens_padded[-1] // cp // tp`` for ``thd`` with
    sequence parallelism, the router input's ``shape[0] * shape[1]``), checked against the
    rows built, since Megatron's replay takes too few rows silently. Further keywords
    (``first_stage_layers``, ``last_stage_layers``, ``account_for_embedding``,
    ``account_for_loss``, ``pipeline_layout``) describe an uneven or custom pipeline as
    ``TransformerConfig`` does (see :func:`router_layers`).

    ``packing="thd_contiguous_cp"`` is slime's ``--allgather-cp`` layout: the sequences
    packed unpadded and the whole stream cut into ``cp`` contiguous parts (pass slime's
    ``packed_seq_params.cu_seqlens_q`` with ``trailing_padding=True``).

    The tensors are views of one ``[routers, tokens, top_k]`` block: every router of the call
    holds its row until the next call or :func:`clear_replay` replaces them all, so a copy per
    router would only add a copy.
    """
    import torch

    ids = replay_arrays(
        tables,
        layout,
        pp_rank=pp_rank,
        pp_size=pp_size,
        vp_stage=vp_stage,
        vp_size=vp_size,
        tp_sp=tp_sp,
        cp=cp,
        packing=packing,
        cu_seqlens_padded=cu_seqlens_padded,
        trailing_padding=trailing_padding,
        padded_len=padded_len,
        seq_lens=seq_lens,
        num_tokens=num_tokens,
        **split,
    )
    whole = torch.from_numpy(ids)
    if device is not None:
        whole = whole.to(device)
    return list(whole.unbind(0))


def set_replay(
    tables: Sequence[RouteTable], layout: LayerLayout, *, action="replay_forward", config=None, **kwargs
):
    """:func:`replay_data` handed to Megatron-Core's ``RouterReplay``, and the global action
    set (``"replay_forward"``, ``"replay_backward"``, ``"record"`` or a
    ``RouterReplayAction``). Returns the tensors.

    ``config`` (the model's ``TransformerConfig``, or a router or model holding it as
    ``.config``) is checked first by :func:`check_replay_config`: settings under which
    Megatron-Core routes without reading the replay ids (``moe_router_fusion``, sinkhorn or
    quantile-balancing routing) raise :class:`r3.RouteError` rather than leave replay off
    without a trace. The pipeline split is then read from it too
    (:func:`pipeline_from_config`: ``pipeline_model_parallel_size``, the virtual size, the
    uneven stages, the embedding / loss accounting and a custom
    ``pipeline_model_parallel_layout``), and a pipeline keyword given that disagrees with it
    is refused; ``pp_rank`` and ``vp_stage`` are still the caller's.

    Without ``vp_stage`` every router instance of the rank gets this micro-batch
    (``RouterReplay.set_replay_data``, which refuses a count that differs from its
    instances). Under virtual pipelining the model chunks run different micro-batches: call
    it before each chunk's forward with that chunk's ``vp_stage``, and only that chunk's
    instances — those after the MoE routers of the rank's earlier chunks, in construction
    order — get the ids (``set_target_indices``, as verl's ``set_router_replay_data`` does).

    Each call appends to every targeted instance's ``replay_backward_list``, which only a
    recomputing backward (``"replay_backward"``) pops: call :func:`clear_replay` once the
    step's backward is done (every step, recompute or not), or the lists and the tensors they
    hold grow step after step.
    """
    if config is not None:
        check_replay_config(config)
        kwargs = pipeline_from_config(config, layout.num_hidden_layers, kwargs)
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    if not isinstance(action, RouterReplayAction):
        action = RouterReplayAction(action)
    vp_stage = kwargs.get("vp_stage")
    data = replay_data(tables, layout, **kwargs)
    if vp_stage is None:
        RouterReplay.set_replay_data(data)
    else:
        pipeline = {k: kwargs[k] for k in _PIPELINE_KEYS if k in kwargs}
        instances = RouterReplay.global_router_replay_instances
        every_chunk = router_layers(layout, **pipeline)
        if len(every_chunk) != len(instances):
            raise RouteError(
                f"the rank's model chunks build {len(every_chunk)} MoE routers (layers "
                f"{every_chunk}), but RouterReplay holds {len(instances)} instances"
            )
        offset = sum(len(router_layers(layout, vp_stage=s, **pipeline)) for s in range(vp_stage))
        for instance, ids in zip(instances[offset : offset + len(data)], data):
            instance.set_target_indices(ids)
    RouterReplay.set_global_router_replay_action(action)
    return data


def clear_replay() -> None:
    """Drops every router's replay ids and its ``replay_backward_list``
    (``RouterReplay.clear_global_indices``) and its action, so routing is free again
    (``RouterReplay.clear_global_router_replay_action``). Call it after each training step's
    backward, as verl does after each forward-backward."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
