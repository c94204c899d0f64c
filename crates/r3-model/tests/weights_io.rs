//! Checkpoint I/O: save → load round trips for every family, fused 3-D expert tensors,
//! sharded index.json checkpoints, and errors naming missing or mis-shaped tensors.

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::{sequences, tiny_config, tiny_weights, FAMILIES};
use r3_model::{Batch, Config, Model, ModelError, Routing, Weights};
use r3_test_support::Scratch;

fn logits(cfg: &Config, weights: &Weights) -> Vec<f32> {
    let model = Model::new(cfg, weights).expect("model");
    let batch = Batch::new(&sequences(&[5], cfg.vocab_size, 1), 0, &Device::Cpu).expect("batch");
    let out = model.forward(&batch, Routing::Native).expect("forward");
    out.logits
        .flatten_all()
        .expect("flat")
        .to_vec1::<f32>()
        .expect("vec")
}

fn write(path: &Path, tensors: HashMap<String, Tensor>) {
    candle_core::safetensors::save(&tensors, path).expect("write safetensors");
}

#[test]
fn save_then_load_round_trips_every_family() {
    for family in FAMILIES {
        let cfg = tiny_config(family);
        let weights = tiny_weights(&cfg, 2, DType::F32);
        let dir = Scratch::new(&format!("model-test-{family}"));
        weights.save(&dir, &cfg).expect("save");
        let cfg2 = Config::from_file(&dir.join("config.json")).expect("config back");
        let back = Weights::load(&dir, &cfg2, &Device::Cpu).expect("load back");
        assert_eq!(back.tensors().len(), weights.tensors().len(), "{family}");
        for (name, t) in weights.tensors() {
            let u = back.get(name).expect("tensor back");
            let same = t.flatten_all().expect("f").to_vec1::<f32>().expect("v")
                == u.flatten_all().expect("f").to_vec1::<f32>().expect("v");
            assert!(same, "{family}: {name} changed in the round trip");
        }
        assert_eq!(logits(&cfg, &weights), logits(&cfg2, &back), "{family}");
    }
}

#[test]
fn hf_names_are_written() {
    let cfg = tiny_config("mixtral");
    let dir = Scratch::new("model-test-names");
    tiny_weights(&cfg, 1, DType::F32)
        .save(&dir, &cfg)
        .expect("save");
    let raw =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).expect("raw");
    for name in [
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        "model.layers.2.block_sparse_moe.experts.0.w2.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "lm_head.weight",
    ] {
        assert!(raw.contains_key(name), "missing {name}");
    }
}

/// Rewrites per-expert tensors of a checkpoint into the transformers-5 fused layout.
fn fuse(
    cfg: &Config,
    weights: &Weights,
    prefix_of: impl Fn(usize) -> String,
) -> HashMap<String, Tensor> {
    let mut out: HashMap<String, Tensor> = weights.tensors().clone().into_iter().collect();
    let moe = cfg.moe.as_ref().expect("moe");
    let names = r3_model::spec::expert_names(cfg);
    for &layer in cfg.layout.moe_layers() {
        let p = format!("model.layers.{layer}.{}.experts", cfg.moe_prefix());
        let mut gate_up = Vec::new();
        let mut down = Vec::new();
        for j in 0..moe.num_experts {
            let g = out
                .remove(&format!("{p}.{j}.{}.weight", names.gate))
                .expect("gate");
            let u = out
                .remove(&format!("{p}.{j}.{}.weight", names.up))
                .expect("up");
            gate_up.push(Tensor::cat(&[g, u], 0).expect("cat"));
            down.push(
                out.remove(&format!("{p}.{j}.{}.weight", names.down))
                    .expect("down"),
            );
        }
        let fused = prefix_of(layer);
        out.insert(
            format!("{fused}.gate_up_proj"),
            Tensor::stack(&gate_up, 0).expect("stack"),
        );
        out.insert(
            format!("{fused}.down_proj"),
            Tensor::stack(&down, 0).expect("stack"),
        );
    }
    out
}

#[test]
fn fused_expert_tensors_load() {
    for family in ["qwen3_moe", "mixtral", "deepseek_v3"] {
        let cfg = tiny_config(family);
        let weights = tiny_weights(&cfg, 4, DType::F32);
        let dir = Scratch::new(&format!("model-test-fused-{family}"));
        // transformers 5 keeps fused experts under `mlp.experts` for every family.
        let mut fused = fuse(&cfg, &weights, |l| format!("model.layers.{l}.mlp.experts"));
        if family == "mixtral" {
            for &l in cfg.layout.moe_layers() {
                let t = fused
                    .remove(&format!("model.layers.{l}.block_sparse_moe.gate.weight"))
                    .expect("router");
                fused.insert(format!("model.layers.{l}.mlp.gate.weight"), t);
            }
        }
        write(&dir.join("model.safetensors"), fused);
        let back = Weights::load(&dir, &cfg, &Device::Cpu).expect("load fused");
        assert_eq!(logits(&cfg, &weights), logits(&cfg, &back), "{family}");
    }
}

#[test]
fn sharded_checkpoint_loads() {
    let cfg = tiny_config("qwen2_moe");
    let weights = tiny_weights(&cfg, 8, DType::F32);
    let dir = Scratch::new("model-test-sharded");
    let mut shards: [HashMap<String, Tensor>; 2] = [HashMap::new(), HashMap::new()];
    let mut map = serde_json::Map::new();
    for (i, (name, t)) in weights.tensors().iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i % 2 + 1);
        map.insert(name.clone(), file.into());
        shards[i % 2].insert(name.clone(), t.to_dtype(DType::BF16).expect("bf16"));
    }
    for (i, shard) in shards.into_iter().enumerate() {
        write(
            &dir.join(format!("model-0000{}-of-00002.safetensors", i + 1)),
            shard,
        );
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
    let back = Weights::load(&dir, &cfg, &Device::Cpu).expect("load sharded");
    // bf16 storage, loaded as f32.
    let t = back.get("model.embed_tokens.weight").expect("embed");
    assert_eq!(t.dtype(), DType::F32);
    let want = weights
        .get("model.embed_tokens.weight")
        .expect("embed")
        .to_dtype(DType::BF16)
        .expect("bf16");
    let diff = (t - want.to_dtype(DType::F32).expect("f32"))
        .expect("sub")
        .abs()
        .expect("abs")
        .max_all()
        .expect("max")
        .to_scalar::<f32>()
        .expect("s");
    assert_eq!(diff, 0.0);
}

#[test]
fn missing_and_misshaped_tensors_are_named() {
    let cfg = tiny_config("olmoe");
    let weights = tiny_weights(&cfg, 3, DType::F32);
    let dir = Scratch::new("model-test-bad");
    let mut map: HashMap<String, Tensor> = weights.tensors().clone().into_iter().collect();
    map.remove("model.layers.1.mlp.experts.2.up_proj.weight");
    write(&dir.join("model.safetensors"), map.clone());
    match Weights::load(&dir, &cfg, &Device::Cpu) {
        Err(ModelError::MissingTensor(name)) => {
            assert_eq!(name, "model.layers.1.mlp.experts.2.up_proj.weight")
        }
        other => panic!("expected a missing-tensor error, got {other:?}"),
    }
    map.insert(
        "model.layers.1.mlp.experts.2.up_proj.weight".into(),
        Tensor::zeros((3, 16), DType::F32, &Device::Cpu).expect("zeros"),
    );
    write(&dir.join("model.safetensors"), map);
    match Weights::load(&dir, &cfg, &Device::Cpu) {
        Err(ModelError::TensorShape {
            name,
            expected,
            got,
        }) => {
            assert_eq!(name, "model.layers.1.mlp.experts.2.up_proj.weight");
            assert_eq!((expected, got), (vec![8, 16], vec![3, 16]));
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
    let empty = Scratch::new("model-test-empty");
    let err = Weights::load(&empty, &cfg, &Device::Cpu).expect_err("no checkpoint");
    assert!(err.to_string().contains("model.safetensors"), "{err}");
}

/// Training holds experts fused; saving those weights writes HF per-expert tensors equal to
/// the originals, and fusing is invisible to the forward.
#[test]
fn trainable_fused_experts_save_as_per_expert_tensors() {
    for family in ["qwen3_moe", "mixtral", "deepseek_v3"] {
        let cfg = tiny_config(family);
        let weights = tiny_weights(&cfg, 4, DType::F32);
        let (_, trainable) = weights.clone().into_trainable(&cfg).expect("trainable");
        assert_eq!(
            trainable.expert_layout(&cfg),
            r3_model::ExpertLayout::Fused,
            "{family}"
        );
        assert_eq!(
            logits(&cfg, &weights),
            logits(&cfg, &trainable),
            "{family}: fused forward"
        );
        let dir = Scratch::new(&format!("model-test-fused-{family}"));
        trainable.save(&dir, &cfg).expect("save");
        let back = Weights::load(&dir, &cfg, &Device::Cpu).expect("load back");
        assert_eq!(back.expert_layout(&cfg), r3_model::ExpertLayout::PerExpert);
        assert_eq!(back.tensors().len(), weights.tensors().len(), "{family}");
        for (name, t) in weights.tensors() {
            let u = back.get(name).expect("tensor back");
            let same = t.flatten_all().expect("f").to_vec1::<f32>().expect("v")
                == u.flatten_all().expect("f").to_vec1::<f32>().expect("v");
            assert!(same, "{family}: {name} changed through fuse + save");
        }
        let unfused = trainable.unfuse_experts(&cfg).expect("unfuse");
        assert_eq!(
            unfused.tensors().keys().collect::<Vec<_>>(),
            weights.tensors().keys().collect::<Vec<_>>(),
            "{family}: unfused names"
        );
    }
}

/// Weights drawn by the device's generator are, on the CPU, exactly the host draws (the
/// GPU's cuRAND draws are exercised by `r3 bench train --device cuda`); a model runs on them.
#[test]
fn device_drawn_random_weights_on_the_cpu_are_the_host_draws() {
    let cfg = tiny_config("qwen3_moe");
    let init = r3_model::RandomInit::new(7);
    let a = Weights::random_on_device(&cfg, &init, &Device::Cpu).expect("device draws");
    let host = Weights::random(&cfg, &init, &Device::Cpu).expect("host draws");
    assert_eq!(a.tensors().len(), host.tensors().len());
    for (name, t) in host.tensors() {
        let va = a
            .get(name)
            .and_then(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?));
        let vh = t
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("host");
        assert_eq!(va.expect("device"), vh, "{name}");
    }
    let model = Model::new(&cfg, &a).expect("model");
    let batch = Batch::new(&sequences(&[4], cfg.vocab_size, 1), 0, &Device::Cpu).expect("batch");
    model.forward(&batch, Routing::Native).expect("forward");
}

/// Loading with `narrow_masters` holds each tensor in the dtype `NarrowMasters::dtype_of`
/// gives its role as it is read, with the values and dtypes of the whole f32 load narrowed
/// after (`Weights::narrow_for_training`), bit for bit: every family, routers narrow or
/// not, from an f32 and from a bf16 checkpoint.
#[test]
fn loading_narrowed_equals_narrowing_the_f32_load() {
    use r3_model::{LoadOptions, NarrowMasters};
    for family in FAMILIES {
        let cfg = tiny_config(family);
        for stored in [DType::F32, DType::BF16] {
            let weights = tiny_weights(&cfg, 3, DType::F32)
                .to_dtype(stored)
                .expect("stored dtype");
            let dir = Scratch::new(&format!("model-test-narrow-{family}-{stored:?}"));
            weights.save(&dir, &cfg).expect("save");
            for router in [false, true] {
                let narrow = NarrowMasters {
                    dtype: DType::BF16,
                    router,
                };
                let options = LoadOptions {
                    narrow_masters: Some(narrow),
                    ..LoadOptions::default()
                };
                let loaded = Weights::load_with(&dir, &cfg, &Device::Cpu, &options).expect("load");
                let want = Weights::load(&dir, &cfg, &Device::Cpu)
                    .and_then(|w| w.narrow_for_training(&cfg, DType::BF16, router))
                    .expect("narrowed after");
                assert_eq!(loaded.tensors().len(), want.tensors().len());
                let mut narrowed = 0;
                for (name, w) in want.tensors() {
                    let got = loaded.get(name).expect("tensor");
                    let what = format!("{family} {stored:?} router {router}: {name}");
                    assert_eq!(got.dtype(), w.dtype(), "{what}");
                    let bits = |t: &Tensor| {
                        t.to_dtype(DType::F32)
                            .and_then(|t| t.flatten_all())
                            .and_then(|t| t.to_vec1::<f32>())
                            .expect("values")
                            .iter()
                            .map(|v| v.to_bits())
                            .collect::<Vec<_>>()
                    };
                    assert_eq!(bits(got), bits(w), "{what}");
                    narrowed += usize::from(got.dtype() == DType::BF16);
                }
                assert!(narrowed > 0, "{family}: something is held in bf16");
            }
        }
    }
}
