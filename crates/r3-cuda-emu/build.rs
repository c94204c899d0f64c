//! Compiles r3's CUDA kernels (`crates/r3-model/src/cuda/kernels.cu`) for the host, twice:
//! once with every floating-point expression rounded as written (`-ffp-contract=off`), once
//! with multiplies and adds contracted into fused multiply-adds where the compiler finds them
//! (`-mfma -ffp-contract=fast`, as nvcc does by default). Each copy sits in a namespace of
//! its own with its kernels renamed (`emu_plain_r3_…`, `emu_fma_r3_…`), beside the emulated
//! grid's runtime (`emu/runtime.cpp`) and the CUDA names it provides (`emu/cuda_shim.h`).

use std::path::{Path, PathBuf};

/// CUDA source made host C++ for the emulator: the CUDA includes left to the shim,
/// `extern __shared__` arrays read from the launch's buffer, each static `__shared__`
/// variable filled with garbage at every block's start (`r3emu_fill_shared_once`), and
/// pointer casts checked for the target's alignment (`r3emu_cast`).
fn host_cxx(source: &str, line_prefix: &dyn Fn(&str) -> String) -> String {
    let mut out = String::new();
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
        let line = line_prefix(line).replace("reinterpret_cast<", "r3emu_cast<");
        out.push_str(&line);
        if let Some(rest) = trimmed.strip_prefix("__shared__ ") {
            // `__shared__ T name[N];` (or a scalar): filled once a block, where declared.
            let decl = rest.trim_end().strip_suffix(';').unwrap_or_else(|| {
                panic!("r3-cuda-emu: a __shared__ declaration not on one line: {line:?}")
            });
            let decl = decl.split('[').next().unwrap_or(decl).trim_end();
            let name = decl.rsplit(' ').next().unwrap_or(decl);
            out.push_str(&format!(
                " r3emu_fill_shared_once(&{name}, sizeof({name}));"
            ));
        }
        out.push('\n');
    }
    out
}

/// The kernels' source made a host translation unit for `variant`: [`host_cxx`] with every
/// `r3_` name prefixed, inside a namespace of the variant's own, and the variant's probe:
/// `r3emu_<variant>_probe(a, b, c)` = `a · b + c` as the variant compiles it (fused where it
/// contracts).
fn host_source(source: &str, variant: &str) -> String {
    let prefix = format!("emu_{variant}_");
    let mut out = String::from("#include \"cuda_shim.h\"\n");
    out.push_str(&format!("namespace r3emu_{variant} {{\n"));
    out.push_str(&host_cxx(source, &|line| prefix_names(line, &prefix)));
    out.push_str("}\n");
    out.push_str(&format!(
        "extern \"C\" float r3emu_{variant}_probe(float a, float b, float c) {{ return a * b + c; }}\n"
    ));
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
    // The emulator's own faulty kernels go through the same rewriting as r3's.
    let faulty_source = std::fs::read_to_string(emu.join("faulty_kernels.cpp"))
        .unwrap_or_else(|e| panic!("r3-cuda-emu: cannot read faulty_kernels.cpp: {e}"));
    let faulty = out_dir.join("faulty_kernels.cpp");
    let mut faulty_cxx = String::from("#include \"cuda_shim.h\"\n");
    faulty_cxx.push_str(&host_cxx(&faulty_source, &|line| line.to_string()));
    std::fs::write(&faulty, faulty_cxx)
        .unwrap_or_else(|e| panic!("r3-cuda-emu: cannot write {}: {e}", faulty.display()));
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .include(&emu)
        .warnings(false)
        .file(emu.join("runtime.cpp"))
        .file(&faulty);
    compile(&build, "r3emu_runtime");
    compile_variant(&source, &emu, &out_dir, "plain", &["-ffp-contract=off"]);
    // x86-64 has fused multiply-adds only when asked for; other targets have them always.
    let contracted: &[&str] = if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64") {
        &["-mfma", "-ffp-contract=fast"]
    } else {
        &["-ffp-contract=fast"]
    };
    compile_variant(&source, &emu, &out_dir, "fma", contracted);
    write_signatures(&emu, &out_dir);
}

/// Writes `kernel_signatures.rs` (included by `src/kernels.rs`): every kernel's Rust
/// signature, read from the plain variant's source after the preprocessor (so the kernels
/// that macros instantiate are there too). A kernel added to or changed in `kernels.cu`
/// changes its Rust declaration with it: a test calling it the old way no longer compiles,
/// where a hand-kept list would call it with the wrong arguments.
fn write_signatures(emu: &Path, out_dir: &Path) {
    let file = out_dir.join("kernels_plain.cpp");
    let expanded = cc::Build::new()
        .cpp(true)
        .std("c++17")
        .include(emu)
        .file(&file)
        .try_expand()
        .unwrap_or_else(|e| panic!("r3-cuda-emu: cannot preprocess {}: {e}", file.display()));
    let text = String::from_utf8_lossy(&expanded);
    let mut out = String::from("kernels! {\n");
    // The table's rows, sorted by name (r3-model looks a kernel up by binary search).
    let mut rows: Vec<String> = Vec::new();
    let mut count = 0;
    const PREFIX: &str = "emu_plain_r3_";
    let mut rest = text.as_ref();
    while let Some(at) = rest.find(PREFIX) {
        let before = rest[..at].trim_end();
        let after = &rest[at + PREFIX.len()..];
        rest = after;
        if !before.ends_with("void") {
            continue;
        }
        let name_len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(after.len());
        let name = &after[..name_len];
        let params = after[name_len..].trim_start();
        let Some(params) = params.strip_prefix('(') else {
            continue;
        };
        let close = params
            .find(')')
            .unwrap_or_else(|| panic!("r3-cuda-emu: r3_{name}'s parameters do not close"));
        let rust: Vec<String> = params[..close]
            .split(',')
            .map(|param| rust_param(name, param))
            .collect();
        out.push_str(&format!("    fn r3_{name}({});\n", rust.join(", ")));
        let kinds: Vec<&str> = rust.iter().map(|param| param_kind(param)).collect();
        rows.push(format!("    (\"r3_{name}\", &[{}]),\n", kinds.join(", ")));
        count += 1;
    }
    out.push_str("}\n");
    assert!(
        count > 0,
        "r3-cuda-emu: no kernel found in {}",
        file.display()
    );
    rows.sort();
    let mut table = String::from(TABLE_HEAD);
    table.extend(rows);
    table.push_str("];\n");
    let table_file = out_dir.join("kernel_params_table.rs");
    std::fs::write(&table_file, table)
        .unwrap_or_else(|e| panic!("r3-cuda-emu: cannot write {}: {e}", table_file.display()));
    let target = out_dir.join("kernel_signatures.rs");
    std::fs::write(&target, out)
        .unwrap_or_else(|e| panic!("r3-cuda-emu: cannot write {}: {e}", target.display()));
}

/// The head of r3-model's `kernel_params/table.rs`, which this build writes afresh (the
/// checked-in copy must equal it: r3-cuda-emu's test `the_checked_in_kernel_params_are_current`).
const TABLE_HEAD: &str =
    "//! Every kernel of `cuda/kernels.cu` with its parameters' kinds, in order: written by
//! r3-cuda-emu's build.rs from the preprocessed source (its `kernel_params_table.rs`), checked
//! against it by r3-cuda-emu's test `the_checked_in_kernel_params_are_current`. Not edited by
//! hand: a kernel changed in `kernels.cu` fails that test until this file is copied anew.

use super::ParamKind::{self, *};

/// Every kernel by name (sorted), with its parameters' kinds in order.
#[rustfmt::skip]
pub(super) const KERNEL_PARAMS: &[(&str, &[ParamKind])] = &[
";

/// The `ParamKind` of a Rust parameter (`x: *const f32`) of a kernel's signature.
fn param_kind(param: &str) -> &'static str {
    let ty = param.rsplit(": ").next().unwrap_or(param);
    if ty.starts_with('*') {
        return "Pointer";
    }
    match ty {
        "f32" => "F32",
        "f64" => "F64",
        "u32" | "i32" => "Int32",
        "u64" | "usize" => "Int64",
        other => panic!("r3-cuda-emu: no parameter kind for the type {other}"),
    }
}

/// One C parameter (`const float *x`) as a Rust one (`x: *const f32`).
fn rust_param(kernel: &str, param: &str) -> String {
    let param = param.split_whitespace().collect::<Vec<_>>().join(" ");
    let param = param.replace(" *", "*").replace("*", " * ");
    let words: Vec<&str> = param.split_whitespace().collect();
    let Some((name, ty)) = words.split_last() else {
        panic!("r3-cuda-emu: an empty parameter of r3_{kernel}")
    };
    let ty = ty.join(" ");
    let rust = match ty.as_str() {
        "float" => "f32",
        "double" => "f64",
        "int" => "i32",
        "uint32_t" => "u32",
        "uint64_t" => "u64",
        "size_t" => "usize",
        "const float *" => "*const f32",
        "float *" => "*mut f32",
        "const double *" => "*const f64",
        "double *" => "*mut f64",
        "const uint16_t *" => "*const u16",
        "uint16_t *" => "*mut u16",
        "const uint32_t *" => "*const u32",
        "uint32_t *" => "*mut u32",
        "const uint64_t *" => "*const u64",
        "uint64_t *" => "*mut u64",
        "const __nv_bfloat16 *" => "*const bf16",
        "__nv_bfloat16 *" => "*mut bf16",
        "const __half *" => "*const f16",
        "__half *" => "*mut f16",
        "void *" => "*mut c_void",
        other => panic!("r3-cuda-emu: r3_{kernel}'s parameter {name} has the type {other:?}, which build.rs does not map to Rust"),
    };
    format!("{name}: {rust}")
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
        // The vector casts read 16-bit buffers as 16-byte words, as a GPU does.
        .flag("-fno-strict-aliasing")
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
