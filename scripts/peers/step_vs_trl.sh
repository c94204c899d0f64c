#!/usr/bin/env bash
# The whole RL step, r3 against TRL's GRPOTrainer on the same work, interleaved in one
# sitting (r3 N steps, TRL N steps, repeated), with the machine's load at the start of each
# run. Not part of `cargo test`: it needs the TRL venv (scripts/peers/setup_trl.sh, PyPI).
#
#   scripts/peers/step_vs_trl.sh                          # default task and gsm8k-style
#   scripts/peers/step_vs_trl.sh --steps 6 --rounds 3 configs/gsm8k-style.toml
#   scripts/peers/step_vs_trl.sh --r3 path/to/r3 --as-shipped default
#
# Configs: `default` (the built-in configs/default.toml) or a TOML path; default both.
# r3 runs with eval and checkpoints off and, unless --as-shipped, on the work TRL can do:
# f32 rollouts, no routing replay, no dynamic sampling (TRL keeps every group). TRL then
# reads the resolved config.toml of r3's run, so both sides use the same settings.
# Options: --r3 PATH (default target/release/r3, else target/debug/r3), --steps N (per run,
# default 4; medians skip each run's first step), --rounds R (default 2), --micro-batch N
# (TRL sequences per forward/backward; default the whole batch, as r3), --threads N (TRL's
# torch threads; default all cores, as r3's thread pool), --as-shipped, --bf16 (both sides
# in bf16: r3 with train.dtype and rollout.dtype bf16, TRL with bf16=True, f32 parameters
# under autocast), --out DIR (default target/peers/step_vs_trl), --venv DIR (default
# target/trl-venv).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
r3=""
steps=4
rounds=2
micro=0
threads="$(nproc)"
shipped=0
bf16=0
out="target/peers/step_vs_trl"
venv="target/trl-venv"
configs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --r3) r3="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --micro-batch) micro="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --as-shipped) shipped=1; shift ;;
    --bf16) bf16=1; shift ;;
    --out) out="$2"; shift 2 ;;
    --venv) venv="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "step_vs_trl.sh: unknown option $1" >&2; exit 2 ;;
    *) configs+=("$1"); shift ;;
  esac
done
[ ${#configs[@]} -gt 0 ] || configs=(default configs/gsm8k-style.toml)
if [ -z "$r3" ]; then
  if [ -x target/release/r3 ]; then r3=target/release/r3; else r3=target/debug/r3; fi
fi
[ -x "$r3" ] || { echo "step_vs_trl.sh: no r3 binary at $r3 (cargo build --release -p r3-cli)" >&2; exit 1; }
[ -x "$venv/bin/python" ] || { echo "step_vs_trl.sh: no TRL venv at $venv (scripts/peers/setup_trl.sh)" >&2; exit 1; }
case "$r3" in
  */debug/*) echo "NOTE: $r3 is a debug build: its times are not r3's speed" ;;
esac

same_work=(--set algo.dynamic_sampling=false --set algo.router_replay=disabled --set rollout.dtype=f32)
[ "$shipped" = 1 ] && same_work=()
trl_bf16=()
if [ "$bf16" = 1 ]; then
  same_work=(--set algo.dynamic_sampling=false --set algo.router_replay=disabled --set rollout.dtype=bf16 --set train.dtype=bf16)
  trl_bf16=(--bf16)
fi
echo "r3: $r3 ($("$r3" --version 2>/dev/null || echo '?')); cores $(nproc); steps $steps x rounds $rounds; $([ "$shipped" = 1 ] && echo 'r3 as shipped' || { [ "$bf16" = 1 ] && echo 'both in bf16: r3 bf16 rollout and training, TRL bf16=True; no replay, no dynamic sampling' || echo 'r3 on the same work: f32 rollout, no replay, no dynamic sampling'; })"

for cfg in "${configs[@]}"; do
  if [ "$cfg" = default ]; then name=default; cfg_args=(); else name="$(basename "$cfg" .toml)"; cfg_args=(--config "$cfg"); fi
  dir="$out/$name"
  rm -rf "$dir"
  mkdir -p "$dir"
  for k in $(seq 1 "$rounds"); do
    run="$dir/r3-round$k"
    load_r3="$(cat /proc/loadavg)"
    echo "== $name round $k: r3, load $load_r3"
    "$r3" train --no-progress ${cfg_args[@]+"${cfg_args[@]}"} --set steps="$steps" --set run_dir="$run" \
      --set eval.every=0 --set checkpoint.every=0 ${same_work[@]+"${same_work[@]}"} \
      > "$dir/r3-round$k.log" 2>&1 || { tail -20 "$dir/r3-round$k.log"; exit 1; }
    load_trl="$(cat /proc/loadavg)"
    echo "== $name round $k: TRL, load $load_trl"
    printf '%s\n%s\n' "$load_r3" "$load_trl" > "$dir/load-round$k.txt"
    "$venv/bin/python" scripts/peers/trl_grpo_step.py --config "$run/config.toml" --r3 "$r3" \
      --steps "$steps" --micro-batch "$micro" --threads "$threads" --out "$dir/trl-round$k.json" ${trl_bf16[@]+"${trl_bf16[@]}"} \
      > "$dir/trl-round$k.log" 2>&1 || { tail -20 "$dir/trl-round$k.log"; exit 1; }
    grep -E "^TRL median" "$dir/trl-round$k.log"
  done
  grep -E "^versions|^torch threads" "$dir/trl-round1.log"
  python3 scripts/peers/step_ratio.py "$dir"
done
echo "not mapped between r3 and TRL: see the 'not mapped' lines of $out/*/trl-round1.log"
