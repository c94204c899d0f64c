//! Compiles r3's CUDA kernels (`crates/r3-model/src/cuda/kernels.cu`) for the host, twice:
//! once with every floating-point expression rounded as written (`-ffp-contract=off`), once
//! with multiplies and adds contracted into fused multiply-adds where the compiler finds them
//! (`-mfma -ffp-contract=fast`, as nvcc does by default). Each copy sits in a namespace of
//! its own with its kernels renamed (`emu_plain_r3_…`, `emu_fma_r3_…`), beside the emulated
//! grid's runtime (`emu/runtime.cpp`) and the CUDA names it provides (`emu/cuda_shim.h`).

use std::path::{Path, PathBuf};

/// The kernels' source made a host translation unit for `variant`: the CUDA includes left to
/// the shim, dynamic shared arrays read from the launch's buffer, and every `r3_` name
/// prefixed.
fn host_source(source: &str, variant: &str) -> String {
    let mut out = String::from("#include \"cuda_shim.h\"\n");
    out.push_str(&format!("namespace r3emu_{variant} {{\n"));
    for line in source.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#include") {
            continue;
        }
        if let Some(rest) = trimmed.strip_prefix("extern __shared__ ") {
            // `extern __shared__ T name[];` → a pointer to the launch's dynamic shared bytes.
            let decl = rest.trim_end().trim_end_matches(';').trim_end_matches("[]");
            let (ty, name) = decl.rsplit_once(' ').unwrap_or_else(|| {
                panic!("r3-cuda-emu: cannot read the dynamic shared array in {line:?}")
            });
            out.push_str(&format!(
                "{ty} *{name} = static_cast<{ty} *>(r3emu_dynamic_shared());\n"
            ));
            continue;
        }
        out.push_str(&prefix_names(line, &format!("emu_{variant}_")));
        out.push('\n');
    }
    out.push_str("}\n");
    out
}

/// `line` with `prefix` before every identifier that starts with `r3_`.
fn prefix_names(line: &str, prefix: &str) -> String {
    let bytes = line.as_bytes();
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < bytes.len() {
        let starts_name = line[i..].starts_with("r3_")
            && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'));
        if starts_name {
            out.push_str(prefix);
        }
        let c = line[i..].chars().next().expect("a char at a char boundary");
        out.push(c);
        i += c.len_utf8();
    }
    out
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let kernels = manifest.join("../r3-model/src/cuda/kernels.cu");
    let emu = manifest.join("emu");
    println!("cargo:rerun-if-changed={}", kernels.display());
    // The whole folder: cargo watches every file under it.
    println!("cargo:rerun-if-changed={}", emu.display());
    let source = std::fs::read_to_string(&kernels)
        .unwrap_or_else(|e| panic!("r3-cuda-emu: cannot read {}: {e}", kernels.display()));
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .include(&emu)
        .warnings(false)
        .file(emu.join("runtime.cpp"))
        .file(emu.join("faulty_kernels.cpp"));
    compile(&build, "r3emu_runtime");
    compile_variant(&source, &emu, &out_dir, "plain", &["-ffp-contract=off"]);
    compile_variant(
        &source,
        &emu,
        &out_dir,
        "fma",
        &["-mfma", "-ffp-contract=fast"],
    );
}

/// Writes and compiles one variant of the kernels into its own static library.
fn compile_variant(source: &str, emu: &Path, out_dir: &Path, variant: &str, flags: &[&str]) {
    let file = out_dir.join(format!("kernels_{variant}.cpp"));
    std::fs::write(&file, host_source(source, variant))
        .unwrap_or_else(|e| panic!("r3-cuda-emu: cannot write {}: {e}", file.display()));
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .include(emu)
        .warnings(false)
        .file(&file);
    for flag in flags {
        build.flag(flag);
    }
    compile(&build, &format!("r3emu_kernels_{variant}"));
}

/// Compiles `build` into the static library `name`, or stops the build naming what is
/// missing: the kernels are C++17, so this crate (tests only) needs a C++ compiler.
fn compile(build: &cc::Build, name: &str) {
    if let Err(e) = build.try_compile(name) {
        panic!(
            "r3-cuda-emu: cannot compile {name} ({e}); the host emulation of r3's CUDA kernels needs a C++17 compiler (g++ or clang++, or set CXX)"
        );
    }
}
