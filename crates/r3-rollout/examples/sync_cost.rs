//! Where a weight sync's time goes on `r3 bench step`'s mid-size config (240 M parameters,
//! seeded random weights, experts fused as the trainer hands them over): the range scan,
//! copying the tensors out of candle as f32, the f16 pack by each packing kernel, and building
//! the engine weights per dtype.
//! `cargo run --release -p r3-rollout --example sync_cost`

use std::time::Instant;

use candle_core::{DType, Device};
use r3_model::{check_map_holds, presets, RandomInit, Weights};
use r3_rollout::kernels::packed_f16::{HalfKind, PackedF16, PanelKernel, StackedRows};
use r3_rollout::model::tensors::F32Values;
use r3_rollout::model::weights::ModelWeights;
use r3_rollout::{Dtype, Engine, EngineConfig, RouterDtype, TensorMap};

fn best_of<T>(reps: usize, mut f: impl FnMut() -> T) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            let out = f();
            let s = t.elapsed().as_secs_f64();
            drop(out);
            s
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cfg = presets::mid_size_bench_config()?;
    let map: TensorMap = Weights::random(&cfg, &RandomInit::new(7), &Device::Cpu)?
        .fuse_experts(&cfg)?
        .into_map();
    let params: usize = map.values().map(|t| t.elem_count()).sum();
    println!("mid config: {params} parameters, {} tensors", map.len());
    let reps = 3;
    for precision in [Dtype::F32, Dtype::F16] {
        let s = best_of(reps, || {
            check_map_holds(&map, precision.weight_precision()).map_err(|e| e.to_string())
        });
        println!("range scan ({precision}):           {s:.3} s");
    }
    let s = best_of(reps, || {
        map.values()
            .map(|t| {
                t.to_dtype(DType::F32)
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1::<f32>())
                    .map(|v| v.len())
            })
            .collect::<Result<Vec<_>, _>>()
    });
    println!("copy out as f32 (serial):      {s:.3} s");
    // Every matrix (rank ≥ 2, as [rows, last dim]) repacked to f16 in place by each kernel:
    // the pack alone, without the walk over the layers around it.
    let values = map
        .values()
        .filter(|t| t.rank() >= 2)
        .map(|t| Ok((F32Values::of(t)?, t.dims().last().copied().unwrap_or(0))))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let mut packs: Vec<PackedF16> = values
        .iter()
        .map(|(v, k)| PackedF16::pack_as(HalfKind::F16, v, v.len() / k, *k))
        .collect();
    // Every kernel this CPU runs (the last is the one the engine uses).
    let detected = PanelKernel::detect();
    for kernel in PanelKernel::available() {
        let s = best_of(reps, || {
            for ((v, k), p) in values.iter().zip(packs.iter_mut()) {
                let block = [&**v];
                p.repack_with(kernel, &StackedRows::new(&block, *k));
            }
        });
        let used = if kernel == detected {
            ", the engine's"
        } else {
            ""
        };
        println!("f16 repack, {} kernel{used}: {s:.3} s", kernel.name());
    }
    drop(packs);
    for dtype in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
        let s = best_of(reps, || {
            ModelWeights::from_tensors_with_router(&cfg, &map, dtype, RouterDtype::Model)
                .map_err(|e| e.to_string())
        });
        println!("build engine weights ({dtype}):  {s:.3} s");
    }
    for dtype in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
        let mut weights =
            ModelWeights::from_tensors_with_router(&cfg, &map, dtype, RouterDtype::Model)?;
        let s = best_of(reps, || {
            weights
                .refill(&cfg, &map, dtype, RouterDtype::Model)
                .map_err(|e| e.to_string())
        });
        println!("refill engine weights ({dtype}): {s:.3} s");
    }
    for dtype in [Dtype::F32, Dtype::F16] {
        let engine_cfg = EngineConfig {
            dtype,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(cfg.clone(), &map, engine_cfg)?;
        let s = best_of(reps, || {
            engine.update_weights(&map).map_err(|e| e.to_string())
        });
        println!("Engine::update_weights ({dtype}): {s:.3} s");
    }
    Ok(())
}
