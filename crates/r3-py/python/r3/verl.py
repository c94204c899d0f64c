"""verl's layout: ``routed_experts`` ``[batch, seq, num_hidden_layers, top_k]``, aligned with
``input_ids`` / ``attention_mask`` (left-padded prompt, right-padded response), zeros where no
route was recorded — padding and each sequence's last token.

Where it plugs in: verl's agent loop places each rollout's ``[rows, layers, top_k]`` array at
the sequence's first attended position; :func:`from_verl` reads such a batch back into
validated tables (a zero-padded MoE cell, a dense layer carrying ids, or a short array raises
:class:`r3.RouteError` instead of replaying expert 0), and :func:`to_verl` writes tables into
the batch tensor verl's actor expects (``torch.from_numpy(to_verl(...))``)::

    mask = batch["attention_mask"].numpy()
    tables = r3.verl.from_verl(batch["routed_experts"].numpy(), mask, layout=layout,
                               trailing_unrouted="filler",
                               response_mask=batch["response_mask"].numpy())
    r3.megatron.set_replay(tables, layout, pp_rank=..., pp_size=..., tp_sp=(tp, tp_rank),
                           seq_lens=r3.verl.seq_lens(mask),
                           cu_seqlens_padded=packed_seq_params.cu_seqlens_q_padded)

verl pads each packed sequence to ``tp`` even without sequence parallelism, so pass its
``cu_seqlens_padded`` rather than rely on the inferred padding.

A multi-turn rollout that verl ends on an interaction turn appends the user's tokens after
the engine's last call: they are attended but were never fed to the engine, and their rows
stay 0. ``trailing_unrouted="filler"`` accepts such a trailing run of all-zero rows: the table
holds the routed rows before it, and :func:`seq_lens` gives :func:`r3.megatron.replay_data`
the sequences' whole lengths, so those tokens replay filler. They carry no loss (no later
token does either); ``response_mask`` checks it. With top-1 routing, a row choosing expert 0
in every MoE layer cannot be told from an unrouted one.
"""

from typing import List, Optional, Sequence

import numpy as np

from r3._dtype import check_id_dtype
from r3._r3 import LayerLayout, RouteError, RouteTable

__all__ = ["from_verl", "seq_lens", "to_verl"]


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


def seq_lens(attention_mask) -> List[int]:
    """The attended tokens of each batch row: the sequences' lengths for
    :func:`r3.megatron.replay_data` (``seq_lens=``)."""
    return [len(span) for span in _spans(attention_mask)]


def _routed_end(rows: np.ndarray) -> int:
    """One past the last row holding any nonzero id (0 when every row is zero)."""
    nonzero = np.flatnonzero(rows.reshape(len(rows), -1).any(axis=1))
    return int(nonzero[-1]) + 1 if nonzero.size else 0


def _check_no_loss(response_mask, b: int, span: range, seq: int, first: int) -> None:
    """Sequence positions ``first ..`` of batch row ``b`` carry no loss: their
    ``response_mask`` (verl's, over the last ``response_length`` columns) is 0."""
    mask = np.asarray(response_mask)
    prompt_cols = seq - mask.shape[1]
    for q in range(first, len(span)):
        col = span.start + q - prompt_cols
        if col >= 0 and mask[b, col] != 0:
            raise RouteError(
                f"batch row {b}: token {q} carries loss (response_mask) but token {q - 1}, "
                f"whose logits predict it, has no route: only tokens after the engine's last "
                f"call (no loss) may replay filler"
            )


def from_verl(
    routed_experts,
    attention_mask,
    *,
    layout: LayerLayout,
    trailing_unrouted: str = "error",
    response_mask=None,
) -> List[RouteTable]:
    """One validated table per batch row: the routes of every attended token but the last
    (which no engine routes), row 0 at the sequence's first token.

    ``trailing_unrouted="filler"``: a trailing run of all-zero rows (tokens appended after the
    engine's last call, e.g. an interaction turn that ended the rollout) is left out of the
    table instead of refused; replay those tokens as filler by passing :func:`seq_lens` to
    :func:`r3.megatron.replay_data`. A zero cell before the run is still refused, as is a row
    with no route at all. ``response_mask`` (verl's ``[batch, response_length]``) checks that
    no token after the routed rows carries loss."""
    if trailing_unrouted not in ("error", "filler"):
        raise RouteError(f"trailing_unrouted must be 'error' or 'filler', got {trailing_unrouted!r}")
    routes = np.asarray(routed_experts)
    spans = _spans(attention_mask)
    seq = np.asarray(attention_mask).shape[1]
    if routes.ndim != 4 or routes.shape[:2] != (len(spans), seq):
        raise RouteError(
            f"routed_experts: expected [batch, seq, layers, top_k] matching attention_mask "
            f"{np.asarray(attention_mask).shape}, got shape {routes.shape}"
        )
    if response_mask is not None:
        rm = np.asarray(response_mask)
        if rm.ndim != 2 or rm.shape[0] != len(spans) or rm.shape[1] > seq:
            raise RouteError(
                f"response_mask: expected [batch, response_length] with {len(spans)} rows and at "
                f"most {seq} columns, got shape {rm.shape}"
            )
    tables = []
    for b, span in enumerate(spans):
        rows = routes[b, span.start : span.stop - 1]
        end = _routed_end(rows)
        if trailing_unrouted == "filler" and len(rows) > 0:
            if end == 0:
                raise RouteError(
                    f"batch row {b}: no row holds a route (were routes captured?); only a "
                    f"trailing run after routed rows may replay filler"
                )
            if response_mask is not None:
                _check_no_loss(response_mask, b, span, seq, end + 1)
            rows = rows[:end]
        try:
            tables.append(RouteTable.from_vllm(rows, layout=layout))
        except RouteError as e:
            hint = ""
            if 0 < end < len(rows):
                hint = (
                    f" (rows {end}..{len(rows) - 1} are all 0: tokens appended after the "
                    f"engine's last call, such as verl's interaction turn? see "
                    f"trailing_unrouted='filler')"
                )
            raise RouteError(f"batch row {b}: {e}{hint}") from None
    return tables


def to_verl(
    tables: Sequence[RouteTable], attention_mask, *, dtype=np.int32, trailing_unrouted: str = "error"
) -> np.ndarray:
    """verl's ``routed_experts`` for these tables (row ``b`` for batch row ``b``): each
    sequence's routes from its first attended position, zeros elsewhere. Every table must
    cover its whole sequence (``attended tokens - 1`` rows from position 0); with
    ``trailing_unrouted="filler"`` it may stop short, the rows after it left 0 (as
    :func:`from_verl` reads them). ``dtype`` must hold every expert id of the layout exactly,
    else :class:`r3.RouteError`."""
    if trailing_unrouted not in ("error", "filler"):
        raise RouteError(f"trailing_unrouted must be 'error' or 'filler', got {trailing_unrouted!r}")
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
        short = trailing_unrouted == "filler" and table.num_rows <= len(span) - 1
        if table.start_pos != 0 or (table.num_rows != len(span) - 1 and not short):
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
        out[b, span.start : span.start + table.num_rows] = table.to_numpy_all_layers()
    return out
