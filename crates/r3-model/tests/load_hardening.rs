//! Loading hardening: config values that cannot be right are refused with the key named,
//! sizes above `ConfigLimits` are refused before anything is built from them, non-finite
//! weights are refused with the tensor named (and loaded when the caller allows them), and a
//! safetensors file whose header disagrees with its bytes is a clear error.

mod common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::{tiny_config, tiny_json, tiny_weights, FAMILIES};
use r3_model::{check_finite, Config, LoadOptions, ModelError, Weights};
use r3_test_support::Scratch;
use serde_json::{json, Value};

fn with(family: &str, key: &str, value: Value) -> Value {
    let mut v = tiny_json(family);
    v[key] = value;
    v
}

/// (family, key set, value, text the error must contain: the key it names).
fn refused_configs() -> Vec<(&'static str, &'static str, Value, &'static str)> {
    vec![
        // sizes above the limits (item 6): refused before a layout or a tensor list is built
        (
            "qwen3_moe",
            "num_hidden_layers",
            json!(1_000_000_000u64),
            "num_hidden_layers",
        ),
        ("qwen3_moe", "vocab_size", json!(1u64 << 40), "vocab_size"),
        ("qwen3_moe", "hidden_size", json!(1u64 << 40), "hidden_size"),
        (
            "qwen3_moe",
            "intermediate_size",
            json!(1u64 << 40),
            "intermediate_size",
        ),
        (
            "qwen3_moe",
            "num_attention_heads",
            json!(1u64 << 40),
            "num_attention_heads",
        ),
        ("qwen3_moe", "num_experts", json!(1u64 << 40), "num_experts"),
        (
            "qwen3_moe",
            "num_experts_per_tok",
            json!(1u64 << 20),
            "num_experts_per_tok",
        ),
        (
            "qwen3_moe",
            "max_position_embeddings",
            json!(1u64 << 40),
            "max_position_embeddings",
        ),
        (
            "deepseek_v3",
            "kv_lora_rank",
            json!(1u64 << 40),
            "kv_lora_rank",
        ),
        // values (item 10)
        (
            "qwen3_moe",
            "max_position_embeddings",
            json!(0),
            "max_position_embeddings",
        ),
        ("qwen3_moe", "eos_token_id", json!(32), "eos_token_id"),
        ("qwen3_moe", "eos_token_id", json!([2, 99]), "eos_token_id"),
        ("qwen3_moe", "eos_token_id", json!(-3), "eos_token_id"),
        ("qwen3_moe", "rms_norm_eps", json!(0.0), "rms_norm_eps"),
        ("qwen3_moe", "rms_norm_eps", json!(-1e-6), "rms_norm_eps"),
        ("qwen3_moe", "rope_theta", json!(0.0), "rope_theta"),
        ("qwen3_moe", "rope_theta", json!(-10000.0), "rope_theta"),
        ("qwen3_moe", "head_dim", json!(0), "head_dim"),
        (
            "qwen3_moe",
            "num_key_value_heads",
            json!(3),
            "num_key_value_heads",
        ),
        (
            "qwen3_moe",
            "num_key_value_heads",
            json!(0),
            "num_key_value_heads",
        ),
        (
            "qwen3_moe",
            "num_experts_per_tok",
            json!(7),
            "num_experts_per_tok",
        ),
        (
            "qwen3_moe",
            "num_experts_per_tok",
            json!(0),
            "num_experts_per_tok",
        ),
        ("mixtral", "hidden_size", json!(18), "hidden_size"),
        (
            "qwen3_moe",
            "rope_scaling",
            json!({"rope_type": "linear", "factor": 0.0}),
            "rope_scaling.factor",
        ),
        (
            "qwen3_moe",
            "rope_scaling",
            json!({"rope_type": "linear", "factor": -2.0}),
            "rope_scaling.factor",
        ),
        (
            "deepseek_v3",
            "rope_scaling",
            json!({"type": "yarn", "factor": 0.0, "original_max_position_embeddings": 16}),
            "rope_scaling.factor",
        ),
        (
            "deepseek_v3",
            "rope_scaling",
            json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}),
            "rope_scaling.original_max_position_embeddings",
        ),
        (
            "deepseek_v3",
            "rope_scaling",
            json!({"type": "yarn", "factor": 4.0, "beta_fast": -1.0}),
            "rope_scaling.beta_fast",
        ),
        ("deepseek_v3", "n_group", json!(3), "n_group"),
        ("deepseek_v3", "topk_group", json!(5), "topk_group"),
        (
            "deepseek_v3",
            "routed_scaling_factor",
            json!(0.0),
            "routed_scaling_factor",
        ),
        ("olmoe", "clip_qkv", json!(0.0), "clip_qkv"),
        ("mixtral", "sliding_window", json!(0), "sliding_window"),
    ]
}

#[test]
fn each_bad_config_value_is_refused_naming_its_key() {
    for (family, key, value, named) in refused_configs() {
        let doc = with(family, key, value.clone());
        match Config::from_value(doc) {
            Ok(_) => panic!("{family}: `{key}` = {value} was accepted"),
            Err(e) => assert!(
                e.to_string().contains(named),
                "{family}: `{key}` = {value}: error does not name `{named}`: {e}"
            ),
        }
    }
}

#[test]
fn too_many_expert_blocks_are_refused_before_the_tensor_list_is_built() {
    // 4096 layers of 65536 experts: every single size is within its limit, the product is not.
    let mut doc = with("deepseek_v3", "num_hidden_layers", json!(4096));
    doc["n_routed_experts"] = json!(65536);
    let err = Config::from_value(doc).expect_err("2^28 expert blocks");
    assert!(
        matches!(err, ModelError::ConfigTooLarge { key, .. } if key.contains("MoE layers")),
        "{err}"
    );
}

#[test]
fn valid_configs_still_load() {
    for family in FAMILIES {
        tiny_config(family);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dirs = [
        root.join("tests/fixtures/qwen3_moe_tiny"),
        root.join("tests/fixtures/deepseek_v3_tiny"),
        root.join("../../models/arith-moe"),
    ];
    for dir in dirs {
        Config::from_file(&dir.join("config.json"))
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    }
    // Values HF accepts with at most a warning stay accepted.
    let mut doc = with(
        "deepseek_v3",
        "rope_scaling",
        json!({"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 16}),
    );
    doc["eos_token_id"] = json!([1, 2]);
    Config::from_value(doc).expect("yarn factor below 1 and an eos list");
}

/// Saves `weights` with the tensor `name` replaced by `tensor`.
fn save_with(dir: &Path, cfg: &Config, weights: &Weights, name: &str, tensor: Tensor) {
    let mut map = weights.tensors().clone();
    map.insert(name.to_string(), tensor);
    Weights::from_map(map).save(dir, cfg).expect("save");
}

#[test]
fn non_finite_weights_are_refused_naming_the_tensor_unless_allowed() {
    let cfg = tiny_config("qwen3_moe");
    let name = "model.layers.2.mlp.experts.4.down_proj.weight";
    for (dtype, bad) in [
        (DType::F32, f32::NAN),
        (DType::F16, f32::INFINITY),
        (DType::BF16, f32::NEG_INFINITY),
    ] {
        let weights = tiny_weights(&cfg, 5, dtype);
        let original = weights.get(name).expect("tensor");
        let mut values = original
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("values");
        let index = values.len() - 3;
        values[index] = bad;
        let poisoned = Tensor::from_vec(values, original.dims(), &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .expect("poisoned");
        let dir = Scratch::new(&format!("model-load-nan-{dtype:?}"));
        save_with(&dir, &cfg, &weights, name, poisoned);

        match Weights::load(&dir, &cfg, &Device::Cpu) {
            Err(ModelError::NonFiniteWeight {
                tensor,
                index: at,
                value,
            }) => {
                assert_eq!(tensor, name);
                assert_eq!(at, index);
                assert_eq!(value.is_nan(), bad.is_nan(), "{value}");
                if !bad.is_nan() {
                    assert_eq!(value, f64::from(bad));
                }
            }
            other => panic!("{dtype:?}: expected NonFiniteWeight, got {other:?}"),
        }
        let allowed = LoadOptions {
            allow_non_finite: true,
            ..LoadOptions::default()
        };
        let loaded = Weights::load_with(&dir, &cfg, &Device::Cpu, &allowed).expect("allowed");
        let back = loaded
            .get(name)
            .and_then(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?))
            .expect("values");
        assert_eq!(back[index].is_nan(), bad.is_nan());
        assert_eq!(back[index].is_infinite(), bad.is_infinite());
    }
}

#[test]
fn check_finite_scans_every_element_across_chunks() {
    // Larger than one scan chunk, with the bad value in the last chunk; a strided view too.
    let n = (1 << 16) * 3 + 7;
    let mut values = vec![0.5f32; n];
    values[n - 2] = f32::NAN;
    values[(1 << 16) + 1] = 1e30; // finite: accepted
    let t = Tensor::from_vec(values, (n,), &Device::Cpu).expect("tensor");
    match check_finite("big", &t) {
        Err(ModelError::NonFiniteWeight { tensor, index, .. }) => {
            assert_eq!((tensor.as_str(), index), ("big", n - 2))
        }
        other => panic!("expected NonFiniteWeight, got {other:?}"),
    }
    let grid =
        Tensor::from_vec(vec![1f32, 2.0, f32::INFINITY, 4.0], (2, 2), &Device::Cpu).expect("grid");
    // The transpose puts the inf (row 1, column 0) at flat index 1 of the transposed view.
    match check_finite("grid.T", &grid.t().expect("transpose")) {
        Err(ModelError::NonFiniteWeight { index, .. }) => assert_eq!(index, 1),
        other => panic!("expected NonFiniteWeight, got {other:?}"),
    }
    let ok = Tensor::from_vec(vec![1u32, 2, 3], (3,), &Device::Cpu).expect("ints");
    check_finite("ids", &ok).expect("integers are always finite");
}

fn write_raw(path: &Path, header: &Value, data: &[u8]) {
    let text = header.to_string();
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).expect("write");
}

#[test]
fn truncated_or_lying_safetensors_files_are_clear_errors() {
    let cfg = tiny_config("olmoe");
    let dir = Scratch::new("model-load-truncated");
    tiny_weights(&cfg, 1, DType::F32)
        .save(&dir, &cfg)
        .expect("save");
    let file = dir.join("model.safetensors");
    let len = std::fs::metadata(&file).expect("meta").len();
    let bytes = std::fs::read(&file).expect("read");
    std::fs::write(&file, &bytes[..(len as usize - 100)]).expect("truncate");
    let err = Weights::load(&dir, &cfg, &Device::Cpu).expect_err("truncated");
    assert!(
        matches!(&err, ModelError::Checkpoint { msg, .. } if msg.contains("truncated")),
        "{err}"
    );

    // A header that says more than the file holds, before any tensor.
    std::fs::write(&file, &bytes[..4]).expect("4 bytes");
    let err = Weights::load(&dir, &cfg, &Device::Cpu).expect_err("4 bytes");
    assert!(err.to_string().contains("too short"), "{err}");
    let mut huge = (1u64 << 40).to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    std::fs::write(&file, huge).expect("huge header length");
    let err = Weights::load(&dir, &cfg, &Device::Cpu).expect_err("2^40 header");
    assert!(err.to_string().contains("header length"), "{err}");

    // A tensor whose byte range disagrees with its dtype x shape, and one that overflows.
    let header = json!({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}});
    write_raw(&file, &header, &[0u8; 8]);
    let err = Weights::load(&dir, &cfg, &Device::Cpu).expect_err("short tensor");
    assert!(err.to_string().contains("needs 16 bytes"), "{err}");
    let header =
        json!({"w": {"dtype": "F32", "shape": [1u64 << 40, 1u64 << 40], "data_offsets": [0, 8]}});
    write_raw(&file, &header, &[0u8; 8]);
    let err = Weights::load(&dir, &cfg, &Device::Cpu).expect_err("overflowing shape");
    assert!(err.to_string().contains("overflows"), "{err}");
}
