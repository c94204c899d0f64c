"""SGLang's own clients against r3 serve: the frontend language through `RuntimeEndpoint`
(sglang installed with --no-deps; `triton_kernels`, imported through server utilities and
not installable on a CPU machine, is stubbed; the HTTP client never calls it), and
`python -m sglang.bench_serving` with `--backend sglang` and `--backend sglang-oai` on a few
random-token prompts (`--dataset-name random-ids`: plain `random` first downloads ShareGPT
from the hub; run as the stock module, in a subprocess).

Usage: client_sglang.py --url http://HOST:PORT --model-dir DIR
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from report import attempt, result


def runtime_endpoint(url):
    import stubs

    stubs.install(["triton_kernels"])
    import sglang as sgl
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    sgl.set_default_backend(RuntimeEndpoint(url))

    @sgl.function
    def arith(s, q):
        s += q
        s += sgl.gen("a", max_tokens=8, temperature=0, return_logprob=True,
                     logprob_start_len=0, top_logprobs_num=2)

    st = arith.run(q="12+7=")
    meta = st.get_meta_info("a")
    attempt("sglang", "RuntimeEndpoint gen (return_logprob, top_logprobs_num)",
            lambda: (isinstance(st["a"], str) and meta["completion_tokens"] > 0, str(meta)[:200]))
    attempt("sglang", "RuntimeEndpoint prompt log-probs (logprob_start_len=0)",
            lambda: (meta["input_token_logprobs"][0][0] is None
                     and len(meta["input_token_logprobs"]) > 1, str(meta)[:200]))

    def stream():
        text = "".join(arith.run(q="12+7=", stream=True).text_iter("a"))
        return text.endswith(st["a"]), f"{text!r} vs {st['a']!r}"

    attempt("sglang", "RuntimeEndpoint stream", stream)

    @sgl.function
    def stop_at(s):
        s += "1+1="
        s += sgl.gen("x", max_tokens=8, stop="=", temperature=0)

    attempt("sglang", "RuntimeEndpoint gen with a stop string",
            lambda: (lambda r: ("=" not in r["x"], repr(r["x"])))(stop_at.run()))

    # `select` asks for prompt log-probs from the prompt's second-to-last token and, when
    # the prompt text ends with that token's text ("token healing"), subtracts the first
    # entry — which SGLang's scheduler (`_process_input_token_logprobs`: `[None] + ...`)
    # and r3 both send as null. A prompt whose last two characters differ (the test model's
    # tokenizer is character-level) stays out of that branch, as it must with real SGLang.
    @sgl.function
    def choose(s):
        s += "12+7="
        s += sgl.select("y", choices=["19", "20"])

    attempt("sglang", "RuntimeEndpoint select",
            lambda: (lambda r: (r["y"] in ("19", "20"), str(r)))(choose.run()))


def bench_serving(url, model_dir, backend):
    host, port = url.rsplit("//", 1)[1].split(":")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.jsonl")
        cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--host", host,
               "--port", port, "--model", model_dir, "--tokenizer", model_dir,
               # random-ids: random token ids; "random" first downloads ShareGPT from the hub.
               "--dataset-name", "random-ids", "--random-input-len", "16", "--random-output-len", "16",
               "--random-range-ratio", "1.0", "--num-prompts", "8", "--seed", "1",
               "--output-file", out, "--disable-tqdm"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        sys.stdout.write(p.stdout[-3000:])
        sys.stderr.write(p.stderr[-3000:])
        if p.returncode != 0:
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["(no output)"]
            return False, f"exit {p.returncode}: {tail[0]}"
        rows = [json.loads(line) for line in open(out)]
        done = rows[-1].get("completed") if rows else None
        return done == 8, f"completed={done} of 8"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--only", choices=["frontend", "bench"])
    a = ap.parse_args()
    if a.only != "bench":
        try:
            runtime_endpoint(a.url)
        except Exception as e:  # an import failure is a result too
            result("sglang", "RuntimeEndpoint", False, f"{type(e).__name__}: {e}")
    if a.only != "frontend":
        for backend in ("sglang", "sglang-oai"):
            attempt("sglang", f"bench_serving --backend {backend}",
                    lambda b=backend: bench_serving(a.url, a.model_dir, b))


if __name__ == "__main__":
    main()
