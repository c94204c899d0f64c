"""Codec round trips, checked against payloads built independently with numpy and base64."""

import base64
import io
import json

import numpy as np
import pytest

import r3
from conftest import NUM_EXPERTS, NUM_LAYERS, TOP_K, random_wire

MOE = [1, 2, 3]


def test_layout_from_hf_config_forms(tmp_path, layout):
    assert layout.moe_layers == MOE
    assert (layout.num_hidden_layers, layout.num_experts, layout.top_k) == (4, 8, 2)
    assert not layout.is_moe(0) and layout.is_moe(3)
    cfg = {"num_hidden_layers": 6, "num_experts": 8, "num_experts_per_tok": 2,
           "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for form in (cfg, json.dumps(cfg), str(tmp_path), tmp_path, tmp_path / "config.json"):
        assert r3.LayerLayout.from_hf_config(form).moe_layers == [1, 5]
    with pytest.raises(r3.RouteError, match="num_experts_per_tok"):
        r3.LayerLayout.from_hf_config({"num_hidden_layers": 2, "num_experts": 4})
    with pytest.raises(r3.RouteError, match="cannot read"):
        r3.LayerLayout.from_hf_config(tmp_path / "missing.json")


def test_sglang_payload_built_with_numpy_decodes_to_its_moe_columns(rng, layout):
    wire = random_wire(rng, 7)
    for dtype in ("int32", "uint16", "uint8"):
        payload = base64.b64encode(wire.astype(dtype).tobytes()).decode()
        table = r3.RouteTable.from_sglang(payload, layout=layout, dtype=dtype, start_len=3)
        np.testing.assert_array_equal(table.ids, wire[:, MOE, :])
        assert table.present.all() and table.present.shape == (7, 3)
        assert (table.start_pos, table.num_rows, table.layers, len(table)) == (3, 7, MOE, 7)
        # Encoding gives back the same bytes SGLang sent.
        assert base64.b64decode(table.to_sglang(dtype)) == wire.astype(dtype).tobytes()
        assert r3.RouteTable.from_sglang(payload.encode(), layout=layout, dtype=dtype) == \
            r3.RouteTable.from_sglang(payload, layout=layout, dtype=dtype)
    np.testing.assert_array_equal(table.to_numpy_all_layers(), wire)


def test_sglang_response_dict_checks_token_counts(rng, layout):
    wire = random_wire(rng, 5)
    b64 = base64.b64encode(wire.tobytes()).decode()
    meta = {"routed_experts": b64, "routed_experts_dtype": "int32",
            "prompt_tokens": 4, "completion_tokens": 2}
    table = r3.RouteTable.from_sglang({"meta_info": meta}, layout=layout)
    np.testing.assert_array_equal(table.ids, wire[:, MOE])
    meta["completion_tokens"] = 3
    with pytest.raises(r3.RouteError, match="expected 6, got 5"):
        r3.RouteTable.from_sglang({"meta_info": meta}, layout=layout)


def test_sglang_response_dict_honours_an_explicit_dtype(rng, layout):
    wire = random_wire(rng, 5)
    u16 = base64.b64encode(wire.astype(np.uint16).tobytes()).decode()
    # A reply that does not say its dtype (read as int32 by default) or says it wrongly: the
    # caller's dtype wins, in meta_info or in the meta_info dict itself.
    for meta in ({"routed_experts": u16}, {"routed_experts": u16, "routed_experts_dtype": "int32"}):
        for payload in ({"meta_info": dict(meta)}, dict(meta)):
            table = r3.RouteTable.from_sglang(payload, layout=layout, dtype="uint16")
            np.testing.assert_array_equal(table.ids, wire[:, MOE])
        with pytest.raises(r3.RouteError):
            r3.RouteTable.from_sglang({"meta_info": dict(meta)}, layout=layout)
    # Without an explicit dtype the reply's own is used, and the caller's dict is untouched.
    meta = {"routed_experts": u16, "routed_experts_dtype": "uint16"}
    table = r3.RouteTable.from_sglang({"meta_info": meta}, layout=layout)
    np.testing.assert_array_equal(table.ids, wire[:, MOE])
    r3.RouteTable.from_sglang({"meta_info": meta}, layout=layout, dtype="uint16")
    assert meta == {"routed_experts": u16, "routed_experts_dtype": "uint16"}
    with pytest.raises(r3.RouteError, match="unknown dtype"):
        r3.RouteTable.from_sglang({"meta_info": meta}, layout=layout, dtype="float8")


def npy_bytes(arr):
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def test_vllm_npy_from_numpy_save_in_every_form(rng, layout):
    wire = random_wire(rng, 6)
    for dtype in ("int16", "int32", "uint8", "uint16"):
        arr = wire.astype(dtype)
        raw = npy_bytes(arr)
        b64 = base64.b64encode(raw).decode()
        forms = [arr, raw, b64, b64.encode(), json.dumps({"routed_experts": b64}),
                 {"choices": [{"routed_experts": b64}]}]
        for form in forms:
            table = r3.RouteTable.from_vllm(form, layout=layout)
            np.testing.assert_array_equal(table.ids, wire[:, MOE])
        back = np.load(io.BytesIO(base64.b64decode(table.to_vllm("int16"))))
        np.testing.assert_array_equal(back, wire)


def test_missing_cells_round_trip_as_minus_one(rng, layout):
    wire = random_wire(rng, 5)
    wire[2, 3] = -1
    wire[4, 1] = -1
    table = r3.RouteTable.from_vllm(wire, layout=layout)
    expected_present = np.ones((5, 3), dtype=bool)
    expected_present[2, 2] = expected_present[4, 0] = False
    np.testing.assert_array_equal(table.present, expected_present)
    np.testing.assert_array_equal(table.ids, wire[:, MOE])
    np.testing.assert_array_equal(table.to_numpy_all_layers(), wire)
    again = r3.RouteTable.from_sglang(table.to_sglang("int32"), layout=layout)
    assert again == table
    # An unsigned dtype cannot carry the missing mark.
    with pytest.raises(r3.RouteError, match="cannot carry -1"):
        table.to_sglang("uint8")


def test_from_numpy_takes_moe_or_wire_columns_and_any_int_dtype(rng, layout):
    wire = random_wire(rng, 4)
    moe = wire[:, MOE]
    a = r3.RouteTable.from_numpy(moe.astype(np.int64), layout=layout, start_pos=2)
    b = r3.RouteTable.from_numpy(wire.astype(np.uint8), layout=layout, start_pos=2)
    assert a == b and a.start_pos == 2
    # A non-contiguous view (every other row) is read after one contiguous copy.
    c = r3.RouteTable.from_numpy(moe[::2], layout=layout)
    np.testing.assert_array_equal(c.ids, moe[::2])


def test_canonical_json_and_slices(rng, layout):
    table = r3.RouteTable.from_vllm(random_wire(rng, 6), layout=layout, start_len=1)
    again = r3.RouteTable.from_json(table.to_json(), layout=layout)
    assert again == table
    part = table.slice_rows(2, 5)
    assert (part.start_pos, part.num_rows) == (3, 3)
    np.testing.assert_array_equal(part.ids, table.ids[2:5])
    assert "RouteTable(rows=6" in repr(table)


def test_base64_with_line_breaks_decodes_the_same(rng, layout):
    wire = random_wire(rng, 9)
    b64 = base64.b64encode(wire.tobytes()).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    assert r3.RouteTable.from_sglang(wrapped, layout=layout) == \
        r3.RouteTable.from_sglang(b64, layout=layout)


def test_vllm_response_of_several_choices_needs_the_choice(rng, layout):
    # n = 2: each choice carries its own routed_experts (3 rows and 5 rows).
    w0, w1 = random_wire(rng, 3), random_wire(rng, 5)
    b0 = base64.b64encode(npy_bytes(w0.astype(np.int16))).decode()
    b1 = base64.b64encode(npy_bytes(w1.astype(np.int16))).decode()
    response = {"choices": [{"routed_experts": b0}, {"routed_experts": b1}]}
    for form in (response, json.dumps(response), json.dumps(response).encode()):
        with pytest.raises(r3.RouteError, match="holds 2 choices"):
            r3.RouteTable.from_vllm(form, layout=layout)
        np.testing.assert_array_equal(r3.RouteTable.from_vllm(form, layout=layout, choice=1).ids, w1[:, MOE])
        np.testing.assert_array_equal(r3.RouteTable.from_vllm(form, layout=layout, choice=0).ids, w0[:, MOE])
        with pytest.raises(r3.RouteError, match="choice 2 asked for"):
            r3.RouteTable.from_vllm(form, layout=layout, choice=2)
    # The nested lists of vLLM 0.21 take the same argument.
    nested = {"prompt_routed_experts": w0[:2].tolist(),
              "choices": [{"routed_experts": w0[2:].tolist()}, {"routed_experts": w1[:1].tolist()}]}
    with pytest.raises(r3.RouteError, match="expected 1, got 2"):
        r3.RouteTable.from_vllm(nested, layout=layout)
    np.testing.assert_array_equal(
        r3.RouteTable.from_vllm(nested, layout=layout, choice=1).ids,
        np.concatenate([w0[:2], w1[:1]])[:, MOE],
    )
    with pytest.raises(r3.RouteError, match="choice 5 asked for; the response holds 2"):
        r3.RouteTable.from_vllm(nested, layout=layout, choice=5)
    # An array is one choice.
    assert r3.RouteTable.from_vllm(w0, layout=layout, choice=0).num_rows == 3
    with pytest.raises(r3.RouteError, match="an array is one choice"):
        r3.RouteTable.from_vllm(w0, layout=layout, choice=1)


def test_empty_sglang_reply_from_the_prompts_end(layout):
    # start_len = prompt_tokens (SGLang allows it) and nothing generated: 0 rows, as the
    # bare payload decodes.
    meta = {"routed_experts": "", "prompt_tokens": 7, "completion_tokens": 0}
    for payload in ({"meta_info": meta}, meta):
        table = r3.RouteTable.from_sglang(payload, layout=layout, start_len=7)
        assert (table.num_rows, table.start_pos) == (0, 7)
        assert table == r3.RouteTable.from_sglang("", layout=layout, start_len=7)
    with pytest.raises(r3.RouteError, match="misaligned"):
        r3.RouteTable.from_sglang({"meta_info": meta}, layout=layout, start_len=8)
