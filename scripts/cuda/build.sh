#!/usr/bin/env bash
# Builds `r3` and the GPU test binaries with candle's CUDA backend (`--features cuda`) on a
# machine that may have no GPU and no CUDA toolkit: the toolkit comes from PyPI alone.
#
#   scripts/cuda/build.sh            # CUDA 13.0 from PyPI into gpu/toolchain (a venv)
#   CUDA_HOME=/usr/local/cuda scripts/cuda/build.sh   # a regular toolkit instead
#
# Output (ignored by git): gpu/bin/r3 and gpu/bin/<crate>-<test> — everything
# scripts/cuda/check.sh needs on the GPU machine, which has CUDA 13 libraries but no Rust —
# and gpu/pack/bin.tar.xz, the same packed small enough to carry (carry=["gpu/pack"]).
# The binaries look for CUDA's libraries in /usr/local/cuda/lib64 (rpath) and through the
# loader's usual paths, so nothing but gpu/bin has to travel.
#
# Environment it reads (all optional): CUDA_HOME (use this toolkit), CUDA_COMPUTE_CAP
# (default 90: H100/H200; there is no GPU here to ask), PYTHON (default python3),
# CARGO_BUILD_JOBS (default 1).
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
out="$root/gpu"
mkdir -p "$out/bin"
start=$(date +%s)

# cudarc 0.19 knows CUDA up to 13.4 and the lent machines' driver (580) speaks 13.0: pin 13.0.
cuda_wheels=(
    "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*"
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-nvrtc==13.0.*"
    "nvidia-curand==10.4.0.*" "nvidia-cublas==13.0.*"
)

if [ -z "${CUDA_HOME:-}" ]; then
    venv="$out/toolchain"
    if [ ! -x "$venv/bin/python" ]; then
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${cuda_wheels[@]}"
    CUDA_HOME=$("$venv/bin/python" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
    lib="$CUDA_HOME/lib"
    # candle links cudarc with `dynamic-linking`: the linker wants unversioned names.
    for name in cublas cublasLt nvrtc cudart curand; do
        versioned=$(cd "$lib" && ls "lib$name.so."* 2>/dev/null | sort | head -n 1 || true)
        if [ -z "$versioned" ]; then
            echo "build.sh: lib$name.so.* is missing from $lib (wheel install incomplete?)" >&2
            exit 1
        fi
        ln -sf "$versioned" "$lib/lib$name.so"
    done
    # The wheels ship no driver. Link against a stub libcuda.so (soname libcuda.so.1, as the
    # real driver's) that defines every cu* function cudarc binds; at run time the GPU
    # machine's driver is loaded instead. Each stub returns CUDA_ERROR_STUB_LIBRARY (34), so a
    # binary that meets the stub by mistake fails with that error instead of undefined behaviour.
    stubs="$lib/stubs"
    mkdir -p "$stubs"
    cudarc_src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -z "$cudarc_src" ]; then
        (cd "$root" && cargo fetch --quiet)
        cudarc_src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* | sort -V | tail -n 1)
    fi
    grep -ohE '^pub unsafe fn cu[A-Za-z0-9_]+' "$cudarc_src/src/driver/sys/mod.rs" \
        | sed 's/^pub unsafe fn //' | sort -u \
        | awk '{ printf "int %s(void) { return 34; }\n", $1 }' > "$stubs/libcuda_stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" "$stubs/libcuda_stub.c"
    ln -sf libcuda.so "$stubs/libcuda.so.1"
    echo "build.sh: CUDA from PyPI at $CUDA_HOME ($(grep -c . "$stubs/libcuda_stub.c") driver stubs)"
else
    echo "build.sh: CUDA toolkit at $CUDA_HOME"
fi

export CUDA_HOME CUDA_PATH="$CUDA_HOME" CUDA_ROOT="$CUDA_HOME" NVCC="$CUDA_HOME/bin/nvcc"
export PATH="$CUDA_HOME/bin:$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-1}"
# Its own target folder: the CUDA features would otherwise rebuild the CPU build's artefacts.
export CARGO_TARGET_DIR="$root/target/cuda"
# RUSTFLAGS replaces .cargo/config.toml's flags, so they are repeated here; the rpath lets the
# binary find the GPU machine's own CUDA libraries.
export RUSTFLAGS="-C target-feature=+avx2,+fma,+f16c -C link-arg=-Wl,-rpath,/usr/local/cuda/lib64"
"$NVCC" --version | tail -n 1

cd "$root"
cargo build --release --locked -p r3-cli --features cuda
cp "$CARGO_TARGET_DIR/release/r3" "$out/bin/r3"

# The device tests: each `crate:test` below is a tests/<test>.rs whose CUDA half is gated on
# the crate's `cuda` feature. `cargo test --no-run` prints the executable; copied under a stable name.
for spec in r3-model:devices r3-model:kernels r3-train:devices r3-rollout:device_engine r3-rollout:device_prefix_cache r3-rollout:device_pause r3-rollout:device_chunked_prefill r3-rollout:device_kv_dtype; do
    crate=${spec%%:*}
    test=${spec#*:}
    exe=$(cargo test --release --locked -p "$crate" --features cuda --test "$test" --no-run \
        --message-format=json \
        | "${PYTHON:-python3}" -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])' | tail -n 1)
    if [ -z "$exe" ]; then
        echo "build.sh: no test binary for $crate --test $test" >&2
        exit 1
    fi
    cp "$exe" "$out/bin/$crate-$test"
done

# The 16-bit GEMM experiment (check.sh step 7): how bf16 training could call cuBLAS.
cargo build --release --locked -p r3-model --features cuda --example gemm16_modes
cp "$CARGO_TARGET_DIR/release/examples/gemm16_modes" "$out/bin/r3-model-gemm16_modes"

# Symbols are not needed on the GPU machine, and what travels there is limited (64 MiB).
strip "$out/bin/"* 2>/dev/null || true

# Which source the binaries are: check.sh prints it, so figures are read against the commit
# they came from (a pack left from an earlier build is otherwise indistinguishable).
{
    echo "commit $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "uncommitted changes $(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null | wc -l)"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} > "$out/bin/BUILT_FROM"

# What travels to the GPU machine is limited to 64 MiB with the working tree: one xz archive
# of all the binaries, whose dictionary spans them so the CUDA kernels (PTX) each one embeds
# are stored once. check.sh unpacks it with Python's tarfile when gpu/bin is absent.
mkdir -p "$out/pack"
tar -C "$out" -cf - bin | xz -9 --lzma2=preset=9,dict=256MiB -T1 > "$out/pack/bin.tar.xz"

end=$(date +%s)
echo "build.sh: built in $((end - start)) s:"
ls -l "$out/bin" "$out/pack"
