//! With the `cuda` feature: compiles r3's own CUDA kernels (`src/cuda/kernels.cu`) to PTX
//! with `nvcc` (`$NVCC`, else `nvcc` on the path; `scripts/cuda/build.sh` sets it) for the
//! GPU generation `$CUDA_COMPUTE_CAP` (default 90, H100/H200), embedded by `src/cuda/mod.rs`.
//! Without the feature it does nothing (the CPU build needs no CUDA toolkit).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/cuda/kernels.cu");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".to_string());
    let out_dir = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR for build scripts");
    let ptx = PathBuf::from(out_dir).join("r3_kernels.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", &format!("-arch=compute_{cap}"), "-o"])
        .arg(&ptx)
        .arg("src/cuda/kernels.cu")
        .status()
        .unwrap_or_else(|e| {
            panic!("r3-model: cannot run {nvcc} for the cuda feature ({e}); run scripts/cuda/build.sh or set NVCC")
        });
    assert!(
        status.success(),
        "r3-model: {nvcc} failed on src/cuda/kernels.cu ({status})"
    );
}
