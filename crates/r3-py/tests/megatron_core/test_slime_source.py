"""r3 against slime's own code, run from a slime checkout rather than transcribed: its resume
merge (``Sample._apply_meta_info``, ``slime/utils/types.py``), its THD packing (``get_batch``,
``slime/backends/megatron_utils/data.py``) and its route slicing
(``prepare_routed_experts_for_routing_replay``, ``cp_utils.py``), both the zigzag layout and
``--allgather-cp``.

Skipped unless ``R3_SLIME_SRC`` names a checkout of THUDM/slime (last run against 624b824:
``R3_SLIME_SRC=/path/to/slime scripts/py/megatron_check.sh``) and torch imports. The numpy
suite (tests/test_megatron_split.py, tests/test_align_metrics.py) holds transcriptions of the
same code that CI runs. slime's Megatron-dependent modules are not imported: the functions
are taken from the source files (``ast``) and run with a stub ``mpu`` giving the rank.
"""

import ast
import os
import sys
import types
from collections.abc import Callable, Sequence

import numpy as np
import pytest

SLIME = os.environ.get("R3_SLIME_SRC")
if not SLIME:
    pytest.skip("R3_SLIME_SRC (a slime checkout) not set", allow_module_level=True)
torch = pytest.importorskip("torch")
F = torch.nn.functional

import r3  # noqa: E402

MEGATRON_UTILS = os.path.join(SLIME, "slime", "backends", "megatron_utils")


def slime_functions(path, names, **env):
    """The top-level functions ``names`` of the slime source file ``path``, defined in a
    namespace holding ``env`` (what they use of the module's imports)."""
    with open(path) as f:
        src = f.read()
    tree = ast.parse(src)
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in found} == set(names), f"{path} lacks {set(names) - {n.name for n in found}}"
    namespace = dict(env)
    exec(compile("\n\n".join(ast.get_source_segment(src, n) for n in found), path, "exec"), namespace)
    return namespace


class PackedSeqParams(types.SimpleNamespace):
    """Megatron's PackedSeqParams as get_batch fills it (a class: its return annotation
    unions it with tensor types)."""


MPU = types.SimpleNamespace()
CP_UTILS = slime_functions(
    os.path.join(MEGATRON_UTILS, "cp_utils.py"),
    {"slice_with_cp", "_pad_routed_experts", "prepare_routed_experts_for_routing_replay"},
    torch=torch, F=F, mpu=MPU, Callable=Callable, Sequence=Sequence,
)
DATA = slime_functions(
    os.path.join(MEGATRON_UTILS, "data.py"),
    {"get_batch"},
    torch=torch, F=F, mpu=MPU, Sequence=Sequence, slice_with_cp=CP_UTILS["slice_with_cp"],
    PackedSeqParams=PackedSeqParams,
    accelerator=types.SimpleNamespace(current_device=lambda: "cpu", device=lambda: "cpu"),
)


def on_rank(tp, tp_rank, cp, cp_rank):
    MPU.get_tensor_model_parallel_world_size = lambda: tp
    MPU.get_tensor_model_parallel_rank = lambda: tp_rank
    MPU.get_context_parallel_world_size = lambda: cp
    MPU.get_context_parallel_rank = lambda: cp_rank


class Batch:
    """What get_batch reads of slime's DataIterator: one micro-batch of whole samples."""

    def __init__(self, lens):
        self.batch = {
            "tokens": [torch.arange(n) for n in lens],
            "total_lengths": list(lens),
            "response_lengths": [n - 1 for n in lens],
            "loss_masks": [torch.ones(n - 1, dtype=torch.int) for n in lens],
        }

    def get_next(self, keys):
        return dict(self.batch)


BIG = 10**6


def slime_rank(lens, tp, tp_rank, cp, cp_rank, mult, allgather_cp):
    """slime's cu_seqlens for the micro-batch and the (sequence, position) of every row its
    replay gives the rank's routers (None for filler), sequence parallelism on."""
    on_rank(tp, tp_rank, cp, cp_rank)
    batch = DATA["get_batch"](Batch(lens), ["tokens"], pad_multiplier=mult, allgather_cp=allgather_cp)
    cu = batch["packed_seq_params"].cu_seqlens_q.tolist()
    # The routes tagged "sequence * 1000 + position" above BIG; slime's filler (arange %
    # num_experts with num_experts = BIG) stays below.
    tags = [torch.tensor([[[BIG + s * 1000 + p]] for p in range(n - 1)], dtype=torch.int64) for s, n in enumerate(lens)]
    rows = CP_UTILS["prepare_routed_experts_for_routing_replay"](
        tags, batch["unconcat_tokens"], num_experts=BIG, data_pad_size_multiplier=mult,
        sequence_parallel=True, allgather_cp=allgather_cp,
    )[:, 0, 0].tolist()
    return cu, [((v - BIG) // 1000, (v - BIG) % 1000) if v >= BIG else None for v in rows]


@pytest.mark.parametrize("allgather_cp", [False, True])
def test_rank_tokens_follow_slimes_own_packing(allgather_cp):
    packing = "thd_contiguous_cp" if allgather_cp else "thd"
    checked = 0
    for lens in ([5, 3], [6, 2, 9], [17]):
        for tp, cp in [(1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (4, 2)]:
            for mult in (1, 4, 128):
                for tp_rank in range(tp):
                    for cp_rank in range(cp):
                        cu, want = slime_rank(lens, tp, tp_rank, cp, cp_rank, mult, allgather_cp)
                        slots = r3.megatron.rank_tokens(
                            lens, packing, (tp, tp_rank), (cp, cp_rank), cu_seqlens_padded=cu, trailing_padding=True
                        )
                        got = [(int(s), int(p)) if s >= 0 and p < lens[s] - 1 else None for s, p in slots]
                        assert got == want, (lens, tp, tp_rank, cp, cp_rank, mult, cu)
                        checked += 1
    assert checked == 3 * 3 * (1 + 2 + 2 + 4 + 3 + 8)


def test_resume_merge_is_slimes_own():
    sys.path.insert(0, SLIME)
    try:
        import httpx  # noqa: F401  (slime.utils.http_utils needs it at import)
    except ImportError:
        stub = types.ModuleType("httpx")
        stub.AsyncClient = stub.Limits = stub.Timeout = stub.HTTPStatusError = object
        sys.modules["httpx"] = stub
    from slime.utils.types import Sample

    num_layers, top_k, num_experts = 4, 2, 8
    args = types.SimpleNamespace(num_layers=num_layers, moe_router_topk=top_k)
    layout = r3.LayerLayout(num_layers, [1, 2, 3], num_experts=num_experts, top_k=top_k)
    rng = np.random.default_rng(4)

    def routes(rows):
        out = np.zeros((rows, num_layers, top_k), dtype=np.int32)
        for t in range(rows):
            for layer in (1, 2, 3):
                out[t, layer] = rng.choice(num_experts, size=top_k, replace=False)
        return out

    for start in (0, 1, 6, 9, 10):
        # The earlier call: 11 tokens, rows [0, 10). The resumed call (sent with
        # routed_experts_start_len = start) ends at 15 tokens: rows [start, 14).
        sample = Sample(tokens=list(range(11)))
        earlier = routes(10)
        sample._apply_meta_info(args, {"routed_experts": earlier.reshape(-1)})
        sample.tokens = list(range(15))
        resumed = routes(14 - start)
        sample._apply_meta_info(
            args, {"routed_experts": resumed.reshape(-1), "routed_experts_start_len": start}
        )
        merged = r3.merge_resumed(
            [r3.RouteTable.from_vllm(earlier, layout=layout),
             r3.RouteTable.from_vllm(resumed, layout=layout, start_len=start)],
            policy="prefer_resumed_from_its_start",
        )
        np.testing.assert_array_equal(
            merged.to_numpy_all_layers(), sample.rollout_routed_experts.numpy(), err_msg=f"start {start}"
        )
    # Past the earlier rows both refuse.
    sample = Sample(tokens=list(range(11)))
    sample._apply_meta_info(args, {"routed_experts": earlier.reshape(-1)})
    sample.tokens = list(range(15))
    with pytest.raises(ValueError, match="shorter than routed_experts_start_len"):
        sample._apply_meta_info(args, {"routed_experts": routes(3).reshape(-1), "routed_experts_start_len": 11})
    with pytest.raises(r3.RouteError, match="a gap"):
        r3.merge_resumed(
            [r3.RouteTable.from_vllm(earlier, layout=layout),
             r3.RouteTable.from_vllm(routes(3), layout=layout, start_len=11)],
            policy="prefer_resumed_from_its_start",
        )
