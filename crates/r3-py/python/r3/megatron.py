"""Megatron-Core adapter: the replay ids of one rank's local routers.

Megatron-Core's ``RouterReplay`` (``megatron/core/transformer/moe/router_replay.py``) keeps one
instance per locally built ``TopKRouter`` in construction order and takes one int64
``[num_tokens, top_k]`` tensor per instance; it does no pipeline, virtual-pipeline,
sequence-parallel or context-parallel slicing. :func:`replay_data` does that slicing
(computed by r3-routing: :class:`PipelineSplit` mirrors ``get_num_layers_to_build`` and
``get_transformer_layer_offset``; the token order is Megatron's zigzag context-parallel split
followed by the sequence-parallel split of the first dimension), :func:`set_replay` hands
the result to ``RouterReplay`` with an action (under virtual pipelining, to one model chunk's
routers at a time), and :func:`clear_replay` drops what was handed once a step is done.

Sequence ``i`` is ``tables[i].num_rows + 1`` tokens long (a rollout engine routes every token
but the last). Its last token and padding replay filler ids no loss reads, spread over the
experts (the rank's ``t``-th token replays ``(t * top_k + j) % num_experts``, ``j < top_k``);
every other cell must be present, else :class:`r3.RouteError` names the sequence, token and
layer. Padding is inferred from the split unless the caller gives its own
(``cu_seqlens_padded`` for ``thd``, ``padded_len`` for ``bshd``), which is then checked.

torch is imported by :func:`replay_data`, megatron.core by :func:`set_replay`; neither is
needed to import this module.
"""

from typing import List, Optional, Sequence, Tuple

from r3._r3 import LayerLayout, PipelineSplit, RouteError, RouteTable, rank_tokens, replay_ids

__all__ = [
    "PipelineSplit",
    "clear_replay",
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
) -> List[int]:
    """Global MoE layers whose routers this pipeline rank builds, in construction order
    (every model chunk in turn when ``vp_size`` is set and ``vp_stage`` is None)."""
    split = PipelineSplit(
        layout.num_hidden_layers,
        pp_size,
        vp_size=vp_size,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        account_for_embedding=account_for_embedding,
        account_for_loss=account_for_loss,
    )
    return [layer for layer in split.local_layers(pp_rank, vp_stage) if layout.is_moe(layer)]


def _group(pair: Optional[Tuple[int, int]], name: str) -> Tuple[int, int]:
    if pair is None:
        return (1, 0)
    try:
        size, rank = pair
    except (TypeError, ValueError):
        raise RouteError(f"{name} must be a (size, rank) pair or None, got {pair!r}") from None
    return (int(size), int(rank))


def _ints(values, name: str) -> Optional[List[int]]:
    """``values`` (a list, numpy array or torch tensor of ints) as a list of ints, or None."""
    if values is None:
        return None
    if hasattr(values, "tolist"):  # numpy arrays and torch tensors (on any device)
        values = values.tolist()
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise RouteError(f"{name} must be a sequence of ints, got {values!r}") from None


def replay_arrays(
    tables: Sequence[RouteTable],
    layout: LayerLayout,
    *,
    tp_sp: Optional[Tuple[int, int]] = None,
    cp: Optional[Tuple[int, int]] = None,
    packing: str = "thd",
    cu_seqlens_padded=None,
    padded_len: Optional[int] = None,
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
    padded_len: Optional[int] = None,
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
    of ``PackedSeqParams``, one more than ``tables``, from 0) or ``padded_len`` (``bshd``; the
    batch's padded sequence length), checked against the tables and the split. Further
    keywords (``first_stage_layers``, ``last_stage_layers``, ``account_for_embedding``,
    ``account_for_loss``) describe an uneven pipeline as ``TransformerConfig`` does.

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
        padded_len=padded_len,
        **split,
    )
    whole = torch.from_numpy(ids)
    if device is not None:
        whole = whole.to(device)
    return list(whole.unbind(0))


def set_replay(tables: Sequence[RouteTable], layout: LayerLayout, *, action="replay_forward", **kwargs):
    """:func:`replay_data` handed to Megatron-Core's ``RouterReplay``, and the global action
    set (``"replay_forward"``, ``"replay_backward"``, ``"record"`` or a
    ``RouterReplayAction``). Returns the tensors.

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
