//! Declared sizes above `DecodeLimits`, or larger than the bytes present, are refused before
//! anything of that size is allocated. Every payload here is a few bytes that declares a huge
//! size: if a decoder allocated first, the test would abort instead of failing.

use r3_routing::wire::npy::write_npy;
use r3_routing::wire::{binary, sglang, vllm, vllm_json, WireDtype, WireShape};
use r3_routing::{
    DecodeLimits, ExpertPlacement, LayerLayout, LayerSpace, LayoutRules, RouteError, RouteTable,
};
use serde_json::json;

const HUGE: usize = 1 << 40;

/// An r3-bin header (8 experts, top-2, moe_only, no versions) followed by `tail`.
fn r3_bin(columns: u32, num_tokens: u64, tail: &[u8]) -> Vec<u8> {
    let mut bytes = b"R3RT".to_vec();
    bytes.extend_from_slice(&[1, 1, 1, 0]);
    bytes.extend_from_slice(&8u32.to_le_bytes());
    bytes.extend_from_slice(&2u32.to_le_bytes());
    bytes.extend_from_slice(&columns.to_le_bytes());
    bytes.extend_from_slice(&0u64.to_le_bytes());
    bytes.extend_from_slice(&num_tokens.to_le_bytes());
    bytes.extend_from_slice(tail);
    bytes
}

fn assert_too_large(err: RouteError, what: &str, value: usize) {
    match &err {
        RouteError::TooLarge {
            what: w, value: v, ..
        } => {
            assert!(w.contains(what), "{err}");
            assert_eq!(*v, value, "{err}");
        }
        other => panic!("expected TooLarge({what}), got {other}"),
    }
}

#[test]
fn r3_bin_huge_token_count_is_refused_by_the_limit() {
    // One column, layer 0, and 2^40 tokens: 40 bytes in all.
    let bytes = r3_bin(1, 1 << 40, &0u32.to_le_bytes());
    let err = binary::decode_binary(&bytes).expect_err("2^40 tokens");
    assert_too_large(err, "num_tokens", HUGE);
}

#[test]
fn r3_bin_token_count_disagreeing_with_the_bytes_is_refused() {
    // 2^20 tokens is within the limit, but one column of top-2 needs 2^20 bitmap bytes / 8
    // plus 2^21 id bytes; the payload carries none of them.
    let bytes = r3_bin(1, 1 << 20, &0u32.to_le_bytes());
    let err = binary::decode_binary(&bytes).expect_err("2^20 tokens without their bytes");
    let expected = 36 + 4 + (1 << 20) / 8 + 2 * (1 << 20);
    assert_eq!(
        err,
        RouteError::length(
            "r3-bin payload bytes for the declared shape",
            expected,
            bytes.len()
        )
    );
}

#[test]
fn r3_bin_huge_column_count_is_refused() {
    let bytes = r3_bin(u32::MAX, 1, &[]);
    let err = binary::decode_binary(&bytes).expect_err("2^32 columns");
    assert_too_large(err, "num_columns", u32::MAX as usize);
}

#[test]
fn layouts_refuse_huge_layer_counts() {
    let rules = LayoutRules::all_moe(1_000_000_000, 8);
    assert_too_large(
        LayerLayout::from_rules(&rules).expect_err("1e9 layers"),
        "num_hidden_layers",
        1_000_000_000,
    );
    assert_too_large(
        LayerLayout::new(HUGE, vec![0]).expect_err("2^40 layers"),
        "num_hidden_layers",
        HUGE,
    );
    assert_too_large(
        LayerLayout::first_k_dense(HUGE, 1).expect_err("2^40 layers"),
        "num_hidden_layers",
        HUGE,
    );
    assert_too_large(
        LayerLayout::from_rules(&LayoutRules::all_moe(4, HUGE)).expect_err("2^40 experts"),
        "num_experts",
        HUGE,
    );
    // The limit itself is accepted.
    let layout = LayerLayout::from_rules(&LayoutRules::all_moe(DecodeLimits::MAX_LAYERS, 8))
        .expect("MAX_LAYERS layers");
    assert_eq!(layout.num_moe_layers(), DecodeLimits::MAX_LAYERS);
}

#[test]
fn sglang_and_vllm_json_refuse_a_huge_layer_count_with_an_empty_payload() {
    let shape = WireShape::new(HUGE, 2, 8);
    let err = sglang::decode_sglang("", WireDtype::I32, &shape).expect_err("2^40 layers");
    assert_too_large(err, "num_layers", HUGE);
    let err = vllm_json::decode_vllm_json(&json!({"prompt_routed_experts": []}), &shape)
        .expect_err("2^40 layers");
    assert_too_large(err, "num_layers", HUGE);
}

#[test]
fn wire_shapes_refuse_huge_top_k_and_expert_counts() {
    let err = sglang::decode_sglang("", WireDtype::I32, &WireShape::new(2, HUGE, HUGE))
        .expect_err("2^40 experts");
    assert!(matches!(err, RouteError::Argument(_)), "{err}");
    let err = sglang::decode_sglang("", WireDtype::I32, &WireShape::new(2, 1024, 4096))
        .expect_err("top_k 1024");
    assert_too_large(err, "top_k", 1024);
}

#[test]
fn npy_declared_shape_must_match_the_data() {
    let shape = WireShape::new(2, 2, 8);
    // (2^40, 2, 2) int32 with 16 data bytes: the declared size is checked, not allocated.
    let npy = write_npy(WireDtype::I32, &[HUGE, 2, 2], &[0u8; 16], 1).expect("npy");
    let err = vllm::decode_npy_routes(&npy, &shape).expect_err("2^40 rows, 16 bytes");
    assert!(err.to_string().contains("needs"), "{err}");
    // A shape whose product overflows usize.
    let npy = write_npy(WireDtype::I32, &[HUGE, HUGE, 2], &[], 1).expect("npy");
    let err = vllm::decode_npy_routes(&npy, &shape).expect_err("overflowing shape");
    assert!(err.to_string().contains("overflows"), "{err}");
}

#[test]
fn canonical_json_refuses_huge_declared_sizes() {
    let doc = json!({"format": "r3-routes", "version": 1, "num_experts": 8, "top_k": 2,
        "layer_space": "moe_only", "layers": [0], "start_pos": 0, "num_tokens": HUGE,
        "routes": []});
    let err = RouteTable::from_json(&doc).expect_err("2^40 tokens, no rows");
    assert!(
        matches!(err, RouteError::Length { expected, got: 0, .. } if expected == HUGE),
        "{err}"
    );
    let doc = json!({"format": "r3-routes", "version": 1, "num_experts": 8, "top_k": 2,
        "layer_space": "moe_only", "layers": [HUGE], "start_pos": 0, "num_tokens": 0,
        "routes": []});
    let err = RouteTable::from_json(&doc).expect_err("layer index 2^40");
    assert_too_large(err, "column layer index", HUGE);
}

#[test]
fn tables_and_placements_refuse_huge_counts() {
    let err =
        RouteTable::missing(8, 2, LayerSpace::MoeOnly, vec![0], 0, HUGE).expect_err("2^40 rows");
    assert_too_large(err, "num_tokens", HUGE);
    let err = ExpertPlacement::new(HUGE, vec![0]).expect_err("2^40 logical experts");
    assert_too_large(err, "num_logical", HUGE);
}
