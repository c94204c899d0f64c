#!/usr/bin/env bash
# The venv of the TRL side-by-side (scripts/peers/trl_grpo_step.py), from PyPI:
#
#   scripts/peers/setup_trl.sh [VENV]        # default target/trl-venv (ignored by git)
#
# Pinned: the versions the step times in docs/results.md were measured with. PyPI's Linux
# torch wheel is the CUDA build and imports only with its nvidia-* wheels beside it (about
# 4.5 GB in all); it runs on the CPU here. Re-running reuses the venv.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-$root/target/trl-venv}"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  "torch==2.15.0" "transformers==5.24.0" "trl==1.16.0" "accelerate==1.15.0" \
  "datasets==5.2.0" "tokenizers==0.23.3" "safetensors==0.8.0" "numpy==2.4.6"
"$venv/bin/python" -c 'import torch, transformers, trl; print("torch", torch.__version__, "transformers", transformers.__version__, "trl", trl.__version__)'
echo "TRL venv ready: $venv"
