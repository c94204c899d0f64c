//! End-to-end checks of `r3 routes ...`: stdin payloads decode to canonical JSON, bad input
//! exits non-zero with a single `error:` line naming the problem.

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn r3(args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_r3"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn r3");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin)
        .expect("write stdin");
    child.wait_with_output().expect("wait r3")
}

/// Base64 of little-endian int32 values, written out by hand (RFC 4648 alphabet).
fn b64_i32(vals: &[i32]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

const SHAPE: [&str; 8] = [
    "--num-layers",
    "2",
    "--top-k",
    "2",
    "--num-experts",
    "8",
    "--first-k-dense",
    "1",
];

fn decode_sglang(extra: &[&str], stdin: &str) -> Output {
    let mut args = vec!["routes", "decode", "--format", "sglang"];
    args.extend_from_slice(&SHAPE);
    args.extend_from_slice(extra);
    r3(&args, stdin.as_bytes())
}

#[test]
fn sglang_bare_and_meta_info_decode_to_the_same_table() {
    // 2 rows x 2 layers x top-2; layer 0 dense (zeros).
    let b64 = b64_i32(&[0, 0, 5, 1, 0, 0, 2, 7]);
    let bare = decode_sglang(&["--start-len", "3"], &format!("{b64}\n"));
    assert!(
        bare.status.success(),
        "{}",
        String::from_utf8_lossy(&bare.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&bare.stdout).unwrap();
    assert_eq!(v["layers"], serde_json::json!([1]));
    assert_eq!(v["start_pos"], 3);
    assert_eq!(v["routes"], serde_json::json!([[[5, 1]], [[2, 7]]]));
    let meta = format!(
        r#"{{"meta_info": {{"routed_experts": "{b64}", "routed_experts_dtype": "int32",
            "prompt_tokens": 4, "completion_tokens": 2}}}}"#
    );
    let out = decode_sglang(&["--start-len", "3"], &meta);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, bare.stdout);
}

fn assert_one_line_error(out: &Output, needle: &str) {
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(needle),
        "{err}"
    );
}

#[test]
fn bad_payloads_fail_with_one_line() {
    let nonzero_dense = b64_i32(&[3, 0, 5, 1]);
    assert_one_line_error(
        &decode_sglang(&[], &nonzero_dense),
        "layer 0 is a dense layer",
    );
    let out_of_range = b64_i32(&[0, 0, 5, 9]);
    assert_one_line_error(
        &decode_sglang(&[], &out_of_range),
        "expert id 9 out of range",
    );
    let short = b64_i32(&[0, 0, 5]);
    assert_one_line_error(&decode_sglang(&[], &short), "not a whole number of rows");
    assert_one_line_error(&decode_sglang(&[], "%%%"), "invalid base64");
    let counts = format!(
        r#"{{"meta_info": {{"routed_experts": "{}", "prompt_tokens": 4, "completion_tokens": 4}}}}"#,
        b64_i32(&[0, 0, 5, 1])
    );
    assert_one_line_error(&decode_sglang(&[], &counts), "expected 7, got 1");
}

/// `r3 routes encode --format format` of the r3-routes JSON `table` (2 layers, the first
/// dense), as text.
fn encode(format: &str, table: &str) -> String {
    let out = r3(
        &[
            "routes",
            "encode",
            "--format",
            format,
            "--num-layers",
            "2",
            "--first-k-dense",
            "1",
        ],
        table.as_bytes(),
    );
    assert!(
        out.status.success(),
        "{format}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn encode_then_decode_round_trips_and_diff_is_zero() {
    let table = r#"{"format":"r3-routes","version":1,"num_experts":8,"top_k":2,"layer_space":"moe_only",
        "layers":[1],"start_pos":0,"num_tokens":2,"routes":[[[5,1]],[[2,7]]]}"#;
    for format in ["sglang", "vllm", "vllm-json"] {
        let enc = encode(format, table);
        let mut args = vec!["routes", "decode", "--format", format];
        args.extend_from_slice(&SHAPE);
        let dec = r3(&args, enc.as_bytes());
        assert!(
            dec.status.success(),
            "{format}: {}",
            String::from_utf8_lossy(&dec.stderr)
        );
        let a: serde_json::Value = serde_json::from_slice(&dec.stdout).unwrap();
        let b: serde_json::Value = serde_json::from_str(table).unwrap();
        assert_eq!(a, b, "{format}");
    }
    let dir = std::env::temp_dir().join(format!("r3-routes-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("a.json");
    std::fs::write(&path, table).unwrap();
    let p = path.to_str().unwrap();
    let diff = r3(&["routes", "diff", p, p], b"");
    assert!(diff.status.success());
    let d: serde_json::Value = serde_json::from_slice(&diff.stdout).unwrap();
    assert_eq!(d["router_diff_fraction"], 0.0);
    assert_eq!(d["compared_routers"], 2);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_huge_layer_count_is_refused_before_allocating() {
    // 2^40 layers with an empty payload (and with a layout of 2^40 layers): refused by the
    // routing limits instead of allocating 2^40 columns.
    for extra in [&[][..], &["--first-k-dense", "1"][..]] {
        let mut args = vec![
            "routes",
            "decode",
            "--format",
            "sglang",
            "--num-layers",
            "1099511627776",
            "--top-k",
            "2",
            "--num-experts",
            "8",
        ];
        args.extend_from_slice(extra);
        let out = r3(&args, b"");
        assert_one_line_error(&out, "= 1099511627776 exceeds the limit of 4096");
    }
}

/// A MoE-only table whose layers are exactly `0..num_layers` says every layer is MoE: it
/// is written without `--first-k-dense` / `--moe-layers`, to the same bytes as with
/// `--first-k-dense 0` and to the values written out by hand. A table missing a layer of
/// `--num-layers` still needs the layout.
#[test]
fn an_all_moe_table_encodes_without_a_layout() {
    let table = r#"{"format":"r3-routes","version":1,"num_experts":8,"top_k":2,"layer_space":"moe_only",
        "layers":[0,1],"start_pos":0,"num_tokens":2,"routes":[[[5,1],[6,0]],[[2,7],[3,4]]]}"#;
    let encode = |extra: &[&str]| {
        let mut args = vec!["routes", "encode", "--format", "sglang", "--num-layers"];
        args.extend_from_slice(extra);
        r3(&args, table.as_bytes())
    };
    let bare = encode(&["2"]);
    assert!(
        bare.status.success(),
        "{}",
        String::from_utf8_lossy(&bare.stderr)
    );
    let want = b64_i32(&[5, 1, 6, 0, 2, 7, 3, 4]);
    assert_eq!(String::from_utf8_lossy(&bare.stdout).trim(), want);
    let explicit = encode(&["2", "--first-k-dense", "0"]);
    assert_eq!(bare.stdout, explicit.stdout);
    // Layer 2 of 3 is not in the table: dense or an uncaptured MoE layer, the table cannot say.
    assert_one_line_error(&encode(&["3"]), "needs the layer layout");
}

/// A vLLM response of several choices holds one route table per choice: `decode` without
/// `--choice` refuses it (it is not one sequence) in both vLLM formats, and `--choice N`
/// prints choice N; `--choice` on a one-table format is refused.
#[test]
fn decode_of_several_vllm_choices_needs_the_choice() {
    let table = |a: u8, b: u8| {
        format!(
            r#"{{"format":"r3-routes","version":1,"num_experts":8,"top_k":2,"layer_space":"moe_only",
            "layers":[1],"start_pos":0,"num_tokens":1,"routes":[[[{a},{b}]]]}}"#
        )
    };
    let (first, second) = (table(5, 1), table(2, 7));
    let b64 = |t: &str| {
        let enc = encode("vllm", t);
        let enc = enc.trim();
        let v: serde_json::Value = serde_json::from_str(enc)
            .unwrap_or_else(|_| serde_json::Value::String(enc.to_string()));
        v.as_str().map(str::to_string).unwrap_or_else(|| {
            v["routed_experts"]
                .as_str()
                .expect("routed_experts")
                .to_string()
        })
    };
    let vllm = serde_json::json!({"choices": [
        {"routed_experts": b64(&first)}, {"routed_experts": b64(&second)}
    ]})
    .to_string();
    let nested = |t: &str| -> serde_json::Value {
        serde_json::from_str(&encode("vllm-json", t)).expect("vllm-json")
    };
    let (a, b) = (nested(&first), nested(&second));
    let mut vllm_json = a.clone();
    vllm_json["choices"] = serde_json::json!([a["choices"][0], b["choices"][0]]);
    let vllm_json = vllm_json.to_string();
    for (format, payload) in [("vllm", &vllm), ("vllm-json", &vllm_json)] {
        let mut args = vec!["routes", "decode", "--format", format];
        args.extend_from_slice(&SHAPE);
        assert_one_line_error(&r3(&args, payload.as_bytes()), "choice");
        args.extend_from_slice(&["--choice", "1"]);
        let out = r3(&args, payload.as_bytes());
        assert!(
            out.status.success(),
            "{format}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        let want: serde_json::Value = serde_json::from_str(&second).expect("json");
        assert_eq!(got, want, "{format}");
    }
    let mut args = vec!["routes", "decode", "--format", "sglang", "--choice", "0"];
    args.extend_from_slice(&SHAPE);
    assert_one_line_error(&r3(&args, b"AAAA"), "--choice");
}
