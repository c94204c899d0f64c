#!/usr/bin/env bash
# The Python package's tests that need only numpy (what CI runs after `cargo test`):
#
#   scripts/py/test.sh [VENV] [pytest args...]
#
# Builds the venv and the package (scripts/py/setup_venv.sh), then runs pytest on
# crates/r3-py/tests. The Megatron-Core tests there skip themselves without torch and
# megatron.core (scripts/py/megatron_check.sh runs them). pytest's exit code 5 (no test
# collected) is a failure here: the suite must have run.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$root/target/py-venv"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then venv="$1"; shift; fi
"$root/scripts/py/setup_venv.sh" "$venv" || exit 1
cd "$root/crates/r3-py"
"$venv/bin/python" -m pytest -q tests "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests in crates/r3-py/tests" >&2
  exit 1
fi
exit "$rc"
