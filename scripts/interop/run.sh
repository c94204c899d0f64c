#!/usr/bin/env bash
# Interop check of `r3 serve` with the real Python clients of the RL frameworks (not part of
# `cargo test`: it needs Python and the package index). One command:
#
#   scripts/interop/run.sh [--bin PATH_TO_r3] [MODEL_DIR]      (default model: models/arith-moe)
#
# What it does (everything under target/):
# - target/interop-venv: a venv with openai, sglang (--no-deps; its client modules' own deps,
#   incl. torchvision, apache-tvm-ffi, datasets, sentencepiece, compressed-tensors, gguf for
#   bench_serving), sglang-router, verl and
#   areal (--no-deps, plus what their client modules import), torchdata, torch, transformers.
# - target/interop-src/{slime,miles}: the frameworks' sources (git clone at the pinned commits
#   below unless the directory is already there); they are imported from there.
# - target/interop-model: MODEL_DIR's files plus a tokenizer_config.json (tokenizer class for
#   transformers' AutoTokenizer, and a chat template that joins the messages' contents);
#   target/interop-model-b: the same with other weights (routers negated, the LM head's rows
#   rotated), which AReaL's weight updates switch to and back from.
# - two `r3 serve --return-routed-experts-by-default` workers and sglang-router (round robin)
#   in front of them, and a third worker on the device engine (`--device cpu-candle`, for
#   AReaL's offload / onload); each client_*.py drives its client's own code and prints RESULT
#   lines.
# Prints a table: client | path | result (ok, or the error). Exits non-zero if any failed.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
here="$root/scripts/interop"
bin=""
if [ "${1:-}" = "--bin" ]; then bin="$2"; shift 2; fi
model_src="${1:-$root/models/arith-moe}"
venv="$root/target/interop-venv"
src="$root/target/interop-src"
logs="$root/target/interop-logs"
model="$root/target/interop-model"
py="$venv/bin/python"
mkdir -p "$logs" "$src"

SLIME_COMMIT=624b824a898ab0ec1fcb4d373004c7f3852bf515
MILES_COMMIT=31f1ca961a94cb860cec3b2dea34ec332bfa8f76

if [ -z "$bin" ]; then
  (cd "$root" && cargo build --release -p r3-cli) || exit 1
  bin="${CARGO_TARGET_DIR:-$root/target}/release/r3"
fi

if [ ! -x "$py" ]; then
  python3 -m venv "$venv"
fi
pip() { "$venv/bin/pip" install --quiet "$@" >>"$logs/pip.log" 2>&1; }
# The package list below, as installed; a venv with another list is completed.
packages="openai requests sglang-router numpy tqdm httpx aiohttp pillow transformers tokenizers
  psutil pybase64 packaging msgspec pyzmq ipython pydantic uvloop orjson sympy torch
  torchvision apache-tvm-ffi datasets sentencepiece compressed-tensors gguf
  ray codetiming
  colorlog tenacity flask lark hydra-core numba einops aiofiles"
# torchvision ... gguf: imported by sglang.bench_serving at module load.
# ray, codetiming: imported by verl at package load (verl itself goes in --no-deps).
# colorlog ... aiofiles: imported by areal's client modules (areal goes in --no-deps).
nodeps="sglang verl areal torchdata"
marker="$venv/.r3-interop-packages"
if [ "$(cat "$marker" 2>/dev/null)" != "$packages $nodeps" ]; then
  echo "installing the clients into $venv (log: $logs/pip.log)"
  pip $packages && pip --no-deps $nodeps && printf '%s' "$packages $nodeps" >"$marker"
fi
for pair in "slime https://github.com/THUDM/slime $SLIME_COMMIT" \
            "miles https://github.com/radixark/miles $MILES_COMMIT"; do
  set -- $pair
  if [ ! -d "$src/$1" ]; then
    git clone --quiet "$2" "$src/$1" && git -C "$src/$1" checkout --quiet "$3"
  fi
done

mkdir -p "$model"
cp "$model_src"/config.json "$model_src"/*.safetensors "$model_src"/tokenizer.json "$model/"
cat >"$model/tokenizer_config.json" <<'EOF'
{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
 "pad_token": "<pad>", "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
EOF
# The same architecture with other weights, for the weight updates to switch to and back:
# every router negated (tokens pick other experts), the LM head's rows rotated by one.
model_b="$root/target/interop-model-b"
mkdir -p "$model_b"
cp "$model"/config.json "$model"/tokenizer.json "$model"/tokenizer_config.json "$model_b/"
"$py" - "$model" "$model_b" <<'EOF'
import glob, os, sys
import numpy as np
from safetensors.numpy import load_file, save_file
src, dst = sys.argv[1:]
for path in glob.glob(os.path.join(src, "*.safetensors")):
    t = load_file(path)
    for k, v in t.items():
        if k.endswith(".mlp.gate.weight"):
            t[k] = -v
        elif k == "lm_head.weight":
            t[k] = np.roll(v, -1, axis=0)
    save_file(t, os.path.join(dst, os.path.basename(path)))
EOF
layers=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" "$model/config.json")
topk=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['num_experts_per_tok'])" "$model/config.json")

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
w1=http://127.0.0.1:31001 w2=http://127.0.0.1:31002 router=http://127.0.0.1:31000
"$bin" serve --model "$model" --port 31001 --return-routed-experts-by-default >"$logs/worker1.log" 2>&1 &
pids+=($!)
"$bin" serve --model "$model" --port 31002 --return-routed-experts-by-default >"$logs/worker2.log" 2>&1 &
pids+=($!)
# A third worker on the device engine (r3-model's layers on candle's CPU: the code a GPU runs),
# for AReaL's colocated offload / onload cycle.
w3=http://127.0.0.1:31003
"$bin" serve --model "$model" --port 31003 --device cpu-candle >"$logs/worker3.log" 2>&1 &
pids+=($!)
"$py" -m sglang_router.launch_router --worker-urls "$w1" "$w2" --policy round_robin \
  --prometheus-port 31009 --host 127.0.0.1 --port 31000 >"$logs/router.log" 2>&1 &
pids+=($!)
for u in "$w1" "$w2" "$w3" "$router"; do
  for _ in $(seq 120); do curl -sf "$u/health" >/dev/null && break; sleep 0.5; done
done
# The router needs a moment to register its workers after it answers /health.
for _ in $(seq 60); do
  curl -sf "$router/v1/models" | grep -q '"id"' && break; sleep 0.5
done

out="$logs/results.tsv"
: >"$out"
run() {
  local name="$1"; shift
  echo "== $name" >>"$logs/clients.log"
  (cd "$here" && timeout 900 "$py" "$@") >>"$logs/clients.log" 2>&1
  local rc=$?
  if ! grep -aq "^RESULT	$name	" "$logs/clients.log"; then
    printf 'RESULT\t%s\t(start)\tFAIL: exit %s before any result, see %s\n' "$name" "$rc" "$logs/clients.log" >>"$logs/clients.log"
  fi
}
: >"$logs/clients.log"
run slime client_slime.py --pkg slime --src "$src/slime" --url "$router" --model-dir "$model" --layers "$layers" --top-k "$topk"
run miles client_slime.py --pkg miles --src "$src/miles" --url "$router" --model-dir "$model" --layers "$layers" --top-k "$topk"
run areal client_areal.py --urls "$w1" "$w2" --model-dir "$model" --other-model-dir "$model_b" --device-url "$w3"
run verl client_verl.py --url "$w1" --model-dir "$model"
run sglang client_sglang.py --url "$w1" --model-dir "$model"
run openai client_openai.py --url "$w1"
run sglang-router client_router.py --router "$router" --workers "$w1" "$w2" --layers "$layers" --top-k "$topk"
run "raw HTTP (check.py)" check.py --worker "$w1" --model-dir "$model"

grep -a '^RESULT' "$logs/clients.log" | cut -f2- >"$out"
"$py" - "$out" <<'EOF'
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
w = [max(len(r[i]) for r in rows + [["client", "path", "result"]]) for i in range(2)]
print(f"| {'client':<{w[0]}} | {'path':<{w[1]}} | result |")
print(f"|{'-' * (w[0] + 2)}|{'-' * (w[1] + 2)}|--------|")
for c, p, r in rows:
    print(f"| {c:<{w[0]}} | {p:<{w[1]}} | {r} |")
EOF
echo "client output: $logs/clients.log"
! grep -aq $'\tFAIL' "$out"
