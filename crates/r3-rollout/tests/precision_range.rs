//! Weights an engine's precision cannot hold are refused on every way in (load, update),
//! naming the tensor, the value and the precision, and accepted by an engine whose precision
//! holds them; a forward that turns non-finite anyway is located by a diagnostic re-run.

mod common;

use candle_core::{Device, Tensor};
use common::model_dir;
use r3_model::Config;
use r3_rollout::model::Stage;
use r3_rollout::{load_dir, Dtype, Engine, EngineConfig, GenerateRequest, SamplingParams};

const EMBED: &str = "model.embed_tokens.weight";

fn engine_config(dtype: Dtype) -> EngineConfig {
    EngineConfig {
        dtype,
        prefix_cache: false,
        kv_cache_bytes: 16 << 20,
        ..EngineConfig::default()
    }
}

/// The qwen3 fixture's config and tensors with `name` replaced by `f(tensor)`.
fn fixture_with(name: &str, f: impl Fn(&Tensor) -> Tensor) -> (Config, r3_rollout::TensorMap) {
    let dir = model_dir("qwen3_moe_tiny");
    let cfg = Config::from_file(&dir.join("config.json")).expect("config");
    let mut map = load_dir(&dir, &cfg).expect("fixture loads");
    let changed = f(&map[name]);
    map.insert(name.into(), changed);
    (cfg, map)
}

#[test]
fn weights_past_f16s_range_are_refused_by_an_f16_engine_naming_the_tensor() {
    // ±0.02–0.1 embeddings × 1e6: past 65504, finite in f32 and bf16.
    let (cfg, scaled) = fixture_with(EMBED, |t| t.affine(1e6, 0.0).expect("scale"));
    let e = Engine::new(cfg.clone(), &scaled, engine_config(Dtype::F16)).expect_err("refused");
    let text = e.to_string();
    assert!(
        text.contains(EMBED) && text.contains("outside the finite range of f16 (±65504)"),
        "{text}"
    );
    Engine::new(cfg.clone(), &scaled, engine_config(Dtype::F32)).expect("f32 holds it");
    Engine::new(cfg.clone(), &scaled, engine_config(Dtype::Bf16)).expect("bf16 holds it");

    // A weight update into a running f16 engine is refused the same way; the engine keeps
    // its weights and version and answers as before.
    let (_, original) = fixture_with(EMBED, Clone::clone);
    let mut engine = Engine::new(cfg, &original, engine_config(Dtype::F16)).expect("engine");
    let req = || {
        GenerateRequest::new(
            vec![3, 17, 42, 5],
            SamplingParams {
                max_new_tokens: 4,
                ..SamplingParams::default()
            },
        )
    };
    let before = engine.generate(vec![req()]).expect("generate").remove(0);
    let e = engine.update_weights(&scaled).expect_err("update refused");
    assert!(e.to_string().contains(EMBED), "{e}");
    let after = engine.generate(vec![req()]).expect("generate").remove(0);
    assert_eq!(after.weight_version, before.weight_version);
    assert_eq!(after.output_ids, before.output_ids);
    assert_eq!(after.output_logprobs, before.output_logprobs);
}

#[test]
fn a_non_finite_forward_is_located_at_its_first_stage() {
    // Every lm_head weight 60000: each is an f16 value, but a logit sums 60000 × hidden
    // values of the normalised state, far past 65504, so f16 logits overflow to ±inf.
    let (cfg, big_head) = fixture_with("lm_head.weight", |t| {
        Tensor::full(60000f32, t.shape(), &Device::Cpu).expect("full")
    });
    let prompt = vec![3u32, 17, 42, 5];
    let mut f16 = Engine::new(cfg.clone(), &big_head, engine_config(Dtype::F16)).expect("loads");
    assert_eq!(
        f16.locate_non_finite(&prompt).expect("diagnostic"),
        Some(Stage::LmHead)
    );
    // In f32 the same logits are finite: nothing to locate.
    let mut f32_engine = Engine::new(cfg, &big_head, engine_config(Dtype::F32)).expect("loads");
    assert_eq!(
        f32_engine.locate_non_finite(&prompt).expect("diagnostic"),
        None
    );
}

/// A sync with a range proof: a proof for a precision as narrow as the engine's is taken
/// (no scan), one for a wider precision is scanned and a value the engine cannot hold is
/// refused as on every other way in, the engine keeping its weights.
#[test]
fn a_held_update_is_scanned_where_its_proof_is_wider_than_the_engine() {
    let (cfg, original) = fixture_with(EMBED, Clone::clone);
    let (_, scaled) = fixture_with(EMBED, |t| t.affine(1e6, 0.0).expect("scale"));
    let mut engine = Engine::new(cfg, &original, engine_config(Dtype::F16)).expect("engine");
    let v0 = engine.weight_version();
    let proof = r3_model::HeldTensors::check(&scaled, r3_model::WeightPrecision::F32)
        .expect("f32 holds it");
    let e = engine.update_weights_held(proof).expect_err("refused");
    assert!(e.to_string().contains(EMBED), "{e}");
    assert_eq!(engine.weight_version(), v0);
    let held = r3_model::HeldTensors::check(&original, r3_model::WeightPrecision::F16)
        .expect("f16 holds the fixture");
    assert_eq!(engine.update_weights_held(held).expect("taken"), v0 + 1);
}
