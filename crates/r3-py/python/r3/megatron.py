"""Megatron-Core adapter: the replay ids of one rank's local routers.

Megatron-Core's ``RouterReplay`` (``megatron/core/transformer/moe/router_replay.py``) keeps one
instance per locally built ``TopKRouter`` in construction order and takes one int64
``[num_tokens, top_k]`` tensor per instance; it does no pipeline, virtual-pipeline,
sequence-parallel or context-parallel slicing. :func:`replay_data` does that slicing
(computed by r3-routing: :class:`PipelineSplit` mirrors ``get_num_layers_to_build`` and
``get_transformer_layer_offset``; the token order is Megatron's zigzag context-parallel split
followed by the sequence-parallel split of the first dimension), and :func:`set_replay` hands
the result to ``RouterReplay`` with an action.

Sequence ``i`` is ``tables[i].num_rows + 1`` tokens long (a rollout engine routes every token
but the last). Its last token and alignment padding replay experts ``0..top_k``; every other
cell must be present, else :class:`r3.RouteError` names the sequence, token and layer.

torch is imported by :func:`replay_data`, megatron.core by :func:`set_replay`; neither is
needed to import this module.
"""

from typing import List, Optional, Sequence, Tuple

from r3._r3 import LayerLayout, PipelineSplit, RouteError, RouteTable, rank_tokens, replay_ids

__all__ = ["PipelineSplit", "rank_tokens", "replay_arrays", "replay_data", "router_layers", "set_replay"]


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


def replay_arrays(
    tables: Sequence[RouteTable],
    layout: LayerLayout,
    *,
    tp_sp: Optional[Tuple[int, int]] = None,
    cp: Optional[Tuple[int, int]] = None,
    packing: str = "thd",
    **pipeline,
):
    """:func:`replay_data` as one numpy int64 array ``[routers, tokens, top_k]`` (no torch);
    ``pipeline`` takes the keywords of :func:`router_layers`."""
    layers = router_layers(layout, **pipeline)
    return replay_ids(list(tables), layers, packing, _group(tp_sp, "tp_sp"), _group(cp, "cp"))


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
    device=None,
    **split,
):
    """The int64 ``torch.Tensor`` ``[tokens, top_k]`` of each local router of this rank, in
    Megatron's construction order, for the micro-batch of sequences ``tables``.

    ``tp_sp``: ``(tensor-parallel size, rank)`` when sequence parallelism is on; ``cp``:
    ``(context-parallel size, rank)``; ``packing``: ``"thd"`` (packed sequences, each padded
    to the split's alignment) or ``"bshd"`` (one padded batch, position-major). Further
    keywords (``first_stage_layers``, ``last_stage_layers``, ``account_for_embedding``,
    ``account_for_loss``) describe an uneven pipeline as ``TransformerConfig`` does.
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
        **split,
    )
    whole = torch.from_numpy(ids)
    if device is not None:
        whole = whole.to(device)
    return list(whole.unbind(0))


def set_replay(tables: Sequence[RouteTable], layout: LayerLayout, *, action="replay_forward", **kwargs):
    """:func:`replay_data`, handed to ``RouterReplay.set_replay_data``, and the global action
    set (``"replay_forward"``, ``"replay_backward"``, ``"record"`` or a ``RouterReplayAction``).
    Returns the tensors. ``RouterReplay`` refuses a count that differs from its instances."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    data = replay_data(tables, layout, **kwargs)
    if not isinstance(action, RouterReplayAction):
        action = RouterReplayAction(action)
    RouterReplay.set_replay_data(data)
    RouterReplay.set_global_router_replay_action(action)
    return data
