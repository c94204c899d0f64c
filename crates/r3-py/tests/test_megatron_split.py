"""r3.megatron's layer and token selection with numpy alone, against hand-built packing
(the comparison with Megatron-Core's own functions is tests/megatron_core/)."""

import numpy as np
import pytest

import r3
from conftest import NUM_EXPERTS, random_wire


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


def fill(ids, num_experts=NUM_EXPERTS):
    """Rows of -1 (a last token or padding) replaced by the filler: the rank's t-th token
    replays experts (t * top_k + j) % num_experts."""
    ids = ids.copy()
    top_k = ids.shape[-1]
    for t in np.flatnonzero((ids == -1).all(axis=-1)):
        ids[t] = (t * top_k + np.arange(top_k)) % num_experts
    return ids


def hand_thd(wires, layer, align, sp=(1, 0), cp=(1, 0), padded=None):
    """Replay ids of one router: sequences padded to `align` (or to `padded`), zigzag over
    cp, split over sp; the last token and padding replay the filler."""
    local = []
    for i, w in enumerate(wires):
        n = len(w) + 1
        length = padded[i] if padded else -(-n // align) * align
        seq = np.full((length, w.shape[-1]), -1)
        seq[: n - 1] = w[:, layer]
        if cp[0] > 1:
            chunks = np.split(seq, 2 * cp[0])
            seq = np.concatenate([chunks[cp[1]], chunks[2 * cp[0] - 1 - cp[1]]])
        local.append(seq)
    local = np.concatenate(local)
    return fill(np.split(local, sp[0])[sp[1]])


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
    expected = np.full((6, 2, 2), -1)
    for b, w in enumerate(wires):
        expected[: len(w), b] = w[:, 1]
    np.testing.assert_array_equal(ids[0], fill(expected.reshape(12, 2)))
    # The 4 filler rows (slots 6, 8, 10, 11) are spread over experts, not all [0, 1] as
    # before, and distinct within each row.
    filler = ids[0][(expected.reshape(12, 2) == -1).all(axis=1)]
    assert filler.tolist() == [[4, 5], [0, 1], [4, 5], [6, 7]]
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


def test_explicit_padding_is_used_and_checked(rng, layout):
    wires = [random_wire(rng, n) for n in (4, 2)]
    tables = [r3.RouteTable.from_vllm(w, layout=layout) for w in wires]
    # thd, sp 2: the data loader padded the sequences (5 and 3 tokens) to 8 and 4.
    for sp_rank in range(2):
        for cu in ([0, 8, 12], np.array([0, 8, 12]), np.array([0, 8, 12], dtype=np.int32)):
            ids = r3.megatron.replay_arrays(tables, layout, tp_sp=(2, sp_rank), cu_seqlens_padded=cu)
            np.testing.assert_array_equal(ids[0], hand_thd(wires, 1, 2, (2, sp_rank), padded=[8, 4]))
    # The inferred padding is the same as giving it.
    np.testing.assert_array_equal(
        r3.megatron.replay_arrays(tables, layout, tp_sp=(2, 0)),
        r3.megatron.replay_arrays(tables, layout, tp_sp=(2, 0), cu_seqlens_padded=[0, 6, 10]),
    )
    with pytest.raises(r3.RouteError, match="sequence 0 4 tokens, fewer than its 5"):
        r3.megatron.replay_arrays(tables, layout, cu_seqlens_padded=[0, 4, 8])
    with pytest.raises(r3.RouteError, match="cu_seqlens_padded has 2 entries; 2 sequences need 3"):
        r3.megatron.replay_arrays(tables, layout, cu_seqlens_padded=[0, 8])
    with pytest.raises(r3.RouteError, match="not both"):
        r3.megatron.replay_arrays(tables, layout, cu_seqlens_padded=[0, 8, 12], padded_len=8)
    with pytest.raises(r3.RouteError, match="cu_seqlens_padded must be a sequence of ints"):
        r3.megatron.replay_arrays(tables, layout, cu_seqlens_padded=["a"])
    # bshd: padded to 7 positions instead of 5.
    ids = r3.megatron.replay_arrays(tables, layout, packing="bshd", padded_len=7)
    assert ids.shape == (3, 14, 2)
    slots = r3.megatron.rank_tokens([5, 3], "bshd", padded_len=7)
    assert (slots[-4:] == -1).all()
    with pytest.raises(r3.RouteError, match="padded_len 4 is shorter than sequence 0's 5 tokens"):
        r3.megatron.replay_arrays(tables, layout, packing="bshd", padded_len=4)
    with pytest.raises(r3.RouteError, match="padded_len is for bshd"):
        r3.megatron.replay_arrays(tables, layout, padded_len=8)


def test_huge_arguments_raise_instead_of_allocating(layout):
    with pytest.raises(r3.RouteError, match="exceed the 67108864 tokens"):
        r3.megatron.rank_tokens([10**15])
    with pytest.raises(r3.RouteError, match="exceed the 67108864 tokens"):
        r3.megatron.rank_tokens([2**40] * 3, "bshd")
    with pytest.raises(r3.RouteError, match="alignment exceeds"):
        r3.megatron.rank_tokens([4], "thd", (2**62, 0), (4, 0))
    with pytest.raises(r3.RouteError, match="num_layers"):
        r3.megatron.PipelineSplit(10**15, 1).local_layers(0)
