//! What the wire decoders refuse rather than guess: a top-1 payload without the layer layout
//! (its zero filler would read as expert 0), a vLLM choice without its routes, SGLang token
//! counts that are not both integers, and a layout with no MoE column to keep.

use base64::Engine as _;
use r3_routing::wire::{sglang, vllm, vllm_json, WireDtype, WireShape};
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

/// A `.npy` v1 file of int32 `[rows, layers, top_k]` written by hand (NumPy's format: magic,
/// version, header length, a Python-dict header padded with spaces to a multiple of 64),
/// base64-encoded as vLLM sends it.
fn npy_b64(values: &[i32], rows: usize, layers: usize, top_k: usize) -> String {
    let dict = format!(
        "{{'descr': '<i4', 'fortran_order': False, 'shape': ({rows}, {layers}, {top_k}), }}"
    );
    let mut header = dict.into_bytes();
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(b' ');
    }
    header.push(b'\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header);
    out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    base64::engine::general_purpose::STANDARD.encode(out)
}

#[test]
fn a_vllm_response_of_several_choices_names_the_choice() {
    // 1 layer, top-2: choice 0 has 1 row [1, 2], choice 1 has 2 rows [3, 4], [5, 6].
    let shape = WireShape::new(1, 2, 8);
    let (c0, c1) = (npy_b64(&[1, 2], 1, 1, 2), npy_b64(&[3, 4, 5, 6], 2, 1, 2));
    let two = json!({"choices": [{"routed_experts": c0}, {"routed_experts": c1}]}).to_string();
    // Decoding choice 0 of an n = 2 response as "the" routes is refused, naming the count.
    let err = vllm::decode_vllm_payload(&two, &shape).expect_err("two choices");
    assert!(err.to_string().contains("holds 2 choices"), "{err}");
    let t1 = vllm::decode_vllm_choice(&two, 1, &shape).expect("choice 1");
    assert_eq!((t1.num_tokens(), t1.experts(1, 0)), (2, Some(vec![5, 6])));
    let t0 = vllm::decode_vllm_choice(&two, 0, &shape).expect("choice 0");
    assert_eq!((t0.num_tokens(), t0.experts(0, 0)), (1, Some(vec![1, 2])));
    let err = vllm::decode_vllm_choice(&two, 2, &shape).expect_err("no choice 2");
    assert!(
        err.to_string()
            .contains("choice 2 asked for; `choices` holds 2"),
        "{err}"
    );
    // One choice, in `outputs` too, needs no index; a bare payload is choice 0 only.
    let one = json!({"outputs": [{"routed_experts": npy_b64(&[1, 2], 1, 1, 2)}]}).to_string();
    assert_eq!(
        vllm::decode_vllm_payload(&one, &shape)
            .expect("one")
            .num_tokens(),
        1
    );
    let bare = npy_b64(&[1, 2], 1, 1, 2);
    assert_eq!(
        vllm::decode_vllm_choice(&bare, 0, &shape)
            .expect("bare")
            .num_tokens(),
        1
    );
    let err = vllm::decode_vllm_choice(&bare, 1, &shape).expect_err("bare choice 1");
    assert!(err.to_string().contains("choice 1 asked for"), "{err}");
}

#[test]
fn an_empty_sglang_reply_at_the_prompts_end_is_zero_rows() {
    // SGLang: start_len may be the whole prompt (7 tokens); with nothing generated the
    // capture is max(0, 7 + 0 - 1 - 7) = 0 rows, the payload the empty string.
    let shape = WireShape::new(1, 2, 8).with_start_len(7);
    let reply =
        json!({"meta_info": {"routed_experts": "", "prompt_tokens": 7, "completion_tokens": 0}});
    let t = sglang::decode_sglang_response(&reply, &shape).expect("empty reply");
    assert_eq!((t.num_tokens(), t.start_pos()), (0, 7));
    let bare = sglang::decode_sglang("", WireDtype::I32, &shape).expect("bare");
    assert_eq!(t, bare);
    // A start past the sequence is still refused, as is a row count the counts do not give.
    let past = WireShape::new(1, 2, 8).with_start_len(8);
    sglang::decode_sglang_response(&reply, &past).expect_err("start past the sequence");
    let two_tokens =
        json!({"meta_info": {"routed_experts": "", "prompt_tokens": 7, "completion_tokens": 2}});
    let err = sglang::decode_sglang_response(&two_tokens, &shape).expect_err("0 rows of 1");
    assert!(err.to_string().contains("completion_tokens 2"), "{err}");
}
