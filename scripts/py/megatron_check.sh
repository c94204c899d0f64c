#!/usr/bin/env bash
# r3.megatron against real Megatron-Core on the CPU (not part of CI: torch from PyPI is the
# CUDA build, ~5.4 GB installed). One command:
#
#   scripts/py/megatron_check.sh [VENV]          (default venv: target/py-megatron-venv)
#
# Builds the venv with the pinned torch and megatron-core (scripts/py/setup_venv.sh
# --with-megatron), then runs crates/r3-py/tests/megatron_core: routers built with
# `moe_enable_routing_replay` select exactly the routes r3 decoded from an SGLang payload (and
# still get gradients); pipeline layer offsets and counts equal Megatron's
# get_transformer_layer_offset / get_num_layers_to_build; sequence- and context-parallel token
# slices equal Megatron's own split functions. Prints the install and test times.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-$root/target/py-megatron-venv}"
t0=$(date +%s)
"$root/scripts/py/setup_venv.sh" "$venv" --with-megatron || exit 1
t1=$(date +%s)
cd "$root/crates/r3-py"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -W ignore::UserWarning tests/megatron_core
rc=$?
t2=$(date +%s)
echo "setup (venv, torch, megatron-core, build): $((t1 - t0)) s; tests: $((t2 - t1)) s"
if [ "$rc" -eq 5 ]; then echo "no Megatron-Core test ran" >&2; exit 1; fi
exit "$rc"
