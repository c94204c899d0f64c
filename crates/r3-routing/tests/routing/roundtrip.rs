//! Encode → decode round trips for every wire format, dtype and NPY version.

use proptest::prelude::*;
use r3_routing::wire::{binary, npy, sglang, vllm, vllm_json, WireDtype, WireShape};
use r3_routing::{LayerLayout, RouteTable};

use crate::common::{all_layers_table, layout_of, moe_table, spec_strategy, Spec};

fn shape_with_layout(spec: &Spec) -> WireShape {
    WireShape::new(spec.num_layers, spec.top_k, spec.num_experts)
        .with_start_len(spec.start_pos)
        .with_layout(layout_of(spec))
        .unwrap()
}

fn fits(dtype: WireDtype, spec: &Spec) -> bool {
    dtype.max_id() >= spec.num_experts as i64 - 1
}

fn with_versions(mut t: RouteTable, seed: u64) -> RouteTable {
    let n = t.num_tokens();
    t.set_versions((0..n as u64).map(|i| (i + seed) % 3).collect())
        .unwrap();
    t
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn canonical_json_round_trip(spec in spec_strategy(40), versions in any::<bool>()) {
        let mut t = moe_table(&spec);
        if versions { t = with_versions(t, spec.seed); }
        let back = RouteTable::from_json_str(&t.to_json_string()).unwrap();
        prop_assert_eq!(&back, &t);
        let all = t.to_all_layers(&layout_of(&spec)).unwrap();
        prop_assert_eq!(RouteTable::from_json(&all.to_json()).unwrap(), all);
    }

    #[test]
    fn binary_round_trip(spec in spec_strategy(40), versions in any::<bool>()) {
        let mut t = moe_table(&spec);
        if versions { t = with_versions(t, spec.seed); }
        prop_assert_eq!(binary::decode_binary(&binary::encode_binary(&t)).unwrap(), t);
    }

    /// Dense columns are written as zeros and checked/dropped on decode with the layout.
    #[test]
    fn sglang_round_trip_with_layout(spec in spec_strategy(0)) {
        let t = moe_table(&spec);
        let shape = shape_with_layout(&spec);
        for dtype in sglang::SGLANG_DTYPES {
            if !fits(dtype, &spec) { continue; }
            let b64 = sglang::encode_sglang(&t, dtype, spec.num_layers, Some(&layout_of(&spec))).unwrap();
            prop_assert_eq!(&sglang::decode_sglang(&b64, dtype, &shape).unwrap(), &t);
        }
    }

    /// Missing cells survive as -1 in int32; the response form checks the token counts.
    #[test]
    fn sglang_int32_missing_and_meta(spec in spec_strategy(40)) {
        let t = moe_table(&spec);
        let layout = layout_of(&spec);
        let meta = sglang::encode_sglang_meta(&t, WireDtype::I32, spec.num_layers, Some(&layout), spec.start_pos).unwrap();
        let back = sglang::decode_sglang_response(&meta, &shape_with_layout(&spec)).unwrap();
        prop_assert_eq!(back, t);
    }

    /// Without a layout the table stays in all-layers space; top-1 is refused (a zero
    /// filler cannot be told from expert 0 without the layout).
    #[test]
    fn sglang_round_trip_all_layers(spec in spec_strategy(0)) {
        let t = all_layers_table(&spec);
        let shape = WireShape::new(spec.num_layers, spec.top_k, spec.num_experts).with_start_len(spec.start_pos);
        for dtype in sglang::SGLANG_DTYPES {
            if !fits(dtype, &spec) { continue; }
            let b64 = sglang::encode_sglang(&t, dtype, spec.num_layers, None).unwrap();
            let decoded = sglang::decode_sglang(&b64, dtype, &shape);
            if spec.top_k == 1 {
                let refused = matches!(&decoded, Err(r3_routing::RouteError::Layout(m)) if m.contains("top_k = 1"));
                prop_assert!(refused, "{:?}", decoded);
                continue;
            }
            let back = decoded.unwrap();
            prop_assert_eq!(back.space(), r3_routing::LayerSpace::AllLayers);
            prop_assert_eq!(&back, &t);
        }
    }

    #[test]
    fn vllm_npy_round_trip(spec in spec_strategy(0), version in 1u8..=3) {
        let t = moe_table(&spec);
        let shape = shape_with_layout(&spec);
        for dtype in WireDtype::ALL {
            if !fits(dtype, &spec) { continue; }
            let b64 = vllm::encode_vllm(&t, dtype, version, spec.num_layers, Some(&layout_of(&spec))).unwrap();
            prop_assert_eq!(&vllm::decode_vllm(&b64, &shape).unwrap(), &t);
            let quoted = format!("{{\"routed_experts\": \"{b64}\"}}");
            prop_assert_eq!(&vllm::decode_vllm_payload(&quoted, &shape).unwrap(), &t);
        }
    }

    #[test]
    fn vllm_npy_signed_keeps_missing(spec in spec_strategy(50), version in 1u8..=3) {
        let t = moe_table(&spec);
        for dtype in [WireDtype::I16, WireDtype::I32] {
            if !fits(dtype, &spec) { continue; }
            let b64 = vllm::encode_vllm(&t, dtype, version, spec.num_layers, Some(&layout_of(&spec))).unwrap();
            prop_assert_eq!(&vllm::decode_vllm(&b64, &shape_with_layout(&spec)).unwrap(), &t);
        }
    }

    #[test]
    fn vllm_json_round_trip(spec in spec_strategy(40), split in 0usize..=12) {
        let t = moe_table(&spec);
        let prompt_rows = split.min(t.num_tokens());
        let v = vllm_json::encode_vllm_json(&t, prompt_rows, spec.num_layers, Some(&layout_of(&spec))).unwrap();
        let tables = vllm_json::decode_vllm_json(&v, &shape_with_layout(&spec)).unwrap();
        prop_assert_eq!(tables.len(), 1);
        prop_assert_eq!(&tables[0], &t);
    }

    /// MoE-only → all-layers → MoE-only is the identity.
    #[test]
    fn space_round_trip(spec in spec_strategy(40)) {
        let t = moe_table(&spec);
        let layout = layout_of(&spec);
        let all = t.to_all_layers(&layout).unwrap();
        prop_assert_eq!(all.num_columns(), spec.num_layers);
        prop_assert_eq!(all.to_moe_only(&layout).unwrap(), t);
    }
}

#[test]
fn npy_header_versions_are_parsed() {
    let data: Vec<u8> = (0..24u8).collect();
    for v in 1..=3 {
        let bytes = npy::write_npy(WireDtype::U8, &[2, 3, 4], &data, v).unwrap();
        assert_eq!(bytes[6], v);
        // The header block is padded to a multiple of 64 bytes, as numpy does.
        assert_eq!((bytes.len() - data.len()) % 64, 0);
        let arr = npy::parse_npy(&bytes).unwrap();
        assert_eq!(
            (arr.version, arr.shape.clone(), arr.data),
            (v, vec![2, 3, 4], &data[..])
        );
    }
}

/// An NPY v1 file assembled by hand from the NPY spec (not by our writer) for
/// `[[[1, 2]], [[3, 0]]]` as `<i4`, so the reader is checked against an independent layout.
#[test]
fn npy_numpy_style_header() {
    let header = "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 1, 2), }";
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    let pad = 64 - (10 + header.len() + 1) % 64;
    let full = format!("{header}{}\n", " ".repeat(pad));
    bytes.extend_from_slice(&(full.len() as u16).to_le_bytes());
    bytes.extend_from_slice(full.as_bytes());
    for v in [1i32, 2, 3, 0] {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    let shape = WireShape::new(1, 2, 4);
    let t = vllm::decode_npy_routes(&bytes, &shape).unwrap();
    assert_eq!(t.num_tokens(), 2);
    assert_eq!(t.experts(0, 0), Some(vec![1, 2]));
    assert_eq!(t.experts(1, 0), Some(vec![3, 0]));
}

/// A SGLang payload assembled by hand: 2 rows x 2 layers x top-2, layer 0 dense (zeros).
#[test]
fn sglang_hand_payload_first_k_dense() {
    let vals: [i32; 8] = [0, 0, 5, 1, 0, 0, 2, 7];
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
    let shape = WireShape::new(2, 2, 8)
        .with_start_len(3)
        .with_layout(LayerLayout::first_k_dense(2, 1).unwrap())
        .unwrap();
    let t = sglang::decode_sglang(&b64, WireDtype::I32, &shape).unwrap();
    assert_eq!(t.layers(), &[1]);
    assert_eq!(t.start_pos(), 3);
    assert_eq!(t.experts(0, 0), Some(vec![5, 1]));
    assert_eq!(t.experts(1, 0), Some(vec![2, 7]));
}
