//! RoutingConfig from the routing keys of HF config.json documents of several families.

use r3_routing::RoutingConfig;
use serde_json::json;

fn moe_layers(v: serde_json::Value) -> (Vec<usize>, usize, usize) {
    let c = RoutingConfig::from_hf_config(&v).unwrap();
    let layout = c.layout().unwrap();
    (layout.moe_layers().to_vec(), c.rules.num_experts, c.top_k)
}

#[test]
fn families() {
    let deepseek = json!({"model_type": "deepseek_v3", "num_hidden_layers": 6,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "first_k_dense_replace": 2,
        "moe_layer_freq": 1});
    assert_eq!(moe_layers(deepseek), (vec![2, 3, 4, 5], 16, 4));
    let qwen = json!({"model_type": "qwen2_moe", "num_hidden_layers": 6, "num_experts": 8,
        "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3]});
    assert_eq!(moe_layers(qwen), (vec![1, 5], 8, 2));
    let mixtral = json!({"num_hidden_layers": 3, "num_local_experts": 8,
        "num_experts_per_tok": 2});
    assert_eq!(moe_layers(mixtral), (vec![0, 1, 2], 8, 2));
    let nested = json!({"model_type": "qwen3_vl_moe", "text_config": {
        "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 1}});
    assert_eq!(moe_layers(nested), (vec![0, 1], 4, 1));
}

/// A DeepSeek-V3 config.json leaving out its routing keys is HF `DeepseekV3Config`'s default
/// model (transformers v5: 61 layers, the first 3 dense, 256 experts, 8 per token), as
/// r3-model parses it; the keys are family defaults, so another family still needs them.
#[test]
fn a_deepseek_v3_config_without_its_routing_keys_takes_hfs_defaults() {
    let (moe, experts, top_k) = moe_layers(json!({"model_type": "deepseek_v3"}));
    assert_eq!(moe, (3..61).collect::<Vec<_>>());
    assert_eq!((experts, top_k), (256, 8));
    // One key left out, the others given.
    let no_dense_key = json!({"model_type": "deepseek_v3", "num_hidden_layers": 6,
        "n_routed_experts": 16, "num_experts_per_tok": 4});
    assert_eq!(moe_layers(no_dense_key), (vec![3, 4, 5], 16, 4));
    // A null is not left out (HF keeps the None and cannot build the model): an error
    // naming the key, as r3-model's parser gives.
    for key in [
        "num_experts_per_tok",
        "first_k_dense_replace",
        "n_routed_experts",
        "num_hidden_layers",
    ] {
        let mut null = json!({"model_type": "deepseek_v3"});
        null[key] = serde_json::Value::Null;
        let err = RoutingConfig::from_hf_config(&null)
            .unwrap_err()
            .to_string();
        assert!(err.contains(key) && err.contains("null"), "{key}: {err}");
    }
    let qwen = json!({"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8});
    let err = RoutingConfig::from_hf_config(&qwen)
        .unwrap_err()
        .to_string();
    assert!(err.contains("num_experts_per_tok"), "{err}");
}

#[test]
fn errors_name_the_key() {
    let dense = json!({"num_hidden_layers": 4, "num_experts_per_tok": 2});
    let e = RoutingConfig::from_hf_config(&dense)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no routed experts"), "{e}");
    let wrong = json!({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "first_k_dense_replace": "two"});
    let e = RoutingConfig::from_hf_config(&wrong)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("first_k_dense_replace") && e.contains("\"two\""),
        "{e}"
    );
    let out = json!({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "mlp_only_layers": [9]});
    let e = RoutingConfig::from_hf_config(&out)
        .unwrap()
        .layout()
        .unwrap_err()
        .to_string();
    assert!(e.contains("9"), "{e}");
    assert!(RoutingConfig::from_hf_config_str("{").is_err());
}

/// Llama-4 as HF `Llama4TextConfig` reads it: `moe_layers` when given, else
/// `list(range(interleave_moe_layer_step - 1, num_hidden_layers, interleave_moe_layer_step))`.
#[test]
fn llama4_interleaved_and_explicit_moe_layers() {
    // Maverick's text config: 48 layers, every second one MoE, 128 experts, top-1.
    let maverick = json!({"model_type": "llama4", "text_config": {"num_hidden_layers": 48,
        "num_local_experts": 128, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2}});
    let every_second: Vec<usize> = (1..48).step_by(2).collect();
    assert_eq!(moe_layers(maverick), (every_second, 128, 1));
    // Scout: step 1, every layer.
    let scout = json!({"num_hidden_layers": 4, "num_local_experts": 16,
        "num_experts_per_tok": 1, "interleave_moe_layer_step": 1});
    assert_eq!(moe_layers(scout), (vec![0, 1, 2, 3], 16, 1));
    let step3 = json!({"num_hidden_layers": 7, "num_local_experts": 4,
        "num_experts_per_tok": 1, "interleave_moe_layer_step": 3});
    assert_eq!(moe_layers(step3), (vec![2, 5], 4, 1));
    // An explicit list wins over the step.
    let explicit = json!({"num_hidden_layers": 6, "num_local_experts": 4,
        "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "moe_layers": [0, 4]});
    assert_eq!(moe_layers(explicit), (vec![0, 4], 4, 1));
}

#[test]
fn llama4_keys_are_checked() {
    let err = |v: serde_json::Value| RoutingConfig::from_hf_config(&v).unwrap_err().to_string();
    let base = |extra: serde_json::Value| {
        let mut v = json!({"num_hidden_layers": 4, "num_local_experts": 4,
            "num_experts_per_tok": 1});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    let e = err(base(json!({"interleave_moe_layer_step": 0})));
    assert!(e.contains("interleave_moe_layer_step"), "{e}");
    let e = err(base(
        json!({"interleave_moe_layer_step": 2, "decoder_sparse_step": 3}),
    ));
    assert!(
        e.contains("interleave_moe_layer_step") && e.contains("decoder_sparse_step"),
        "{e}"
    );
    let e = err(base(json!({"moe_layers": [1, 4]})));
    assert!(e.contains("moe_layers") && e.contains('4'), "{e}");
    let e = err(base(json!({"moe_layers": 2})));
    assert!(e.contains("moe_layers"), "{e}");
}
