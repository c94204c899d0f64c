"""Drives a running `r3 serve` with the clients RL frameworks use; exits non-zero on failure.

Run through scripts/interop/run.sh. Checks: the `openai` client (models.list, completions
with stop strings, neutral penalties, best_of / logit_bias / suffix and logprobs with
text_offset), SGLang-native /generate with slime's and AReaL's request bodies, the pause /
update / continue cycle with a string weight_version, and, given --router, two workers behind
sglang-router returning routed experts.
"""

import argparse
import json
import sys
import time
import urllib.request


def call(base, path, body=None, method=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method or ("POST" if data else "GET"))
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read() or b"{}")


def wait_ready(base):
    # sglang-router answers /health with plain text, so only the status is checked.
    for _ in range(600):
        try:
            with urllib.request.urlopen(base + "/health", timeout=10) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.5)
    raise SystemExit(f"{base} never became healthy")


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + (f": {detail}" if detail and not cond else ""))
    if not cond:
        check.failed = True


check.failed = False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--router")
    ap.add_argument("--model-dir", required=True)
    a = ap.parse_args()
    wait_ready(a.worker)

    from openai import OpenAI

    client = OpenAI(base_url=a.worker + "/v1", api_key="none")
    models = client.models.list()
    check("openai models.list", len(models.data) == 1)
    name = models.data[0].id
    c = client.completions.create(
        model=name, prompt="12+7=", max_tokens=12, temperature=0, stop=["#"],
        presence_penalty=0.0, frequency_penalty=0.0, best_of=1, logit_bias={}, suffix="",
        logprobs=2,
    )
    ch = c.choices[0]
    check("openai completion stop string", "#" not in ch.text, ch.text)
    check("openai logprobs.text_offset", len(ch.logprobs.text_offset) == len(ch.logprobs.tokens))
    check("openai top_logprobs", all(len(t) <= 2 for t in ch.logprobs.top_logprobs))

    # slime (THUDM/slime slime/rollout/sglang_rollout.py) with R3.
    r = call(a.worker, "/generate", {
        "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 16,
                            "stop": None, "stop_token_ids": None, "skip_special_tokens": False,
                            "no_stop_trim": True, "spaces_between_special_tokens": False},
        "return_logprob": True, "return_routed_experts": True, "text": "3*4=",
    })
    check("slime generate", "routed_experts" in r["meta_info"], json.dumps(r)[:200])
    # AReaL (inclusionAI/AReaL areal/engine/sglang_remote.py): huge max_new_tokens, no body on pause.
    r = call(a.worker, "/generate", {
        "text": "3*4=", "image_data": None, "return_logprob": True, "stream": False,
        "sampling_params": {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": 16384,
                            "temperature": 1.0, "stop_token_ids": [], "frequency_penalty": 0.0},
    })
    check("areal generate (max_new_tokens clipped)", r["meta_info"]["completion_tokens"] > 0)
    call(a.worker, "/pause_generation", method="POST")
    u = call(a.worker, "/update_weights_from_disk",
             {"model_path": a.model_dir, "weight_version": "7", "abort_all_requests": True})
    call(a.worker, "/continue_generation", method="POST")
    info = call(a.worker, "/get_server_info")
    check("weight_version string", u["weight_version"] == "7" and info["weight_version"] == "7")
    call(a.worker, "/flush_cache", method="POST")
    loads = call(a.worker, "/v1/loads")
    check("v1/loads", "loads" in loads)

    if a.router:
        wait_ready(a.router)
        r = call(a.router, "/generate", {"text": "3*4=", "return_routed_experts": True,
                                          "sampling_params": {"max_new_tokens": 8}})
        check("sglang-router generate with routes", bool(r["meta_info"].get("routed_experts")))
        c = OpenAI(base_url=a.router + "/v1", api_key="none").completions.create(
            model=name, prompt="3*4=", max_tokens=8)
        check("sglang-router completions", len(c.choices) == 1)
    sys.exit(1 if check.failed else 0)


if __name__ == "__main__":
    main()
