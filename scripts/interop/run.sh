#!/usr/bin/env bash
# Interop check of `r3 serve` with real Python clients (not part of `cargo test`).
# Usage: scripts/interop/run.sh [MODEL_DIR]   (default: models/arith-moe)
# Creates a venv in target/interop-venv, installs `openai`, SGLang's client (`sglang --no-deps`)
# and `sglang-router` when their wheels install, starts r3 serve on free local ports, runs check.py, and stops what it started.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
model="${1:-$root/models/arith-moe}"
venv="$root/target/interop-venv"
cd "$root"
cargo build --release -p r3-cli
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet openai requests
# SGLang's client (RuntimeEndpoint) without its server deps: the wheel with --no-deps plus
# what its client modules import; torch is stubbed at import time (scripts/interop/stubs.py).
if "$venv/bin/pip" install --quiet --no-deps sglang; then
  "$venv/bin/pip" install --quiet numpy tqdm psutil pybase64 packaging pillow msgspec pyzmq ipython || true
fi
router=0
if "$venv/bin/pip" install --quiet sglang-router; then router=1; fi
bin="$root/target/release/r3"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
"$bin" serve --model "$model" --port 31001 --return-routed-experts-by-default & pids+=($!)
"$bin" serve --model "$model" --port 31002 --return-routed-experts-by-default & pids+=($!)
if [ "$router" = 1 ]; then
  "$venv/bin/python" -m sglang_router.launch_router \
    --worker-urls http://127.0.0.1:31001 http://127.0.0.1:31002 --host 127.0.0.1 --port 31000 &
  pids+=($!)
fi
"$venv/bin/python" "$root/scripts/interop/check.py" --worker http://127.0.0.1:31001 \
  --model-dir "$model" $([ "$router" = 1 ] && echo --router http://127.0.0.1:31000)
