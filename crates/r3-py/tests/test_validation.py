"""Fail-closed validation from Python: r3-routing's malformed cases, each raising
``r3.RouteError`` naming the token, layer and value, and seeded fuzzing of every decoder —
any outcome but a table or ``r3.RouteError`` (a crash, a panic, another exception) fails."""

import base64
import io
import struct

import numpy as np
import pytest

import r3
from conftest import random_wire


def sglang(values, dtype="<i4"):
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


def test_route_error_is_a_value_error():
    assert issubclass(r3.RouteError, ValueError)


def two_layer():
    """2 layers, both MoE, 8 experts, top-2."""
    return r3.LayerLayout(2, [0, 1], num_experts=8, top_k=2)


@pytest.mark.parametrize("bad", [[-5, -5], [-2, -3], [-1, -2]])
def test_negative_garbage_names_token_layer_value(bad):
    values = [1, 2, 3, 4, 5, 6] + bad
    with pytest.raises(r3.RouteError, match=r"token 6, layer 1: id -\d+ is negative"):
        r3.RouteTable.from_sglang(sglang(values), layout=two_layer(), start_len=5)


@pytest.mark.parametrize(
    "cell, message",
    [
        ([8, 1], r"token 1, layer 1: expert id 8 out of range \[0, 8\)"),
        ([3, 3], r"token 1, layer 1: expert 3 appears more than once"),
        ([0, 0], r"token 1, layer 1: all 2 ids are 0"),
        ([-1, 4], r"token 1, layer 1: cell mixes missing \(-1\) and present ids \(-1\)"),
    ],
)
def test_bad_cells_name_token_layer_value(cell, message):
    wire = np.array([[[1, 2], [3, 4]], [[5, 6], cell]], dtype=np.int32)
    for decode in (
        lambda: r3.RouteTable.from_sglang(base64.b64encode(wire.tobytes()).decode(), layout=two_layer()),
        lambda: r3.RouteTable.from_vllm(wire, layout=two_layer()),
        lambda: r3.RouteTable.from_numpy(wire, layout=two_layer()),
        lambda: r3.RouteTable.from_vllm(wire.tolist(), layout=two_layer()),
    ):
        with pytest.raises(r3.RouteError, match=message):
            decode()


def test_dense_layer_carrying_ids_is_named(layout, rng):
    wire = random_wire(rng, 3)
    wire[2, 0] = [3, 0]
    with pytest.raises(r3.RouteError, match="token 2, layer 0 is a dense layer but carries expert id 3"):
        r3.RouteTable.from_vllm(wire, layout=layout)


@pytest.mark.parametrize(
    "payload, kwargs, message",
    [
        ("AAAA!", {}, "invalid base64"),
        (sglang([1, 2, 3]), {}, "not a whole number of rows"),
        (sglang([1, 2, 3, 4]), {"dtype": "float32"}, "unknown dtype"),
        (sglang([1, 2, 3, 4], "<i2"), {"dtype": "int16"}, "not one SGLang sends"),
        ({"meta_info": {"routed_experts": None}}, {}, "capture was off"),
        (12, {}, "must be the base64"),
    ],
)
def test_malformed_sglang_payloads(payload, kwargs, message):
    with pytest.raises(r3.RouteError, match=message):
        r3.RouteTable.from_sglang(payload, layout=two_layer(), **kwargs)


def npy_header(shape, descr="<i4"):
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
    header = header + " " * (63 - len(header) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode()


@pytest.mark.parametrize(
    "payload, message",
    [
        (npy_header("(1099511627776, 2, 2)"), "exceeds the limit|bytes"),
        (npy_header("(1, 2, 2)"), "bytes"),
        (npy_header("(1, 3, 2)") + bytes(24), "does not match num_layers"),
        (npy_header("(1, 2, 2)", "<f4") + bytes(16), "dtype|descr"),
        (b"\x93NUMPY\x09\x00", "not an .npy file"),
        (np.zeros((2, 2), dtype=np.int32), "3-D"),
        (np.zeros((1, 2, 3), dtype=np.int32), "top_k is 2"),
        (np.zeros((1, 3, 2), dtype=np.int32), "3 layer columns"),
        (np.ones((1, 2, 2), dtype=np.float32), "array of integers"),
        ("not base64 at all", "base64"),
    ],
)
def test_malformed_vllm_payloads(payload, message):
    with pytest.raises(r3.RouteError, match=message):
        r3.RouteTable.from_vllm(payload, layout=two_layer())


def test_layout_and_argument_errors():
    with pytest.raises(r3.RouteError, match="listed twice"):
        r3.LayerLayout(4, [1, 1], num_experts=8, top_k=2)
    with pytest.raises(r3.RouteError, match="out of range"):
        r3.LayerLayout(4, [4], num_experts=8, top_k=2)
    with pytest.raises(r3.RouteError, match="top_k 9"):
        r3.LayerLayout(4, [1], num_experts=8, top_k=9)
    with pytest.raises(r3.RouteError, match="exceeds the limit"):
        r3.LayerLayout.from_hf_config({"num_hidden_layers": 10**9, "num_experts": 8, "num_experts_per_tok": 2})
    with pytest.raises(r3.RouteError, match="decoder_sparse_step"):
        r3.LayerLayout.from_hf_config({"num_hidden_layers": 4, "num_experts": 8,
                                       "num_experts_per_tok": 2, "decoder_sparse_step": -1})


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda l: r3.RouteTable.from_sglang("", layout=l, start_len=-1), "start_len"),
        (lambda l: r3.RouteTable.from_vllm(b"", layout=l, start_len=-2), "start_len"),
        (lambda l: r3.RouteTable.from_vllm(b"", layout=l, choice=-1), "choice"),
        (lambda l: r3.RouteTable.from_numpy(np.zeros((0, 3, 2), dtype=np.int32), layout=l, start_pos=-1), "start_pos"),
        (lambda l: r3.RouteTable.from_numpy(np.zeros((0, 3, 2), dtype=np.int32), layout=l).slice_rows(-1, 0), "start"),
        (lambda l: r3.RouteTable.from_numpy(np.zeros((0, 3, 2), dtype=np.int32), layout=l).slice_rows(0, -1), "stop"),
        (lambda l: r3.RouteTable.from_numpy(np.zeros((0, 3, 2), dtype=np.int32), layout=l).to_vllm("int16", -1), "npy_version"),
        (lambda l: r3.LayerLayout(4, [-1], num_experts=8, top_k=2), r"moe_layers\[0\]"),
        (lambda l: r3.LayerLayout(-4, [1], num_experts=8, top_k=2), "num_hidden_layers"),
        (lambda l: r3.LayerLayout(4, [1], num_experts=-8, top_k=2), "num_experts"),
        (lambda l: r3.LayerLayout(4, [1], num_experts=8, top_k=-2), "top_k"),
        (lambda l: l.is_moe(-1), "layer"),
        (lambda l: r3.check_covers_sequence(r3.RouteTable.from_numpy(np.zeros((0, 3, 2), dtype=np.int32), layout=l), -1),
         "total_tokens"),
    ],
)
def test_negative_integers_raise_route_error_naming_the_argument(layout, call, name):
    # Not OverflowError (PyO3's own, naming nothing), which `except ValueError` misses.
    with pytest.raises(r3.RouteError, match=f"{name} must be a non-negative integer, got -"):
        call(layout)


def test_integers_too_large_raise_route_error_naming_the_argument(layout):
    with pytest.raises(r3.RouteError, match="start_len is 36893488147419103232, above its largest value"):
        r3.RouteTable.from_sglang("", layout=layout, start_len=2**65)
    with pytest.raises(r3.RouteError, match="npy_version is 256, above its largest value 255"):
        r3.RouteTable.from_numpy(np.zeros((0, 3, 2), dtype=np.int32), layout=layout).to_vllm("int16", 256)
    # A wrong type stays the TypeError PyO3 names the argument in.
    with pytest.raises(TypeError, match="argument 'start_len'"):
        r3.RouteTable.from_sglang("", layout=layout, start_len="3")


def decode_everything(data, layout):
    """Every decoder on one input: each must return a table or raise r3.RouteError."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    attempts = [
        lambda: r3.RouteTable.from_sglang(text, layout=layout),
        lambda: r3.RouteTable.from_sglang(text, layout=layout, dtype="uint8", start_len=3),
        lambda: r3.RouteTable.from_vllm(data, layout=layout),
        lambda: r3.RouteTable.from_vllm(text, layout=layout),
        lambda: r3.RouteTable.from_json(text, layout=layout),
    ]
    if isinstance(data, bytes) and len(data) % 4 == 0 and data:
        arr = np.frombuffer(data, dtype="<i4")
        attempts.append(lambda: r3.RouteTable.from_numpy(arr.reshape(-1, 1, 1), layout=layout))
        if arr.size % 4 == 0:
            attempts.append(lambda: r3.RouteTable.from_vllm(arr.reshape(-1, 2, 2), layout=layout))
    for attempt in attempts:
        try:
            attempt()
        except r3.RouteError:
            pass


def valid_payloads(rng, layout):
    wire = random_wire(rng, 3, num_layers=2, dense=())
    wire[1, 1] = -1
    table = r3.RouteTable.from_vllm(wire, layout=layout)
    raw = io.BytesIO()
    np.save(raw, wire)
    return [
        table.to_sglang("int32").encode(),
        table.to_vllm("int16").encode(),
        raw.getvalue(),
        table.to_json().encode(),
    ]


def test_fuzz_arbitrary_and_mutated_payloads():
    rng = np.random.default_rng(7)
    layout = two_layer()
    small = r3.LayerLayout(1, [0], num_experts=300, top_k=1)
    for _ in range(400):
        data = rng.integers(0, 256, size=int(rng.integers(0, 200)), dtype=np.uint8).tobytes()
        decode_everything(data, layout)
        decode_everything(data, small)
    for _ in range(300):
        for payload in valid_payloads(rng, layout):
            buf = bytearray(payload)
            for _ in range(int(rng.integers(1, 6))):
                buf[int(rng.integers(0, len(buf)))] = int(rng.integers(0, 256))
            if rng.random() < 0.5:
                del buf[int(rng.integers(0, len(buf) + 1)):]
            decode_everything(bytes(buf), layout)
