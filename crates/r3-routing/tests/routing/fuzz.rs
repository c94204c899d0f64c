//! Decoders fuzzed with proptest: arbitrary bytes and strings, and random mutations of valid
//! payloads, must give `Ok` or `Err` — never a panic (a panic fails the test).

use proptest::prelude::*;
use r3_routing::wire::{binary, npy, sglang, vllm, vllm_json, WireDtype, WireShape};
use r3_routing::{LayerLayout, RouteTable};
use serde_json::Value;

use crate::common::{moe_table, Spec};

fn shapes() -> Vec<WireShape> {
    vec![
        WireShape::new(2, 2, 8),
        WireShape::new(3, 1, 300).with_start_len(2),
        WireShape::new(3, 2, 8)
            .with_layout(LayerLayout::first_k_dense(3, 1).unwrap())
            .unwrap(),
        WireShape::new(0, 2, 8),
    ]
}

fn decode_all_bytes(bytes: &[u8]) {
    let _ = binary::decode_binary(bytes);
    let _ = npy::parse_npy(bytes);
    for shape in shapes() {
        let _ = vllm::decode_npy_routes(bytes, &shape);
    }
}

fn decode_all_text(text: &str) {
    let _ = RouteTable::from_json_str(text);
    for shape in shapes() {
        for dtype in WireDtype::ALL {
            let _ = sglang::decode_sglang(text, dtype, &shape);
        }
        let _ = vllm::decode_vllm_payload(text, &shape);
        if let Ok(v) = serde_json::from_str::<Value>(text) {
            let _ = vllm_json::decode_vllm_json(&v, &shape);
            let _ = sglang::decode_sglang_response(&v, &shape);
            let _ = RouteTable::from_json(&v);
        }
    }
}

/// Arbitrary JSON with small and extreme integers, nested a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (-3i64..300).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        "[a-z_]{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(
                prop_oneof![
                    Just("prompt_routed_experts".to_string()),
                    Just("routed_experts".to_string()),
                    Just("choices".to_string()),
                    Just("meta_info".to_string()),
                    Just("routes".to_string()),
                    Just("layers".to_string()),
                    "[a-z_]{1,8}".prop_map(String::from),
                ],
                inner,
                0..5
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn valid_payloads(seed: u64) -> Vec<Vec<u8>> {
    let spec = Spec {
        num_experts: 8,
        top_k: 2,
        num_layers: 3,
        first_k_dense: 1,
        tokens: 3,
        start_pos: 0,
        missing_pct: 20,
        seed,
    };
    let t = moe_table(&spec);
    let layout = LayerLayout::first_k_dense(3, 1).unwrap();
    let mut out = vec![binary::encode_binary(&t), t.to_json_string().into_bytes()];
    out.push(vllm::encode_npy_routes(&t, WireDtype::I32, 2, 3, Some(&layout)).unwrap());
    out.push(
        sglang::encode_sglang(&t, WireDtype::I32, 3, Some(&layout))
            .unwrap()
            .into_bytes(),
    );
    out.push(
        vllm_json::encode_vllm_json(&t, 1, 3, Some(&layout))
            .unwrap()
            .to_string()
            .into_bytes(),
    );
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        decode_all_bytes(&bytes);
        decode_all_text(&String::from_utf8_lossy(&bytes));
    }

    /// Headers with valid magic so the fuzzer gets past the first check.
    #[test]
    fn magic_prefixed_bytes(tail in prop::collection::vec(any::<u8>(), 0..128), which in 0usize..3) {
        let mut bytes = match which {
            0 => b"R3RT\x01".to_vec(),
            1 => b"\x93NUMPY\x01\x00".to_vec(),
            _ => b"\x93NUMPY\x03\x00".to_vec(),
        };
        bytes.extend_from_slice(&tail);
        decode_all_bytes(&bytes);
    }

    #[test]
    fn arbitrary_strings(s in "\\PC{0,200}") {
        decode_all_text(&s);
    }

    #[test]
    fn arbitrary_json(v in json_value()) {
        decode_all_text(&v.to_string());
    }

    #[test]
    fn mutated_valid_payloads(
        seed in any::<u64>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        for mut p in valid_payloads(seed) {
            for (at, byte) in &edits {
                let i = at.index(p.len());
                p[i] = *byte;
            }
            if truncate {
                let n = cut.index(p.len() + 1);
                p.truncate(n);
            }
            decode_all_bytes(&p);
            decode_all_text(&String::from_utf8_lossy(&p));
        }
    }
}
