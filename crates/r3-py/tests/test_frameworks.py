"""verl's padded batch and slime's per-sample arrays to and from RouteTables: round trips and
the placement verl's agent loop makes, built by hand."""

import numpy as np
import pytest

import r3
from conftest import random_wire


def verl_batch(rng, prompt_lens, response_lens, prompt_width=6, response_width=5):
    """attention_mask as verl builds it (left-padded prompt, right-padded response) and
    each sequence's wire routes (tokens - 1 rows)."""
    mask = np.zeros((len(prompt_lens), prompt_width + response_width), dtype=np.int64)
    wires = []
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[b, prompt_width - p : prompt_width + r] = 1
        wires.append(random_wire(rng, p + r - 1))
    return mask, wires


def test_verl_round_trip_and_placement(rng, layout):
    mask, wires = verl_batch(rng, [3, 6, 1], [5, 2, 4])
    tables = [r3.RouteTable.from_vllm(w, layout=layout) for w in wires]
    routed = r3.verl.to_verl(tables, mask)
    assert routed.shape == (3, 11, 4, 2)
    # verl's rule: rows go from start_pos = prompt_width - len(prompt); zeros elsewhere.
    expected = np.zeros_like(routed)
    for b, (w, p) in enumerate(zip(wires, [3, 6, 1])):
        expected[b, 6 - p : 6 - p + len(w)] = w
    np.testing.assert_array_equal(routed, expected)
    back = r3.verl.from_verl(routed, mask, layout=layout)
    assert back == tables


def test_verl_zero_padding_is_not_replayed_as_expert_zero(rng, layout):
    mask, wires = verl_batch(rng, [3, 4], [4, 4])
    routed = r3.verl.to_verl([r3.RouteTable.from_vllm(w, layout=layout) for w in wires], mask)
    routed[1, 6] = 0  # a route lost in transit: zeros where a token was fed
    with pytest.raises(r3.RouteError, match="batch row 1: token 4, layer 1: all 2 ids are 0"):
        r3.verl.from_verl(routed, mask, layout=layout)
    gappy = mask.copy()
    gappy[0, 4] = 0
    with pytest.raises(r3.RouteError, match="not contiguous"):
        r3.verl.from_verl(routed, gappy, layout=layout)
    short = r3.RouteTable.from_vllm(wires[0][:-1], layout=layout)
    with pytest.raises(r3.RouteError, match="batch row 0"):
        r3.verl.to_verl([short, short], mask)


def test_slime_round_trip_and_length_check(rng, layout):
    tokens = 9
    arr = random_wire(rng, tokens - 1)
    table = r3.slime.from_slime(arr, layout=layout, num_tokens=tokens)
    np.testing.assert_array_equal(r3.slime.to_slime(table), arr)
    with pytest.raises(r3.RouteError, match="cover every fed position"):
        r3.slime.from_slime(arr, layout=layout, num_tokens=tokens + 1)
    arr[3, 2] = -1
    with pytest.raises(r3.RouteError, match="token 3, layer 2: no route recorded"):
        r3.slime.to_slime(r3.slime.from_slime(arr, layout=layout))


def test_output_dtypes_must_hold_every_expert_id(rng):
    def one_table(num_experts):
        layout = r3.LayerLayout(2, [1], num_experts=num_experts, top_k=2)
        wire = np.zeros((3, 2, 2), dtype=np.int32)
        wire[:, 1] = [[num_experts - 1, 0], [1, num_experts - 2], [2, 3]]
        return r3.RouteTable.from_vllm(wire, layout=layout), wire

    mask = np.ones((1, 4), dtype=np.int64)
    # 300 experts: uint8 would write id 299 as 43.
    t300, w300 = one_table(300)
    with pytest.raises(r3.RouteError, match="dtype uint8 holds ids up to 255, but the layout's largest expert id is 299"):
        r3.verl.to_verl([t300], mask, dtype=np.uint8)
    with pytest.raises(r3.RouteError, match="dtype uint8 holds ids up to 255"):
        r3.slime.to_slime(t300, dtype="uint8")
    np.testing.assert_array_equal(r3.slime.to_slime(t300, dtype=np.int16), w300)
    # 256 experts: int8 would write id 255 as -1, the mark of a missing route.
    t256, w256 = one_table(256)
    with pytest.raises(r3.RouteError, match="dtype int8 holds ids up to 127, but the layout's largest expert id is 255"):
        r3.slime.to_slime(t256, dtype=np.int8)
    out = r3.verl.to_verl([t256], mask, dtype=np.uint8)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out[0, :3], w256)
    # Floats hold exact integers only up to 2 ** (mantissa bits + 1); non-numbers none.
    t4096, _ = one_table(4096)
    with pytest.raises(r3.RouteError, match="dtype float16 holds ids up to 2048"):
        r3.slime.to_slime(t4096, dtype=np.float16)
    assert r3.slime.to_slime(t4096, dtype=np.float32).max() == 4095
    with pytest.raises(r3.RouteError, match="cannot hold expert ids"):
        r3.slime.to_slime(t256, dtype=bool)


def interaction_batch(rng, layout):
    """One verl row ended by its interaction turn: prompt of 3 tokens (columns 3-5 of a
    6-wide prompt), response of 6 (columns 6-11 of 6): the engine's last call fed positions
    0-5 (their routes) and generated position 6 (loss, never fed), then 2 user tokens were
    appended (positions 7-8, response_mask 0), never fed either; rows 6-7 (the rows read run
    to the last token but one) are left 0 — what verl's tool agent loop builds."""
    mask = np.zeros((1, 12), dtype=np.int64)
    mask[0, 3:12] = 1
    wire = random_wire(rng, 6)
    routed = np.zeros((1, 12, 4, 2), dtype=np.int32)
    routed[0, 3:9] = wire
    response_mask = np.array([[1, 1, 1, 1, 0, 0]])  # response positions 3-8
    return routed, mask, wire, response_mask


def test_verl_interaction_terminated_rollouts(rng, layout):
    routed, mask, wire, response_mask = interaction_batch(rng, layout)
    with pytest.raises(r3.RouteError, match=r"token 6, layer 1: all 2 ids are 0.*rows 6\.\.7 are all 0.*trailing_unrouted"):
        r3.verl.from_verl(routed, mask, layout=layout)
    (table,) = r3.verl.from_verl(routed, mask, layout=layout, trailing_unrouted="filler",
                                 response_mask=response_mask)
    assert (table.start_pos, table.num_rows) == (0, 6)
    np.testing.assert_array_equal(table.ids, wire[:, 1:])
    assert r3.verl.seq_lens(mask) == [9]
    # Replayed over the 9 attended tokens, positions 6-8 replay the filler.
    ids = r3.megatron.replay_arrays([table], layout, seq_lens=r3.verl.seq_lens(mask))
    assert ids.shape == (3, 9, 2)
    np.testing.assert_array_equal(ids[0, :6], wire[:, 1])
    assert ids[0, 6:].tolist() == [[4, 5], [6, 7], [0, 1]]  # (t * 2 + j) % 8
    # Written back, the rows after the table stay 0, as verl has them.
    np.testing.assert_array_equal(r3.verl.to_verl([table], mask, trailing_unrouted="filler"), routed)
    with pytest.raises(r3.RouteError, match="batch row 0: the table covers"):
        r3.verl.to_verl([table], mask)
    # A zero row before routed rows is still refused.
    gap = routed.copy()
    gap[0, 5] = 0
    with pytest.raises(r3.RouteError, match="token 2, layer 1: all 2 ids are 0"):
        r3.verl.from_verl(gap, mask, layout=layout, trailing_unrouted="filler")
    # A token with loss after the routed rows: its logits would come from a filler route.
    lossy = np.array([[1, 1, 1, 1, 1, 0]])
    with pytest.raises(r3.RouteError, match="token 7 carries loss .* token 6, whose logits predict it, has no route"):
        r3.verl.from_verl(routed, mask, layout=layout, trailing_unrouted="filler", response_mask=lossy)
    # No route at all is not a trailing run.
    with pytest.raises(r3.RouteError, match="no row holds a route"):
        r3.verl.from_verl(np.zeros_like(routed), mask, layout=layout, trailing_unrouted="filler")
    with pytest.raises(r3.RouteError, match="trailing_unrouted must be"):
        r3.verl.from_verl(routed, mask, layout=layout, trailing_unrouted="drop")
