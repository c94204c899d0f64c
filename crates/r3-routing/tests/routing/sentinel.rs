//! Only -1 means "not captured": other negative ids are errors naming token, layer and value,
//! in every decoder; a table needs at least one column, so a header that declares zero columns
//! and a huge token count is refused before anything is allocated.

use base64::Engine as _;
use r3_routing::wire::{binary, sglang, vllm_json, WireDtype, WireShape};
use r3_routing::{LayerSpace, RouteError, RouteTable};
use serde_json::json;

fn sglang_b64(values: &[i32]) -> String {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[test]
fn sglang_negative_garbage_is_an_error_naming_the_cell() {
    // 2 rows, 2 layers, top-2, rows start at position 5.
    let shape = WireShape::new(2, 2, 8).with_start_len(5);
    for bad in [[-5, -5], [-2, -3], [-1, -2]] {
        let values = [1, 2, 3, 4, 5, 6, bad[0], bad[1]];
        let err = sglang::decode_sglang(&sglang_b64(&values), WireDtype::I32, &shape)
            .expect_err("negative garbage");
        match err {
            RouteError::NegativeId {
                token,
                layer,
                value,
            } => {
                assert_eq!((token, layer), (6, 1), "{bad:?}");
                assert!(
                    value < -1 && bad.contains(&(value as i32)),
                    "{bad:?}: {value}"
                );
            }
            other => panic!("{bad:?}: expected NegativeId, got {other:?}"),
        }
    }
    // The sentinel itself still decodes as missing.
    let values = [1, 2, 3, 4, 5, 6, -1, -1];
    let t = sglang::decode_sglang(&sglang_b64(&values), WireDtype::I32, &shape).expect("-1");
    assert!(!t.is_present(1, 1) && t.is_present(1, 0));
}

#[test]
fn vllm_json_negative_garbage_is_an_error() {
    let shape = WireShape::new(1, 2, 8);
    let v = json!({"prompt_routed_experts": [[[1, 2]], [[-2, -3]]], "choices": []});
    let err = vllm_json::decode_vllm_json(&v, &shape).expect_err("negative garbage");
    assert!(
        matches!(err, RouteError::NegativeId { value: -2, .. }),
        "{err:?}"
    );
}

#[test]
fn zero_column_tables_are_refused() {
    let err =
        RouteTable::missing(8, 2, LayerSpace::MoeOnly, Vec::new(), 0, 4).expect_err("no columns");
    assert!(err.to_string().contains("at least one column"), "{err}");
    let canonical = json!({"format": "r3-routes", "version": 1, "num_experts": 8, "top_k": 2,
        "layer_space": "moe_only", "layers": [], "start_pos": 0, "num_tokens": 1,
        "routes": [[]]});
    let err = RouteTable::from_json(&canonical).expect_err("no columns");
    assert!(err.to_string().contains("at least one column"), "{err}");
}

#[test]
fn binary_header_with_zero_columns_and_huge_token_count_is_refused() {
    // magic, version 1, width 1, space moe_only, flags 0, 8 experts, top-2, 0 columns,
    // start_pos 0, num_tokens 2^40: 36 bytes that used to abort on allocation.
    let mut bytes = b"R3RT".to_vec();
    bytes.extend_from_slice(&[1, 1, 1, 0]);
    bytes.extend_from_slice(&8u32.to_le_bytes());
    bytes.extend_from_slice(&2u32.to_le_bytes());
    bytes.extend_from_slice(&0u32.to_le_bytes());
    bytes.extend_from_slice(&0u64.to_le_bytes());
    bytes.extend_from_slice(&(1u64 << 40).to_le_bytes());
    assert_eq!(bytes.len(), 36);
    let err = binary::decode_binary(&bytes).expect_err("zero columns");
    assert!(err.to_string().contains("at least one column"), "{err}");
}
