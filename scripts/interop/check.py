"""Drives a running `r3 serve` with the clients RL frameworks use; exits non-zero on failure.

Run through scripts/interop/run.sh. Checks: the `openai` client (models.list, completions
with stop strings, neutral penalties, best_of / logit_bias / suffix and logprobs with
text_offset, token-by-token streaming, echo with logprobs), prompt log-probs and streaming on
/generate, a `retract` pause, SGLang-native /generate with slime's and AReaL's request bodies, the pause /
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
    print(("ok   " if cond else "FAIL ") + name + (f": {detail}" if detail and not cond else ""))
    if not cond:
        check.failed = True


check.failed = False


def sglang_frontend(url):
    """SGLang's own client, `RuntimeEndpoint`, through its frontend language (sglang installed
    with --no-deps; torch stubbed: the HTTP client never calls it)."""
    import stubs
    stubs.install(["torch"])
    try:
        import sglang as sgl
        from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
    except ImportError as e:
        print(f"skip sglang RuntimeEndpoint: {e}")
        return
    sgl.set_default_backend(RuntimeEndpoint(url))

    @sgl.function
    def arith(s, q):
        s += q
        s += sgl.gen("a", max_tokens=8, temperature=0, return_logprob=True,
                     logprob_start_len=0, top_logprobs_num=2)

    st = arith.run(q="12+7=")
    meta = st.get_meta_info("a")
    check("sglang RuntimeEndpoint gen", isinstance(st["a"], str) and meta["completion_tokens"] > 0,
          str(meta)[:200])
    check("sglang RuntimeEndpoint prompt log-probs",
          meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) > 1,
          str(meta)[:200])
    streamed = arith.run(q="12+7=", stream=True)
    text = "".join(streamed.text_iter("a"))
    check("sglang RuntimeEndpoint stream", text.endswith(st["a"]), f"{text!r} vs {st['a']!r}")


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

    # Token-by-token streaming through the openai client: several chunks, and their texts
    # concatenate to the non-streamed text for the same seed.
    kw = dict(model=name, prompt="12+7=", max_tokens=24, temperature=1.0, seed=3,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    parts = [ev.choices[0].text for ev in client.completions.create(stream=True, **kw)]
    check("openai stream: chunks concatenate to the plain text", "".join(parts) == plain,
          f"{parts!r} vs {plain!r}")
    check("openai stream: token by token", len(parts) > 2, str(len(parts)))
    # echo with logprobs (prompt scoring).
    e = client.completions.create(model=name, prompt="12+7=", max_tokens=1, temperature=0,
                                  echo=True, logprobs=1)
    lp = e.choices[0].logprobs
    check("openai echo + logprobs", e.choices[0].text.startswith("12+7=")
          and lp.token_logprobs[0] is None
          and all(v is not None for v in lp.token_logprobs[1:]), str(lp)[:200])
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

    sglang_frontend(a.worker)

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
