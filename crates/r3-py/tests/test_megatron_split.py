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


def test_num_tokens_is_checked_against_the_rows_built(rng, layout):
    # verl, tp 2 without sequence parallelism: verl pads each packed sequence to tp anyway,
    # so sequences of 5 and 3 tokens fill cu_seqlens_padded [0, 6, 10] and the router sees
    # 10 tokens; the padding inferred for tp_sp=None gives 8 rows. Megatron's replay would
    # take the 8 and route 2 tokens to no expert, silently; with num_tokens r3 refuses.
    wires = [random_wire(rng, n) for n in (4, 2)]
    tables = [r3.RouteTable.from_vllm(w, layout=layout) for w in wires]
    with pytest.raises(r3.RouteError, match="routers see 10 tokens, but the tables and padding give 8"):
        r3.megatron.replay_arrays(tables, layout, num_tokens=10)
    ids = r3.megatron.replay_arrays(tables, layout, num_tokens=10, cu_seqlens_padded=[0, 6, 10])
    assert ids.shape == (3, 10, 2)
    np.testing.assert_array_equal(ids[0], hand_thd(wires, 1, 1, padded=[6, 4]))
    # The count a rank sees: 10 tokens over sp 2 are 5 on each rank.
    r3.megatron.replay_arrays(tables, layout, tp_sp=(2, 1), num_tokens=5, cu_seqlens_padded=[0, 6, 10])
    with pytest.raises(r3.RouteError, match="routers see 10 tokens, but the tables and padding give 5"):
        r3.megatron.replay_arrays(tables, layout, tp_sp=(2, 1), num_tokens=10, cu_seqlens_padded=[0, 6, 10])


def slime_rows(lens, tp, tp_rank, cp, cp_rank, mult):
    """(row, sequence, position) of every routed token a rank's routers see under slime's
    get_batch, and the rank's row count, rebuilt by hand from slime's rule: each sequence
    padded to a multiple of 2·cp (only with cp > 1) and zigzag-split, the rank's tokens then
    padded at the end to a multiple of tp · mult, then split over tp (sequence parallel)."""
    local = []
    for s, n in enumerate(lens):
        seq = [(s, p) if p < n - 1 else None for p in range(n)]  # the last token: no route
        if cp > 1:
            padded = -(-n // (2 * cp)) * 2 * cp
            seq += [None] * (padded - n)
            c = padded // (2 * cp)
            seq = seq[cp_rank * c : (cp_rank + 1) * c] + seq[(2 * cp - 1 - cp_rank) * c : (2 * cp - cp_rank) * c]
        local += seq
    local += [None] * ((-len(local)) % (tp * mult))
    share = len(local) // tp
    mine = local[tp_rank * share : (tp_rank + 1) * share]
    return [(i, *x) for i, x in enumerate(mine) if x is not None], len(mine)


def slime_cu(lens, tp, cp, mult):
    """slime's packed_seq_params.cu_seqlens_q: the local offsets (with the tail as one more
    entry when there is one) times cp."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + (-(-n // (2 * cp)) * 2 if cp > 1 else n))
    pad = (-cu[-1]) % (tp * mult)
    if pad:
        cu.append(cu[-1] + pad)
    return [x * cp for x in cu]


def test_slimes_own_cu_seqlens_give_slimes_token_order():
    lens = [5, 3]
    # Hand-checked against slime's prepare_routed_experts_for_routing_replay for these
    # lengths: its cu_seqlens and, per rank, the routed rows.
    assert slime_cu(lens, 2, 1, 128) == [0, 5, 8, 256]
    assert slime_cu(lens, 1, 2, 128) == [0, 8, 12, 256]
    assert slime_cu(lens, 2, 2, 128) == [0, 8, 12, 512]
    assert slime_cu(lens, 2, 2, 1) == [0, 8, 12]
    assert slime_rows(lens, 2, 0, 1, 0, 128) == ([(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3), (5, 1, 0), (6, 1, 1)], 128)
    assert slime_rows(lens, 2, 1, 2, 1, 1) == ([(1, 1, 1)], 3)
    assert slime_rows(lens, 1, 0, 2, 1, 128) == ([(0, 0, 2), (1, 0, 3), (4, 1, 1)], 128)
    for tp, cp in [(2, 1), (1, 2), (2, 2)]:
        for mult in (1, 128):
            cu = slime_cu(lens, tp, cp, mult)
            for tp_rank in range(tp):
                for cp_rank in range(cp):
                    slots = r3.megatron.rank_tokens(
                        lens, "thd", (tp, tp_rank), (cp, cp_rank), cu_seqlens_padded=cu, trailing_padding=True
                    )
                    got = [(i, int(s), int(p)) for i, (s, p) in enumerate(slots) if s >= 0 and p < lens[s] - 1]
                    assert (got, len(slots)) == slime_rows(lens, tp, tp_rank, cp, cp_rank, mult), (tp, cp, mult)
    # Without trailing_padding, slime's extra entry is refused rather than read as padding.
    with pytest.raises(r3.RouteError, match="has 4 entries; 2 sequences need 3"):
        r3.megatron.rank_tokens(lens, "thd", (1, 0), (2, 0), cu_seqlens_padded=[0, 8, 12, 256])
    with pytest.raises(r3.RouteError, match="trailing_padding describes cu_seqlens_padded"):
        r3.megatron.rank_tokens(lens, trailing_padding=True)


def test_replay_of_slimes_batch_uses_the_tail(rng, layout):
    wires = [random_wire(rng, n) for n in (4, 2)]
    tables = [r3.RouteTable.from_vllm(w, layout=layout) for w in wires]
    ids = r3.megatron.replay_arrays(
        tables, layout, tp_sp=(2, 0), cp=(2, 1), cu_seqlens_padded=[0, 8, 12, 512],
        trailing_padding=True, num_tokens=128,
    )
    assert ids.shape == (3, 128, 2)
    # cp rank 1 holds positions 2 3 4 5 of sequence 0 and 1 2 of sequence 1, then the tail.
    expected = np.full((128, 2), -1)
    expected[0:2] = wires[0][2:4, 1]
    expected[4] = wires[1][1, 1]
    np.testing.assert_array_equal(ids[0], fill(expected))


class Config:
    """The fields of Megatron-Core's TransformerConfig that decide whether routers replay."""

    def __init__(self, **kw):
        self.moe_enable_routing_replay = True
        self.moe_router_fusion = False
        self.moe_router_load_balancing_type = "aux_loss"
        self.__dict__.update(kw)


class Router:
    def __init__(self, config):
        self.config = config


def test_settings_that_bypass_replay_are_refused(rng, layout):
    tables = [r3.RouteTable.from_vllm(random_wire(rng, 3), layout=layout)]
    r3.megatron.check_replay_config(Config())
    r3.megatron.check_replay_config(Router(Config(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"])))
    for cfg, name in [
        (Config(moe_router_fusion=True), "moe_router_fusion is True"),
        (Config(moe_router_load_balancing_type="sinkhorn"), "'sinkhorn'"),
        (Config(moe_router_load_balancing_type="quantile_balancing"), "'quantile_balancing'"),
        (Config(moe_enable_routing_replay=False), "moe_enable_routing_replay is False"),
    ]:
        for form in (cfg, Router(cfg)):
            with pytest.raises(r3.RouteError, match=name):
                r3.megatron.set_replay(tables, layout, config=form)
    with pytest.raises(r3.RouteError, match="expected Megatron-Core's TransformerConfig"):
        r3.megatron.check_replay_config(object())


def test_sequences_past_their_routes_replay_filler(rng, layout):
    # A verl rollout ended by its interaction turn: 9 attended tokens, 6 routed rows.
    wire = random_wire(rng, 6)
    tables = [r3.RouteTable.from_vllm(wire, layout=layout)]
    ids = r3.megatron.replay_arrays(tables, layout, seq_lens=[9])
    expected = np.full((9, 2), -1)
    expected[:6] = wire[:, 1]
    np.testing.assert_array_equal(ids[0], fill(expected))
    assert r3.megatron.replay_arrays(tables, layout).shape == (3, 7, 2)
    with pytest.raises(r3.RouteError, match=r"seq_lens\[0\] = 6 is shorter"):
        r3.megatron.replay_arrays(tables, layout, seq_lens=[6])


def test_negative_integers_raise_route_error_naming_the_argument(rng, layout):
    tables = [r3.RouteTable.from_vllm(random_wire(rng, 3), layout=layout)]
    cases = [
        (lambda: r3.megatron.router_layers(layout, pp_rank=-1, pp_size=2), "pp_rank"),
        (lambda: r3.megatron.router_layers(layout, pp_size=-2), "pp_size"),
        (lambda: r3.megatron.replay_arrays(tables, layout, tp_sp=(2, -1)), r"tp_sp\[1\]"),
        (lambda: r3.megatron.replay_arrays(tables, layout, cp=(-2, 0)), r"cp\[0\]"),
        (lambda: r3.megatron.replay_arrays(tables, layout, cu_seqlens_padded=[0, -4]), r"cu_seqlens_padded\[1\]"),
        (lambda: r3.megatron.replay_arrays(tables, layout, num_tokens=-1), "num_tokens"),
        (lambda: r3.megatron.replay_arrays(tables, layout, seq_lens=[-3]), r"seq_lens\[0\]"),
        (lambda: r3.megatron.replay_arrays(tables, layout, packing="bshd", padded_len=-8), "padded_len"),
        (lambda: r3.megatron.rank_tokens([3], cu_seqlens_padded=[0, -4]), r"cu_seqlens_padded\[1\]"),
        (lambda: r3.megatron.rank_tokens([-3]), r"seq_lens\[0\]"),
        (lambda: r3.megatron.rank_tokens([3], "thd", (2, -1)), r"sp\[1\]"),
        (lambda: r3.megatron.PipelineSplit(-4), "num_layers"),
        (lambda: r3.megatron.PipelineSplit(4, 2, vp_size=-2), "vp_size"),
        (lambda: r3.megatron.PipelineSplit(4, 2).local_layers(0, -1), "vp_stage"),
        (lambda: r3.megatron.PipelineSplit(4, 2).layer_offset(-1), "pp_rank"),
    ]
    for call, name in cases:
        with pytest.raises(r3.RouteError, match=f"{name} must be a non-negative integer, got -"):
            call()
