"""merge_resumed policies and sequence coverage; mismatch metrics and routing divergence
against hand computations in numpy."""

import numpy as np
import pytest

import r3
from conftest import random_wire

MOE = [1, 2, 3]


def table(rng, layout, rows, start=0):
    return r3.RouteTable.from_vllm(random_wire(rng, rows), layout=layout, start_len=start)


def test_keep_per_token_origin_keeps_earlier_rows(rng, layout):
    earlier = table(rng, layout, 5)  # positions 0..5, aborted
    resumed = table(rng, layout, 8)  # positions 0..8, the resumed call re-reports all
    merged = r3.merge_resumed([earlier, resumed])
    assert (merged.start_pos, merged.num_rows) == (0, 8)
    np.testing.assert_array_equal(merged.ids[:5], earlier.ids)
    np.testing.assert_array_equal(merged.ids[5:], resumed.ids[5:])
    # Incremental routes (the resumed call reports only the new rows) append.
    tail = table(rng, layout, 3, start=5)
    inc = r3.merge_resumed([earlier, tail], policy="keep_per_token_origin")
    np.testing.assert_array_equal(inc.ids, np.concatenate([earlier.ids, tail.ids]))
    # Three calls fold left to right.
    third = table(rng, layout, 10)
    three = r3.merge_resumed([earlier, resumed, third])
    np.testing.assert_array_equal(three.ids[:8], merged.ids)
    np.testing.assert_array_equal(three.ids[8:], third.ids[8:])


def test_replace_with_resumed_takes_the_resumed_rows(rng, layout):
    earlier = table(rng, layout, 5)
    resumed = table(rng, layout, 8)
    assert r3.merge_resumed([earlier, resumed], policy="replace_with_resumed") == resumed
    with pytest.raises(r3.RouteError, match="start after the earlier call's start"):
        r3.merge_resumed([earlier, table(rng, layout, 3, start=5)], policy="replace_with_resumed")


def slime_merge(existing, routed_experts, routed_experts_start_len):
    """slime's merge of a resumed call's routes, transcribed from THUDM/slime
    ``slime/utils/types.py`` (``Sample._apply_meta_info``, mirror 624b824) with numpy for
    torch; ``existing`` and ``routed_experts`` are slime's all-layer arrays from position 0
    and from ``routed_experts_start_len``::

        if routed_experts_start_len == 0:
            self.rollout_routed_experts = routed_experts
        else:
            existing = self.rollout_routed_experts
            ...
            if existing.shape[0] < routed_experts_start_len:
                raise ValueError("Existing routed experts shorter than routed_experts_start_len: ...")
            self.rollout_routed_experts = torch.cat(
                [existing[:routed_experts_start_len], routed_experts],
                dim=0,
            )
    """
    if routed_experts_start_len == 0:
        return routed_experts
    if existing.shape[0] < routed_experts_start_len:
        raise ValueError("Existing routed experts shorter than routed_experts_start_len")
    return np.concatenate([existing[:routed_experts_start_len], routed_experts], axis=0)


def test_prefer_resumed_from_its_start_is_slimes_merge(rng, layout):
    # The earlier call captured rows [0, 10); the resumed call, sent with
    # routed_experts_start_len 6, reports rows [6, 14). slime keeps rows 0-5 and takes 6-13
    # (6-9 included) from the resumed call.
    early_wire, resumed_wire = random_wire(rng, 10), random_wire(rng, 8)
    earlier = r3.RouteTable.from_vllm(early_wire, layout=layout)
    resumed = r3.RouteTable.from_vllm(resumed_wire, layout=layout, start_len=6)
    merged = r3.merge_resumed([earlier, resumed], policy="prefer_resumed_from_its_start")
    assert (merged.start_pos, merged.num_rows) == (0, 14)
    np.testing.assert_array_equal(merged.to_numpy_all_layers(), slime_merge(early_wire, resumed_wire, 6))
    # Neither other policy gives slime's table.
    kept = r3.merge_resumed([earlier, resumed], policy="keep_per_token_origin")
    assert not np.array_equal(kept.to_numpy_all_layers(), slime_merge(early_wire, resumed_wire, 6))
    with pytest.raises(r3.RouteError, match="start after the earlier call's start"):
        r3.merge_resumed([earlier, resumed], policy="replace_with_resumed")
    # Every start slime accepts (0: the resumed rows alone; up to the earlier rows' end: a
    # plain concatenation) gives slime's array; past it both refuse.
    for start in (0, 1, 9, 10):
        wire = random_wire(rng, 14 - start)
        again = r3.RouteTable.from_vllm(wire, layout=layout, start_len=start)
        got = r3.merge_resumed([earlier, again], policy="prefer_resumed_from_its_start")
        np.testing.assert_array_equal(got.to_numpy_all_layers(), slime_merge(early_wire, wire, start))
    late = r3.RouteTable.from_vllm(random_wire(rng, 3), layout=layout, start_len=11)
    with pytest.raises(ValueError, match="shorter than routed_experts_start_len"):
        slime_merge(early_wire, late.to_numpy_all_layers(), 11)
    with pytest.raises(r3.RouteError, match="a gap"):
        r3.merge_resumed([earlier, late], policy="prefer_resumed_from_its_start")


def test_merge_refuses_gaps_losses_and_unknown_policies(rng, layout):
    earlier = table(rng, layout, 5)
    with pytest.raises(r3.RouteError, match="a gap"):
        r3.merge_resumed([earlier, table(rng, layout, 2, start=6)])
    with pytest.raises(r3.RouteError, match="rows would be lost"):
        r3.merge_resumed([earlier, table(rng, layout, 3)])
    with pytest.raises(r3.RouteError, match="unknown policy"):
        r3.merge_resumed([earlier, earlier], policy="concat")
    with pytest.raises(r3.RouteError, match="at least one"):
        r3.merge_resumed([])


def test_check_covers_sequence(rng, layout):
    t = table(rng, layout, 9)
    r3.check_covers_sequence(t, 10)
    with pytest.raises(r3.RouteError, match="cover every fed position"):
        r3.check_covers_sequence(t, 11)
    late = table(rng, layout, 6, start=3)
    r3.check_covers_sequence(late, 10)


def hand_mismatch(train, rollout, mask):
    t = train.astype(np.float64)[mask]
    r = rollout.astype(np.float64)[mask]
    d = t - r
    pt, pr = np.exp(t), np.exp(r)
    pd = np.abs(pt - pr)
    return {
        "mismatch.num_tokens": float(mask.sum()),
        "mismatch.k3_kl": np.mean(np.exp(d) - 1 - d),
        "mismatch.f_tau2": np.mean(np.abs(d) > np.log(2)),
        "mismatch.f_tau5": np.mean(np.abs(d) > np.log(5)),
        "mismatch.mean_abs_delta": np.mean(np.abs(d)),
        "mismatch.mean_sq_delta": np.mean(d**2),
        "mismatch.mean_log_ratio": np.mean(d),
        "mismatch.prob_diff_max": pd.max(),
        "mismatch.prob_diff_mean": pd.mean(),
        "mismatch.prob_diff_std": pd.std(),
        "mismatch.pearson": np.corrcoef(pt, pr)[0, 1],
    }


def test_mismatch_matches_numpy(rng):
    n = 500
    rollout = np.log(rng.uniform(0.01, 1.0, n)).astype(np.float32)
    train = (rollout + rng.normal(0, 0.8, n)).astype(np.float32)
    train = np.minimum(train, 0).astype(np.float32)
    for mask in (None, rng.random(n) < 0.7):
        got = r3.mismatch(train, rollout, mask)
        want = hand_mismatch(train, rollout, np.ones(n, bool) if mask is None else mask)
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # float64 and list inputs holding float32 values are accepted (exactly float32 values).
    assert r3.mismatch(train.astype(np.float64).tolist(), rollout)["mismatch.k3_kl"] == \
        pytest.approx(hand_mismatch(train, rollout, np.ones(n, bool))["mismatch.k3_kl"], rel=1e-9)


def test_mismatch_refuses_bad_inputs():
    with pytest.raises(r3.RouteError, match="expected 3, got 2"):
        r3.mismatch([-1.0, -2.0, -3.0], [-1.0, -2.0])
    with pytest.raises(r3.RouteError, match="token 1: log-probs must be finite"):
        r3.mismatch([-1.0, float("nan")], [-1.0, -2.0])
    with pytest.raises(r3.RouteError, match="no unmasked tokens"):
        r3.mismatch([-1.0], [-1.0], [False])


def test_routing_divergence_matches_numpy(rng, layout):
    a_wire = random_wire(rng, 40)
    b_wire = a_wire.copy()
    flip = rng.random((40, 4)) < 0.3
    flip[:, 0] = False
    b_wire[flip] = random_wire(rng, 40)[flip]
    a = r3.RouteTable.from_vllm(a_wire, layout=layout)
    b = r3.RouteTable.from_vllm(b_wire, layout=layout)
    d = r3.routing_divergence(a, b)
    sa = [[set(c) for c in row] for row in a_wire[:, MOE].tolist()]
    sb = [[set(c) for c in row] for row in b_wire[:, MOE].tolist()]
    differ = np.array([[x != y for x, y in zip(ra, rb)] for ra, rb in zip(sa, sb)])
    overlap = np.array([[len(x & y) / 2 for x, y in zip(ra, rb)] for ra, rb in zip(sa, sb)])
    assert d["compared_routers"] == differ.size
    assert d["differing_routers"] == differ.sum()
    assert d["router_diff_fraction"] == pytest.approx(differ.mean())
    assert d["divergence.router_frac"] == pytest.approx(differ.mean())
    assert d["token_diff_fraction"] == pytest.approx(differ.any(axis=1).mean())
    assert d["divergence.token_frac"] == pytest.approx(differ.any(axis=1).mean())
    assert d["mean_overlap"] == pytest.approx(overlap.mean())
    assert d["diff_layers_histogram"] == np.bincount(differ.sum(axis=1), minlength=4).tolist()
    assert [p["layer"] for p in d["per_layer"]] == MOE
    with pytest.raises(r3.RouteError, match="same positions"):
        r3.routing_divergence(a, a.slice_rows(0, 5))


def test_mismatch_never_narrows_float64_silently():
    exact = np.array([-1.0, -0.5, -2.25])  # float64 values that are float32 values too
    assert r3.mismatch(exact, exact.astype(np.float32))["mismatch.k3_kl"] == 0.0
    close = np.array([-1.0, -0.1, -2.25])  # -0.1 is not a float32
    with pytest.raises(
        r3.RouteError, match=r"train_logp: float64 value -0\.1 at index 1 is not exactly a float32"
    ):
        r3.mismatch(close, exact)
    with pytest.raises(r3.RouteError, match="rollout_logp: float64 value -0.1 at index 1"):
        r3.mismatch(exact, [-1.0, -0.1, -2.25])
    # float32 in, the values as they are.
    f32 = close.astype(np.float32)
    got = r3.mismatch(f32, exact)["mismatch.mean_log_ratio"]
    assert got == pytest.approx(np.mean(f32.astype(np.float64) - exact), rel=1e-12)
