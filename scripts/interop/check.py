"""Drives a running `r3 serve` with the clients RL frameworks use; exits non-zero on failure.

Run through scripts/interop/run.sh, beside the real clients (client_*.py). Checks with plain
HTTP what the clients' code paths do not reach: prompt log-probs and streaming on /generate, a
`retract` pause, slime's and AReaL's request bodies, the pause / update / continue cycle with
a string weight_version, /flush_cache and /v1/loads.
"""

import argparse
import json
import sys
import time
import urllib.request

from report import result


def call(base, path, body=None, method=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method or ("POST" if data else "GET"))
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read() or b"{}")


def stream_events(base, path, body):
    """The JSON events of a server-sent-events answer, read as they arrive."""
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    out = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                out.append(json.loads(line[5:]))
    return out


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
    result("raw HTTP (check.py)", name, cond, detail)
    if not cond:
        check.failed = True


check.failed = False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--model-dir", required=True)
    a = ap.parse_args()
    wait_ready(a.worker)

    # Prompt log-probs on /generate (reference / teacher calls).
    r = call(a.worker, "/generate", {"text": "12+7=19", "return_logprob": True,
                                      "logprob_start_len": 0, "top_logprobs_num": 2,
                                      "sampling_params": {"max_new_tokens": 1}})
    ilp = r["meta_info"]["input_token_logprobs"]
    check("generate input_token_logprobs", ilp[0][0] is None
          and all(x[0] is not None for x in ilp[1:])
          and len(r["meta_info"]["input_top_logprobs"]) == len(ilp), json.dumps(r)[:300])
    # SGLang-format streaming: cumulative chunks, the last equals the plain answer.
    body = {"text": "12+7=", "sampling_params": {"max_new_tokens": 16, "seed": 5,
                                                   "temperature": 1.0, "ignore_eos": True}}
    plain = call(a.worker, "/generate", body)
    chunks = stream_events(a.worker, "/generate", dict(body, stream=True))
    check("generate stream: last chunk is the plain answer",
          chunks and chunks[-1]["output_ids"] == plain["output_ids"]
          and chunks[-1]["text"] == plain["text"], str(len(chunks)))
    check("generate stream: token by token", len(chunks) > 2, str(len(chunks)))

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
    # AReaL's retract pause around a weight update: the request in flight goes back to the
    # queue and finishes after continue_generation.
    import threading
    held = {}
    t = threading.Thread(target=lambda: held.update(call(a.worker, "/generate", {
        "text": "1+1=", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})))
    t.start()
    time.sleep(0.2)
    p = call(a.worker, "/pause_generation", {"mode": "retract"})
    loads = call(a.worker, "/v1/loads")["loads"][0]
    call(a.worker, "/continue_generation", method="POST")
    t.join()
    check("pause retract: request queued, then finished",
          loads["num_running_reqs"] == 0 and held["meta_info"]["finish_reason"]["type"] == "length",
          f"{p} {loads} {held.get('meta_info')}")
    call(a.worker, "/pause_generation", method="POST")
    u = call(a.worker, "/update_weights_from_disk",
             {"model_path": a.model_dir, "weight_version": "7", "abort_all_requests": True})
    call(a.worker, "/continue_generation", method="POST")
    info = call(a.worker, "/get_server_info")
    check("weight_version string", u["weight_version"] == "7" and info["weight_version"] == "7")
    call(a.worker, "/flush_cache", method="POST")
    loads = call(a.worker, "/v1/loads")
    check("v1/loads", "loads" in loads)

    sys.exit(1 if check.failed else 0)


if __name__ == "__main__":
    main()
