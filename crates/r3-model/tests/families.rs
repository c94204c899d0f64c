//! Forward smoke tests for every family with random weights: padding invariance,
//! record → replay equivalence, the tokens−1 convention, and replay input errors.

mod common;

use std::time::Duration;

use candle_core::{Device, IndexOp};
use common::{sequences, tiny_model, FAMILIES};
use r3_model::{Batch, Config, ModelError, ReplayRoutes, Routing};
use r3_routing::{LayerSpace, RouteTable};

fn max_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f32 {
    (a - b)
        .expect("sub")
        .abs()
        .expect("abs")
        .flatten_all()
        .expect("flat")
        .max(0)
        .expect("max")
        .to_scalar::<f32>()
        .expect("scalar")
}

/// A forward of detached weights (the trainer's old-policy pass) against a training forward
/// of the same weights as variables, on every family: the same routes and the same logits
/// bit for bit (both weigh the gates by the same ops; only the rollout engine's steps weigh
/// them on the host), so the first mini-step's ratio is exactly 1.
#[test]
fn a_frozen_forward_gives_the_training_forwards_bits() {
    for family in FAMILIES {
        let cfg = common::tiny_config(family);
        let weights = common::tiny_weights(&cfg, 5, candle_core::DType::F32);
        let frozen = r3_model::Model::new(&cfg, &weights).expect("model");
        let (_vars, trainable) = weights.into_trainable(&cfg).expect("variables");
        let training = r3_model::Model::new(&cfg, &trainable).expect("trainable model");
        let seqs = sequences(&[9, 4], cfg.vocab_size, 2);
        let batch = Batch::new(&seqs, 0, &Device::Cpu).expect("batch");
        let routing = match cfg.moe {
            Some(_) => Routing::Record,
            None => Routing::Native,
        };
        let a = frozen.forward(&batch, routing).expect("frozen");
        let b = training.forward(&batch, routing).expect("training");
        assert!(
            !a.logits.track_op() && b.logits.track_op(),
            "{family}: the two paths"
        );
        assert_eq!(max_diff(&a.logits, &b.logits), 0.0, "{family}: logits");
        assert_eq!(a.routes, b.routes, "{family}: routes");
    }
}

#[test]
fn padded_batch_equals_single_sequences() {
    for family in FAMILIES {
        let (cfg, model) = tiny_model(family, 7);
        let seqs = sequences(&[7, 4, 1], cfg.vocab_size, 1);
        let batch = Batch::new(&seqs, 0, &Device::Cpu).expect("batch");
        let out = model.forward(&batch, Routing::Native).expect("forward");
        assert_eq!(out.logits.dims(), &[3, 7, cfg.vocab_size]);
        for (b, seq) in seqs.iter().enumerate() {
            let single = Batch::new(std::slice::from_ref(seq), 0, &Device::Cpu).expect("batch");
            let alone = model.forward(&single, Routing::Native).expect("forward");
            let batched = out.logits.i((b, ..seq.len())).expect("slice");
            let d = max_diff(&batched, &alone.logits.i(0).expect("row"));
            assert!(
                d < 1e-5,
                "{family}: sequence {b} differs by {d} when batched"
            );
        }
    }
}

#[test]
fn replaying_recorded_routes_reproduces_native() {
    for family in FAMILIES {
        let (cfg, model) = tiny_model(family, 11);
        let seqs = sequences(&[6, 3], cfg.vocab_size, 2);
        let batch = Batch::new(&seqs, 0, &Device::Cpu).expect("batch");
        if cfg.moe.is_none() {
            let err = model
                .forward(&batch, Routing::Record)
                .expect_err("dense record");
            assert!(err.to_string().contains("dense"), "{err}");
            continue;
        }
        let rec = model.forward(&batch, Routing::Record).expect("record");
        let native = model.forward(&batch, Routing::Native).expect("native");
        // the overhead timer covers only the work Record / Replay add
        assert_eq!(native.routing_overhead, Duration::ZERO, "{family}");
        assert!(rec.routing_overhead > Duration::ZERO, "{family}");
        let tables = rec.routes.expect("routes");
        assert_eq!(tables.len(), 2);
        for (t, seq) in tables.iter().zip(&seqs) {
            assert_eq!(t.num_tokens(), seq.len());
            assert_eq!(t.layers(), cfg.layout.moe_layers());
            assert_eq!(t.space(), LayerSpace::MoeOnly);
        }
        let rep = model
            .forward(&batch, Routing::Replay(&covered(&tables, &cfg)))
            .expect("replay");
        assert_eq!(max_diff(&rep.logits, &rec.logits), 0.0, "{family}");
        assert_eq!(max_diff(&native.logits, &rec.logits), 0.0, "{family}");
        assert!(rep.routing_overhead > Duration::ZERO, "{family}");
        let proof = rep.replay.expect("proof");
        let moe = cfg.layout.moe_layers().len();
        assert_eq!(proof.replayed_cells, vec![9; moe], "{family}");
        assert_eq!(proof.differs_from_native, vec![0; moe], "{family}");
        assert_eq!(proof.native_final_position, vec![false, false]);
        // A native or recording layer waits for its router's choice; a replay forcing every
        // row counts its divergence where the logits are and waits in no layer (every
        // family's routers select on the device, DeepSeek-V3's grouped ones included).
        assert_eq!(native.routing_waits.layers, moe, "{family}: native waits");
        assert_eq!(rec.routing_waits.layers, moe, "{family}: record waits");
        assert_eq!(rep.routing_waits.layers, 0, "{family}: replay waits");
        assert_eq!(rep.routing_waits.time, Duration::ZERO, "{family}");

        // Rollout convention: tokens − 1 rows, final position native and reported.
        let short: Vec<RouteTable> = tables
            .iter()
            .map(|t| t.slice_rows(0, t.num_tokens() - 1).expect("slice"))
            .collect();
        let rep = model
            .forward(&batch, Routing::Replay(&covered(&short, &cfg)))
            .expect("replay short");
        assert_eq!(max_diff(&rep.logits, &rec.logits), 0.0, "{family}");
        let proof = rep.replay.expect("proof");
        assert_eq!(proof.native_final_position, vec![true, true]);
        assert_eq!(proof.native_cells, vec![2; moe]);
        // Rows left to the router: every layer waits for its choice.
        assert_eq!(
            rep.routing_waits.layers, moe,
            "{family}: short replay waits"
        );
        assert_eq!(proof.replayed_cells, vec![7; moe]);

        // All-layer tables (as SGLang / vLLM send them) are converted, checked, replayed.
        let all: Vec<RouteTable> = tables
            .iter()
            .map(|t| t.to_all_layers(&cfg.layout).expect("to all layers"))
            .collect();
        let rep = model
            .forward(&batch, Routing::Replay(&covered(&all, &cfg)))
            .expect("replay all-layer");
        assert_eq!(max_diff(&rep.logits, &rec.logits), 0.0, "{family}");
    }
}

fn replay_error(family: &str, make: impl Fn(&RouteTable) -> Vec<RouteTable>) -> ModelError {
    let (cfg, model) = tiny_model(family, 3);
    let seqs = sequences(&[5], cfg.vocab_size, 4);
    let batch = Batch::new(&seqs, 0, &Device::Cpu).expect("batch");
    let rec = model.forward(&batch, Routing::Record).expect("record");
    let tables = make(&rec.routes.expect("routes")[0]);
    // A table with a missing cell is refused when the replay input is built.
    let routes = match ReplayRoutes::new(tables, &cfg.layout) {
        Ok(routes) => routes,
        Err(e) => return e,
    };
    match model.forward(&batch, Routing::Replay(&routes)) {
        Ok(_) => panic!("replay of a bad table succeeded"),
        Err(e) => e,
    }
}

#[test]
fn replay_rejects_tables_that_do_not_fit() {
    // Too few rows.
    let e = replay_error("qwen3_moe", |t| vec![t.slice_rows(0, 3).expect("slice")]);
    assert!(e.to_string().contains("3 rows"), "{e}");
    // Wrong number of tables.
    let e = replay_error("qwen3_moe", |t| vec![t.clone(), t.clone()]);
    assert!(e.to_string().contains("2 route tables"), "{e}");
    // Rows that do not start at position 0.
    let e = replay_error("qwen3_moe", |t| vec![t.slice_rows(1, 5).expect("slice")]);
    assert!(e.to_string().contains("position 1"), "{e}");
    // Wrong top-k / expert count.
    let e = replay_error("qwen3_moe", |t| {
        let cols: Vec<Vec<u32>> = (0..t.num_columns())
            .map(|c| {
                t.column_ids(c)
                    .expect("ids")
                    .iter()
                    .step_by(2)
                    .copied()
                    .collect()
            })
            .collect();
        vec![
            RouteTable::from_columns(6, 1, LayerSpace::MoeOnly, t.layers().to_vec(), 0, &cols)
                .expect("k=1"),
        ]
    });
    assert!(e.to_string().contains("top-1"), "{e}");
    // Wrong layers: layer 1 of the tiny Qwen3-MoE is dense (mlp_only_layers = [1]).
    let e = replay_error("qwen3_moe", |t| {
        assert_eq!(t.layers(), &[0, 2]);
        let cols: Vec<Vec<u32>> = (0..t.num_columns())
            .map(|c| t.column_ids(c).expect("ids"))
            .collect();
        vec![
            RouteTable::from_columns(6, 2, LayerSpace::MoeOnly, vec![0, 1], 0, &cols)
                .expect("table"),
        ]
    });
    assert!(e.to_string().contains("[0, 1]"), "{e}");
    // A missing cell is an error, never a silent native fallback.
    let e = replay_error("deepseek_v3", |t| {
        let (n, c, k) = (t.num_tokens(), t.num_columns(), t.top_k());
        let mut flat = Vec::with_capacity(n * c * k);
        for tok in 0..n {
            for col in 0..c {
                let cell = t.experts(tok, col).expect("cell");
                let missing = tok == 2 && col == 0;
                flat.extend(
                    cell.iter()
                        .map(|&x| if missing { -1 } else { i64::from(x) }),
                );
            }
        }
        vec![RouteTable::from_flat(
            t.num_experts(),
            k,
            LayerSpace::MoeOnly,
            t.layers().to_vec(),
            0,
            &flat,
        )
        .expect("flat")]
    });
    assert!(e.to_string().contains("sequence 0"), "{e}");
    assert!(e.to_string().contains("row 2"), "{e}");
}

#[test]
fn bad_tokens_are_named() {
    let (cfg, model) = tiny_model("mixtral", 1);
    let batch =
        Batch::new(&[vec![1, 2, cfg.vocab_size as u32 + 3]], 0, &Device::Cpu).expect("batch");
    let err = model
        .forward(&batch, Routing::Native)
        .expect_err("out-of-vocab token");
    assert!(err.to_string().contains("position 2"), "{err}");
    assert!(Batch::new(&[vec![]], 0, &Device::Cpu).is_err());
}

/// The tables as replay input (recorded tables have a route in every cell).
fn covered(tables: &[RouteTable], cfg: &Config) -> ReplayRoutes {
    ReplayRoutes::new(tables.to_vec(), &cfg.layout).expect("every MoE cell routed")
}

/// An inference model whose weight matrices are stored in the 16-bit float
/// (`Weights::narrow_matrices`) computes what the f32-weight model at that precision does:
/// logits bit for bit and the same routes, in every family, in bf16 and f16, with an f32 and
/// a 16-bit router; it holds the matrices in the narrow dtype (embedding and norms in f32).
#[test]
fn narrow_weight_copies_compute_what_the_f32_weights_do() {
    use candle_core::DType;
    use r3_model::{Model, Precision};
    for family in FAMILIES {
        let cfg = common::tiny_config(family);
        let weights = common::tiny_weights(&cfg, 5, DType::F32)
            .fuse_experts(&cfg)
            .expect("fuse");
        let seqs = sequences(&[6, 4], cfg.vocab_size, 3);
        let batch = Batch::new(&seqs, 0, &Device::Cpu).expect("batch");
        for precision in [
            Precision::Bf16 { router_f32: false },
            Precision::Bf16 { router_f32: true },
            Precision::F16 { router_f32: true },
        ] {
            let narrow = precision.narrow_dtype().expect("16-bit");
            let router_narrow = precision.router().narrow_dtype().is_some();
            let narrowed = weights
                .clone()
                .narrow_matrices(&cfg, narrow, router_narrow)
                .expect("narrow");
            let dtypes: Vec<DType> = narrowed.tensors().values().map(|t| t.dtype()).collect();
            assert!(dtypes.contains(&narrow), "{family}: nothing narrowed");
            assert_eq!(
                narrowed
                    .get("model.embed_tokens.weight")
                    .expect("embed")
                    .dtype(),
                DType::F32
            );
            let f32_model = Model::with_precision(&cfg, &weights, precision).expect("model");
            let narrow_model = Model::with_precision(&cfg, &narrowed, precision).expect("model");
            // A dense family has no routes to record.
            let routing = if cfg.moe.is_some() {
                Routing::Record
            } else {
                Routing::Native
            };
            let a = f32_model.forward(&batch, routing).expect("f32 weights");
            let b = narrow_model
                .forward(&batch, routing)
                .expect("narrow weights");
            assert_eq!(
                max_diff(&a.logits, &b.logits),
                0.0,
                "{family} {precision:?}"
            );
            assert_eq!(a.routes, b.routes, "{family} {precision:?} routes");
        }
    }
}

/// Seeded weights of `cfg` held for training in bf16 (`Weights::narrow_for_training`), and
/// the same values widened to f32 (f32 masters holding exactly what the bf16 ones do).
fn held_in_bf16_and_widened(
    cfg: &r3_model::Config,
    seed: u64,
) -> (r3_model::Weights, r3_model::Weights) {
    use candle_core::DType;
    let narrowed = common::tiny_weights(cfg, seed, DType::F32)
        .fuse_experts(cfg)
        .and_then(|w| w.narrow_for_training(cfg, DType::BF16, true))
        .expect("narrow");
    let widened = r3_model::Weights::from_map(
        narrowed
            .tensors()
            .iter()
            .map(|(k, t)| (k.clone(), t.to_dtype(DType::F32).expect("widen")))
            .collect(),
    );
    (narrowed, widened)
}

/// One bf16 forward and backward of `weights` made trainable: the logits' bits and, per
/// variable (by name), its dtype and its gradient's bits widened to f32.
#[allow(clippy::type_complexity)]
fn bf16_step(
    cfg: &r3_model::Config,
    weights: r3_model::Weights,
    batch: &Batch,
    lengths: &[usize],
) -> (Vec<u32>, Vec<(String, candle_core::DType, Vec<u32>)>) {
    use r3_model::{Model, Precision};
    let (varmap, weights) = weights.into_trainable(cfg).expect("trainable");
    let precision = Precision::Bf16 { router_f32: false };
    let model = Model::with_precision(cfg, &weights, precision).expect("model");
    let logits = model
        .forward(batch, Routing::Native)
        .expect("forward")
        .logits;
    let grads = (&logits * common::probe(lengths, cfg.vocab_size, &Device::Cpu))
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    let data = varmap.data().lock().expect("lock");
    let mut named: Vec<_> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let grads = named
        .iter()
        .filter_map(|(name, v)| {
            let g = grads.get(v.as_tensor())?;
            Some((name.clone(), v.dtype(), r3_test_support::bits(g)))
        })
        .collect();
    (r3_test_support::bits(&logits), grads)
}

/// Weights held in bf16 as trainable variables (a trainer's `train.master_weights =
/// "bf16"`, `Weights::narrow_for_training`) train as f32 master weights holding the same
/// values: in every family the logits and every matrix's gradient are the same bits (the
/// 16-bit GEMMs read the variables as they are, and hand their gradients back in bf16, which
/// the f32 masters' gradients are exactly in a bf16 forward); the embedding's gradient is the
/// f32 masters' rounded to bf16.
#[test]
fn bf16_matrices_as_variables_train_as_f32_masters_of_their_values() {
    use candle_core::DType;
    use r3_model::Weights;
    for family in FAMILIES {
        let cfg = common::tiny_config(family);
        let (narrowed, widened) = held_in_bf16_and_widened(&cfg, 5);
        let lengths = [6, 4];
        let seqs = sequences(&lengths, cfg.vocab_size, 3);
        let batch = Batch::new(&seqs, 0, &Device::Cpu).expect("batch");
        let run = |weights: Weights| bf16_step(&cfg, weights, &batch, &lengths);
        let (wide_logits, wide_grads) = run(widened);
        let (narrow_logits, narrow_grads) = run(narrowed);
        assert_eq!(wide_logits, narrow_logits, "{family}: logits");
        assert_eq!(wide_grads.len(), narrow_grads.len(), "{family}");
        let mut held_narrow = 0;
        for ((name, _, a), (_, dtype, b)) in wide_grads.iter().zip(&narrow_grads) {
            if name == "model.embed_tokens.weight" {
                // The bf16 table's gradient is the f32 one (each row's f32 sum) rounded to
                // bf16 once, nearest.
                assert_eq!(
                    *dtype,
                    DType::BF16,
                    "{family}: the embedding is held in bf16"
                );
                let rounded: Vec<u32> = a
                    .iter()
                    .map(|&v| half::bf16::from_f32(f32::from_bits(v)).to_f32().to_bits())
                    .collect();
                assert!(rounded == *b, "{family}: the embedding's gradient");
            } else {
                assert!(a == b, "{family}: the gradient of {name} differs");
            }
            held_narrow += usize::from(*dtype == DType::BF16);
        }
        assert!(held_narrow > 0, "{family}: no bf16 variable");
    }
}

/// A head tied to the embedding, held in bf16: the logits are the f32 masters' bit for bit,
/// and the shared tensor's gradient (the lookup's rows plus the head's, each handed back in
/// bf16 and summed in bf16) is within two bf16 roundings of the f32 masters' sum.
#[test]
fn a_tied_head_held_in_bf16_trains() {
    use candle_core::DType;
    use r3_model::Weights;
    let mut cfg = common::tiny_config("qwen3_moe");
    cfg.tie_word_embeddings = true;
    let (narrowed, widened) = held_in_bf16_and_widened(&cfg, 9);
    let lengths = [6, 4];
    let batch = Batch::new(&sequences(&lengths, cfg.vocab_size, 5), 0, &Device::Cpu).expect("b");
    let run = |weights: Weights| {
        let (logits, grads) = bf16_step(&cfg, weights, &batch, &lengths);
        let (_, dtype, bits) = grads
            .into_iter()
            .find(|(name, _, _)| name == "model.embed_tokens.weight")
            .expect("the embedding's gradient");
        let g: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        (logits, g, dtype)
    };
    let (wide_logits, wide, wide_dtype) = run(widened);
    let (narrow_logits, narrow, narrow_dtype) = run(narrowed);
    assert_eq!((wide_dtype, narrow_dtype), (DType::F32, DType::BF16));
    assert_eq!(wide_logits, narrow_logits, "logits");
    let scale = wide.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (w, n)) in wide.iter().zip(&narrow).enumerate() {
        // Each of the two parts rounded once and their sum once: three half-steps of bf16
        // (2^-8 relative each) of the largest magnitudes involved.
        let tol = 3.0 * 2f32.powi(-8) * scale;
        assert!(
            (w - n).abs() <= tol,
            "embedding gradient {i}: {n} against {w}"
        );
    }
    assert!(scale > 0.0);
}
