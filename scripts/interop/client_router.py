"""sglang-router (the package index's `sglang-router`, launched by run.sh with
`python -m sglang_router.launch_router --worker-urls W1 W2`) in front of two `r3 serve
--return-routed-experts-by-default` workers: /generate with routes decoded to
`[prompt + completion - 1, layers, top_k]`, requests spread over both workers, the OpenAI
paths through the router, and the control endpoints it fans out.

Usage: client_router.py --router URL --workers W1 W2 --layers L --top-k K
"""

import argparse
import base64
import json
import urllib.request

import numpy as np

from report import attempt


def call(base, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=300) as r:
        raw = r.read()
        try:
            return json.loads(raw or b"{}")
        except json.JSONDecodeError:
            return raw.decode(errors="replace")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--workers", nargs=2, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--top-k", type=int, required=True)
    a = ap.parse_args()
    c = "sglang-router"

    def routes():
        r = call(a.router, "/generate", {"text": "3*4=", "return_routed_experts": True,
                                          "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 8}})
        m = r["meta_info"]
        ex = np.frombuffer(base64.b64decode(m["routed_experts"]), dtype=np.int32)
        rows = m["prompt_tokens"] + m["completion_tokens"] - 1
        ex = ex.reshape(rows, a.layers, a.top_k)
        return ex.shape[0] == rows and len(m["output_token_logprobs"]) == m["completion_tokens"], str(ex.shape)

    attempt(c, "/generate with routed_experts through the router", routes)

    def spread():
        before = [call(w, "/get_server_info")["worker"]["steps"] for w in a.workers]
        for i in range(8):
            call(a.router, "/generate", {"input_ids": [5, 6, 7 + i % 3],
                                         "sampling_params": {"max_new_tokens": 2}})
        after = [call(w, "/get_server_info")["worker"]["steps"] for w in a.workers]
        return all(y > x for x, y in zip(before, after)), f"steps {before} -> {after}"

    attempt(c, "requests reach both workers", spread)

    def openai_paths():
        from openai import OpenAI

        cl = OpenAI(base_url=a.router + "/v1", api_key="none")
        name = cl.models.list().data[0].id
        comp = cl.completions.create(model=name, prompt="3*4=", max_tokens=8, stop=["#"],
                                     logprobs=1)
        chat = cl.chat.completions.create(model=name, messages=[{"role": "user", "content": "3*4="}],
                                          max_tokens=8)
        parts = [e.choices[0].text for e in cl.completions.create(
            model=name, prompt="3*4=", max_tokens=8, stream=True) if e.choices]
        return (len(comp.choices) == 1 and chat.choices[0].message.role == "assistant"
                and len(parts) >= 1), f"{comp.choices[0].text!r} {chat.choices[0].message.content!r} {parts}"

    attempt(c, "openai completions / chat / stream through the router", openai_paths)

    def control():
        call(a.router, "/flush_cache", {})
        return True, ""

    attempt(c, "/flush_cache fan-out", control)


if __name__ == "__main__":
    main()
