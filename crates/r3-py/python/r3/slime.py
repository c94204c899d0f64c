"""slime's layout: one ``[len(tokens) - 1, num_hidden_layers, top_k]`` array per sample (its
``rollout_routed_experts``), every layer on the wire as SGLang returns it.

Where it plugs in: slime's SGLang rollout decodes ``meta_info.routed_experts`` into that array
and its training side slices it for the Megatron routers. :func:`from_slime` validates one
sample's array (checking its length against the sample's tokens), :func:`to_slime` writes a
table back::

    table = r3.slime.from_slime(sample.rollout_routed_experts, layout=layout,
                                num_tokens=len(sample.tokens))
    sample.rollout_routed_experts = r3.slime.to_slime(table)

For Megatron replay, slime's own ``cu_seqlens`` describe its packing, tail padding included
(each context-parallel rank's tokens padded at the end to ``tp * data_pad_size_multiplier``)::

    cu = batch["packed_seq_params"].cu_seqlens_q
    r3.megatron.set_replay(tables, layout, tp_sp=(tp, tp_rank), cp=(cp, cp_rank),
                           cu_seqlens_padded=cu, trailing_padding=True,
                           num_tokens=int(cu[-1]) // cp // tp, config=model_config)

(slime's ``allgather_cp`` packing is another layout, not supported.)
"""

from typing import Optional

import numpy as np

from r3._dtype import check_id_dtype
from r3._r3 import LayerLayout, RouteError, RouteTable, check_covers_sequence

__all__ = ["from_slime", "to_slime"]


def from_slime(
    routed_experts, *, layout: LayerLayout, num_tokens: Optional[int] = None
) -> RouteTable:
    """A validated table from one sample's array; with ``num_tokens`` (``len(tokens)``) the
    array must hold exactly ``num_tokens - 1`` rows."""
    table = RouteTable.from_vllm(np.asarray(routed_experts), layout=layout)
    if num_tokens is not None:
        check_covers_sequence(table, num_tokens)
    return table


def to_slime(table: RouteTable, *, dtype=np.int32) -> np.ndarray:
    """The sample's ``[rows, num_hidden_layers, top_k]`` array (dense layers 0). Every cell
    must be present: slime has no missing mark. ``dtype`` must hold every expert id of the
    layout exactly, else :class:`r3.RouteError`."""
    dtype = check_id_dtype(dtype, table.layout)
    if table.start_pos != 0:
        raise RouteError(f"slime arrays start at position 0; this table starts at {table.start_pos}")
    if not table.present.all():
        tok, col = np.argwhere(~table.present)[0]
        raise RouteError(
            f"token {int(tok)}, layer {table.layers[int(col)]}: no route recorded "
            f"(slime has no missing mark)"
        )
    return table.to_numpy_all_layers().astype(dtype, copy=False)
