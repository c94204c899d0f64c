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

    def one(i_row):
        i, row = i_row
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        texts = ask(a.url, messages, a.k, a.temperature, a.max_tokens, a.seed + i)
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
            json.dump(per_prompt, f)
    if a.baseline:
        with open(a.baseline) as f:
            base = json.load(f)
        if len(base) != len(per_prompt):
            sys.exit(f"--baseline has {len(base)} prompts, this dataset {len(per_prompt)}")
        diff = [x - y for x, y in zip(per_prompt, base)]
        report["paired_diff"] = round(statistics.mean(diff), 4)
        report["paired_stderr"] = round(statistics.stdev(diff) / math.sqrt(len(diff)), 4)
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
