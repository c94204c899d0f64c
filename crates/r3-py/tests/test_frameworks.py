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
