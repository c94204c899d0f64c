"""verl's layout: ``routed_experts`` ``[batch, seq, num_hidden_layers, top_k]``, aligned with
``input_ids`` / ``attention_mask`` (left-padded prompt, right-padded response), zeros where no
route was recorded — padding and each sequence's last token.

Where it plugs in: verl's agent loop places each rollout's ``[rows, layers, top_k]`` array at
the sequence's first attended position; :func:`from_verl` reads such a batch back into
validated tables (a zero-padded MoE cell, a dense layer carrying ids, or a short array raises
:class:`r3.RouteError` instead of replaying expert 0), and :func:`to_verl` writes tables into
the batch tensor verl's actor expects (``torch.from_numpy(to_verl(...))``)::

    tables = r3.verl.from_verl(batch["routed_experts"].numpy(), batch["attention_mask"].numpy(),
                               layout=layout)
    r3.megatron.set_replay(tables, layout, pp_rank=..., pp_size=..., tp_sp=(tp, tp_rank))
"""

from typing import List, Sequence

import numpy as np

from r3._dtype import check_id_dtype
from r3._r3 import LayerLayout, RouteError, RouteTable

__all__ = ["from_verl", "to_verl"]


def _spans(attention_mask) -> List[range]:
    """The attended positions of each row, checked to be one contiguous run."""
    mask = np.asarray(attention_mask)
    if mask.ndim != 2:
        raise RouteError(f"attention_mask: expected [batch, seq], got shape {mask.shape}")
    spans = []
    for b, row in enumerate(mask != 0):
        idx = np.flatnonzero(row)
        if idx.size == 0:
            raise RouteError(f"attention_mask row {b} attends to no token")
        first, n = int(idx[0]), int(idx.size)
        if int(idx[-1]) != first + n - 1:
            raise RouteError(
                f"attention_mask row {b}: attended positions are not contiguous "
                f"({first}..{int(idx[-1])} holds {n} tokens)"
            )
        spans.append(range(first, first + n))
    return spans


def from_verl(routed_experts, attention_mask, *, layout: LayerLayout) -> List[RouteTable]:
    """One validated table per batch row: the routes of every attended token but the last
    (which no engine routes), row 0 at the sequence's first token."""
    routes = np.asarray(routed_experts)
    spans = _spans(attention_mask)
    if routes.ndim != 4 or routes.shape[:2] != (len(spans), np.asarray(attention_mask).shape[1]):
        raise RouteError(
            f"routed_experts: expected [batch, seq, layers, top_k] matching attention_mask "
            f"{np.asarray(attention_mask).shape}, got shape {routes.shape}"
        )
    tables = []
    for b, span in enumerate(spans):
        rows = routes[b, span.start : span.stop - 1]
        try:
            tables.append(RouteTable.from_vllm(rows, layout=layout))
        except RouteError as e:
            raise RouteError(f"batch row {b}: {e}") from None
    return tables


def to_verl(tables: Sequence[RouteTable], attention_mask, *, dtype=np.int32) -> np.ndarray:
    """verl's ``routed_experts`` for these tables (row ``b`` for batch row ``b``): each
    sequence's routes from its first attended position, zeros elsewhere. Every table must
    cover its whole sequence (``attended tokens - 1`` rows from position 0). ``dtype`` must
    hold every expert id of the layout exactly, else :class:`r3.RouteError`."""
    spans = _spans(attention_mask)
    if len(tables) != len(spans):
        raise RouteError(f"{len(tables)} tables for {len(spans)} batch rows")
    if not tables:
        raise RouteError("no tables")
    layout = tables[0].layout
    dtype = check_id_dtype(dtype, layout)
    seq = np.asarray(attention_mask).shape[1]
    out = np.zeros((len(spans), seq, layout.num_hidden_layers, layout.top_k), dtype=dtype)
    for b, (table, span) in enumerate(zip(tables, spans)):
        if table.layout != layout:
            raise RouteError(f"batch row {b}: table layout differs from row 0's")
        if table.start_pos != 0 or table.num_rows != len(span) - 1:
            raise RouteError(
                f"batch row {b}: the table covers positions [{table.start_pos}, "
                f"{table.end_pos}), the sequence feeds [0, {len(span) - 1})"
            )
        if not table.present.all():
            tok, col = np.argwhere(~table.present)[0]
            raise RouteError(
                f"batch row {b}: token {int(tok)}, layer {table.layers[int(col)]}: "
                f"no route recorded (verl has no missing mark)"
            )
        out[b, span.start : span.stop - 1] = table.to_numpy_all_layers()
    return out
