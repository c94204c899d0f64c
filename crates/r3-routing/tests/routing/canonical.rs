//! Canonical JSON: the documented example decodes; malformed documents give clear errors.

use r3_routing::{LayerSpace, RouteError, RouteTable};
use serde_json::json;

fn example() -> serde_json::Value {
    json!({"format": "r3-routes", "version": 1, "num_experts": 8, "top_k": 2,
           "layer_space": "moe_only", "layers": [1, 2], "start_pos": 0, "num_tokens": 2,
           "routes": [[[3, 5], [0, 7]], [null, [1, 2]]], "versions": [4, 4]})
}

#[test]
fn documented_example_decodes() {
    let t = RouteTable::from_json(&example()).unwrap();
    assert_eq!(
        (t.num_tokens(), t.top_k(), t.space()),
        (2, 2, LayerSpace::MoeOnly)
    );
    assert_eq!(t.layers(), &[1, 2]);
    assert_eq!(t.experts(0, 1), Some(vec![0, 7]));
    assert!(!t.is_present(1, 0));
    assert_eq!(t.versions(), Some(&[4u64, 4][..]));
    assert_eq!(t.to_json(), example());
}

fn with(field: &str, value: serde_json::Value) -> serde_json::Value {
    let mut v = example();
    v[field] = value;
    v
}

#[test]
fn malformed_documents() {
    let err = |v: serde_json::Value| RouteTable::from_json(&v).unwrap_err();
    assert!(matches!(
        err(with("format", json!("other"))),
        RouteError::Format { .. }
    ));
    assert!(matches!(
        err(with("version", json!(2))),
        RouteError::Format { .. }
    ));
    assert!(matches!(
        err(with("num_tokens", json!(3))),
        RouteError::Length { .. }
    ));
    assert!(matches!(
        err(with("layer_space", json!("some"))),
        RouteError::Format { .. }
    ));
    assert!(matches!(
        err(with("versions", json!([1]))),
        RouteError::Length { .. }
    ));
    assert_eq!(
        err(with("routes", json!([[[3, 9], [0, 7]], [null, [1, 2]]]))),
        RouteError::ExpertOutOfRange {
            token: 0,
            layer: 1,
            value: 9,
            num_experts: 8
        }
    );
    assert!(matches!(
        err(with("routes", json!([[[3], [0, 7]], [null, [1, 2]]]))),
        RouteError::Length { .. }
    ));
    assert!(matches!(
        err(with("routes", json!([[[3, 5]], [null, [1, 2]]]))),
        RouteError::Length { .. }
    ));
    let msg = err(with("routes", json!([[[3, 5], [0, 7]], [null, [1, 2.5]]]))).to_string();
    assert!(msg.contains("token 1") && msg.contains("layer 2"), "{msg}");
    // A wrongly typed field is named with its path in the document.
    let msg = err(with("layers", json!([1, "2"]))).to_string();
    assert!(msg.contains("layers[1]"), "{msg}");
    let msg = err(with("routes", json!([[[3, 5], [0, 7]], [null, "x"]]))).to_string();
    assert!(msg.contains("routes[1][1]"), "{msg}");
    let msg = err(with("top_k", json!(-2))).to_string();
    assert!(msg.contains("top_k"), "{msg}");
    let mut no_field = example();
    no_field.as_object_mut().unwrap().remove("top_k");
    assert!(err(no_field).to_string().contains("top_k"));
    assert!(RouteTable::from_json_str("{").is_err());
}

#[test]
fn huge_positions_are_errors_not_overflows() {
    let v = with("start_pos", json!(u64::MAX));
    assert!(matches!(
        RouteTable::from_json(&v),
        Err(RouteError::Overflow { .. })
    ));
    let shape = r3_routing::WireShape::new(1, 1, 4).with_start_len(usize::MAX);
    let payload = r3_routing::wire::vllm_json::decode_vllm_json(
        &json!({"prompt_routed_experts": [[[1]], [[2]]]}),
        &shape,
    );
    assert!(payload.is_err());
    let layout = r3_routing::LayerLayout::first_k_dense(2, 1).unwrap();
    let dense = r3_routing::WireShape::new(2, 1, 4)
        .with_start_len(usize::MAX)
        .with_layout(layout)
        .unwrap();
    let bytes = [0u8, 1, 0, 2];
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
    let r = r3_routing::wire::sglang::decode_sglang(&b64, r3_routing::WireDtype::U8, &dense);
    assert!(r.is_err());
}
