"""r3.megatron against real Megatron-Core on the CPU (gloo, world size 1).

Skipped unless torch and megatron.core import (scripts/py/megatron_check.sh installs the
pinned versions and runs this). Two CPU shims, both outside the routing code under test:
``Router.gating`` moves CPU weights to ``torch.cuda.current_device()``, so that returns the
CPU device here; and megatron-core 0.16.1's ``moe_utils`` leaves ``te_general_gemm`` undefined
without Transformer Engine, so it is defined as None (what the failed import means).
"""

import base64
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import r3  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel.mappings import _split_along_first_dim  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.pipeline_parallel_layer_layout import (  # noqa: E402
    PipelineParallelLayerLayout,
)
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # noqa: E402
from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402

NUM_LAYERS, HIDDEN, EXPERTS, TOP_K = 4, 16, 8, 2


@pytest.fixture(scope="module")
def megatron_cpu():
    torch.cuda.current_device = lambda: torch.device("cpu")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not torch.distributed.is_initialized():
        store = tempfile.NamedTemporaryFile(delete=False)
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{store.name}", rank=0, world_size=1
        )
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()


def moe_config(**kw):
    return TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=2,
        num_moe_experts=EXPERTS, moe_router_topk=TOP_K, moe_enable_routing_replay=True,
        use_cpu_initialization=True, moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, **kw,
    )


def build_routers(moe_layers):
    """One TopKRouter per MoE layer, in layer order (Megatron's construction order)."""
    RouterReplay.clear_global_router_replay_instances()
    pg = ProcessGroupCollection.use_mpu_process_groups()
    routers = []
    for layer in moe_layers:
        router = TopKRouter(moe_config(), pg_collection=pg)
        router.set_layer_number(layer + 1)
        routers.append(router)
    assert len(RouterReplay.global_router_replay_instances) == len(routers)
    return routers


def chosen(routing_map):
    """The sorted expert ids each token was dispatched to."""
    return [sorted(row.nonzero().flatten().tolist()) for row in routing_map]


def test_routers_replay_exactly_the_decoded_routes(megatron_cpu):
    layout = r3.LayerLayout(NUM_LAYERS, [1, 2, 3], num_experts=EXPERTS, top_k=TOP_K)
    routers = build_routers(layout.moe_layers)
    torch.manual_seed(0)
    lens = [7, 4]
    hidden = [torch.randn(sum(lens), 1, HIDDEN) for _ in routers]  # THD: [tokens, 1, hidden]
    # 1. Record natively.
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        for router, h in zip(routers, hidden):
            router(h)
    recorded = [ids.clone() for ids in RouterReplay.get_recorded_data()]
    # 2. Encode each sequence as SGLang's payload: all layers, dense layer 0 zeros, the
    #    sequence's last token not routed.
    payloads, start = [], 0
    for n in lens:
        wire = np.zeros((n - 1, NUM_LAYERS, TOP_K), dtype=np.int32)
        for router_ids, layer in zip(recorded, layout.moe_layers):
            wire[:, layer] = router_ids[start : start + n - 1].numpy()
        payloads.append(base64.b64encode(wire.tobytes()).decode())
        start += n
    # 3. Decode with r3, hand to RouterReplay, perturb the routers so that free routing
    #    would choose otherwise, replay.
    tables = [r3.RouteTable.from_sglang(p, layout=layout) for p in payloads]
    data = r3.megatron.set_replay(tables, layout)
    assert [d.dtype for d in data] == [torch.int64] * 3
    assert all(r.router_replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD for r in routers)
    with torch.no_grad():
        for router in routers:
            router.weight.add_(torch.randn_like(router.weight) * 5)
    free_differs = False
    for r_i, (router, h) in enumerate(zip(routers, hidden)):
        router.weight.grad = None
        probs, routing_map = router(h)
        got = chosen(routing_map)
        start = 0
        for n in lens:
            for t in range(n - 1):
                assert got[start + t] == sorted(recorded[r_i][start + t].tolist())
            # The last token (the rank's token t) replays the filler (t * top_k + j) % experts.
            t = start + n - 1
            assert got[t] == sorted((t * TOP_K + j) % EXPERTS for j in range(TOP_K))
            start += n
        # The gate weights of the replayed experts still carry gradients.
        (probs * torch.randn_like(probs)).sum().backward()
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
        with torch.no_grad():
            free = torch.topk(h.view(-1, HIDDEN) @ router.weight.T, TOP_K).indices
        free_differs |= any(sorted(f.tolist()) != g for f, g in zip(free, got))
    assert free_differs, "the perturbation should have changed some free routing"
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_router_replay_instances()


def routes_of(rng, n, num_layers, moe_layers):
    """A sequence of ``n`` tokens' wire array ``[n - 1, num_layers, top_k]``: distinct random
    experts in the MoE layers, zeros in the dense ones."""
    wire = np.zeros((n - 1, num_layers, TOP_K), dtype=np.int32)
    for t in range(n - 1):
        for layer in moe_layers:
            wire[t, layer] = rng.choice(EXPERTS, size=TOP_K, replace=False)
    return wire


def assert_replays(router, wires, layer):
    """The router, run on as many tokens as the packed sequences hold, selects each routed
    token's recorded experts and the filler elsewhere."""
    n = sum(len(w) + 1 for w in wires)
    with torch.no_grad():
        _, routing_map = router(torch.randn(n, 1, HIDDEN))
    got, t = chosen(routing_map), 0
    for w in wires:
        for row in w[:, layer]:
            assert got[t] == sorted(row.tolist()), (layer, t)
            t += 1
        assert got[t] == sorted((t * TOP_K + j) % EXPERTS for j in range(TOP_K)), (layer, t)
        t += 1


def test_set_replay_targets_one_model_chunk_under_virtual_pipelining(megatron_cpu):
    # 12 layers, pp 2 x vp 2: pp rank 0 builds chunks [0, 1, 2] and [6, 7, 8]; layer 0 is
    # dense, so its routers are those of layers 1, 2 (chunk 0) then 6, 7, 8 (chunk 1).
    num_layers, moe = 12, list(range(1, 12))
    layout = r3.LayerLayout(num_layers, moe, num_experts=EXPERTS, top_k=TOP_K)
    pipe = dict(pp_rank=0, pp_size=2, vp_size=2)
    chunk0, chunk1 = [1, 2], [6, 7, 8]
    assert r3.megatron.router_layers(layout, **pipe) == chunk0 + chunk1
    routers = build_routers(chunk0 + chunk1)
    rng = np.random.default_rng(7)
    # The chunks run different micro-batches: chunk 0 micro-batch A, chunk 1 micro-batch B.
    wires_a = [routes_of(rng, n, num_layers, moe) for n in (5, 3)]
    wires_b = [routes_of(rng, 6, num_layers, moe)]
    tables_a = [r3.RouteTable.from_vllm(w, layout=layout) for w in wires_a]
    tables_b = [r3.RouteTable.from_vllm(w, layout=layout) for w in wires_b]
    data_a = r3.megatron.set_replay(tables_a, layout, vp_stage=0, **pipe)
    data_b = r3.megatron.set_replay(tables_b, layout, vp_stage=1, **pipe)
    assert (len(data_a), len(data_b)) == (2, 3)
    # Each instance holds exactly its own chunk's one micro-batch.
    assert [len(r.router_replay.replay_backward_list) for r in routers] == [1] * 5
    for router, layer in zip(routers, chunk0 + chunk1):
        assert router.router_replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD
        assert_replays(router, wires_a if layer in chunk0 else wires_b, layer)
    # A recomputing backward pops the same ids, chunk by chunk.
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    for router, layer in zip(routers, chunk0 + chunk1):
        assert_replays(router, wires_a if layer in chunk0 else wires_b, layer)
    assert [len(r.router_replay.replay_backward_list) for r in routers] == [0] * 5
    # Instances that do not match the rank's chunks are refused by name.
    build_routers(chunk0)
    with pytest.raises(r3.RouteError, match="build 5 MoE routers .* holds 2 instances"):
        r3.megatron.set_replay(tables_a, layout, vp_stage=0, **pipe)
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_router_replay_instances()


def test_clear_replay_drops_the_ids_each_call_appends(megatron_cpu):
    layout = r3.LayerLayout(NUM_LAYERS, [1, 2, 3], num_experts=EXPERTS, top_k=TOP_K)
    routers = build_routers(layout.moe_layers)
    rng = np.random.default_rng(3)
    tables = [r3.RouteTable.from_vllm(routes_of(rng, 4, NUM_LAYERS, [1, 2, 3]), layout=layout)]
    for _ in range(3):  # three micro-batches (or steps) without a recomputing backward
        r3.megatron.set_replay(tables, layout)
    assert [len(r.router_replay.replay_backward_list) for r in routers] == [3] * 3
    r3.megatron.clear_replay()
    for r in routers:
        assert r.router_replay.replay_backward_list == []
        assert r.router_replay.target_topk_idx is None
        assert r.router_replay.router_replay_action is None
    RouterReplay.clear_global_router_replay_instances()


SPLITS = [
    dict(num_layers=8, pp=2),
    dict(num_layers=8, pp=2, vp=2),
    dict(num_layers=8, pp=2, vp=4),
    dict(num_layers=12, pp=4, vp=3),
    dict(num_layers=12, pp=3),
    dict(num_layers=10, pp=4, first=1, last=3),
    dict(num_layers=10, pp=3, first=2),
    dict(num_layers=9, pp=3, last=1),
    dict(num_layers=12, pp=4, first=2, last=2, vp=2),
    dict(num_layers=7, pp=4, emb=True),
    dict(num_layers=6, pp=4, emb=True, loss=True),
    dict(num_layers=6, pp=2, emb=True, loss=True, vp=2),
]


def pipeline_config(s):
    return TransformerConfig(
        num_layers=s["num_layers"], hidden_size=HIDDEN, num_attention_heads=2,
        pipeline_model_parallel_size=s["pp"], virtual_pipeline_model_parallel_size=s.get("vp"),
        num_layers_in_first_pipeline_stage=s.get("first"),
        num_layers_in_last_pipeline_stage=s.get("last"),
        account_for_embedding_in_pipeline_split=s.get("emb", False),
        account_for_loss_in_pipeline_split=s.get("loss", False),
        pipeline_dtype=torch.float32, use_cpu_initialization=True,
    )


@pytest.mark.parametrize("s", SPLITS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_pipeline_split_equals_megatrons_functions(s):
    config = pipeline_config(s)
    split = r3.megatron.PipelineSplit(
        s["num_layers"], s["pp"], vp_size=s.get("vp"), first_stage_layers=s.get("first"),
        last_stage_layers=s.get("last"), account_for_embedding=s.get("emb", False),
        account_for_loss=s.get("loss", False),
    )
    for pp_rank in range(s["pp"]):
        for vp_stage in (range(s["vp"]) if s.get("vp") else [None]):
            assert split.layer_offset(pp_rank, vp_stage) == get_transformer_layer_offset(
                config, vp_stage=vp_stage, pp_rank=pp_rank
            ), (pp_rank, vp_stage)
            assert split.num_layers_to_build(pp_rank, vp_stage) == get_num_layers_to_build(
                config, vp_stage=vp_stage, pp_rank=pp_rank
            ), (pp_rank, vp_stage)


class FakeGroup:
    """What Megatron's split reads of a process group: its size and this rank."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def megatron_cp_split(positions, cp_size, cp_rank, monkeypatch):
    """Megatron's get_batch_on_this_cp_rank on a [batch, seq] tensor of positions."""
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp_size)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: cp_rank)
    return get_batch_on_this_cp_rank({"position_ids": positions})["position_ids"]


@pytest.mark.parametrize("sp, cp", [(1, 2), (2, 1), (2, 2), (4, 1), (1, 3), (2, 3)])
def test_token_slices_equal_megatrons_split_functions(sp, cp, monkeypatch):
    lens = [9, 3, 14]
    align = 2 * cp * sp if cp > 1 else sp
    # BSHD: one padded batch [b, s] of "seq * 1000 + pos" (pads = -1); Megatron splits the
    # sequence dim over CP, transposes to [s, b], splits the first dim over SP; the routers
    # see it flattened.
    s_len = -(-max(lens) // align) * align
    ids = torch.full((len(lens), s_len), -1, dtype=torch.int64)
    for b, n in enumerate(lens):
        ids[b, :n] = b * 1000 + torch.arange(n)
    # THD: each sequence padded to the alignment, split per sequence (TE's
    # thd_get_partitioned_indices is the same zigzag per sub-sequence, so Megatron's bshd
    # split is applied to each sequence alone), concatenated, then SP-split.
    #
    # With `extra`, the data loader padded further than the alignment (bshd by `extra`
    # positions, thd each sequence by `extra` more), and r3 is given that padding
    # (`padded_len`, `cu_seqlens_padded`).
    for extra in (0, 2 * cp * sp):
        wide = torch.full((len(lens), s_len + extra), -1, dtype=torch.int64)
        wide[:, :s_len] = ids
        thd_lens = [-(-n // align) * align + extra for n in lens]
        cu = np.concatenate([[0], np.cumsum(thd_lens)])
        given = dict(bshd=dict(padded_len=s_len + extra), thd=dict(cu_seqlens_padded=cu.tolist()))
        for cp_rank in range(cp):
            bshd = megatron_cp_split(wide.clone(), cp, cp_rank, monkeypatch).T.contiguous()
            thd = []
            for b, n in enumerate(lens):
                padded = torch.full((1, thd_lens[b]), -1, dtype=torch.int64)
                padded[0, :n] = b * 1000 + torch.arange(n)
                thd.append(megatron_cp_split(padded, cp, cp_rank, monkeypatch)[0])
            thd = torch.cat(thd)
            for sp_rank in range(sp):
                want_bshd = _split_along_first_dim(bshd, FakeGroup(sp, sp_rank)).flatten()
                want_thd = _split_along_first_dim(thd, FakeGroup(sp, sp_rank))
                for packing, want in (("bshd", want_bshd), ("thd", want_thd)):
                    pad = given[packing] if extra else {}
                    slots = r3.megatron.rank_tokens(lens, packing, (sp, sp_rank), (cp, cp_rank), **pad)
                    got = np.where(slots[:, 0] >= 0, slots[:, 0] * 1000 + slots[:, 1], -1)
                    np.testing.assert_array_equal(
                        got, want.numpy(), err_msg=f"{packing} sp{sp_rank} cp{cp_rank} extra {extra}"
                    )


def test_a_short_replay_is_silent_in_megatron_and_refused_with_num_tokens(megatron_cpu):
    # verl at tp 2 without sequence parallelism pads sequences of 5 and 3 tokens to 6 and 4:
    # the router sees 10 tokens, the inferred padding gives 8 rows.
    layout = r3.LayerLayout(NUM_LAYERS, [1, 2, 3], num_experts=EXPERTS, top_k=TOP_K)
    routers = build_routers(layout.moe_layers)
    rng = np.random.default_rng(11)
    wires = [routes_of(rng, n, NUM_LAYERS, [1, 2, 3]) for n in (5, 3)]
    tables = [r3.RouteTable.from_vllm(w, layout=layout) for w in wires]
    r3.megatron.set_replay(tables, layout)
    with torch.no_grad():
        _, routing_map = routers[0](torch.randn(10, 1, HIDDEN))
    # Megatron takes 8 rows for 10 tokens without an error: the last 2 go to no expert.
    assert [len(row) for row in chosen(routing_map)] == [TOP_K] * 8 + [0, 0]
    r3.megatron.clear_replay()
    with pytest.raises(r3.RouteError, match="routers see 10 tokens, but the tables and padding give 8"):
        r3.megatron.set_replay(tables, layout, num_tokens=10)
    # With verl's padding given, every router row is one of the 10 tokens.
    r3.megatron.set_replay(tables, layout, num_tokens=10, cu_seqlens_padded=[0, 6, 10])
    with torch.no_grad():
        _, routing_map = routers[0](torch.randn(10, 1, HIDDEN))
    got = chosen(routing_map)
    assert [got[t] for t in (0, 1, 2, 3, 6, 7)] == [sorted(w[t, 1].tolist()) for w, t in
                                                     [(wires[0], 0), (wires[0], 1), (wires[0], 2),
                                                      (wires[0], 3), (wires[1], 0), (wires[1], 1)]]
    r3.megatron.clear_replay()
    RouterReplay.clear_global_router_replay_instances()


def test_routing_that_ignores_replay_is_refused(megatron_cpu):
    layout = r3.LayerLayout(NUM_LAYERS, [1, 2, 3], num_experts=EXPERTS, top_k=TOP_K)
    rng = np.random.default_rng(5)
    wire = routes_of(rng, 9, NUM_LAYERS, [1, 2, 3])
    tables = [r3.RouteTable.from_vllm(wire, layout=layout)]
    # Megatron-Core's sinkhorn routing never reads RouterReplay: with it, the routers route
    # freely after set_replay (top-1, the one sinkhorn supports).
    RouterReplay.clear_global_router_replay_instances()
    pg = ProcessGroupCollection.use_mpu_process_groups()
    sinkhorn = moe_config()
    sinkhorn.moe_router_load_balancing_type, sinkhorn.moe_router_topk = "sinkhorn", 1
    layout1 = r3.LayerLayout(NUM_LAYERS, [1, 2, 3], num_experts=EXPERTS, top_k=1)
    routers = []
    for layer in (1, 2, 3):
        routers.append(TopKRouter(sinkhorn, pg_collection=pg))
        routers[-1].set_layer_number(layer + 1)
    one = routes_of(rng, 9, NUM_LAYERS, [1, 2, 3])[:, :, :1]
    r3.megatron.set_replay([r3.RouteTable.from_vllm(one, layout=layout1)], layout1)
    h = torch.randn(9, 1, HIDDEN)
    with torch.no_grad():
        _, replayed = routers[0](h)
        RouterReplay.clear_global_router_replay_action()
        _, free = routers[0](h)
    assert torch.equal(replayed, free)
    assert any(chosen(replayed)[t] != [int(one[t, 1, 0])] for t in range(8)), "replay would differ"
    r3.megatron.clear_replay()
    with pytest.raises(r3.RouteError, match="moe_router_load_balancing_type is 'sinkhorn'"):
        r3.megatron.set_replay([r3.RouteTable.from_vllm(one, layout=layout1)], layout1, config=routers[0])
    RouterReplay.clear_global_router_replay_instances()
    # moe_router_fusion: the fused top-k kernel is chosen before the replay (refused here on
    # the config; the kernel itself needs Transformer Engine on a GPU).
    fused = moe_config()
    fused.moe_router_fusion = True
    with pytest.raises(r3.RouteError, match="moe_router_fusion is True"):
        r3.megatron.set_replay(tables, layout, config=fused)
    build_routers(layout.moe_layers)
    r3.megatron.set_replay(tables, layout, config=moe_config())
    r3.megatron.clear_replay()
    RouterReplay.clear_global_router_replay_instances()


# Custom pipeline layouts (pipeline_model_parallel_layout), as Megatron's CLI takes them:
# (layout, num_layers, pp, moe_layer_freq, mtp_num_layers).
LAYOUTS = [
    ("Et|tt|tt|tL", 6, 2, [0, 1, 1, 1, 1, 1], None),  # pp 2 x vp 2, 1/2/2/1 layers
    ("E|t*4|t*4|tt,L", 10, 4, [0] * 3 + [1] * 7, None),  # DeepSeek-like embedding stage
    ("Ettt|(tt|)*6,tL", 16, 4, 2, None),  # pp 4 x vp 2, every other layer MoE
    ("E|(tt|)*6,L", 12, 4, [0] + [1] * 11, None),  # embedding and loss stages, pp 4 x vp 2
    ("Et*3|t*3|t*3|t*2,L", 11, 2, [0, 0] + [1] * 9, None),
    ("Et|tt|tt|tmL", 6, 2, [0, 1, 1, 1, 1, 1], 1),  # an MTP layer on the last stage
    ("EttttL", 4, 1, [0, 1, 1, 1], None),  # one stage
]


def layout_config(text, num_layers, pp, freq, mtp):
    """A TransformerConfig with the layout: __post_init__ turns the string into Megatron's
    PipelineParallelLayerLayout, checks it, and sets the virtual size it implies."""
    return TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=2,
        pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=text,
        num_moe_experts=EXPERTS, moe_router_topk=TOP_K, moe_layer_freq=freq,
        mtp_num_layers=mtp, moe_enable_routing_replay=True, moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none", pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )


def on_rank(monkeypatch, pp_rank, vp):
    """With a layout Megatron's functions read the pipeline rank and the virtual size from
    parallel_state (get_transformer_layer_offset ignores its pp_rank argument)."""
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: pp_rank)
    monkeypatch.setattr(
        parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: vp if vp > 1 else None
    )


@pytest.mark.parametrize("case", LAYOUTS, ids=lambda c: c[0])
def test_pipeline_layout_equals_megatrons_functions(case, monkeypatch):
    text, num_layers, pp, freq, mtp = case
    config = layout_config(text, num_layers, pp, freq, mtp)
    mg_layout = config.pipeline_model_parallel_layout
    vp = mg_layout.virtual_pipeline_model_parallel_size
    assert (config.virtual_pipeline_model_parallel_size or 1) == vp
    pattern = [1 if i % freq == 0 else 0 for i in range(num_layers)] if isinstance(freq, int) else freq
    model = r3.LayerLayout(num_layers, [i for i, m in enumerate(pattern) if m], num_experts=EXPERTS, top_k=TOP_K)
    # The layout as the CLI string, as the config's object, and read from the config.
    forms = {
        "string": dict(pp_size=pp, pipeline_layout=text),
        "object": dict(pp_size=pp, pipeline_layout=mg_layout),
        "config": r3.megatron.pipeline_from_config(config, num_layers),
    }
    for name, pipe in forms.items():
        split = r3.megatron.PipelineSplit(
            num_layers, pipe["pp_size"], vp_size=pipe.get("vp_size"), pipeline_layout=pipe["pipeline_layout"]
        )
        for pp_rank in range(pp):
            chunks = []
            for stage in range(vp):
                vp_stage = stage if vp > 1 else None
                on_rank(monkeypatch, pp_rank, vp)
                where = (name, pp_rank, vp_stage)
                assert split.layer_offset(pp_rank, vp_stage) == get_transformer_layer_offset(
                    config, vp_stage=vp_stage, pp_rank=pp_rank
                ), where
                assert split.num_layers_to_build(pp_rank, vp_stage) == get_num_layers_to_build(
                    config, vp_stage=vp_stage, pp_rank=pp_rank
                ), where
                ids = mg_layout.get_layer_id_list(vp_stage=vp_stage, pp_rank=pp_rank)
                assert split.local_layers(pp_rank, vp_stage) == ids, where
                # The layers whose specs Megatron builds as MoE layers (each has a router).
                specs = get_gpt_decoder_block_spec(
                    config, use_transformer_engine=False, vp_stage=vp_stage, pp_rank=pp_rank
                ).layer_specs
                moe = [i for i, spec in zip(ids, specs) if spec.submodules.mlp.module is MoELayer]
                routers = r3.megatron.router_layers(model, pp_rank=pp_rank, vp_stage=vp_stage, **pipe)
                assert routers == moe, where
                chunks += moe
            # Every chunk in construction order when no vp_stage is named.
            assert r3.megatron.router_layers(model, pp_rank=pp_rank, **pipe) == chunks


def test_set_replay_reads_the_layout_from_the_config(megatron_cpu):
    # "Et|tt|tt|tL" over pp 2: pp rank 1 builds chunk 0 = layers [1, 2] and chunk 1 = [5];
    # layer 0 is dense. An even split of 6 layers over pp 2 x vp 2 does not exist at all.
    text, num_layers, pp, freq, _ = LAYOUTS[0]
    config = layout_config(text, num_layers, pp, freq, None)
    layout = r3.LayerLayout(num_layers, [1, 2, 3, 4, 5], num_experts=EXPERTS, top_k=TOP_K)
    chunk0, chunk1 = [1, 2], [5]
    routers = build_routers(chunk0 + chunk1)
    rng = np.random.default_rng(17)
    wires_a = [routes_of(rng, n, num_layers, layout.moe_layers) for n in (5, 3)]
    wires_b = [routes_of(rng, 4, num_layers, layout.moe_layers)]
    tables_a = [r3.RouteTable.from_vllm(w, layout=layout) for w in wires_a]
    tables_b = [r3.RouteTable.from_vllm(w, layout=layout) for w in wires_b]
    # Only pp_rank and vp_stage given: the layout, pp and vp come from the config.
    data_a = r3.megatron.set_replay(tables_a, layout, config=config, pp_rank=1, vp_stage=0)
    data_b = r3.megatron.set_replay(tables_b, layout, config=config, pp_rank=1, vp_stage=1)
    assert (len(data_a), len(data_b)) == (2, 1)
    assert [len(r.router_replay.replay_backward_list) for r in routers] == [1] * 3
    for router, layer in zip(routers, chunk0 + chunk1):
        assert_replays(router, wires_a if layer in chunk0 else wires_b, layer)
    r3.megatron.clear_replay()
    # Without the layout, the config-less call cannot describe this pipeline.
    with pytest.raises(r3.RouteError, match="not divisible"):
        r3.megatron.set_replay(tables_a, layout, pp_rank=1, pp_size=2, vp_size=2, vp_stage=0)
    # A pipeline keyword that disagrees with the config is refused by name.
    with pytest.raises(r3.RouteError, match="pipeline_layout='Et|ttt|t|tL' differs"):
        r3.megatron.set_replay(tables_a, layout, config=config, pp_rank=1, vp_stage=0,
                               pipeline_layout="Et|ttt|t|tL")
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_router_replay_instances()


def random_layout_text(rng):
    """Pieces of the layout grammar (letters, stages, x*n, (...)*n, commas) with strays
    (a lone star or bracket, a digit, a space, an unknown letter) among them."""
    pieces = []
    for _ in range(rng.integers(1, 7)):
        kind = rng.integers(0, 7)
        if kind == 0:
            pieces.append(str(rng.choice(list("EtmL"))))
        elif kind == 1:
            pieces.append("|")
        elif kind == 2:
            pieces.append(f"{rng.choice(list('Etm|L'))}*{rng.integers(0, 12)}")
        elif kind == 3:
            inner = "".join(rng.choice(list("tt|E,m("), size=rng.integers(0, 5)))
            pieces.append(f"({inner})*{rng.integers(0, 5)}")
        elif kind == 4:
            pieces.append(",")
        else:
            pieces.append(str(rng.choice(list("*()x 07t"))))
    return "".join(pieces)


def test_layout_strings_parse_as_megatrons_parser():
    """r3's parser against PipelineParallelLayerLayout.parse_str_to_list on the docstring's
    examples and 4,000 seeded random strings: the same stages, or both refuse."""
    rng = np.random.default_rng(2026)
    texts = ["Ettt|(tt|)*29,m|L", "E|(t*4|)*3,tt,m,L", "((tt)*2)*2", "t**2", "(|Et)*2,tL", "", "|"]
    texts += [random_layout_text(rng) for _ in range(4000)]
    agreed = refused = repeated = 0
    for text in texts:
        try:
            want = [[layer.name for layer in stage] for stage in PipelineParallelLayerLayout.parse_str_to_list(text)]
        except AssertionError:
            want = None
        try:
            got = r3.megatron.PipelineSplit(1, pipeline_layout=text).pipeline_layout
        except r3.RouteError:
            got = None
        assert got == want, repr(text)
        agreed += want is not None
        refused += want is None
        repeated += want is not None and "*" in text
    assert min(agreed, refused, repeated) > 500, (agreed, refused, repeated)
