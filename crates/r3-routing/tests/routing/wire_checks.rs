//! What the wire decoders refuse rather than guess: a top-1 payload without the layer layout
//! (its zero filler would read as expert 0), a vLLM choice without its routes, SGLang token
//! counts that are not both integers, and a layout with no MoE column to keep.

use base64::Engine as _;
use r3_routing::wire::{sglang, vllm_json, WireDtype, WireShape};
use r3_routing::{LayerLayout, LayerSpace, RouteError, RouteTable};
use serde_json::json;

fn sglang_b64(values: &[i32]) -> String {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn refused_for_top1(r: Result<impl std::fmt::Debug, RouteError>) {
    match r {
        Err(RouteError::Layout(m)) => assert!(m.contains("top_k = 1"), "{m}"),
        other => panic!("expected the top-1 refusal, got {other:?}"),
    }
}

/// Rows of 2 layers, top-1, as SGLang writes them for a model whose layer 0 is dense:
/// layer 0 holds the zero filler, layer 1 the routes (expert 0, then expert 3).
#[test]
fn top1_needs_the_layout_and_reads_expert_0_in_moe_columns() {
    let b64 = sglang_b64(&[0, 0, 0, 3]);
    let bare = WireShape::new(2, 1, 4);
    refused_for_top1(sglang::decode_sglang(&b64, WireDtype::I32, &bare));
    let v = json!({"prompt_routed_experts": [[[0], [0]], [[0], [3]]]});
    refused_for_top1(vllm_json::decode_vllm_json(&v, &bare));
    let shape = bare
        .with_layout(LayerLayout::first_k_dense(2, 1).expect("layout"))
        .expect("shape");
    let t = sglang::decode_sglang(&b64, WireDtype::I32, &shape).expect("with the layout");
    assert_eq!((t.space(), t.layers()), (LayerSpace::MoeOnly, &[1][..]));
    assert_eq!(t.experts(0, 0), Some(vec![0]), "a real expert 0 is kept");
    assert_eq!(t.experts(1, 0), Some(vec![3]));
    // A dense column that carries an id is still refused.
    let err = sglang::decode_sglang(&sglang_b64(&[2, 0, 0, 3]), WireDtype::I32, &shape)
        .expect_err("dense column with an id");
    assert!(
        matches!(err, RouteError::DenseColumnNotEmpty { value: 2, .. }),
        "{err:?}"
    );
}

#[test]
fn a_vllm_choice_without_routes_is_an_error() {
    let shape = WireShape::new(1, 2, 8);
    let prompt = json!([[[1, 2]], [[3, 4]]]);
    for choice in [json!({"text": "x"}), json!({"routed_experts": null})] {
        let v = json!({"prompt_routed_experts": prompt, "choices": [{"routed_experts": [[[5, 6]]]}, choice]});
        let err = vllm_json::decode_vllm_json(&v, &shape).expect_err("choice 1 has no routes");
        assert!(
            err.to_string().contains("choices[1].routed_experts"),
            "{err}"
        );
    }
    let top_level = json!({"prompt_routed_experts": prompt, "routed_experts": null});
    let err = vllm_json::decode_vllm_json(&top_level, &shape).expect_err("null routes");
    assert!(err.to_string().contains("routed_experts"), "{err}");
    // An empty list is a choice without rows of its own.
    let v = json!({"prompt_routed_experts": prompt, "choices": [{"routed_experts": []}]});
    let tables = vllm_json::decode_vllm_json(&v, &shape).expect("empty list");
    assert_eq!(tables[0].num_tokens(), 2);
}

#[test]
fn sglang_token_counts_must_be_both_integers_or_both_absent() {
    let shape = WireShape::new(1, 2, 8);
    // 2 rows: 2 prompt tokens + 1 completion token - 1.
    let b64 = sglang_b64(&[1, 2, 3, 4]);
    let meta = |p: serde_json::Value, c: serde_json::Value| {
        let mut m = json!({"routed_experts": b64});
        if !p.is_null() {
            m["prompt_tokens"] = p;
        }
        if !c.is_null() {
            m["completion_tokens"] = c;
        }
        json!({ "meta_info": m })
    };
    let ok = sglang::decode_sglang_response(&meta(json!(2), json!(1)), &shape).expect("counts");
    assert_eq!(ok.num_tokens(), 2);
    sglang::decode_sglang_response(&meta(json!(null), json!(null)), &shape).expect("no counts");
    for (v, field) in [
        (meta(json!("2"), json!(1)), "prompt_tokens"),
        (meta(json!(2), json!(1.5)), "completion_tokens"),
        (meta(json!(-2), json!(1)), "prompt_tokens"),
        (meta(json!(null), json!(1)), "prompt_tokens"),
        (meta(json!(2), json!(null)), "completion_tokens"),
    ] {
        let err = sglang::decode_sglang_response(&v, &shape).expect_err(field);
        assert!(err.to_string().contains(field), "{v}: {err}");
    }
}

#[test]
fn a_layout_without_moe_layers_has_no_moe_only_table() {
    // One row of two dense layers, nothing captured.
    let t = RouteTable::missing(8, 2, LayerSpace::AllLayers, vec![0, 1], 0, 1).expect("table");
    let dense = LayerLayout::new(2, Vec::new()).expect("layout");
    let err = t.to_moe_only(&dense).expect_err("no MoE layer");
    assert!(err.to_string().contains("no MoE layer"), "{err}");
}
