//! Routes captured by the rollout engine during generation against the routes the training
//! forward (r3-model, `Routing::Record`) chooses for the same full sequence: equal in f32,
//! measured (printed) in f16 — the routing mismatch that R3 removes.

mod common;

use candle_core::Device;
use common::{engine, model_dir, MODELS};
use r3_model::{Batch, Config, Model, Routing, Weights};
use r3_rollout::{Dtype, GenerateRequest, SamplingParams};
use r3_routing::RouteTable;

fn sorted(t: &RouteTable, tok: usize, col: usize) -> Vec<u16> {
    let mut v = t.experts(tok, col).expect("cell present");
    v.sort();
    v
}

/// (cells compared, cells whose expert sets differ) between rollout and training routes.
fn compare(name: &str, dtype: Dtype) -> (usize, usize) {
    let dir = model_dir(name);
    let cfg = Config::from_file(&dir.join("config.json")).unwrap();
    let weights = Weights::load(&dir, &cfg, &Device::Cpu).unwrap();
    let model = Model::new(&cfg, &weights).unwrap();
    let mut e = engine(name, dtype, false);
    let reqs: Vec<GenerateRequest> = (0..3u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..(6 + 5 * i))
                .map(|j| (j * 29 + i * 71 + 5) % 250 + 3)
                .collect();
            let params = SamplingParams {
                temperature: 1.0,
                max_new_tokens: 10,
                seed: i as u64,
                ..Default::default()
            };
            GenerateRequest::new(prompt, params)
        })
        .collect();
    let results = e.generate(reqs.clone()).unwrap();
    let (mut cells, mut differ) = (0, 0);
    for (req, r) in reqs.iter().zip(&results) {
        let mut seq = req.input_ids.clone();
        seq.extend(&r.output_ids);
        let batch = Batch::new(std::slice::from_ref(&seq), 0, &Device::Cpu).unwrap();
        let out = model.forward(&batch, Routing::Record).unwrap();
        let recorded = &out.routes.unwrap()[0];
        let rollout = r.routes.as_ref().unwrap();
        assert_eq!(
            rollout.num_tokens(),
            seq.len() - 1,
            "{name}: prompt + generated - 1 rows"
        );
        assert_eq!(
            rollout.layers(),
            recorded.layers(),
            "{name}: same MoE layers (global ids)"
        );
        for tok in 0..rollout.num_tokens() {
            for col in 0..rollout.num_columns() {
                cells += 1;
                if sorted(rollout, tok, col) != sorted(recorded, tok, col) {
                    differ += 1;
                }
            }
        }
    }
    (cells, differ)
}

#[test]
fn f32_rollout_routes_equal_training_record_routes() {
    for name in MODELS {
        let (cells, differ) = compare(name, Dtype::F32);
        println!("{name} f32: {differ}/{cells} routers differ from the training forward");
        assert_eq!(differ, 0, "{name}");
    }
}

#[test]
fn f16_rollout_routes_vs_training_are_measured() {
    for name in MODELS {
        let (cells, differ) = compare(name, Dtype::F16);
        println!(
            "{name} f16: {differ}/{cells} routers ({:.2}%) differ from the f32 training forward",
            100.0 * differ as f64 / cells as f64
        );
        // Loose sanity bound: f16 noise flips few routers on these tiny models.
        assert!(
            differ * 5 <= cells,
            "{name}: more than 20% of routers differ"
        );
    }
}
