//! Config parsing against config.json documents modelled on released checkpoints
//! (values copied from their HF config.json), plus the key variants and rejections.

use r3_model::{
    Architecture, AttentionConfig, Config, ModelError, QkNorm, RopeScaling, RouterKind,
    SharedExpert,
};

const QWEN3_30B_A3B: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
  "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
  "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
  "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
  "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
}"#;

const QWEN15_MOE_A27B: &str = r#"{
  "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
  "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192,
  "max_window_layers": 21, "model_type": "qwen2_moe", "num_attention_heads": 16,
  "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.39.0.dev0", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 151936, "decoder_sparse_step": 1,
  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
  "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": false,
  "output_router_logits": false, "router_aux_loss_coef": 0.001
}"#;

const MIXTRAL_8X7B: &str = r#"{
  "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
  "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
  "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 32000
}"#;

const OLMOE_1B_7B: &str = r#"{
  "architectures": ["OlmoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "clip_qkv": null, "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048,
  "initializer_range": 0.02, "intermediate_size": 1024, "max_position_embeddings": 4096,
  "model_type": "olmoe", "norm_topk_prob": false, "num_attention_heads": 16,
  "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
  "num_key_value_heads": 16, "output_router_logits": false, "pad_token_id": 1,
  "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0,
  "router_aux_loss_coef": 0.01, "tie_word_embeddings": false, "torch_dtype": "float32",
  "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 50304
}"#;

/// DeepSeek-V3 with its yarn rope; the released file also has an fp8 `quantization_config`,
/// tested separately below.
const DEEPSEEK_V3: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
  "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
  "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
  "max_position_embeddings": 163840, "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
  "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
  "seq_aux": true, "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": true,
  "v_head_dim": 128, "vocab_size": 129280
}"#;

const MOONLIGHT_16B_A3B: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 163584,
  "eos_token_id": 163585, "ep_size": 1, "first_k_dense_replace": 1, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11264,
  "kv_lora_rank": 512, "max_position_embeddings": 8192, "model_type": "deepseek_v3",
  "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
  "n_shared_experts": 2, "norm_topk_prob": true, "num_attention_heads": 16,
  "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
  "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": null,
  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
  "rope_scaling": null, "rope_theta": 50000.0, "routed_scaling_factor": 2.446,
  "scoring_func": "sigmoid", "seq_aux": true, "tie_word_embeddings": false, "topk_group": 1,
  "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.48.0",
  "use_cache": true, "v_head_dim": 128, "vocab_size": 163840
}"#;

fn parse(text: &str) -> Config {
    match Config::from_json_str(text) {
        Ok(c) => c,
        Err(e) => panic!("config failed to parse: {e}"),
    }
}

fn with(text: &str, key: &str, value: serde_json::Value) -> String {
    let mut v: serde_json::Value = serde_json::from_str(text).expect("test json");
    v[key] = value;
    v.to_string()
}

fn without(text: &str, key: &str) -> String {
    let mut v: serde_json::Value = serde_json::from_str(text).expect("test json");
    v.as_object_mut().expect("object").remove(key);
    v.to_string()
}

#[test]
fn qwen3_30b_a3b() {
    let c = parse(QWEN3_30B_A3B);
    assert_eq!(c.architecture, Architecture::Qwen3Moe);
    let moe = c.moe.as_ref().expect("moe");
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
        (128, 8, 768)
    );
    assert_eq!(
        moe.router,
        RouterKind::Softmax {
            norm_topk_prob: true
        }
    );
    assert_eq!(moe.shared, SharedExpert::None);
    assert_eq!(
        c.layout.moe_layers(),
        (0..48).collect::<Vec<_>>().as_slice()
    );
    assert_eq!(c.rope.theta, 1e6);
    assert_eq!(c.rope.dim, 128);
    assert!(!c.rope.interleaved);
    match c.attention {
        AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            qkv_bias,
            qk_norm,
            ..
        } => {
            assert_eq!(
                (num_kv_heads, head_dim, qkv_bias, qk_norm),
                (4, 128, false, QkNorm::PerHead)
            );
        }
        _ => panic!("expected GQA"),
    }
}

#[test]
fn qwen15_moe_a27b() {
    let c = parse(QWEN15_MOE_A27B);
    assert_eq!(c.architecture, Architecture::Qwen2Moe);
    let moe = c.moe.as_ref().expect("moe");
    assert_eq!((moe.num_experts, moe.top_k), (60, 4));
    assert_eq!(
        moe.router,
        RouterKind::Softmax {
            norm_topk_prob: false
        }
    );
    assert_eq!(
        moe.shared,
        SharedExpert::Gated {
            intermediate_size: 5632
        }
    );
    match c.attention {
        AttentionConfig::Gqa {
            qkv_bias,
            qk_norm,
            sliding_window,
            head_dim,
            ..
        } => {
            assert!(qkv_bias);
            assert_eq!(qk_norm, QkNorm::None);
            // use_sliding_window = false: the window key is ignored, as in HF.
            assert_eq!(sliding_window, None);
            assert_eq!(head_dim, 128);
        }
        _ => panic!("expected GQA"),
    }
    assert_eq!(c.layout.moe_layers().len(), 24);
}

#[test]
fn mixtral_8x7b() {
    let c = parse(MIXTRAL_8X7B);
    assert_eq!(c.architecture, Architecture::Mixtral);
    let moe = c.moe.as_ref().expect("moe");
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
        (8, 2, 14336)
    );
    assert_eq!(
        moe.router,
        RouterKind::Softmax {
            norm_topk_prob: true
        }
    );
    assert_eq!(c.moe_prefix(), "block_sparse_moe");
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert_eq!(c.layout.moe_layers().len(), 32);
}

#[test]
fn olmoe_1b_7b() {
    let c = parse(OLMOE_1B_7B);
    assert_eq!(c.architecture, Architecture::Olmoe);
    let moe = c.moe.as_ref().expect("moe");
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
        (64, 8, 1024)
    );
    assert_eq!(
        moe.router,
        RouterKind::Softmax {
            norm_topk_prob: false
        }
    );
    match c.attention {
        AttentionConfig::Gqa {
            qk_norm, clip_qkv, ..
        } => {
            assert_eq!(qk_norm, QkNorm::Full);
            assert_eq!(clip_qkv, None);
        }
        _ => panic!("expected GQA"),
    }
    let clipped = parse(&with(OLMOE_1B_7B, "clip_qkv", 8.0.into()));
    assert!(
        matches!(clipped.attention, AttentionConfig::Gqa { clip_qkv: Some(c), .. } if c == 8.0)
    );
}

#[test]
fn deepseek_v3() {
    let c = parse(DEEPSEEK_V3);
    assert_eq!(c.architecture, Architecture::DeepseekV3);
    let moe = c.moe.as_ref().expect("moe");
    assert_eq!((moe.num_experts, moe.top_k), (256, 8));
    assert_eq!(
        moe.router,
        RouterKind::GroupedSigmoid {
            n_group: 8,
            topk_group: 4,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5
        }
    );
    assert_eq!(
        moe.shared,
        SharedExpert::Plain {
            intermediate_size: 2048
        }
    );
    assert_eq!(
        c.layout.moe_layers(),
        (3..61).collect::<Vec<_>>().as_slice()
    );
    assert!(c.rope.interleaved, "HF defaults rope_interleave to true");
    assert_eq!(c.rope.dim, 64);
    assert!(
        matches!(c.rope.scaling, RopeScaling::Yarn { factor, original_max_position_embeddings: 4096, .. } if factor == 40.0)
    );
    assert!(matches!(
        c.attention,
        AttentionConfig::Mla {
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            ..
        }
    ));
}

#[test]
fn moonlight_16b_a3b() {
    let c = parse(MOONLIGHT_16B_A3B);
    let moe = c.moe.as_ref().expect("moe");
    assert_eq!((moe.num_experts, moe.top_k), (64, 6));
    assert_eq!(
        moe.shared,
        SharedExpert::Plain {
            intermediate_size: 2 * 1408
        }
    );
    assert!(matches!(
        moe.router,
        RouterKind::GroupedSigmoid {
            n_group: 1,
            topk_group: 1,
            ..
        }
    ));
    assert!(matches!(
        c.attention,
        AttentionConfig::Mla {
            q_lora_rank: None,
            ..
        }
    ));
    assert_eq!(c.rope.theta, 50000.0);
    assert_eq!(c.rope.scaling, RopeScaling::None);
    assert_eq!(
        c.layout.moe_layers(),
        (1..27).collect::<Vec<_>>().as_slice()
    );
}

#[test]
fn transformers5_key_variants() {
    // num_local_experts + rope_parameters, as transformers 5 writes a Qwen3-MoE config.
    let t5 = with(
        &without(&without(QWEN3_30B_A3B, "num_experts"), "rope_theta"),
        "num_local_experts",
        128.into(),
    );
    let t5 = with(
        &t5,
        "rope_parameters",
        serde_json::json!({"rope_theta": 5e5, "rope_type": "default"}),
    );
    let c = parse(&t5);
    assert_eq!(c.num_experts(), 128);
    assert_eq!(c.rope.theta, 5e5);
    let yarn = with(
        &t5,
        "rope_parameters",
        serde_json::json!({"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    );
    assert!(matches!(parse(&yarn).rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 4.0));
}

#[test]
fn layer_rules_pick_dense_layers() {
    let c = parse(&with(
        QWEN3_30B_A3B,
        "mlp_only_layers",
        serde_json::json!([0, 5]),
    ));
    assert!(!c.is_moe_layer(0) && !c.is_moe_layer(5) && c.is_moe_layer(1));
    let c = parse(&with(QWEN3_30B_A3B, "decoder_sparse_step", 2.into()));
    assert_eq!(&c.layout.moe_layers()[..3], &[1, 3, 5]);
    let c = parse(&with(DEEPSEEK_V3, "moe_layer_freq", 2.into()));
    assert_eq!(&c.layout.moe_layers()[..3], &[4, 6, 8]);
    // A dense model is a valid config.
    let dense = parse(&with(QWEN3_30B_A3B, "num_experts", 0.into()));
    assert!(dense.moe.is_none());
    assert!(dense.layout.moe_layers().is_empty());
}

fn rejects(text: &str, needle: &str) {
    match Config::from_json_str(text) {
        Ok(_) => panic!("expected an error naming `{needle}`"),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains(needle),
                "error `{msg}` does not name `{needle}`"
            );
        }
    }
}

#[test]
fn unsupported_options_are_named() {
    rejects(
        &with(QWEN3_30B_A3B, "model_type", "gpt_oss".into()),
        "gpt_oss",
    );
    rejects(
        &with(QWEN3_30B_A3B, "hidden_act", "gelu".into()),
        "hidden_act",
    );
    rejects(
        &with(DEEPSEEK_V3, "scoring_func", "softmax".into()),
        "scoring_func",
    );
    rejects(
        &with(DEEPSEEK_V3, "topk_method", "group_limited_greedy".into()),
        "topk_method",
    );
    rejects(
        &with(
            DEEPSEEK_V3,
            "quantization_config",
            serde_json::json!({"quant_method": "fp8"}),
        ),
        "quantization_config",
    );
    rejects(
        &with(
            QWEN3_30B_A3B,
            "rope_scaling",
            serde_json::json!({"rope_type": "longrope", "factor": 2.0}),
        ),
        "longrope",
    );
    rejects(
        &with(QWEN15_MOE_A27B, "use_sliding_window", true.into()),
        "use_sliding_window",
    );
    rejects(
        &with(MIXTRAL_8X7B, "router_jitter_noise", 0.1.into()),
        "router_jitter_noise",
    );
    rejects(
        &without(MIXTRAL_8X7B, "num_local_experts"),
        "num_local_experts",
    );
    rejects(
        &with(QWEN3_30B_A3B, "num_local_experts", 64.into()),
        "conflicts",
    );
    // Left out, it is HF's default 2.5 (`hf_v5_parity.rs`); an explicit null is no value.
    rejects(
        &with(
            DEEPSEEK_V3,
            "routed_scaling_factor",
            serde_json::Value::Null,
        ),
        "routed_scaling_factor",
    );
    rejects(
        &with(QWEN3_30B_A3B, "mlp_only_layers", serde_json::json!([99])),
        "99",
    );
    assert!(matches!(
        Config::from_json_str(&with(QWEN3_30B_A3B, "model_type", "bert".into())),
        Err(ModelError::UnsupportedModelType(_))
    ));
}
