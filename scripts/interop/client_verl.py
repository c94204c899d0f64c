"""verl's SGLang HTTP path against r3 serve: `AsyncHttpServerAdapter` (verl 0.9.1 from the
package index, verl/workers/rollout/sglang_rollout/http_server_engine.py), the adapter verl
uses to drive an SGLang server over HTTP. Its request methods (`generate`, `flush_cache`,
`abort_request`, `available_models`) run unchanged. The adapter is created with
`launch_server=False` but without its `__init__`, which builds SGLang's `ServerArgs` (GPU
probing) only to read host and port: those are set on the object instead. Stubbed at import
(not called by these methods): sglang's server modules (`sglang.srt.*`, imported for the
server launch and tensor weight updates), tensordict (verl's DataProto). sglang 0.5.23's
`EngineBase` has two abstract methods verl 0.9.1 lacks; they are cleared so the class
instantiates (a skew between the two packages).

Usage: client_verl.py --url http://HOST:PORT --model-dir DIR
"""

import argparse
import asyncio
from types import SimpleNamespace

import transformers  # noqa: F401  (before the stubs)

import stubs
from report import attempt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model-dir", required=True)
    a = ap.parse_args()
    stubs.install(["sglang.srt.entrypoints.http_server", "sglang.srt.managers", "sglang.srt.server_args",
                   "sglang.srt.utils", "tensordict", "torch_npu"])
    from verl.workers.rollout.sglang_rollout import http_server_engine as hse

    host, port = a.url.rsplit("//", 1)[1].split(":")
    # sglang 0.5.23's EngineBase declares begin/end_weight_update abstract and verl 0.9.1
    # does not define them (a skew between the two packages, unrelated to the server).
    hse.AsyncHttpServerAdapter.__abstractmethods__ = frozenset()
    eng = object.__new__(hse.AsyncHttpServerAdapter)
    eng.server_args = SimpleNamespace(host=host, port=int(port))
    eng.node_rank = 0
    eng.timeout = 60.0
    eng.max_attempts = 3
    eng.retry_delay = 1.0
    eng.max_connections = 16
    tok = transformers.AutoTokenizer.from_pretrained(a.model_dir)
    ids = tok.encode("12+7=", add_special_tokens=False)
    run = asyncio.run

    def gen():
        # verl's agent loop sampling params (temperature/top_p/top_k, repetition_penalty,
        # max_new_tokens) with return_logprob.
        r = run(eng.generate(input_ids=ids, return_logprob=True, sampling_params={
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
            "max_new_tokens": 8}))
        m = r["meta_info"]
        return len(m["output_token_logprobs"]) == m["completion_tokens"] > 0, str(m)[:200]

    attempt("verl", "AsyncHttpServerAdapter.generate (input_ids, return_logprob)", gen)

    def gen_text():
        r = run(eng.async_generate(prompt="3*4=", sampling_params={"max_new_tokens": 4},
                                   logprob_start_len=0, return_logprob=True, top_logprobs_num=2))
        m = r["meta_info"]
        return m["input_token_logprobs"][0][0] is None and len(m["output_top_logprobs"]) > 0, str(m)[:200]

    attempt("verl", "AsyncHttpServerAdapter.async_generate (prompt log-probs, top_logprobs_num)", gen_text)
    attempt("verl", "AsyncHttpServerAdapter.available_models (GET /v1/models)",
            lambda: (lambda r: (r["data"][0]["id"] != "", str(r)))(run(eng.available_models())))
    attempt("verl", "AsyncHttpServerAdapter.flush_cache (GET /flush_cache)",
            lambda: (lambda r: (isinstance(r, dict), str(r)))(run(eng.flush_cache())))
    attempt("verl", "AsyncHttpServerAdapter.abort_request(abort_all=True)",
            lambda: (lambda r: (isinstance(r, dict), str(r)))(run(eng.abort_request(abort_all=True))))


if __name__ == "__main__":
    main()
