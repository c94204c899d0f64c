//! The bf16 rollout engine against an independent reference that rounds at the same points:
//! r3-model's training forward with `Precision::Bf16` (candle ops, bf16 casts at every
//! boundary the engine rounds at). Both fixture families (Qwen3-MoE GQA + softmax router,
//! DeepSeek-V3 MLA + grouped sigmoid router), both router precisions.
//!
//! Tolerance: the two implementations accumulate in f32 in different orders (fused vs
//! separate projections, panel kernels vs gemm), so an f32 value lying within an f32 ulp of a
//! bf16 rounding boundary can round to neighbouring bf16 values (one bf16 ulp, 2^-8
//! relative) and carry on. The test requires the engine to be far closer to the bf16
//! reference than to the f32 forward (at least 4x in max |Δlogit|), the same greedy
//! continuation, and routers equal except for a small fraction of such ties.

mod common;

use candle_core::Device;
use common::{full_forward, model_dir, MODELS};
use r3_model::{Batch, Config, Model, Precision, Routing, Weights};
use r3_rollout::model::InferenceModel;
use r3_rollout::SamplingParams;
use r3_rollout::{load_dir, Dtype, Engine, EngineConfig, GenerateRequest, RouterDtype};

fn tokens(i: u32, len: u32) -> Vec<u32> {
    (0..len).map(|j| (j * 37 + i * 53 + 11) % 250 + 3).collect()
}

/// Logits `[t, vocab]` of the training forward at `precision` and its recorded routes.
fn reference(model: &Model, seq: &[u32]) -> (Vec<f32>, Vec<Vec<u16>>) {
    let batch = Batch::new(&[seq.to_vec()], 0, &Device::Cpu).expect("batch");
    let out = model.forward(&batch, Routing::Record).expect("forward");
    let logits = out
        .logits
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("logits");
    let table = &out.routes.expect("routes")[0];
    let mut routes = Vec::new();
    for tok in 0..table.num_tokens() {
        for col in 0..table.num_columns() {
            let mut e = table.experts(tok, col).expect("cell");
            e.sort();
            routes.push(e);
        }
    }
    (logits, routes)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn bf16_engine_matches_the_bf16_training_reference() {
    for name in MODELS {
        let dir = model_dir(name);
        let cfg = Config::from_file(&dir.join("config.json")).expect("config");
        let weights = Weights::load(&dir, &cfg, &Device::Cpu).expect("weights");
        let tensors = load_dir(&dir, &cfg).expect("tensors");
        let f32_model = Model::new(&cfg, &weights).expect("f32 model");
        for (router, router_f32) in [(RouterDtype::Model, false), (RouterDtype::F32, true)] {
            let precision = Precision::Bf16 { router_f32 };
            let ref_model = Model::with_precision(&cfg, &weights, precision).expect("model");
            let mut engine_model =
                InferenceModel::with_router(cfg.clone(), &tensors, Dtype::Bf16, router)
                    .expect("engine model");
            let (mut to_ref, mut to_f32) = (0f32, 0f32);
            let (mut cells, mut differ) = (0usize, 0usize);
            for i in 0..3 {
                let seq = tokens(i, 9 + 6 * i);
                let (logits, routes) = full_forward(&mut engine_model, &seq);
                let (want, want_routes) = reference(&ref_model, &seq);
                let (full, _) = reference(&f32_model, &seq);
                to_ref = to_ref.max(max_abs_diff(&logits, &want));
                to_f32 = to_f32.max(max_abs_diff(&logits, &full));
                let k = cfg.top_k();
                for (got, want) in routes.chunks_exact(k).zip(&want_routes) {
                    let mut got = got.to_vec();
                    got.sort();
                    cells += 1;
                    differ += usize::from(&got != want);
                }
            }
            println!(
                "{name} router {router}: max |Δlogit| engine-bf16 vs bf16 reference {to_ref:.3e}, \
                 vs f32 forward {to_f32:.3e}; routers differing from the reference {differ}/{cells}"
            );
            assert!(
                to_ref * 4.0 <= to_f32,
                "{name} router {router}: the engine is not closer to the bf16 reference \
                 ({to_ref}) than to f32 ({to_f32})"
            );
            assert!(
                differ * 50 <= cells,
                "{name} router {router}: {differ}/{cells} routers differ from the reference"
            );
        }
    }
}

#[test]
fn bf16_greedy_generation_equals_the_reference_greedy_continuation() {
    for name in MODELS {
        let dir = model_dir(name);
        let cfg = Config::from_file(&dir.join("config.json")).expect("config");
        let weights = Weights::load(&dir, &cfg, &Device::Cpu).expect("weights");
        let ref_model =
            Model::with_precision(&cfg, &weights, Precision::Bf16 { router_f32: false })
                .expect("model");
        let ecfg = EngineConfig {
            dtype: Dtype::Bf16,
            prefix_cache: false,
            kv_cache_bytes: 64 << 20,
            ..EngineConfig::default()
        };
        let mut engine = Engine::from_dir(&dir, ecfg).expect("engine");
        for i in 0..2 {
            let prompt = tokens(i + 7, 8 + 3 * i);
            let params = SamplingParams {
                temperature: 0.0,
                max_new_tokens: 8,
                ..Default::default()
            };
            let got = engine
                .generate(vec![GenerateRequest::new(prompt.clone(), params)])
                .expect("generate")
                .remove(0)
                .output_ids;
            // The reference's greedy continuation: one full forward per new token.
            let mut seq = prompt.clone();
            let vocab = cfg.vocab_size;
            for _ in 0..got.len() {
                let (logits, _) = reference(&ref_model, &seq);
                let last = &logits[(seq.len() - 1) * vocab..seq.len() * vocab];
                seq.push(argmax(last));
            }
            assert_eq!(got, seq[prompt.len()..], "{name} prompt {i}");
        }
    }
}
