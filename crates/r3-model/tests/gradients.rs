//! Gradients of the training forward: every trainable tensor receives one, and autograd
//! agrees with central finite differences (f64) in native and replayed routing, router
//! weights included.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{covering_tables, sequences, sorted_vars, tiny_config, tiny_weights, FAMILIES};
use r3_model::{Batch, Config, Model, ReplayRoutes, Routing};
use r3_routing::{LayerSpace, RouteTable};

/// A fixed random projection of the logits (zero on padding) so the loss touches every output.
fn probe(cfg: &Config, lengths: &[usize], dtype: DType) -> Tensor {
    let t = *lengths.iter().max().expect("lengths");
    let v = cfg.vocab_size;
    let mut data = Vec::with_capacity(lengths.len() * t * v);
    for (b, &len) in lengths.iter().enumerate() {
        for i in 0..t {
            for j in 0..v {
                let x = ((b * 31 + i * 17 + j * 7) % 23) as f64 / 23.0 - 0.5;
                data.push(if i < len { x } else { 0.0 });
            }
        }
    }
    Tensor::from_vec(data, (lengths.len(), t, v), &Device::Cpu)
        .expect("probe")
        .to_dtype(dtype)
        .expect("dtype")
}

fn loss(model: &Model, batch: &Batch, routing: Routing<'_>, probe: &Tensor) -> Tensor {
    let out = model.forward(batch, routing).expect("forward");
    (out.logits * probe).expect("mul").sum_all().expect("sum")
}

#[test]
fn every_parameter_receives_a_gradient() {
    for family in FAMILIES {
        let cfg = tiny_config(family);
        let (varmap, weights) = tiny_weights(&cfg, 5, DType::F32)
            .into_trainable(&cfg)
            .expect("trainable");
        let model = Model::new(&cfg, &weights).expect("model");
        let lengths = [6, 4];
        let batch =
            Batch::new(&sequences(&lengths, cfg.vocab_size, 3), 0, &Device::Cpu).expect("batch");
        let tables;
        let routing = if cfg.moe.is_some() {
            tables =
                ReplayRoutes::new(covering_tables(&cfg, &lengths), &cfg.layout).expect("covered");
            Routing::Replay(&tables)
        } else {
            Routing::Native
        };
        let l = loss(&model, &batch, routing, &probe(&cfg, &lengths, DType::F32));
        let grads = l.backward().expect("backward");
        let trainable = r3_model::tensor_specs_in(&cfg, r3_model::ExpertLayout::Fused)
            .iter()
            .filter(|s| s.role.is_trainable())
            .count();
        let all = sorted_vars(varmap.data());
        assert_eq!(
            all.len(),
            trainable,
            "{family}: every trainable tensor is a Var"
        );
        for (name, var) in all {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{family}: no gradient for {name}"));
            // Fused expert tensors hold one block per expert: the covering routes send rows
            // to every expert, so every block must receive a gradient of its own.
            let blocks = if name.contains(".experts.") {
                (0..g.dim(0).expect("experts"))
                    .map(|j| g.get(j).expect("block"))
                    .collect()
            } else {
                vec![g.clone()]
            };
            for (j, block) in blocks.iter().enumerate() {
                let norm = block
                    .abs()
                    .expect("abs")
                    .max_all()
                    .expect("max")
                    .to_scalar::<f32>()
                    .expect("scalar");
                assert!(
                    norm > 0.0 && norm.is_finite(),
                    "{family}: gradient of {name} (block {j}) is {norm}"
                );
            }
        }
    }
}

/// Central-difference check of selected coordinates of selected tensors.
fn finite_difference_check(family: &str, replay: bool) {
    let cfg = tiny_config(family);
    let (varmap, weights) = tiny_weights(&cfg, 21, DType::F64)
        .into_trainable(&cfg)
        .expect("trainable");
    let model = Model::new(&cfg, &weights).expect("model");
    let lengths = [5, 3];
    let batch =
        Batch::new(&sequences(&lengths, cfg.vocab_size, 9), 0, &Device::Cpu).expect("batch");
    let probe = probe(&cfg, &lengths, DType::F64);
    let native = model
        .forward(&batch, Routing::Record)
        .expect("record")
        .routes
        .expect("routes");
    // Replay something other than the native choice: every id shifted by one.
    let shifted: Vec<RouteTable> = native
        .iter()
        .map(|t| {
            let cols: Vec<Vec<u32>> = (0..t.num_columns())
                .map(|c| {
                    t.column_ids(c)
                        .expect("ids")
                        .iter()
                        .map(|&i| (i + 1) % cfg.num_experts() as u32)
                        .collect()
                })
                .collect();
            RouteTable::from_columns(
                t.num_experts(),
                t.top_k(),
                LayerSpace::MoeOnly,
                t.layers().to_vec(),
                0,
                &cols,
            )
            .expect("shifted")
        })
        .collect();
    let shifted = ReplayRoutes::new(shifted, &cfg.layout).expect("covered");
    let routing = if replay {
        Routing::Replay(&shifted)
    } else {
        Routing::Native
    };
    let grads = loss(&model, &batch, routing, &probe)
        .backward()
        .expect("backward");

    let moe_layer = cfg.layout.moe_layers()[0];
    // An expert that this routing actually uses (unused experts have no gradient).
    let first = native[0].column_ids(0).expect("ids")[0];
    let used = if replay {
        (first + 1) % cfg.num_experts() as u32
    } else {
        first
    };
    let mut names = vec![
        format!("model.layers.{moe_layer}.mlp.gate.weight"),
        format!("model.layers.{moe_layer}.mlp.experts.gate_up_proj"),
        format!("model.layers.{moe_layer}.mlp.experts.down_proj"),
        format!("model.layers.{moe_layer}.post_attention_layernorm.weight"),
        "model.layers.0.self_attn.o_proj.weight".to_string(),
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".to_string(),
        "lm_head.weight".to_string(),
    ];
    if family == "deepseek_v3" {
        names.push("model.layers.1.self_attn.q_a_proj.weight".into());
        names.push("model.layers.1.self_attn.kv_b_proj.weight".into());
        names.push("model.layers.1.mlp.shared_experts.up_proj.weight".into());
    } else {
        names.push("model.layers.2.self_attn.q_proj.weight".into());
        names.push("model.layers.2.self_attn.k_norm.weight".into());
    }
    let all = sorted_vars(varmap.data());
    let h = 1e-6;
    let mut checked = 0;
    for name in &names {
        let var = &all
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no var {name}"))
            .1;
        let base = var
            .as_tensor()
            .flatten_all()
            .expect("flat")
            .to_vec1::<f64>()
            .expect("vec");
        let grad = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("no grad {name}"));
        let grad = grad
            .flatten_all()
            .expect("flat")
            .to_vec1::<f64>()
            .expect("vec");
        // In a fused expert tensor, probe the block of the expert this routing uses (its
        // first, a middle and its last element: gate and up rows, or down rows).
        let (from, len) = if name.contains(".experts.") {
            let block = base.len() / cfg.num_experts();
            (used as usize * block, block)
        } else {
            (0, base.len())
        };
        let picks = [from, from + len / 3, from + len - 1];
        for &i in &picks {
            let eval = |delta: f64| {
                let mut p = base.clone();
                p[i] += delta;
                var.set(&Tensor::from_vec(p, var.as_tensor().shape(), &Device::Cpu).expect("t"))
                    .expect("set");
                let l = loss(&model, &batch, routing, &probe)
                    .to_scalar::<f64>()
                    .expect("scalar");
                if !replay {
                    let routes = model
                        .forward(&batch, Routing::Record)
                        .expect("record")
                        .routes
                        .expect("routes");
                    assert_eq!(
                        routes, native,
                        "{family}: perturbing {name}[{i}] flipped the native routing"
                    );
                }
                l
            };
            let fd = (eval(h) - eval(-h)) / (2.0 * h);
            var.set(
                &Tensor::from_vec(base.clone(), var.as_tensor().shape(), &Device::Cpu).expect("t"),
            )
            .expect("reset");
            let ad = grad[i];
            let tol = 1e-7 + 1e-5 * fd.abs().max(ad.abs());
            assert!(
                (fd - ad).abs() <= tol,
                "{family} replay={replay}: d/d {name}[{i}]: autograd {ad}, finite difference {fd}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, names.len() * 3);
}

#[test]
fn finite_differences_qwen3_moe_native() {
    finite_difference_check("qwen3_moe", false);
}

#[test]
fn finite_differences_qwen3_moe_replay() {
    finite_difference_check("qwen3_moe", true);
}

#[test]
fn finite_differences_deepseek_v3_native() {
    finite_difference_check("deepseek_v3", false);
}

#[test]
fn finite_differences_deepseek_v3_replay() {
    finite_difference_check("deepseek_v3", true);
}
