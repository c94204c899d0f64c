#!/usr/bin/env python3
"""avg@k accuracy of a served model on a verl-schema JSONL dataset (standard library only).

Sends every row's chat prompt to an OpenAI-compatible `/v1/chat/completions` (e.g. `r3 serve
--model DIR`) with `n = k` samples at the given temperature, scores each sample as GSM8K does
(the number after the last `####`, commas removed, compared numerically with
`reward_model.ground_truth`) and prints the mean accuracy with its standard error over
prompts. Used to measure the RL curve of `configs/gsm8k-style.toml` more tightly than the
trainer's one-sample eval:

    r3 serve --model runs/gsm8k-style/checkpoints/step_200 --port 30000 &
    python3 scripts/eval_avg_at_k.py --url http://127.0.0.1:30000 \
        --data data/gsm8k-style/val.jsonl --k 8 --temperature 1.0 --max-tokens 160

Every sample has its own sampler stream: `r3 serve` gives choice j of a request seeded s the
seed s + j, so prompt i is sent `(seed * prompts + i) * k` (`request_seed`), and sample j of
prompt i draws from seed `(seed * prompts + i) * k + j`: no two samples of one run, nor of two
runs with different `--seed`, share a stream. (Before 2026-12, prompt i was sent `seed + i`, so
sample j of prompt i and sample j - 1 of prompt i + 1 drew the same stream, and `--seed 1`
repeated 7/8 of `--seed 0`'s streams.)

`--out` writes the per-prompt scores with the settings that produced them; `--baseline` (such
a file, or `r3 eval --out`'s line) refuses one sampled with another k or temperature (an old
file, a bare list of scores, pairs with a warning) and one with another number of prompts. It
pairs by position: both must list the same prompts in the same order.
"""
import argparse
import json
import math
import re
import statistics
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def score(text, truth):
    found = ANSWER.findall(text)
    if not found:
        return 0.0
    try:
        return float(abs(float(found[-1].replace(",", "")) - float(truth)) < 1e-9)
    except ValueError:
        return 0.0


def request_seed(seed, i, prompts, k):
    """The seed prompt `i` of `prompts` is sent with: its k choices take this + 0 ... k - 1."""
    return (seed * prompts + i) * k


def sample_seeds(seed, prompts, k):
    """Every (prompt, sample) stream's seed in a run, as `r3 serve` derives them."""
    return [request_seed(seed, i, prompts, k) + j for i in range(prompts) for j in range(k)]


def check_streams(seed, prompts, k):
    """Refuses a seeding in which two samples of the run share a sampler stream."""
    seeds = sample_seeds(seed, prompts, k)
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"sampler streams repeat: {len(seeds) - len(set(seeds))} of {len(seeds)}")


def load_baseline(path):
    """(per-prompt scores, {"k", "temperature"}) of an `--out` file of this script or of
    `r3 eval --out`; settings None for an old bare list, temperature None where unrecorded."""
    with open(path) as f:
        base = json.load(f)
    if isinstance(base, list):
        return base, None
    k = base.get("k", base.get("samples_per_prompt", 1))
    return base["prompt_scores"], {"k": k, "temperature": base.get("temperature")}


def paired(per_prompt, base, base_settings, k, temperature):
    """The paired difference this - baseline with its standard error (None under 2 prompts)
    and a warning when the baseline's settings are unknown; exits on a mismatch."""
    if len(base) != len(per_prompt):
        sys.exit(f"--baseline has {len(base)} prompts, this dataset {len(per_prompt)}")
    warning = None
    if base_settings is None:
        warning = ("--baseline records no k or temperature (an old file): "
                   "they are assumed to match")
    elif base_settings["k"] != k:
        sys.exit(f"--baseline was sampled with k {base_settings['k']}, this run with k {k}: "
                 "a paired difference needs the same sampling")
    elif base_settings["temperature"] is None:
        warning = "--baseline records no temperature: it is assumed to match"
    elif abs(base_settings["temperature"] - temperature) > 1e-6:
        sys.exit(f"--baseline was sampled with k {base_settings['k']} at temperature "
                 f"{base_settings['temperature']}, this run with k {k} at {temperature}: "
                 "a paired difference needs the same sampling")
    diff = [x - y for x, y in zip(per_prompt, base)]
    se = statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else None
    return statistics.mean(diff), se, warning


def ask(url, messages, k, temperature, max_tokens, seed):
    body = json.dumps({
        "model": "default", "messages": messages, "n": k, "temperature": temperature,
        "max_tokens": max_tokens, "seed": seed,
        # The whole distribution at `temperature`, whatever generation_config.json a model
        # ships: a server's chat defaults (`--sampling-defaults model`) would otherwise
        # truncate it with the model's top_p / top_k / min_p.
        "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
    }).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        out = json.load(resp)
    return [c["message"]["content"] for c in out["choices"]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--baseline", help="per-prompt scores of another model (--out of an earlier call): "
                    "also print the paired difference and its standard error")
    ap.add_argument("--out", help="write the per-prompt scores here (JSON list)")
    a = ap.parse_args()
    rows = [json.loads(line) for line in open(a.data) if line.strip()]
    check_streams(a.seed, len(rows), a.k)

    def one(i_row):
        i, row = i_row
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        texts = ask(a.url, messages, a.k, a.temperature, a.max_tokens,
                    request_seed(a.seed, i, len(rows), a.k))
        truth = row["reward_model"]["ground_truth"]
        return statistics.mean(score(t, truth) for t in texts)

    with ThreadPoolExecutor(a.workers) as pool:
        per_prompt = list(pool.map(one, enumerate(rows)))
    mean = statistics.mean(per_prompt)
    se = statistics.stdev(per_prompt) / math.sqrt(len(per_prompt)) if len(per_prompt) > 1 else 0.0
    report = {"prompts": len(rows), "k": a.k, "temperature": a.temperature,
              "avg_at_k": round(mean, 4), "stderr": round(se, 4)}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"data": a.data, "k": a.k, "temperature": a.temperature, "seed": a.seed,
                       "prompt_scores": per_prompt}, f)
    if a.baseline:
        base, settings = load_baseline(a.baseline)
        d, dse, warning = paired(per_prompt, base, settings, a.k, a.temperature)
        report["paired_diff"] = round(d, 4)
        report["paired_stderr"] = None if dse is None else round(dse, 4)
        if warning:
            report["warning"] = warning
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
