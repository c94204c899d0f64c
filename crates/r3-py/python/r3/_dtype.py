"""The one check :func:`r3.verl.to_verl` and :func:`r3.slime.to_slime` make of an output
dtype: every expert id of the layout must be representable, so that no cast wraps an id
(uint8 turns id 300 into 44) or turns it into the ``-1`` some readers take as "missing"."""

import numpy as np

from r3._r3 import LayerLayout, RouteError


def check_id_dtype(dtype, layout: LayerLayout) -> np.dtype:
    """``dtype`` as a numpy dtype, checked to hold ids ``0..num_experts - 1`` exactly; else
    :class:`r3.RouteError` naming the dtype and the largest id."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise RouteError(f"dtype {dtype!r} is not a numpy dtype") from None
    largest = layout.num_experts - 1
    if dt.kind in "iu":
        most = int(np.iinfo(dt).max)
    elif dt.kind == "f":
        most = 2 ** (np.finfo(dt).nmant + 1)  # every integer up to this is exact
    else:
        raise RouteError(f"dtype {dt} cannot hold expert ids (an integer dtype is needed)")
    if largest > most:
        raise RouteError(
            f"dtype {dt} holds ids up to {most}, but the layout's largest expert id is "
            f"{largest} (num_experts {layout.num_experts}): the cast would change ids"
        )
    return dt
