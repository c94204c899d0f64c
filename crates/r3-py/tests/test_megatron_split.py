"""r3.megatron's layer and token selection with numpy alone, against hand-built packing
(the comparison with Megatron-Core's own functions is tests/megatron_core/)."""

import numpy as np
import pytest

import r3
from conftest import random_wire


def test_router_layers_skip_dense_layers_and_follow_chunks(layout):
    # 4 layers, layer 0 dense.
    assert r3.megatron.router_layers(layout, pp_rank=0, pp_size=2) == [1]
    assert r3.megatron.router_layers(layout, pp_rank=1, pp_size=2) == [2, 3]
    # 2 stages x 2 virtual stages: stage 0 builds [0], [2]; stage 1 builds [1], [3].
    assert r3.megatron.router_layers(layout, pp_rank=0, pp_size=2, vp_size=2) == [2]
    assert r3.megatron.router_layers(layout, pp_rank=1, pp_size=2, vp_size=2) == [1, 3]
    assert r3.megatron.router_layers(layout, pp_rank=1, pp_size=2, vp_size=2, vp_stage=1) == [3]
    with pytest.raises(r3.RouteError, match="not divisible"):
        r3.megatron.router_layers(layout, pp_rank=0, pp_size=3)


def hand_thd(wires, layer, align, sp=(1, 0), cp=(1, 0)):
    """Replay ids of one router: sequences padded to `align`, zigzag over cp, split over sp;
    the last token and padding replay [0, 1]."""
    filler = np.array([0, 1])
    local = []
    for w in wires:
        n = len(w) + 1
        padded = -(-n // align) * align
        seq = np.tile(filler, (padded, 1))
        seq[: n - 1] = w[:, layer]
        if cp[0] > 1:
            chunks = np.split(seq, 2 * cp[0])
            seq = np.concatenate([chunks[cp[1]], chunks[2 * cp[0] - 1 - cp[1]]])
        local.append(seq)
    local = np.concatenate(local)
    return np.split(local, sp[0])[sp[1]]


@pytest.mark.parametrize("sp, cp", [((1, 0), (1, 0)), ((2, 1), (1, 0)), ((1, 0), (2, 1)), ((2, 0), (2, 1))])
def test_thd_replay_ids_match_hand_packing(rng, layout, sp, cp):
    wires = [random_wire(rng, n) for n in (6, 2, 9)]
    tables = [r3.RouteTable.from_vllm(w, layout=layout) for w in wires]
    ids = r3.megatron.replay_arrays(tables, layout, pp_rank=1, pp_size=2, tp_sp=sp, cp=cp)
    align = 2 * cp[0] * sp[0] if cp[0] > 1 else sp[0]
    assert ids.dtype == np.int64 and ids.shape[0] == 2  # layers 2 and 3
    for r, layer in enumerate([2, 3]):
        np.testing.assert_array_equal(ids[r], hand_thd(wires, layer, align, sp, cp))


def test_bshd_is_position_major(rng, layout):
    wires = [random_wire(rng, n) for n in (3, 5)]
    tables = [r3.RouteTable.from_vllm(w, layout=layout) for w in wires]
    ids = r3.megatron.replay_arrays(tables, layout, packing="bshd")
    assert ids.shape == (3, 12, 2)  # 3 routers, 6 positions x 2 sequences
    expected = np.tile(np.array([0, 1]), (6, 2, 1))
    for b, w in enumerate(wires):
        expected[: len(w), b] = w[:, 1]
    np.testing.assert_array_equal(ids[0], expected.reshape(12, 2))
    slots = r3.megatron.rank_tokens([4, 6], "bshd")
    assert slots[:4].tolist() == [[0, 0], [1, 0], [0, 1], [1, 1]]
    assert slots[-2:].tolist() == [[-1, -1], [1, 5]]


def test_replay_refuses_missing_routes_naming_them(rng, layout):
    w = random_wire(rng, 4)
    w[2, 3] = -1
    tables = [r3.RouteTable.from_vllm(random_wire(rng, 3), layout=layout),
              r3.RouteTable.from_vllm(w, layout=layout)]
    with pytest.raises(r3.RouteError, match="sequence 1: token 2, layer 3: no route recorded"):
        r3.megatron.replay_arrays(tables, layout)
    # A rank whose routers do not include layer 3 does not need that cell.
    assert r3.megatron.replay_arrays(tables, layout, pp_rank=0, pp_size=2).shape == (1, 9, 2)
    late = r3.RouteTable.from_vllm(random_wire(rng, 3), layout=layout, start_len=2)
    with pytest.raises(r3.RouteError, match="sequence 0: .*capture the prompt"):
        r3.megatron.replay_arrays([late], layout)
    with pytest.raises(r3.RouteError, match="tp_sp must be"):
        r3.megatron.replay_arrays(tables, layout, tp_sp=2)
