"""slime's / miles' real rollout `generate()` (PKG/rollout/sglang_rollout.py) against r3 serve.

Usage: client_slime.py --pkg slime|miles --src SRC_DIR --url http://HOST:PORT --model-dir DIR
The checked-out package is imported from SRC_DIR; `args` is the argparse Namespace fields the
function reads, `sample` the package's own `Sample`. Stubbed at import time (the request path
never calls them): ray (data loading and distributed POST, off here), megatron, sglang and
other trainer-side packages imported on the import chain. torch is the real package (`Sample`
keeps routes and log-probs as tensors); the tokenizer is the model directory's own, loaded by
transformers' AutoTokenizer as slime does.
"""

import argparse
import asyncio
import sys
from argparse import Namespace

import numpy as np
import transformers  # noqa: F401  (imported before the stubs: it must see that torch is absent)

import stubs
from report import attempt

HEAVY = ["ray", "megatron", "torch_memory_saver", "sglang", "wandb", "opentelemetry",
         "flash_attn", "transformer_engine", "apex", "deepspeed", "tensorboard", "pylatexenc"]


class Args(Namespace):
    """The launcher's argparse Namespace, with the fields the rollout path reads set as a plain
    R3 run sets them; names the code looks up with a default (`getattr(args, x, d)`) and that
    are not set here are recorded in `unset` and get the code's own default."""

    unset = set()

    def __getattr__(self, name):
        Args.unset.add(name)
        raise AttributeError(name)


def make_args(url, model_dir, routes, layers, top_k):
    host, port = url.rsplit("//", 1)[1].split(":")
    return Args(
        ci_test=False, hf_checkpoint=model_dir, sglang_router_ip=host, sglang_router_port=int(port),
        sglang_server_concurrency=8, rollout_num_engines=1, use_distributed_post=False,
        rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=12,
        rollout_stop=None, rollout_stop_token_ids=None, rollout_skip_special_tokens=False,
        rollout_seed=42, n_samples_per_prompt=2, sglang_dp_size=None,
        use_rollout_routing_replay=routes, partial_rollout=False, mask_offpolicy_in_partial_rollout=False,
        custom_generate_function_path=None, group_rm=False, router_policy=None,
        use_rollout_indexer_replay=False, use_opd=False, rollout_function_path=None,
        num_layers=layers, moe_router_topk=top_k,
        # One rollout engine of one GPU, as the launcher would record it (miles sizes its
        # HTTP client from these).
        rollout_num_gpus=1, rollout_num_gpus_per_engine=1, eval_num_gpus=0,
        eval_num_gpus_per_engine=1, chat_template_path=None,
        sglang_router_policy=None, sglang_speculative_algorithm=None,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pkg", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--top-k", type=int, required=True)
    a = ap.parse_args()
    stubs.install(HEAVY)
    sys.path.insert(0, a.src)
    mod = __import__(f"{a.pkg}.rollout.sglang_rollout", fromlist=["generate", "GenerateState"])
    types = __import__(f"{a.pkg}.utils.types", fromlist=["Sample"])
    http_utils = __import__(f"{a.pkg}.utils.http_utils", fromlist=["init_http_client"])
    Sample = types.Sample
    args = make_args(a.url, a.model_dir, True, a.layers, a.top_k)
    http_utils.init_http_client(args)
    state = mod.GenerateState(args)
    tok = state.tokenizer

    def one(prompt, params):
        sample = Sample(prompt=prompt, index=0)
        sample.status = Sample.Status.PENDING
        return asyncio.get_event_loop().run_until_complete(mod.generate(args, sample, params))

    def plain():
        s = one("12+7=", state.sampling_params.copy())
        lps = [float(x) for x in s.rollout_log_probs]
        ok = s.response_length > 0 and len(lps) == s.response_length and all(x <= 0 for x in lps)
        return ok, f"response_length={s.response_length} log_probs={lps[:4]} status={s.status}"

    def routes():
        s = one("3*4=", state.sampling_params.copy())
        ex = getattr(s, "rollout_routed_experts", None)
        if ex is None:
            return False, "sample.rollout_routed_experts is None"
        arr = np.asarray(ex)
        want = (len(s.tokens) - 1, args.num_layers, args.moe_router_topk)
        return arr.shape == want and arr.min() >= 0, f"routed experts shape {arr.shape}, want {want}"

    def stop_params():
        p = state.sampling_params.copy()
        p.update(stop=["#"], stop_token_ids=[2], skip_special_tokens=True, sampling_seed=3)
        s = one("5+5=", p)
        return s.response_length > 0, f"response {s.response!r}"

    attempt(a.pkg, "generate() plain (input_ids, return_logprob)", plain)
    attempt(a.pkg, "generate() with use_rollout_routing_replay", routes)
    attempt(a.pkg, "generate() stop / stop_token_ids / sampling_seed", stop_params)
    print(f"{a.pkg}: args fields read but not set (None): {sorted(Args.unset)}")


if __name__ == "__main__":
    main()
