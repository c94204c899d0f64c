#!/usr/bin/env bash
# Builds the Python package `r3` (crates/r3-py) into a venv made from PyPI:
#
#   scripts/py/setup_venv.sh [VENV] [--release] [--with-megatron]
#
# VENV defaults to target/py-venv. Installs maturin, numpy and pytest (plus the pinned torch
# and megatron-core with --with-megatron), then `maturin develop` builds the extension with
# the workspace's cargo (dev profile unless --release) into the venv. Re-running reuses the
# venv and cargo's incremental build.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$root/target/py-venv"
profile=()
extra=()
for arg in "$@"; do
  case "$arg" in
    --release) profile=(--release) ;;
    # Pinned: the versions the Megatron-Core check was last run against.
    --with-megatron) extra=("torch==2.15.0" "megatron-core==0.16.1") ;;
    -*) echo "unknown option $arg" >&2; exit 2 ;;
    *) venv="$arg" ;;
  esac
done
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  "maturin>=1.5,<2" "numpy>=1.21" pytest ${extra[@]+"${extra[@]}"}
# maturin installs into the venv named by VIRTUAL_ENV.
VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
  "$venv/bin/maturin" develop --quiet ${profile[@]+"${profile[@]}"} \
  --manifest-path "$root/crates/r3-py/Cargo.toml"
echo "r3 installed in $venv"
