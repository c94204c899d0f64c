"""Decode speed of r3's validating SGLang / vLLM decoders against what the frameworks do
today: ``np.frombuffer(base64.b64decode(...)).reshape(...)`` (no check at all) and JSON lists
(``json.loads`` then ``np.asarray``). Prints a markdown table: MB/s of payload text and
payload bytes per token, median of repeated runs.

    python scripts/py/bench_decode.py [--tokens N] [--layers L] [--experts E] [--top-k K]

Run it in a venv with r3 built --release (scripts/py/setup_venv.sh --release).
"""

import argparse
import base64
import io
import json
import statistics
import time

import numpy as np

import r3


def cpu_seconds(fn):
    """CPU time of one call (single-threaded work; robust to other load on a shared machine)."""
    t = time.process_time()
    fn()
    return time.process_time() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=30_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--dense", type=int, default=0, help="leading dense layers")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    moe = list(range(a.dense, a.layers))
    layout = r3.LayerLayout(a.layers, moe, num_experts=a.experts, top_k=a.top_k)
    wire = np.zeros((a.tokens, a.layers, a.top_k), dtype=np.int32)
    # Distinct experts per cell: the first top_k of a random permutation per (token, layer).
    perm = np.argsort(rng.random((a.tokens, len(moe), a.experts)), axis=2)[:, :, : a.top_k]
    wire[:, a.dense :] = perm
    shape = wire.shape
    rows = []

    def add(name, payload_len, fn, check):
        check(fn())
        rows.append([name, payload_len, fn, []])

    def same_ids(t):
        np.testing.assert_array_equal(t.ids, wire[:, a.dense :])

    def same_array(x):
        np.testing.assert_array_equal(x, wire)

    for dtype in ("int32", "uint16", "uint8"):
        if dtype == "uint8" and a.experts > 256:
            continue
        b64 = base64.b64encode(wire.astype(dtype).tobytes()).decode()
        add(f"numpy: frombuffer(b64decode) {dtype} (no check)", len(b64),
            lambda b64=b64, dtype=dtype: np.frombuffer(base64.b64decode(b64), dtype=dtype).reshape(shape),
            same_array)
        add(f"r3: RouteTable.from_sglang {dtype} (validated)", len(b64),
            lambda b64=b64, dtype=dtype: r3.RouteTable.from_sglang(b64, layout=layout, dtype=dtype),
            same_ids)
    buf = io.BytesIO()
    np.save(buf, wire.astype(np.int16))
    npy_b64 = base64.b64encode(buf.getvalue()).decode()
    add("numpy: np.load(b64decode) vLLM int16 .npy (no check)", len(npy_b64),
        lambda: np.load(io.BytesIO(base64.b64decode(npy_b64))), same_array)
    add("r3: RouteTable.from_vllm int16 .npy (validated)", len(npy_b64),
        lambda: r3.RouteTable.from_vllm(npy_b64, layout=layout), same_ids)
    text = json.dumps(wire.tolist())
    add("json: np.asarray(json.loads(lists)) (no check)", len(text),
        lambda: np.asarray(json.loads(text), dtype=np.int32), same_array)
    for _ in range(a.repeat):
        for row in rows:
            row[3].append(cpu_seconds(row[2]))
    print(f"{a.tokens} tokens x {a.layers} layers ({a.dense} dense) x top-{a.top_k} of {a.experts} experts; "
          f"median CPU time of {a.repeat} interleaved calls")
    print()
    print("| decoder | bytes / token | MB/s | ms |")
    print("|---|---:|---:|---:|")
    for name, payload_len, _, times in rows:
        t = statistics.median(times)
        print(f"| {name} | {payload_len / a.tokens:.0f} | {payload_len / t / 1e6:.0f} | {t * 1e3:.1f} |")


if __name__ == "__main__":
    main()
