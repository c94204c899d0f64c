#!/usr/bin/env bash
# The GPU check, run on the GPU machine (CUDA 13 driver and libraries, Python with PyTorch;
# no Rust, no network) from the repository root, with the binaries built by
# scripts/cuda/build.sh on any machine and carried over (gpu/bin, or its archive
# gpu/pack/bin.tar.xz, which is unpacked here when gpu/bin is absent):
#
#   bash scripts/cuda/check.sh [OUT] [--steps 1,2,3,4] [--budget SECONDS]
#
# OUT: where logs go (default gpu/check). The detailed logs are written under a work folder
# and packed into OUT/logs.tar.gz after every step (so a run stopped by its caller's time
# limit still returns what it did); OUT/summary.txt holds the verdicts so far.
# --steps: which of the steps below to run (default all). --budget: wall seconds the whole
# check may take (default 480); each command's own limit is cut to what is left, and a step
# that cannot start with a minute left is skipped and says so.
#
# 1. the GPU tests (test binaries built with `--features cuda`): r3's own CUDA kernels one op
#    at a time against the CPU (kernels.rs), then every family's tiny model
#    on CUDA against the CPU (logits, routes, replay proofs, log-probs, entropy, every
#    parameter's gradient), the HF oracle fixtures on CUDA, AdamW and the policy update;
# 2. `r3 train --set train.device=cuda --set steps=20`: replay.verified_frac = 1 in every
#    step and step 1's rewards equal to a CPU run's (the rollouts come from the same engine
#    with the same weights and seed); then 3 bf16 steps with the held bf16 weight copies, 3
#    without, and 3 with the weight gradients kept in bf16, their metrics compared
#    (`train-bf16-copies`: same or where they differ);
# 3. `r3 bench train` on CUDA beside scripts/cuda/peer_hf.py (HF transformers on the same
#    GPU, the same config and batch): mid in f32 and bf16, the 8-layer 30B-A3B shape in bf16;
#    each bf16 run also beside HF with f32 parameters under autocast (`--dtype amp-bf16`, its
#    Trainer's bf16: r3's own precision scheme) while the budget lasts; bf16 runs hold bf16
#    copies of the weights (rewritten once per step in a pass timed beside the step, outside
#    its forward+backward tokens/s, as HF's are), and the 30B-A3B shape runs again
#    without them (`--narrow-copies off`: a cast of every weight at every use); bf16 runs
#    again with the weight gradients in bf16 (`--narrow-gradients`), and with activation
#    checkpointing as well (`--gradient-checkpointing`), memory beside HF's, and mid bf16's
#    lean run again with its head scored in chunks (`--head-chunk-tokens 1024`); then `r3 bench
#    optim` on the GPU (f32 gradients; bf16 gradients with held bf16 copies).
# 4. The device rollout engine on CUDA: its tests (greedy = HF's on the oracle fixtures and
#    = the CPU engine's, routes = the trainer's native routes on the GPU in f32 and bf16,
#    seeded sampling reproducing itself, a batch = one at a time), `r3 generate --device
#    cuda` = `--device cpu` on the oracle prompts, both engines on the GPU in `r3 train` (the
#    default task's 200 steps beside its CPU run, then configs/gsm8k-style.toml in bf16
#    beside its CPU run), and
#    `r3 bench decode --device cuda` at batch 1 / 64 / 256 (mid in f32 and bf16, the 30B-A3B
#    shape in bf16) beside scripts/cuda/peer_hf_generate.py (each the best of two timed
#    runs: batch 1 moves by a third between runs on a GPU host), small batches routed on the
#    host against routed on the device (`--routing`), mid bf16 sampled at temperature 1
#    (an RL rollout's setting), and one 8,192-token prompt on the 30B-A3B shape (prefilled
#    at once, its attention in query tiles, then in chunks of 2,048) beside HF's.
# 5. Only with --steps 5: Nsight Compute's per-kernel time table of one bf16 training step
#    of the 30B-A3B shape, then of mid (where a step's GPU time goes).
# 6. Only with --steps 6: Nsight Systems' CUDA API table of one mid bf16 training step (where
#    the host's time between kernels goes: launches, allocations, cudarc's per-argument
#    event records and waits, the routing's device-to-host copies).
# 7. Only with --steps 7: the 16-bit GEMM experiment (`gemm16_modes`, below).
# 8. Only with --steps 8: the kernels one decode step launches at batch 1 (mid, bf16 and
#    f32), by Nsight Compute (≈ 60–80 s a dtype: each kernel is profiled).
# 9. Only with --steps 9: the 30B-A3B shape at batch 8 x 512 (the issue's HF figure) with the
#    matrices held in bf16, beside HF bf16, then again with the head scored in chunks while
#    the budget lasts (≈ 3 x 60–150 s).
# 10. Only with --steps 10: whole RL steps with both engines on the GPU, `r3 bench step`:
#    each phase's time and its share of the GPU's limits measured in the same run (its GEMM
#    peak in the phase's dtype, its copy rate), on configs/gsm8k-style.toml (dynamic sampling
#    off: a random model's groups all score alike) with its own model, with
#    bench train's mid model (208 M with that vocabulary, random weights) and with the
#    30B-A3B layer shape (8 layers, ≈ 5.0 B parameters drawn on the GPU; bf16 weights,
#    moments and gradient sums), all in bf16 (≈ 30–90 s, 60–150 s, 90–240 s).
# Ends with one summary line.
#
# --dry-run R3 (any machine, no GPU): every r3 command line the asked steps would run is
# given to R3, a CPU build of r3, instead: each must be accepted (its flags and --set keys
# parse, and it stops at the GPU it asks for, or runs 5 s without an error). The test
# binaries answer "0 passed" and the peers run as they can (without torch they fail). The
# summary's `dry-run` verdict counts the command lines and names any refused; the exit code
# is 1 if one was. r3-cli's test `gpu_check_dry_run.rs` runs it in `cargo test`, so a flag
# renamed in r3 cannot cost a GPU call.
set -uo pipefail
# A peer killed at its time limit keeps what it printed (Python holds a file's output back).
export PYTHONUNBUFFERED=1

root=$(cd "$(dirname "$0")/../.." && pwd)
out_arg=""
steps="1,2,3,4"
budget=480
dry_r3=""
while [ $# -gt 0 ]; do
    case "$1" in
        --steps) steps="$2"; shift 2 ;;
        --budget) budget="$2"; shift 2 ;;
        --dry-run) dry_r3="$2"; shift 2 ;;
        -*) echo "check.sh: unknown option $1" >&2; exit 2 ;;
        *) out_arg="$1"; shift ;;
    esac
done
out=$(mkdir -p "${out_arg:-$root/gpu/check}" && cd "${out_arg:-$root/gpu/check}" && pwd)
# The logs live in a work folder; OUT gets one archive of them (few files travel back).
work=$(mktemp -d /tmp/r3-check.XXXXXX)
started=$(date +%s)
bin="$root/gpu/bin"
cd "$root"
python=$(command -v python3 || command -v python)
verdicts=()
# Each written beside, then moved into place: a kill during a write leaves the last whole one.
pack_logs() {
    tar -czf "$out/.logs.tar.gz.part" -C "$work" . 2>/dev/null \
        && mv -f "$out/.logs.tar.gz.part" "$out/logs.tar.gz"
    echo "SUMMARY gpu=[${gpu_name:-unknown}] $(IFS=' '; echo "${verdicts[*]}")" > "$out/.summary.part" \
        && mv -f "$out/.summary.part" "$out/summary.txt"
}
verdict() { verdicts+=("$1=$2"); echo "== $1: $2"; pack_logs; }
# outcome RC: a command's verdict from its exit code; `timeout`'s 124 (its limit, cut to the
# budget left by `limit`) reads as a timeout, not as a failure of what ran; 137 is a SIGKILL:
# `timeout -k` after its limit, or the kernel's out-of-memory killer.
outcome() {
    case "$1" in
        0) echo pass ;;
        124) echo "TIMEOUT(at its limit or the budget's end)" ;;
        137) echo "KILLED(137: past its limit, or out of host memory)" ;;
        *) echo "FAIL($1)" ;;
    esac
}
# Seconds left of the budget, less a reserve for packing the logs.
left() { echo $(( budget - ($(date +%s) - started) - 10 )); }
# limit N: the smaller of N and what is left (at least 1).
limit() { local l; l=$(left); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
# wants STEP: whether STEP was asked for and a minute is left to start it.
wants() {
    case ",$steps," in *",$1,"*) ;; *) return 1 ;; esac
    if [ "$(left)" -lt 60 ]; then verdict "step$1" "skipped(budget: $(left) s left)"; return 1; fi
}

# --dry-run: gpu/bin is replaced by a folder whose r3 hands each command line to the CPU
# build and records whether it was accepted (the GPU error naming the missing `cuda` feature
# means every flag before it parsed), and whose test binaries pass without running.
test_exes="r3-model-devices r3-model-kernels r3-train-devices r3-rollout-device_engine r3-rollout-device_prefix_cache r3-rollout-device_pause r3-rollout-device_chunked_prefill r3-rollout-device_kv_dtype"
if [ -n "$dry_r3" ]; then
    if [ ! -x "$dry_r3" ]; then
        echo "check.sh: --dry-run $dry_r3 is not an executable (a CPU build of r3)" >&2
        exit 2
    fi
    dry_r3=$(cd "$(dirname "$dry_r3")" && pwd)/$(basename "$dry_r3")
    trap 'rm -rf "$work"' EXIT
    bin="$work/dry-bin"
    dry_report="$work/dry-run.txt"
    mkdir -p "$bin" && : > "$dry_report"
    cat > "$bin/r3" <<EOF
#!/usr/bin/env bash
err=\$(mktemp)
timeout 5 "$dry_r3" "\$@" > /dev/null 2> "\$err"
rc=\$?
if [ \$rc = 0 ] || [ \$rc = 124 ] || grep -q "needs the .cuda. feature" "\$err"; then
    echo "accepted: r3 \$*" >> "$dry_report"
    rm -f "\$err"
    exit 0
fi
echo "REFUSED (rc \$rc): r3 \$* :: \$(grep -v '^\$' "\$err" | tail -n 2 | tr '\n' ' ')" >> "$dry_report"
cat "\$err" >&2
rm -f "\$err"
exit 1
EOF
    for exe in $test_exes; do
        printf '#!/usr/bin/env bash\necho "test result: ok. 0 passed; 0 failed (check.sh --dry-run)"\n' > "$bin/$exe"
    done
    chmod +x "$bin"/*
fi
# A warm machine keeps gpu/bin from an earlier call: the pack is unpacked again whenever it
# is not the one gpu/bin came from (its checksum kept beside the binaries), so a pack rebuilt
# between calls is never shadowed by the last call's binaries.
pack="$root/gpu/pack/bin.tar.xz"
if [ -z "$dry_r3" ] && [ -f "$pack" ]; then
    pack_sum=$(sha256sum "$pack" | cut -d' ' -f1)
    if [ ! -d "$bin" ] || [ "$(cat "$bin/.pack-sha256" 2>/dev/null)" != "$pack_sum" ]; then
        t0=$(date +%s)
        rm -rf "$bin"
        "$python" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
            "$pack" "$root/gpu" || { echo "check.sh: cannot unpack gpu/pack/bin.tar.xz" >&2; exit 2; }
        echo "$pack_sum" > "$bin/.pack-sha256"
        echo "== unpacked gpu/pack/bin.tar.xz in $(( $(date +%s) - t0 )) s"
    fi
fi
if [ -f "$bin/BUILT_FROM" ]; then
    verdict binaries "$(tr '\n' ';' < "$bin/BUILT_FROM")"
else
    verdict binaries "no BUILT_FROM (built before build.sh wrote one)"
fi
gpu_name=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
echo "== GPU: ${gpu_name:-unknown (nvidia-smi failed)}"
# Which Python packages the machine has (a peer needing one it lacks cannot run there; TRL,
# the CPU step's peer, is pure Python and could be carried if its dependencies are present).
python_packages=$("$python" - <<'PY' 2>/dev/null
import importlib.metadata as m
import sys
found = []
for name in ["torch", "transformers", "accelerate", "datasets", "trl", "pyarrow", "pandas", "numpy"]:
    try:
        found.append(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        found.append(f"{name} -")
print(f"python {sys.version.split()[0]}: " + ", ".join(found))
PY
)
verdict python "${python_packages:-unknown}"
for exe in r3 $test_exes; do
    if [ ! -x "$bin/$exe" ]; then
        echo "check.sh: $bin/$exe is missing: run scripts/cuda/build.sh and carry gpu/bin" >&2
        verdict binaries "MISSING $exe"
        exit 2
    fi
done
# The binaries link libcuda.so.1 and CUDA 13's cuBLAS / NVRTC / cuRAND: show where from.
[ -n "$dry_r3" ] || ldd "$bin/r3" | grep -E "cuda|cublas|nvrtc|curand" | tee "$work/ldd.txt"
# A library the system does not have: PyTorch's own CUDA wheels (site-packages/nvidia/…/lib)
# hold cuBLAS, NVRTC and cuRAND of the same CUDA, tried before giving up.
if [ -z "$dry_r3" ] && ldd "$bin/r3" | grep -q "not found"; then
    wheel_libs=$("$python" - <<'PY' 2>/dev/null
import glob, os
import nvidia
dirs = set()
for base in nvidia.__path__:
    for lib in glob.glob(os.path.join(base, "**", "lib*.so*"), recursive=True):
        # Never a stubs folder: its libcuda.so would shadow the driver's.
        if "stubs" not in lib.split(os.sep):
            dirs.add(os.path.dirname(lib))
print(":".join(sorted(dirs)))
PY
)
    if [ -n "$wheel_libs" ]; then
        export LD_LIBRARY_PATH="$wheel_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "== a library was not found; trying PyTorch's CUDA wheels: $wheel_libs"
        ldd "$bin/r3" | grep -E "cuda|cublas|nvrtc|curand" | tee "$work/ldd-wheels.txt"
    fi
    if ldd "$bin/r3" | grep -q "not found"; then
        echo "check.sh: a CUDA library is not found (see $work/ldd.txt); set LD_LIBRARY_PATH" >&2
        verdict libraries "missing: $(ldd "$bin/r3" | grep "not found" | awk '{print $1}' | tr '\n' ' ')"
    else
        verdict libraries "from PyTorch's CUDA wheels"
    fi
fi

# 1. GPU tests (cwd = the crate folder: the tests find their fixtures relative to it).
if wants 1; then
t0=$(date +%s)
(cd crates/r3-model && timeout -k 5 "$(limit 60)" "$bin/r3-model-kernels" --test-threads=1 --nocapture) > "$work/test-kernels.txt" 2>&1
rc=$?; grep -E "max|test result|panicked" "$work/test-kernels.txt" | tail -n 30
verdict kernel-tests "$(outcome $rc)"
(cd crates/r3-model && timeout -k 5 "$(limit 150)" "$bin/r3-model-devices" --test-threads=1) > "$work/test-model.txt" 2>&1
rc=$?; tail -n 30 "$work/test-model.txt"
verdict model-tests "$(outcome $rc)"
(cd crates/r3-train && timeout -k 5 "$(limit 60)" "$bin/r3-train-devices" --test-threads=1) > "$work/test-train.txt" 2>&1
rc=$?; tail -n 20 "$work/test-train.txt"
verdict train-tests "$(outcome $rc)"
echo "   tests took $(( $(date +%s) - t0 )) s"
fi

# 2. The default task on the GPU, and step 1 on the CPU for the rewards.
if wants 2; then
t0=$(date +%s)
timeout -k 5 "$(limit 120)" "$bin/r3" train --set train.device=cuda --set steps=20 --set eval.every=0 \
    --set checkpoint.every=0 --set run_dir="$work/train-cuda" > "$work/train-cuda.txt" 2>&1
rc_cuda=$?
timeout -k 5 "$(limit 60)" "$bin/r3" train --set steps=1 --set eval.every=0 --set checkpoint.every=0 \
    --set run_dir="$work/train-cpu" > "$work/train-cpu.txt" 2>&1
rc_cpu=$?
tail -n 5 "$work/train-cuda.txt"
train_verdict=$("$python" - "$work" "$rc_cuda" "$rc_cpu" <<'PY'
import json, sys
out, rc_cuda, rc_cpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def rows(name):
    try:
        with open(f"{out}/{name}/metrics.jsonl") as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []
cuda, cpu = rows("train-cuda"), rows("train-cpu")
if rc_cuda != 0 or len(cuda) < 20:
    print(f"FAIL(cuda run rc {rc_cuda}, {len(cuda)} steps)"); sys.exit()
verified = [r.get("replay.verified_frac") for r in cuda]
bad = [i + 1 for i, v in enumerate(verified) if v != 1.0]
same = bool(cpu) and cuda[0].get("reward_mean") == cpu[0].get("reward_mean")
last = cuda[-1]
print(("pass" if not bad and same else "FAIL")
      + f"(verified_frac!=1 at steps {bad or 'none'}; step-1 reward cuda {cuda[0].get('reward_mean')}"
      + f" cpu {cpu[0].get('reward_mean') if cpu else 'n/a'}; step 20 reward {last.get('reward_mean')})")
PY
)
verdict train-cuda "$train_verdict"
# bf16 training on the GPU with its held bf16 weight copies (`auto` there) and without them
# (every matmul casting its f32 weight): the same arithmetic, so the same metrics if the GPU's
# kernels are deterministic run to run (reported, not required: cuBLAS may pick another
# algorithm).
if [ "$(left)" -ge 60 ]; then
    for copies in on off; do
        timeout -k 5 "$(limit 40)" "$bin/r3" train --set train.device=cuda --set train.dtype=bf16 \
            --set train.narrow_weight_copies=$copies --set steps=3 --set eval.every=0 \
            --set checkpoint.every=0 --set run_dir="$work/train-bf16-$copies" \
            > "$work/train-bf16-$copies.txt" 2>&1
    done
    # The weights held in bf16 with no f32 master and AdamW's moments in bf16
    # (train.master_weights = "bf16", optim.moments_dtype = "bf16": the r3_adamw_bf16*_mbf16
    # kernels, stochastic rounding), in micro-batches of 512 tokens whose gradients are summed
    # in bf16 (train.grad_accum_dtype = "bf16": r3_sum_bf16_stochastic_*), the gradient norm
    # by r3_sum_squares_*: another scheme, so other metrics; replay verified at every step
    # and the rewards reported.
    timeout -k 5 "$(limit 40)" "$bin/r3" train --set train.device=cuda --set train.dtype=bf16 \
        --set train.master_weights=bf16 --set optim.moments_dtype=bf16 \
        --set train.grad_accum_dtype=bf16 --set algo.max_tokens_per_micro_batch=512 \
        --set steps=3 --set eval.every=0 \
        --set checkpoint.every=0 --set run_dir="$work/train-bf16-masters" \
        > "$work/train-bf16-masters.txt" 2>&1
    # The same with the weight gradients kept in bf16 (the GEMMs' own outputs, read by
    # AdamW's kernel as they are): the same arithmetic again.
    timeout -k 5 "$(limit 40)" "$bin/r3" train --set train.device=cuda --set train.dtype=bf16 \
        --set train.narrow_gradients=true --set steps=3 --set eval.every=0 \
        --set checkpoint.every=0 --set run_dir="$work/train-bf16-narrow" \
        > "$work/train-bf16-narrow.txt" 2>&1
    copies_verdict=$("$python" - "$work" <<'PY'
import json, sys
out = sys.argv[1]
def rows(name):
    try:
        with open(f"{out}/{name}/metrics.jsonl") as f:
            return [{k: v for k, v in json.loads(line).items()
                     if not k.startswith(("time.", "throughput.", "memory."))}
                    for line in f if line.strip()]
    except OSError:
        return []
on, off, narrow = rows("train-bf16-on"), rows("train-bf16-off"), rows("train-bf16-narrow")
if len(on) < 3 or len(off) < 3:
    print(f"FAIL({len(on)} / {len(off)} steps with / without copies)"); sys.exit()
def differ(x, y):
    d = [(i + 1, k) for i, (a, b) in enumerate(zip(x, y)) for k in a if a[k] != b.get(k)]
    return "same" if not d else f"differ(first at step {d[0][0]}: {d[0][1]})"
masters = rows("train-bf16-masters")
verified = all(r.get("replay.verified_frac") == 1.0 for r in on + narrow + masters)
print(f"without copies {differ(on, off)}; bf16 gradients "
      + (differ(on, narrow) if len(narrow) >= 3 else f"FAIL({len(narrow)} steps)")
      + "; bf16 masters " + (f"rewards {[r.get('reward_mean') for r in masters]}, skipped "
                             f"{sum(r.get('update.skipped', 0) or 0 for r in masters)}"
                             if len(masters) >= 3 else f"FAIL({len(masters)} steps)")
      + f" (verified_frac=1 every step: {verified})")
PY
)
    verdict train-bf16-copies "$copies_verdict"
fi
echo "   training runs took $(( $(date +%s) - t0 )) s"
fi

# gpu_peak FILE CMD...: runs CMD with nvidia-smi sampling used memory; prints the peak MiB.
gpu_peak() {
    local log="$1"; shift
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$log.mem" 2>/dev/null &
    local smi=$!
    "$@" > "$log" 2>&1
    local rc=$?
    kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
    sort -n "$log.mem" | tail -n 1
    return $rc
}
# tensors_mib FILE: the tensors' own high-water mark (the memory pool's) r3 bench train
# printed, beside nvidia-smi's whole process.
tensors_mib() { grep -E "^device memory" "$1" | sed -E 's/.*during the steps ([0-9]+) MiB.*/\1/'; }
# routing_waits FILE: the routing waits a bench's forward made (MoE layers whose router's
# choice the host read mid-forward, each draining the GPU's queue), native and replay:
# "native N/T ms, replay M/U ms".
routing_waits() {
    grep -E "^routing waits" "$1" | sed -E 's/.*native ([0-9]+) layers, ([0-9.]+) ms; replay ([0-9]+) layers, ([0-9.]+) ms.*/native \1\/\2 ms, replay \3\/\4 ms/'
}
# grads_kept FILE: the gradients' size at the backward's end and how many r3 bench train kept
# in bf16 (--narrow-gradients).
grads_kept() {
    grep -E "^gradients at the backward's end" "$1" \
        | sed -E 's/.*end: ([0-9.]+) GB, ([0-9]+) of ([0-9]+) tensors.*/\1 GB, \2 of \3 in bf16/'
}
# peak_share FILE: the share of the GPU's GEMM peak (in the step's dtype, measured in the same
# run) r3 bench train's mean step reached.
peak_share() {
    grep -E "^matrix work .*TFLOP/s mean" "$1" \
        | sed -E 's/.* = ([0-9.]+)% \/ [0-9.]+% of the ([A-Za-z0-9]+) GEMM peak measured in this run \(([0-9.]+) TFLOP\/s.*/\1% of the \2 peak (\3 TFLOP\/s)/'
}

# 3. Speed beside HF transformers on the same GPU: r3 bench train's configs, mid (240 M; f32,
#    bf16, batch 8 × 512) and Qwen3-30B-A3B's layer shape with 8 layers (5.6 B; bf16, batch
#    2 × 512: r3 keeps f32 master weights and gradients, 56 GB at 5.6 B, where HF trains
#    in bf16 alone; batch 4 ran out of the H100's 80 GB). GPU memory is read by nvidia-smi
#    every 100 ms for both (the same meter: it counts the whole process, context and
#    allocator pools included).
if wants 3; then
t0=$(date +%s)
bench=()
for run in "mid f32 8 70 --parts" "mid bf16 8 70 --parts" "a3b-8l bf16 2 120"; do
    read -r config dtype batch secs parts <<< "$run"
    name="$config-$dtype"
    if [ "$(left)" -lt 60 ]; then bench+=("$name skipped(budget)"); continue; fi
    # --parts: then each part of the model alone (embedding, attention, router, MoE block,
    # head), forward and backward synchronised, beside the whole step.
    r3_mem=$(gpu_peak "$work/bench-r3-$name.txt" timeout -k 5 "$(limit "$secs")" "$bin/r3" bench train \
        --device cuda --config "$config" --dtype "$dtype" --batch "$batch" --seq-len 512 --steps 3 --warmup 1 ${parts:-})
    cat "$work/bench-r3-$name.txt"
    r3_tps=$(grep -E "^native +mean" "$work/bench-r3-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s +best.*/\1/')
    replay_cost=$(grep -E "^replay cost" "$work/bench-r3-$name.txt" | sed -E 's/replay cost vs native: ([-+0-9.]+)% mean.*/\1/')
    r3_tensors=$(tensors_mib "$work/bench-r3-$name.txt")
    hf_mem=$(gpu_peak "$work/bench-hf-$name.txt" timeout -k 5 "$(limit "$secs")" "$python" scripts/cuda/peer_hf.py \
        --config "$config" --dtype "$dtype" --batch "$batch" --seq-len 512 --steps 3)
    cat "$work/bench-hf-$name.txt"
    hf_tps=$(grep -E "^peer " "$work/bench-hf-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s.*/\1/')
    line="$name r3 ${r3_tps:-?} tok/s ${r3_mem:-?} MiB (tensors ${r3_tensors:-?} MiB; $(peak_share "$work/bench-r3-$name.txt")), HF ${hf_tps:-?} tok/s ${hf_mem:-?} MiB, replay ${replay_cost:-?}% (waits $(routing_waits "$work/bench-r3-$name.txt"))"
    # bf16 also beside HF the way its Trainer runs bf16 (f32 parameters under autocast): r3's
    # own scheme (f32 master weights, bf16 matmuls), so the like-for-like peer.
    if [ "$dtype" = bf16 ] && [ "$(left)" -ge 60 ]; then
        amp_mem=$(gpu_peak "$work/bench-hf-amp-$name.txt" timeout -k 5 "$(limit "$secs")" "$python" \
            scripts/cuda/peer_hf.py --config "$config" --dtype amp-bf16 --batch "$batch" --seq-len 512 --steps 3)
        cat "$work/bench-hf-amp-$name.txt"
        amp_tps=$(grep -E "^peer " "$work/bench-hf-amp-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s.*/\1/')
        line+=", HF amp-bf16 ${amp_tps:-?} tok/s ${amp_mem:-?} MiB"
    fi
    # bf16 runs again with the matrices held in bf16 with no f32 master (--master-weights
    # bf16: HF bf16's own scheme, weights and their gradients 2 bytes a parameter each):
    # the memory beside HF bf16's.
    if [ "$dtype" = bf16 ] && [ "$(left)" -ge 60 ]; then
        masters_mem=$(gpu_peak "$work/bench-r3-masters-$name.txt" timeout -k 5 "$(limit "$secs")" "$bin/r3" \
            bench train --device cuda --config "$config" --dtype "$dtype" --batch "$batch" \
            --seq-len 512 --steps 3 --warmup 1 --master-weights bf16)
        cat "$work/bench-r3-masters-$name.txt"
        masters_tps=$(grep -E "^native +mean" "$work/bench-r3-masters-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s +best.*/\1/')
        line+=", r3 bf16 masters ${masters_tps:-?} tok/s ${masters_mem:-?} MiB (tensors $(tensors_mib "$work/bench-r3-masters-$name.txt") MiB; gradients $(grads_kept "$work/bench-r3-masters-$name.txt"); $(peak_share "$work/bench-r3-masters-$name.txt"))"
    fi
    # bf16 runs hold a bf16 copy of every weight matrix (`--narrow-copies auto`: on a GPU),
    # rewritten once per step; the 30B-A3B shape also runs without them (every matmul casts
    # its f32 weight, the scheme before), so the copies' gain and memory are measured in one
    # call.
    if [ "$config" = a3b-8l ] && [ "$(left)" -ge 60 ]; then
        cast_mem=$(gpu_peak "$work/bench-r3-cast-$name.txt" timeout -k 5 "$(limit "$secs")" "$bin/r3" \
            bench train --device cuda --config "$config" --dtype "$dtype" --batch "$batch" \
            --seq-len 512 --steps 3 --warmup 1 --narrow-copies off)
        cat "$work/bench-r3-cast-$name.txt"
        cast_tps=$(grep -E "^native +mean" "$work/bench-r3-cast-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s +best.*/\1/')
        line+=", r3 without weight copies ${cast_tps:-?} tok/s ${cast_mem:-?} MiB"
    fi
    # bf16 runs again with the weight gradients kept in bf16 (--narrow-gradients: each
    # 16-bit GEMM's and weight rounding's as written, large f32 ones where exact), copies
    # held: the fast configuration's memory.
    if [ "$dtype" = bf16 ] && [ "$(left)" -ge 60 ]; then
        fast_mem=$(gpu_peak "$work/bench-r3-gradbf16-$name.txt" timeout -k 5 "$(limit "$secs")" "$bin/r3" \
            bench train --device cuda --config "$config" --dtype "$dtype" --batch "$batch" \
            --seq-len 512 --steps 3 --warmup 1 --narrow-gradients)
        cat "$work/bench-r3-gradbf16-$name.txt"
        fast_tps=$(grep -E "^native +mean" "$work/bench-r3-gradbf16-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s +best.*/\1/')
        line+=", r3 gradients in bf16 ${fast_tps:-?} tok/s ${fast_mem:-?} MiB (tensors $(tensors_mib "$work/bench-r3-gradbf16-$name.txt") MiB; gradients $(grads_kept "$work/bench-r3-gradbf16-$name.txt"))"
    fi
    # The 30B-A3B shape without copies and with its weight gradients kept in bf16 where
    # exact (--narrow-gradients: 2 bytes a parameter instead of 4, the same gradients): the
    # memory of r3's own scheme at full speed, beside HF amp-bf16's.
    if [ "$config" = a3b-8l ] && [ "$(left)" -ge 60 ]; then
        narrow_mem=$(gpu_peak "$work/bench-r3-narrow-$name.txt" timeout -k 5 "$(limit "$secs")" "$bin/r3" \
            bench train --device cuda --config "$config" --dtype "$dtype" --batch "$batch" \
            --seq-len 512 --steps 3 --warmup 1 --narrow-copies off --narrow-gradients)
        cat "$work/bench-r3-narrow-$name.txt"
        narrow_tps=$(grep -E "^native +mean" "$work/bench-r3-narrow-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s +best.*/\1/')
        line+=", r3 without copies, gradients in bf16 ${narrow_tps:-?} tok/s ${narrow_mem:-?} MiB (tensors $(tensors_mib "$work/bench-r3-narrow-$name.txt") MiB; gradients $(grads_kept "$work/bench-r3-narrow-$name.txt"))"
    fi
    # bf16 runs again in the leanest memory: activation checkpointing (each layer run again
    # in the backward: one layer's activations held at a time), the weight gradients kept in
    # bf16 where exact, and on the 30B-A3B shape no weight copies; the same gradients, the
    # memory beside HF's.
    if [ "$dtype" = bf16 ] && [ "$(left)" -ge 60 ]; then
        lean=(--gradient-checkpointing --narrow-gradients)
        if [ "$config" = a3b-8l ]; then lean+=(--narrow-copies off); fi
        ckpt_mem=$(gpu_peak "$work/bench-r3-ckpt-$name.txt" timeout -k 5 "$(limit "$secs")" "$bin/r3" \
            bench train --device cuda --config "$config" --dtype "$dtype" --batch "$batch" \
            --seq-len 512 --steps 3 --warmup 1 "${lean[@]}")
        cat "$work/bench-r3-ckpt-$name.txt"
        ckpt_tps=$(grep -E "^native +mean" "$work/bench-r3-ckpt-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s +best.*/\1/')
        line+=", r3 lean (${lean[*]}) ${ckpt_tps:-?} tok/s ${ckpt_mem:-?} MiB (tensors $(tensors_mib "$work/bench-r3-ckpt-$name.txt") MiB; gradients $(grads_kept "$work/bench-r3-ckpt-$name.txt"))"
    fi
    # mid bf16 lean again with the head scored 1,024 tokens at a time without its logits
    # kept (--head-chunk-tokens: one more forward of the head; at 8 x 512 tokens and a
    # 32,000-token vocabulary the logits and their gradient are 1 GB in f32).
    if [ "$config" = mid ] && [ "$dtype" = bf16 ] && [ "$(left)" -ge 60 ]; then
        chunk_mem=$(gpu_peak "$work/bench-r3-chunk-$name.txt" timeout -k 5 "$(limit "$secs")" "$bin/r3" \
            bench train --device cuda --config "$config" --dtype "$dtype" --batch "$batch" \
            --seq-len 512 --steps 3 --warmup 1 "${lean[@]}" --head-chunk-tokens 1024)
        cat "$work/bench-r3-chunk-$name.txt"
        chunk_tps=$(grep -E "^native +mean" "$work/bench-r3-chunk-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s +best.*/\1/')
        line+=", r3 lean + head in chunks of 1024 ${chunk_tps:-?} tok/s ${chunk_mem:-?} MiB (tensors $(tensors_mib "$work/bench-r3-chunk-$name.txt") MiB)"
    fi
    bench+=("$line")
    echo "== bench $name: ${bench[-1]}"
done
verdict bench "$(IFS=';'; echo "${bench[*]}")"
# The optimiser step alone on the GPU (300 M parameters of mid's shapes): f32 gradients, then
# bf16 gradients with held bf16 copies (the pass reads the gradients as they are and writes
# the copies itself), then bf16 weights and bf16 moments (`r3_adamw_bf16_mbf16`, stochastic
# rounding), each composed against fused, against the GPU's own copy rate.
if [ "$(left)" -ge 45 ]; then
    optim=()
    for mode in "f32" "bf16 --held-copies" "f32 --bf16-matrices --bf16-moments"; do
        read -r gd extra <<< "$mode"
        tag="$gd${extra:+-masters}"
        timeout -k 5 "$(limit 40)" "$bin/r3" bench optim --device cuda --params 300000000 --steps 3 \
            --grad-dtype "$gd" $extra > "$work/optim-$tag.txt" 2>&1
        rc=$?
        tail -n 7 "$work/optim-$tag.txt"
        line=$(grep -E "^whole optimiser step" "$work/optim-$tag.txt" | sed -E 's/.*best: (.*) faster; fused at ([0-9.]+)% of bandwidth.*/\1 faster, fused \2% of bandwidth/')
        optim+=("$gd gradients${extra:+ $extra}: ${line:-FAIL(rc $rc)}")
    done
    verdict optim "$(IFS=';'; echo "${optim[*]}")"
fi
echo "   benchmarks took $(( $(date +%s) - t0 )) s"
fi

# 4. The device rollout engine on the GPU.
if wants 4; then
t0=$(date +%s)
(cd crates/r3-rollout && timeout -k 5 "$(limit 90)" "$bin/r3-rollout-device_engine" --test-threads=1 --nocapture \
    && timeout -k 5 "$(limit 60)" "$bin/r3-rollout-device_prefix_cache" --test-threads=1 --nocapture \
    && timeout -k 5 "$(limit 30)" "$bin/r3-rollout-device_pause" --test-threads=1 --nocapture \
    && timeout -k 5 "$(limit 30)" "$bin/r3-rollout-device_chunked_prefill" --test-threads=1 --nocapture \
    && timeout -k 5 "$(limit 30)" "$bin/r3-rollout-device_kv_dtype" --test-threads=1 --nocapture) \
    > "$work/test-rollout.txt" 2>&1
rc=$?; grep -E "differ|test result|panicked" "$work/test-rollout.txt" | tail -n 40
verdict rollout-tests "$(outcome $rc)"
generate_verdict=$("$python" - "$bin/r3" "$(limit 240)" <<'PY'
import json, subprocess, sys, time
r3 = sys.argv[1]
# The four generate runs share what is left of the budget (a hung one is cut, not waited on).
deadline = time.monotonic() + max(float(sys.argv[2]) - 5, 1)
oracle = json.load(open("crates/r3-rollout/tests/fixtures/oracle_subset.json"))
bad = []
for name in ("qwen3_moe_tiny", "deepseek_v3_tiny"):
    g = oracle[name]["greedy"]
    prompt, want = g["prompt"], g["output_ids"]
    outs = {}
    for device in ("cuda", "cpu"):
        try:
            p = subprocess.run([r3, "generate", "--model", f"crates/r3-rollout/tests/fixtures/{name}",
                                "--input-ids", ",".join(map(str, prompt)), "--dtype", "f32",
                                "--max-new-tokens", str(len(want) - len(prompt)), "--device", device],
                               capture_output=True, text=True,
                               timeout=max(min(60, deadline - time.monotonic()), 1))
        except subprocess.TimeoutExpired:
            bad.append(f"{name}: r3 generate --device {device} timed out")
            outs[device] = None
            continue
        lines = p.stdout.strip().splitlines()
        outs[device] = json.loads(lines[-1]) if p.returncode == 0 and lines else None
    cuda, cpu = outs.get("cuda"), outs.get("cpu")
    if cuda is None or cpu is None:
        bad.append(f"{name}: r3 generate failed"); continue
    if cuda["output_ids"] != want[len(prompt):]:
        bad.append(f"{name}: cuda tokens differ from HF's")
    if cuda["output_ids"] != cpu["output_ids"]:
        bad.append(f"{name}: cuda tokens differ from the CPU engine's")
    if cuda["routes"] != cpu["routes"]:
        bad.append(f"{name}: cuda routes differ from the CPU engine's (ties within rounding?)")
print("pass" if not bad else "FAIL(" + "; ".join(bad) + ")")
PY
)
verdict generate-cuda "${generate_verdict:-FAIL(no verdict: the comparison itself failed)}"
# Both engines on the GPU: the default task's whole run (200 steps; replay must verify every
# step), beside the same run on this host's CPU (both engines there): step 1's mean reward
# within 0.02 of the CPU's (the same weights and seed; a GPU-sampled token may flip where two
# candidates tie within rounding), and the rewards rising as they do on the CPU: the mean of
# steps 181-200 above that of steps 1-20 (on the 2-core CPU machine 0.369 -> 0.483; over 20
# steps alone the reward moves by ±0.1 from step to step and need not rise). After step 1
# the two runs part at float rounding, so only their trends are compared.
timeout -k 5 "$(limit 150)" "$bin/r3" train --set train.device=cuda --set rollout.device=cuda \
    --set eval.every=0 --set checkpoint.every=0 --set run_dir="$work/train-both-cuda" \
    > "$work/train-both-cuda.txt" 2>&1
rc=$?; tail -n 3 "$work/train-both-cuda.txt"
timeout -k 5 "$(limit 90)" "$bin/r3" train --set eval.every=0 --set checkpoint.every=0 \
    --set run_dir="$work/train-both-cpu" > "$work/train-both-cpu.txt" 2>&1
both_verdict=$("$python" - "$work/train-both-cuda/metrics.jsonl" "$rc" "$work/train-both-cpu/metrics.jsonl" <<'PY'
import json, sys
def rows_of(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip()]
    except OSError:
        return []
rows, cpu = rows_of(sys.argv[1]), rows_of(sys.argv[3])
if sys.argv[2] != "0" or len(rows) < 200:
    print(f"FAIL(rc {sys.argv[2]}, {len(rows)} steps)"); sys.exit()
bad = [i + 1 for i, r in enumerate(rows) if r.get("replay.verified_frac") != 1.0]
split = {k: round(sum(r.get(k, 0) for r in rows[1:]) / max(len(rows) - 1, 1), 3)
         for k in ("time.rollout_s", "time.old_logp_s", "time.update_s", "time.sync_s")}
rewards = lambda rs: [r.get("reward_mean", 0.0) for r in rs]
gpu, host = rewards(rows), rewards(cpu)
mean = lambda xs: round(sum(xs) / max(len(xs), 1), 4)
trend = lambda xs: (mean(xs[:20]), mean(xs[-20:]))
host_trend = trend(host) if len(host) >= 200 else f"{len(host)} cpu steps"
first = host[0] if host else None
ok = not bad and first is not None and abs(gpu[0] - first) <= 0.02 and trend(gpu)[1] > trend(gpu)[0]
print(("pass" if ok else "FAIL") + f"(verified_frac!=1 at {bad or 'none'}; step 1 reward gpu {gpu[0]} cpu"
      + f" {first}; mean reward steps 1-20 -> 181-200 gpu {trend(gpu)} cpu {host_trend};"
      + f" mean s/step after 1: {split})")
PY
)
verdict train-both-cuda "$both_verdict"
# Both engines on the GPU on configs/gsm8k-style.toml (models/gsm8k-moe with its BPE
# tokenizer and chat template, 32 prompts x 8 samples, <= 160 new tokens, the math reward,
# dynamic sampling, R3), in bf16, 3 steps; beside it 2 steps of the config as shipped on
# this host's CPU: the time per step and its split, replay verified at every step.
if [ "$(left)" -ge 150 ]; then
    timeout -k 5 "$(limit 120)" "$bin/r3" train --config configs/gsm8k-style.toml --set train.device=cuda \
        --set rollout.device=cuda --set rollout.dtype=bf16 --set train.dtype=bf16 --set steps=3 \
        --set eval.every=0 --set checkpoint.every=0 --set run_dir="$work/gsm8k-cuda" \
        > "$work/gsm8k-cuda.txt" 2>&1
    rc_gpu=$?; tail -n 3 "$work/gsm8k-cuda.txt"
    timeout -k 5 "$(limit 60)" "$bin/r3" train --config configs/gsm8k-style.toml --set steps=2 \
        --set eval.every=0 --set checkpoint.every=0 --set run_dir="$work/gsm8k-cpu" \
        > "$work/gsm8k-cpu.txt" 2>&1
    rc_cpu=$?
    gsm8k_verdict=$("$python" - "$work" "$rc_gpu" "$rc_cpu" <<'PY'
import json, sys
out, rc_gpu, rc_cpu = sys.argv[1], sys.argv[2], sys.argv[3]
def rows(name):
    try:
        with open(f"{out}/{name}/metrics.jsonl") as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []
keys = ("time.rollout_s", "time.old_logp_s", "time.update_s", "time.sync_s")
def split(rs):
    later = rs[1:] or rs
    parts = {k.split(".")[1][:-2]: round(sum(r.get(k, 0) for r in later) / len(later), 3) for k in keys}
    return f"{round(sum(parts.values()), 3)} s/step {parts}"
gpu, cpu = rows("gsm8k-cuda"), rows("gsm8k-cpu")
if rc_gpu != "0" or len(gpu) < 3:
    print(f"FAIL(gpu rc {rc_gpu}, {len(gpu)} steps)"); sys.exit()
bad = [i + 1 for i, r in enumerate(gpu) if r.get("replay.verified_frac") != 1.0]
print(("pass" if not bad else "FAIL") + f"(verified_frac!=1 at {bad or 'none'}; gpu bf16 after step 1: {split(gpu)};"
      + f" cpu as shipped: {split(cpu) if cpu else f'rc {rc_cpu}, no steps'};"
      + f" rewards gpu {[r.get('reward_mean') for r in gpu]})")
PY
)
    verdict train-gsm8k-cuda "$gsm8k_verdict"
else
    verdict train-gsm8k-cuda "skipped(budget)"
fi
decode=()
for run in "mid f32" "mid bf16" "a3b-8l bf16"; do
    read -r config dtype <<< "$run"
    if [ "$(left)" -lt 60 ]; then decode+=("$config $dtype skipped(budget)"); continue; fi
    timeout -k 5 "$(limit 150)" "$bin/r3" bench decode --device cuda --configs "$config" --batches 1,64,256 \
        --dtype "$dtype" --prompt-len 32 --new-tokens 128 --repeats 2 > "$work/decode-r3-$config-$dtype.txt" 2>&1
    cat "$work/decode-r3-$config-$dtype.txt"
    r3_tps=$(grep -E "^decode $config" "$work/decode-r3-$config-$dtype.txt" | sed -E 's/.*batch ([0-9]+): ([0-9.]+) tokens\/s.*/\1:\2/' | tr '\n' ' ')
    # The share of each run the host spent waiting for the GPU (near 100%: kernel-bound;
    # low: bound by the host's own work and launches).
    r3_wait=$(grep -E "^decode $config" "$work/decode-r3-$config-$dtype.txt" | sed -nE 's/.*batch ([0-9]+): .*waiting for the device ([0-9.]+)%.*/\1:\2%/p' | tr '\n' ' ')
    # The share of each batch's steps `auto` routed on the device.
    r3_routed=$(grep -E "^decode $config" "$work/decode-r3-$config-$dtype.txt" | sed -nE 's/.*\(([0-9]+)% of steps on the device\) batch ([0-9]+):.*/\2:\1%/p' | tr '\n' ' ')
    (cd scripts/cuda && timeout -k 5 "$(limit 150)" "$python" peer_hf_generate.py --config "$config" \
        --dtype "$dtype" --batches 1,64,256 --prompt-len 32 --new-tokens 128 --repeats 2) \
        > "$work/decode-hf-$config-$dtype.txt" 2>&1
    cat "$work/decode-hf-$config-$dtype.txt"
    hf_tps=$(grep -E "^peer-generate" "$work/decode-hf-$config-$dtype.txt" | sed -E 's/.*batch ([0-9]+),.* ([0-9.]+) tokens\/s.*/\1:\2/' | tr '\n' ' ')
    decode+=("$config $dtype r3 [${r3_tps:-?}] HF [${hf_tps:-?}] tok/s by batch, r3's host waiting for the GPU [${r3_wait:-?}], steps routed on the GPU [${r3_routed:-?}]")
done
verdict decode "$(IFS=';'; echo "${decode[*]}")"
# The runs above route on the device where `auto` says (a GPU's steps of a few rows: each
# MoE layer's top-k, gates and experts without the host); the same small batches routed on
# the host (one wait a layer) say what that saved.
routing=()
for run in "mid f32 1,8" "mid bf16 1,8" "a3b-8l bf16 1"; do
    read -r config dtype batches <<< "$run"
    if [ "$(left)" -lt 50 ]; then routing+=("$config $dtype skipped(budget)"); continue; fi
    for place in host device; do
        timeout -k 5 "$(limit 90)" "$bin/r3" bench decode --device cuda --configs "$config" --batches "$batches" \
            --dtype "$dtype" --prompt-len 32 --new-tokens 128 --routing "$place" \
            > "$work/decode-routing-$place-$config-$dtype.txt" 2>&1
        cat "$work/decode-routing-$place-$config-$dtype.txt"
    done
    host=$(grep -E "^decode $config" "$work/decode-routing-host-$config-$dtype.txt" | sed -E 's/.*batch ([0-9]+): ([0-9.]+) tokens\/s.*waiting for the device ([0-9.]+)%.*/\1:\2 (wait \3%)/' | tr '\n' ' ')
    dev=$(grep -E "^decode $config" "$work/decode-routing-device-$config-$dtype.txt" | sed -E 's/.*batch ([0-9]+): ([0-9.]+) tokens\/s.*waiting for the device ([0-9.]+)%.*/\1:\2 (wait \3%)/' | tr '\n' ' ')
    routing+=("$config $dtype routed on the host [${host:-?}] on the device [${dev:-?}] tok/s by batch")
done
verdict decode-routing "$(IFS=';'; echo "${routing[*]}")"
# Sampled at temperature 1 (an RL rollout: every row's logits go to the host's sampler each
# step, through page-locked memory), mid bf16, beside the greedy figures above.
if [ "$(left)" -ge 45 ]; then
    timeout -k 5 "$(limit 90)" "$bin/r3" bench decode --device cuda --configs mid --batches 64,256 \
        --dtype bf16 --prompt-len 32 --new-tokens 128 --temperature 1 > "$work/decode-r3-sampled.txt" 2>&1
    cat "$work/decode-r3-sampled.txt"
    sampled=$(grep -E "^decode mid" "$work/decode-r3-sampled.txt" | sed -E 's/.*batch ([0-9]+): ([0-9.]+) tokens\/s.*waiting for the device ([0-9.]+)%.*/\1:\2 (wait \3%)/' | tr '\n' ' ')
    verdict decode-sampled "mid bf16 r3 [${sampled:-?}] tok/s by batch at temperature 1"
fi
# One 8,192-token prompt on the 30B-A3B shape (bf16, 16 new tokens): r3 prefills it in one
# step (its attention in query tiles within the default 8 GiB activation budget), then in
# chunks of 2,048 (`--chunked-prefill-size`, the chunked path at this shape); HF prefills it
# at once. Seconds to the 16 tokens, each, prefill included.
if [ "$(left)" -ge 130 ]; then
    seconds() { awk -v t="$1" 'BEGIN { if (t > 0) printf "%.2f s", 16 / t; else print "?" }'; }
    rate() { grep -E "^$1" "$2" | sed -E 's/.*batch 1: ([0-9.]+) tokens\/s.*/\1/; s/.* ([0-9.]+) tokens\/s.*/\1/'; }
    timeout -k 5 "$(limit 100)" "$bin/r3" bench decode --device cuda --configs a3b-8l --batches 1 \
        --dtype bf16 --prompt-len 8192 --new-tokens 16 > "$work/decode-r3-long.txt" 2>&1
    r3_long_rc=$?
    cat "$work/decode-r3-long.txt"
    timeout -k 5 "$(limit 100)" "$bin/r3" bench decode --device cuda --configs a3b-8l --batches 1 \
        --dtype bf16 --prompt-len 8192 --new-tokens 16 --chunked-prefill-size 2048 \
        > "$work/decode-r3-long-chunks.txt" 2>&1
    r3_chunks_rc=$?
    cat "$work/decode-r3-long-chunks.txt"
    (cd scripts/cuda && timeout -k 5 "$(limit 100)" "$python" peer_hf_generate.py --config a3b-8l \
        --dtype bf16 --batches 1 --prompt-len 8192 --new-tokens 16 --repeats 1) \
        > "$work/decode-hf-long.txt" 2>&1
    hf_long_rc=$?
    cat "$work/decode-hf-long.txt"
    r3_long=$(rate "decode a3b-8l" "$work/decode-r3-long.txt")
    r3_chunks=$(rate "decode a3b-8l" "$work/decode-r3-long-chunks.txt")
    hf_long=$(rate "peer-generate" "$work/decode-hf-long.txt")
    verdict decode-long-prompt "a3b-8l bf16, 8192-token prompt + 16 tokens at batch 1: r3 rc $r3_long_rc $(seconds "${r3_long:-0}") (one prefill step, attention in tiles), r3 rc $r3_chunks_rc $(seconds "${r3_chunks:-0}") (chunks of 2048), HF rc $hf_long_rc $(seconds "${hf_long:-0}")"
fi
echo "   rollout engine checks took $(( $(date +%s) - t0 )) s"
fi

# 5. (asked for by --steps 5 only) Where a training step's GPU time goes: Nsight Compute
#    times every kernel of one bf16 training step (forward + backward; `ncu` serialises the
#    kernels, so only the per-kernel durations mean anything, not the wall time), on mid and
#    on the 30B-A3B shape: `r3 bench train --profile-step` opens the profiler's capture range
#    around its first timed Native step only (ncu --profile-from-start off), and the table of
#    kernels by total time is written to profile-kernels-CONFIG.txt.
if wants 5; then
t0=$(date +%s)
if command -v ncu > /dev/null; then
    profiles=()
    for run in "a3b-8l 2 200" "mid 8 150"; do
        read -r config batch secs <<< "$run"
        if [ "$(left)" -lt 60 ]; then profiles+=("$config skipped(budget)"); continue; fi
        timeout -k 5 "$(limit "$secs")" ncu --metrics gpu__time_duration.sum --csv --print-units base \
            --profile-from-start off "$bin/r3" bench train --device cuda --config "$config" \
            --dtype bf16 --batch "$batch" --seq-len 512 --steps 1 --warmup 1 --profile-step \
            > "$work/profile-$config.csv" 2> "$work/profile-$config.err"
        rc=$?
        table=$("$python" - "$work/profile-$config.csv" "$work/profile-kernels-$config.txt" <<'PY'
import collections, csv, sys
rows = []
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") == "gpu__time_duration.sum":
        try:
            rows.append((r["Kernel Name"], float(r["Metric Value"].replace(",", ""))))
        except (KeyError, ValueError):
            pass
total = sum(ns for _, ns in rows)
by = collections.defaultdict(lambda: [0, 0.0])
for name, ns in rows:
    by[name.split("(")[0]][0] += 1
    by[name.split("(")[0]][1] += ns
with open(sys.argv[2], "w") as out:
    out.write(f"{len(rows)} kernels, {total / 1e6:.1f} ms of GPU time in all\n")
    for name, (n, ns) in sorted(by.items(), key=lambda kv: -kv[1][1])[:40]:
        out.write(f"{ns / 1e6:9.2f} ms {100 * ns / max(total, 1):5.1f}% {n:6d}x  {name[:90]}\n")
print(f"{len(rows)} kernels, {total / 1e6:.1f} ms GPU time")
PY
)
        head -n 25 "$work/profile-kernels-$config.txt" 2>/dev/null
        profiles+=("$config rc $rc: ${table:-no table}")
    done
    verdict profile "$(IFS=';'; echo "${profiles[*]}")"
else
    verdict profile "skipped(no ncu on PATH)"
fi
echo "   profile took $(( $(date +%s) - t0 )) s"
fi

# 6. (asked for by --steps 6 only) The host side of one mid bf16 training step: Nsight
#    Systems traces the CUDA API calls inside `r3 bench train --profile-step`'s capture range
#    and its `cuda_api_sum` report (time, calls and average per API function) is kept.
if wants 6; then
t0=$(date +%s)
if command -v nsys > /dev/null; then
    timeout -k 5 "$(limit 150)" nsys profile --trace cuda --capture-range cudaProfilerApi \
        --force-overwrite true -o "$work/nsys-mid" "$bin/r3" bench train --device cuda \
        --config mid --dtype bf16 --batch 8 --seq-len 512 --steps 1 --warmup 1 --profile-step \
        > "$work/nsys-mid.txt" 2>&1
    rc=$?
    # The report's name changed across Nsight Systems versions.
    for report in cuda_api_sum cudaapisum; do
        nsys stats --report "$report" --format csv --output "$work/nsys-api" \
            "$work/nsys-mid.nsys-rep" > "$work/nsys-stats.txt" 2>&1 && break
    done
    api=$(ls "$work"/nsys-api*.csv 2>/dev/null | head -n 1)
    head -n 16 "${api:-/dev/null}"
    if [ -n "$api" ]; then
        verdict nsys "rc $rc: $(basename "$api")"
    else
        verdict nsys "rc $rc: no API table (see nsys-stats.txt)"
    fi
else
    verdict nsys "skipped(no nsys on PATH)"
fi
echo "   nsys took $(( $(date +%s) - t0 )) s"
fi

# 7. (asked for by --steps 7 only) How bf16 training's GEMMs could call cuBLAS: the
#    `gemm16_modes` example times r3's cast-then-bf16-GEMM against a weight already held in
#    bf16, cuBLAS's FAST_16BF compute on the f32 operands and plain f32 (30B-A3B expert and mid
#    dense shapes), and finds how FAST_16BF rounds an f32 operand (it can replace the casts
#    only if it rounds to nearest-even, as r3 does).
if wants 7; then
t0=$(date +%s)
if [ -x "$bin/r3-model-gemm16_modes" ]; then
    timeout -k 5 "$(limit 90)" "$bin/r3-model-gemm16_modes" > "$work/gemm16.txt" 2>&1
    rc=$?
    cat "$work/gemm16.txt"
    verdict gemm16 "$([ $rc = 0 ] && grep -o 'fast16bf_rounding=[a-z-]*' "$work/gemm16.txt" || echo "FAIL($rc)")"
else
    verdict gemm16 "skipped(no gpu/bin/r3-model-gemm16_modes: rebuild with scripts/cuda/build.sh)"
fi
echo "   gemm16 took $(( $(date +%s) - t0 )) s"
fi

# 8. (asked for by --steps 8 only) Decode at batch 1 is bound by the host (it waits for the
#    GPU an eighth of the time), so what matters is how many kernels a step launches and
#    which. Nsight Compute lists every kernel of `r3 bench decode --batches 1` (mid, bf16 then
#    f32; a warm-up and a timed generate of 4 new tokens); every greedy step ends in one
#    `r3_greedy_rows_f32` launch, so the kernels between two of them are one step's: the
#    counts of each such step are listed, and the last one's kernels by name.
if wants 8; then
t0=$(date +%s)
if command -v ncu > /dev/null; then
    traced=()
    for dtype in bf16 f32; do
        if [ "$(left)" -lt 40 ]; then traced+=("mid $dtype skipped(budget)"); continue; fi
        timeout -k 5 "$(limit 100)" ncu --metrics gpu__time_duration.sum --csv --print-units base \
            "$bin/r3" bench decode --device cuda --configs mid --dtype "$dtype" --batches 1 \
            --prompt-len 8 --new-tokens 4 \
            > "$work/decode-trace-$dtype.csv" 2> "$work/decode-trace-$dtype.err"
        per_step=$("$python" - "$work" "$dtype" <<'PY'
import collections, csv, sys
work, dtype = sys.argv[1], sys.argv[2]
names = []
try:
    with open(f"{work}/decode-trace-{dtype}.csv") as f:
        lines = [l for l in f if l.startswith('"')]
except OSError:
    lines = []
for r in csv.DictReader(lines):
    if r.get("Metric Name") == "gpu__time_duration.sum":
        try:
            ns = float(r["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        names.append((r.get("Kernel Name", "?").split("(")[0], ns))
marks = [i for i, (n, _) in enumerate(names) if n.startswith("r3_greedy_rows")]
if len(marks) < 2:
    print(f"no step boundaries ({len(names)} kernels traced)"); sys.exit()
steps = [names[a + 1:b + 1] for a, b in zip(marks, marks[1:])]
last = steps[-1]
by = collections.defaultdict(lambda: [0, 0.0])
for n, ns in last:
    by[n][0] += 1
    by[n][1] += ns
with open(f"{work}/decode-trace-{dtype}.txt", "w") as out:
    out.write(f"mid {dtype} batch 1: kernels of each step between greedy picks "
              f"{[len(s) for s in steps]}; the last, {len(last)} kernels, "
              f"{sum(ns for _, ns in last) / 1e3:.1f} us of GPU time:\n")
    for n, (k, ns) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        out.write(f"{k:5d}x {ns / 1e3:8.2f} us  {n[:100]}\n")
print(f"{len(last)} kernels a decode step ({[len(s) for s in steps]} between picks), "
      f"{sum(ns for _, ns in last) / 1e3:.0f} us of GPU time")
PY
)
        head -n 45 "$work/decode-trace-$dtype.txt" 2>/dev/null
        traced+=("mid $dtype batch 1: ${per_step:-no table}")
    done
    verdict decode-trace "$(IFS=';'; echo "${traced[*]}")"
else
    verdict decode-trace "skipped(no ncu on PATH)"
fi
echo "   decode trace took $(( $(date +%s) - t0 )) s"
fi

# 9. (asked for by --steps 9 only) The 30B-A3B shape at the batch the issue's HF figure was
#    taken at (8 x 512 tokens): r3 with its matrices held in bf16 (--master-weights bf16,
#    HF bf16's own scheme: weights and gradients 2 bytes a parameter each; f32 masters ran
#    out of the H100's 80 GB at batch 4) beside HF bf16 at the same batch, speed and memory.
if wants 9; then
t0=$(date +%s)
name=a3b-8l-bf16-batch8
r3_mem=$(gpu_peak "$work/bench-r3-$name.txt" timeout -k 5 "$(limit 150)" "$bin/r3" bench train \
    --device cuda --config a3b-8l --dtype bf16 --batch 8 --seq-len 512 --steps 3 --warmup 1 \
    --master-weights bf16)
r3_rc=$?
cat "$work/bench-r3-$name.txt"
r3_tps=$(grep -E "^native +mean" "$work/bench-r3-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s +best.*/\1/')
replay_cost=$(grep -E "^replay cost" "$work/bench-r3-$name.txt" | sed -E 's/replay cost vs native: ([-+0-9.]+)% mean.*/\1/')
hf_mem=$(gpu_peak "$work/bench-hf-$name.txt" timeout -k 5 "$(limit 150)" "$python" scripts/cuda/peer_hf.py \
    --config a3b-8l --dtype bf16 --batch 8 --seq-len 512 --steps 3)
hf_rc=$?
cat "$work/bench-hf-$name.txt"
hf_tps=$(grep -E "^peer " "$work/bench-hf-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s.*/\1/')
# A run that failed says how (124: its time ran out; out of memory where the log says so).
oom() { grep -m1 -io 'out of memory\|OUT_OF_MEMORY' "$1" > /dev/null && echo ", out of memory"; }
line="r3 rc ${r3_rc}$(oom "$work/bench-r3-$name.txt"): bf16 masters ${r3_tps:-?} tok/s ${r3_mem:-?} MiB (tensors $(tensors_mib "$work/bench-r3-$name.txt") MiB; gradients $(grads_kept "$work/bench-r3-$name.txt"); $(peak_share "$work/bench-r3-$name.txt")), replay ${replay_cost:-?}% (waits $(routing_waits "$work/bench-r3-$name.txt")); HF rc ${hf_rc}$(oom "$work/bench-hf-$name.txt"): bf16 ${hf_tps:-?} tok/s ${hf_mem:-?} MiB"
# Then, while the budget lasts, the same run with the padded experts one op per step
# (--padded-expert-ops per-step: the graph keeping each step's f32 input, ≈ 1.0 GB a layer
# at this batch, where the fused ops, the default, hold ≈ 0.3 GB in bf16): the memory the
# fused ops save, measured in one call, and their speed beside the chain's.
if [ "$(left)" -ge 100 ]; then
    chain_mem=$(gpu_peak "$work/bench-r3-perstep-$name.txt" timeout -k 5 "$(limit 150)" "$bin/r3" bench train \
        --device cuda --config a3b-8l --dtype bf16 --batch 8 --seq-len 512 --steps 3 --warmup 1 \
        --master-weights bf16 --padded-expert-ops per-step)
    chain_rc=$?
    cat "$work/bench-r3-perstep-$name.txt"
    chain_tps=$(grep -E "^native +mean" "$work/bench-r3-perstep-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s +best.*/\1/')
    line+="; r3 rc ${chain_rc}$(oom "$work/bench-r3-perstep-$name.txt"): bf16 masters, experts per step ${chain_tps:-?} tok/s ${chain_mem:-?} MiB (tensors $(tensors_mib "$work/bench-r3-perstep-$name.txt") MiB)"
fi
# Then, while the budget lasts, r3 with its head scored 1,024 tokens at a time without the
# logits kept (`algo.head_chunk_tokens`): at 8 x 512 tokens and 151,936 columns the f32 logits
# and their log-softmax are ≈ 5 GB of the activations (one more forward of the head); and
# the attention's q and k heads run again in the backward (`--selective-recompute`, ≈ 0.2 GB
# a layer less): r3's leanest activations without full checkpointing.
if [ "$(left)" -ge 100 ]; then
    chunk_mem=$(gpu_peak "$work/bench-r3-chunk-$name.txt" timeout -k 5 "$(limit 150)" "$bin/r3" bench train \
        --device cuda --config a3b-8l --dtype bf16 --batch 8 --seq-len 512 --steps 3 --warmup 1 \
        --master-weights bf16 --head-chunk-tokens 1024 --selective-recompute)
    chunk_rc=$?
    cat "$work/bench-r3-chunk-$name.txt"
    chunk_tps=$(grep -E "^native +mean" "$work/bench-r3-chunk-$name.txt" | sed -E 's/.* ([0-9.]+) tokens\/s +best.*/\1/')
    line+="; r3 rc ${chunk_rc}$(oom "$work/bench-r3-chunk-$name.txt"): bf16 masters, head in chunks of 1024, selective recompute ${chunk_tps:-?} tok/s ${chunk_mem:-?} MiB (tensors $(tensors_mib "$work/bench-r3-chunk-$name.txt") MiB)"
fi
verdict bench-batch8 "$line"
echo "   batch-8 bench took $(( $(date +%s) - t0 )) s"
fi

# 10. (asked for by --steps 10 only) Whole RL steps with both engines on the GPU: the phases'
#     times and shares of the GPU's limits (`r3 bench step`, the machine measured in the run).
if wants 10; then
t0=$(date +%s)
stepped=()
# The 30B-A3B shape (≈ 5.0 B parameters) held in bf16 throughout: weights, gradient sums and
# moments ≈ 40 GB beside the device engine's 10 GB; the update staged tensor by tensor (the
# whole step's staging would add ≈ 30 GB at the optimiser step: past an H100's 80 GB).
a3b_sets="--set train.master_weights=bf16 --set optim.moments_dtype=bf16 --set train.grad_accum_dtype=bf16 --set optim.update_staging=tensor_by_tensor"
# model, seconds it may take, seconds it needs left to start, more --set options
for run in "config 90 45" "mid 150 60" "a3b-8l 240 150 $a3b_sets"; do
    read -r model secs need sets <<< "$run"
    if [ "$(left)" -lt "$need" ]; then stepped+=("$model skipped(budget: $(left) s left)"); continue; fi
    # shellcheck disable=SC2086 # $sets: more --set options, split on purpose
    timeout -k 5 "$(limit "$secs")" "$bin/r3" bench step --config configs/gsm8k-style.toml \
        --model "$model" --steps 3 --warmup 2 --set train.device=cuda --set rollout.device=cuda \
        --set train.dtype=bf16 --set rollout.dtype=bf16 --set algo.dynamic_sampling=false $sets \
        > "$work/bench-step-$model.txt" 2>&1
    rc=$?
    grep -vE "INFO|WARN" "$work/bench-step-$model.txt" | tail -n 16
    line=$(grep -E "^step " "$work/bench-step-$model.txt" | awk '{print $2 " s, " $8 " of limit"}')
    rollout=$(grep -E "^rollout\+capture " "$work/bench-step-$model.txt" | awk '{print $3 " " $8}')
    update=$(grep -E "^update backward " "$work/bench-step-$model.txt" | awk '{print $4 " " $9}')
    device_mib=$(grep -E "high-water mark over a step" "$work/bench-step-$model.txt" | sed -E 's/.* ([0-9]+) MiB.*/\1/')
    stepped+=("$model rc $rc: step ${line:-?} (rollout share/of-limit ${rollout:-?}; backward ${update:-?}; tensors ${device_mib:-?} MiB)")
done
verdict bench-step "$(IFS=';'; echo "${stepped[*]}")"
echo "   RL step bench took $(( $(date +%s) - t0 )) s"
fi

if [ -n "$dry_r3" ]; then
    accepted=$(grep -c "^accepted" "$dry_report")
    refused=$(grep -c "^REFUSED" "$dry_report")
    verdict dry-run "$accepted accepted, $refused refused$(grep -m 3 "^REFUSED" "$dry_report" | sed 's/^/; /' | tr -d '\n')"
    cat "$out/summary.txt"
    [ "$refused" = 0 ] || exit 1
    exit 0
fi
pack_logs
cat "$out/summary.txt"
