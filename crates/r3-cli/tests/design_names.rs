//! `docs/design.md` is the map of the code; this test keeps its code names true.
//!
//! The rule: every code name the page cites must exist in the workspace's Rust sources
//! (`crates/*/**/*.rs`). A code name is, in a backtick span, the path the span starts with
//! (`Trainer::rl_step`, `r3_model::ConfigLimits`, `Routing::{Native, Replay}`) when it is a
//! path (`A::B`), a call (`fn_name(…)`, `Foo(…)`) or a CamelCase identifier (`RouteTable`);
//! inside a fenced code block, every token of those shapes. Each segment of the path must be
//! declared somewhere (after `fn`, `struct`, `enum`, `trait`, `type`, `const`, `static` or
//! `mod`, or as a variant or field: an identifier that starts a line followed by `(`, `{`,
//! `,`, `:` or `=`); the last segment of a lowercase call must be a `fn`. Workspace crate
//! names are not checked as segments. Names of other projects (SGLang's, candle's, HF's) are
//! written with their crate first (`candle_core::…`), which the test skips, or listed in
//! [`OTHER_PROJECTS`]. File names in backticks (`step.rs`, `r3-model/src/spec.rs`) must name
//! a file under `crates/` too.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// Names of other projects the page cites by their bare name.
const OTHER_PROJECTS: &[&str] = &[
    // SGLang's request classes (the server's field policy covers their fields).
    "GenerateReqInput",
    "UpdateWeightFromDiskReqInput",
    // Megatron's router precision setting and its pipeline layer offsets (r3-routing's
    // `megatron.rs` is checked against the latter by the Python package's Megatron check).
    "moe_router_dtype",
    "get_transformer_layer_offset",
    // libc's open-file limit (`r3 serve` fits its connection cap under it).
    "RLIMIT_NOFILE",
    // candle's ops (the "candle notes").
    "softmax_last_dim",
    "rms_norm",
    "scatter_add",
    "index_add",
    "arg_sort_last_dim",
    "rope_slow",
    "rms_norm_slow",
    "index_select",
    "log_softmax",
    // The CUDA toolkit's root, which scripts/cuda/build.sh honours.
    "CUDA_HOME",
];

/// Spans that look like code names but are not: math symbols and plain words.
const NOT_CODE: &[&str] = &["I_infer", "g_i", "MoE"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file below `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The identifier `s` starts with, if any.
fn leading_ident(s: &str) -> Option<&str> {
    let first = s.chars().next()?;
    if !is_ident_start(first) {
        return None;
    }
    let end = s.find(|c: char| !is_ident_char(c)).unwrap_or(s.len());
    Some(&s[..end])
}

/// What the sources declare: `fn` names apart, every declared name, the members of each
/// type (methods of its `impl` blocks, variants, fields, trait items) and the snake_case
/// words of string literals (serde names, config keys, tensor names).
struct Declared {
    fns: HashSet<String>,
    names: HashSet<String>,
    members: HashMap<String, HashSet<String>>,
    strings: HashSet<String>,
    files: Vec<PathBuf>,
}

/// The type an item line opens a block for: `impl X`, `impl<T> Tr for X<T>`, `enum X`,
/// `struct X {`, `trait X`.
fn block_owner(line: &str) -> Option<String> {
    let t = line.trim_start();
    let t = t
        .strip_prefix("pub(crate) ")
        .or_else(|| t.strip_prefix("pub "))
        .unwrap_or(t);
    let (kind, rest) = t.split_once(' ')?;
    let kind = kind.split('<').next()?;
    if !matches!(kind, "impl" | "enum" | "struct" | "trait") {
        return None;
    }
    let mut rest = rest;
    if kind == "impl" {
        if t.starts_with("impl<") {
            // Skip the generic parameters of `impl<…>`.
            let close = t.find("> ")?;
            rest = &t[close + 2..];
        }
        if let Some((_, self_ty)) = rest.split_once(" for ") {
            rest = self_ty;
        }
    }
    let name = leading_ident(rest.trim_start())?;
    Some(name.to_string())
}

fn declared(files: Vec<PathBuf>) -> Declared {
    const KEYWORDS: &[&str] = &[
        "fn", "struct", "enum", "trait", "type", "const", "static", "mod", "union",
    ];
    let mut fns = HashSet::new();
    let mut names = HashSet::new();
    let mut members: HashMap<String, HashSet<String>> = HashMap::new();
    let mut strings = HashSet::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("a readable source file");
        // The open item blocks: (owner, brace depth inside its block).
        let mut open: Vec<(String, i64)> = Vec::new();
        let mut depth = 0i64;
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or_default();
            for (k, piece) in code.split('"').enumerate() {
                if k % 2 == 1 {
                    let words = piece.split(|c: char| !is_ident_char(c));
                    strings.extend(words.filter(|w| w.contains('_')).map(str::to_string));
                }
            }
            let owner = block_owner(code);
            // A member: a declared name one level inside an item block.
            if let Some((name, inner)) = open.last() {
                if depth == *inner {
                    let mut rest = code.trim_start();
                    for prefix in [
                        "pub(crate) ",
                        "pub(super) ",
                        "pub ",
                        "async ",
                        "const ",
                        "unsafe ",
                    ] {
                        rest = rest.strip_prefix(prefix).unwrap_or(rest);
                    }
                    let rest = rest
                        .strip_prefix("fn ")
                        .or_else(|| rest.strip_prefix("type "))
                        .unwrap_or(rest);
                    if let Some(id) = leading_ident(rest) {
                        members
                            .entry(name.clone())
                            .or_default()
                            .insert(id.to_string());
                    }
                }
            }
            for c in code.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        if let Some(name) = &owner {
                            if open.last().is_none_or(|(_, d)| *d < depth) {
                                open.push((name.clone(), depth));
                            }
                        }
                    }
                    '}' => {
                        if open.last().is_some_and(|(_, d)| *d == depth) {
                            open.pop();
                        }
                        depth -= 1;
                    }
                    _ => {}
                }
            }
            let words: Vec<&str> = line
                .split(|c: char| !is_ident_char(c))
                .filter(|w| !w.is_empty())
                .collect();
            for pair in words.windows(2) {
                if KEYWORDS.contains(&pair[0]) {
                    names.insert(pair[1].to_string());
                    if pair[0] == "fn" {
                        fns.insert(pair[1].to_string());
                    }
                }
            }
            // A variant or a field: `Name(`, `Name {`, `Name,`, `name:`, `Name = 3`.
            let mut rest = line.trim_start();
            for prefix in ["pub(crate) ", "pub(super) ", "pub "] {
                rest = rest.strip_prefix(prefix).unwrap_or(rest);
            }
            if let Some(id) = leading_ident(rest) {
                let after = rest[id.len()..].trim_start();
                if after.starts_with(['(', '{', ',', ':', '=']) && !after.starts_with("::") {
                    names.insert(id.to_string());
                }
            }
        }
    }
    Declared {
        fns,
        names,
        members,
        strings,
        files,
    }
}

/// A code name cited by the page: its path segments and whether it is called.
#[derive(Debug)]
struct Cited {
    segments: Vec<String>,
    called: bool,
    text: String,
}

fn is_camel(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_uppercase()) && s.chars().any(|c| c.is_ascii_lowercase())
}

/// The code name `s` starts with, if it is one (see the module doc), and the bytes it spans.
fn code_name(s: &str) -> Option<(Vec<Cited>, usize)> {
    let mut segments = Vec::new();
    let mut at = 0;
    loop {
        let id = leading_ident(&s[at..])?;
        segments.push(id.to_string());
        at += id.len();
        if s[at..].starts_with("::") && s[at + 2..].starts_with(is_ident_start) {
            at += 2;
            continue;
        }
        break;
    }
    let mut cited = Vec::new();
    // `Path::{A, B}`: each member is cited with the path.
    if let Some(group) = s[at..].strip_prefix("::{") {
        let end = group.find('}')?;
        for member in group[..end].split(',') {
            let member = member.trim();
            if leading_ident(member).is_some_and(|m| m.len() == member.len()) {
                let mut path = segments.clone();
                path.push(member.to_string());
                cited.push(Cited {
                    segments: path,
                    called: false,
                    text: s[..at + 3 + end + 1].to_string(),
                });
            }
        }
        return Some((cited, at + 3 + end + 1));
    }
    let called = s[at..].starts_with('(');
    let last = segments.last().expect("at least one segment");
    let snake = last.contains('_') && !s[at..].starts_with('.');
    if segments.len() < 2 && !called && !is_camel(last) && !snake {
        return None;
    }
    cited.push(Cited {
        segments,
        called,
        text: s[..at].to_string(),
    });
    Some((cited, at))
}

/// The code names and file names of `docs/design.md`.
fn citations(page: &str) -> (Vec<Cited>, Vec<String>) {
    let mut names = Vec::new();
    let mut files = Vec::new();
    let mut fenced = false;
    for line in page.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            let mut i = 0;
            while i < line.len() {
                let rest = &line[i..];
                let boundary =
                    i == 0 || !line[..i].ends_with(|c: char| is_ident_char(c) || c == '.');
                if boundary && rest.starts_with(is_ident_start) {
                    if let Some((cited, len)) = code_name(rest) {
                        names.extend(cited);
                        i += len;
                        continue;
                    }
                    i += leading_ident(rest).map_or(1, str::len);
                    continue;
                }
                i += rest.chars().next().map_or(1, char::len_utf8);
            }
            continue;
        }
        for (k, span) in line.split('`').enumerate() {
            if k % 2 == 0 {
                continue;
            }
            if span.ends_with(".rs") || span.ends_with(".rs/") {
                files.push(span.to_string());
            } else if let Some((cited, _)) = code_name(span) {
                names.extend(cited);
            }
        }
    }
    (names, files)
}

#[test]
fn every_code_name_in_the_design_page_exists() {
    let root = repo_root();
    let page = std::fs::read_to_string(root.join("docs/design.md")).expect("docs/design.md");
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    assert!(files.len() > 50, "found only {} sources", files.len());
    let crates: HashSet<String> = std::fs::read_dir(root.join("crates"))
        .expect("crates/")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().replace('-', "_"))
        .collect();
    let decl = declared(files);
    let (names, file_names) = citations(&page);
    assert!(names.len() > 50, "found only {} code names", names.len());
    let mut stale = Vec::new();
    for cited in &names {
        let first = &cited.segments[0];
        let foreign_crate = cited.segments.len() > 1
            && first.starts_with(|c: char| c.is_ascii_lowercase())
            && !crates.contains(first)
            && !decl.names.contains(first);
        let text = cited.text.as_str();
        if foreign_crate || OTHER_PROJECTS.contains(&text) || NOT_CODE.contains(&text) {
            continue;
        }
        let last = cited.segments.len() - 1;
        for (k, seg) in cited.segments.iter().enumerate() {
            if crates.contains(seg) || matches!(seg.as_str(), "crate" | "self" | "super") {
                continue;
            }
            // `Type::member`: a member of that type where the sources give it members.
            let owner = (k > 0)
                .then(|| decl.members.get(&cited.segments[k - 1]))
                .flatten();
            let lower_call = k == last && cited.called && !is_camel(seg);
            let found = if let Some(members) = owner {
                members.contains(seg)
            } else if lower_call {
                decl.fns.contains(seg)
            } else {
                decl.names.contains(seg) || (seg.contains('_') && decl.strings.contains(seg))
            };
            if !found {
                match owner {
                    Some(_) => {
                        stale.push(format!("`{text}`: {} has no {seg}", cited.segments[k - 1]))
                    }
                    None => stale.push(format!("`{text}`: no {seg}")),
                }
            }
        }
    }
    for name in &file_names {
        let name = name.trim_end_matches('/');
        if name.contains('*') {
            continue;
        }
        let known = decl.files.iter().any(|f| {
            let f = f.to_string_lossy();
            f.ends_with(&format!("/{name}"))
        });
        if !known {
            stale.push(format!("`{name}`: no such file under crates/"));
        }
    }
    stale.dedup();
    assert!(
        stale.is_empty(),
        "docs/design.md cites {} names the sources do not have:\n{}",
        stale.len(),
        stale.join("\n")
    );
}

#[test]
fn the_scanner_finds_paths_calls_and_types() {
    let (names, files) = citations(
        "a `Foo::bar` b `baz(x) → y` c `Quux` d `rollout.backend` e `Routing::{A, B}` f `x.rs`\n\
         ```\nTrainer::step (a.rs)\n  mix_seed(s) then Engine\n```\n",
    );
    let texts: Vec<String> = names
        .iter()
        .map(|c| {
            format!(
                "{}{}",
                c.segments.join("::"),
                if c.called { "()" } else { "" }
            )
        })
        .collect();
    assert_eq!(
        texts,
        [
            "Foo::bar",
            "baz()",
            "Quux",
            "Routing::A",
            "Routing::B",
            "Trainer::step",
            "mix_seed()",
            "Engine"
        ]
    );
    assert_eq!(files, ["x.rs"]);
}
