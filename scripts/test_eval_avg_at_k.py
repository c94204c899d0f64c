#!/usr/bin/env python3
"""Checks of scripts/eval_avg_at_k.py that need no server (standard library only):

    python3 scripts/test_eval_avg_at_k.py      # or: python3 -m pytest scripts/test_eval_avg_at_k.py
"""
import importlib.util
import json
import pathlib
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("eval_avg_at_k", HERE / "eval_avg_at_k.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def test_every_sample_has_its_own_stream():
    # r3 serve seeds choice j of a request seeded s with s + j.
    for seed, prompts, k in [(0, 200, 8), (3, 1, 8), (7, 50, 1), (1, 2, 64)]:
        seeds = script.sample_seeds(seed, prompts, k)
        assert len(seeds) == prompts * k
        assert len(set(seeds)) == prompts * k, (seed, prompts, k)
        script.check_streams(seed, prompts, k)
    # Another --seed shares no stream with the first.
    assert not set(script.sample_seeds(0, 200, 8)) & set(script.sample_seeds(1, 200, 8))
    # Sample j of prompt i draws from (seed * prompts + i) * k + j.
    assert script.sample_seeds(2, 3, 4)[1 * 4 + 3] == (2 * 3 + 1) * 4 + 3


def test_the_old_seeding_is_caught():
    # The seeding before the fix: prompt i sent seed + i, so 200 x 8 samples had 207 streams.
    old = script.request_seed
    script.request_seed = lambda seed, i, prompts, k: seed + i
    try:
        assert len(set(script.sample_seeds(0, 200, 8))) == 207
        try:
            script.check_streams(0, 200, 8)
        except SystemExit as e:
            assert "streams repeat: 1393 of 1600" in str(e), e
        else:
            raise AssertionError("repeated streams not refused")
    finally:
        script.request_seed = old


def test_baseline_pairing():
    # One prompt: a difference, no standard error, no crash.
    assert script.paired([0.5], [0.25], {"k": 8, "temperature": 1.0}, 8, 1.0) == (0.25, None, None)
    d, se, w = script.paired([1.0, 0.5], [0.5, 0.5], None, 8, 1.0)
    assert (d, se) == (0.25, 0.25) and "no k or temperature" in w
    for settings in ({"k": 1, "temperature": 1.0}, {"k": 8, "temperature": 0.0}):
        try:
            script.paired([0.5], [0.25], settings, 8, 1.0)
        except SystemExit as e:
            assert "needs the same sampling" in str(e)
        else:
            raise AssertionError(f"{settings} paired")
    # r3 eval's --out line: k from samples_per_prompt, temperature maybe unrecorded.
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"step": 0, "samples_per_prompt": 8, "prompt_scores": [0.25]}, f)
    scores, settings = script.load_baseline(f.name)
    pathlib.Path(f.name).unlink()
    assert (scores, settings) == ([0.25], {"k": 8, "temperature": None})
    assert "no temperature" in script.paired([0.5], scores, settings, 8, 1.0)[2]
    try:
        script.paired([0.5, 0.5], [0.25], None, 8, 1.0)
    except SystemExit as e:
        assert "1 prompts, this dataset 2" in str(e)
    else:
        raise AssertionError("different prompt counts paired")


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_"):
            fn()
            print(f"{name}: ok")
