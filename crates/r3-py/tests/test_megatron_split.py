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


def slime_pad_routed_experts(experts, pad, num_experts):
    """slime's ``_pad_routed_experts`` (``cp_utils.py``), numpy for torch: ``pad`` filler rows
    ``arange(pad * num_layers * topk).reshape(pad, num_layers, topk) % num_experts``."""
    if pad == 0:
        return experts
    _, num_layers, topk = experts.shape
    filler = np.arange(pad * num_layers * topk, dtype=experts.dtype).reshape(pad, num_layers, topk) % num_experts
    return np.concatenate([experts, filler], axis=0)


def slime_allgather_cp(rollout_routed_experts, tp, tp_rank, cp, cp_rank, mult, num_experts):
    """slime's ``--allgather-cp`` path (THUDM/slime, mirror 624b824), numpy for torch, with
    sequence parallelism on. Returns what ``prepare_routed_experts_for_routing_replay``
    hands the rank's routers and the ``cu_seqlens`` that ``get_batch`` builds::

        # data.py get_batch, `if allgather_cp:`
        for t in tokens:
            cu_seqlens_list.append(cu_seqlens_list[-1] + t.size(0))
        tokens = torch.cat(tokens, dim=0)
        global_pad_size = cp_size * pad_size            # pad_size = tp * pad_multiplier
        pad = (global_pad_size - tokens.size(0) % global_pad_size) % global_pad_size
        if pad != 0:
            tokens = F.pad(tokens, (0, pad), value=pad_token_id)
            cu_seqlens_list.append(cu_seqlens_list[-1] + pad)
        tokens = tokens.chunk(cp_size, dim=0)[cp_rank]

        # cp_utils.py prepare_routed_experts_for_routing_replay
        padded_experts = [_pad_routed_experts(experts, 1, num_experts) for experts in ...]
        if allgather_cp:
            routed_experts = torch.cat(padded_experts, dim=0)
            global_pad_size = cp_size * pad_size
            pad = (global_pad_size - routed_experts.size(0) % global_pad_size) % global_pad_size
            routed_experts = _pad_routed_experts(routed_experts, pad, num_experts)
            routed_experts = routed_experts.chunk(cp_size, dim=0)[cp_rank]
        if sequence_parallel:
            seqlen = routed_experts.size(0)
            start = seqlen // tp_size * tp_rank
            end = seqlen // tp_size * (tp_rank + 1)
            routed_experts = routed_experts[start:end]
    """
    pad_size = tp * mult
    global_pad_size = cp * pad_size
    cu = [0]
    for experts in rollout_routed_experts:
        cu.append(cu[-1] + len(experts) + 1)  # a sample's tokens: its routed rows + 1
    pad = (global_pad_size - cu[-1] % global_pad_size) % global_pad_size
    if pad != 0:
        cu.append(cu[-1] + pad)
    padded = [slime_pad_routed_experts(e, 1, num_experts) for e in rollout_routed_experts]
    routed = np.concatenate(padded, axis=0)
    pad = (global_pad_size - routed.shape[0] % global_pad_size) % global_pad_size
    routed = slime_pad_routed_experts(routed, pad, num_experts)
    routed = np.split(routed, cp)[cp_rank]  # torch.chunk: equal parts, the length divides
    seqlen = routed.shape[0]
    return routed[seqlen // tp * tp_rank : seqlen // tp * (tp_rank + 1)], cu


def test_contiguous_cp_replays_as_slimes_allgather_cp(rng, layout):
    lens = [6, 2, 9]  # tokens per sequence
    wires = [random_wire(rng, n - 1) for n in lens]
    tables = [r3.RouteTable.from_vllm(w, layout=layout) for w in wires]
    # Which (sequence, position) each of slime's rows holds: run it on tags (num_experts
    # above every tag, so its filler stays below them).
    big = 10**6
    tags = [np.array([[[big + s * 1000 + p]] for p in range(n - 1)], dtype=np.int64) for s, n in enumerate(lens)]
    for tp, cp in [(1, 2), (2, 2), (1, 3), (2, 1), (4, 2)]:
        for mult in (1, 128):
            for tp_rank in range(tp):
                for cp_rank in range(cp):
                    want, cu = slime_allgather_cp(wires, tp, tp_rank, cp, cp_rank, mult, NUM_EXPERTS)
                    rows, _ = slime_allgather_cp(tags, tp, tp_rank, cp, cp_rank, mult, big)
                    where = [((v - big) // 1000, (v - big) % 1000) if v >= big else None for v in rows[:, 0, 0]]
                    kw = dict(tp_sp=(tp, tp_rank), cp=(cp, cp_rank), packing="thd_contiguous_cp",
                              cu_seqlens_padded=cu, trailing_padding=True)
                    ids = r3.megatron.replay_arrays(tables, layout, num_tokens=len(want), **kw)
                    slots = r3.megatron.rank_tokens(
                        lens, "thd_contiguous_cp", (tp, tp_rank), (cp, cp_rank),
                        cu_seqlens_padded=cu, trailing_padding=True,
                    )
                    got = [(int(s), int(p)) if s >= 0 and p < lens[s] - 1 else None for s, p in slots]
                    case = (tp, tp_rank, cp, cp_rank, mult)
                    assert got == where, case
                    for r, layer in enumerate([1, 2, 3]):
                        routed = [i for i, w in enumerate(where) if w is not None]
                        np.testing.assert_array_equal(ids[r][routed], want[routed, layer], err_msg=str(case))
                        # Elsewhere (last tokens, padding) r3's filler, as for thd.
                        others = [i for i, w in enumerate(where) if w is None]
                        np.testing.assert_array_equal(
                            ids[r][others], fill(np.full((len(where), 2), -1))[others], err_msg=str(case)
                        )
    # The zigzag packing cannot read slime's allgather offsets (here [0, 6, 8, 17, 18]: a
    # 1-token tail two cp ranks cannot share, and sequences no multiple of 2·cp).
    _, cu = slime_allgather_cp(wires, 1, 0, 2, 1, 1, NUM_EXPERTS)
    assert cu == [0, 6, 8, 17, 18]
    with pytest.raises(r3.RouteError, match="trailing padding segment has 1 tokens"):
        r3.megatron.rank_tokens(lens, "thd", (1, 0), (2, 1), cu_seqlens_padded=cu, trailing_padding=True)
    with pytest.raises(r3.RouteError, match="not a multiple of 2·cp = 4"):
        r3.megatron.rank_tokens(lens, "thd", (1, 0), (2, 1), cu_seqlens_padded=cu[:-1])
    with pytest.raises(r3.RouteError, match=r'unknown packing "allgather" \(thd, bshd or thd_contiguous_cp\)'):
        r3.megatron.rank_tokens(lens, "allgather")


# A 6-layer model, layer 0 dense; Megatron's pipeline_model_parallel_layout "Et|tt|tt|tL"
# over pp 2: flat stages (pp 0, vp 0) "Et", (pp 1, vp 0) "tt", (pp 0, vp 1) "tt",
# (pp 1, vp 1) "tL", decoder layers numbered in that order: [0] [1, 2] [3, 4] [5].
LAYOUT_TEXT = "Et|tt|tt|tL"


@pytest.fixture
def six_layers():
    return r3.LayerLayout(6, [1, 2, 3, 4, 5], num_experts=NUM_EXPERTS, top_k=2)


class LayerType:
    """Megatron's LayerType enum as the layout object holds it: members with a ``.name``."""

    def __init__(self, name):
        self.name = name


class MegatronLayout:
    """What r3 reads of Megatron's PipelineParallelLayerLayout: ``.layout[pp_rank][vp_stage]``
    (lists of LayerType) and ``.pipeline_model_parallel_size``."""

    def __init__(self, per_rank):
        self.layout = [[[LayerType(n) for n in stage] for stage in rank] for rank in per_rank]
        self.pipeline_model_parallel_size = len(per_rank)


E, T, L = "embedding", "decoder", "loss"
MEGATRON_OBJECT = MegatronLayout([[[E, T], [T, T]], [[T, T], [T, L]]])
LIST_FORM = [[E, T], [T, T], ["Decoder ", T], [T, L]]  # stripped, any case, as Megatron's


def test_pipeline_layout_decides_the_routers(six_layers):
    for form in (LAYOUT_TEXT, LIST_FORM, MEGATRON_OBJECT):
        kw = dict(pp_size=2, pipeline_layout=form)
        # Layer 0 (pp 0, vp 0) is dense: no router.
        assert r3.megatron.router_layers(six_layers, pp_rank=0, **kw) == [3, 4]
        assert r3.megatron.router_layers(six_layers, pp_rank=1, **kw) == [1, 2, 5]
        assert r3.megatron.router_layers(six_layers, pp_rank=0, vp_stage=0, **kw) == []
        assert r3.megatron.router_layers(six_layers, pp_rank=1, vp_stage=1, **kw) == [5]
        split = r3.megatron.PipelineSplit(6, 2, pipeline_layout=form)
        assert split.pipeline_layout == [[E, T], [T, T], [T, T], [T, L]]
        assert [split.layer_offset(1, s) for s in (0, 1)] == [1, 5]
        assert [split.num_layers_to_build(0, s) for s in (0, 1)] == [1, 2]
    # Without the layout the even split of 6 layers over pp 2 x vp 2 does not divide (3 per
    # stage); a caller approximating it as pp 2 alone gets other layers.
    assert r3.megatron.router_layers(six_layers, pp_rank=1, pp_size=2) == [3, 4, 5]
    assert r3.megatron.PipelineSplit(6, 2).pipeline_layout is None


def test_pipeline_layout_refusals_name_the_problem(six_layers):
    cases = [
        (dict(pp_size=3, pipeline_layout=LAYOUT_TEXT), "4 stages, not a multiple of pp_size 3"),
        (dict(pp_size=2, pipeline_layout="Et|tt|tt|ttL"), "7 decoder layers"),
        (dict(pp_size=2, pipeline_layout="Et|tt|tt|tX"), "invalid layer character 'X'"),
        (dict(pp_size=2, vp_size=4, pipeline_layout=LAYOUT_TEXT), "vp_size 4 conflicts"),
        (dict(pp_size=2, first_stage_layers=1, pipeline_layout=LAYOUT_TEXT), "cannot be set with the other"),
        (dict(pp_size=4, pipeline_layout=MEGATRON_OBJECT), "built for pipeline_model_parallel_size 2"),
        (dict(pp_size=2, pipeline_layout=[[E, T], "tt", [T, T], [T, L]]), r"pipeline_layout\[1\] must be a list"),
        (dict(pp_size=2, pipeline_layout=[[E, T], [T, 3], [T, T], [T, L]]), r"pipeline_layout\[1\]\[1\] must be a LayerType"),
        (dict(pp_size=2, pipeline_layout=[[E, T], [T, "encoder"], [T, T], [T, L]]), r"pipeline_layout\[1\]\[1\]: encoder layers are not supported"),
        (dict(pp_size=2, pipeline_layout=[[E, T], [T, "t"], [T, T], [T, L]]), r'pipeline_layout\[1\]\[1\]: "t" is not a layer type'),
    ]
    for kw, match in cases:
        with pytest.raises(r3.RouteError, match=match):
            r3.megatron.router_layers(six_layers, **kw)
    with pytest.raises(r3.RouteError, match="vp_stage is required"):
        r3.megatron.PipelineSplit(6, 2, pipeline_layout=LAYOUT_TEXT).layer_offset(0)


class PipelineConfig(Config):
    """TransformerConfig's pipeline fields, as __post_init__ leaves them: a layout string
    turned into Megatron's object and the virtual size set from it."""

    def __init__(self, **kw):
        super().__init__(
            pipeline_model_parallel_size=1,
            virtual_pipeline_model_parallel_size=None,
            num_layers_in_first_pipeline_stage=None,
            num_layers_in_last_pipeline_stage=None,
            account_for_embedding_in_pipeline_split=False,
            account_for_loss_in_pipeline_split=False,
            pipeline_model_parallel_layout=None,
        )
        self.__dict__.update(kw)


def test_the_pipeline_is_read_from_the_config(rng, six_layers):
    cfg = PipelineConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                         pipeline_model_parallel_layout=MEGATRON_OBJECT)
    pipeline = r3.megatron.pipeline_from_config(cfg, 6, {"pp_rank": 1, "tp_sp": (1, 0)})
    assert pipeline["pp_size"] == 2 and pipeline["pipeline_layout"] is MEGATRON_OBJECT
    assert pipeline["pp_rank"] == 1 and pipeline["tp_sp"] == (1, 0)
    tables = [r3.RouteTable.from_vllm(random_wire(rng, 4, num_layers=6), layout=six_layers)]
    ids = r3.megatron.replay_arrays(tables, six_layers, **pipeline)
    assert ids.shape == (3, 5, 2)  # the routers of layers 1, 2 and 5
    np.testing.assert_array_equal(ids[2][:4], tables[0].ids[:, 4])  # layer 5 = MoE column 4
    # A router or model holding the config works the same; given keywords must agree.
    assert r3.megatron.pipeline_from_config(Router(cfg), 6)["vp_size"] == 2
    assert r3.megatron.pipeline_from_config(cfg, 6, {"pipeline_layout": LAYOUT_TEXT, "vp_size": 2})
    with pytest.raises(r3.RouteError, match="pp_size=4 differs from the config's pipeline_model_parallel_size=2"):
        r3.megatron.pipeline_from_config(cfg, 6, {"pp_size": 4})
    with pytest.raises(r3.RouteError, match="pipeline_layout='Ett|t|tt|tL' differs"):
        r3.megatron.pipeline_from_config(cfg, 6, {"pipeline_layout": "Ett|t|tt|tL"})
    with pytest.raises(r3.RouteError, match="pipeline_layout=None differs"):
        r3.megatron.pipeline_from_config(cfg, 6, {"pipeline_layout": None})
    # Without a layout the config's even split is read (vp None and 1 agree).
    even = PipelineConfig(pipeline_model_parallel_size=2)
    assert r3.megatron.pipeline_from_config(even, 6, {"vp_size": 1})["pipeline_layout"] is None
    assert r3.megatron.router_layers(six_layers, pp_rank=1, **{
        k: v for k, v in r3.megatron.pipeline_from_config(even, 6).items()
    }) == [3, 4, 5]
    with pytest.raises(r3.RouteError, match="expected Megatron-Core's TransformerConfig"):
        r3.megatron.pipeline_from_config(object(), 6)
