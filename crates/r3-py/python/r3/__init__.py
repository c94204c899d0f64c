"""r3's route plane for Python.

Decode SGLang's and vLLM's routed-expert payloads into validated :class:`RouteTable` s, merge
the routes of resumed requests, check them against sequences, measure training-inference
mismatch and routing divergence, convert to and from verl's and slime's layouts
(:mod:`r3.verl`, :mod:`r3.slime`) and hand a Megatron-Core rank exactly the routes its
routers replay (:mod:`r3.megatron`). Everything is computed by the compiled core over the
Rust crate r3-routing; every invalid input raises :class:`RouteError` (a ``ValueError``)
naming the token, layer and value.

Only numpy is needed to import this package; :mod:`r3.megatron` imports torch and
megatron.core when it is used.
"""

from r3._r3 import (
    LayerLayout,
    RouteError,
    RouteTable,
    check_covers_sequence,
    merge_resumed,
    mismatch,
    routing_divergence,
)
from r3 import megatron, slime, verl

__all__ = [
    "LayerLayout",
    "RouteError",
    "RouteTable",
    "check_covers_sequence",
    "megatron",
    "merge_resumed",
    "mismatch",
    "routing_divergence",
    "slime",
    "verl",
]
