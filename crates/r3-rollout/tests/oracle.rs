//! The engine against the HF transformers oracle: f32 logits and routed expert sets for the
//! fixed input, greedy generation with the KV cache, and (printed) f16 agreement — for the two
//! fixtures of this crate and the other families' (Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 with
//! YaRN, dense Qwen3 / Qwen2 / Llama) kept in r3-model's fixture folder.

mod common;

use common::{full_forward_any, ids, oracle_model_dir, oracle_of, FAMILY_MODELS, MODELS};
use r3_model::Config;
use r3_rollout::model::InferenceModel;
use r3_rollout::{load_dir, Dtype, Engine, EngineConfig, GenerateRequest, SamplingParams};

/// One full-sequence forward of the oracle input through the engine's model: logits, routes
/// (`None` where the model captured none: a dense one), MoE layers and top-k.
fn forward_all(name: &str, dtype: Dtype) -> (Vec<f32>, Option<Vec<u16>>, usize, usize) {
    let dir = oracle_model_dir(name);
    let cfg = Config::from_file(&dir.join("config.json")).unwrap();
    let tensors = load_dir(&dir, &cfg).unwrap();
    let mut model = InferenceModel::new(cfg, &tensors, dtype).unwrap();
    let input = ids(&oracle_of(name)["input_ids"][0]);
    let (logits, routes) = full_forward_any(&mut model, &input);
    let (cols, k) = model.route_shape();
    (logits, routes, cols, k)
}

/// Every oracle fixture: this crate's two, then the other families'.
fn all_models() -> impl Iterator<Item = &'static str> {
    MODELS.into_iter().chain(FAMILY_MODELS)
}

/// An engine without prefix cache over any oracle fixture.
fn oracle_engine(name: &str, dtype: Dtype) -> Engine {
    let cfg = EngineConfig {
        dtype,
        prefix_cache: false,
        kv_cache_bytes: 64 << 20,
        ..EngineConfig::default()
    };
    Engine::from_dir(&oracle_model_dir(name), cfg).expect("engine loads fixture")
}

#[test]
fn f32_logits_and_expert_sets_match_hf() {
    for name in all_models() {
        let o = oracle_of(name);
        let input = ids(&o["input_ids"][0]);
        let (logits, routes, cols, k) = forward_all(name, Dtype::F32);
        let want: Vec<f32> = o[name]["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
            })
            .collect();
        assert_eq!(logits.len(), want.len());
        let max_diff = logits
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("{name}: f32 max |logit - HF| = {max_diff:.2e}");
        assert!(max_diff < 1e-4, "{name}: logits differ by {max_diff}");
        let layers = o[name]["moe_layers"].as_object().unwrap();
        let mut layer_ids: Vec<usize> = layers.keys().map(|k| k.parse().unwrap()).collect();
        layer_ids.sort();
        assert_eq!(layer_ids.len(), cols, "{name}: MoE layers");
        if cols == 0 {
            // A dense model: nothing routed, nothing captured.
            assert!(
                routes.as_ref().is_none_or(|r| r.is_empty()),
                "{name}: routes of a dense model"
            );
            continue;
        }
        let routes = routes.expect("routes captured");
        assert_eq!(routes.len(), input.len() * cols * k, "{name}: route cells");
        for (c, layer) in layer_ids.iter().enumerate() {
            let sets = layers[&layer.to_string()]["topk_idx_sorted"]
                .as_array()
                .unwrap();
            for (tok, want_set) in sets.iter().enumerate() {
                let mut got: Vec<u32> = routes[(tok * cols + c) * k..][..k]
                    .iter()
                    .map(|&v| v as u32)
                    .collect();
                got.sort();
                assert_eq!(got, ids(want_set), "{name} layer {layer} token {tok}");
            }
        }
    }
}

#[test]
fn f32_greedy_generation_reproduces_hf() {
    for name in all_models() {
        let o = oracle_of(name);
        let g = &o[name]["greedy"];
        let prompt = ids(&g["prompt"]);
        let want = ids(&g["output_ids"]);
        let new = want.len() - prompt.len();
        let mut e = oracle_engine(name, Dtype::F32);
        let r = e
            .generate(vec![GenerateRequest::new(
                prompt.clone(),
                SamplingParams::greedy(new),
            )])
            .unwrap();
        assert_eq!(r[0].output_ids, want[prompt.len()..], "{name}");
        assert_eq!(r[0].output_logprobs.len(), new);
        assert!(r[0]
            .output_logprobs
            .iter()
            .all(|lp| lp.is_finite() && *lp <= 0.0));
        let dense = o[name]["moe_layers"].as_object().unwrap().is_empty();
        match &r[0].routes {
            Some(routes) => assert_eq!(
                routes.num_tokens(),
                want.len() - 1,
                "{name}: prompt + generated - 1 rows"
            ),
            None => assert!(dense, "{name}: a MoE model returned no routes"),
        }
    }
}

#[test]
fn f16_agreement_with_hf_is_measured() {
    for name in all_models() {
        let o = oracle_of(name);
        let (l16, r16, cols, k) = forward_all(name, Dtype::F16);
        let (l32, r32, _, _) = forward_all(name, Dtype::F32);
        let (r16, r32) = (r16.unwrap_or_default(), r32.unwrap_or_default());
        let max_diff = l16
            .iter()
            .zip(&l32)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let cells = r16.len() / k.max(1);
        let same_sets = (0..cells)
            .filter(|c| {
                let mut a = r16[c * k..(c + 1) * k].to_vec();
                let mut b = r32[c * k..(c + 1) * k].to_vec();
                a.sort();
                b.sort();
                a == b
            })
            .count();
        let g = &o[name]["greedy"];
        let prompt = ids(&g["prompt"]);
        let want = ids(&g["output_ids"]);
        let mut e = oracle_engine(name, Dtype::F16);
        let r = e
            .generate(vec![GenerateRequest::new(
                prompt.clone(),
                SamplingParams::greedy(want.len() - prompt.len()),
            )])
            .unwrap();
        let agree = r[0]
            .output_ids
            .iter()
            .zip(&want[prompt.len()..])
            .take_while(|(a, b)| a == b)
            .count();
        println!(
            "{name}: f16 vs f32 max |logit diff| = {max_diff:.3e}; routers with same expert set: \
             {same_sets}/{cells} ({cols} layers); greedy tokens agreeing with HF before first divergence: {agree}/{}",
            want.len() - prompt.len()
        );
        // Loose sanity bounds: f16 is close, not equal.
        assert!(
            max_diff < 0.1,
            "{name}: f16 logits far from f32 ({max_diff})"
        );
        assert!(
            same_sets * 10 >= cells * 8,
            "{name}: fewer than 80% of routers agree"
        );
    }
}
