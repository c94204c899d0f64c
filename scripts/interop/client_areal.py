"""AReaL's `RemoteSGLangEngine` against r3 serve (areal 1.0.4 from the package index,
installed --no-deps; areal/engine/sglang_remote.py + areal/infra/remote_inf_engine.py):
`initialize(addr=...)` (health wait), `agenerate` with R3 (`return_routed_experts`) and with
AReaL's default `max_new_tokens`, `pause_generation` / `continue_generation`, and
`update_weights_from_disk` as its trainer drives it (the trainer's "saved" record put in
AReaL's name_resolve, then the engine's update request to every server) — to other weights
(`--other-model-dir`: greedy tokens change on every server) and back (the first tokens
again) — and with `--device-url` its colocated cycle (`offload` / `onload`:
/release_memory_occupation and /resume_memory_occupation, the update to the other weights
while offloaded) against a worker on the device engine. Nothing is stubbed that these calls
use; torch / torchdata are real packages.

Usage: client_areal.py --urls URL1 URL2 --model-dir DIR --other-model-dir DIR_B [--device-url URL3]
"""

import argparse
import asyncio
import tempfile
import time

import transformers  # noqa: F401

from report import attempt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--urls", nargs="+", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--other-model-dir", required=True,
                    help="the same architecture with other weights (the updates switch to it)")
    ap.add_argument("--device-url", help="a worker on the device engine (r3 serve --device cpu-candle)")
    a = ap.parse_args()
    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
    from areal.api.io_struct import ModelRequest
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.utils import name_resolve

    records = tempfile.mkdtemp(prefix="areal-names-")
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=records))
    # `backend` has no default in areal 1.0.4 (MISSING): two SGLang servers, data parallel.
    config = InferenceEngineConfig(experiment_name="r3-interop", trial_name="t0", backend="sglang:d2",
                                   max_concurrent_rollouts=4, consumer_batch_size=1,
                                   request_timeout=120, setup_timeout=60,
                                   return_routed_experts=True, pause_grace_period=0.1)
    addrs = [u.rsplit("//", 1)[1] for u in a.urls]
    eng = RemoteSGLangEngine(config)
    c = "areal"
    if not attempt(c, "RemoteSGLangEngine.initialize(addr=[2 servers])",
                   lambda: (eng.initialize(addr=addrs), True)[1]):
        return
    tok = transformers.AutoTokenizer.from_pretrained(a.model_dir)
    ids = tok.encode("12+7=", add_special_tokens=False)

    def agenerate(max_new):
        req = ModelRequest(input_ids=list(ids), tokenizer=tok,
                           gconfig=GenerationHyperparameters(max_new_tokens=max_new, n_samples=1))
        return asyncio.run(eng.agenerate(req))

    def with_routes():
        r = agenerate(8)
        rows = len(r.input_tokens) + len(r.output_tokens) - 1
        shape = None if r.routed_experts is None else r.routed_experts.shape
        return (len(r.output_tokens) == len(r.output_logprobs) > 0 and shape is not None
                and shape[0] == rows), f"stop {r.stop_reason}, routes {shape}, rows {rows}"

    attempt(c, "agenerate with return_routed_experts", with_routes)

    def default_len():
        # GenerationHyperparameters' default max_new_tokens (16384) is far past the context:
        # r3 clips it and answers `length`.
        r = agenerate(GenerationHyperparameters().max_new_tokens)
        return r.stop_reason in ("length", "stop") and len(r.output_tokens) > 0, f"{r.stop_reason} {len(r.output_tokens)}"

    attempt(c, "agenerate with the default max_new_tokens", default_len)

    def weight_cycle():
        # As many greedy answers as servers (AReaL spreads requests over them), before the
        # update, under the other weights, and back under the first ones.
        answers = lambda: [greedy(eng, tok, ids) for _ in addrs]
        before = answers()
        eng.pause_generation()
        update_from_disk(eng, config, a.other_model_dir, version=1)
        eng.continue_generation()
        eng.set_version(1)
        other = answers()
        eng.pause_generation()
        update_from_disk(eng, config, a.model_dir, version=2)
        eng.continue_generation()
        eng.set_version(2)
        back = answers()
        first = before[0]
        ok = (len(first) > 0 and all(b == first for b in before + back)
              and all(o != first for o in other))
        return ok, f"tokens {before} -> other weights {other} -> back {back}"

    attempt(c, "pause_generation / update_weights_from_disk / continue_generation", weight_cycle)
    eng.destroy()
    if a.device_url:
        offload_cycle(a, tok, ids, config)


def greedy(eng, tok, ids):
    """Six greedy tokens after `ids` through `eng.agenerate`."""
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest

    req = ModelRequest(input_ids=list(ids), tokenizer=tok,
                       gconfig=GenerationHyperparameters(max_new_tokens=6, greedy=True,
                                                         n_samples=1))
    return asyncio.run(eng.agenerate(req)).output_tokens


def update_from_disk(eng, config, model_dir, version):
    """The update from disk to `version` as AReaL's trainer drives it: the engine at the
    version before, the saved checkpoint announced in name_resolve, then the engine's update
    request to every server."""
    from areal.api.io_struct import WeightUpdateMeta
    from areal.utils import name_resolve, names

    eng.set_version(version - 1)
    meta = WeightUpdateMeta(type="disk", path=model_dir, clear_checkpoint_after_load=False)
    name_resolve.add(names.update_weights_from_disk(config.experiment_name, config.trial_name,
                                                    version - 1), str(time.time()), replace=True)
    eng.update_weights_from_disk(meta).result(timeout=120)


def offload_cycle(a, tok, ids, config):
    """AReaL's colocated step (areal/trainer/rl_trainer.py `_offload_rollout` /
    `_onload_rollout`) against a device-engine worker: `pause` + `pause_generation`, then
    `offload()` (/release_memory_occupation, every region), the trainer's update from disk
    while the rollout is offloaded, `onload()` (/resume_memory_occupation), then
    `continue_generation`; the same prompt then generates other greedy tokens (the update
    was to the other weights), and after an update back, the same as before."""
    import json
    import urllib.request

    from areal.engine.sglang_remote import RemoteSGLangEngine

    c = "areal"
    config.backend = "sglang:d1"
    eng = RemoteSGLangEngine(config)
    addr = a.device_url.rsplit("//", 1)[1]
    if not attempt(c, "RemoteSGLangEngine.initialize(addr=[device worker])",
                   lambda: (eng.initialize(addr=[addr]), True)[1]):
        return

    def released():
        with urllib.request.urlopen(a.device_url + "/get_server_info", timeout=30) as r:
            return json.load(r)["worker"]["memory_released"]

    def cycle():
        before = greedy(eng, tok, ids)
        eng.pause()
        eng.pause_generation()
        eng.offload()
        during = released()
        update_from_disk(eng, config, a.other_model_dir, version=1)
        eng.onload()
        after_onload = released()
        eng.continue_generation()
        eng.resume()
        eng.set_version(1)
        after = greedy(eng, tok, ids)
        eng.pause_generation()
        update_from_disk(eng, config, a.model_dir, version=2)
        eng.continue_generation()
        eng.set_version(2)
        back = greedy(eng, tok, ids)
        ok = (sorted(during) == ["cuda_graph", "kv_cache", "weights"] and after_onload == []
              and len(before) > 0 and after != before and back == before)
        return ok, (f"released {during}, then {after_onload}; tokens {before} -> other weights "
                    f"{after} -> back {back}")

    attempt(c, "pause / offload / update_weights_from_disk / onload / continue (device worker)",
            cycle)
    eng.destroy()


if __name__ == "__main__":
    main()
